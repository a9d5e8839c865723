"""Copy-outs fed to the GPU a few pieces at a time by a host thread (`--offload-copy-out-in-flight-mb`,
`OffloadConfig.copy_out_in_flight_bytes`; on by default with the streamed step).

Why: a GPU's copy engine runs the D2H copies given to it in order. The training loop reads small
results to the host right after the optimizer step (Megatron's update flag and loss), and each such
read is a D2H copy too: queued behind the copy-out of the whole optimizer state it blocks the host
for all of it, and the next iteration is not enqueued meanwhile. So by default the copy-out waits
for the next forward (coordinator.optimizer_step_done). With the feeder it starts when the step
is done (with the chunked step: when each piece is stepped), but only about `in_flight_bytes` of
it are ever queued on the GPU (the thread tops the queue up while less is in flight, one piece of
at most that size at a time): a read waits behind at most those. The thread keeps the copy engine
busy while the main thread is blocked in such a read. An asynchronous save's copies from the GPU into
its snapshot set are fed the same way (`submit_copies`; [Note: device fill] in save_snapshot.py),
held until the save's fill starts (once its request is with the writer, or when something waits
for the fill; a free flushes them before): the save's own planning reads the device, and
megatron-core copies what stays on the GPU, on the same copy engine.

Invariants:
* Pieces are enqueued on the D2H stream in submission order, each batch after a wait on the
  compute-stream event recorded when it was submitted (the step that wrote the state).
* A chunk's `ready` event is recorded right after its last piece of any batch. Until then the chunk is
  `pending` and has no `ready`: whoever needs it (a free, a take-back, a phase switch, a re-pack)
  calls `flush` first, which enqueues every piece up to that chunk from the caller's thread.
* A chunk's `ready` is set before it leaves `pending`, so a caller that reads `pending()` without
  the lock (`OptimizerStateOffloader.copied_out`) and finds it False also finds its `ready`.
* The thread leaves a held batch, and every batch after it, until it is released; `flush` and
  `close` enqueue it all the same (holding delays copies, never skips them).
* Enqueuing and `flush` hold one lock, so a piece is enqueued at least once and leaves the queue
  only once all its bookkeeping is done (a failure half-way enqueues the same copy again later,
  which writes the same bytes). If the thread fails, it says so in the log and the callers enqueue
  everything themselves from then on, eagerly, as without the feeder (slower, never wrong).
* The copy timings (D2H GB/s in the log) span a batch from its first piece to its last, gaps
  where the queue waited for the thread included: they read low with the feeder.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from typing import Deque, Dict, List, Optional, Tuple

import torch

# Pieces the thread enqueues (a piece must be well below the in-flight bound for the bound to mean
# anything; `copy_piece_bytes` overrides it when smaller).
FEED_PIECE_BYTES = 64 * 2**20
# How long the thread sleeps between polls of the oldest piece in flight (the poll releases the
# GIL, so the training loop's host thread is not held up by it).
POLL_SECONDS = 50e-6
# How often a caller waiting for the thread to enqueue a batch checks that the thread still runs.
WAIT_POLL_SECONDS = 0.01


logger = logging.getLogger(__name__)
# Feeders not closed yet: closed at interpreter exit (a weak set, so that a coordinator dropped
# without close() can still be collected).
_LIVE: "weakref.WeakSet[CopyOutFeeder]" = weakref.WeakSet()
# At exit, how long to wait for copies still running (a hung compute stream must not hang the exit).
EXIT_WAIT_SECONDS = 10.0


@atexit.register
def _close_live_feeders() -> None:
    # Why: nothing in Megatron's loop closes the coordinator at exit; copies the thread has not
    # enqueued must not be left to the interpreter's teardown (which frees the pinned buffers).
    for feeder in list(_LIVE):
        feeder.close(wait_seconds=EXIT_WAIT_SECONDS)


class _Batch:
    """Copies submitted together: one offloader's stale chunks after a step or a piece
    (`submit`), or copies of chunks' tensors into other host memory (`submit_copies`), as
    pieces (chunk, dst, src) of at most `step` bytes."""

    def __init__(self, copies, after, step: int):
        self.after = after  # compute-stream event the first piece waits for (None on CPU)
        self.pieces: Deque[Tuple[object, torch.Tensor, torch.Tensor]] = collections.deque()
        self.nbytes = 0
        for chunk, dst, src in copies:
            # (views of the memory itself: a reshape of a non-contiguous tensor would copy)
            assert dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel(), (dst.shape, src.shape)
            dst, src = dst.view(-1), src.view(-1)
            size = dst.element_size()
            per = max(1, step // size)
            for start in range(0, dst.numel(), per):
                self.pieces.append((chunk, dst[start:start + per], src[start:start + per]))
            self.nbytes += dst.numel() * size
        self.started = False
        self.timer = None
        self.enqueued = threading.Event()  # set once its last piece is enqueued
        self.last = None  # the event after its last piece (None on CPU)
        self.held = False  # the thread leaves it (and every batch after it) until it is released


class FedCopies:
    """What `submit_copies` returns: `synchronize` waits until the copies have run (releasing
    them first if they were submitted held)."""

    def __init__(self, feeder, batch):
        self._feeder = feeder
        self._batch = batch

    def release(self) -> None:
        """Let the thread feed copies submitted `held` (a no-op otherwise)."""
        self._feeder._release(self._batch)

    def synchronize(self, flush: bool = True) -> None:
        """Block until every piece has run. `flush`: enqueue the pieces the thread has not yet,
        from this thread, at once; else wait for the thread to enqueue them (at its bounded pace;
        the caller enqueues them itself only if the thread is gone)."""
        self.release()
        self._feeder._wait_enqueued(self._batch, flush)
        if self._batch.enqueued.is_set() and self._batch.last is not None:
            self._batch.last.synchronize()


class CopyOutFeeder:
    """Feeds the D2H of submitted chunks to the copy stream, about `in_flight_bytes` queued."""

    def __init__(self, streams, in_flight_bytes: int):
        if in_flight_bytes <= 0:
            raise ValueError("in_flight_bytes must be > 0")
        self.streams = streams
        self.in_flight_bytes = int(in_flight_bytes)
        self._lock = threading.Condition()
        self._batches: Deque[_Batch] = collections.deque()
        self._pending: Dict[int, int] = {}  # id() of chunks -> their pieces not enqueued yet
        self._in_flight: Deque[Tuple[Optional[torch.cuda.Event], int]] = collections.deque()
        self._in_flight_bytes = 0  # sum over `_in_flight`
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.error: Optional[BaseException] = None  # what stopped the thread, if anything
        self.flushed_pieces = 0  # pieces enqueued by `flush` (the caller's thread), for the report
        self.enqueued_pieces = 0  # all pieces enqueued, by either thread
        _LIVE.add(self)

    # ------------------------------------------------------------------ main thread
    def submit(self, offloader, chunks: List) -> None:
        """Copy `chunks` (COPYING_OUT, host copy marked current by the caller) out behind the
        compute stream's work enqueued so far."""
        chunks = [c for c in chunks if c.nbytes]
        if not chunks:
            return
        step = min(offloader.copy_piece_bytes or FEED_PIECE_BYTES, FEED_PIECE_BYTES, self.in_flight_bytes)
        self._add(_Batch([(c, c.host, c.packed) for c in chunks], self.streams.record(self.streams.compute), step))

    def submit_copies(self, copies: List, held: bool = False) -> FedCopies:
        """Feed `copies`, (chunk, dst, src) with `src` a view of the chunk's device buffer and
        `dst` host memory of its size, like copy-outs: after the compute stream's work enqueued so
        far and after every copy submitted before, in pieces, about `in_flight_bytes` queued. A
        chunk stays `pending` (and its `ready` unset) until its last piece of any batch is
        enqueued, so that whoever frees it waits for these copies too. `held`: the thread starts
        on them (and on anything submitted later) only once they are released
        (`FedCopies.release` or `synchronize`); a `flush` enqueues them all the same."""
        step = min(FEED_PIECE_BYTES, self.in_flight_bytes)
        batch = _Batch([c for c in copies if c[1].numel()], self.streams.record(self.streams.compute), step)
        batch.held = held
        if batch.pieces:
            self._add(batch)
        else:
            batch.enqueued.set()
        return FedCopies(self, batch)

    def _add(self, batch: _Batch) -> None:
        with self._lock:
            self._batches.append(batch)
            for chunk, _, _ in batch.pieces:
                self._pending[id(chunk)] = self._pending.get(id(chunk), 0) + 1
            if self._closed or self.error is not None:
                # No thread (closed: a checkpoint access once detached; or it failed): all now.
                self._enqueue_all()
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="megatron-offload-copy-out", daemon=True)
                self._thread.start()
            self._lock.notify()

    def pending(self, chunk) -> bool:
        return id(chunk) in self._pending

    def busy(self) -> bool:
        """Whether copies it feeds may still wait or run: pieces not enqueued yet, or the last piece
        the thread enqueued not finished (pieces finish in order: one D2H stream). False without
        the thread (closed or failed: everything was enqueued eagerly, as without a feeder)."""
        with self._lock:
            if self._thread is None or self.error is not None:
                return False
            if self._batches:
                return True
            last = self._in_flight[-1][0] if self._in_flight else None
            return last is not None and not last.query()

    def flush(self, chunks: Optional[List] = None) -> None:
        """Enqueue now, from this thread, every piece up to the last of `chunks` (all if None)
        that the thread has not enqueued yet; their `ready` events exist afterwards."""
        with self._lock:
            wanted = set(self._pending) if chunks is None else {id(c) for c in chunks} & self._pending.keys()
            while wanted & self._pending.keys():
                self._enqueue_next_piece()
                self.flushed_pieces += 1

    def close(self, wait_seconds: Optional[float] = None) -> None:
        """Enqueue what is left, stop the thread and wait for the copies: without limit, or for at
        most `wait_seconds` (at exit). Idempotent."""
        with self._lock:
            self._enqueue_all()
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._wait_for_copies(wait_seconds)
        _LIVE.discard(self)

    def _wait_for_copies(self, wait_seconds: Optional[float]) -> None:
        stream = self.streams.d2h
        if stream is None:
            return
        if wait_seconds is None:
            stream.synchronize()
            return
        deadline = time.monotonic() + wait_seconds
        while not stream.query() and time.monotonic() < deadline:
            time.sleep(0.01)

    # ------------------------------------------------------------------ either thread (lock held)
    def _enqueue_all(self) -> None:
        while self._batches:
            self._enqueue_next_piece()

    def _enqueue_next_piece(self) -> None:
        """Enqueue the first piece not enqueued yet. It leaves the queue only once everything
        below has succeeded: if anything raises, the next caller enqueues it again."""
        batch = self._batches[0]
        chunk, dst, src = batch.pieces[0]
        s = self.streams
        with s.on_d2h() as stream:
            if not batch.started:
                # Why: the D2H must read the state only after the compute stream has finished
                # writing it (the step enqueued before `submit`).
                if batch.after is not None:
                    stream.wait_event(batch.after)
                s.delay(stream)  # (tests: copy-stream delays)
                batch.timer = s.stats.start_copy(stream, "d2h")
                batch.started = True
            dst.copy_(src, non_blocking=True)
            event = s.record(stream)
            last_of_batch = len(batch.pieces) == 1
            if last_of_batch:
                s.stats.end_copy(batch.timer, stream, batch.nbytes)
        # Bookkeeping (cannot fail): the piece is enqueued.
        batch.pieces.popleft()
        self.enqueued_pieces += 1
        left = self._pending[id(chunk)] - 1
        if left:
            self._pending[id(chunk)] = left
        else:
            chunk.ready = event
            del self._pending[id(chunk)]
        if last_of_batch:
            self._batches.popleft()
            batch.last = event
            batch.enqueued.set()
            self._lock.notify()  # (a thread waiting at a held batch that a flush just enqueued)
        nbytes = dst.numel() * dst.element_size()
        if self._thread is not None and self.error is None and event is not None:
            # Only the thread reads this window (`_queued_bytes`); without it nothing drains it.
            self._in_flight.append((event, nbytes))
            self._in_flight_bytes += nbytes

    def _release(self, batch: _Batch) -> None:
        """`batch` and every held batch queued before it (the thread could not reach it past them:
        one whose fill never started, a save that failed before its take) go to the thread."""
        with self._lock:
            if not batch.held:
                return
            batch.held = False
            if not batch.enqueued.is_set():
                for queued in self._batches:
                    if queued is batch:
                        break
                    queued.held = False
            self._lock.notify()

    def _wait_enqueued(self, batch: _Batch, flush: bool) -> None:
        """Until `batch`'s last piece is enqueued: enqueued from here at once (`flush`, or no
        thread to do it), else left to the thread. On the thread itself (a finalizer that a
        garbage collection ran there, perhaps inside `_enqueue_next_piece`) nothing is enqueued
        and nothing waited for: the pieces left go on as they are, into memory they keep alive."""
        if threading.current_thread() is self._thread:
            return
        while not batch.enqueued.is_set():
            with self._lock:
                if flush or self._thread is None or self.error is not None:
                    while not batch.enqueued.is_set():
                        self._enqueue_next_piece()
                        self.flushed_pieces += 1
                    return
            batch.enqueued.wait(WAIT_POLL_SECONDS)

    def _queued_bytes(self) -> int:
        """Bytes enqueued and not finished, dropping finished pieces from the front."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight_bytes -= self._in_flight.popleft()[1]
        return self._in_flight_bytes

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            if self.streams.device.type == "cuda":
                torch.cuda.set_device(self.streams.device)
            while True:
                with self._lock:
                    while (not self._batches or self._batches[0].held) and not self._closed:
                        self._lock.wait()
                    if self._closed and not self._batches:
                        return
                    if self._queued_bytes() < self.in_flight_bytes:
                        self._enqueue_next_piece()
                        continue
                time.sleep(POLL_SECONDS)
        except BaseException as err:  # noqa: BLE001 - the callers take over (module docstring)
            logger.warning("megatron-offload: the copy-out thread failed; copy-outs are enqueued eagerly from "
                           "now on", exc_info=err)
            with self._lock:
                self.error = err
                self._in_flight.clear()
                self._in_flight_bytes = 0
