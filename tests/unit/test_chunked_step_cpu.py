"""The piecewise optimizer step (megatron_offload/chunked_step.py) against the whole step, on CPU:
torch AdamW in each of its implementations and the TE FusedAdam stand-in (group step counter)."""

import random
import threading
import time

import pytest
import torch

from megatron_offload import ChunkState
from megatron_offload.chunks import Chunk
from megatron_offload.coordinator import Phase
from megatron_offload.chunked_step import (
    complete_pieces,
    first_chunk_of,
    install_piecewise_step,
    pieces_by_last_chunk,
    step_in_pieces,
)

from fakes import (FakeDistOpt, FakePrecisionAwareDistOpt, make_coordinator, assert_bitwise_equal, make_grads, resident_snapshot,
                   snapshot, step_beside, storage_bytes)


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


TE_CONFIGS = {
    "fp32-master": dict(),
    "int16-remainders-bf16-moments": dict(store_param_remainders=True, moment_dtype=torch.bfloat16),
    "fp16-moments": dict(moment_dtype=torch.float16),
}


@pytest.mark.parametrize("config", list(TE_CONFIGS))
def test_te_in_pieces_steps_each_parameter_once_and_advances_the_group_step_once(config):
    """megatron-core's precision-aware optimizer gives TE FusedAdam its gradients in
    `.decoupled_grad` (TE then ignores `.grad`): hiding only `.grad` stepped every parameter in
    every piece. TE's group counter advances at every `step()` call (each piece)."""
    ref, opt = FakePrecisionAwareDistOpt(**TE_CONFIGS[config]), FakePrecisionAwareDistOpt(**TE_CONFIGS[config])
    for step in range(4):
        for o in (ref, opt):
            make_grads(o.all_params(), step)
            o.hand_over_grads()
        ref.optimizer.step()
        step_pieces(opt, 3, seed=step)
        assert opt.optimizer.param_groups[0]["step"] == ref.optimizer.param_groups[0]["step"] == step + 1
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
        assert all(p.decoupled_grad is not None and p.grad is None for p in opt.all_params())  # restored


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
    coord = make_coordinator(device=torch.device("cpu"), chunk_bytes=2048,
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
    make_grads(ref.all_params(), 0)
    make_grads(opt.all_params(), 0)
    ref.optimizer.step()
    # Inside a state access the state is back and the coordinator's step hooks stay out.
    with coord.state_access([off], will_modify=True):
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


# ------------------------------------------------------------------------------------------------
# The coordinator's chunked step (--offload-chunked-step)
# ------------------------------------------------------------------------------------------------
MANY = (300, 1000, 64, 1024, 512, 900, 700, 1000, 256, 1024, 800, 600)


class MegatronShapedPrecisionAware(FakePrecisionAwareDistOpt):
    """The precision-aware layout with megatron-core's step structure; megatron-core's
    `_copy_main_params_to_model_params` returns at once there (TE's step writes the params)."""

    copies = 0

    def __init__(self, **kw):
        super().__init__(**kw)
        self.model_float16_groups = [list(self.shard_float16_groups[0])]
        self.model_fp32_groups = [[]]

    def _copy_main_params_to_model_params(self):
        self.copies += 1

    def step_with_ready_grads(self):
        self.hand_over_grads()
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True

    step = step_with_ready_grads


class MegatronShapedMany(MegatronShapedDistOpt):
    step = MegatronShapedDistOpt.step_with_ready_grads

    def __init__(self):
        super().__init__(bf16_numels=MANY)


CHUNKED_FACTORIES = {
    "torch-adamw": MegatronShapedMany,
    # TE FusedAdam as megatron-core's precision-aware optimizer builds it (state created at the
    # first step or up front by the offloader, gradients in `.decoupled_grad`).
    **{f"te-fusedadam-{name}": (lambda kw=kw: MegatronShapedPrecisionAware(numels=MANY, **kw))
       for name, kw in TE_CONFIGS.items()},
}


def chunked_iteration(opt, coord, step, skip=False, watch=None, level=None):
    """One iteration; `level`: a one-element list the fake allocator reads, set high at the end
    of each forward (activations) and to 0 in the backward, so that the backward's reload rule
    would bring everything back."""
    for _ in range(2):
        coord.forward_begin(True)
        coord.layer_forward_begin()
        if level is not None:
            level[0] = 10**9
        coord.forward_end()
        if watch is not None:
            watch("forward_end")
        coord.backward_begin()
        if level is not None:
            level[0] = 0
        coord.layer_backward_begin()
    if level is not None:
        level[0] = 10**9  # what the step finds: no room beyond the minimum budget
    coord.grads_finalizing()
    make_grads(opt.all_params(), step)
    if not skip:
        opt.step()
    coord.optimizer_step_done()


@pytest.mark.parametrize("name", list(CHUNKED_FACTORIES))
def test_chunked_step_is_bit_identical_and_keeps_the_step_within_its_budget(name):
    from test_offloader_cpu import make_coord

    ref, opt = CHUNKED_FACTORIES[name](), CHUNKED_FACTORIES[name]()
    level = [0]
    coord = make_coord(chunk_bytes=2048, chunked_step=True, memory_allocated=lambda: level[0],
                       max_memory_allocated=lambda: level[0], free_block_sizes=lambda: [2**40])
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    resident_in_step, freed_after_forward = [], []
    # Each piece's Adam (one inner step() call) runs with what the coordinator admitted for it.
    opt.optimizer.register_step_pre_hook(
        lambda *_: resident_in_step.append((coord.resident_bytes, coord.it.step_budget)))

    def watch(when):
        freed_after_forward.append(coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes)

    skips = {2, 5}
    for step in range(7):
        make_grads(ref.all_params(), step)
        if step not in skips:
            ref.step()
        chunked_iteration(opt, coord, step, skip=step in skips, watch=watch, level=level)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    slot = off.chunks[0].gpu_nbytes
    assert len(off.chunks) >= 6, off.chunks
    # The fake allocator reads 0 at the step: the budget is the pipeline's minimum of three chunks
    # (of the chunks at that step: TE's moments appear in the first one, and the slot grows),
    # and the backward, whose reload rule alone would bring everything back, stops there too.
    assert coord.events.count("reload_start") >= 1
    assert resident_in_step[-1][1] == (3 + coord.step_waiting[-1]) * slot
    assert all(resident <= budget for resident, budget in resident_in_step), resident_in_step
    assert max(r for r, _ in resident_in_step) < coord.gpu_bytes
    assert freed_after_forward[2:] and all(freed_after_forward[2:])
    if name.startswith("te-"):
        # One group step per optimizer step (the stand-in's group counter), none for skips.
        assert opt.optimizer.param_groups[0]["step"] == 7 - len(skips)
    else:
        assert all(float(opt.optimizer.state[p]["step"]) == 7 - len(skips) for p in opt.all_params())
    # One main-to-model copy per piece of every step that was not skipped, for every optimizer.
    assert opt.copies == (7 - len(skips)) * len(off.chunks), (opt.copies, len(off.chunks))
    coord.close()


class Embedded(MegatronShapedDistOpt):
    """One parameter (an embedding) with 3x the state of the largest other."""
    step = MegatronShapedDistOpt.step_with_ready_grads

    def __init__(self):
        super().__init__(bf16_numels=(3072,) + (1024, 512, 256) * 4)


@pytest.mark.parametrize("budget_chunks", [None, 1], ids=["automatic-budget", "one-chunk-budget"])
def test_a_parameter_split_over_chunks_leaves_only_once_it_is_stepped(budget_chunks):
    """The streamed step packs a parameter's state larger than half a chunk tensor by tensor
    (chunks.layout_chunks): here the embedding's master and moments (12 KiB each) fill three
    chunks of 12 KiB, where whole parameters would make every slot 36 KiB. Its piece comes with
    its last chunk; the chunks before it stay resident (neither copied out nor freed) until then,
    within the budget raised by them; everything stays bit-exact, skipped steps included."""
    from test_offloader_cpu import make_coord

    ref, opt = Embedded(), Embedded()
    level, resident_in_step, at_its_piece = [0], [], []
    coord = make_coord(chunk_bytes=12 * 1024, chunked_step=True, memory_allocated=lambda: level[0],
                       max_memory_allocated=lambda: level[0], free_block_sizes=lambda: [2**40])
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    if budget_chunks:
        coord.step_budget_bytes = budget_chunks * off.chunks[0].gpu_nbytes
    embedding = opt.all_params()[len(opt.shard_fp32_groups[0])]
    homes = sorted({c.index for c in off.chunks for st in c.tensors if st.param is embedding})
    assert len(homes) == 3 and off.chunks[0].gpu_nbytes == 12 * 1024, (homes, off.chunks)

    def before_each_piece(*_):
        resident_in_step.append((coord.resident_bytes, coord.it.step_budget))
        if embedding.grad is not None:  # (the embedding's piece: every other one hides its gradient)
            at_its_piece.append([(c.state, c.host_valid) for c in off.chunks if c.index in homes])
    opt.optimizer.register_step_pre_hook(before_each_piece)
    # Which chunks the step frees to make room while keeping the latest copied out: never one of
    # the group the latest piece sent out (the embedding's piece sends its three chunks at once).
    free_stepped, free, latest_freed, groups = coord._free_stepped, off.free, [], []

    def watched_free_stepped(nbytes, keep_latest=True):
        group = coord.it.stepped_out[len(coord.it.stepped_out) - coord.it.latest_out:] if keep_latest else []
        groups.append(len(group))

        def watched_free(chunks, **kw):
            latest_freed.extend(c for c in chunks if (off, c) in group)
            return free(chunks, **kw)
        off.free = watched_free
        try:
            free_stepped(nbytes, keep_latest=keep_latest)
        finally:
            off.free = free
    coord._free_stepped = watched_free_stepped
    skips, steps_done = {2}, []
    for step in range(5):
        make_grads(ref.all_params(), step)
        if step not in skips:
            ref.step()
        chunked_iteration(opt, coord, step, skip=step in skips, level=level)
        if step not in skips:
            steps_done.append(step)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    assert float(opt.optimizer.state[embedding]["step"]) == len(steps_done)
    # Once per step that ran, with all three of its chunks resident and their host copies stale.
    assert at_its_piece == [[(ChunkState.RESIDENT, False)] * 3] * len(steps_done), at_its_piece
    # Its first two chunks wait for the third in every step (the step order follows the arrival order).
    assert coord.step_waiting == [2] * len(steps_done), coord.step_waiting
    assert all(resident <= budget for resident, budget in resident_in_step), resident_in_step
    assert not latest_freed, latest_freed
    if budget_chunks:  # (the tight budget frees during the step, the group of three included)
        assert 3 in groups, groups
    coord.close()


def test_chunked_step_copies_out_during_the_step_only_what_later_pieces_need():
    """Chunks stepped once nothing else waits stay resident (their copy-out waits for the next
    forward, as the unchunked step's does); earlier ones are copied out in the step."""
    from test_offloader_cpu import make_coord

    opt = MegatronShapedMany()
    coord = make_coord(chunk_bytes=2048, chunked_step=True)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(2):
        chunked_iteration(opt, coord, step)
    states = [c.state for c in off.chunks]
    assert states.count(ChunkState.RESIDENT) >= 1
    assert states.count(ChunkState.OFFLOADED) + states.count(ChunkState.COPYING_OUT) >= len(states) - 3
    assert coord.bytes_in(ChunkState.RESIDENT, ChunkState.COPYING_OUT) <= (3 + coord.step_waiting[-1]) * off.chunks[0].gpu_nbytes
    coord.close()


def test_an_explicit_step_budget_is_used_but_never_below_one_chunk():
    from test_offloader_cpu import make_coord

    opt = MegatronShapedMany()
    coord = make_coord(chunk_bytes=2048, chunked_step=True, step_budget_bytes=1)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    ref = MegatronShapedMany()
    for step in range(3):
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step)
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    assert coord.step_budgets == [(1 + w) * off.chunks[0].gpu_nbytes for w in coord.step_waiting]
    coord.close()


