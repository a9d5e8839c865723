"""The plugin's Megatron flags: their definitions (`--offload-*`), the checks of their values, and
their translation into an `OffloadConfig`. Combinations with Megatron's own flags are judged in
validation.py; megatron_wiring.py registers these with Megatron's parser.
"""

from __future__ import annotations

import dataclasses

from . import validation
from .chunks import DEFAULT_CHUNK_BYTES
from .config import DEFERRED_FREES_HOST_LEAD_LAYERS, DEFAULT_MARGIN_BYTES, OffloadConfig

# `--offload-state-fraction auto` measures this iteration: the first has start-up costs, the
# second is the first with the coordinator's memory profile.
AUTO = "auto"
AUTO_FRACTION_ITERATION = 3
# --offload-step: the streamed step (chunked_step.py, chunked_schedule.py) or the whole state back
# for one step.
STREAMED, WHOLE = "streamed", "whole"
STEP_ENGINES = (STREAMED, WHOLE)
# The streamed step's copy-out in flight by default (MiB): chosen side by side with 256 (see [Note:
# copy-out at the next forward] in docs/design.md). What it costs: a read right after the step (the
# loss) may wait behind this much copy.
DEFAULT_IN_FLIGHT_MB = 1024

# Overrides of OffloadConfig's diagnostic fields (keep_backward_workspace, backward_reloads,
# host_waits_at_free, release_at), set before training by a benchmark's launcher to measure
# alternatives side by side; empty in a user's run.
DIAGNOSTICS: dict = {}


def add_flags(parser):
    """Add the `--offload-*` flags to `parser` (an argparse parser), in a group of their own."""
    group = parser.add_argument_group(title="megatron-offload")
    group.add_argument(
        "--offload-optimizer-states",
        action="store_true",
        help="Move the DistributedOptimizer's Adam moments and fp32 master weights to pinned CPU "
        "memory between steps and bring them back, overlapped with compute, before the next "
        "step. The Adam step stays on the GPU. (megatron-offload)",
    )
    group.add_argument(
        "--offload-chunk-size-mb",
        type=int,
        default=DEFAULT_CHUNK_BYTES // 2**20,
        help="Granularity (MiB) at which offloaded state is freed during the forward and "
        "reloaded during the last backward. Chunks are balanced and rounded, and a state "
        "tensor is never split (a chunk holds at least the largest one), so the size used "
        "can differ; the start-up line gives it. (megatron-offload)",
    )
    group.add_argument(
        "--offload-memory-margin-mb",
        type=int,
        default=None,
        help="Safety margin (MiB) kept below the measured activation peak when deciding how "
        f"late state may stay on the GPU. Default: {DEFAULT_MARGIN_BYTES // 2**20}, or the memory the "
        "first iterations kept for good (e.g. FP8 weight copies) where that is larger; a value "
        "given here is used as it is. (megatron-offload)",
    )
    group.add_argument(
        "--offload-state-fraction",
        type=_fraction_or_auto,
        default=1.0,
        help="Share (0 < f <= 1) of each DistributedOptimizer's state bytes to offload; the rest "
        "stays on the GPU. 'auto': offload everything for the first iterations, measure one of them "
        "(phase times, activation memory, copy bandwidth), then offload only what moves without "
        "delaying the step, but at least what this GPU's memory requires. `python -m "
        "megatron_offload.planner` computes the same from a profile. (megatron-offload)",
    )
    group.add_argument(
        "--offload-step",
        choices=STEP_ENGINES,
        default=None,
        help="How the optimizer step meets the offloaded state. 'streamed' (the default): the step "
        "runs chunk by chunk, each chunk stepped as it comes back and copied out right after, both "
        "copy directions overlapped, the state on the GPU bounded by --offload-step-budget-mb. "
        "'whole': the whole state comes back for one step and leaves with the next forward (the "
        "default under --fp8-param-gather / --fp4-param-gather, which quantize all parameters in "
        "one operation, under --log-params-norm, which reads every master right after the step, "
        "and with --offload-state-fraction auto, whose model is the whole step; unless "
        "--offload-step-budget-mb is given). (megatron-offload)",
    )
    group.add_argument(
        "--offload-chunked-step",
        action="store_true",
        help="Same as --offload-step streamed (kept for older command lines). (megatron-offload)",
    )
    group.add_argument(
        "--offload-step-budget-mb",
        type=int,
        default=0,
        help="With the streamed step: at most this many MiB of optimizer state on the GPU "
        "during the step (at least one chunk). 0: what the activations of the forward left "
        "room for, at least three chunks. Either floor grows by the chunks that a parameter "
        "split over several holds until its last one is stepped. (megatron-offload)",
    )
    group.add_argument(
        "--offload-release-cached-memory",
        action="store_true",
        help="Once per iteration, when the offloaded state has left the GPU, return PyTorch's "
        "cached free memory to the device (torch.cuda.empty_cache). Experimental: it can stop "
        "reserved memory creeping up over iterations, at some time per step, but it can also raise "
        "the peak (each iteration maps its memory anew). (megatron-offload)",
    )
    group.add_argument(
        "--offload-copy-piece-mb",
        type=int,
        default=0,
        help="Split each chunk's D2H/H2D copy into pieces of this many MiB (0: one copy per "
        "chunk). (megatron-offload)",
    )
    group.add_argument(
        "--offload-copy-out-in-flight-mb",
        type=int,
        default=None,
        help="Start the copy-out as the step goes (each chunk once stepped; with --offload-step "
        "whole: when the step is done) and let a host thread keep about this many MiB of it queued "
        "on the GPU, so that the host's reads right after the step wait behind at most that much. "
        f"0: copy out at the next forward. Default: {DEFAULT_IN_FLIGHT_MB} with the streamed step, "
        "0 with the whole step. (megatron-offload)",
    )
    group.add_argument(
        "--offload-host-lead-layers",
        type=int,
        default=None,
        help="Keep the host at most this many layers (layer hooks, the output layer included) "
        "ahead of the GPU during the forward and backward (0: no bound). A host far ahead "
        "allocates before memory freed through another stream is reusable (weight gradients "
        "while DDP's gradient accumulators stay on their own stream), and reserved memory grows "
        "while the GPU waits for the plugin's copies. Default: 0 where the plugin re-creates those "
        f"accumulators on the compute stream, {DEFERRED_FREES_HOST_LEAD_LAYERS} where they stay "
        "(--offload-keep-ddp-grad-stream, nodes it cannot replace). The calibration iterations of "
        "--offload-state-fraction auto keep one layer whatever N. (megatron-offload)",
    )
    group.add_argument(
        "--offload-keep-ddp-grad-stream",
        action="store_true",
        help="Leave the gradient-accumulation (AccumulateGrad) nodes of megatron-core's DDP on the "
        "side stream that get_model builds DDP under. By default the plugin re-creates them, with "
        "DDP's hooks, on the compute stream, so that each weight gradient is freed at once instead "
        "of at an event of that stream; deferred frees make reserved memory grow over the first "
        "iterations while the GPU waits for the plugin's copies. Also turns "
        "the host-lead bound on (--offload-host-lead-layers). (megatron-offload)",
    )
    group.add_argument(
        "--offload-no-timing",
        action="store_true",
        help="Do not record CUDA events around copies (no D2H/H2D timings in the log). "
        "(megatron-offload)",
    )
    return parser


