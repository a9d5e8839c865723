"""Every contact point with Megatron-LM's training loop, in one place.

`install()` wraps, by module attribute (Megatron looks them up at call time), these functions of an
unmodified megatron-core installation (0.17 to 0.19: compat.SUPPORTED; on 0.17 also the copy of
validate_args that megatron.training.initialize imports, compat.ALIASES):

  megatron.training.arguments.add_megatron_arguments  -> adds our flags (or steps aside when the
                                                          running Megatron defines them itself)
  megatron.training.arguments.validate_args           -> our checks, before any GPU allocation
  megatron.training.training.setup_model_and_optimizer -> attaches the offloaders and layer hooks
  megatron.training.training.get_megatron_optimizer    -> ... as soon as the optimizer exists,
                                                          before a resume loads into it
  megatron.training.training.finalize_model_grads     -> fallback reload trigger
  megatron.training.training.training_log             -> transfer statistics each log interval
  megatron.core.pipeline_parallel.schedules.forward_step / backward_step -> iteration pacing

plus the fixes of upstream_fixes.py (megatron-core's own bugs, unrelated to offloading),

and, per optimizer instance, the top-level `optimizer.step` (to see skipped steps) and each
DistributedOptimizer's checkpoint/reload methods (a torch_dist save or load runs on the host
copies of what is off the GPU; the others get the state back first).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from typing import Iterator, Optional

import torch

from . import compat, upstream_fixes, validation
from .coordinator import DEFAULT_MARGIN_BYTES, OffloadCoordinator, OffloadNotRunningError
from .host_memory import HostMemoryError
from .offloader import DEFAULT_CHUNK_BYTES

logger = logging.getLogger(__name__)

# DistributedOptimizer methods that read the state: it must be resident while they run.
STATE_READERS = (
    "state_dict",
    "save_parameter_state",
    "get_parameter_state_dp_zero",
    "get_parameter_state_dp_reshardable",
)
# Methods that write or replace it: resident, then re-discovered and sent out again afterwards.
STATE_WRITERS = (
    "load_state_dict",
    "load_parameter_state",
    "reload_model_params",
    "offload_to_cpu",
    "restore_from_cpu",
)
# Those that may run on the host copies of what is off the GPU (coordinator.before_state_access):
# a torch_dist save or load (`sharded_state_dict`, then `load_state_dict`). The masters' refresh
# from the model after a model-only load (`reload_model_params`, element-wise copies that would
# work on the host too, not run on a GPU that way yet), the legacy per-file load and Megatron's
# own CPU round trip (RL) get the state back first.
HOST_ACCESS_OK = ("sharded_state_dict", "load_state_dict")

# `--offload-state-fraction auto` measures this iteration: the first has start-up costs, the
# second is the first with the coordinator's memory profile.
AUTO = "auto"
AUTO_FRACTION_ITERATION = 3

_installed = False
_stepped_aside = False
coordinator: Optional[OffloadCoordinator] = None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _print(msg: str, all_ranks: bool = False) -> None:
    if all_ranks or _rank() == 0:
        print(f"[megatron-offload] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------
def add_arguments(parser):
    """Add our flags to a Megatron parser, unless the running Megatron already defines them."""
    global _stepped_aside
    if "--offload-optimizer-states" in parser._option_string_actions:
        _stepped_aside = True
        _print(
            "this Megatron already defines --offload-optimizer-states (a dev-branch build); "
            "megatron-offload steps aside and leaves the flag to Megatron's own implementation."
        )
        return parser
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
        "reloaded during the last backward. (megatron-offload)",
    )
    group.add_argument(
        "--offload-memory-margin-mb",
        type=int,
        default=DEFAULT_MARGIN_BYTES // 2**20,
        help="Safety margin (MiB) kept below the measured activation peak when deciding how "
        "late state may stay on the GPU. (megatron-offload)",
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
        "--offload-chunked-step",
        action="store_true",
        help="Run the optimizer step piece by piece (one chunk of state at a time: reload, "
        "Adam, copy out, overlapped), so that the step never needs the whole state on the GPU. "
        "For runs whose memory peak is the optimizer step (full recompute, late pipeline "
        "stages, small activations). (megatron-offload)",
    )
    group.add_argument(
        "--offload-step-budget-mb",
        type=int,
        default=0,
        help="With --offload-chunked-step: at most this many MiB of optimizer state on the GPU "
        "during the step (at least one chunk). 0: what the activations of the forward left "
        "room for, at least three chunks. (megatron-offload)",
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
        "--offload-no-timing",
        action="store_true",
        help="Do not record CUDA events around copies (no D2H/H2D timings in the log). "
        "(megatron-offload)",
    )
    return parser


def _fraction_or_auto(value: str):
    return AUTO if value == AUTO else float(value)


def validate_args(args) -> None:
    if _stepped_aside:
        return
    validation.validate(args)
    if getattr(args, "offload_optimizer_states", False):
        if args.offload_chunk_size_mb <= 0:
            raise validation.OffloadArgumentError("--offload-chunk-size-mb must be positive")
        if args.offload_memory_margin_mb < 0:
            raise validation.OffloadArgumentError("--offload-memory-margin-mb must be >= 0")
        if args.offload_step_budget_mb < 0:
            raise validation.OffloadArgumentError("--offload-step-budget-mb must be >= 0 (0: automatic)")
        if args.offload_step_budget_mb and not args.offload_chunked_step:
            raise validation.OffloadArgumentError(
                "--offload-step-budget-mb bounds the state resident during a chunked step: add "
                "--offload-chunked-step or drop it")
        if args.offload_copy_piece_mb < 0:
            raise validation.OffloadArgumentError("--offload-copy-piece-mb must be >= 0")
        if args.offload_state_fraction != AUTO and not 0.0 < args.offload_state_fraction <= 1.0:
            raise validation.OffloadArgumentError(
                "--offload-state-fraction must be in (0, 1] or 'auto': the share of the optimizer "
                "state to offload (drop --offload-optimizer-states to offload nothing)")


# ----------------------------------------------------------------------------------------------
# Attaching to the optimizer and model Megatron built
# ----------------------------------------------------------------------------------------------
def iter_distributed_optimizers(optimizer) -> Iterator:
    """Every DistributedOptimizer inside a (possibly nested) ChainedOptimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if hasattr(optimizer, "chained_optimizers"):
        for sub in optimizer.chained_optimizers:
            yield from iter_distributed_optimizers(sub)
    elif isinstance(optimizer, DistributedOptimizer):
        yield optimizer
    else:
        raise validation.OffloadArgumentError(
            f"--offload-optimizer-states found a {type(optimizer).__name__}, not a "
            "DistributedOptimizer; add --use-distributed-optimizer."
        )


