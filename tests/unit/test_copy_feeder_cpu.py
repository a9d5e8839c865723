"""The experimental copy-out feeder (megatron_offload/copy_feeder.py) on CPU: training with it is
bit-identical to training without offloading, the copy-out starts at the step, and every reader
of a chunk's copy finds it enqueued."""

import threading
import time

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


def gated_feeder(in_flight_bytes=10**9):
    """A feeder whose thread waits at a gate (`release()`), so that the caller's flushes are all
    that has run until then. Release it in a `finally`: a test failing with the thread held would
    leave it there, and the feeder's close at exit would wait for it."""
    feeder = CopyOutFeeder(CopyStreams(torch.device("cpu")), in_flight_bytes=in_flight_bytes)
    gate = threading.Event()
    original = feeder._run
    feeder._run = lambda: (gate.wait(), original())
    return feeder, gate.set


def fail_next_record(feeder):
    """The next piece's event fails, after its copy, as a failing enqueue would."""
    record = feeder.streams.record

    def fail_once(stream):
        feeder.streams.record = record
        raise RuntimeError("injected copy failure")

    feeder.streams.record = fail_once


def test_flush_enqueues_every_piece_up_to_the_chunk_in_order_and_once():
    feeder, release = gated_feeder()
    try:
        chunks = [Chunk(2500, k + 1) for k in range(3)]
        feeder.submit(Offloader(), chunks[:2])
        feeder.submit(Offloader(), chunks[2:])
        assert all(feeder.pending(c) for c in chunks)
        feeder.flush([chunks[1]])
        assert feeder.flushed_pieces == 6  # chunks 0 and 1: three 1000-byte pieces each
        assert [feeder.pending(c) for c in chunks] == [False, False, True]
        assert all(torch.equal(c.host, c.packed) for c in chunks[:2]) and not chunks[2].host.any()
    finally:
        release()
    feeder.close()  # the thread (or close itself) enqueues the rest, once
    assert torch.equal(chunks[2].host, chunks[2].packed) and not feeder.pending(chunks[2])
    assert feeder.enqueued_pieces == 9 and feeder._thread is None


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
    the next forward; with the feeder each chunk leaves as soon as every parameter with state in
    it is stepped (its own piece, or a later one for a parameter split over chunks)."""
    ref, opt = CHUNKED_FACTORIES[name](), CHUNKED_FACTORIES[name]()
    level = [0]
    coord = make_coord(chunk_bytes=2048, chunked_step=True, step_budget_bytes=2**40,
                       copy_out_in_flight_bytes=1024 if feed else 0,
                       memory_allocated=lambda: level[0], max_memory_allocated=lambda: level[0],
                       free_block_sizes=lambda: [2**40])
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    leaving, done = [], []  # at each piece's Adam: chunks sent out in this step, chunks complete

    def before_piece(*_):
        leaving.append(len(off.chunks_in(ChunkState.COPYING_OUT)))
        done.append(sum(len(chunks) for chunks in coord.it.leaving_after[id(off)][:len(leaving) - 1]))
    opt.optimizer.register_step_pre_hook(before_piece)
    for step in range(4):
        make_grads(ref.all_params(), step)
        ref.step()
        leaving.clear()
        done.clear()
        chunked_iteration(opt, coord, step, level=level)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    if feed:
        assert leaving == done and len(leaving) == len(off.chunks) > 2, (leaving, done)
        assert leaving != list(range(len(leaving)))  # (here some parameters are split over chunks)
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


def test_the_thread_copies_everything_without_any_flush_and_pieces_respect_the_bound():
    from megatron_offload.copy_feeder import _Batch

    chunks = [Chunk(2500, k + 1) for k in range(2)]
    pieces = _Batch([(c, c.host, c.packed) for c in chunks], None, 700).pieces
    assert [dst.numel() for _, dst, _ in pieces] == [700, 700, 700, 400] * 2
    feeder = CopyOutFeeder(CopyStreams(torch.device("cpu")), in_flight_bytes=700)
    feeder.submit(Offloader(), chunks)
    deadline = time.time() + 10
    while any(feeder.pending(c) for c in chunks) and time.time() < deadline:
        time.sleep(0.001)
    assert not any(feeder.pending(c) for c in chunks) and feeder.flushed_pieces == 0 and feeder.enqueued_pieces == 8
    assert all(torch.equal(c.host, c.packed) for c in chunks)
    feeder.close()


def test_a_failing_copy_in_the_thread_loses_no_piece_and_the_callers_take_over(caplog):
    feeder, release = gated_feeder()
    chunk, later = Chunk(2500, 7), Chunk(1500, 9)
    original = chunk.host
    try:
        feeder.submit(Offloader(), [chunk])
        fail_next_record(feeder)
    finally:
        release()
    deadline = time.time() + 10
    while feeder.error is None and time.time() < deadline:
        time.sleep(0.001)
    assert "injected copy failure" in str(feeder.error)
    assert any("copy-out thread failed" in r.getMessage() for r in caplog.records)
    feeder.flush()  # the piece that failed is still queued: the caller enqueues it, nothing lost
    assert torch.equal(original, chunk.packed) and not feeder.pending(chunk)
    feeder.submit(Offloader(), [later])  # from now on enqueued at once, by the caller
    assert not feeder.pending(later) and torch.equal(later.host, later.packed)
    feeder.close()


def test_take_back_and_phase_switch_leave_nothing_pending():
    opt = FakeDistOpt()
    coord = make_coord(chunk_bytes=2048, copy_out_in_flight_bytes=1024)
    coord.feeder.close()  # (replaced by a gated one)
    feeder, release = gated_feeder(1024)
    coord.feeder = feeder
    try:
        off = coord.add_optimizer(opt)
        coord.offload_existing_state()
        one_iteration(opt, coord, 0)
        assert all(feeder.pending(c) for c in off.chunks)  # the thread is held: all still queued
        first, last = feeder._batches[0].pieces[0][0], feeder._batches[-1].pieces[-1][0]  # in copy order
        off.make_resident(will_modify=False, chunks=[first])
        assert not feeder.pending(first) and feeder.pending(last)
        coord.offload_all().wait()
        assert not any(feeder.pending(c) for c in off.chunks)
    finally:
        release()
    coord.close()


def test_auto_fraction_repack_with_the_feeder_still_sends_the_state_out(monkeypatch):
    """The calibration step re-packs the state at the chosen fraction after the step; the copy-out
    must send the new chunks (it once sent the old ones, then the re-pack took them back)."""
    import math

    from megatron_offload import auto_fraction

    monkeypatch.setattr(auto_fraction, "choose", lambda *a, **k: auto_fraction.Choice(0.5, 0.5, 0.0, 1.0, 0.0, 55, 55))
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord(chunk_bytes=4096, auto_fraction_at=3, memory_room=lambda: math.inf,
                       copy_out_in_flight_bytes=1024)
    off = coord.add_optimizer(opt)
    off_after_first_forward = []  # in every iteration after the re-pack

    def check(when, mb):
        if off.kept and mb == 0:
            off_after_first_forward.append(coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes > 0)

    for step in range(6):
        make_grads(ref.all_params(), step)
        ref.step()
        # (No state read between iterations here: a read's close sends the state out again,
        # which hid the missing copy-out after the re-pack.)
        one_iteration(opt, coord, step, check=check)
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    assert off.kept and coord.state_fraction == 0.5
    assert off_after_first_forward and all(off_after_first_forward), off_after_first_forward
    coord.close()


def test_a_state_access_after_close_still_copies_out():
    """Megatron's checkpoint wrappers stay installed after a detach; their copy-outs then run
    without the thread."""
    opt = FakeDistOpt()
    coord = make_coord(chunk_bytes=2048, copy_out_in_flight_bytes=1024)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    one_iteration(opt, coord, 0)
    coord.close()
    coord.before_state_access(off, will_modify=True)
    coord.after_state_access(off, modified=True)
    assert not any(coord.feeder.pending(c) for c in off.chunks)


def test_busy_while_pieces_wait_or_the_last_enqueued_runs():
    """`busy()` (megatron_reads' condition for answering Megatron's reads on the host): pieces not
    enqueued yet, or the last one the thread enqueued not finished; never without the thread."""

    class Event:
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

    feeder, release = gated_feeder()
    try:
        assert not feeder.busy()  # (nothing submitted, no thread)
        chunks = [Chunk(2500, 1)]
        feeder.submit(Offloader(), chunks)
        assert feeder.busy()  # (three pieces wait for the thread)
        feeder.flush()
        assert not feeder.busy()  # (all enqueued, none tracked in flight on CPU)
        first, last = Event(), Event()
        feeder._in_flight.extend([(first, 1000), (last, 1000)])
        first.done = True
        assert feeder.busy()  # (the last piece still runs)
        last.done = True
        assert not feeder.busy()
        last.done = False
        feeder.error = RuntimeError("thread failed")
        assert not feeder.busy()  # (the callers enqueue eagerly: nothing of the thread's to wait for)
        feeder.error = None
    finally:
        release()
    feeder._in_flight.clear()
    feeder.close()
    assert not feeder.busy()


class _Event:
    """A CUDA event stand-in at time `t` (ms) that has completed or not."""

    def __init__(self, t, done=True):
        self.t, self.done = t, done

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return end.t - self.t


def test_the_waits_so_far_count_what_completed_and_leave_the_harvest_whole():
    """`exposed_so_far`: the harvested waits plus those completed since, per direction; a wait
    still running counts once it completes; reading harvests nothing, so the periodic log's next
    harvest still sees every wait."""
    from megatron_offload.streams import TransferStats

    stats = TransferStats(timing=True)
    stats._waits = [("d2h", _Event(0.0), _Event(3.0)), ("h2d", _Event(10.0), _Event(15.0))]
    first = stats.harvest()
    assert (first.exposed_d2h_ms, first.exposed_h2d_ms) == (3.0, 5.0)
    running = _Event(27.0, done=False)
    stats._waits = [("d2h", _Event(20.0), _Event(22.0)), ("h2d", _Event(25.0), running)]
    assert stats.exposed_so_far() == (5.0, 5.0)
    running.done = True
    assert stats.exposed_so_far() == (5.0, 7.0) and stats.exposed_so_far() == (5.0, 7.0)
    second = stats.harvest()
    assert (second.exposed_d2h_ms, second.exposed_h2d_ms) == (2.0, 2.0)
    assert (stats.harvested.exposed_d2h_ms, stats.harvested.exposed_h2d_ms) == stats.exposed_so_far() == (5.0, 7.0)


def test_submitted_copies_follow_earlier_batches_and_keep_their_chunks_pending():
    """`submit_copies` (a save's copies into its snapshot set): fed after what was submitted
    before, in pieces; a chunk stays pending, its `ready` unset, until its last piece of any
    batch is enqueued; `synchronize(flush=False)` waits for the thread, `synchronize()` enqueues
    from the caller."""
    feeder, release = gated_feeder(1000)
    try:
        chunks = [Chunk(2500, k + 1) for k in range(2)]
        snaps = [torch.zeros(2500, dtype=torch.uint8) for _ in chunks]
        feeder.submit(Offloader(), chunks)
        fed = feeder.submit_copies([(c, snap, c.packed) for c, snap in zip(chunks, snaps)])
        feeder.flush([chunks[0]])  # its copy-out and its copy into the set, and chunk 1's copy-out before it
        assert feeder.flushed_pieces == 3 + 3 + 3 and not feeder.pending(chunks[0]) and feeder.pending(chunks[1])
        assert torch.equal(snaps[0], chunks[0].packed) and not snaps[1].any()
        waited = threading.Thread(target=fed.synchronize, kwargs={"flush": False})
        waited.start()
        waited.join(0.2)
        assert waited.is_alive() and not snaps[1].any()  # (the thread is held: nothing more ran)
    finally:
        release()
    waited.join(10)
    assert not waited.is_alive() and torch.equal(snaps[1], chunks[1].packed) and not feeder.pending(chunks[1])
    assert feeder.flushed_pieces == 9  # (the rest came from the thread)
    more = feeder.submit_copies([(chunks[0], snaps[0], torch.full((2500,), 5, dtype=torch.uint8))])
    more.synchronize()
    assert (snaps[0] == 5).all()
    feeder.close()


def wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("released_by", ["synchronize", "flush"])
def test_held_copies_wait_for_their_release_and_so_does_what_follows(released_by):
    """`submit_copies(held=True)` (an asynchronous save's copies into its set, held until its
    fill starts): the thread feeds what came before them and stops there, batches submitted later
    included; `synchronize(flush=False)` releases them to the thread, a flush enqueues them (and
    what it needs after them) from the caller as if they were not held."""
    feeder = CopyOutFeeder(CopyStreams(torch.device("cpu")), in_flight_bytes=1000)
    chunks = [Chunk(2500, k + 1) for k in range(3)]
    snap = torch.zeros(2500, dtype=torch.uint8)
    feeder.submit(Offloader(), chunks[:1])
    fed = feeder.submit_copies([(chunks[0], snap, chunks[0].packed)], held=True)
    feeder.submit(Offloader(), chunks[1:])
    assert wait_until(lambda: feeder.enqueued_pieces == 3)
    time.sleep(0.2)  # (time for the thread to go on, were it not held)
    assert feeder.enqueued_pieces == 3 and not snap.any() and not chunks[1].host.any()
    assert feeder.pending(chunks[0]) and feeder.busy()
    if released_by == "flush":
        feeder.flush([chunks[1]])
        assert feeder.flushed_pieces == 6 and torch.equal(snap, chunks[0].packed)
        assert torch.equal(chunks[1].host, chunks[1].packed) and not feeder.pending(chunks[0])
    else:
        waiter = threading.Thread(target=fed.synchronize, kwargs={"flush": False})
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive() and torch.equal(snap, chunks[0].packed)
    assert wait_until(lambda: not feeder.busy())  # (the thread fed the rest)
    assert all(torch.equal(c.host, c.packed) for c in chunks) and feeder.enqueued_pieces == 12
    assert feeder.flushed_pieces == (6 if released_by == "flush" else 0)
    feeder.close()


@pytest.mark.parametrize("then", ["synchronize", "close"])
def test_a_release_also_releases_the_held_copies_queued_before(then):
    """Two held batches (a save whose fill never started, or that failed before its take, then
    another save): a wait for the later one's copies at the thread's pace releases the earlier
    too (the thread cannot reach it past them), and a close enqueues every held one."""
    feeder = CopyOutFeeder(CopyStreams(torch.device("cpu")), in_flight_bytes=1000)
    chunks = [Chunk(2500, k + 1) for k in range(2)]
    snaps = [torch.zeros(2500, dtype=torch.uint8) for _ in chunks]
    first = feeder.submit_copies([(chunks[0], snaps[0], chunks[0].packed)], held=True)
    second = feeder.submit_copies([(chunks[1], snaps[1], chunks[1].packed)], held=True)
    time.sleep(0.2)
    assert feeder.enqueued_pieces == 0 and feeder.pending(chunks[0])
    if then == "close":
        feeder.close()
    else:
        waiter = threading.Thread(target=second.synchronize, kwargs={"flush": False}, daemon=True)
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive()
        first.synchronize(flush=False)
        assert feeder.flushed_pieces == 0
        feeder.close()
    assert all(torch.equal(snap, c.packed) for snap, c in zip(snaps, chunks)) and feeder.enqueued_pieces == 6


def test_a_waiter_for_submitted_copies_enqueues_them_itself_once_the_thread_failed():
    feeder, release = gated_feeder()
    chunk = Chunk(2500, 3)
    snap = torch.zeros(2500, dtype=torch.uint8)
    try:
        fed = feeder.submit_copies([(chunk, snap, chunk.packed)])
        fail_next_record(feeder)
    finally:
        release()
    waiter = threading.Thread(target=fed.synchronize, kwargs={"flush": False})
    waiter.start()
    waiter.join(10)  # (a waiter that waited for a thread that is gone would still be waiting)
    assert not waiter.is_alive()
    assert feeder.error is not None and torch.equal(snap, chunk.packed) and not feeder.pending(chunk)
    feeder.close()


def test_a_wait_for_submitted_copies_on_the_feeders_own_thread_enqueues_nothing():
    """A snapshot set's finalizer waits for the copies into it (`FedCopies.synchronize`); a
    garbage collection can run it on the feeder's thread, even inside `_enqueue_next_piece`,
    where enqueuing again would pop a piece twice: there it returns at once."""
    feeder, release = gated_feeder()
    chunk = Chunk(2500, 4)
    snap = torch.zeros(2500, dtype=torch.uint8)
    try:
        fed = feeder.submit_copies([(chunk, snap, chunk.packed)])
        thread = feeder._thread
        feeder._thread = threading.current_thread()  # (this test stands in for the feeder's thread)
        try:
            fed.synchronize()
        finally:
            feeder._thread = thread
        assert feeder.pending(chunk) and feeder.enqueued_pieces == 0 and not snap.any()
    finally:
        release()
    fed.synchronize()
    assert torch.equal(snap, chunk.packed)
    feeder.close()


@pytest.mark.parametrize("sets", ["pinned", "unpinned", "none"])
def test_an_in_place_save_leaves_its_copies_into_the_set_to_the_feeder(sets, monkeypatch):
    """[Note: device fill] with the feeder (the CPU stands in for the GPU, page locks faked): the
    save enqueues none of its copies into the snapshot set itself (a flush would queue them all
    before the save's own small reads of the device, which would wait behind them); the writer's
    fill waits for the feeder to run them (held until it starts), and the writer gets the state as
    it was at the save.
    Where nothing can be copied from the device (`unpinned`: the set could not be page-locked;
    `none`: no set to take), what the writer gets is read from the host copies: the save enqueues
    their copy-outs itself, while the feeder's thread is still held."""
    from megatron_offload import snapshot_fill
    from megatron_offload.discovery import find_state_tensors
    from test_chunked_step_cpu import MegatronShapedMany, background_saving_coord
    from test_offloader_cpu import CPU
    from test_save_snapshot_cpu import FakeLocks

    ref, opt = MegatronShapedMany(), MegatronShapedMany()
    coord, off = background_saving_coord(opt, locks=FakeLocks(fail_at=1 if sets == "unpinned" else None),
                                         copy_out_in_flight_bytes=1024)
    if sets == "none":
        monkeypatch.setattr(off.snapshots, "_choose", lambda *a: None)
    coord.offload_existing_state()
    for step in range(2):
        make_grads(ref.all_params(), step)
        ref.step()
        one_iteration(opt, coord, step)
    coord.feeder.close()
    coord.feeder, release = gated_feeder(1024)
    off.feeder = coord.feeder
    make_grads(ref.all_params(), 2)
    ref.step()
    one_iteration(opt, coord, 2)
    expected = {st.name: st.tensor.clone().view(-1) for st in find_state_tensors(ref, CPU).tensors}
    try:
        with coord.state_access(coord.offloaders, will_modify=False, host_copies_ok=True, references_only=True):
            handed = {st.name: st.tensor.view(-1) for c in off.chunks for st in c.tensors}
        fills = coord.pending_snapshot_fills()
        if sets == "pinned":
            assert coord.feeder.flushed_pieces == 0 and all(coord.feeder.pending(c) for c in off.chunks)
            assert off.snapshots.device_bytes == sum(v.nbytes for v in handed.values())
            assert fills
            # The thread feeds the copy-outs and holds the copies into the set until the fill starts.
            release()
            assert wait_until(lambda: all(torch.equal(c.host.view(-1), c.packed.view(-1)) for c in off.chunks))
            time.sleep(0.2)
            assert all(coord.feeder.pending(c) for c in off.chunks) and coord.feeder.busy()
            for fill in fills:
                fill.start()
        else:
            assert off.snapshots.device_bytes == 0 and bool(fills) == (sets == "unpinned")
            for fill in fills:
                fill.start()
            snapshot_fill.check_written(fills)
            assert_bitwise_equal({k: v.clone() for k, v in handed.items()}, expected)
    finally:
        release()
    snapshot_fill.check_written(fills)
    assert_bitwise_equal({k: v.clone() for k, v in handed.items()}, expected)
    make_grads(ref.all_params(), 3)
    ref.step()
    one_iteration(opt, coord, 3)
    coord.close()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))