def _fraction_or_auto(value: str):
    return AUTO if value == AUTO else float(value)


def check_values(args) -> None:
    """Refuse flag values out of range (OffloadArgumentError)."""
    if not getattr(args, "offload_optimizer_states", False):
        return
    if args.offload_chunk_size_mb <= 0:
        raise validation.OffloadArgumentError("--offload-chunk-size-mb must be positive")
    if args.offload_memory_margin_mb is not None and args.offload_memory_margin_mb < 0:
        raise validation.OffloadArgumentError("--offload-memory-margin-mb must be >= 0")
    if args.offload_step_budget_mb < 0:
        raise validation.OffloadArgumentError("--offload-step-budget-mb must be >= 0 (0: automatic)")
    if getattr(args, "offload_chunked_step", False) and getattr(args, "offload_step", None) == WHOLE:
        raise validation.OffloadArgumentError(
            "--offload-chunked-step asks for the streamed step and --offload-step whole for the whole "
            "step: drop one of them")
    if args.offload_step_budget_mb and step_engine(args) == WHOLE:
        raise validation.OffloadArgumentError(
            "--offload-step-budget-mb bounds the state resident during a streamed step, and this run "
            "asks for the whole step (--offload-step whole): drop one of them")
    if args.offload_copy_piece_mb < 0:
        raise validation.OffloadArgumentError("--offload-copy-piece-mb must be >= 0")
    if (args.offload_copy_out_in_flight_mb or 0) < 0:
        raise validation.OffloadArgumentError("--offload-copy-out-in-flight-mb must be >= 0 (0: off)")
    if (args.offload_host_lead_layers or 0) < 0:
        raise validation.OffloadArgumentError("--offload-host-lead-layers must be >= 0 (0: no bound)")
    if args.offload_state_fraction != AUTO and not 0.0 < args.offload_state_fraction <= 1.0:
        raise validation.OffloadArgumentError(
            "--offload-state-fraction must be in (0, 1] or 'auto': the share of the optimizer "
            "state to offload (drop --offload-optimizer-states to offload nothing)")


def _whole_by_default(args):
    """Why the default engine is the whole step for these flags (None: it is the streamed step)."""
    for flag, name in validation.QUANTIZED_GATHER_FLAGS:
        if getattr(args, name, False):
            return f"{flag} quantizes all parameters at once"
    if getattr(args, "log_params_norm", False):
        # Why: the norm reads every master right after the step; the streamed step would have to
        # wait there for its whole copy-out (or bring chunks back), the whole step has them resident.
        return "--log-params-norm reads every master right after the step"
    if getattr(args, "offload_state_fraction", None) == AUTO:
        # Why: the automatic fraction measures and models the whole step's schedule (auto_fraction.py,
        # planner.py); on the streamed step it chose fractions that cost more (benchmarks/NOTES.md).
        return "the automatic fraction models the whole step"
    return None


