"""Copy streams shared by all offloaders of one device, and the timing of what runs on them.

On a CPU "device" (the CPU unit tests) there are no streams: every copy is synchronous and every
wait is a no-op, so the same offloader code runs unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch


@dataclasses.dataclass
class TransferTotals:
    """What moved since the last `TransferStats.harvest()`; times in milliseconds."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_ms: float = 0.0
    h2d_ms: float = 0.0
    # Time the compute stream sat waiting for a copy: before freeing (d2h) or before the step (h2d).
    exposed_d2h_ms: float = 0.0
    exposed_h2d_ms: float = 0.0
    # Accumulated over the whole run (never reset).
    cumulative_d2h_bytes: int = 0
    cumulative_h2d_bytes: int = 0

    @staticmethod
    def _gbps(nbytes: int, ms: float) -> float:
        return nbytes / ms / 1e6 if ms > 0 else 0.0

    @property
    def d2h_gbps(self) -> float:
        return self._gbps(self.d2h_bytes, self.d2h_ms)

    @property
    def h2d_gbps(self) -> float:
        return self._gbps(self.h2d_bytes, self.h2d_ms)


class TransferStats:
    """Records CUDA events around copies and compute-stream waits; reads them only when asked."""

    def __init__(self, timing: bool):
        self.timing = timing
        # The copy-out feeder's thread records copies too (copy_feeder.py): the list of copies and
        # the byte counters change under this lock.
        self._copies_lock = threading.Lock()
        # Event pairs not harvested yet (only with timing; without, just the byte counters).
        self._copies: List[Tuple[str, object, object, int]] = []
        self._waits: List[Tuple[str, object, object]] = []
        self.cumulative_d2h_bytes = 0
        self.cumulative_h2d_bytes = 0
        # Sum of everything harvested so far (timed copies and waits), for end-of-run reports.
        self.harvested = TransferTotals()
        # When a list: every compute-stream wait also appends its (before, after) events here,
        # timing or not (the automatic fraction removes the waits from its timeline).
        self.stall_sink: Optional[list] = None

    def _event(self, stream) -> Optional[torch.cuda.Event]:
        return timed_event(stream) if self.timing and stream is not None else None

    def start_copy(self, stream, direction: str):
        return (direction, self._event(stream))

    def end_copy(self, timer, stream, nbytes: int) -> None:
        direction, start = timer
        end = self._event(stream) if start is not None else None
        with self._copies_lock:
            if direction == "d2h":
                self.cumulative_d2h_bytes += nbytes
            else:
                self.cumulative_h2d_bytes += nbytes
            if start is not None:
                self._copies.append((direction, start, end, nbytes))

    @contextlib.contextmanager
    def exposed_wait(self, compute_stream, label: str):
        sink = self.stall_sink if compute_stream is not None else None
        timed = compute_stream is not None and (self.timing or sink is not None)
        before = timed_event(compute_stream) if timed else None
        yield
        if before is not None:
            after = timed_event(compute_stream)
            if sink is not None:
                sink.append((before, after))
            if self.timing:
                self._waits.append((label, before, after))

    def _add_completed_copies(self, totals: TransferTotals) -> list:
        """Add the copies whose end event has completed to `totals`; returns those still in flight."""
        in_flight = []
        for direction, start, end, nbytes in self._copies:
            if not end.query():
                in_flight.append((direction, start, end, nbytes))
                continue
            ms = start.elapsed_time(end)
            if direction == "d2h":
                totals.d2h_bytes += nbytes
                totals.d2h_ms += ms
            else:
                totals.h2d_bytes += nbytes
                totals.h2d_ms += ms
        return in_flight

    def peek(self) -> TransferTotals:
        """Totals of the completed copies not harvested yet, leaving them for `harvest`."""
        totals = TransferTotals()
        with self._copies_lock:
            self._add_completed_copies(totals)
        return totals

    def _add_completed_waits(self, totals: TransferTotals) -> list:
        """Add the compute-stream waits whose end event has completed to `totals`; returns the others."""
        pending = []
        for label, before, after in self._waits:
            if not after.query():
                pending.append((label, before, after))
                continue
            ms = before.elapsed_time(after)
            if label == "d2h":
                totals.exposed_d2h_ms += ms
            else:
                totals.exposed_h2d_ms += ms
        return pending

    def exposed_so_far(self) -> Tuple[float, float]:
        """(before free, before step) ms the compute stream waited for copies since the start,
        harvested or completed since; harvests nothing (the periodic log's windows stay whole)."""
        totals = TransferTotals()
        self._add_completed_waits(totals)
        return (self.harvested.exposed_d2h_ms + totals.exposed_d2h_ms,
                self.harvested.exposed_h2d_ms + totals.exposed_h2d_ms)

    def harvest(self) -> TransferTotals:
        """Totals of every copy/wait whose events have completed; unfinished ones stay queued."""
        totals = TransferTotals()
        with self._copies_lock:
            self._copies = self._add_completed_copies(totals)
        self._waits = self._add_completed_waits(totals)
        totals.cumulative_d2h_bytes = self.cumulative_d2h_bytes
        totals.cumulative_h2d_bytes = self.cumulative_h2d_bytes
        for field in ("d2h_bytes", "h2d_bytes", "d2h_ms", "h2d_ms", "exposed_d2h_ms", "exposed_h2d_ms"):
            setattr(self.harvested, field, getattr(self.harvested, field) + getattr(totals, field))
        return totals