def _wrap_state_access(coord: OffloadCoordinator, off, dist_opt) -> None:
    def wrap(name: str, writes):
        original = getattr(dist_opt, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            with coord.state_access([off], will_modify=writes(args, kwargs), host_copies_ok=name in HOST_ACCESS_OK):
                return original(*args, **kwargs)

        setattr(dist_opt, name, wrapper)

    for name in STATE_READERS:
        wrap(name, lambda a, k: False)
    for name in STATE_WRITERS:
        wrap(name, lambda a, k: True)
    # sharded_state_dict(model_sharded_state_dict, is_loading=False, ...): a load template is
    # filled in place by dist_checkpointing.load, so loading counts as a write. A save only
    # references the tensors, which dist-checkpointing writes from the host anyway: what is off
    # the GPU is saved from its host copy, and loaded into it.
    wrap("sharded_state_dict", lambda a, k: bool(k.get("is_loading", a[1] if len(a) > 1 else False)))


EXPANDABLE_SEGMENTS = "expandable_segments:True"
_allocator_note: Optional[str] = None  # what validate_args decided about the allocator, printed at attach


def allocator_choice(alloc_conf: Optional[str]):
    """(enable, note): whether to turn on expandable segments, and what to tell the user.

    With PyTorch's default caching allocator a good part of the offloaded memory stays *reserved*:
    every freed chunk is a segment of its own, the activations that fill it leave holes, and a
    chunk coming back finds no block of its size and gets a new segment (by default only part of
    the offloaded bytes comes off peak reserved memory, with expandable segments most of it; the
    run without offloading reserves the same with both; see [Note: expandable segments] in
    docs/design.md). So the plugin turns them on when the user has not configured the allocator,
    and leaves any explicit setting alone.
    """
    conf = (alloc_conf or "").replace(" ", "").lower()
    if not conf:
        return True, ("turned on PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF was unset), so "
                      "that offloaded memory comes off *reserved* memory; set PYTORCH_CUDA_ALLOC_CONF "
                      "yourself (e.g. expandable_segments:False) to keep your own allocator settings.")
    if "expandable_segments:true" in conf:
        return False, None
    return False, (f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf!r} does not set {EXPANDABLE_SEGMENTS}: with "
                   "PyTorch's default caching allocator part of the offloaded memory stays reserved "
                   f"(fragmentation). Add {EXPANDABLE_SEGMENTS} to get most of it back.")


