"""The planner's input: one iteration of a run without offloading, as phases (`Segment`) of known
duration over which the activation growth changes linearly, plus the state size and the copy
rates (`Profile`); built from a run's phase marks (`profile_from_timeline`, `median_marks`), a JSON
file (`load_profile`) or the built-in presets. What the planner computes from it: planner.py."""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Dict, List, Optional


GiB = 2**30
# A phase is taken as launch-bound (its busy_ms used) only where the GPU needed less than this share
# of its baseline duration: single iterations of one phase differ by up to ~6 % on a noisy host.
HOST_BOUND_SHARE = 0.9
# The segments of an optimizer step: the work before the inner optimizer's, where marked, then the step.
STEP_KINDS = ("step_prep", "step")


@dataclasses.dataclass
class Segment:
    kind: str  # "forward", "backward", "gap", "step_prep" (planner.py's module doc) or "step"
    ms: float
    growth_start: float  # bytes above the iteration's base when the segment starts
    growth_end: float
    # The GPU's own time for the phase when it lags the host (<= ms; None: ms, i.e. GPU-bound).
    busy_ms: Optional[float] = None

    @property
    def speed(self) -> float:
        """How much faster than in the baseline the GPU can run this phase while catching up
        (infinite for a phase of host time only)."""
        busy = self.ms if self.busy_ms is None else min(self.busy_ms, self.ms)
        if busy <= 0:
            return float("inf") if self.ms > 0 else 1.0
        return self.ms / busy


@dataclasses.dataclass
class Profile:
    segments: List[Segment]
    state_bytes: float
    d2h_gbps: float = 55.0
    h2d_gbps: float = 55.0
    both_gbps: float = 100.0

    @property
    def iteration_ms(self) -> float:
        return sum(s.ms for s in self.segments)

    @property
    def peak_growth(self) -> float:
        return max(max(s.growth_start, s.growth_end) for s in self.segments)

    @property
    def max_unchunked_bytes(self) -> float:
        """The step runs with all state resident, so it must fit under the lowered peak."""
        step_growth = max((max(s.growth_start, s.growth_end) for s in self.segments if s.kind == "step"),
                          default=0.0)
        return max(0.0, min(self.state_bytes, self.peak_growth - step_growth))


# ------------------------------------------------------------------------------------------------
# Profiles from the brief (section 5: 2 x H200, PCIe Gen5 x16, rank 0); inputs for the tests and a
# starting point for users. Growth is linear within each phase, as the brief's table gives it.
# ------------------------------------------------------------------------------------------------
def _pp1(microbatches, fwd_ms, bwd_ms, act, tail_ms, step_ms, step_growth, fwd_end_growth=None,
         bwd_extra=0.0):
    segs = []
    peak_fwd = act if fwd_end_growth is None else fwd_end_growth
    for _ in range(microbatches):
        segs.append(Segment("forward", fwd_ms, 0.0, peak_fwd))
        if bwd_extra:
            segs.append(Segment("backward", bwd_ms / 2, peak_fwd, peak_fwd + bwd_extra))
            segs.append(Segment("backward", bwd_ms / 2, peak_fwd + bwd_extra, 0.0))
        else:
            segs.append(Segment("backward", bwd_ms, peak_fwd, 0.0))
    segs.append(Segment("gap", tail_ms, 0.0, 0.0))
    segs.append(Segment("step", step_ms, step_growth, step_growth))
    return segs


def _pp_stage0(microbatches, warmup, fwd_ms, bwd_ms, per_mb, tail_ms, step_ms, step_growth):
    segs, live = [], 0.0
    for _ in range(warmup):
        segs.append(Segment("forward", fwd_ms, live, live + per_mb))
        live += per_mb
    for _ in range(microbatches - warmup):
        segs.append(Segment("backward", bwd_ms, live, live - per_mb))
        live -= per_mb
        segs.append(Segment("forward", fwd_ms, live, live + per_mb))
        live += per_mb
    for _ in range(warmup):
        segs.append(Segment("backward", bwd_ms, live, live - per_mb))
        live -= per_mb
    segs.append(Segment("gap", tail_ms, 0.0, 0.0))
    segs.append(Segment("step", step_ms, step_growth, step_growth))
    return segs


PRESETS: Dict[str, Profile] = {
    # preset r1: 24 x 2048 GPT, DP2, 4 microbatches; 6.8 GiB state, +22.7 GiB at each forward end.
    "r1": Profile(_pp1(4, 60, 100, 22.7 * GiB, 13, 28, 2.4 * GiB), state_bytes=6.8 * GiB),
    # preset r2: r1 with full recompute: +0.9 GiB at forward end, +1.6 GiB in backward; the step is
    # the peak.
    "r2": Profile(_pp1(4, 56, 150, 0.0, 13, 26, 2.4 * GiB, fwd_end_growth=0.9 * GiB,
                       bwd_extra=0.7 * GiB), state_bytes=6.8 * GiB),
    # preset r3: r1's model, PP2 x DP2, stage 0, 8 microbatches, 2 warm-up forwards; 3.4 GiB state.
    # The phase table sums to 631 ms; a real iteration of that shape also holds pipeline waits
    # that the table does not place, so compare its stalls in ms rather than as ratios. See
    # [Note: preset r3] in docs/design.md.
    "r3": Profile(_pp_stage0(8, 2, 26, 50, 11.1 * GiB, 9, 14, 1.2 * GiB), state_bytes=3.4 * GiB),
}


