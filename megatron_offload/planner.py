"""Planner: how much GPU memory can offloading save on a run, and what will it cost?

    python -m megatron_offload.planner --preset r1
    python -m megatron_offload.planner --profile my_run.json [--state-gib 7.3] [--gbps 55]

The floor is a computation, not a guess. Input: the timeline of one steady iteration of the run
*without* offloading, as segments of known duration over which the activation growth (allocated
memory above the iteration's base, which includes the optimizer state) changes linearly, plus the
state size and the PCIe bandwidth per direction. The model, for X bytes to take off the peak:

* the copy-out starts when the step ends and runs at the D2H bandwidth; a byte may be freed once
  copied (freeing is free);
* compute stalls whenever its next bit of growth would lift allocated memory above the target
  peak (the no-offload peak minus X);
* the reload may start after the last forward, runs at the H2D bandwidth and obeys the same
  ceiling; the step cannot start before all X bytes are back (the step runs with the whole state
  resident: the step's own temporaries therefore bound X, see `max_unchunked_bytes`);
* both directions at once share `both_gbps`.

With a chunked step (`predict(..., step_budget=B)`: the streamed step bounded by `--offload-step-budget-mb`,
its in-step copy-out only where later pieces need the room) the step holds at
most B bytes of state (plus one piece's temporaries) instead of all of it: the reload before the
step stops at B; the rest streams in during the step while the stepped pieces stream out, both
directions at once, so the step lasts at least its compute time and at least the time to bring
the rest in at that shared rate; the last B bytes stepped stay resident and their copy-out opens
the next iteration (the others left during the step).

With the streamed step (`predict(..., streamed=True)`: the plugin's default engine) the step begins on the
chunks already back while the rest stream in (as the chunked step, with the whole state as its
budget), and each stepped chunk streams out at once, during the rest of the step, both directions
sharing `both_gbps`: what left during one step is already off the GPU when the next iteration
starts (steady state: the iteration is simulated again from what the first pass sent out).

The step's own work before the inner optimizer's (the gradient norm and clipping; the recorder's
"adam_begin" mark, where the marks have it) is a "step_prep" segment. Adam needs the clipped
gradients, so nothing is stepped before that work ends: the reload goes on during it, alone, and
the streamed step's copy-out starts only after it. Marks without "adam_begin" make the whole step
one segment, as before; the streamed step's copy-out is then modelled from the step's start, which
no schedule reaches (the floor is low by what the link could have copied out during that work).

The host's lead: a phase whose baseline duration `ms` is longer than the GPU's own time for it
(`busy_ms`, measured with the GPU made to lag behind the host; None: the same) was bounded by the
host launching its kernels, not by the GPU. While compute waits for a copy, the host keeps
launching, so afterwards the GPU runs such phases at its own speed until it has caught up with
the host: part of every wait is absorbed. The simulation keeps `behind`, how far the GPU lags the
host's launches (in the baseline's time); the host launches at the baseline's pace and waits only
at the start of the optimizer step (its first segment), whose host sync (the gradient norm's
`.item()`) ends the lead built before it; while the step then waits for the reload, the host
launches the rest of it. The chunked step is bound by its own streams or its baseline time (its
lead from earlier phases ended at that sync). Without `busy_ms` nothing changes: every phase is
as long as in the baseline. A wait the lead absorbs still counts in `stall_out_ms` /
`stall_in_ms`: with busy times the stalls can exceed the slowdown.

The predicted iteration time is the simulated length of that timeline: the least time any
schedule can achieve under these rules (a real schedule adds its own overheads on top).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import List, Optional

# The planner's inputs, also reachable from here (planner.Segment, planner.profile_from_timeline, ...).
from .phase_profile import (GiB, PRESETS, STEP_KINDS, Profile, Segment, load_profile, median_marks,
                            profile_from_timeline)

__all__ = ["GiB", "PRESETS", "STEP_KINDS", "Profile", "Segment", "load_profile", "median_marks",
           "profile_from_timeline",
           "Prediction", "predict", "FREE_COST", "free_bytes", "suggested_fraction", "report", "main"]


@dataclasses.dataclass
class Prediction:
    offloaded_bytes: float
    iteration_ms: float
    baseline_ms: float
    stall_out_ms: float  # compute waiting for memory during the forwards
    stall_in_ms: float  # step waiting for the reload
    feasible: bool  # False: X exceeds what an unchunked step allows (or the chunked budget fits)
    sent_in_step: float = 0.0  # bytes already copied out when the step ends (streamed step)
    # Simulated milliseconds of each of the profile's segments, its stalls included.
    segment_ms: List[float] = dataclasses.field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.iteration_ms / self.baseline_ms


def predict(profile: Profile, offloaded_bytes: float, dt_ms: float = 0.05,
            step_budget: Optional[float] = None, piece_growth: float = 0.0, streamed: bool = False) -> Prediction:
    """Simulate one iteration with `offloaded_bytes` taken off the peak (see module doc).
    `step_budget`: the chunked step's bound on resident state (None: unchunked step, or with
    `streamed` the whole state); `piece_growth`: one piece's Adam temporaries (chunked and
    streamed steps); `streamed`: stepped chunks leave during the step (steady state: two passes)."""
    if not streamed:
        return _simulate(profile, offloaded_bytes, dt_ms, step_budget, piece_growth)
    budget = offloaded_bytes if step_budget is None else step_budget
    first = _simulate(profile, offloaded_bytes, dt_ms, budget, piece_growth, sent_before=0.0)
    return _simulate(profile, offloaded_bytes, dt_ms, budget, piece_growth, sent_before=first.sent_in_step)


def _simulate(profile: Profile, offloaded_bytes: float, dt_ms: float, step_budget: Optional[float],
              piece_growth: float, sent_before: Optional[float] = None) -> Prediction:
    """One iteration (module doc). `sent_before`: the streamed step's bytes that left during the
    previous step (None: not streamed)."""
    x = float(offloaded_bytes)
    limit = profile.peak_growth - x  # allowed growth + (state resident - state base) above base
    mb_ms = 1e9 / 1e3  # bytes per millisecond per GB/s
    last_forward = max((i for i, s in enumerate(profile.segments) if s.kind == "forward"), default=-1)
    chunked = step_budget is not None
    held = min(x, step_budget) if chunked else x  # most state bytes back before the step
    # Chunked: only the bytes stepped last are still on the GPU when the iteration starts;
    # streamed: also what left during the step.
    copied = freed = max(x - held, sent_before or 0.0) if chunked else 0.0
    reloaded = sent = 0.0
    t = stall_out = stall_in = 0.0
    behind = 0.0  # how far the GPU lags the host's launches, in baseline milliseconds (module doc)
    starts = []
    for index, seg in enumerate(profile.segments):
        starts.append(t)
        done = 0.0  # baseline milliseconds of this segment completed
        rate = (seg.growth_end - seg.growth_start) / seg.ms if seg.ms else 0.0
        speed = seg.speed
        if seg.kind in STEP_KINDS:
            # (the step's host sync: module doc; after a step_prep the lead is 0 already: that
            # segment grows nothing, so it never waits and builds none)
            behind = 0.0
        if seg.kind == "step" and chunked:
            # The rest comes in during the step while stepped pieces go out: both at once.
            shared = min(profile.h2d_gbps, profile.d2h_gbps, profile.both_gbps / 2)
            stream_ms = (x - reloaded) / (shared * mb_ms)
            extra = max(0.0, stream_ms - seg.ms)
            wall = seg.ms + extra
            t += wall
            stall_in += extra
            reloaded = x
            # (streamed: the pieces stepped go out behind the ones coming in)
            sent = min(x, shared * mb_ms * wall)
            continue
        if seg.kind == "step" and reloaded < x:
            # The Adam kernel needs the whole state back before it starts.
            while reloaded < x:
                growth = seg.growth_start
                room = profile.peak_growth - growth - (x - freed) - reloaded  # bytes we may add
                step_in = min(profile.h2d_gbps * mb_ms * dt_ms, x - reloaded, max(0.0, room))
                if step_in <= 0:
                    break  # cannot fit: infeasible, reported below
                reloaded += step_in
                t += dt_ms
                stall_in += dt_ms
                behind += dt_ms
        reload_window = index > last_forward and seg.kind != "step"

        def transfer(wall):
            """Copies over `wall` milliseconds at the current growth."""
            nonlocal copied, freed, reloaded
            both = copied < x and reload_window and reloaded < freed
            out_bw = min(profile.d2h_gbps, profile.both_gbps / 2 if both else profile.d2h_gbps)
            in_bw = min(profile.h2d_gbps, profile.both_gbps / 2 if both else profile.h2d_gbps)
            if copied < x:
                copied = min(x, copied + out_bw * mb_ms * wall)
                freed = copied
            if reload_window and reloaded < min(freed, held):
                room = limit - growth_now + freed - reloaded
                reloaded += min(in_bw * mb_ms * wall, min(freed, held) - reloaded, max(0.0, room))

        while done < seg.ms - 1e-9:
            # One tick: the GPU advances `adv` baseline milliseconds in `wall` milliseconds, at
            # most `speed` times faster, never past what the host has launched (`behind` more).
            remaining = seg.ms - done
            adv = min(dt_ms * speed, dt_ms + behind, remaining)
            wall = dt_ms if adv < remaining else max(adv / speed, adv - behind)
            growth_now = seg.growth_start + rate * done
            transfer(wall)
            # State off the GPU now: freed - reloaded. Compute may add growth only below the limit.
            next_growth = seg.growth_start + rate * (done + adv)
            blocked = next_growth > growth_now and next_growth > limit + (freed - reloaded) + 1.0
            if blocked and copied < x:  # wait for the copy-out (1 byte absorbs float rounding)
                if wall < dt_ms and speed > 1.0:  # (a short tail tick: wait a whole tick)
                    transfer(dt_ms - wall)
                    wall = dt_ms
                t += wall
                stall_out += wall
                behind += wall  # the host keeps launching
                continue
            done += adv
            t += wall
            behind += wall - adv
    if chunked:
        # Growth during the step: state never offloaded (S - x) + held + one piece's temporaries
        # over a base that holds all S; it must stay under the lowered peak.
        feasible = held + piece_growth - x <= limit + 1e-6
    else:
        feasible = x <= profile.max_unchunked_bytes + 1e-6
    return Prediction(x, t, profile.iteration_ms, stall_out, stall_in, feasible,
                      sent if sent_before is not None else 0.0,
                      [end - start for start, end in zip(starts, starts[1:] + [t])])


# The slowdown the planner still calls "free" (`free_bytes`).
FREE_COST = 0.005


def free_bytes(profile: Profile, tolerance: float = FREE_COST) -> float:
    """The most state that comes off the peak at no more than `tolerance` slowdown (bisection)."""
    lo, hi = 0.0, profile.max_unchunked_bytes
    for _ in range(30):
        mid = (lo + hi) / 2
        if predict(profile, mid, dt_ms=0.1).ratio <= 1 + tolerance:
            lo = mid
        else:
            hi = mid
    return lo


def suggested_fraction(profile: Profile) -> float:
    """The --offload-state-fraction that moves only what the planner says is free (rounded down
    to 0.01, at least 0.01)."""
    if profile.state_bytes <= 0:
        return 1.0
    return max(0.01, min(1.0, int(100 * free_bytes(profile) / profile.state_bytes) / 100))


def report(profile: Profile, name: str = "") -> str:
    lines = [f"plan {name}: iteration {profile.iteration_ms:.0f} ms without offloading, state "
             f"{profile.state_bytes / GiB:.2f} GiB, activation peak +{profile.peak_growth / GiB:.2f} GiB, "
             f"D2H {profile.d2h_gbps:g} / H2D {profile.h2d_gbps:g} GB/s"]
    cap = profile.max_unchunked_bytes
    if cap < profile.state_bytes - 1e-6:
        lines.append(f"  the optimizer step itself is (near) the peak: the whole step (--offload-step whole) "
                     f"lets at most {cap / GiB:.2f} GiB come off it (a bounded streamed step is needed for more)")
        for budget_gib in (1.5, 3.0):
            p = predict(profile, profile.state_bytes, step_budget=budget_gib * GiB, streamed=True)
            lines.append(f"  --offload-step-budget-mb {int(budget_gib * 1024)} (streamed step holding {budget_gib:g} "
                         f"GiB during the step): all "
                         f"{profile.state_bytes / GiB:.2f} GiB off the peak in {p.iteration_ms:.0f} ms/iter "
                         f"({p.ratio:.3f}x{'' if p.feasible else '; the budget does not fit under the lowered peak'})")
    if cap <= 0:
        return "\n".join(lines)
    free = free_bytes(profile)
    lines.append(f"  off the peak at no cost (<= 0.5 %): {free / GiB:.2f} GiB, i.e. "
                 f"--offload-state-fraction {suggested_fraction(profile):.2f}")
    lines.append("  | GiB off the peak | predicted ms/iter | x no offload | stall before peak ms | stall before step ms |")
    lines.append("  |---|---|---|---|---|")
    for frac in (0.25, 0.5, 0.75, 1.0):
        x = cap * frac
        p = predict(profile, x)
        lines.append(f"  | {x / GiB:.2f} | {p.iteration_ms:.0f} | {p.ratio:.3f} | {p.stall_out_ms:.0f} | "
                     f"{p.stall_in_ms:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="megatron-offload-plan", description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS),
                     help="a built-in profile: r1 (GPT 24 x 2048, DP2, 4 microbatches), r2 (r1 with full "
                          "activation recompute: the step is the peak), r3 (r1's model at PP2 x DP2, 8 microbatches)")
    src.add_argument("--profile", help="JSON timeline of one iteration without offloading (see load_profile)")
    parser.add_argument("--state-gib", type=float, help="override the optimizer state size per rank (GiB)")
    parser.add_argument("--gbps", type=float, help="override the PCIe bandwidth of each direction (GB/s)")
    opts = parser.parse_args(argv)
    try:
        profile = PRESETS[opts.preset] if opts.preset else load_profile(opts.profile)
    except OSError as err:
        parser.error(f"cannot read --profile {opts.profile}: {err.strerror}")
    except (ValueError, KeyError, TypeError) as err:
        parser.error(f"--profile {opts.profile} is not a profile ({type(err).__name__}: {err}); "
                     "expected JSON with state_gib and segments [{kind, ms, growth_start_gib, growth_end_gib}]")
    if opts.state_gib is not None:
        profile = dataclasses.replace(profile, state_bytes=opts.state_gib * GiB)
    if opts.gbps is not None:
        profile = dataclasses.replace(profile, d2h_gbps=opts.gbps, h2d_gbps=opts.gbps)
    print(report(profile, opts.preset or opts.profile))


if __name__ == "__main__":
    main()