def _alloc_conf_from_env() -> Optional[str]:
    # PYTORCH_ALLOC_CONF is the newer name of the same setting.
    return ",".join(filter(None, (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), os.environ.get("PYTORCH_ALLOC_CONF"))))


def configure_allocator() -> Optional[str]:
    """Apply `allocator_choice` to this process. Returns the note for the log.

    Runs when Megatron validates the arguments, before it allocates anything on the GPU. The variable
    covers an allocator not initialised yet and any child process; `_set_allocator_settings` one
    that is (e.g. a script that set a memory fraction first): segments created from then on are
    expandable."""
    enable, note = allocator_choice(_alloc_conf_from_env())
    if enable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
        # The accelerator-generic setter where this torch has it (torch.cuda's own name for it
        # warns that it is deprecated there), else the older one.
        setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                  or getattr(torch.cuda.memory, "_set_allocator_settings", None))
        if setter is not None:
            try:
                setter(EXPANDABLE_SEGMENTS)
            except RuntimeError as err:  # e.g. a backend without expandable segments
                note = f"could not turn on expandable segments ({err}); set PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS}"
    return note


def attach(model, optimizer, args) -> OffloadCoordinator:
    """Create the coordinator for this process and hook it to Megatron's optimizer and model."""
    global coordinator
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    model_chunks = model if isinstance(model, (list, tuple)) else [model]
    auto = args.offload_state_fraction == AUTO
    coord = OffloadCoordinator(
        announce=lambda msg: _print(msg, all_ranks=True),
        chunk_bytes=args.offload_chunk_size_mb * 2**20,
        margin_bytes=args.offload_memory_margin_mb * 2**20,
        expected_forwards_per_iteration=lambda: get_num_microbatches() * len(model_chunks),
        timing=not args.offload_no_timing,
        copy_piece_bytes=args.offload_copy_piece_mb * 2**20,
        state_fraction=1.0 if auto else args.offload_state_fraction,
        auto_fraction_at=AUTO_FRACTION_ITERATION if auto else None,
        chunked_step=args.offload_chunked_step,
        step_budget_bytes=args.offload_step_budget_mb * 2**20,
        release_cache=args.offload_release_cached_memory,
        # Where the release happens: an experiment knob for the benchmark (allocator.RELEASE_POINTS).
        release_at=os.environ.get("MEGATRON_OFFLOAD_RELEASE_AT", "offloaded").split(","),
        smallest_in_group=_smallest_in_data_parallel_group() if auto else None,
        # Experiment knobs for the benchmark: reloads without the workspace rule (`@nows`); no
        # reload inside the backward, all of it at finalize_model_grads (`@reloadlate`: no free
        # block ever fits).
        keep_backward_workspace=os.environ.get("MEGATRON_OFFLOAD_WORKSPACE", "1") != "0",
        free_block_sizes=(lambda: []) if os.environ.get("MEGATRON_OFFLOAD_BACKWARD_RELOADS") == "0" else None,
        host_waits_at_free=os.environ.get("MEGATRON_OFFLOAD_HOST_WAIT", "0") == "1",  # (`@hostwait`)
        # A fully parallel load exchanges what each rank read over NCCL: GPU tensors only.
        host_loads=not getattr(args, "ckpt_fully_parallel_load", False),
    )
    for i, dist_opt in enumerate(iter_distributed_optimizers(optimizer)):
        off = coord.add_optimizer(dist_opt, name=f"distopt{i}")
        _wrap_state_access(coord, off, dist_opt)
    # The fp32 masters exist since the optimizer was built, the moments after a resume, and torch
    # Adam's moments are created here rather than lazily in step 1: pack and send out all of it
    # now, while no activation exists, so that even the first forward runs without it.
    try:
        coord.offload_existing_state()  # (detaches itself if it fails)
    except HostMemoryError as err:
        # One line per rank, like an argument error, instead of a traceback from deep inside.
        _print(f"error: {err}", all_ranks=True)
        raise SystemExit(1) from err
    coord.release_startup_state()

    step = optimizer.step

    @functools.wraps(step)
    def step_and_notify(*a, **k):
        coord.optimizer_step_begin()
        try:
            result = step(*a, **k)
        except BaseException:
            try:  # the step's own error is the one to report
                coord.optimizer_step_done()
            except Exception:  # noqa: BLE001
                logger.exception("megatron-offload: after a failed optimizer step")
            raise
        coord.optimizer_step_done()
        return result

    optimizer.step = step_and_notify
    hooked = coord.watch_model(model_chunks)
    _print(f"attached to {len(coord.offloaders)} DistributedOptimizer(s), {hooked} pacing layers")
    if _allocator_note:
        _print(_allocator_note)
    coordinator = coord
    return coord