def profile_from_timeline(marks, state_bytes: float, step_peak_growth: float = 0.0,
                          d2h_gbps: float = 55.0, h2d_gbps: float = 55.0, both_gbps: float = 100.0,
                          busy_marks=None) -> Profile:
    """Build a Profile from marks taken during one iteration *without* offloading.

    marks: (label, t_ms, allocated_bytes) in time order, t_ms from CUDA events on the compute
    stream. Labels: "iter_begin", "fwd_begin"/"fwd_end", "bwd_begin"/"bwd_end",
    "step_begin"/"step_end", optionally "adam_begin" between the last two (the inner optimizer's
    step begins: the segment before it is "step_prep", planner.py's module doc). Growth is
    allocated memory above the allocation at "iter_begin"; the step's growth is
    `step_peak_growth` (its temporaries, from the allocator's peak). Time between the marked
    phases becomes "gap" segments at the growth they start from.
    busy_marks: the same labels from an iteration whose GPU was made to lag the host first (the
    recorder's MEGATRON_OFFLOAD_BUSY_AT): their durations are the phases' `busy_ms` (planner.py's
    module doc) where below HOST_BOUND_SHARE of the phase's own; ignored unless the labels match.
    """
    kinds = {"fwd": "forward", "bwd": "backward"}
    base = marks[0][2]
    busy = [None] * len(marks)
    if busy_marks and [m[0] for m in busy_marks] == [m[0] for m in marks]:
        # A phase counts as launch-bound only where the GPU's own time is clearly shorter: a
        # single busy iteration against a median, so noise would otherwise only ever lower the floor.
        busy = [b if b < HOST_BOUND_SHARE * (m2[1] - m1[1]) else None
                for (m1, m2), b in zip(zip(marks, marks[1:]),
                                       (max(0.0, y[1] - x[1]) for x, y in zip(busy_marks, busy_marks[1:])))] + [None]
    segments: List[Segment] = []
    for k, ((label, t, alloc), (next_label, next_t, next_alloc)) in enumerate(zip(marks, marks[1:])):
        duration = max(0.0, next_t - t)
        phase = label.rsplit("_", 1)[0]
        if label.endswith("_begin") and phase in kinds and next_label == f"{phase}_end":
            segments.append(Segment(kinds[phase], duration, alloc - base, next_alloc - base, busy[k]))
        elif label in ("step_begin", "adam_begin") and next_label == "step_end":
            segments.append(Segment("step", duration, step_peak_growth, step_peak_growth, busy[k]))
        elif label == "step_begin" and next_label == "adam_begin":
            # (at the gradients' level: the norm's temporaries are small beside the step's)
            segments.append(Segment("step_prep", duration, alloc - base, alloc - base, busy[k]))
        elif duration > 0:
            segments.append(Segment("gap", duration, alloc - base, alloc - base, busy[k]))
    return Profile(segments, state_bytes, d2h_gbps, h2d_gbps, both_gbps)


def median_marks(timelines):
    """One timeline from several iterations' marks with the same phases (as `profile_from_timeline`
    takes): each phase's duration and each boundary's allocated bytes are the median over the
    iterations. A single marked iteration is one sample of a noisy host (the same phase can take
    noticeably longer in one call than in another; see [Note: phase medians] in docs/design.md);
    the median keeps one slow phase from moving the floor. Only the iterations with the most common
    phase labels count (the first such where several are as common): e.g. a skipped step (inf/nan
    gradients) calls no inner optimizer, so its marks lack "adam_begin"; the others stay."""
    timelines = [list(t) for t in timelines if t]
    if not timelines:
        return []
    sequences = [tuple(m[0] for m in t) for t in timelines]
    labels = list(max(sequences, key=sequences.count))  # (max: the first of the most common)
    same = [t for t in timelines if [m[0] for m in t] == labels]
    if len(same) == 1:
        return same[0]
    out, t = [], 0.0
    for k, label in enumerate(labels):
        if k:
            t += statistics.median(tl[k][1] - tl[k - 1][1] for tl in same)
        out.append((label, t, statistics.median(tl[k][2] for tl in same)))
    return out


def load_profile(path: str) -> Profile:
    """JSON: {"state_gib": .., "d2h_gbps": .., "h2d_gbps": .., "both_gbps": .., "segments":
    [{"kind": "forward", "ms": 60, "growth_start_gib": 0, "growth_end_gib": 22.7}, ...]}; optional
    per segment: "busy_ms", the GPU's own time for a launch-bound phase (planner.py's module doc)"""
    with open(path) as f:
        raw = json.load(f)
    segs = [Segment(s["kind"], float(s["ms"]), s["growth_start_gib"] * GiB, s["growth_end_gib"] * GiB,
                    s.get("busy_ms")) for s in raw["segments"]]
    return Profile(segs, raw["state_gib"] * GiB, raw.get("d2h_gbps", 55.0), raw.get("h2d_gbps", 55.0),
                   raw.get("both_gbps", 100.0))
