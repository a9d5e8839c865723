"""The piecewise optimizer step (megatron_offload/chunked_step.py) against the whole step, on CPU:
torch AdamW in each of its implementations and the TE FusedAdam stand-in (group step counter)."""

import random

import pytest
import torch

from megatron_offload import ChunkState, OffloadCoordinator
from megatron_offload.chunked_step import (
    complete_pieces,
    first_chunk_of,
    install_piecewise_step,
    pieces_by_last_chunk,
    step_in_pieces,
)

from fakes import FakeDistOpt, FakePrecisionAwareDistOpt, assert_bitwise_equal, make_grads, snapshot


def random_pieces(params, n, seed):
    order = list(params)
    random.Random(seed).shuffle(order)
    return [order[k::n] for k in range(n)]


def step_whole(opt):
    opt.optimizer.step()


def step_pieces(opt, n, seed):
    step_in_pieces(opt.optimizer, random_pieces(opt.all_params(), n, seed))


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_torch_adamw_in_pieces_is_bit_identical(impl, n):
    ref, opt = FakeDistOpt(), FakeDistOpt()
    for o in (ref, opt):
        group = o.optimizer.param_groups[0]
        group["foreach"], group["fused"] = impl == "foreach", impl == "fused"
    for step in range(4):
        make_grads(ref.all_params(), step)
        make_grads(opt.all_params(), step)
        step_whole(ref)
        step_pieces(opt, n, seed=step)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
        for p in opt.all_params():  # every per-parameter counter advanced exactly once
            assert float(opt.optimizer.state[p]["step"]) == step + 1


@pytest.mark.parametrize("remainders", [False, True])
def test_te_fusedadam_stand_in_in_pieces_advances_the_group_step_once(remainders):
    kw = dict(store_param_remainders=remainders, moment_dtype=torch.bfloat16 if remainders else torch.float32)
    ref, opt = FakePrecisionAwareDistOpt(**kw), FakePrecisionAwareDistOpt(**kw)
    for step in range(4):
        make_grads(ref.all_params(), step)
        make_grads(opt.all_params(), step)
        step_whole(ref)
        step_pieces(opt, 3, seed=step)
        assert opt.optimizer.param_groups[0]["step"] == ref.optimizer.param_groups[0]["step"] == step + 1
        assert_bitwise_equal(snapshot(ref), snapshot(opt))


def test_gradients_are_restored_even_when_a_piece_fails():
    opt = FakeDistOpt()
    make_grads(opt.all_params(), 0)
    grads = [p.grad for p in opt.all_params()]

    def fail(k):
        if k == 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        step_in_pieces(opt.optimizer, random_pieces(opt.all_params(), 3, 0), after_piece=fail)
    assert all(p.grad is g for p, g in zip(opt.all_params(), grads))


def test_pieces_must_cover_each_parameter_with_a_gradient_exactly_once():
    opt = FakeDistOpt()
    make_grads(opt.all_params(), 0)
    params = opt.all_params()
    with pytest.raises(AssertionError, match="in no piece"):
        step_in_pieces(opt.optimizer, [params[:-1]])
    with pytest.raises(AssertionError, match="two pieces"):
        step_in_pieces(opt.optimizer, [params, params[:1]])
    assert len(complete_pieces(opt.optimizer, [params[:-1]])) == 2


def test_pieces_by_last_chunk_step_the_packed_state_bit_identically():
    """Pieces built from the offloader's chunks (a parameter's tensors may straddle two chunks)
    cover every parameter once, and stepping them with their chunks resident is exact."""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = OffloadCoordinator(device=torch.device("cpu"), chunk_bytes=2048,
                               expected_forwards_per_iteration=lambda: 1)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    coord.forward_begin(True)
    coord.forward_end()  # everything off
    assert off.bytes_in(ChunkState.OFFLOADED) == off.bytes_in(*ChunkState) > 0
    pieces = complete_pieces(opt.optimizer, pieces_by_last_chunk(off.chunks))
    assert sorted(id(p) for piece in pieces for p in piece) == sorted(id(p) for p in opt.all_params())
    assert len(off.chunks) > 2 and sum(1 for piece in pieces if piece) > 2
    first = first_chunk_of(off.chunks)
    last = {id(p): k for k, piece in enumerate(pieces_by_last_chunk(off.chunks)) for p in piece}
    assert any(first[pid] < last[pid] for pid in last)  # some parameter straddles two chunks
    coord._suspended += 1  # the coordinator's step hooks stay out of this test
    make_grads(ref.all_params(), 0)
    make_grads(opt.all_params(), 0)
    ref.optimizer.step()
    off.start_copy_in(off.chunks_in(ChunkState.OFFLOADED))  # (the stepper's job, next)
    off.make_resident(will_modify=True)
    step_in_pieces(opt.optimizer, pieces)
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


class MegatronShapedDistOpt(FakeDistOpt):
    """FakeDistOpt with megatron-core 0.19's step structure: `step_with_ready_grads()` = inner
    step, then `_copy_main_params_to_model_params()` walking the group lists pairwise."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.model_float16_groups = [list(self.model_bf16)]
        self.model_fp32_groups = [[v.clone() for v in self.shard_fp32_groups[0]]]
        self.copies = 0

    def _copy_main_params_to_model_params(self):
        self.copies += 1
        for mains, models in ((self.shard_fp32_from_float16_groups, self.model_float16_groups),
                              (self.shard_fp32_groups, self.model_fp32_groups)):
            for gm, gmd in zip(mains, models):
                for main, model in zip(gm, gmd):
                    model.copy_(main.detach())

    def step_with_ready_grads(self):
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True


def test_installed_piecewise_step_copies_each_piece_and_skips_the_whole_copy_once():
    ref, opt = MegatronShapedDistOpt(), MegatronShapedDistOpt()
    seen = []
    uninstall = install_piecewise_step(opt, lambda: random_pieces(opt.all_params(), 3, len(seen)),
                                       after_piece=seen.append)
    for step in range(3):
        make_grads(ref.all_params(), step)
        make_grads(opt.all_params(), step)
        ref.step_with_ready_grads()
        opt.step_with_ready_grads()
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
        for a, b in zip(ref.model_float16_groups[0] + ref.model_fp32_groups[0],
                        opt.model_float16_groups[0] + opt.model_fp32_groups[0]):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    assert seen == [0, 1, 2] * 3
    assert opt.copies == 3 * 3 and ref.copies == 3  # once per piece; the whole copy skipped
    opt._copy_main_params_to_model_params()  # any other caller still gets the whole copy
    assert opt.copies == 10
    uninstall()
    make_grads(ref.all_params(), 3)
    make_grads(opt.all_params(), 3)
    ref.step_with_ready_grads()
    opt.step_with_ready_grads()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert opt.copies == 11
