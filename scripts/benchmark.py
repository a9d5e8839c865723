"""Side-by-side benchmark: the same Megatron GPT run with and without megatron-offload, in one call.

    python scripts/benchmark.py --preset r1 --nproc 2 --out /tmp/bench [--variants baseline,offload]

Presets:
  r1     the brief's reference run R1: GPT 24 layers, hidden 2048, 16 heads, seq 2048, vocab 32000
         (~1.2 B params), micro-batch 2, global batch 16, bf16, DistributedOptimizer, DP = nproc.
  small  4 layers, hidden 1024 (a quick smoke run).
  r2     R1 with full activation recompute (the optimizer step is the memory peak).
  r3     R1's model with PP=2, DP=2 (--nproc 4), 8 microbatches per iteration.
  moe    R1's model with 4 experts (top-2, alltoall dispatcher), dense + expert optimizers;
         EP = 1 unless --extra sets --expert-model-parallel-size.

Each variant runs `--iters` iterations; the table reports, per variant, the median step time over
iterations [--warmup, iters), peak allocated/reserved memory per rank, offloaded and pinned bytes,
and whether the losses are bit-identical to the baseline. Ratios are against the baseline of the
same call. Results are written to <out>/benchmark.json.
"""

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_runs import launch, model_args, run_peak  # noqa: E402

PRESETS = {
    "r1": dict(layers=24, hidden=2048, heads=16, seq=2048, mbs=2, gbs=16),
    "r2": dict(layers=24, hidden=2048, heads=16, seq=2048, mbs=2, gbs=16),
    "small": dict(layers=4, hidden=1024, heads=16, seq=1024, mbs=4, gbs=16),
    # R3: R1's model with PP=2, DP=2 on 4 GPUs, 8 microbatches per iteration (2 x 8 x 2 = 32).
    "r3": dict(layers=24, hidden=2048, heads=16, seq=2048, mbs=2, gbs=32),
    # R1's model with 4 experts per MoE layer (~3.7 B params; EP1 on one GPU: ~44 GiB of state).
    "moe": dict(layers=24, hidden=2048, heads=16, seq=2048, mbs=2, gbs=8),
}
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
       # The local SequentialMLP adds its bias in place on a view (autograd error at EP1).
       "--disable-bias-linear"]
PRESET_ARGS = {"r2": RECOMPUTE, "r3": ["--pipeline-model-parallel-size", "2"], "moe": MOE}
# Environment modifiers, appended to a variant name with '@' (e.g. offload@conn8@expseg).
MODIFIERS = {
    "conn8": {"CUDA_DEVICE_MAX_CONNECTIONS": "8"},
    "expseg": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    # The allocator's default (one segment per cudaMalloc), set explicitly: the plugin then keeps it.
    "noexpseg": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
    # Allocator history of rank 0 from start-up through iteration 6 (before the timed iterations
    # when --warmup >= 7), for scripts/alloc_trace.py. (The dump stalls the host at the start of
    # iteration 7 and the host runs faster without the recording: the allocator's layout, hence
    # reserved memory, of the iterations after it need not be an unrecorded run's.)
    "memhist": {"MEGATRON_OFFLOAD_MEMHIST": "6"},
    # The same over the whole run (every rank writes its own history).
    "memhistall": {"MEGATRON_OFFLOAD_MEMHIST": "100000"},
    # Where --offload-release-cached-memory releases (allocator.RELEASE_POINTS; default "offloaded").
    "relfwd": {"MEGATRON_OFFLOAD_RELEASE_AT": "offloaded,forward"},
    "relstep": {"MEGATRON_OFFLOAD_RELEASE_AT": "step_end"},
    "relwin": {"MEGATRON_OFFLOAD_RELEASE_AT": "offloaded,reload_window"},
    # Reloads in the last backward without the workspace rule (coordinator._fitting, before 5eafd37).
    "nows": {"MEGATRON_OFFLOAD_WORKSPACE": "0"},
    # The workspace rule with the largest interval of the whole backward at every reload, not the
    # largest still to come (ReloadPolicy._workspace_for off).
    "wsmax": {"MEGATRON_OFFLOAD_WORKSPACE_BY_POSITION": "0"},
    # No reload inside the last backward: everything at finalize_model_grads (diagnostic).
    "reloadlate": {"MEGATRON_OFFLOAD_BACKWARD_RELOADS": "0"},
    # The forward's frees make the host wait for their copy-out too (coordinator._free_until).
    "hostwait": {"MEGATRON_OFFLOAD_HOST_WAIT": "1"},
    "nohostwait": {"MEGATRON_OFFLOAD_HOST_WAIT": "0"},
    # The fallback reload maps new memory instead of first handing back free blocks too small
    # for the chunks (ReloadPolicy._room_for_fallback off).
    "nofbrel": {"MEGATRON_OFFLOAD_FALLBACK_RELEASE": "0"},
    # ... and that hand-back in every iteration whose fallback reload fits no free blocks, not
    # only the first after the state was all off (OffloadConfig.fallback_release_every_iteration).
    "fbrelall": {"MEGATRON_OFFLOAD_FALLBACK_RELEASE_ALL": "1"},
    # Memory the first iteration keeps for good stays counted as activation growth in P and the
    # profile (OffloadConfig.forget_lasting_growth off: the behaviour before that rule).
    "keepprofile": {"MEGATRON_OFFLOAD_FORGET_LASTING": "0"},
    # ... and the forward's frees paced with the configured margin only, not at least that memory
    # (OffloadConfig.lasting_growth_margin off).
    "nolastmargin": {"MEGATRON_OFFLOAD_LASTING_MARGIN": "0"},
    # The host at most N layer hooks ahead of the compute stream (--offload-host-lead-layers,
    # streams.HostLeadBound); lead0: no bound.
    **{f"lead{n}": {"MEGATRON_OFFLOAD_HOST_LEAD": str(n)} for n in (0, 1, 2, 4, 8)},
    # The automatic fraction's calibration under the run's own host-lead bound instead of one layer
    # (config.CALIBRATION_HOST_LEAD_LAYERS).
    "calrun": {"MEGATRON_OFFLOAD_CAL_HOST_LEAD": "run"},
    # The second calibration's reading not bounded by the first's untrimmed estimate where the
    # second had no copy waits to speak of (auto_fraction.refine's capped=False).
    "calnocap": {"MEGATRON_OFFLOAD_CAL_CAP": "0"},
    # Once the whole copy-out has finished, the next forward hook frees all of it (not only what
    # the budget asks: OffloadConfig.free_when_copied_out).
    "freecopied": {"MEGATRON_OFFLOAD_FREE_COPIED": "1"},
    # Not even at the first hook: the budget paces a copy-out finished before the forward too
    # (OffloadConfig.free_copied_before_forward off).
    "nofreefirst": {"MEGATRON_OFFLOAD_FREE_COPIED_FIRST": "0"},
    # Megatron's own reads after the step (megatron_reads.py off: the model-parallel reductions and
    # train's loss-scale read): each reads the GPU, behind the copy-out in flight.
    "devreads": {"MEGATRON_OFFLOAD_DEVICE_READS": "1"},
    # An asynchronous save's snapshots filled before the save returns, as before the background
    # fill (OffloadConfig.async_save_background_fill off; with --async-save).
    "syncfill": {"MEGATRON_OFFLOAD_BACKGROUND_FILL": "0"},
    # The background fill over 8 threads (save_snapshot.BACKGROUND_COPY_THREADS; default 1).
    "fill8": {"MEGATRON_OFFLOAD_FILL_THREADS": "8"},
    # The background fill started when the state dict is taken, beside the rest of the save, not
    # once the request is with the writer (save_snapshot.BACKGROUND_FILL_AT_TAKE).
    "fillearly": {"MEGATRON_OFFLOAD_FILL_AT_TAKE": "1"},
    # The background fill copies every byte on the host from the pinned buffer, not from the GPU
    # into page-locked sets (save_snapshot.DEVICE_FILL off).
    "hostfill": {"MEGATRON_OFFLOAD_HOST_FILL": "1"},
    # torch.profiler over iteration 10 of rank 0: kernel/copy table and a compact GPU timeline
    # (gpu_timeline_iter10.json.gz in the variant's record directory).
    "prof": {"MEGATRON_OFFLOAD_PROFILE_ITERS": "10"},
    # The same over iteration 13 (gpu_timeline_iter13.json.gz): one that follows neither Megatron's
    # log line (every 5th) nor a profiled iteration.
    "prof13": {"MEGATRON_OFFLOAD_PROFILE_ITERS": "13"},
    # No change: a second run of a variant in the same call (offload@again is compared with
    # baseline@again, else with the plain baseline; again2 / again3 likewise), to see the run-to-run
    # spread next to the difference being measured.
    **{name: {} for name in ("again", "again2", "again3")},
}
# Argument modifiers, appended the same way (e.g. offload@release).
ARG_MODIFIERS = {
    "release": ["--offload-release-cached-memory"],
    # Megatron's log line (its timers' synchronize, the losses' reads) every iteration instead of
    # every 5th (megatron_runs.py): what a run logging every step pays behind the copy-out.
    "log1": ["--log-interval", "1"],
    # Free every chunk at the first layer of the first forward (a margin no budget can leave room
    # for): no activation is ever placed among resident chunks (diagnostic; exposes the D2H).
    "freeall": ["--offload-memory-margin-mb", "1000000"],
    # The forward's frees that much earlier than the growth profile asks (MiB; a margin given is
    # taken as it is, the lasting margin off; unset: 64 MiB or the memory kept for good, whichever
    # is larger): more room free when activations need a block of their size.
    **{f"margin{n}": ["--offload-memory-margin-mb", str(n)] for n in (256, 512, 1024, 2048)},
    # Python's automatic collector off and one full collection after every iteration (Megatron's
    # --manual-gc): tensors kept by reference cycles are freed at the same point of every
    # iteration instead of wherever a collection happens to run (diagnostic).
    "manualgc": ["--manual-gc", "--manual-gc-interval", "1"],
    # DDP's AccumulateGrad nodes left on get_model's side stream (what the plugin did before it
    # re-created them on the compute stream): weight-gradient frees deferred to that stream.
    "ddpstream": ["--offload-keep-ddp-grad-stream"],
}
VARIANTS = {
    "baseline": [],
    # Every variant without --offload-step runs the plugin's default engine: the streamed step (the
    # copy-out fed as each chunk is stepped). Results recorded before that default ran the whole
    # step under these names (offload, offload-chunk*, offload-frac*, offload-piece*; offload-stepbudget*
    # ran the chunked step without the feeder): benchmarks/NOTES.md says which.
    "offload": ["--offload-optimizer-states"],
    # The whole step (the state back for one step, out at the next forward).
    "offload-whole": ["--offload-optimizer-states", "--offload-step", "whole"],
    "offload-chunk64": ["--offload-optimizer-states", "--offload-chunk-size-mb", "64"],
    "offload-chunk128": ["--offload-optimizer-states", "--offload-chunk-size-mb", "128"],
    "offload-piece32": ["--offload-optimizer-states", "--offload-copy-piece-mb", "32"],
    # Fractional offload at the R1 planner's "free" fraction (python -m megatron_offload.planner).
    "offload-frac47": ["--offload-optimizer-states", "--offload-state-fraction", "0.47"],
    # Measures iteration 3 of its own run, then offloads what moves for free (auto_fraction.py); its
    # default engine is the whole step, which its model describes.
    "offload-auto": ["--offload-optimizer-states", "--offload-state-fraction", "auto"],
    # The step piece by piece without the feeder: stepped chunks leave in the step only when a later
    # piece needs their room, the rest at the next forward.
    "offload-chunked": ["--offload-optimizer-states", "--offload-chunked-step", "--offload-copy-out-in-flight-mb", "0"],
    # The whole step with the copy-out fed from the step on, 256 MiB in flight.
    "offload-fed": ["--offload-optimizer-states", "--offload-step", "whole", "--offload-copy-out-in-flight-mb", "256"],
    # The streamed step with 256 MiB in flight (the default is 1024), as earlier results ran it.
    "offload-chunked-fed": ["--offload-optimizer-states", "--offload-chunked-step", "--offload-copy-out-in-flight-mb",
                            "256"],
    # The automatic fraction on the whole step with the fed copy-out, and on the streamed step at 256 MiB.
    "offload-auto-fed": ["--offload-optimizer-states", "--offload-state-fraction", "auto", "--offload-step", "whole",
                         "--offload-copy-out-in-flight-mb", "256"],
    "offload-auto-chunked-fed": ["--offload-optimizer-states", "--offload-state-fraction", "auto",
                                 "--offload-chunked-step", "--offload-copy-out-in-flight-mb", "256"],
    "recompute": RECOMPUTE,
    "recompute+offload": RECOMPUTE + ["--offload-optimizer-states"],
    # The alternatives users pick today (issue 3):
    # HybridDeviceOptimizer: Adam on the CPU for all params, its copies overlapped.
    "cpu-offload": ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--optimizer-offload-fraction",
                    "1.0", "--overlap-cpu-optimizer-d2h-h2d"],
    # Megatron's own restore_from_cpu() / offload_to_cpu() around every optimizer step
    # (scripts/pretrain_gpt_mock.py, MEGATRON_OFFLOAD_NATIVE_ROUNDTRIP).
    "native-offload": [],
}
VARIANT_ENV = {"native-offload": {"MEGATRON_OFFLOAD_NATIVE_ROUNDTRIP": "1"}}


