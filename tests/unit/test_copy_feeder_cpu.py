"""The experimental copy-out feeder (megatron_offload/copy_feeder.py) on CPU: training with it is
bit-identical to training without offloading, the copy-out starts at the step, and every reader
of a chunk's copy finds it enqueued."""

import threading

import pytest
import torch

from megatron_offload import ChunkState
from megatron_offload.copy_feeder import CopyOutFeeder
from megatron_offload.coordinator import OffloadNotRunningError
from megatron_offload.streams import CopyStreams

from fakes import FakeDistOpt, FakePrecisionAwareDistOpt, assert_bitwise_equal, make_grads, resident_snapshot, snapshot
from test_chunked_step_cpu import CHUNKED_FACTORIES, chunked_iteration
from test_offloader_cpu import make_coord, one_iteration


class Chunk:
    def __init__(self, nbytes, value):
        self.nbytes = nbytes
        self.packed = torch.full((nbytes,), value, dtype=torch.uint8)
        self.host = torch.zeros(nbytes, dtype=torch.uint8)
        self.ready = None


class Offloader:
    copy_piece_bytes = 1000


def test_flush_enqueues_every_piece_up_to_the_chunk_in_order_and_once():
    feeder = CopyOutFeeder(CopyStreams(torch.device("cpu")), in_flight_bytes=10**9)
    gate = threading.Lock()
    gate.acquire()  # hold the thread back: everything below is flushed by this thread
    original = feeder._run
    feeder._run = lambda: (gate.acquire(), original())
    chunks = [Chunk(2500, k + 1) for k in range(3)]
    feeder.submit(Offloader(), chunks[:2])
    feeder.submit(Offloader(), chunks[2:])
    assert all(feeder.pending(c) for c in chunks)
    feeder.flush([chunks[1]])
    assert feeder.flushed_pieces == 6  # chunks 0 and 1: three 1000-byte pieces each
    assert [feeder.pending(c) for c in chunks] == [False, False, True]
    assert all(torch.equal(c.host, c.packed) for c in chunks[:2]) and not chunks[2].host.any()
    gate.release()
    feeder.close()  # the thread (or close's own flush) enqueues the rest, once
    assert torch.equal(chunks[2].host, chunks[2].packed) and not feeder.pending(chunks[2])
    assert feeder.flushed_pieces + 3 >= 9 and feeder._thread is None


FACTORIES = {
    "torch-adamw": FakeDistOpt,
    "te-int16-remainders-bf16-moments": lambda: FakePrecisionAwareDistOpt(store_param_remainders=True,
                                                                          moment_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_training_with_the_feeder_is_bit_identical_and_copies_out_at_the_step(name):
    ref, opt = FACTORIES[name](), FACTORIES[name]()
    coord = make_coord(chunk_bytes=2048, copy_out_in_flight_bytes=1024, copy_piece_bytes=512)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    skips = {2}
    for step in range(5):
        make_grads(ref.all_params(), step)
        if step not in skips:
            ref.step()
        one_iteration(opt, coord, step, skip=step in skips)
        if step not in skips:
            # Started at the step (not deferred to the next forward): nothing is left RESIDENT.
            assert not off.chunks_in(ChunkState.RESIDENT) and not coord._copy_out_due
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    # A phase switch in the middle finds every copy enqueued, and training goes on exactly.
    coord.offload_all().wait()
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes
    coord.restore_all().wait()
    make_grads(ref.all_params(), 5)
    ref.step()
    one_iteration(opt, coord, 5)
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    coord.close()
    assert coord.feeder._thread is None
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


@pytest.mark.parametrize("name", ["torch-adamw", "te-fusedadam-int16-remainders-bf16-moments"])
@pytest.mark.parametrize("feed", [True, False], ids=["feeder", "without"])
def test_chunked_step_with_the_feeder_sends_each_chunk_out_as_it_is_stepped(name, feed):
    """With room for the whole state in the step, the chunked step alone copies nothing out before
    the next forward; with the feeder each chunk leaves as soon as its piece is stepped."""
    ref, opt = CHUNKED_FACTORIES[name](), CHUNKED_FACTORIES[name]()
    level = [0]
    coord = make_coord(chunk_bytes=2048, chunked_step=True, step_budget_bytes=2**40,
                       copy_out_in_flight_bytes=1024 if feed else 0,
                       memory_allocated=lambda: level[0], max_memory_allocated=lambda: level[0],
                       free_block_sizes=lambda: [2**40])
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    leaving = []  # at each piece's Adam: chunks already sent out in this step
    opt.optimizer.register_step_pre_hook(lambda *_: leaving.append(len(off.chunks_in(ChunkState.COPYING_OUT))))
    for step in range(4):
        make_grads(ref.all_params(), step)
        ref.step()
        leaving.clear()
        chunked_iteration(opt, coord, step, level=level)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    if feed:
        assert leaving == list(range(len(leaving))) and len(leaving) == len(off.chunks) > 2, leaving
    else:
        assert not any(leaving), leaving
    coord.close()


def test_a_second_step_without_a_forward_is_still_refused_with_the_feeder():
    opt = FakeDistOpt()
    coord = make_coord(copy_out_in_flight_bytes=1024)
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    one_iteration(opt, coord, 0)
    coord.grads_finalizing()
    make_grads(opt.all_params(), 1)
    opt.step()
    with pytest.raises(OffloadNotRunningError):
        coord.optimizer_step_done()