def timed_event(stream) -> torch.cuda.Event:
    """A timing event recorded on `stream` now."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


class HostLeadBound:
    """Keeps the host at most `depth` pacing points (layer hooks) ahead of the compute stream.

    Why: megatron-core builds its DDP wrapper, hence every parameter's AccumulateGrad node, on a
    stream of its own, so the autograd engine marks each weight gradient as used on that stream
    (record_stream), and the caching allocator defers the gradient's free until that stream's
    event completes on the GPU. A host running far ahead of the GPU therefore allocates the next
    layers' activations while the last backward's weight gradients are freed on the host but not
    reusable yet: the requests map new memory, and *reserved* memory depends on how far ahead the
    host happened to be. The plugin's copy waits stall the GPU while the host runs on, which
    makes that lead large. With the bound, a deferred free becomes reusable at most `depth`
    layers after its request. The Megatron wiring re-creates those nodes on the compute stream
    (upstream_fixes.grad_accumulators_on_current_stream); by default the bound is on only where the
    nodes stay on DDP's stream (`--offload-keep-ddp-grad-stream`, nodes the re-creation could
    not replace: megatron_args.host_lead_layers). See [Note: host lead] in docs/design.md.
    Invariant: after `mark(d)`, at most `d` recorded points are not known to be complete (`d`:
    the bound's own depth unless the mark gives one; none kept where it is 0).
    The points are the coordinator's layer hooks: every pacing module's forward, and the backward
    hooks it registers (while state is packed). Waiting on a point already enqueued adds no
    dependency the GPU did not have, so it cannot deadlock on GPU work; a collective that blocks
    the host inside the forward or backward (a CPU-side one) would still run, one point later.
    """

    def __init__(self, stream, depth: int, new_event: Optional[Callable[[], object]] = None):
        self.stream = stream
        self._can_record = stream is not None or new_event is not None
        self.depth = depth if self._can_record else 0
        self._new_event = new_event or (lambda: stream.record_event())
        self._points: collections.deque = collections.deque()
        self.waits = 0  # marks that blocked the host, and for how long in all
        self.wait_ms = 0.0

    def at_least(self, depth: int) -> int:
        """Raise the bound to `depth` (not where nothing can be recorded); the bound now."""
        if self._can_record:
            self.depth = max(self.depth, depth)
        return self.depth

    def mark(self, depth: Optional[int] = None) -> None:
        """A pacing point was reached on the host: record it on the stream; block until the
        point `depth` marks back (the bound's own unless given) has run on the GPU."""
        depth = (self.depth if depth is None else depth) if self._can_record else 0
        if depth <= 0:
            self._points.clear()  # (left by a mark with a depth of its own)
            return
        self._points.append(self._new_event())
        while len(self._points) > depth:
            oldest = self._points.popleft()
            if not oldest.query():
                start = time.perf_counter()
                oldest.synchronize()
                self.waits += 1
                self.wait_ms += (time.perf_counter() - start) * 1e3


class CopyStreams:
    """The compute stream, one D2H and one H2D stream (separate so both directions can overlap)."""

    def __init__(self, device: torch.device, compute_stream=None, timing: bool = True):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.compute = compute_stream or torch.cuda.current_stream(self.device)
            # Created once for the life of the run: creating streams per step grows allocator pools.
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
        else:
            self.compute = self.d2h = self.h2d = None
        self.stats = TransferStats(timing=timing and self.device.type == "cuda")
        # Tests only: spin this many GPU cycles on a copy stream before each batch of copies, so
        # that a missing cross-stream wait turns into wrong numbers instead of a lucky race.
        self.debug_delay_cycles = 0

    def _on(self, stream):
        if stream is None:
            return contextlib.nullcontext(None)
        return _StreamContext(stream)

    def on_compute(self):
        return self._on(self.compute)

    def on_d2h(self):
        return self._on(self.d2h)

    def on_h2d(self):
        return self._on(self.h2d)

    def record(self, stream) -> Optional[torch.cuda.Event]:
        return None if stream is None else stream.record_event()

    def _wait_for_compute(self, stream) -> None:
        if stream is None:
            return
        stream.wait_event(self.compute.record_event())
        self.delay(stream)

    def delay(self, stream) -> None:
        """Tests: hold `stream` for `debug_delay_cycles` GPU cycles (a missing wait then shows)."""
        if self.debug_delay_cycles and stream is not None:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(self.debug_delay_cycles)

    def d2h_wait_for_compute(self) -> None:
        self._wait_for_compute(self.d2h)

    def h2d_wait_for_compute(self) -> None:
        self._wait_for_compute(self.h2d)

    def compute_wait(self, event) -> None:
        if event is not None and self.compute is not None:
            self.compute.wait_event(event)

    @staticmethod
    def host_wait(event) -> None:
        """Block the calling (host) thread until `event` has completed."""
        if event is not None:
            event.synchronize()


class _StreamContext:
    """`torch.cuda.stream(s)` that also yields the stream."""

    def __init__(self, stream):
        self.stream = stream
        self._ctx = torch.cuda.stream(stream)

    def __enter__(self):
        self._ctx.__enter__()
        return self.stream

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