@pytest.mark.parametrize("budget_chunks", [3, 4])
def test_chunked_step_frees_a_chunk_only_one_piece_after_its_copy_out(budget_chunks):
    """The pipeline of the step: a chunk's memory is freed for the next reload only after the
    following piece was enqueued, so that the compute stream never waits for the D2H it enqueued
    just before (that would serialise Adam, D2H and H2D piece by piece). Also holds with a budget
    of exactly three chunks, the minimum, and the result stays bit-identical."""
    from test_offloader_cpu import make_coord

    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    coord = make_coord(chunk_bytes=2048, chunked_step=True, step_budget_bytes=1)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    coord.step_budget_bytes = budget_chunks * off.chunks[0].gpu_nbytes
    stepped, lags, within = [], [], []
    original_free = off.free

    def piece_begins(*_):  # (an inner step() call per piece: piece k steps chunk k of the order)
        k, order = len(stepped), coord.it.step_order[id(off)]
        stepped.append(order[k] if k < len(order) else None)
        within.append(coord.resident_bytes <= coord.it.step_budget)

    def free(chunks, **kw):
        if coord.phase is Phase.STEPPING:
            for chunk in chunks:
                lags.append(len(stepped) - 1 - stepped.index(chunk))
        return original_free(chunks, **kw)

    opt.optimizer.register_step_pre_hook(piece_begins)
    off.free = free
    for step in range(3):
        stepped.clear()
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    assert lags and min(lags) >= 1, lags
    assert within and all(within)
    coord.close()