def variant_args(variant):
    """Arguments of a variant: one of VARIANTS, or offload-chunk<MiB> / offload-frac<percent> /
    offload-stepbudget<MiB>[-chunk<MiB>] (the default engine with that budget) /
    offload-chunked-chunk<MiB> (offload-chunked, automatic budget) / offload-fed<MiB> /
    offload-chunked-fed<MiB> (that much copy-out in flight instead of 256)."""
    if variant in VARIANTS:
        return VARIANTS[variant]
    m = re.fullmatch(r"offload-chunked-chunk(\d+)", variant)
    if m:
        return VARIANTS["offload-chunked"] + ["--offload-chunk-size-mb", m.group(1)]
    m = re.fullmatch(r"(offload(?:-chunked)?-fed)([1-9]\d*)", variant)
    if m:
        return VARIANTS[m.group(1)][:-1] + [m.group(2)]
    m = re.fullmatch(r"offload-(chunk|frac|stepbudget)(\d+)(?:-chunk(\d+))?", variant)
    if not m or (m.group(3) and m.group(1) != "stepbudget"):
        raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}, offload-chunk<MiB>, "
                         "offload-frac<percent>, offload-stepbudget<MiB>[-chunk<MiB>], offload-chunked-chunk<MiB>, "
                         "offload-fed<MiB>, offload-chunked-fed<MiB>")
    if m.group(1) == "stepbudget":
        chunk = ["--offload-chunk-size-mb", m.group(3)] if m.group(3) else []
        return ["--offload-optimizer-states", "--offload-step-budget-mb", m.group(2), *chunk]
    if m.group(1) == "chunk":
        return ["--offload-optimizer-states", "--offload-chunk-size-mb", m.group(2)]
    return ["--offload-optimizer-states", "--offload-state-fraction", str(int(m.group(2)) / 100)]
# Variants several times slower than the baseline stop after fewer iterations (their median needs
# fewer); losses are compared over the iterations both ran.
MAX_ITERS = {"cpu-offload": 14, "native-offload": 10}