def step_engine(args) -> str:
    """--offload-step as given; else the streamed step where a step budget is given (it bounds that
    step) or nothing calls for the whole step (`_whole_by_default`)."""
    chosen = validation.chosen_step(args)
    if chosen:
        return chosen
    if validation.asks_for_streamed_step(args):
        return STREAMED
    return WHOLE if _whole_by_default(args) else STREAMED


def step_engine_note(args) -> str:
    """How the attach line names the step engine (and why, where the default was not taken)."""
    engine = step_engine(args)
    if engine == WHOLE and not validation.chosen_step(args):
        return f"whole step ({_whole_by_default(args)})"
    return f"{engine} step"


def copy_out_in_flight_mb(args) -> int:
    given = getattr(args, "offload_copy_out_in_flight_mb", None)
    if given is not None:
        return given
    return DEFAULT_IN_FLIGHT_MB if step_engine(args) == STREAMED else 0


def ddp_grad_stream_kept(args) -> str:
    """Why DDP's AccumulateGrad nodes stay on the stream get_model built them under ("" where
    the wiring re-creates them on the compute stream, upstream_fixes)."""
    # (Upstream says it keeps that stream for TE's FP8 gradient setup, Megatron-LM PR #6021; FP8
    # runs re-create the nodes too: [Note: host lead] in docs/design.md.)
    return "--offload-keep-ddp-grad-stream" if getattr(args, "offload_keep_ddp_grad_stream", False) else ""


def host_lead_layers(args) -> int:
    """The host-lead bound (streams.HostLeadBound): the flag's value, else one layer where weight
    gradients are freed through DDP's stream (what the bound is for), else none. See [Note: host
    lead] in docs/design.md."""
    given = getattr(args, "offload_host_lead_layers", None)
    if given is not None:
        return given
    return DEFERRED_FREES_HOST_LEAD_LAYERS if ddp_grad_stream_kept(args) else 0


def host_lead_for_survivors(args) -> int:
    """The bound for nodes the re-creation could not replace (their frees stay deferred): one layer,
    unless the user (or a benchmark's DIAGNOSTICS) chose the bound."""
    chosen = getattr(args, "offload_host_lead_layers", None) is not None or "host_lead_layers" in DIAGNOSTICS
    return 0 if chosen else DEFERRED_FREES_HOST_LEAD_LAYERS


def config_from_args(args) -> OffloadConfig:
    """The `--offload-*` flags as an OffloadConfig (plus DIAGNOSTICS)."""
    auto = args.offload_state_fraction == AUTO
    snapshots = bool(getattr(args, "async_save", False)) and getattr(args, "async_strategy", "mcore") == "mcore"
    # Local and in-memory checkpoints read the state in this process before their writer runs.
    global_saves_only = getattr(args, "non_persistent_ckpt_type", None) in (None, "global")
    margin_mb = getattr(args, "offload_memory_margin_mb", None)
    return dataclasses.replace(OffloadConfig(
        chunk_bytes=args.offload_chunk_size_mb * 2**20,
        margin_bytes=DEFAULT_MARGIN_BYTES if margin_mb is None else margin_mb * 2**20,
        # A margin the user gives means exactly that: an explicit choice (a large one frees
        # everything at the first layer, a small one paces the frees as closely as it can), which
        # the lasting margin (MemoryPolicy._margin) would otherwise override.
        lasting_growth_margin=margin_mb is None,
        copy_piece_bytes=args.offload_copy_piece_mb * 2**20,
        copy_out_in_flight_bytes=copy_out_in_flight_mb(args) * 2**20,
        state_fraction=1.0 if auto else args.offload_state_fraction,
        auto_fraction_at=AUTO_FRACTION_ITERATION if auto else None,
        chunked_step=step_engine(args) == STREAMED,
        step_budget_bytes=args.offload_step_budget_mb * 2**20,
        release_cache=args.offload_release_cached_memory,
        timing=not args.offload_no_timing,
        host_lead_layers=host_lead_layers(args),
        # A fully parallel load exchanges what each rank read over NCCL: GPU tensors only.
        host_loads=not getattr(args, "ckpt_fully_parallel_load", False),
        # megatron-core turns --async-save off itself without --use-persistent-ckpt-worker
        # (validate_args, which runs before this).
        async_saves=bool(getattr(args, "async_save", False)),
        # Snapshots rely on the request's lifetime in megatron-core's own queue (`mcore`); other
        # strategies (nvidia-resiliency-ext's) read the views, which the writer copies.
        async_save_snapshots=snapshots,
        # ... whose requests megatron_saves makes wait for their snapshots (filled meanwhile).
        async_save_background_fill=snapshots and global_saves_only,
    ), **DIAGNOSTICS)