def test_chunked_step_reloads_in_the_backward_up_to_the_level_the_step_reached():
    """When the step is the iteration's peak (the forwards' activations are smaller than its
    budget: full recompute), the last backward may bring chunks back up to the level the last
    step reached, not only up to the forwards' level (which left the whole budget to load after
    the backward). The bound: never above that step level."""
    from test_offloader_cpu import make_coord

    opt = MegatronShapedMany()
    act = [0]
    base = 10**6
    coord = make_coord(chunk_bytes=2048, chunked_step=True, free_block_sizes=lambda: [2**40],
                       memory_allocated=lambda: base + coord.resident_bytes + act[0],
                       max_memory_allocated=lambda: base + coord.resident_bytes + act[0])
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    slot = off.chunks[0].gpu_nbytes
    back_in_backward, levels = [], []
    for step in range(3):
        for mb in range(2):
            coord.forward_begin(True)
            act[0] = slot // 2
            coord.layer_forward_begin()
            act[0] = slot  # the forward's end: one chunk's worth of activations
            coord.forward_end()
            coord.backward_begin()
            act[0] = slot // 2
            coord.layer_backward_begin()
            levels.append(base + coord.resident_bytes + act[0])
        act[0] = 0
        back_in_backward.append(coord.bytes_in(ChunkState.COPYING_IN, ChunkState.RESIDENT))
        coord.grads_finalizing()
        make_grads(opt.all_params(), step)
        opt.step()
        coord.optimizer_step_done()
    # Step 1: no step level known yet (forwards' level only: nothing fits beside the
    # backward's activations); then what the step held (3 chunks) bounds the backward's reloads.
    assert back_in_backward[0] == 0
    assert back_in_backward[1] > 0 and back_in_backward[2] > 0, back_in_backward
    assert max(levels) <= base + (3 + max(coord.step_waiting)) * slot, (levels, slot)
    coord.close()


def test_chunked_step_takes_the_chunks_coming_back_in_the_order_they_arrive(monkeypatch):
    """The backward reloads the latest-freed chunks first (about the reverse of their index order).
    The step takes resident chunks first, then those coming back in the order their H2D was
    enqueued (the order they land), then the rest: a step in index order would begin by waiting
    for the chunk that arrives last. Bit-identical either way."""
    from test_offloader_cpu import make_coord

    # Addresses falling with the index: the forward (highest address first) then frees the chunks in
    # index order, as the loop below assumes. Left to the CPU heap, the order depended on what earlier
    # tests had allocated (the case below then did not always occur).
    monkeypatch.setattr(Chunk, "address", property(
        lambda c: 0 if c.state is ChunkState.OFFLOADED or c.buffer is None else 2**40 - c.index))

    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    act = [0]
    base = 10**6
    coord = make_coord(chunk_bytes=2048, chunked_step=True, free_block_sizes=lambda: [2**40], margin_bytes=0,
                       memory_allocated=lambda: base + coord.resident_bytes + act[0],
                       max_memory_allocated=lambda: base + coord.resident_bytes + act[0])
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    slot = off.chunks[0].gpu_nbytes
    seen = []  # per step: [(chunk index, state, copy_in_seq)] at the step's start, and the order taken
    begin = coord._begin_chunked_step

    def recording_begin(o):
        before = [(c.index, c.state, c.copy_in_seq) for c in o.chunks]
        pieces = begin(o)
        seen.append((before, [c.index for c in coord.it.step_order[id(o)]]))
        return pieces

    coord._begin_chunked_step = recording_begin
    layers = 6
    for step in range(4):
        for mb in range(2):
            coord.forward_begin(True)
            for h in range(layers):
                coord.layer_forward_begin()  # frees chunks in index order as the layers need room
                act[0] += slot
            coord.forward_end()
            coord.backward_begin()
            for h in reversed(range(layers)):
                coord.layer_backward_begin(h)  # reloads the latest freed first
                act[0] -= slot
        act[0] = 0
        coord.grads_finalizing()
        step_beside(ref, opt, coord, step)
    reversed_arrivals = 0
    for before, order in seen:
        state = {i: st for i, st, _ in before}
        seq = {i: q for i, _, q in before}
        rank = {ChunkState.RESIDENT: 0, ChunkState.COPYING_OUT: 0, ChunkState.COPYING_IN: 1, ChunkState.OFFLOADED: 2}
        assert [rank[state[i]] for i in order] == sorted(rank[state[i]] for i in order), (order, state)
        coming = [i for i in order if state[i] is ChunkState.COPYING_IN]
        assert [seq[i] for i in coming] == sorted(seq[i] for i in coming), (coming, seq)
        reversed_arrivals += coming != sorted(coming)
    # The case the rule is for occurred: chunks landing in another order than their indices.
    assert reversed_arrivals >= 1, seen
    coord.close()


@pytest.mark.parametrize("fits", ["all", "none", "what-the-budget-admits"])
def test_streamed_step_admission_hands_back_free_blocks_too_small_for_it(fits):
    """The streamed step's admission at grads_finalizing reloads what its budget holds (with the
    automatic budget, often everything), like the whole step's fallback: in an iteration whose first
    forward found every chunk off (after the start-up offload), when those chunks fit no set of free
    blocks, the cached memory goes back first; never when they fit (only the chunks the budget admits
    count: the step reloads the rest into the room of those it sends out), nor in later iterations."""
    from test_offloader_cpu import make_coord

    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    admitted = 3  # chunks the budget below holds ("what-the-budget-admits")
    level, blocks, released, checked, events = [0], [], [], [], []

    def free_blocks():  # (no room inside the backward: every chunk is left to the admission)
        if "grads_finalizing" not in coord.events:
            return []
        checked.append(coord.it.forwards)
        return list(blocks)

    coord = make_coord(chunk_bytes=2048, chunked_step=True, step_budget_bytes=1 if fits == "what-the-budget-admits" else 10**9,
                       memory_allocated=lambda: level[0], max_memory_allocated=lambda: level[0],
                       free_block_sizes=free_blocks, empty_cache=lambda: released.append(len(events)))
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    coord.release_startup_state()
    released.clear()
    if fits == "what-the-budget-admits":
        coord.step_budget_bytes = admitted * off.chunks[0].gpu_nbytes
        assert len(off.chunks) > admitted
    for step in range(3):
        sizes = [(c.gpu_nbytes + 511) // 512 * 512 for c in off.chunks]
        blocks[:] = {"all": sizes, "none": [], "what-the-budget-admits": sizes[:admitted]}[fits]
        coord.events.clear()
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step, level=level)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
        events.append(list(coord.events))
        ev = coord.events
        if fits == "none" and step == 0:
            # After the backward, before the admission's reloads (the step's first piece).
            step_begin = next(i for i, e in enumerate(ev) if e.startswith("step_begin:"))
            assert ev.index("grads_finalizing") < ev.index("release:fallback") < step_begin, ev
        else:
            assert "release:fallback" not in ev, (step, ev)
    assert len(released) == (1 if fits == "none" else 0), released
    assert checked, "the admission's fit was never checked"
    coord.close()


