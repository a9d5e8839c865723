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
  megatron.training.training.logical_and_across_model_parallel_group, ...reduce_max_stat_..., and
  megatron.core.timers' `torch` name -> while copies are fed: host answers, stream syncs (megatron_reads.py)
  megatron.core.pipeline_parallel.schedules.forward_step / backward_step -> iteration pacing
  megatron.core.dist_checkpointing...async_utils.AsyncCallsQueue.schedule_async_request and
  AsyncRequest.execute_sync -> a save's writer waits for its snapshots (megatron_saves.py)

plus the fixes of upstream_fixes.py (megatron-core's own bugs, unrelated to offloading), and, per
optimizer instance, the top-level `optimizer.step` (to see skipped steps), `get_loss_scale` (train's
read, megatron_reads.py) and each DistributedOptimizer's checkpoint/reload methods (a torch_dist
save or load runs on the host copies of what is off the GPU; the others get the state back first:
megatron_state_methods.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from typing import Iterator, Optional, Tuple

import torch

from . import (auto_fraction, compat, megatron_args, megatron_reads, megatron_saves, megatron_state_methods,
               upstream_fixes, validation)
from .allocator import configure_allocator
from .coordinator import OffloadCoordinator, OffloadNotRunningError
from .host_memory import HostMemoryError

logger = logging.getLogger(__name__)

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
    return megatron_args.add_flags(parser)


def validate_args(args) -> None:
    if _stepped_aside:
        return
    validation.validate(args)
    megatron_args.check_values(args)


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


_allocator_note: Optional[str] = None  # what validate_args decided about the allocator, printed at attach


def attach(model, optimizer, args) -> OffloadCoordinator:
    """Create the coordinator for this process and hook it to Megatron's optimizer and model."""
    global coordinator
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    model_chunks = model if isinstance(model, (list, tuple)) else [model]
    config = megatron_args.config_from_args(args)
    coord = OffloadCoordinator(
        config,
        announce=lambda msg: _print(msg, all_ranks=True),
        expected_forwards_per_iteration=lambda: get_num_microbatches() * len(model_chunks),
        smallest_in_group=auto_fraction.smallest_over_job() if config.auto_fraction_at else None,
    )
    for i, dist_opt in enumerate(iter_distributed_optimizers(optimizer)):
        off = coord.add_optimizer(dist_opt, name=f"distopt{i}")
        megatron_state_methods.wrap_state_access(coord, off, dist_opt)
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
    megatron_reads.answer_loss_scale_on_host(optimizer, feeding=_feeding)
    hooked = coord.watch_model(model_chunks)
    clause, every_rank = _grad_accumulators_to_compute_stream(coord, model_chunks, args)
    _print(f"attached to {len(coord.offloaders)} DistributedOptimizer(s), {hooked} pacing layers, "
           f"{megatron_args.step_engine_note(args)}{clause}", all_ranks=every_rank)
    if _allocator_note:
        _print(_allocator_note)
    coordinator = coord
    return coord


def _grad_accumulators_to_compute_stream(coord, model_chunks, args) -> Tuple[str, bool]:
    """Re-create DDP's AccumulateGrad nodes on the compute stream (upstream_fixes); the clause
    the attach line ends with, and whether every rank prints it (nodes this rank could not
    replace). Upstream keeps DDP's own stream for CUDA graph capture, refused with the plugin
    (validation.py), and names TE's FP8 gradient setup too (Megatron-LM PR #6021); FP8 runs take
    this path as well ([Note: host lead] in docs/design.md says what that rests on)."""
    kept = megatron_args.ddp_grad_stream_kept(args)
    if kept:
        return f"; DDP's gradient accumulators left on their own stream ({kept})", False
    try:
        replaced = upstream_fixes.grad_accumulators_on_current_stream(model_chunks)
    except RuntimeError as err:  # (every other node was replaced; the survivors keep their hooks)
        lead = coord.host_lead.at_least(megatron_args.host_lead_for_survivors(args))  # (their frees)
        return f"; {err}" + (f"; host-lead bound {lead} layer(s)" if lead else ""), True
    return (f", {replaced} DDP gradient accumulators on the compute stream" if replaced else ""), False


# ----------------------------------------------------------------------------------------------
# Wrappers installed on Megatron's modules
# ----------------------------------------------------------------------------------------------
def _enabled() -> bool:
    return coordinator is not None


def _feeding() -> bool:
    """Whether copy-outs fed by the feeder's thread may be queued (megatron_reads' condition)."""
    return _enabled() and coordinator.feeder is not None and coordinator.feeder.busy()


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
    is the iteration's, e.g. with full recompute and a bounded streamed step)."""

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
    """--log-params-norm reads every fp32 master after the step. The whole step (the default under
    that flag) leaves them all resident until the next forward; the streamed step has sent some
    out already (or has their copy-out in flight), and the norm is one multi-tensor reduction over
    all of them: bring them back for it as a checkpoint reader would (host copies stay current, so
    they leave again without a D2H)."""

    @functools.wraps(original)
    def wrapper(*a, **k):
        if not _enabled() or not coordinator.config.chunked_step:
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
    megatron_reads.install(_patch, training, feeding=_feeding)
    _patch(schedules, "forward_step", _wrap_forward_step)
    _patch(schedules, "backward_step", _wrap_backward_step)
    megatron_saves.install(_patch, lambda: coordinator)
    upstream_fixes.install(_patch)
    _installed = True
    if os.environ.get("MEGATRON_OFFLOAD_VERBOSE"):
        _print("installed")
