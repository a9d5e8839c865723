"""Shared-memory snapshots for asynchronous saves (save_snapshot.SaveSnapshots): each snapshot is
its own shared storage holding its source's bytes; a set is reused only once nothing else holds it;
a set still held by a pending save is never rewritten."""

import gc
import logging
import threading
import time

import pytest
import torch

from megatron_offload import save_snapshot, snapshot_fill
from megatron_offload.host_memory import HostMemoryError
from megatron_offload.save_snapshot import SaveSnapshots


def sources(seed, sizes=(300_000, 70_000), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def whole_shared(t):
    return t.is_shared() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("threads", [1, 4])
def test_a_snapshot_is_a_whole_shared_storage_with_the_source_bytes(monkeypatch, threads):
    monkeypatch.setattr(save_snapshot, "COPY_PIECE_BYTES", 4096)  # many pieces over the threads
    snaps = SaveSnapshots(check=lambda n: None, threads=threads)
    src = sources(0, dtype=torch.bfloat16) + sources(1)
    got = snaps.take(src)
    assert [g.dtype for g in got] == [s.dtype for s in src]
    assert all(whole_shared(g) for g in got)
    assert all(torch.equal(g, s) for g, s in zip(got, src))
    assert snaps.nbytes == sum(s.numel() * s.element_size() for s in src)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_source_with_a_scale_is_served_unscaled_as_te_computes_it(monkeypatch, threads):
    """An fp16 state with a scale (Transformer Engine's FusedAdam) gets an fp32 snapshot holding
    exactly what TE's `get_unscaled_state` returns, `state.float().mul_(scale)`, filled piece by
    piece; the other sources keep their bytes; a prepared set of that layout is the one taken."""
    monkeypatch.setattr(save_snapshot, "COPY_PIECE_BYTES", 4096)
    snaps = SaveSnapshots(check=lambda n: None, threads=threads)
    scaled = sources(2, dtype=torch.float16)[0] * 1000  # (large values: a lossy path would show)
    scale = torch.tensor([3.0517578125e-05 * 1.37], dtype=torch.float32)  # not a power of two
    plain = sources(3)[1]
    assert snaps.prepare([scaled, plain], unscaled=[True, False])
    made = [t.data_ptr() for t in snaps._sets[0].tensors]
    got = snaps.take([scaled, plain], as_fp32=[save_snapshot.Fp32(scale), None])
    assert [t.data_ptr() for t in got] == made
    assert got[0].dtype == torch.float32 and all(whole_shared(g) for g in got)
    expected = scaled.float().mul_(scale)
    assert torch.equal(got[0].view(torch.int32), expected.view(torch.int32))  # every bit
    assert not torch.equal(got[0], scaled.float())  # (the scale was applied)
    assert torch.equal(got[1], plain)
    assert snaps.nbytes == scaled.numel() * 4 + plain.numel() * 4
    # bf16 as fp32 without a scale: TE's `.float()`, every bit.
    bf16 = sources(4, dtype=torch.bfloat16)[1]
    got = snaps.take([bf16], as_fp32=[save_snapshot.Fp32()])
    assert got[0].dtype == torch.float32 and torch.equal(got[0], bf16.float())


def test_a_free_set_is_reused_and_a_held_one_is_never_rewritten(caplog):
    snaps = SaveSnapshots(check=lambda n: None)
    first = snaps.take(sources(0))
    ptrs = [t.data_ptr() for t in first]
    del first  # the save that read them is finalized
    again = snaps.take(sources(1))
    assert [t.data_ptr() for t in again] == ptrs  # reused: no new shared memory
    held = [t.detach() for t in again]  # a pending save's request holds these
    del again
    second = snaps.take(sources(2))
    assert [t.data_ptr() for t in second] != ptrs  # a second set
    assert all(torch.equal(h, s) for h, s in zip(held, sources(1)))  # the held set untouched
    kept = [t.detach() for t in second]
    del second
    with caplog.at_level(logging.WARNING):
        assert snaps.take(sources(3)) is None  # both held: the caller hands out its views
    assert "still held by an earlier save" in caplog.text
    assert all(torch.equal(h, s) for h, s in zip(held, sources(1)))
    assert all(torch.equal(k, s) for k, s in zip(kept, sources(2)))
    del held
    third = snaps.take(sources(3))
    assert [t.data_ptr() for t in third] == ptrs and all(torch.equal(t, s) for t, s in zip(third, sources(3)))


def test_a_set_held_only_by_a_reference_cycle_is_reused_after_one_collection():
    """A finalized save's request can stay alive in a reference cycle until the garbage collector
    runs: `take` collects once rather than make a second set, and counts the collection's time."""
    snaps = SaveSnapshots(check=lambda n: None)
    enabled = gc.isenabled()
    gc.disable()  # (no automatic collection may free the cycle first)
    try:
        first = snaps.take(sources(0))
        ptrs = [t.data_ptr() for t in first]
        request = {"tensors": [t.detach() for t in first]}  # (what a save keeps: its own tensors)
        request["self"] = request  # the finalized request, in a cycle
        del first, request
        again = snaps.take(sources(1))
        assert [t.data_ptr() for t in again] == ptrs and len(snaps._sets) == 1
        assert snaps.collections == 1 and snaps.collect_seconds > 0
        del again  # freed at once: no collection
        snaps.take(sources(2))
        assert snaps.collections == 1
    finally:
        if enabled:
            gc.enable()


def test_a_new_layout_gets_a_new_set_and_the_old_one_goes():
    snaps = SaveSnapshots(check=lambda n: None)
    snaps.take(sources(0))
    other = snaps.take(sources(1, sizes=(1000,)))
    assert len(other) == 1 and torch.equal(other[0], sources(1, sizes=(1000,))[0])
    assert snaps.nbytes == 4000  # the first set (free, of the old layout) was dropped


def test_no_room_for_a_set_hands_back_none_with_one_warning(caplog):
    def refuse(nbytes):
        raise HostMemoryError(f"no room for {nbytes}")

    snaps = SaveSnapshots(check=refuse)
    with caplog.at_level(logging.WARNING):
        assert snaps.take(sources(0)) is None
        assert snaps.take(sources(0)) is None
    assert caplog.text.count("no room for 1480000") == 1
    assert snaps.nbytes == 0


def test_too_few_file_descriptors_hand_back_none(monkeypatch):
    """A set of n snapshots needs room for 2n descriptors (n kept, n duplicated by the worker
    queue while a save is sent) besides those open and the margin."""
    import os

    open_now = len(os.listdir("/proc/self/fd"))
    src = sources(0)  # two tensors
    for limit, made in ((open_now + save_snapshot.FD_MARGIN + 3, False), (open_now + save_snapshot.FD_MARGIN + 6, True)):
        monkeypatch.setattr(save_snapshot.resource, "getrlimit", lambda what, limit=limit: (limit, 10**6))
        snaps = SaveSnapshots(check=lambda n: None)
        assert (snaps.take(src) is not None) == made, limit


def test_without_storage_reference_counts_no_set_is_made(monkeypatch):
    """No way to tell when a pending save lets go of a set: no set (the views instead)."""
    monkeypatch.setattr(save_snapshot, "_STORAGE_USE_COUNT", None)
    snaps = SaveSnapshots(check=lambda n: None)
    assert snaps.take(sources(0)) is None and snaps.nbytes == 0


def test_only_large_tensors_get_snapshots_unless_filled_in_the_background():
    big = torch.empty(save_snapshot.MIN_SNAPSHOT_BYTES // 4, dtype=torch.float32)
    snaps = SaveSnapshots(check=lambda n: None)
    assert snaps.selects(big) and not snaps.selects(big[:-1])
    snaps.background = True  # (a small view would be cloned, i.e. read, before the writer waits)
    assert snaps.selects(big[:1]) and not snaps.selects(big[:0])


def gated_take(snaps, src):
    """`take` in the background whose fill waits until the returned gate is set."""
    gate = threading.Event()
    got = snaps.take(src, before=lambda: gate.wait(10), background=True)
    return got, gate


def test_a_background_fill_returns_at_once_and_the_writer_waits_for_its_flag():
    """[Note: background fill]: `take` returns before the copy; the writer's function
    (`writer_waits`, in the writer's process) runs only once the fill's flag is set, and then
    reads every source byte; the set counts as held while it fills; the fill is pending for every
    request until it is done (a second save before the next forward reads the same set); the
    snapshots are shared by name and cross by name under `handed_over_by_name` (no copy into new
    shared memory)."""
    from torch.multiprocessing.reductions import reduce_storage

    snaps = SaveSnapshots(check=lambda n: None)
    snaps.background = True
    src = sources(0)
    got, gate = gated_take(snaps, src)
    (fill,) = snaps.pending_fills()
    assert snaps.pending_fills() == [fill] and not fill.started  # (until the request is with the writer)
    assert int(fill.flag[0]) == 0 and not fill.done and snaps.filling(got[0]) and snaps.filling(got[1][5:])
    assert not snaps.filling(src[0])
    ptrs = [t.untyped_storage().data_ptr() for t in got]
    del got
    assert snaps._sets[0].in_use()  # (the fill's own pieces: no later save may take the set)
    seen = []
    writer = threading.Thread(target=snapshot_fill.writer_waits,
                              args=([fill.flag], lambda *a, **k: seen.append((a, k, [t.clone() for t in snaps._sets[0].tensors]))),
                              kwargs={"x": 1})
    writer.start()
    time.sleep(0.1)
    assert not seen  # still waiting
    fill.start()  # (as megatron_saves does once the request is with the writer)
    time.sleep(0.1)
    assert fill.started and not seen  # (the copy waits at the gate)
    gate.set()
    writer.join(10)
    assert len(seen) == 1 and seen[0][:2] == ((), {"x": 1})
    assert all(torch.equal(a, b) for a, b in zip(seen[0][2], src))
    snaps.wait_filled()
    assert int(fill.flag[0]) == 1 and not snaps.filling(snaps._sets[0].tensors[0]) and snaps.pending_fills() == []
    snapshot_fill.check_written([fill])
    assert not snaps._sets[0].in_use()
    with snapshot_fill.handed_over_by_name():
        rebuild = reduce_storage(snaps._sets[0].tensors[0].untyped_storage())[0]
    assert rebuild.__name__ == "rebuild_storage_filename"
    assert [t.untyped_storage().data_ptr() for t in snaps._sets[0].tensors] == ptrs
    assert torch.multiprocessing.get_sharing_strategy() != "file_system"  # (restored)


def test_a_failed_fill_fails_the_save_and_the_writer_does_not_hang():
    snaps = SaveSnapshots(check=lambda n: None)
    snaps.background = True

    def broken():
        raise OSError("no")

    snaps.take(sources(0), before=broken, background=True)
    (fill,) = snaps.pending_fills()
    fill.start()
    assert snapshot_fill.writer_waits([fill.flag], lambda: "written") == "written"
    assert int(fill.flag[0]) == -1
    with pytest.raises(RuntimeError, match="filling .* must not be used"):
        snapshot_fill.check_written([fill])
    snaps.wait_filled()  # (never raises: whatever rewrites the sources goes on)
    assert snaps.pending_fills() == [fill]  # every later save that may read the set fails too


def test_a_fill_nobody_started_starts_when_waited_for(monkeypatch):
    """A background fill starts with `Fill.start` (megatron_saves, once the request is with the
    writer) or with the first wait for it: a reader of values or a copy-out never waits for ever."""
    snaps = SaveSnapshots(check=lambda n: None)
    snaps.background = True
    src = sources(0)
    ran = []
    got = snaps.take(src, before=lambda: ran.append(1), background=True)
    time.sleep(0.2)
    (fill,) = snaps.pending_fills()
    assert not ran and not fill.started and not fill.done
    assert snaps.fill_wait_seconds == 0.0
    snaps.wait_filled()
    assert ran == [1] and fill.done and int(fill.flag[0]) == 1 and snaps.pending_fills() == []
    assert snaps.fill_wait_seconds > 0  # (counted: it had not finished)
    assert all(torch.equal(a, b) for a, b in zip(got, src))
    waited = snaps.fill_wait_seconds
    snaps.wait_filled()
    assert snaps.fill_wait_seconds == waited  # (nothing pending: no wait counted)
    monkeypatch.setattr(save_snapshot, "BACKGROUND_FILL_AT_TAKE", True)  # (the benchmark's @fillearly)
    del got
    snaps.take(src, before=lambda: time.sleep(0.5), background=True)
    (fill,) = snaps._fills
    assert fill.started
    snaps.wait_filled()


def test_a_fill_whose_thread_cannot_start_fails_without_raising(monkeypatch):
    """`Fill.start` runs where the request is already with the writer (megatron_saves, in a
    `finally`): a thread that cannot be started must not raise there, and its flag must tell the
    writer to stop waiting; the save then fails at finalize."""
    snaps = SaveSnapshots(check=lambda n: None)
    snaps.background = True
    snaps.take(sources(0), background=True)
    (fill,) = snaps.pending_fills()

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    fill.start()  # (no exception)
    assert fill.done and int(fill.flag[0]) == -1
    assert snapshot_fill.writer_waits([fill.flag], lambda: "written") == "written"  # (at once)
    with pytest.raises(RuntimeError, match="filling .* must not be used"):
        snapshot_fill.check_written([fill])
    snaps.wait_filled()  # (never raises, nothing to join)
    assert snaps.pending_fills() == [fill]


def test_a_writer_that_stops_waiting_fails_the_save(monkeypatch):
    monkeypatch.setattr(snapshot_fill, "FILL_TIMEOUT_S", 0.05)
    snaps = SaveSnapshots(check=lambda n: None)
    snaps.background = True
    _, gate = gated_take(snaps, sources(0))
    (fill,) = snaps.pending_fills()
    assert snapshot_fill.writer_waits([fill.flag], lambda: "written") == "written"
    gate.set()
    fill.wait()  # (the fill itself succeeded, after the writer gave up)
    with pytest.raises(RuntimeError, match="stopped waiting"):
        snapshot_fill.check_written([fill])


def test_a_reader_of_values_gets_its_snapshots_filled_in_background_mode_too():
    """A `take` not marked background (a reader that reads the values itself) fills before it
    returns, also where the sets are made for background fills; nothing is left pending."""
    snaps = SaveSnapshots(check=lambda n: None)
    snaps.background = True
    src = sources(0)
    seen = []
    got = snaps.take(src, before=lambda: seen.append(threading.current_thread()))
    assert seen == [threading.current_thread()] and snaps.pending_fills() == []
    assert all(torch.equal(a, b) for a, b in zip(got, src))


def _check_on_rank(rank, world, port, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        snaps = SaveSnapshots(check=lambda n: None)
        snaps.background = True
        results = []
        for failing in (False, True):  # a clean save, then one whose fill fails on rank 0 only
            if failing and rank == 0:
                def broken():
                    raise OSError("no")

                snaps.take(sources(0), before=broken, background=True)
            elif rank == 0:
                snaps.take(sources(0), background=True)
            fills = snaps.pending_fills()
            for fill in fills:
                fill.join()
            try:
                snapshot_fill.check_written(fills)
                results.append("passed")
            except RuntimeError as err:
                results.append("raised: " + ("another rank" if "another rank" in str(err) else "here"))
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


def test_a_fill_failed_on_one_rank_fails_the_save_on_every_rank():
    """`check_written` is collective: a rank whose own fills are fine (or that has none) raises
    too, instead of waiting in megatron-core's collective finalize for the rank that raised."""
    from fakes import run_on_gloo_ranks

    got = run_on_gloo_ranks(_check_on_rank, 2)
    assert got == {0: ["passed", "raised: here"], 1: ["passed", "raised: another rank"]}, got


def test_what_rewrites_or_frees_the_sources_waits_for_the_fill():
    """`drop_free` (a re-pack frees the pinned buffer) and `close` return only once the fill
    has read its sources."""
    for method in ("drop_free", "close"):
        snaps = SaveSnapshots(check=lambda n: None)
        snaps.background = True
        src = sources(0)
        got, gate = gated_take(snaps, src)
        done = threading.Event()
        t = threading.Thread(target=lambda: (getattr(snaps, method)(), done.set()))
        t.start()
        time.sleep(0.1)
        assert not done.is_set(), method
        gate.set()
        t.join(10)
        assert done.is_set() and all(torch.equal(a, b) for a, b in zip(got, src)), method


def test_a_prepared_set_is_the_one_the_first_save_takes():
    snaps = SaveSnapshots(check=lambda n: None)
    src = sources(0)
    assert snaps.prepare([torch.empty(t.shape, dtype=t.dtype) for t in src])
    made = [t.data_ptr() for s in snaps._sets for t in s.tensors]
    got = snaps.take(src)
    assert [t.data_ptr() for t in got] == made and all(torch.equal(g, s) for g, s in zip(got, src))
    assert snaps.prepare(src) and len(snaps._sets) == 1  # (one per layout)


def test_a_new_layout_drops_the_free_sets_of_the_old_one_and_keeps_held_ones():
    snaps = SaveSnapshots(check=lambda n: None)
    old = sources(0)
    assert snaps.prepare(old)
    held = snaps.take(old)[0].detach()  # a pending save of the old layout
    snaps.take(old)  # (a second set of the old layout, free again at once)
    assert len(snaps._sets) == 2
    snaps.drop_free()
    assert len(snaps._sets) == 1  # only the held one
    new = sources(1, sizes=(5000,))
    assert snaps.prepare(new) and len(snaps._sets) == 2 and snaps._sets[1].fits(save_snapshot._layout(new))
    del held
    snaps.drop_free()
    assert len(snaps._sets) == 0


def test_a_set_held_only_by_a_dead_reference_cycle_is_reused():
    """A finalized save's request can linger in a reference cycle until the garbage collector
    runs (megatron-core's save path with torch 2.8): `take` collects before making a new set."""
    import gc

    class Request:
        pass

    snaps = SaveSnapshots(check=lambda n: None)
    first = snaps.take(sources(0))
    ptrs = [t.data_ptr() for t in first]
    enabled = gc.isenabled()
    gc.disable()
    try:
        request = Request()
        request.cycle, request.tensors = request, [t.detach() for t in first]
        del request, first
        again = snaps.take(sources(1))
    finally:
        if enabled:
            gc.enable()
    assert [t.data_ptr() for t in again] == ptrs and len(snaps._sets) == 1


class FakeLocks:
    """cudaHostRegister / cudaHostUnregister for CPU tests: which pointers are page-locked."""

    def __init__(self, fail_at=None):
        self.locked, self.calls, self.fail_at = set(), 0, fail_at

    def register(self, ptr, nbytes):
        self.calls += 1
        if self.calls == self.fail_at:
            return 1  # (cudaErrorInvalidValue)
        self.locked.add(ptr)
        return 0

    def unregister(self, ptr):
        self.locked.remove(ptr)
        return 0


def device_filled(locks, **kw):
    snaps = SaveSnapshots(check=lambda n: None, register=locks.register, unregister=locks.unregister, **kw)
    snaps.background = snaps.device_fill = True
    return snaps


def test_a_device_fill_copies_into_the_set_the_next_take_hands_out_and_take_skips_those():
    """[Note: device fill]: `copy_from_device` writes the given positions into a page-locked set;
    the next `take` of that layout hands out that very set and copies only the other positions
    (here the take's own sources differ from the device's at the copied position, so a take
    that rewrote it would show); positions served as fp32 are never copied from the device."""
    locks = FakeLocks()
    snaps = device_filled(locks)
    host = sources(1, sizes=(1000, 2000, 300))
    device = [host[0] + 1, None, host[2] + 7]  # (stand-ins for the GPU buffers: other values, to tell them apart)
    unscaled = [False, False, True]
    nbytes = snaps.copy_from_device(host, unscaled, device)
    (made,) = snaps._sets
    assert made.pinned and locks.locked == {t.data_ptr() for t in made.tensors}
    assert nbytes == 1000 * 4 and snaps.device_bytes == 0
    fp32 = [None, None, save_snapshot.Fp32(None)]
    got = snaps.take(host, fp32, background=True)
    snaps.wait_filled()
    assert [t.data_ptr() for t in got] == [t.data_ptr() for t in made.tensors]
    assert torch.equal(got[0], device[0]) and torch.equal(got[1], host[1]) and torch.equal(got[2], host[2])
    assert snaps.device_bytes == 1000 * 4
    # Nothing claimed: the next take fills every position itself.
    del got
    got = snaps.take(host, fp32, background=False)
    assert torch.equal(got[0], host[0]) and snaps.device_bytes == 1000 * 4


def test_a_claim_of_another_layout_is_not_used():
    """A take of another layout than the claim's (e.g. chunks still exposed by an earlier save are
    left out of it) fills everything on the host."""
    snaps = device_filled(FakeLocks())
    host = sources(2, sizes=(1000, 2000))
    snaps.copy_from_device(host, [False, False], [host[0] + 1, host[1] + 1])
    got = snaps.take(host[:1], background=True)
    snaps.wait_filled()
    assert torch.equal(got[0], host[0]) and snaps.device_bytes == 0


def test_a_set_that_cannot_be_page_locked_is_filled_on_the_host(monkeypatch, caplog):
    """A registration that fails unlocks what it had locked, clears CUDA's error, warns once, and
    the set is filled on the host (no device copies enqueued)."""
    cleared = []
    monkeypatch.setattr(save_snapshot.host_buffer, "clear_cuda_error", lambda: cleared.append(1))
    locks = FakeLocks(fail_at=2)
    snaps = device_filled(locks)
    host = sources(3, sizes=(1000, 2000))
    with caplog.at_level(logging.WARNING, logger="megatron_offload.save_snapshot"):
        assert snaps.copy_from_device(host, [False, False], [host[0] + 1, host[1] + 1]) == 0
    assert cleared and locks.locked == set() and not snaps._sets[0].pinned
    assert "could not be page-locked" in caplog.text
    got = snaps.take(host, background=False)
    assert torch.equal(got[0], host[0]) and torch.equal(got[1], host[1])


def test_dropped_and_closed_sets_are_unlocked():
    """Sets dropped for a new layout, and every set at `close`, give their page locks back (also
    one still held by a pending save: its shared memory stays valid for the writer)."""
    locks = FakeLocks()
    snaps = device_filled(locks)
    a = sources(4, sizes=(1000, 2000))
    snaps.copy_from_device(a, [False, False], list(a))
    held = [t.view(-1) for t in snaps.take(a, background=False)]  # (what a request holds: other tensors)
    first = {t.data_ptr() for t in held}
    b = sources(5, sizes=(500,))
    snaps.copy_from_device(b, [False], list(b))  # another layout: a second set; the held one stays locked
    assert len(snaps._sets) == 2 and first <= locks.locked
    del held
    snaps.drop_free()
    assert locks.locked == set()
    got = snaps.take(b, background=False)
    assert len(snaps._sets) == 1 and locks.locked == {t.data_ptr() for t in got}
    snaps.close()
    assert locks.locked == set() and torch.equal(got[0], b[0])


def test_a_claim_left_by_a_failed_save_is_never_used():
    """A save that claimed a set and failed before its `take` leaves the claim; the next
    background save forgets it first (`forget_claim`), and no take but a background one uses a
    claim: the writer never gets positions that no copy of this save wrote."""
    snaps = device_filled(FakeLocks())
    host = sources(6, sizes=(1000, 2000))
    snaps.copy_from_device(host, [False, False], [host[0] + 1, host[1] + 1])  # (its save then failed)
    got = snaps.take(host, background=False)  # a take that is not a device-filled save's
    assert torch.equal(got[0], host[0]) and snaps.device_bytes == 0
    del got
    snaps.copy_from_device(host, [False, False], [host[0] + 1, host[1] + 1])
    snaps.forget_claim()  # (the next background save begins)
    got = snaps.take(host, background=True)
    snaps.wait_filled()
    assert torch.equal(got[0], host[0]) and torch.equal(got[1], host[1]) and snaps.device_bytes == 0


def test_a_failed_unlock_clears_the_cuda_error_and_warns(monkeypatch, caplog):
    """cudaHostUnregister failing (here for every page range) must not leave CUDA's last error
    for an unrelated kernel launch to raise: it is cleared, and said once."""
    cleared = []
    monkeypatch.setattr(save_snapshot.host_buffer, "clear_cuda_error", lambda: cleared.append(1))
    locks = FakeLocks()
    locks.unregister = lambda ptr: 1  # (cudaErrorInvalidValue)
    snaps = device_filled(locks)
    host = sources(7, sizes=(1000, 2000))
    snaps.copy_from_device(host, [False, False], list(host))
    with caplog.at_level(logging.WARNING, logger="megatron_offload.snapshot_set"):
        snaps.close()
    assert cleared == [1] and "unlocking" in caplog.text