def test_whole_parameter_units_on_a_small_state_are_packed_with_little_padding(monkeypatch):
    """The streamed step packs whole parameters (master and moments together). On a small state the
    balanced sizes left a quarter of it as padding (three layers' worth of attention and MLP weights,
    as on rank 0 of the functional model at DP2: 10 chunks padded to 62 of 482 MiB, the step's GPU
    buffers 1.29x the state); of the layouts with as many chunks, the one padded least is taken."""
    from megatron_offload import packing
    from test_offloader_cpu import make_coord

    monkeypatch.setattr(packing, "MIN_CHUNK_BYTES", 256)
    class Layers(MegatronShapedDistOpt):
        step = MegatronShapedDistOpt.step_with_ready_grads

        def __init__(self):
            super().__init__(bf16_numels=(3072, 1024, 4096, 4096) * 3 + (4200,))

    ref, opt = Layers(), Layers()
    coord = make_coord(chunk_bytes=2**30, chunked_step=True)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(3):
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    assert len(off.chunks) >= packing.MIN_CHUNKS, off.chunks
    assert coord.gpu_bytes <= 1.06 * off.state_bytes, (coord.gpu_bytes, off.state_bytes)
    assert coord.step_waiting and set(coord.step_waiting) == {0}  # (no parameter split)
    coord.close()


@pytest.mark.parametrize("in_flight", [0, 4096], ids=["unfed", "fed"])
def test_streamed_step_with_a_state_fraction_keeps_the_rest_resident_and_stays_bit_exact(in_flight):
    """A fixed --offload-state-fraction on the streamed step (the default engine): the kept share stays
    where it is (never freed, never copied), the parameters it holds are stepped in the last piece,
    and training stays bit-identical."""
    from test_offloader_cpu import make_coord

    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    coord = make_coord(chunk_bytes=2048, chunked_step=True, state_fraction=0.5, copy_out_in_flight_bytes=in_flight)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    kept_at = {st.name: st.tensor.data_ptr() for st in off.kept}
    for step in range(4):
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
        assert all(st.tensor.untyped_storage().nbytes() > 0 and st.tensor.data_ptr() == kept_at[st.name]
                   for st in off.kept)
    total = coord.state_bytes + off.kept_bytes
    assert kept_at and 0.3 * total <= coord.state_bytes <= 0.5 * total
    assert all(float(opt.optimizer.state[p]["step"]) == 4 for p in opt.all_params())
    assert (coord.feeder is not None and coord.feeder.enqueued_pieces > 0) == bool(in_flight)
    coord.close()


def test_a_save_after_a_chunked_step_reads_the_host_copies_and_training_stays_bit_exact():
    """Issue 4: a checkpoint save must not bring the whole state back. After a chunked step most
    chunks are off the GPU; the save reads them from the host and reloads none."""
    from megatron_offload.megatron_state_methods import wrap_state_access
    from test_offloader_cpu import make_coord

    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    saved = []
    opt.sharded_state_dict = lambda model_sd, is_loading=False: saved.append(snapshot(opt))
    coord = make_coord(chunk_bytes=2048, chunked_step=True)
    off = coord.add_optimizer(opt)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    for step in range(4):
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step)
        resident = coord.resident_bytes
        opt.sharded_state_dict({})  # Megatron saves right after the step
        assert coord.resident_bytes == resident  # nothing came back for the save
        assert sum(c.on_host for c in off.chunks) >= len(off.chunks) - 3 - coord.step_waiting[-1]
        assert_bitwise_equal(saved[-1], snapshot(ref))
    coord.close()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


def test_state_seen_on_the_host_by_a_save_points_back_at_the_gpu_by_the_next_forward():
    """After a save read offloaded chunks on the host, the next iteration must find every state
    tensor on its (freed) GPU buffer again: DistributedOptimizer.step assigns each master a CUDA
    `.grad` before the piecewise step reloads it, which fails on a CPU view (EP2 on 2 x H200)."""
    from megatron_offload.megatron_state_methods import wrap_state_access
    from test_offloader_cpu import make_coord

    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    opt.sharded_state_dict = lambda model_sd, is_loading=False: snapshot(opt)
    coord = make_coord(chunk_bytes=2048, chunked_step=True)
    off = coord.add_optimizer(opt)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    seen = []

    def on_host_at_forward_end(_):
        offloaded = off.chunks_in(ChunkState.OFFLOADED)
        seen.append(sum(c.on_host for c in off.chunks))
        # A tensor of a chunk that is off the GPU is a view of the freed buffer, not of the host.
        assert all(storage_bytes(st.tensor) == 0 for c in offloaded for st in c.tensors)

    for step in range(3):
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step, watch=on_host_at_forward_end if step else None)
        opt.sharded_state_dict({})
        assert sum(c.on_host for c in off.chunks) > 0  # the save did read host copies
    assert seen and not any(seen)
    coord.close()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


def test_the_chunked_steps_own_frees_do_not_make_the_host_wait():
    """The chunked step frees a chunk one piece after its copy-out was enqueued; a host wait there
    would hold back the next pieces' copies and Adam (the pipeline runs on the GPU). Only the
    forward's frees make the host wait (`OffloadConfig.host_waits_at_free`)."""
    from test_offloader_cpu import make_coord

    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    level = [0]
    coord = make_coord(chunk_bytes=2048, chunked_step=True, step_budget_bytes=3 * 2048,
                       memory_allocated=lambda: level[0], max_memory_allocated=lambda: level[0],
                       free_block_sizes=lambda: [2**40], host_waits_at_free=True)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    phases = []

    class Event:
        def synchronize(self):
            phases.append(coord.phase)

    coord.streams.record = lambda stream: Event()
    in_step_frees = []
    original_free = off.free

    def free(chunks, **kw):
        freed = original_free(chunks, **kw)
        if coord.phase is Phase.STEPPING:
            in_step_frees.append(freed)
        return freed

    off.free = free
    for step in range(3):
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step, level=level)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    assert sum(in_step_frees) > 0  # the step did free chunks it had copied out
    assert phases and Phase.STEPPING not in phases, phases  # the forward's frees waited, the step's did not


