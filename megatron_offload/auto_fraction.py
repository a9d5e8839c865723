"""`--offload-state-fraction auto`: measure this run's windows, then offload what moves for free.

The planner (`planner.py`) computes, from the timeline of one iteration *without* offloading and
the copy bandwidth, how many state bytes can leave the peak at no cost. In a real job there is no
such iteration to look at: the user may not fit without offloading. So the automatic mode offloads
everything for the first iterations and, in one of them (`OffloadCoordinator.auto_fraction_at`), records

* CUDA events on the compute stream at the phase boundaries the planner uses (forward and
  backward of every microbatch, the optimizer step), with the activation bytes at each (allocated
  memory minus the chunk buffers that are allocated at that moment, so the state's own comings and
  goings do not count);
* the compute stream's waits for our copies (events around each wait), which are removed from
  the timeline: what is left is the compute-only timeline the planner expects;
* the achieved D2H/H2D bandwidth of that iteration's copies.

After that iteration's step it picks the fraction: what the planner says is free, but never less
than what keeps the predicted peak within the memory this GPU has (`room_bytes`: more state kept
resident raises the peak by exactly the bytes kept). Offloaders are then re-packed with it
(`OptimizerStateOffloader.refresh`) before the copy-out of that step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, List, Optional, Tuple

import torch

from . import planner
from .streams import timed_event

# Both directions at once, as a share of the sum of the two. One GPU copying alone gets a larger
# share than this. But the ranks of a data-parallel job copy at the same moment, and GPUs of one
# host copying both ways at once each get less (one way only, they still get their full rate): that
# is the share the job sees. See [Note: both-directions share] in docs/design.md.
BOTH_DIRECTIONS_SHARE = 0.68
# Left free on the device beyond the predicted peak when memory bounds the fraction.
MEMORY_SAFETY_BYTES = 2 * 2**30


@dataclasses.dataclass
class Choice:
    fraction: float
    free_fraction: float  # what the planner says moves at no cost
    fit_fraction: float  # the least that keeps the peak within the memory available
    iteration_ms: float  # compute-only timeline of the calibration iteration
    stalls_ms: float  # compute-stream waits removed from it
    d2h_gbps: float
    h2d_gbps: float
    own_free_fraction: float = -1.0  # this rank's own measurement, when the group agreed on less
    # The free fraction of the same timeline with its first forward untrimmed: an upper bound
    # (`first_forward_as_the_others`), which the second calibration may not exceed (unless
    # `refine(capped=False)`).
    free_upper: float = -1.0
    calibrations: int = 1

    def describe(self) -> str:
        bound = "memory" if self.fit_fraction > self.free_fraction else "free transfer"
        agreed = (f" (the smallest of the job; this rank measured "
                  f"{self.own_free_fraction:.2f})" if self.own_free_fraction >= 0 else "")
        which = "the second calibration's " if self.calibrations > 1 else "a "
        return (f"--offload-state-fraction auto: {self.fraction:.2f} (bound by {bound}; free "
                f"{self.free_fraction:.2f}{agreed}, memory needs >= {self.fit_fraction:.2f}) from {which}"
                f"{self.iteration_ms:.0f} ms iteration ({self.stalls_ms:.0f} ms of copy waits "
                f"removed), D2H {self.d2h_gbps:.1f} / H2D {self.h2d_gbps:.1f} GB/s")


class PhaseRecorder:
    """Phase marks and copy waits of one iteration, on the compute stream's clock (host clock on
    CPU, for tests)."""

    def __init__(self, stream=None):
        self.stream = stream
        self.marks: List[Tuple[str, object, int]] = []  # (label, event or host ms, activation bytes)
        self.stalls: List[Tuple[object, object]] = []  # (before, after) a compute-stream wait

    def _now(self):
        return time.perf_counter() * 1e3 if self.stream is None else timed_event(self.stream)

    def mark(self, label: str, activation_bytes: int) -> None:
        self.marks.append((label, self._now(), activation_bytes))

    def _elapsed(self, a, b) -> float:
        return b - a if self.stream is None else a.elapsed_time(b)

    def timeline(self) -> Tuple[List[Tuple[str, float, int]], float]:
        """([(label, compute-only ms since the first mark, activation bytes)], stall ms removed).
        Blocks the host until the last mark has run on the GPU (once per run)."""
        if not self.marks:
            return [], 0.0
        first = self.marks[0][1]
        if self.stream is not None:
            self.marks[-1][1].synchronize()
        # A wait and a mark are both on the compute stream, so a mark is never inside a wait.
        stalls = [(self._elapsed(first, before), self._elapsed(before, after)) for before, after in self.stalls]
        stalls = [(start, ms) for start, ms in stalls if start >= 0]
        out = []
        for label, when, act in self.marks:
            t = self._elapsed(first, when)
            out.append((label, t - sum(ms for start, ms in stalls if start < t), act))
        return out, sum(ms for _, ms in stalls)


def choose(timeline, state_bytes: int, d2h_gbps: float, h2d_gbps: float, room_bytes: float,
           step_peak_growth: float = 0.0, stalls_ms: float = 0.0) -> Choice:
    """The fraction to offload (see module doc), rounded down to 0.01; 1.0 when all moves free.
    For a calibration iteration that copied the whole state out: its first forward is trimmed
    (`first_forward_as_the_others`), the untrimmed estimate kept as `free_upper`."""
    both = BOTH_DIRECTIONS_SHARE * (d2h_gbps + h2d_gbps)

    def free_share(marks):
        profile = planner.profile_from_timeline(marks, state_bytes, step_peak_growth, d2h_gbps, h2d_gbps, both)
        return (planner.free_bytes(profile) / state_bytes if state_bytes else 1.0), profile.iteration_ms

    free, iteration_ms = free_share(first_forward_as_the_others(timeline))
    upper, _ = free_share(timeline)
    # (A rank with no state at all still takes part in the choice: its collectives are the job's.)
    no_bound = math.isinf(room_bytes) or not state_bytes
    fit = 0.0 if no_bound else min(1.0, max(0.0, 1.0 - room_bytes / state_bytes))
    return Choice(_settle(free, fit), free, fit, iteration_ms, stalls_ms, d2h_gbps, h2d_gbps,
                  free_upper=max(upper, free))


def needs_second_calibration(first: Choice) -> bool:
    """Whether an iteration run at `first`'s fraction can tell more than the first calibration did:
    only when the trim may have cut the window (the untrimmed estimate is larger) and the
    fraction is not already set by memory beyond that estimate, or everything."""
    # (+ half the 0.01 step the fraction is rounded to: a difference that cannot change it)
    return first.fraction < 1.0 and first.free_upper > max(first.free_fraction, first.fit_fraction) + 0.005


def refine(first: Choice, second: Choice, capped: bool = True) -> Choice:
    """The choice after a second calibration iteration, run at `first.fraction`.

    Why a second one: the first calibration copies the *whole* state out beside its first forward,
    which stretches that forward by a varying amount; trimmed (`first_forward_as_the_others`) it
    errs low where the first forward is legitimately longer (well short of what the planner
    called free), untrimmed it errs high (a fraction whose copy-out delays the step). At
    `first.fraction` the copy-out fits the first forward's window by construction, so the second
    calibration's forward runs nearly undisturbed and is taken as measured (untrimmed). Its free
    share is kept within the first calibration's two estimates (trimmed and untrimmed) so that one
    noisy iteration cannot move the choice outside what the first one bounded. Memory's bound
    stays the first calibration's (measured with the whole state off the GPU). See [Note: second
    calibration] in docs/design.md.

    `capped=False` (a diagnostic: `OffloadConfig.second_calibration_capped`, the benchmark's
    @calnocap) lifts the upper bound where the second calibration had no copy waits to speak of
    (within the planner's cost of "free", `FREE_COST` of its iteration). Why the bound may err
    low: the untrimmed estimate is no upper bound where the first calibration's waits hid host
    time that lengthens an undisturbed first forward (removed with the waits, its first forward
    can come out shorter than a baseline's). What the guard cannot see: phases the calibration
    stretched otherwise (its host-lead bound), which widen the windows it reads."""
    lower = first.free_fraction
    upper = max(first.free_upper, lower)
    measured = second.free_upper if second.free_upper >= 0 else second.free_fraction
    if not capped and second.stalls_ms <= planner.FREE_COST * second.iteration_ms:
        upper = max(upper, measured)
    free = min(max(measured, lower), upper)
    return dataclasses.replace(second, fraction=_settle(free, first.fit_fraction), free_fraction=free,
                               fit_fraction=first.fit_fraction, free_upper=upper,
                               calibrations=first.calibrations + 1)


def first_forward_as_the_others(timeline):
    """The calibration timeline with its first forward no longer than the shortest later one.

    Why: the first forward's window is what bounds the copy-out (the state must be off before
    the activation peak), and in the calibration iteration that forward is the one that runs
    beside the copy-out of the *whole* state. The copy slows it by more than the waits that
    `PhaseRecorder` can remove (the forward's kernels share the GPU's queues and memory with the
    copy), so its compute-only length came out inflated, and by a varying amount: identical runs
    chose different fractions, the larger one slower than the planner's floor on the baseline for
    it. The later forwards of the same iteration run with no copy beside them. This errs on the
    side of offloading less, by more where the first forward is legitimately longer than the
    others (it also waits for the overlapped parameter all-gather, and how much longer varies
    from call to call): there the trimmed choice takes only part of what the planner calls free.
    See [Note: first-forward trim] in docs/design.md."""
    forwards = [(k - 1, k) for k, (label, _, _) in enumerate(timeline)
                if label == "fwd_end" and k > 0 and timeline[k - 1][0] == "fwd_begin"]
    if len(forwards) < 2:
        return timeline
    (begin, end), later = forwards[0], forwards[1:]
    excess = (timeline[end][1] - timeline[begin][1]) - min(timeline[e][1] - timeline[b][1] for b, e in later)
    if excess <= 0:
        return timeline
    return [(label, t - excess if k >= end else t, act) for k, (label, t, act) in enumerate(timeline)]


def _settle(free: float, fit: float) -> float:
    """What moves for free, but at least what memory needs; rounded down to 0.01, 1.0 from 0.99."""
    fraction = max(free, fit)
    return 1.0 if fraction >= 0.99 else max(0.01, math.floor(100 * fraction) / 100)


def smallest_over_job() -> Optional[Callable[[float], float]]:
    """Minimum of a number over every rank of the job; None outside torch.distributed.

    Why the whole job, not the data-parallel group: pipeline stages wait for each other's
    activations and gradients, and tensor/expert-parallel peers for each other's collectives, as
    data-parallel ranks wait at the gradient reduction. A stage that offloads more than its free
    share delays the others, whose waits then read as idle time in its own calibration timeline
    (see [Note: group agreement] in docs/design.md)."""
    if not torch.distributed.is_initialized():
        return None

    def smallest(value: float) -> float:
        # (NCCL reduces CUDA tensors only; the CPU tests run it over gloo.)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        t = torch.tensor([value], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return float(t.item())

    return smallest


def agree(choice: Choice, smallest: Callable[[float], float]) -> Choice:
    """The choice with the free fraction every rank of the job agrees on (`smallest`: the minimum
    over the ranks, a collective). Ranks that step in lockstep (data-parallel peers, pipeline
    stages, tensor/expert-parallel peers) wait for the slowest one, so a rank offloading more than
    its neighbours' free share stalls all of them: the job then runs well above the planner's floor
    for the smaller share (see [Note: group agreement] in
    docs/design.md). The memory bound stays this rank's own: needing more off than is free is
    worth the stall."""
    free = smallest(choice.free_fraction)
    if free >= choice.free_fraction:
        return choice
    return dataclasses.replace(choice, fraction=_settle(free, choice.fit_fraction), free_fraction=free,
                               own_free_fraction=choice.free_fraction)


def memory_room(device: torch.device) -> Callable[[], float]:
    """Reader of how many more bytes this process may reserve at its peak: the device's free memory
    plus what the allocator holds now, minus the peak it has reserved so far, within any per-process
    cap (`torch.cuda.set_per_process_memory_fraction`), less a safety margin."""
    if device.type != "cuda":
        return lambda: math.inf

    def room() -> float:
        free, total = torch.cuda.mem_get_info(device)
        reserved, peak = torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device)
        get_cap = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        cap = total * (get_cap(device) if get_cap is not None else 1.0)
        return min(free + reserved, cap) - peak - MEMORY_SAFETY_BYTES

    return room


def bandwidth_of(stats, default_gbps: float = 55.0) -> Tuple[float, float]:
    """Achieved (D2H, H2D) GB/s of the copies timed so far, without consuming them (the log
    interval still reports them)."""
    totals = stats.peek()
    return (totals.d2h_gbps or default_gbps, totals.h2d_gbps or default_gbps)
