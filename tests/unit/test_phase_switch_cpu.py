"""Phase switches (phase_switch.py): the whole state off and back between training phases, with and
without the per-step offload, bit-exact; refused where the iteration or a reader is in progress."""

import pytest
import torch

from fakes import FakeDistOpt, FakePrecisionAwareDistOpt, assert_bitwise_equal, make_coordinator, make_grads, snapshot
from megatron_offload import ChunkState, PhaseSwitchError, phase_switcher
from megatron_offload.config import AllocatorProbes, OffloadConfig
from test_offloader_cpu import one_iteration, storage_bytes

CPU = torch.device("cpu")
FACTORIES = [lambda: FakeDistOpt(), lambda: FakePrecisionAwareDistOpt(store_param_remainders=True)]


def state_storages(off):
    return [storage_bytes(st.tensor) for st in off.discovery.tensors]


@pytest.mark.parametrize("factory", FACTORIES)
def test_round_trips_between_steps_with_the_per_step_offload_stay_exact(factory):
    ref, opt = factory(), factory()
    coord = make_coordinator(device=CPU, chunk_bytes=4096, expected_forwards_per_iteration=lambda: 2)
    off = coord.add_optimizer(opt)
    for step in range(10):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        handle = coord.offload_all().wait()
        assert handle.nbytes == coord.bytes_in(ChunkState.OFFLOADED) > 0
        assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes and not any(state_storages(off))
        back = coord.restore_all().wait()
        assert back.nbytes == handle.nbytes
        # Resident with the host copy current: the next forward frees without a copy.
        assert all(c.state is ChunkState.COPYING_OUT and c.host_valid for c in off.chunks)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))


@pytest.mark.parametrize("factory", FACTORIES)
def test_a_switcher_without_the_per_step_offload_moves_everything_and_steps_exactly(factory):
    """RL: train with the state resident, switch out for generation, back, train on; and a step
    that runs while the state is off gets it back first."""
    ref, opt = factory(), factory()
    coord = phase_switcher(opt, device=CPU, config=OffloadConfig(chunk_bytes=4096), probes=AllocatorProbes())
    off = coord.offloaders[0]
    for step in range(6):
        for o in (ref, opt):
            make_grads(o.all_params(), step)
            o.step()
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
        handle = coord.offload_all()
        assert handle.nbytes > 0 and not any(state_storages(off)), step
        if step % 2 == 0:
            coord.restore_all()
            assert all(state_storages(off))
        # odd steps: the next step runs with the state off; the pre-step hook takes it back
    coord.restore_all()  # (the last step left it off; reading freed storage is not a test)
    assert_bitwise_equal(snapshot(ref), snapshot(opt))
    # No per-step frees and reloads: chunk buffers are not padded to one slot size (the state
    # comes back once and stays there while the loop trains).
    assert all(c.gpu_nbytes - c.nbytes < 512 for c in off.chunks), off.chunks
    assert len({c.gpu_nbytes for c in off.chunks}) > 1, off.chunks


def test_phase_switches_are_refused_inside_an_iteration_a_reader_or_with_a_kept_share():
    opt = FakeDistOpt()
    coord = make_coordinator(device=CPU, chunk_bytes=4096, expected_forwards_per_iteration=lambda: 2)
    off = coord.add_optimizer(opt)
    one_iteration(opt, coord, 0)
    coord.forward_begin(True)
    with pytest.raises(PhaseSwitchError, match="iteration is in progress"):
        coord.offload_all()
    coord.close()
    with pytest.raises(PhaseSwitchError, match="closed"):
        coord.restore_all()

    coord = make_coordinator(device=CPU, chunk_bytes=4096, expected_forwards_per_iteration=lambda: 2)
    off = coord.add_optimizer(FakeDistOpt())
    coord.before_state_access(off, will_modify=False)
    with pytest.raises(PhaseSwitchError, match="checkpoint access"):
        coord.offload_all()
    coord.after_state_access(off, modified=False)

    opt = FakeDistOpt()
    coord = make_coordinator(device=CPU, chunk_bytes=4096, expected_forwards_per_iteration=lambda: 2,
                             state_fraction=0.5)
    coord.add_optimizer(opt)
    one_iteration(opt, coord, 0)
    with pytest.raises(PhaseSwitchError, match="kept resident"):
        coord.offload_all()


def test_a_write_after_restore_all_survives_the_next_switch_without_the_flag():
    """No checkpoint wrappers guard a switcher's state: restore_all leaves the host copies stale,
    so an in-place write (e.g. a model-only load refreshing the masters) is copied out again."""
    opt = FakeDistOpt()
    coord = phase_switcher(opt, device=CPU, config=OffloadConfig(chunk_bytes=4096, chunked_step=True))
    assert not coord.config.chunked_step  # (no step end is reported: no chunked step)
    make_grads(opt.all_params(), 0)
    opt.step()
    first = coord.offload_all()
    coord.restore_all()
    tensor = coord.offloaders[0].discovery.tensors[0].tensor
    tensor.fill_(42.0)
    again = coord.offload_all()
    assert again.nbytes == first.nbytes > 0
    coord.restore_all()
    assert bool((tensor == 42.0).all())