@pytest.mark.parametrize("name", list(CHUNKED_FACTORIES))
def test_a_save_right_after_a_chunked_step_reads_the_sent_out_chunks_from_the_host(name):
    """What the GPU test does under copy-stream delays: the chunked step leaves chunks OFFLOADED,
    and a save (host copies allowed) reads them on the host, every byte as without offloading.
    TE's fp16 states are unscaled by a scale beside them: while read on the host, that scale is a
    host copy of it, and the optimizer's own scale tensor is back before the next step."""
    from test_offloader_cpu import make_coord

    ref, opt = CHUNKED_FACTORIES[name](), CHUNKED_FACTORIES[name]()
    level = [0]
    coord = make_coord(chunk_bytes=2048, chunked_step=True, memory_allocated=lambda: level[0],
                       max_memory_allocated=lambda: level[0], free_block_sizes=lambda: [2**40])
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(4):
        make_grads(ref.all_params(), step)
        ref.step()
        chunked_iteration(opt, coord, step, level=level)
    off_gpu = coord.bytes_in(ChunkState.OFFLOADED)
    scales = getattr(opt.optimizer, "_scales", {})
    before = {(id(p), k): t for p, d in scales.items() for k, t in d.items()}
    with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True):
        on_host = [c for off in coord.offloaders for c in off.chunks if c.on_host]
        saved = snapshot(opt)
        # The fp16 states read on the host, found from the optimizer: their scales are host copies
        # (the stand-in's scales live on the CPU already; TE's on the GPU: copies either way), the
        # other scales (TE keeps them for bf16 states too) are the optimizer's own.
        inner, exposed = opt.optimizer, {id(st.tensor) for c in on_host for st in c.tensors}
        fp16 = {(id(p), k) for p, d in scales.items() for k in d
                if inner.name_to_dtype_map[k] == torch.float16 and id(inner.state[p][k]) in exposed}
        assert all((t is not before[(id(p), k)] and t.device.type == "cpu") == ((id(p), k) in fp16)
                   for p, d in scales.items() for k, t in d.items())
    assert off_gpu > 0 and on_host, off_gpu
    assert bool(fp16) == name.endswith("fp16-moments"), name
    assert_bitwise_equal(snapshot(ref), saved)
    coord.forward_begin(True)  # (the reader is done: hide_host_copies)
    assert all(t is before[(id(p), k)] for p, d in scales.items() for k, t in d.items())
    assert not any(c.gpu_scales for off in coord.offloaders for c in off.chunks)


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_an_async_save_reads_every_chunk_from_the_host(chunked, monkeypatch):
    """--async-save (OffloadConfig.async_saves): megatron-core's checkpoint worker holds the GPU
    tensors a save hands it (CUDA IPC) until its write is done, so a save must hand it none of the
    chunk buffers. Right after a step (the unchunked step leaves the whole state resident, the
    chunked one a budget's worth), the save's reader finds every chunk sent out and reads the host
    copies, every byte as without offloading (here every tensor from a shared-memory snapshot that
    is its whole storage, which the writer's process maps without a copy); training goes on
    bit-exactly. Without async_saves the resident chunks are read on the GPU (the synchronous
    save's protocol)."""
    from megatron_offload import save_snapshot
    from megatron_offload.megatron_state_methods import wrap_state_access
    from test_offloader_cpu import make_coord, one_iteration

    monkeypatch.setattr(save_snapshot, "MIN_SNAPSHOT_BYTES", 0)  # (these tensors are small)
    for async_saves in (True, False):
        ref, opt = MegatronShapedMany(), MegatronShapedMany()
        seen = []

        def whole_shared(t):
            return t.is_shared() and t.untyped_storage().nbytes() == t.numel() * t.element_size()

        def save(model_sd, is_loading=False, off=None):
            # As megatron-core's does: `state_dict()` first, a reader nested in the save (wrapped).
            opt.state_dict()
            shared = all(whole_shared(st.tensor) for c in off.chunks for st in c.tensors)
            seen.append((coord.resident_bytes, sum(c.on_host for c in off.chunks), snapshot(opt), shared))

        coord = make_coord(chunk_bytes=2048, chunked_step=chunked, async_saves=async_saves,
                           async_save_snapshots=async_saves)
        off = coord.add_optimizer(opt)
        opt.sharded_state_dict = lambda model_sd, is_loading=False, off=off: save(model_sd, is_loading, off)
        opt.state_dict = lambda: {}
        wrap_state_access(coord, off, opt)
        coord.offload_existing_state()
        prepared = list(off.snapshots._sets)  # made at start-up, not at the first save
        assert len(prepared) == (1 if async_saves else 0)
        for step in range(3):
            make_grads(ref.all_params(), step)
            ref.step()
            (chunked_iteration if chunked else one_iteration)(opt, coord, step)
            opt.sharded_state_dict({})
            assert off.snapshots._sets == prepared  # the saves read the prepared set, nothing else was made
            resident, on_host, saved, shared = seen[-1]
            assert_bitwise_equal(saved, snapshot(ref))
            assert shared == async_saves
            if async_saves:
                assert resident == 0 and on_host == len(off.chunks), (resident, on_host)
                assert coord.phase is Phase.OFFLOADED
            else:
                assert resident > 0
        assert coord.host_read_seconds > 0  # (what the functional runs report per save)
        coord.close()
        assert_bitwise_equal(snapshot(ref), snapshot(opt))


def steps_both(ref, opt, coord, step, count=2):
    """`count` training steps of `ref` (no offloading) and `opt` (through `coord`) from `step`;
    returns the next step."""
    from test_offloader_cpu import one_iteration

    for step in range(step, step + count):
        make_grads(ref.all_params(), step)
        ref.step()
        one_iteration(opt, coord, step)
    return step + 1


def background_saving_coord(opt, device_fill=True, locks=None, **kw):
    """A coordinator for asynchronous saves filled in the background, with `opt` added (chunks of
    2048 bytes); `device_fill` with page locks faked by `locks` ([Note: device fill]: the CPU
    stands in for the GPU). Returns it and the offloader."""
    from test_offloader_cpu import make_coord
    from test_save_snapshot_cpu import FakeLocks

    coord = make_coord(chunk_bytes=2048, async_saves=True, async_save_snapshots=True,
                       async_save_background_fill=True, **kw)
    off = coord.add_optimizer(opt)
    locks = locks or FakeLocks()
    off.snapshots.device_fill = device_fill
    off.snapshots._register, off.snapshots._unregister = locks.register, locks.unregister
    return coord, off