def _smallest_in_data_parallel_group():
    """Minimum of a number over this rank's data-parallel group (ranks that step in lockstep);
    None outside torch.distributed."""
    if not torch.distributed.is_initialized():
        return None
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)

    def smallest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=torch.cuda.current_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
        return float(t.item())

    return smallest


# ----------------------------------------------------------------------------------------------
# Wrappers installed on Megatron's modules
# ----------------------------------------------------------------------------------------------
def _enabled() -> bool:
    return coordinator is not None


def _wrap_add_megatron_arguments(original):
    @functools.wraps(original)
    def wrapper(parser):
        parser = add_arguments(original(parser))
        upstream_fixes.mend_help_strings(parser)
        return parser

    return wrapper


def _wrap_validate_args(original):
    @functools.wraps(original)
    def wrapper(args, *a, **k):
        # Ours first: the messages below explain the conflict better than a Megatron assert would.
        # Like argparse: a clean message on stderr and exit status 2, not a traceback per rank.
        try:
            validate_args(args)
        except validation.OffloadArgumentError as err:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from err
        if getattr(args, "offload_optimizer_states", False) and not _stepped_aside:
            global _allocator_note
            _allocator_note = configure_allocator()
        return original(args, *a, **k)

    return wrapper


# True while setup_model_and_optimizer runs with the flag on and nothing attached yet: the
# optimizer it builds gets its offloaders at once (`_wrap_get_megatron_optimizer`).
_attach_at_build = False


def _wrap_setup_model_and_optimizer(original):
    @functools.wraps(original)
    def wrapper(*a, **k):
        global _attach_at_build
        from megatron.training.global_vars import get_args

        args = get_args()
        wanted = getattr(args, "offload_optimizer_states", False) and not _stepped_aside
        _attach_at_build = wanted
        try:
            model, optimizer, scheduler = original(*a, **k)
        finally:
            _attach_at_build = False
        if wanted and optimizer is not None:
            if coordinator is None or not _attached_to(optimizer):
                attach(model, optimizer, args)  # (built some other way: attach after the load)
            from megatron.core.utils import get_model_config

            config = get_model_config(model[0] if isinstance(model, list) else model)
            if config.finalize_model_grads_func is not None:  # a builder installed its own
                config.finalize_model_grads_func = _wrap_finalize(config.finalize_model_grads_func)
        return model, optimizer, scheduler

    return wrapper


def _wrap_get_megatron_optimizer(original):
    """Attach as soon as setup_model_and_optimizer has built the optimizer, before it loads a
    checkpoint: the state is sent out chunk by chunk at once, and the resume's load then writes
    into the host copies (coordinator.before_state_access) instead of putting the whole state on
    the GPU (the moments a load allocates would otherwise be the start-up's peak where the step
    is the iteration's, e.g. with full recompute and --offload-chunked-step)."""

    @functools.wraps(original)
    def wrapper(config, model_chunks, *a, **k):
        global _attach_at_build
        optimizer = original(config, model_chunks, *a, **k)
        if _attach_at_build and optimizer is not None:
            from megatron.training.global_vars import get_args

            _attach_at_build = False  # once per setup
            attach(model_chunks, optimizer, get_args())
        return optimizer

    return wrapper


def _attached_to(optimizer) -> bool:
    """Whether the current coordinator offloads `optimizer`'s DistributedOptimizers."""
    ours = {id(off.dist_opt) for off in coordinator.offloaders}
    return all(id(d) in ours for d in iter_distributed_optimizers(optimizer))


def _wrap_finalize(original):
    if getattr(original, "_megatron_offload", False):
        return original

    @functools.wraps(original)
    def wrapper(*a, **k):
        if _enabled():
            coordinator.grads_finalizing()
        return original(*a, **k)

    wrapper._megatron_offload = True
    return wrapper