def soak_stats(iterations, warmup, window=100):
    """Long-run figures over iterations[warmup:]: p50/p99 step time and their ratio, and peak
    reserved memory of the first and the last `window` iterations (creep: last / first - 1).
    None for runs shorter than two windows."""
    timed = iterations[warmup:]
    if len(timed) < 2 * window:
        return None
    ms = sorted(it["ms"] for it in timed)
    p50, p99 = ms[len(ms) // 2], ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    first = max(it["max_reserved"] for it in timed[:window])
    last = max(it["max_reserved"] for it in timed[-window:])
    slowest = sorted(range(len(timed)), key=lambda i: timed[i]["ms"])[-5:]
    keys = ("ms", "gc_ms", "gc_gen1", "gc_full", "gc_full_collected", "alloc_retries", "device_allocs", "device_frees",
            "max_reserved")
    # The same over start-to-start periods (stalls between train_step calls included), where recorded.
    periods = sorted(it["period_ms"] for it in timed if "period_ms" in it)
    by_period = ({"p50_period_ms": periods[len(periods) // 2],
                  "p99_period_ms": periods[min(len(periods) - 1, int(round(0.99 * (len(periods) - 1))))]}
                 if periods else {})
    return {"iterations": len(timed), "p50_ms": p50, "p99_ms": p99, "p99_over_p50": p99 / p50, **by_period,
            "max_ms": ms[-1], "slowest_iterations": [warmup + i + 1 for i in sorted(slowest)],
            # The slowest iterations with what may explain them (records without a key: None).
            "slowest": [{"iteration": warmup + i + 1, **{k: timed[i].get(k) for k in keys}} for i in sorted(slowest)],
            # Every timed iteration's time and peak reserved memory, for later analysis.
            "ms": [round(it["ms"], 2) for it in timed],
            "max_reserved_mib": [it["max_reserved"] >> 20 for it in timed],
            "reserved_first_gib": first / 2**30, "reserved_last_gib": last / 2**30,
            "reserved_creep": last / first - 1,
            # Garbage collection over the whole run, warm-up included: iterations (1-based) with a
            # collection over 50 ms, and those with a full one (records that count them).
            "gc_slow_at": [[i + 1, round(it["gc_ms"], 1)] for i, it in enumerate(iterations)
                           if (it.get("gc_ms") or 0) > 50],
            "gc_full_at": [[i + 1, round(it["gc_ms"], 1)] for i, it in enumerate(iterations) if it.get("gc_full")]}


def measured_over(result, modelled_ms, key="median_ms"):
    """A variant's median step over a modelled iteration (None for records without a median)."""
    return result[key] / modelled_ms if result.get(key) else None


def reload_starts_text(result):
    """Where rank 0's reloads began in each iteration (steps done before it: position): the backward
    position of the first reload, counting down to 0 through the last backward (-1: at the
    fallback; "?": unknown, inside a recomputation), from the plugin's record."""
    starts = result.get("reload_starts")
    if not starts:
        return "first reload per iteration: not recorded"
    return "first reload per iteration at backward position " + ", ".join(
        f"{i}:{'?' if p is None else p}" for i, p in starts)


def relearned_text(result):
    """How often rank 0 learned the growth profile again, and the lasting growth behind it."""
    times = (result.get("profile_relearned") or [None])[0]
    grown = (result.get("profile_relearned_bytes") or [None])[0]
    return f"{times} times" + (f" ({grown / 2**30:.2f} GiB kept for good)" if times and grown is not None else "")


def workspace_text(result):
    """Rank 0's backward workspace: the largest interval, and each interval by the backward hook
    position that began it, the loss and output layer's (the forward's module count) first."""
    text = f"backward workspace {result.get('backward_workspace_mib', [0])[0]:.0f} MiB"
    by_position = result.get("workspace_by_position_mib")
    if by_position:
        keys = sorted(by_position, key=lambda k: -1 if k == "None" else int(k), reverse=True)
        text += " (by position: " + ", ".join(f"{'?' if k == 'None' else k}:{by_position[k]:.0f}" for k in keys) + ")"
    return text


def timed_per_iteration(iterations, warmup, key):
    """The mean per iteration over `iterations[warmup:]` of the cumulative per-iteration record
    `key` (a number, or a list of numbers: one mean each); None where the records lack it (no
    plugin, older JSON)."""
    cumulative = [it.get(key) for it in iterations]
    timed = len(cumulative) - warmup
    if timed <= 0 or cumulative[-1] is None or (warmup and cumulative[warmup - 1] is None):
        return None
    end, many = cumulative[-1], isinstance(cumulative[-1], (list, tuple))
    start = cumulative[warmup - 1] if warmup else ([0.0] * len(end) if many else 0.0)
    if many:
        return [(e - b) / timed for e, b in zip(end, start)]
    return (end - start) / timed


def timed_waits(iterations, warmup):
    """(before free, before step) ms per iteration over the timed iterations (`exposed_ms`)."""
    return timed_per_iteration(iterations, warmup, "exposed_ms")


def timed_hook_ms(iterations, warmup):
    """Host ms per iteration in the plugin's hooks over the timed iterations (`hook_ms`)."""
    return timed_per_iteration(iterations, warmup, "hook_ms")


def hooks_text(r):
    """The plugin's host time in its hooks as the transfer note prints it."""
    timed = r.get("timed_hook_ms")
    if timed is None:
        return "host time in hooks: not recorded"
    calls = r.get("hook_calls") or {}
    most = sorted((r.get("hook_host_ms") or {}).items(), key=lambda kv: -kv[1])[:3]
    return (f"host time in hooks {timed:.1f} ms per timed iteration (whole run, most: "
            + ", ".join(f"{k} {v:.0f} ms / {calls.get(k, 0)} calls" for k, v in most) + ")")


def step_text(r):
    """The streamed step's last budget and the most chunks it held for split parameters, as the
    transfer note prints them (nothing for the whole step or older records)."""
    waiting = (r.get("step_waiting") or [None])[0]
    budget = (r.get("step_budget_gib") or [0])[0]
    if waiting is None or not budget:
        return ""
    return f"; step budget {budget:.2f} GiB, up to {waiting} chunks held for split parameters"


def waits_text(r):
    """The exposed waits per iteration as the report prints them: over the timed iterations where
    recorded, and the whole run's average (start-up and calibrations included) beside it."""
    t = r["transfer"]
    whole = (t["exposed_d2h_ms"] / max(1, t["iterations"]), t["exposed_h2d_ms"] / max(1, t["iterations"]))
    timed = r.get("timed_exposed_ms")
    if timed is None:
        return f"before free {whole[0]:.1f} ms, before step {whole[1]:.1f} ms (whole run)"
    return (f"before free {timed[0]:.1f} ms, before step {timed[1]:.1f} ms over the timed iterations "
            f"(whole run {whole[0]:.1f} / {whole[1]:.1f})")


def summarize(run, warmup):
    ranks = run["ranks"]
    timed = ranks[0]["iterations"][warmup:]
    steps = [it["ms"] for it in timed]
    # Start to start (the recorder's period_ms): what the loop really takes per iteration, Megatron's
    # work between train_step calls included (where a read may wait behind the copy-out in flight).
    # The last iteration has no next start and is left out; records without periods (older ones, or
    # a single timed iteration) take train_step alone, and `median_of` says which.
    periods = [it["period_ms"] for it in timed if "period_ms" in it]
    return {
        "soak": soak_stats(ranks[0]["iterations"], warmup),
        "median_ms": statistics.median(periods or steps),
        "median_of": "start to start" if periods else "train_step",
        "median_train_step_ms": statistics.median(steps),
        # Whole run (start-up included), and steady state (iterations after warm-up).
        "max_allocated_gib": [run_peak(r, "max_allocated") / 2**30 for r in ranks],
        "max_reserved_gib": [run_peak(r) / 2**30 for r in ranks],
        "steady_max_allocated_gib": [run_peak(r, "max_allocated", warmup) / 2**30 for r in ranks],
        "steady_max_reserved_gib": [run_peak(r, "max_reserved", warmup) / 2**30 for r in ranks],
        "offloaded_gib": [r.get("offloaded_bytes", 0) / 2**30 for r in ranks],
        "pinned_gib": [r.get("pinned_bytes", 0) / 2**30 for r in ranks],
        "kept_gib": [r.get("kept_bytes", 0) / 2**30 for r in ranks],
        "losses": [it["loss"] for it in ranks[-1]["iterations"]],
        "timeline": ranks[0].get("timeline"),
        "timelines": ranks[0].get("timelines") or [],
        "busy_timelines": ranks[0].get("busy_timelines") or [],
        "transfer": ranks[0].get("transfer"),
        "fit_checks": [r.get("fit_checks") for r in ranks],
        "fit_check_ms": [r.get("fit_check_ms") for r in ranks],
        "fit_skips": [r.get("fit_skips") for r in ranks],
        "reloads_deferred_for_fit": [r.get("reloads_deferred_for_fit") for r in ranks],
        "reloads_deferred_for_position": [r.get("reloads_deferred_for_position") for r in ranks],
        "profile_relearned": [r.get("profile_relearned") for r in ranks],
        "profile_relearned_bytes": [r.get("profile_relearned_bytes") for r in ranks],
        "reload_starts": ranks[0].get("reload_starts"),
        "backward_workspace_mib": [(r.get("backward_workspace") or 0) / 2**20 for r in ranks],
        "workspace_by_position_mib": {k: v / 2**20 for k, v in (ranks[0].get("workspace_by_position") or {}).items()},
        "cache_releases": [r.get("cache_releases") for r in ranks],
        "cache_release_ms": [r.get("cache_release_ms") for r in ranks],
        "free_host_wait_ms": [r.get("free_host_wait_ms") for r in ranks],
        "host_lead_waits": [r.get("host_lead_waits") for r in ranks],
        "host_lead_wait_ms": [r.get("host_lead_wait_ms") for r in ranks],
        # rank 0's waits per timed iteration, (before free, before step) ms: the run's totals also hold
        # the start-up offloads and an automatic fraction's calibrations
        "timed_exposed_ms": timed_waits(ranks[0]["iterations"], warmup),
        # rank 0's host ms per timed iteration in the plugin's hooks, and per hook over the run
        "timed_hook_ms": timed_hook_ms(ranks[0]["iterations"], warmup),
        "hook_host_ms": ranks[0].get("hook_host_ms"),
        "hook_calls": ranks[0].get("hook_calls"),
        # rank 0's growth per pacing hook of the first forward, and its peak (MiB)
        "growth_profile_mib": [g / 2**20 for g in ranks[0].get("growth_profile") or []],
        "peak_growth_mib": (ranks[0].get("peak_growth") or 0) / 2**20,
        "expandable_segments": [r.get("expandable_segments") for r in ranks],
        "auto_fraction": [r.get("auto_fraction") for r in ranks],
        "auto_calibrations": ranks[0].get("auto_calibrations") or [],  # (rank 0's, as the planner's timeline)
        # every rank's readings, without the marks (which rank decided, and whether the cap did)
        "auto_readings": [[reading(c) for c in r.get("auto_calibrations") or []] for r in ranks],
        "step_budget_gib": [(r.get("step_budget_bytes") or 0) / 2**30 for r in ranks],
        "step_waiting": [r.get("step_waiting") for r in ranks],
        # Copy-out pieces the feeder enqueued (copy_feeder.py): > 0 where the copy-out started in the step.
        "feeder_enqueued_pieces": [r.get("feeder_enqueued_pieces") for r in ranks],
        "startup_and_run_s": run["seconds"],
        # The node's MemAvailable drop over the run (all ranks, their data-loader workers, the
        # kernel), against the pinned bytes of all ranks.
        "host_drop_gib": (run.get("host") or {}).get("drop", 0) / 2**30,
        "pinned_node_gib": sum(r.get("pinned_bytes", 0) for r in ranks) / 2**30,
        # Checkpoint saves of rank 0 (--extra '--save DIR --save-interval N'; with --async-save the
        # seconds are what the loop waited for): seconds, the plugin's share, GPU growth.
        "saves": ranks[0].get("saves") or [],
        # Every iteration of every rank in brief: where reserved memory grows, and what happened in
        # that iteration (collections, device allocations and frees of the caching allocator).
        "per_iteration": [per_iteration(r["iterations"]) for r in ranks],
    }


PER_ITERATION_KEYS = ("gc_gen1", "gc_full", "gc_full_collected", "alloc_retries", "device_allocs", "device_frees")


# Cumulative host ms in the recorder's iteration records, kept per iteration (each iteration's share).
PER_ITERATION_HOST_MS = ("finalize_host_ms", "host_lead_wait_ms")


def per_iteration(iterations):
    """Columns over a rank's iterations: ms, peak reserved and allocated MiB, the counters of
    PER_ITERATION_KEYS and each iteration's share of the running totals of PER_ITERATION_HOST_MS
    (None where a record lacks one)."""
    def shares(key):
        totals = [it.get(key) for it in iterations]
        return [None if now is None or (k and before is None) else round(now - (before if k else 0.0), 2)
                for k, (before, now) in enumerate(zip([None] + totals[:-1], totals))]

    return {"ms": [round(it["ms"], 1) for it in iterations],
            "period_ms": [round(it["period_ms"], 1) if "period_ms" in it else None for it in iterations],
            "max_reserved_mib": [it["max_reserved"] >> 20 for it in iterations],
            "max_allocated_mib": [it["max_allocated"] >> 20 for it in iterations],
            **{k: [it.get(k) for it in iterations] for k in PER_ITERATION_KEYS},
            **{k: shares(k) for k in PER_ITERATION_HOST_MS}}


def before_step_text(name, r):
    """Rank 0's GPU gap between the last backward and the step (`phase_totals`' "before the step") in
    each marked iteration, beside every rank's host ms in the plugin's `grads_finalizing` and in its
    host-lead bound's waits (those in the layer hooks, over the whole iteration). Without
    --overlap-grad-reduce, `grads_finalizing` runs before Megatron's `finalize_model_grads` enqueues
    the gradients' reduction, so where the host is not ahead of the GPU its time there is the GPU's
    too. Iterations count from 1, as elsewhere in the report. None without marks."""
    from megatron_offload import planner

    def at(column, i):
        return column[i] if column and i < len(column) else None

    ranks = r.get("per_iteration") or []
    parts = []
    for t in r.get("timelines") or []:
        # The record's index (older records: Megatron's number, the same in a fresh run without skips).
        i = t.get("record", t["iteration"])
        gap = phase_totals(planner.profile_from_timeline(t["marks"], 0.0).segments)["before the step"]
        host = [[at(cols.get(k), i) for cols in ranks] for k in PER_ITERATION_HOST_MS]
        known = any(x is not None for x in host[0])
        parts.append(f"{i + 1}: {gap:.1f}" + (" (" + ", ".join(
            f"{what} {' / '.join('-' if x is None else f'{x:.1f}' for x in xs)}"
            for what, xs in zip(("grads_finalizing", "host-lead waits over the iteration"), host)) + ")"
            if known else ""))
    if not parts:
        return None
    return (f"{name}: before the step, rank 0's GPU gap per marked iteration in ms (with the plugin, each rank's "
            f"host ms, rank 0 / 1 / ...): " + "; ".join(parts))


def planner_rates(ceilings, gbps=None, both_gbps=None, together=True):
    """(GB/s per direction, GB/s both at once) for the planner: given values, else the copy
    ceilings measured in the same call, else 55 GB/s (both: None, i.e. 2 x per direction).
    `together`: where measured, the ceilings of all the run's GPUs copying at once (the slowest
    GPU's): in a data-parallel run every rank steps, hence copies, at the same moment, and the GPUs
    of a host share its root complex and memory (where measured, each got far less copying at once
    than one GPU alone: benchmarks/NOTES.md)."""
    if ceilings and together and ceilings.get("all_devices"):
        ceilings = ceilings["all_devices"]
    if gbps is None:
        gbps = min(ceilings["d2h_gbps"], ceilings["h2d_gbps"]) if ceilings else 55.0
    if both_gbps is None and ceilings:
        both_gbps = ceilings.get("both_gbps")
    return gbps, both_gbps


def busy_iteration(variant, warmup):
    """The baseline's iteration marked with the GPU lagging the host (the phases' GPU time for the
    planner's host-lead model): the last warm-up iteration (Megatron counts from 0; `summarize`
    times iterations[warmup:]), so that its GPU sleep is never timed; None for other variants and
    where no earlier iteration sizes the sleep."""
    return warmup - 1 if variant == "baseline" and warmup >= 2 else None


def reference(results, name):
    """The baseline run under the same environment modifiers as `name`, else the plain baseline."""
    mods = name.split("@")[1:]
    return results.get("@".join(["baseline", *mods])) or results.get("baseline")


def baseline_phases(base):
    """(marks, step peak growth, iterations marked, busy marks) of the baseline for the planner: the
    per-phase median over its marked iterations (one slow phase of one iteration on a noisy host
    does not move the floor), else its one timeline; busy marks: its iteration marked with the GPU
    lagging the host (the recorder's MEGATRON_OFFLOAD_BUSY_AT; None in older records)."""
    from megatron_offload import planner

    timelines = base.get("timelines") or [base["timeline"]]
    marks = planner.median_marks([t["marks"] for t in timelines])
    busy = planner.median_marks([t["marks"] for t in base.get("busy_timelines") or []]) or None
    return marks, statistics.median(t["step_peak_growth"] for t in timelines), len(timelines), busy


def compare_with_planner(results, gbps, both_gbps=None, alone=None):
    """The planner's floor from the baseline's measured phase timeline, next to each offload
    variant's measured step time (rank 0). `both_gbps`: both directions at once (sum), as measured
    by the copy ceilings of the same call (default 2 x gbps: the chunked step's floor, which streams
    both ways at once, is then too low where the host cannot carry both at full rate; measured
    87.9 and 100.7 GB/s on two x2 hosts). `alone`: (gbps, both_gbps) of one GPU copying alone,
    for a second floor next to the first when the rates differ."""
    from megatron_offload import planner

    rows = {}
    for name, r in results.items():
        state = r["offloaded_gib"][0] * planner.GiB
        base = reference(results, name)
        if not state or not base or not base.get("timeline"):
            continue
        marks, step_growth, marked, busy = baseline_phases(base)
        prof = planner.profile_from_timeline(marks, state, step_growth, gbps, gbps, both_gbps or 2 * gbps,
                                             busy_marks=busy)
        budget = (r.get("step_budget_gib") or [0])[0] * planner.GiB

        def floor(profile):
            if budget:  # the chunked step: the whole state, the step holding at most `budget`
                return planner.predict(profile, state, step_budget=budget)
            return planner.predict(profile, min(state, profile.max_unchunked_bytes))

        pred = floor(prof)
        rows[name] = {"predicted_ms": pred.iteration_ms, "timeline_ms": prof.iteration_ms, "marked_iterations": marked,
                      "predicted_ratio": pred.ratio, "measured_ratio": r["ratio"],
                      # The ratios divide by different baselines: the floor by the baseline's marked phases,
                      # the measurement by its measured step (which also holds the host's work between
                      # iterations). Measured over modelled milliseconds reads the floor without that.
                      "measured_over_predicted_ms": measured_over(r, pred.iteration_ms),
                      "unchunked_cap_gib": prof.max_unchunked_bytes / planner.GiB,
                      "gbps": gbps, "both_gbps": both_gbps or 2 * gbps}
        also = ""
        if alone and tuple(alone) != (gbps, both_gbps):
            lone = dataclasses.replace(prof, d2h_gbps=alone[0], h2d_gbps=alone[0],
                                       both_gbps=alone[1] or 2 * alone[0])
            lone_pred = floor(lone)
            rows[name]["predicted_ratio_one_gpu_ceiling"] = lone_pred.ratio
            also = f" (with one GPU's ceilings {alone[0]:.1f} / both {lone.both_gbps:.1f} GB/s: {lone_pred.ratio:.3f}x)"
        if any(g.busy_ms is not None for g in prof.segments):
            # The floor as before the host's lead was modelled (every phase GPU-bound), for comparison.
            bound = floor(dataclasses.replace(prof, segments=[dataclasses.replace(g, busy_ms=None)
                                                              for g in prof.segments]))
            rows[name]["predicted_ratio_without_lead"] = bound.ratio
            also += (f" (the host's lead from the baseline's iteration {base['busy_timelines'][0]['iteration']}: "
                     f"phases {sum(g.ms - g.ms / g.speed for g in prof.segments):.0f} ms shorter on the GPU; "
                     f"without it {bound.ratio:.3f}x)")
        print(f"planner {name}: floor {pred.ratio:.3f}x of the baseline's phases (median of {marked} marked "
              f"iteration{'s' if marked > 1 else ''}) "
              f"({pred.iteration_ms:.0f} / {prof.iteration_ms:.0f} ms; {gbps:.1f} GB/s per direction, both "
              f"{both_gbps or 2 * gbps:.1f}){also}; measured {r['ratio']:.3f}x" + (
                  f"; in ms {r['median_ms']:.0f} = {rows[name]['measured_over_predicted_ms'] - 1:+.1%} of the modelled "
                  f"{pred.iteration_ms:.0f}" if rows[name]["measured_over_predicted_ms"] else ""))
        # Issue 24's streamed step (the stepped chunks leave during the step): the floor to beat.
        streamed = planner.predict(prof, state, streamed=True)
        rows[name]["predicted_ratio_streamed"] = streamed.ratio
        vs_streamed = rows[name]["measured_over_streamed_ms"] = measured_over(r, streamed.iteration_ms)
        # The floor of the engine the run used: the streamed step's, held to the run's own budget, where
        # the step was chunked and its copy-out fed from the step on (the default engine), else the one above.
        fed = budget and any((r.get("feeder_enqueued_pieces") or [0])[:1])

        def engine_floor(profile):
            return planner.predict(profile, state, step_budget=budget, streamed=True) if fed else floor(profile)

        engine = engine_floor(prof) if fed else pred
        rows[name]["engine_floor_ratio"] = engine.ratio
        rows[name]["measured_over_engine_floor_ms"] = measured_over(r, engine.iteration_ms)
        # The same with train_step alone (the modelled iteration spans the baseline's train_step; the
        # median above also holds the loop's work between train_step calls): comparable with records
        # from before start-to-start timing.
        step_only = rows[name]["train_step_over_engine_floor_ms"] = measured_over(
            r, engine.iteration_ms, "median_train_step_ms")
        # The same as ratios (the measured one over the timed baseline's median, the floor over the
        # baseline's marked phases): the two forms part where those two baseline figures do.
        as_ratios = rows[name]["measured_ratio_over_engine_floor"] = r["ratio"] / engine.ratio if engine.ratio else None
        prep = rows[name]["step_prep_ms"] = next((g.ms for g in prof.segments if g.kind == "step_prep"), None)
        prep_text = (f"the step's work before Adam {prep:.1f} ms" if prep is not None
                     else "the step's work before Adam not marked: copy-out modelled from the step's start")
        print(f"planner {name}: streamed-step floor {streamed.ratio:.3f}x ({streamed.sent_in_step / planner.GiB:.2f} GiB "
              f"out during the step; {prep_text})" + (f"; measured {vs_streamed - 1:+.1%} of its modelled "
                                         f"{streamed.iteration_ms:.0f} ms" if vs_streamed else ""))
        if fed:  # (the streamed step, held to rank 0's budget where that is below the state)
            which = ("the streamed step" if budget >= state
                     else f"the streamed step held to its budget, {budget / planner.GiB:.2f} GiB")
        else:
            which = "the floor of its step, above"
        vs_engine = rows[name]["measured_over_engine_floor_ms"]
        print(f"planner {name}: the run's own floor ({which}) {engine.ratio:.3f}x = {engine.iteration_ms:.0f} ms"
              + (f"; measured {vs_engine - 1:+.1%} in ms" if vs_engine else "")
              + (f", train_step alone {step_only - 1:+.1%}" if step_only else "")
              + (f", as ratios {r['ratio']:.3f}x / {engine.ratio:.3f}x = {as_ratios - 1:+.1%}" if as_ratios else ""))
        excess = phase_excess(base, r, prof, engine_floor)
        if excess:
            rows[name]["phase_excess_ms"] = excess
            print(f"planner {name}: measured minus modelled ms per phase (the run's floor, the loop's time as a gap "
                  f"before the forwards): " + ", ".join(f"{k} {v:+.1f}" for k, v in excess.items())
                  + f"; in all {sum(excess.values()):+.1f}")
        if name.startswith("offload-auto") or name.startswith("offload-frac"):
            # Issue 3's automatic mode: bytes off the peak against what the planner calls free
            # (the whole state of the baseline, at <= 0.5 % predicted cost).
            total = state + (r.get("kept_gib") or [0])[0] * planner.GiB
            free = planner.free_bytes(dataclasses.replace(prof, state_bytes=total))
            saved = r["reserved_saved_gib"] * planner.GiB
            # Every rank against the free bytes of rank 0's timeline (the ranks of a data-parallel job
            # run the same phases; issue 25 asks it of every rank).
            per_rank = [(b - m) * planner.GiB / free if free else None
                        for b, m in zip(base["max_reserved_gib"], r["max_reserved_gib"])]
            rows[name].update(planner_free_gib=free / planner.GiB, saved_of_free=saved / free if free else None,
                              saved_of_free_per_rank=per_rank)
            print(f"planner {name}: free (<= 0.5 % cost) {free / planner.GiB:.2f} GiB of {total / planner.GiB:.2f}; "
                  f"reserved saved {saved / planner.GiB:.2f} GiB = {saved / free if free else float('nan'):.0%} of it "
                  f"(per rank: {' / '.join(f'{x:.0%}' if x is not None else '-' for x in per_rank)}); "
                  f"chosen in-run: {[a and round(a['fraction'], 2) for a in r.get('auto_fraction') or []]}")
            for cal in r.get("auto_calibrations") or []:
                print(f"planner {name}: " + replay_calibration(cal, marks, gbps, both_gbps or 2 * gbps))
            if any(len(readings) > 1 for readings in r.get("auto_readings") or []):
                print(f"planner {name}: " + readings_text(r["auto_readings"], r.get("auto_fraction") or []))
    return rows


PHASE_GROUPS = ("before the forwards", "first forward", "rest", "last backward", "before the step", "step")


def phase_totals(segments, durations=None) -> dict:
    """Milliseconds per PHASE_GROUPS entry of planner segments: the gaps before the first forward,
    the first forward, the last backward, the gaps between it and the first step after it
    (gradient reduction, `finalize_model_grads`, the fallback reload), the step(s) and the rest
    (every phase and gap between the first forward and the last backward, and the gaps after the
    step), from `durations` (e.g. a prediction's `segment_ms`) or the segments' own `ms`. A run's
    measured phases against the simulated ones say where its excess over the floor lies."""
    from megatron_offload import planner

    durations = [g.ms for g in segments] if durations is None else durations
    kinds = [g.kind for g in segments]
    first_forward = kinds.index("forward") if "forward" in kinds else len(kinds)
    last_backward = len(kinds) - 1 - kinds[::-1].index("backward") if "backward" in kinds else -1
    # (the step's work before Adam counts as the step's)
    step = next((k for k in range(last_backward + 1, len(kinds)) if kinds[k] in planner.STEP_KINDS), len(kinds))
    totals = dict.fromkeys(PHASE_GROUPS, 0.0)
    for k, (kind, ms) in enumerate(zip(kinds, durations)):
        group = ("before the forwards" if k < first_forward else "first forward" if k == first_forward
                 else "last backward" if k == last_backward else "before the step" if 0 <= last_backward < k < step
                 else "step" if kind in planner.STEP_KINDS else "rest")
        totals[group] += ms
    return totals


def phase_excess(base, result, prof, engine_floor):
    """{phase group: measured ms - modelled ms} (`phase_totals`) of a variant against its
    engine's floor, or None where either run lacks marks or a start-to-start median. The modelled
    iteration spans the baseline's marks only; the loop's time outside them (start-to-start median
    minus the marked span) enters the model as a gap before the first forward, where copies run
    (it does not change the floor when the copy-out absorbs it), and the run's own loop time is
    measured the same way. Both loop times are clamped at 0: the median marks (the marked
    iterations) and the start-to-start median (the timed ones) come from different sets of
    iterations, and where a clamp acts the groups no longer sum to median minus floor."""
    from megatron_offload import planner

    marks = planner.median_marks([t["marks"] for t in result.get("timelines") or []])
    if not marks or not base.get("median_ms") or not result.get("median_ms"):
        return None
    loop = max(0.0, base["median_ms"] - prof.iteration_ms)
    gapped = dataclasses.replace(prof, segments=[planner.Segment("gap", loop, 0.0, 0.0)] + prof.segments)
    modelled = phase_totals(gapped.segments, engine_floor(gapped).segment_ms)
    own = planner.profile_from_timeline(marks, prof.state_bytes)
    measured = phase_totals(own.segments)
    measured["before the forwards"] += max(0.0, result["median_ms"] - own.iteration_ms)
    return {k: measured[k] - modelled[k] for k in PHASE_GROUPS}


READING_KEYS = ("iteration", "free_fraction", "free_upper", "stalls_ms", "d2h_gbps", "h2d_gbps", "iteration_ms")


def reading(cal):
    """One calibration record without its marks. `iteration_ms` is the plugin's (the profile of
    the trimmed timeline, which `refine`'s guard compares the waits with); records written
    before it kept that figure get the trimmed marks' span."""
    from megatron_offload import auto_fraction

    out = {k: cal.get(k) for k in READING_KEYS}
    if out["iteration_ms"] is None:
        out["iteration_ms"] = marks_span(auto_fraction.first_forward_as_the_others(cal.get("marks") or []))
    return out


def marks_span(marks):
    """ms from a timeline's first mark to its last (0 without marks)."""
    return marks[-1][1] - marks[0][1] if marks else 0.0


def readings_text(readings, choices):
    """Each rank's first and second calibration (free share trimmed / untrimmed) and what
    `auto_fraction.refine` makes of them with the cap and without (the `@calnocap` diagnostic),
    beside the free share the job agreed on: which rank decided, and whether the cap did. As in
    the run, each rank's first choice is the job's after the first calibration (`agree`: the
    smallest first reading), its cap its own untrimmed reading."""
    from megatron_offload import auto_fraction

    def choice(rec, free=None):
        return auto_fraction.Choice(0.0, rec["free_fraction"] if free is None else free, 0.0, rec["iteration_ms"],
                                    rec["stalls_ms"], rec.get("d2h_gbps") or 0.0, rec.get("h2d_gbps") or 0.0,
                                    free_upper=rec["free_upper"])

    agreed_first = min((recs[0]["free_fraction"] for recs in readings if recs), default=None)
    parts = []
    for rank, recs in enumerate(readings):
        if len(recs) < 2:
            continue
        first, second = choice(recs[0], min(recs[0]["free_fraction"], agreed_first)), choice(recs[-1])
        capped, lifted = (auto_fraction.refine(first, second, capped=c).free_fraction for c in (True, False))
        parts.append(f"rank {rank} {recs[0]['free_fraction']:.3f} / {first.free_upper:.3f}, then {second.free_fraction:.3f} / "
                     f"{second.free_upper:.3f} -> {capped:.3f} capped, {lifted:.3f} without the cap")
    agreed = [c["free_fraction"] for c in choices if c]
    return ("per rank, first then second calibration (free share trimmed / untrimmed; the first's lower bound the "
            f"job's smallest, {agreed_first:.3f}): " + "; ".join(parts)
            + (f"; the job agreed on {min(agreed):.3f}" if agreed else ""))


def replay_calibration(cal, base_marks, gbps, both_gbps):
    """One in-run calibration of the automatic fraction (rank 0's record) against the baseline.

    The calibration's own reading (before a second calibration's bounds and the job's agreement),
    then the planner's free share on its marks (first forward trimmed as in-run, and untrimmed)
    at the rates it used in-run (auto_fraction.choose: measured, both ways at BOTH_DIRECTIONS_SHARE
    of their sum) and at this call's ceilings, the same on the baseline's marks at those ceilings,
    and the phases of both in ms. The two replays on the calibration's marks differ by the rates
    alone; the calibration's against the baseline's at the same ceilings differ by the marks
    alone, and the phases say where. (The baseline's share here has no step growth and no busy
    marks, as in-run: it can differ slightly from the `free` figure above.)"""
    from megatron_offload import auto_fraction, planner

    state = cal["state_bytes"]
    d2h, h2d = cal.get("d2h_gbps") or gbps, cal.get("h2d_gbps") or gbps

    def profile(marks, out=gbps, into=gbps, both=both_gbps):
        return planner.profile_from_timeline(marks, state, 0.0, out, into, both)

    def free(marks, **rates):
        return planner.free_bytes(profile(marks, **rates)) / state if state else 1.0

    def summary(marks):
        """First forward, mean of the later ones, last backward, step (ms; the profile's phases)."""
        segments = profile(marks).segments
        forwards = [g.ms for g in segments if g.kind == "forward"]
        backwards = [g.ms for g in segments if g.kind == "backward"]
        step = sum(g.ms for g in segments if g.kind in planner.STEP_KINDS)  # (one step per iteration)
        return (forwards[:1] or [0.0])[0], statistics.mean(forwards[1:] or [0.0]), (backwards[-1:] or [0.0])[0], step

    names = ("first forward", "later forwards", "last backward", "step")
    both = ", ".join(f"{n} {a:.1f} / {b:.1f}" for n, a, b in zip(names, summary(cal["marks"]), summary(base_marks)))
    span, base_span = marks_span(cal["marks"]), marks_span(base_marks)
    trimmed = auto_fraction.first_forward_as_the_others(cal["marks"])
    in_run = dict(out=d2h, into=h2d, both=auto_fraction.BOTH_DIRECTIONS_SHARE * (d2h + h2d))
    return (f"calibration at iteration {cal['iteration']}: its own reading free {cal['free_fraction']:.3f} (untrimmed "
            f"{cal['free_upper']:.3f}, stalls {cal['stalls_ms']:.1f} ms removed); replayed at its rates {d2h:.1f} / "
            f"{h2d:.1f} / both {in_run['both']:.1f} GB/s {free(trimmed, **in_run):.3f} (untrimmed "
            f"{free(cal['marks'], **in_run):.3f}), at the ceilings {gbps:.1f} / both {both_gbps:.1f} GB/s "
            f"{free(trimmed):.3f} (untrimmed {free(cal['marks']):.3f}); on the baseline's marks {free(base_marks):.3f}; "
            f"ms calibration / baseline: {both}, marked span {span:.1f} / {base_span:.1f}")


def report(results, ceilings):
    """Each variant against its baseline (ratios, memory saved per rank, loss equality) as a
    table and notes; adds those figures to `results`."""
    print("| variant | ms/iter | x baseline | max allocated GiB | max reserved GiB | steady max reserved GiB | "
          "reserved saved GiB | offloaded GiB | saved / offloaded (per rank) | pinned GiB | losses == baseline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for name, r in results.items():
        ref = reference(results, name)
        r["reference"] = next((k for k, v in results.items() if v is ref), None)
        ratio = r["median_ms"] / ref["median_ms"] if ref else float("nan")
        saved = (ref["max_reserved_gib"][0] - r["max_reserved_gib"][0]) if ref else float("nan")
        frac = saved / r["offloaded_gib"][0] if r["offloaded_gib"][0] else float("nan")
        # Per rank: the acceptance asks for every rank.
        fracs = [(b - m) / o if ref and o else float("nan")
                 for b, m, o in zip(ref["max_reserved_gib"] if ref else [], r["max_reserved_gib"], r["offloaded_gib"])]
        r["saved_fraction_of_offloaded_per_rank"] = fracs
        n = min(len(r["losses"]), len(ref["losses"])) if ref else 0
        # Every loss of the shorter run (a variant stopped early) against the baseline's; an empty
        # or loss-less record is not "identical".
        same = (n > 0 and n == len(r["losses"]) and None not in r["losses"]
                and r["losses"][:n] == ref["losses"][:n]) if ref else None
        r.update(ratio=ratio, reserved_saved_gib=saved, saved_fraction_of_offloaded=frac, losses_identical=same)
        if r.get("transfer"):
            t = r["transfer"]
            # (A call run with --no-ceilings still gets the plugin's counters, without the shares.)
            d2h_share = f" ({t['d2h_gbps'] / ceilings['d2h_gbps']:.0%} of ceiling)" if ceilings else ""
            h2d_share = f" ({t['h2d_gbps'] / ceilings['h2d_gbps']:.0%})" if ceilings else ""
            notes.append(f"{name}: achieved D2H {t['d2h_gbps']:.1f} GB/s{d2h_share}, "
                  f"H2D {t['h2d_gbps']:.1f} GB/s{h2d_share}; exposed "
                  f"waits per iteration: {waits_text(r)}; free-block checks "
                  f"{r['fit_checks'][0]} ({r['fit_check_ms'][0] or 0:.0f} ms host in all; "
                  f"{(r.get('fit_skips') or [None])[0]} answered by the counters), reloads deferred "
                  f"for fit {r['reloads_deferred_for_fit'][0]} ({workspace_text(r)}), chunks held back by the position rule "
                  f"{(r.get('reloads_deferred_for_position') or [None])[0]} (once per hook); growth profile learned "
                  f"again {relearned_text(r)}; {reload_starts_text(r)}; "
                  f"cached-memory releases {r['cache_releases'][0]} "
                  f"({r['cache_release_ms'][0] or 0:.0f} ms host in all); host waits at frees "
                  f"{(r.get('free_host_wait_ms') or [0])[0] or 0:.0f} ms in all; host-lead waits "
                  f"{(r.get('host_lead_waits') or [0])[0] or 0} ({(r.get('host_lead_wait_ms') or [0])[0] or 0:.0f} ms in "
                  f"all); {hooks_text(r)}; expandable segments {r['expandable_segments']}{step_text(r)}")
        if ref and ref is not r and "host_drop_gib" in r and "host_drop_gib" in ref:
            # Acceptance of the host-memory fix: node drop over the baseline's <= 1.05 x pinned + 1 GiB/rank.
            extra = r["host_drop_gib"] - ref["host_drop_gib"]
            r["host_extra_gib"] = extra
            notes.append(f"{name}: host MemAvailable drop {r['host_drop_gib']:.2f} GiB (baseline "
                         f"{ref['host_drop_gib']:.2f}), {extra:+.2f} GiB over the baseline for "
                         f"{r['pinned_node_gib']:.2f} GiB pinned on the node"
                         + (f" = {extra / r['pinned_node_gib']:.2f}x" if r["pinned_node_gib"] else ""))
        print(f"| {name} | {r['median_ms']:.1f} | {ratio:.3f} | {r['max_allocated_gib'][0]:.2f} | "
              f"{r['max_reserved_gib'][0]:.2f} | {r['steady_max_reserved_gib'][0]:.2f} | {saved:.2f} | "
              f"{r['offloaded_gib'][0]:.2f} | {' / '.join(f'{x:.3f}' for x in fracs) or frac} | "
              f"{r['pinned_gib'][0]:.2f} | {same} |")
    for name, r in results.items():
        for rank, cols in enumerate(r.get("per_iteration") or []):
            # Where reserved memory grew (iterations from 1) and what that iteration did.
            res = cols["max_reserved_mib"]
            grew = [f"{i + 1}: {res[i - 1]}->{res[i]}" + "".join(
                f" {k}={cols[k][i]}" for k in ("gc_full", "device_allocs") if cols[k][i])
                for i in range(1, len(res)) if res[i] > res[i - 1]]
            full = [i + 1 for i, n in enumerate(cols["gc_full"]) if n]
            listed = f"peak reserved MiB per iteration {res}; " if rank == 0 and len(res) <= 60 else ""
            notes.append(f"{name} rank {rank}: {listed}grew at {'; '.join(grew[:20]) or 'none'}"
                         f"{f' (+{len(grew) - 20} more)' if len(grew) > 20 else ''}; full collections in "
                         f"{full[:20] or 'none'}")
        gap_text = before_step_text(name, r)
        if gap_text:
            notes.append(gap_text)
        if r.get("saves"):
            later = saves_after_the_first(r)
            if later:
                ref = reference(results, name)
                ref_later = saves_after_the_first(ref) if ref and ref is not r else None
                notes.append(f"{name}: saves after the first blocked the loop a median {later['seconds']:.3f} s "
                             f"over {later['count']} (state dict {later['state_dict_s']:.3f} + dist save "
                             f"{later['dist_save_s']:.3f} + schedule {later['schedule_s']:.3f}, medians)"
                             + (f"; the baseline's {ref_later['seconds']:.3f} s over {ref_later['count']}: "
                                f"{later['seconds'] - ref_later['seconds']:+.3f} s" if ref_later else ""))
                if "with_after_s" in later:
                    notes.append(
                        f"{name}: with the {AFTER_SAVE_ITERATIONS} iterations after each (their excess over the "
                        f"median iteration, median {later['after_s']:+.3f} s): a median {later['with_after_s']:.3f} s "
                        f"per save ({', '.join(f'{x:.3f}' for x in later['with_after_each_s'])}; saves followed by "
                        f"{AFTER_SAVE_ITERATIONS} timed iterations)"
                        + (f"; the baseline's {ref_later['with_after_s']:.3f} s "
                           f"({', '.join(f'{x:.3f}' for x in ref_later['with_after_each_s'])}): "
                           f"{later['with_after_s'] - ref_later['with_after_s']:+.3f} s"
                           if ref_later and "with_after_s" in ref_later else ""))
            notes.append(f"{name}: checkpoint saves blocked the loop " + ", ".join(
                f"{sv['seconds']:.2f} s (plugin {sv.get('plugin_seconds', 0):.2f} s"
                + (f" of which a garbage collection {sv['plugin_collect_seconds']:.2f} s"
                   if sv.get("plugin_collect_seconds") else "")
                + (f", waits for snapshot fills {sv['plugin_fill_wait_seconds']:.2f} s"
                   if sv.get("plugin_fill_wait_seconds") else "")
                + (f", {sv['plugin_device_fill_bytes'] / 2**30:.2f} GiB of snapshots copied from the GPU"
                   if sv.get("plugin_device_fill_bytes") else "")
                + (f", Python's collector {sv['gc_ms'] / 1e3:.2f} s" if sv.get("gc_ms", 0) >= 1 else "")
                + f", GPU "
                f"{(sv['max_allocated'] - sv['allocated_before']) / 2**20:+.0f} MiB, snapshots "
                f"{sv.get('snapshot_bytes', 0) / 2**30:.2f} GiB of host memory)" for sv in r["saves"]))
    for name, r in results.items():
        soak, ref = r.get("soak"), reference(results, name)
        if soak:
            against = ""
            if ref and ref.get("soak") and ref is not r:
                against = (f"; p99/p50 {soak['p99_over_p50'] / ref['soak']['p99_over_p50']:.3f}x the baseline's "
                           f"({ref['soak']['p99_over_p50']:.3f})")
            notes.append(f"{name} soak over {soak['iterations']} iterations: p50 {soak['p50_ms']:.1f} ms, p99 "
                         f"{soak['p99_ms']:.1f} ms (p99/p50 {soak['p99_over_p50']:.3f}{against}), max {soak['max_ms']:.1f} ms "
                         f"at iterations {soak['slowest_iterations']}; peak reserved first 100 {soak['reserved_first_gib']:.2f} "
                         f"GiB, last 100 {soak['reserved_last_gib']:.2f} GiB ({soak['reserved_creep']:+.2%})")
    print("\n".join(notes))


# Iterations after a save whose time over the run's median counts as the save's: what a save
# leaves the loop to wait for (a copy still running, a collection it set off) shows there.
AFTER_SAVE_ITERATIONS = 2


def after_save_excess(r, sv):
    """Seconds the AFTER_SAVE_ITERATIONS iterations after save `sv` took beyond the median of rank 0's
    iterations that follow no save; None where they were not timed."""
    ms = ((r.get("per_iteration") or [{}])[0] or {}).get("ms")
    if not ms:
        return None
    after = {sv2["after_iteration"] + i for sv2 in r.get("saves") or [] for i in range(AFTER_SAVE_ITERATIONS)}
    usual = [x for i, x in enumerate(ms) if x is not None and i not in after]
    k = sv["after_iteration"]
    window = ms[k:k + AFTER_SAVE_ITERATIONS]
    if not usual or len(window) < AFTER_SAVE_ITERATIONS or None in window:
        return None
    return sum(window) / 1e3 - AFTER_SAVE_ITERATIONS * statistics.median(usual) / 1e3


def saves_after_the_first(r):
    """Medians over a run's checkpoint saves but the first (which, with --async-save, also starts
    the writer's process): the seconds the loop was blocked and their parts, the excess of the
    iterations after each (`after_save_excess`) and the two together; None with fewer than two."""
    saves = (r.get("saves") or [])[1:]
    if not saves:
        return None
    out = {"count": len(saves), "seconds": statistics.median(sv["seconds"] for sv in saves)}
    for key in ("state_dict_s", "dist_save_s", "schedule_s"):
        out[key] = statistics.median((sv.get("parts") or {}).get(key, 0.0) for sv in saves)
    timed = [(sv, after_save_excess(r, sv)) for sv in saves]
    timed = [(sv, e) for sv, e in timed if e is not None]  # (not a save after the last timed iterations)
    if timed:
        out["after_s"] = statistics.median(e for _, e in timed)
        out["with_after_s"] = statistics.median(sv["seconds"] + e for sv, e in timed)
        out["with_after_each_s"] = [round(sv["seconds"] + e, 3) for sv, e in timed]
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="r1", choices=sorted(PRESETS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--variants", default="baseline,offload")
    p.add_argument("--out", default="/tmp/megatron_offload_bench")
    p.add_argument("--extra", action="append", default=[],
                   help="extra Megatron args for every run (repeatable; each is split at spaces; "
                        "'{variant}' becomes the variant's name)")
    p.add_argument("--gbs", type=int, default=None,
                   help="global batch size instead of the preset's (e.g. R1's 4 microbatches per rank on one "
                        "GPU: --nproc 1 --gbs 8)")
    p.add_argument("--gbps", type=float, default=None,
                   help="PCIe GB/s per direction for the planner (default: measured, see --no-ceilings)")
    p.add_argument("--both-gbps", type=float, default=None,
                   help="GB/s of both directions at once, summed (default: measured, else 2 x --gbps)")
    p.add_argument("--no-ceilings", action="store_true", help="skip measuring the copy ceilings first")
    p.add_argument("--replan", metavar="BENCHMARK_JSON",
                   help="no runs: the planner comparison again for a finished benchmark.json (its own ceilings)")
    p.add_argument("--timeline-at", default=None,
                   help="iterations whose phases are marked for the planner, comma-separated; the planner "
                        "takes the per-phase median (default: the three after warmup + 1, within --iters)")
    p.add_argument("--env", action="append", default=[],
                   help="KEY=VALUE for every run, e.g. CUDA_DEVICE_MAX_CONNECTIONS=8 (default 1)")
    opts = p.parse_args(argv)
    if opts.replan:
        done = json.load(open(opts.replan))
        report(done["results"], done.get("ceilings"))  # (again: a benchmark cut short has no table)
        compare_with_planner(done["results"], *planner_rates(done.get("ceilings"), opts.gbps, opts.both_gbps),
                             alone=planner_rates(done.get("ceilings"), together=False))
        return
    env_extra = dict(kv.split("=", 1) for kv in opts.env)
    env_extra.setdefault("MEGATRON_OFFLOAD_NO_DIGEST", "1")  # the losses are compared, not digests
    marked = range(opts.warmup + 2, min(opts.warmup + 5, opts.iters + 1))
    env_extra.setdefault("MEGATRON_OFFLOAD_TIMELINE_AT",
                         opts.timeline_at if opts.timeline_at is not None else ",".join(map(str, marked)))
    os.makedirs(opts.out, exist_ok=True)
    if os.path.exists(os.path.join(opts.out, "benchmark.json")):  # (an earlier call's must not pass for this one's)
        os.remove(os.path.join(opts.out, "benchmark.json"))
    preset = dict(PRESETS[opts.preset], **({"gbs": opts.gbs} if opts.gbs else {}))
    base = model_args(opts.iters, **preset) + PRESET_ARGS.get(opts.preset, []) + " ".join(opts.extra).split()
    ceilings = None
    if not opts.no_ceilings:
        # In a subprocess: a CUDA context in this driver would sit on GPU 0 during the runs.
        path = os.path.join(opts.out, "ceilings.json")
        done = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "copy_ceilings.py"), "--sizes-gib", "4", "--out", path,
                               "--devices", str(opts.nproc)])
        if done.returncode == 0 and os.path.exists(path):
            ceilings = json.load(open(path))[-1]
        else:  # the runs matter more than the ceiling: go on without it
            print("copy ceilings could not be measured; the planner assumes 55 GB/s", flush=True)
    if ceilings is None and opts.nproc > 1 and opts.both_gbps is None:
        # (the GPUs of one host copying both ways at once get far less than one GPU alone does:
        # copy_ceilings.py's all_devices figures in benchmarks/NOTES.md)
        print(f"planner: no copy ceilings measured; the floors assume one GPU's nominal rates, optimistic at "
              f"{opts.nproc} GPUs (give --gbps / --both-gbps, or replan with a call's ceilings)", flush=True)
    opts.gbps, opts.both_gbps = planner_rates(ceilings, opts.gbps, opts.both_gbps)
    results = {}
    for name in opts.variants.split(","):
        variant, *mods = name.split("@")
        env = dict(env_extra)
        env.update(VARIANT_ENV.get(variant, {}))
        extra_args = []
        for mod in mods:
            if mod in ARG_MODIFIERS:
                extra_args += ARG_MODIFIERS[mod]
            else:
                env.update(MODIFIERS[mod])
        iters = min(opts.iters, MAX_ITERS.get(variant, opts.iters))
        warmup = min(opts.warmup, iters // 2)
        busy_at = busy_iteration(variant, warmup)
        if busy_at is not None:
            env.setdefault("MEGATRON_OFFLOAD_BUSY_AT", str(busy_at))
        # Same --train-iters (hence the same LR schedule and losses); stop early with --exit-interval.
        stop = ["--exit-interval", str(iters)] if iters < opts.iters else []
        # ("{variant}" in an --extra argument: this variant's name, e.g. a checkpoint folder of its own)
        args = [a.replace("{variant}", name) for a in base]
        run = launch(name, args + variant_args(variant) + extra_args + stop, opts.nproc, opts.out, env_extra=env)
        results[name] = summarize(run, warmup)
        results[name]["iterations_timed"] = f"{warmup + 1}-{iters}"
        print(f"{name}: median {results[name]['median_ms']:.1f} ms/iter {results[name]['median_of']} "
              f"({results[name]['median_train_step_ms']:.1f} in train_step)", flush=True)
        with open(os.path.join(opts.out, "benchmark.json"), "w") as f:  # partial, in case of a time-out
            json.dump({"partial": True, "ceilings": ceilings, "results": results}, f, indent=1)
    print(f"\npreset {opts.preset}, {opts.nproc} GPUs, iterations {opts.warmup + 1}-{opts.iters} (fewer for "
          f"{', '.join(MAX_ITERS)}), rank 0 unless noted; each variant against the baseline with the same '@' modifiers")
    report(results, ceilings)
    planned = compare_with_planner(results, opts.gbps, opts.both_gbps,
                                   alone=planner_rates(ceilings, together=False))
    with open(os.path.join(opts.out, "benchmark.json"), "w") as f:
        json.dump({"preset": opts.preset, "gbs": preset["gbs"], "nproc": opts.nproc, "iters": opts.iters, "warmup": opts.warmup,
                   "env": env_extra, "planner": planned, "ceilings": ceilings,
                   "args": base, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