@pytest.mark.parametrize("device_fill", [False, True], ids=["host-fill", "device-fill"])
@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_a_background_fill_is_read_only_once_complete(chunked, device_fill, monkeypatch):
    """[Note: background fill] (async_save_background_fill): a save's `sharded_state_dict` returns
    while its snapshots still fill (here each fill first sleeps). What reads them waits: the
    writer (`writer_waits` on the flags it is handed), a reader of values nested in the save (a
    gather, `get_parameter_state_dp_zero`), dist-checkpointing itself where it would read a
    snapshot in this process (a ShardedTensor over a view of one: cloned for the writer), and the
    copy-outs of the next iterations, which rewrite the host copies the fill reads: the writer
    gets the state as it was at the save, and training stays bit-exact. `device_fill` ([Note:
    device fill]; the CPU stands in for the GPU, page locks faked): the save leaves the chunks
    still on the device where they are (COPYING_OUT, their tensors pointing at snapshots copied
    from there), and the next forward frees them."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_offload import snapshot_fill
    from megatron_offload.discovery import find_state_tensors
    from megatron_offload.megatron_state_methods import wrap_state_access
    from test_offloader_cpu import CPU, one_iteration

    slow = snapshot_fill.fill_pieces
    # (long enough that nothing but a wait sees a fill done, even on a loaded machine)
    monkeypatch.setattr(snapshot_fill, "fill_pieces", lambda *a: (time.sleep(0.5), slow(*a)))
    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    coord, off = background_saving_coord(opt, device_fill, chunked_step=chunked)
    seen = {}

    def save(model_sd, is_loading=False, view=False, gather=False):
        seen["on_device"] = [c.state for c in off.chunks if c.state is not ChunkState.OFFLOADED]
        seen["on_device_bytes"] = sum(st.tensor.nbytes for c in off.chunks if c.state is not ChunkState.OFFLOADED
                                      for st in c.tensors)
        seen["from_device"] = off.snapshots.device_bytes
        tensors = {st.name: st.tensor for c in off.chunks for st in c.tensors}
        seen["pending"] = any(off.snapshots.filling(t) for t in tensors.values())
        seen["whole"] = all(off.snapshots.filling(t) and t.untyped_storage().nbytes() == t.nbytes
                            for t in tensors.values())
        if gather:  # (a reader of values, wrapped like megatron-core's)
            seen["gathered"] = opt.get_parameter_state_dp_zero()
        return {name: ShardedTensor.from_rank_offsets(name, t[1:] if view else t, replica_id=0)
                for name, t in tensors.items()}

    opt.get_parameter_state_dp_zero = lambda: {st.name: st.tensor.clone() for c in off.chunks for st in c.tensors}
    opt.sharded_state_dict = lambda model_sd, is_loading=False, **k: save(model_sd, is_loading, **k)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    iteration = chunked_iteration if chunked else one_iteration
    step = 0
    for view, gather in ((False, False), (True, False), (False, True)):
        for _ in range(2):
            make_grads(ref.all_params(), step)
            ref.step()
            iteration(opt, coord, step)
            step += 1
        expected = {st.name: st.tensor.clone() for st in find_state_tensors(ref, CPU).tensors}
        from_device = off.snapshots.device_bytes
        sharded = opt.sharded_state_dict({}, view=view, gather=gather)
        assert seen["pending"] and seen["whole"]
        if device_fill:
            # The chunks still on the device stay there (every one after the whole step, those the
            # chunked step's budget kept after it), and what they hold is copied from there.
            assert set(seen["on_device"]) == {ChunkState.COPYING_OUT}, seen
            assert chunked or len(seen["on_device"]) == len(off.chunks), seen
            assert off.snapshots.device_bytes - from_device == seen["on_device_bytes"] > 0
        else:
            assert seen["on_device"] == [] and off.snapshots.device_bytes == 0
        # The save waited for its fills itself where something in this process reads them.
        assert any(not f.done for f in off.snapshots._fills) == (not view and not gather), (view, gather)
        if gather:
            assert_bitwise_equal(seen["gathered"], expected)
        # What megatron-core's writer reads, once the flags are set: the sharded tensors' data
        # (views made by dist-checkpointing before the save returns; the state tensors
        # themselves point back at the GPU buffers at the next forward).
        handed = {k: v.data.view(-1) for k, v in sharded.items()}
        fills = coord.pending_snapshot_fills()
        written = {}
        writer = threading.Thread(target=snapshot_fill.writer_waits, args=(
            [f.flag for f in fills], lambda: written.update({k: v.clone() for k, v in handed.items()})))
        writer.start()
        for fill in fills:  # (as megatron_saves does once the request is with the writer)
            fill.start()
        for _ in range(2):  # training goes on at once: the copy-outs wait for the fill
            make_grads(ref.all_params(), step)
            ref.step()
            iteration(opt, coord, step)
            step += 1
        writer.join(10)
        snapshot_fill.check_written(fills)
        assert_bitwise_equal(written, {k: (v[1:] if view else v) for k, v in expected.items()})
        del sharded, written, handed
    coord.close()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


@pytest.mark.parametrize("moments", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_an_async_save_serves_te_fp16_states_unscaled_from_shared_memory(chunked, moments, monkeypatch):
    """Every reader of TE's fp16 states asks `get_unscaled_state`, which makes a private fp32 tensor
    of each on the host (the writer's queue then copies it into shared memory while training
    waits). In an asynchronous save the plugin's snapshot set holds those fp32 values already
    and `get_unscaled_state` hands them out: each a whole shared-memory storage with the bits TE
    computes; states without a scale are not served; once the chunks leave the host (the next
    forward) the optimizer's own method is back, and training goes on bit-exactly."""
    from megatron_offload import save_snapshot
    from megatron_offload.megatron_state_methods import wrap_state_access
    from test_offloader_cpu import make_coord, one_iteration

    monkeypatch.setattr(save_snapshot, "MIN_SNAPSHOT_BYTES", 0)  # (these tensors are small)
    ref, opt = (MegatronShapedPrecisionAware(numels=MANY, moment_dtype=moments) for _ in range(2))
    coord = make_coord(chunk_bytes=2048, chunked_step=chunked, async_saves=True, async_save_snapshots=True)
    off = coord.add_optimizer(opt)
    seen = []

    def params(o):
        return [p for g in o.optimizer.param_groups for p in g["params"]]

    def save(model_sd, is_loading=False):
        seen.append([{k: opt.optimizer.get_unscaled_state(p, k) for k in ("exp_avg", "exp_avg_sq", "master_param")}
                     for p in params(opt)])

    opt.sharded_state_dict = save
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    prepared = list(off.snapshots._sets)
    assert len(prepared) == 1
    for step in range(3):
        make_grads(ref.all_params(), step)
        ref.step()
        (chunked_iteration if chunked else one_iteration)(opt, coord, step)
        # The last save's chunks left the host at this iteration's forward, and with them the wrapper.
        assert "get_unscaled_state" not in opt.optimizer.__dict__ and not off._unscaled
        if step:  # what the last save's reader still holds keeps its set from being rewritten
            assert off.snapshots._sets[0].in_use()
            del held
            assert not off.snapshots._sets[0].in_use()
        opt.sharded_state_dict({})
        assert "get_unscaled_state" in opt.optimizer.__dict__
        assert off.snapshots._sets == prepared  # the unscaled layout was prepared at start-up
        state = opt.optimizer.state
        for got, p, rp in zip(seen[-1], params(opt), params(ref)):
            for k, value in got.items():
                expected = ref.optimizer.get_unscaled_state(rp, k)
                assert value.dtype == expected.dtype and torch.equal(value.view(torch.int32), expected.view(torch.int32))
                if k == "master_param":  # (fp32: no scale, TE returns the state itself)
                    assert value is state[p][k]
                else:  # (TE itself would return a fresh private tensor)
                    assert value.is_shared() and value.untyped_storage().nbytes() == value.numel() * 4
                    if moments == torch.bfloat16:  # (asked for the stored bf16: TE's answer, unserved)
                        assert opt.optimizer.get_unscaled_state(p, k, skip_unscale=True) is state[p][k]
        held = seen.pop()  # noqa: F841  (a pending save's request keeps what it was given)
        del got, value
    # Each reader let go of its set before the next save: no save had to collect garbage for one.
    assert coord.snapshot_collect_seconds == 0.0 and off.snapshots.collections == 0
    off.snapshots.collect_seconds = 0.25  # (the coordinator sums its offloaders' snapshot collections)
    assert coord.snapshot_collect_seconds == 0.25
    assert coord.snapshot_fill_wait_seconds == 0.0
    off.snapshots.fill_wait_seconds = 0.5  # (and their waits for background fills)
    assert coord.snapshot_fill_wait_seconds == 0.5
    coord.close()
    assert "get_unscaled_state" not in opt.optimizer.__dict__
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