def _wrap_forward_step(original):
    @functools.wraps(original)
    def wrapper(*a, **k):
        if not _enabled():
            return original(*a, **k)
        model = k["model"] if "model" in k else a[2]
        training = torch.is_grad_enabled() and getattr(model, "training", True)
        coordinator.forward_begin(training)
        out = original(*a, **k)
        if training:
            coordinator.forward_end()
        return out

    return wrapper


def _wrap_backward_step(original):
    @functools.wraps(original)
    def wrapper(*a, **k):
        if not _enabled():
            return original(*a, **k)
        coordinator.backward_begin()
        out = original(*a, **k)
        coordinator.backward_end()
        return out

    return wrapper


def _wrap_training_log(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*a, **k):
        result = original(*a, **k)
        from megatron.training.global_vars import get_args

        if not _enabled() and getattr(get_args(), "offload_optimizer_states", False) and not _stepped_aside:
            # (training_log runs after every train_step: the first step has happened.)
            raise OffloadNotRunningError(
                "megatron-offload: --offload-optimizer-states is set but the plugin never attached to the "
                "optimizer, so nothing is offloaded. It attaches inside megatron.training.training."
                "setup_model_and_optimizer / get_megatron_optimizer: the script built its model and "
                "optimizer some other way, or imported those functions by name before "
                "megatron_offload.install() ran (call install() first, or launch with -m megatron_offload).")
        if _enabled():
            iteration = signature.bind_partial(*a, **k).arguments.get("iteration")
            interval = getattr(get_args(), "log_interval", 1) or 1
            if iteration is not None and iteration % interval == 0:
                t = coordinator.harvest()
                _print(
                    f"iteration {iteration}: d2h {t.d2h_bytes / 2**30:.2f} GiB in {t.d2h_ms:.1f} ms "
                    f"({t.d2h_gbps:.1f} GB/s), h2d {t.h2d_bytes / 2**30:.2f} GiB in {t.h2d_ms:.1f} ms "
                    f"({t.h2d_gbps:.1f} GB/s), exposed wait on compute: before free "
                    f"{t.exposed_d2h_ms:.1f} ms, before step {t.exposed_h2d_ms:.1f} ms "
                    f"(over the last {interval} iteration(s))"
                )
        return result

    return wrapper


def _wrap_calc_params_l2_norm(original):
    """--log-params-norm reads every fp32 master after the step. The unchunked step leaves them
    all resident until the next forward; the chunked step has sent some out already, and the
    norm is one multi-tensor reduction over all of them: bring them back for it as a checkpoint
    reader would (host copies stay current, so they leave again without a D2H)."""

    @functools.wraps(original)
    def wrapper(*a, **k):
        if not _enabled() or not coordinator.chunked_step:
            return original(*a, **k)
        with coordinator.state_access(coordinator.offloaders, will_modify=False):
            return original(*a, **k)

    return wrapper


def _patch(module, name: str, make_wrapper) -> None:
    original = getattr(module, name)
    if getattr(original, "_megatron_offload", False):
        return
    wrapped = make_wrapper(original)
    wrapped._megatron_offload = True
    setattr(module, name, wrapped)
    # Copies bound by `from ... import` in releases whose callers look the function up there.
    for alias in compat.aliases_of(getattr(module, "__name__", ""), name):
        if getattr(alias, name, None) is original:
            setattr(alias, name, wrapped)


def install() -> None:
    """Wire megatron-offload into Megatron's training loop (idempotent)."""
    global _installed
    if _installed:
        return
    # Each raises IncompatibleMegatronError, one line, before anything is patched.
    note = compat.check_versions()
    arguments, training, schedules = compat.import_training_modules()
    compat.check()
    if note:
        _print(note)
    _patch(arguments, "add_megatron_arguments", _wrap_add_megatron_arguments)
    _patch(arguments, "validate_args", _wrap_validate_args)
    _patch(training, "setup_model_and_optimizer", _wrap_setup_model_and_optimizer)
    _patch(training, "get_megatron_optimizer", _wrap_get_megatron_optimizer)
    _patch(training, "finalize_model_grads", _wrap_finalize)
    _patch(training, "training_log", _wrap_training_log)
    _patch(training, "calc_params_l2_norm", _wrap_calc_params_l2_norm)
    _patch(schedules, "forward_step", _wrap_forward_step)
    _patch(schedules, "backward_step", _wrap_backward_step)
    upstream_fixes.install(_patch)
    _installed = True
    if os.environ.get("MEGATRON_OFFLOAD_VERBOSE"):
        _print("installed")