def test_te_reads_16_bit_states_only_once_a_background_fill_is_done(monkeypatch):
    """[Note: background fill] with TE's fp16 states: a save's `get_unscaled_state` hands out the
    served fp32 snapshot at once (still filling: the writer waits for it) and an fp32 state as it
    is, but an fp16 state it converts itself (here one written in place, so no longer served)
    is read only once the fill is done."""
    from megatron_offload import snapshot_fill
    from test_offloader_cpu import make_coord, one_iteration

    slow = snapshot_fill.fill_pieces
    monkeypatch.setattr(snapshot_fill, "fill_pieces", lambda *a: (time.sleep(0.6), slow(*a)))
    opt = MegatronShapedPrecisionAware(numels=MANY, moment_dtype=torch.float16)
    coord = make_coord(chunk_bytes=2048, async_saves=True, async_save_snapshots=True, async_save_background_fill=True)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    one_iteration(opt, coord, 0)
    inner = opt.optimizer
    p = inner.param_groups[0]["params"][0]
    with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True, references_only=True):
        served = inner.get_unscaled_state(p, "exp_avg")
        master = inner.get_unscaled_state(p, "master_param")
        assert off.snapshots.filling(served) and off.snapshots.filling(master)  # (no wait for either)
        assert master is inner.state[p]["master_param"]
        inner.state[p]["exp_avg_sq"].mul_(1)  # written in place: TE's own conversion, of the host copy
        fresh = inner.get_unscaled_state(p, "exp_avg_sq")
        assert not any(off.snapshots.filling(t) for t in (served, master)) and not fresh.is_shared()
        assert torch.equal(fresh, inner.state[p]["exp_avg_sq"].float().mul_(inner._scales[p]["exp_avg_sq"]))
    coord.close()


def test_served_unscaled_states_stay_current_or_are_not_served():
    """While TE's fp16 states are served from snapshots: an in-place write to a state (a load's
    `set_scaled_state`, unwrapped) or a state replaced makes TE's own method answer again; a
    writer that re-points the chunks at their host copies ends the serving; a save that finds no
    free snapshot set serves nothing (TE's method, with the host copies of the scales)."""
    from megatron_offload import save_snapshot
    from test_offloader_cpu import make_coord, one_iteration

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(save_snapshot, "MIN_SNAPSHOT_BYTES", 0)
    try:
        opt = MegatronShapedPrecisionAware(numels=MANY, moment_dtype=torch.float16)
        coord = make_coord(chunk_bytes=2048, async_saves=True, async_save_snapshots=True)
        off = coord.add_optimizer(opt)
        coord.offload_existing_state()
        one_iteration(opt, coord, 0)
        inner = opt.optimizer
        p = inner.param_groups[0]["params"][0]

        def served(q, k):
            return inner.get_unscaled_state(q, k).is_shared()

        with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True):
            assert served(p, "exp_avg") and served(p, "exp_avg_sq")
            kept = inner.state[p]["exp_avg_sq"]
            inner.state[p]["exp_avg_sq"] = kept.clone()  # replaced: not the state it was made from
            assert not served(p, "exp_avg_sq")
            inner.state[p]["exp_avg_sq"] = kept
            assert served(p, "exp_avg_sq")
            inner.state[p]["exp_avg"].add_(1)  # written in place: the snapshot is stale
            fresh = inner.get_unscaled_state(p, "exp_avg")
            assert not fresh.is_shared()
            assert torch.equal(fresh, inner.state[p]["exp_avg"].float().mul_(inner._scales[p]["exp_avg"]))
            q = inner.param_groups[0]["params"][-1]  # (another chunk's: still served)
            assert served(q, "exp_avg")
            off.expose_host_copies(repoint=True)  # a writer: the host copies are the state again
            assert "get_unscaled_state" not in inner.__dict__ and not served(q, "exp_avg")
        coord.forward_begin(True)
        coord.forward_end()
        coord.backward_begin()
        coord.grads_finalizing()
        opt.step()
        coord.optimizer_step_done()
        monkeypatch.setattr(off.snapshots, "take", lambda *a, **k: None)  # no set free
        with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True):
            assert "get_unscaled_state" not in inner.__dict__ and not served(p, "exp_avg")
        coord.close()
    finally:
        monkeypatch.undo()


def test_an_async_save_with_nothing_offloaded_leaves_the_phase_alone():
    """A save before any state is packed (phase NO_STATE) must not mark the state offloaded: that
    would switch on the per-layer gradient hooks and the cache releases of an offloaded phase."""
    from test_offloader_cpu import make_coord

    coord = make_coord(chunk_bytes=2048, async_saves=True)
    coord.add_optimizer(MegatronShapedMany())
    with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True):
        pass
    assert coord.phase is Phase.NO_STATE
    coord.close()


@pytest.mark.parametrize("fed", [0, 1024], ids=["", "feeder"])
@pytest.mark.parametrize("then", ["gpu_read", "gpu_write", "host_write", "second_save", "hide", "restore_all", "close"])
def test_what_comes_between_an_in_place_save_and_the_next_forward(then, fed):
    """[Note: device fill] (the CPU stands in for the GPU, page locks faked): a save leaves the
    chunks on the device, their tensors pointing at snapshots, until the next forward. Whatever
    comes before that forward sees a consistent state: a reader or writer that takes the state
    on the device gets the chunk buffers again (a write lands there, not in the snapshots the
    writer still reads), and a load that writes into the host copies gets those; a second save reads the first one's snapshots; the forward's hiding
    (before it frees anything), an RL phase switch's `restore_all` and `close` bring the tensors
    back. The writer reads the state as it was at the save, and training after it
    stays bit-exact (the write made in both runs). `fed`: the copy-outs and the copies into the
    set go through the copy feeder (copy_feeder.py), whose thread may not have enqueued them yet."""
    from megatron_offload import snapshot_fill
    from megatron_offload.discovery import find_state_tensors
    from test_offloader_cpu import CPU

    # (torch Adam with every moment a master's: what a load writes into on the host)
    factory = (lambda: FakeDistOpt(fp32_numels=())) if then == "host_write" else MegatronShapedMany
    ref, opt = factory(), factory()
    coord, off = background_saving_coord(opt, copy_out_in_flight_bytes=fed)
    coord.offload_existing_state()

    def in_buffer(st, chunk):
        return st.tensor.untyped_storage().data_ptr() == chunk.buffer.untyped_storage().data_ptr()

    step = steps_both(ref, opt, coord, 0)
    expected = {st.name: st.tensor.clone() for st in find_state_tensors(ref, CPU).tensors}
    with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True, references_only=True):
        handed = {st.name: st.tensor.view(-1) for c in off.chunks for st in c.tensors}
    assert all(c.state is ChunkState.COPYING_OUT and c.on_host for c in off.chunks)
    assert not any(in_buffer(st, c) for c in off.chunks for st in c.tensors)
    fills = coord.pending_snapshot_fills()
    for fill in fills:
        fill.start()
    if then in ("gpu_read", "gpu_write"):
        write = then == "gpu_write"
        with coord.state_access(coord.offloaders, will_modify=write):
            assert all(in_buffer(st, c) and not c.on_host for c in off.chunks for st in c.tensors)
            if write:
                with torch.no_grad():
                    for c in off.chunks:
                        for st in c.tensors:
                            st.tensor.mul_(2)
        if write:
            with torch.no_grad():
                for st in find_state_tensors(ref, CPU).tensors:
                    st.tensor.mul_(2)
    elif then == "host_write":  # (a torch_dist load into torch Adam: it writes into the host copies)
        assert off.host_writes_supported()
        with coord.state_access(coord.offloaders, will_modify=True, host_copies_ok=True):
            host = {c.index: (c.host.data_ptr(), c.host.data_ptr() + c.nbytes) for c in off.chunks}
            assert all(host[c.index][0] <= st.tensor.data_ptr() < host[c.index][1]
                       for c in off.chunks for st in c.tensors)
            with torch.no_grad():
                for c in off.chunks:
                    for st in c.tensors:
                        st.tensor.mul_(2)
        with torch.no_grad():
            for st in find_state_tensors(ref, CPU).tensors:
                st.tensor.mul_(2)
    elif then == "second_save":
        with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True, references_only=True):
            again = {st.name: st.tensor.view(-1) for c in off.chunks for st in c.tensors}
        assert all(again[k].data_ptr() == v.data_ptr() for k, v in handed.items())  # (the same snapshots)
    elif then == "restore_all":  # (an RL phase switch between steps)
        coord.restore_all().wait()
        assert all(in_buffer(st, c) and not c.on_host for c in off.chunks for st in c.tensors)
    elif then == "hide":  # (what forward_begin does first; the chunks stay until its frees)
        coord._hide_host_copies()
        assert all(c.state is ChunkState.COPYING_OUT and not c.on_host for c in off.chunks)
        assert all(in_buffer(st, c) for c in off.chunks for st in c.tensors)
    else:
        coord.close()
        assert all(in_buffer(st, c) for c in off.chunks for st in c.tensors)
    snapshot_fill.check_written(fills)
    assert_bitwise_equal({k: v.clone() for k, v in handed.items()}, {k: v.view(-1) for k, v in expected.items()})
    if then != "close":
        step = steps_both(ref, opt, coord, step)
        coord.close()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


@pytest.mark.parametrize("fed", [False, True], ids=["", "feeder"])
@pytest.mark.parametrize("moments", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_an_in_place_save_serves_te_16_bit_states_unscaled(moments, fed):
    """[Note: device fill] with TE's 16-bit states (the CPU stands in for the GPU, page locks
    faked): the chunks stay on the device through the save; the fp32 masters are copied into
    the set from there, the 16-bit moments are served as the fp32 values TE computes (converted
    on the host from the host copies the save's copy-out wrote); the writer reads TE's bits, and
    training after the save stays bit-exact. `fed` (the copy feeder, its thread held through the
    save): the save enqueues the copy-outs the host's conversion reads, and leaves the copies
    into the set to the feeder."""
    from megatron_offload import snapshot_fill
    from test_copy_feeder_cpu import gated_feeder

    ref, opt = (MegatronShapedPrecisionAware(numels=MANY, moment_dtype=moments) for _ in range(2))
    coord, off = background_saving_coord(opt, copy_out_in_flight_bytes=1024 if fed else 0)
    coord.offload_existing_state()

    def params(o):
        return [p for g in o.optimizer.param_groups for p in g["params"]]

    keys = ("exp_avg", "exp_avg_sq", "master_param")
    step = steps_both(ref, opt, coord, 0)
    release = None
    if fed:  # (a gated feeder from the step before the save on)
        coord.feeder.close()
        coord.feeder, release = gated_feeder(1024)
        off.feeder = coord.feeder
        step = steps_both(ref, opt, coord, step, 1)
    from_device = off.snapshots.device_bytes
    try:
        with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True, references_only=True):
            assert all(c.state is ChunkState.COPYING_OUT for c in off.chunks)
            got = [{k: opt.optimizer.get_unscaled_state(p, k) for k in keys} for p in params(opt)]
        if fed:
            # The chunks holding a 16-bit moment, whose conversion reads their host copies: their
            # copy-outs enqueued; the copies into the set (the masters) still wait for the thread.
            converted = [c for c in off.chunks if any(st.tensor.dtype == moments for st in c.tensors)]
            assert converted and all(torch.equal(c.host, c.packed) for c in converted)  # (run: on the CPU)
            left = [dst for batch in coord.feeder._batches for _, dst, _ in batch.pieces]
            assert any(not any(c.host.data_ptr() <= d.data_ptr() < c.host.data_ptr() + c.nbytes for c in off.chunks)
                       for d in left)
    finally:
        if release is not None:
            release()
    assert off.snapshots.device_bytes > from_device  # (the fp32 masters, at least)
    fills = coord.pending_snapshot_fills()
    for fill in fills:
        fill.start()
    snapshot_fill.check_written(fills)  # (waits for them)
    for mine, rp in zip(got, params(ref)):
        for k, value in mine.items():
            expected = ref.optimizer.get_unscaled_state(rp, k)
            assert value.dtype == expected.dtype and torch.equal(value.view(torch.int32), expected.view(torch.int32)), k
    del got, mine, value
    step = steps_both(ref, opt, coord, step)
    assert "get_unscaled_state" not in opt.optimizer.__dict__
    coord.close()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))
