"""Megatron's host reads right after the optimizer step, answered on the host where they can be.

megatron.training.training's `train_step` reduces the update flag and the grad norm over the
model-parallel group right after `optimizer.step()` (`logical_and_across_model_parallel_group`,
`reduce_max_stat_across_model_parallel_group`; `training_log` the learning rate): a GPU tensor of a
host value, an all-reduce and `.item()`. Each `.item()` is a D2H copy, and the GPU's copy engine
runs D2H copies in order: with the copy-out feeder on (copy_feeder.py) it waits behind the copy-out
queued at that moment, the host stalled and the compute stream idle. With a group of one rank (no
tensor or pipeline parallelism) the reduction is the value itself, so it is answered on the host,
to the same bits (Megatron's float32 round trip included); larger groups, device values (a grad
norm that the clipping returns as a CUDA tensor) and times when no fed copy is queued
(`CopyOutFeeder.busy`, the `feeding` condition throughout) keep Megatron's own. `train` then reads
`optimizer.get_loss_scale().item()` every iteration: where no optimizer has a grad scaler (bf16,
fp32) that is a constant, read once at attach and handed to `train` as a host tensor (every other
caller gets Megatron's CUDA tensor). Megatron's timers (megatron.core.timers) call
`torch.cuda.synchronize()` in `start`/`stop`, at every log interval for `interval-time`: a
device-wide wait, for the copy-out too; while feeding they wait for the current stream, which runs
the work they time. Not covered: fp16's loss scale and the losses `training_log` reads at log
intervals (device values). See [Note: reads after the step] in docs/design.md.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

# False: Megatron's own reductions throughout (the benchmark's `@devreads` measures both).
ENABLED = True


def _alone_in(group) -> bool:
    if group is None:  # (0.17-0.18 take no group: the model-parallel one)
        from megatron.core import parallel_state

        group = parallel_state.get_model_parallel_group()
    return torch.distributed.get_world_size(group=group) == 1


def _on_host_when_alone(on_host: Callable, feeding: Callable[[], bool]):
    """A wrapper factory for `(value)` (0.17-0.18) / `(value, group=None)` (0.19) reductions:
    `on_host(value)` where `feeding()`, the value is a host number and the group has one rank."""
    def make(original):
        @functools.wraps(original)
        def wrapper(*a, **k):
            if (a and ENABLED and feeding() and (a[0] is None or isinstance(a[0], (bool, int, float)))
                    and _alone_in(a[1] if len(a) > 1 else k.get("group"))):
                return on_host(a[0])
            return original(*a, **k)

        return wrapper

    return make


def logical_and_alone(value) -> bool:
    """`logical_and_across_model_parallel_group` over one rank (it reduces `1 if value is True else 0`)."""
    return value is True


def reduce_max_alone(stat):
    """`reduce_max_stat_across_model_parallel_group` over one rank: a float32 of the value (-1.0
    standing for None), read back."""
    read = float(torch.tensor([-1.0 if stat is None else stat], dtype=torch.float32))
    return None if read == -1.0 else read


class _CudaForTimers:
    """`torch.cuda` as megatron.core.timers sees it: `synchronize()` waits for the current stream
    alone while `feeding()` (fed copies may be queued: the copy-out's stream is not what a timer
    times, and a device-wide wait would hold the host until all of it has run), else for the
    device as before."""

    def __init__(self, cuda, feeding: Callable[[], bool]):
        self._cuda = cuda
        self._feeding = feeding

    def __getattr__(self, name):
        return getattr(self._cuda, name)

    def synchronize(self, device=None):
        if ENABLED and self._feeding():
            self._cuda.current_stream(device).synchronize()
        else:
            self._cuda.synchronize(device)


class TorchForTimers:
    """The `torch` name of megatron.core.timers: torch itself but for `cuda` (_CudaForTimers)."""

    def __init__(self, torch_module, feeding: Callable[[], bool]):
        self._torch = torch_module
        self.cuda = _CudaForTimers(torch_module.cuda, feeding)

    def __getattr__(self, name):
        return getattr(self._torch, name)


def install(patch, training, feeding: Callable[[], bool]) -> None:
    """Wrap both reductions in `training` (megatron.training.training, where train_step and
    training_log look them up) with `patch(module, name, make_wrapper)` (megatron_wiring._patch),
    and give megatron.core.timers its stream-synchronizing `torch` (TorchForTimers)."""
    patch(training, "logical_and_across_model_parallel_group", _on_host_when_alone(logical_and_alone, feeding))
    patch(training, "reduce_max_stat_across_model_parallel_group", _on_host_when_alone(reduce_max_alone, feeding))
    from megatron.core import timers

    if not isinstance(timers.torch, TorchForTimers):
        timers.torch = TorchForTimers(timers.torch, feeding)


# The one caller whose read is answered on the host: Megatron's own loop (its code object is looked
# up by name, so that a wrapper around `train` changes nothing).
_TRAIN = ("megatron.training.training", "train")


def _called_from_train(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    return (frame.f_globals.get("__name__"), frame.f_code.co_name) == _TRAIN


def _optimizers_in(optimizer):
    """`optimizer` and every optimizer chained in it, at any depth."""
    yield optimizer
    for inner in getattr(optimizer, "chained_optimizers", None) or []:
        yield from _optimizers_in(inner)


def answer_loss_scale_on_host(optimizer, feeding: Callable[[], bool]) -> bool:
    """Wrap this optimizer instance's `get_loss_scale` so that `train`'s per-iteration read gets a
    host copy of the value, where the value cannot change: no optimizer in it has a grad scaler
    (Megatron then returns its constant 1.0: `_scale_one` / `_scale`). Read once here, at attach
    (on a first attach no copy-out is in flight yet). Every other caller (the loss scaling in the
    schedules, MoE's aux loss) gets the original CUDA tensor, which it multiplies with CUDA
    tensors. Whether it wrapped."""
    if any(getattr(o, "grad_scaler", None) is not None for o in _optimizers_in(optimizer)):
        return False  # (fp16's scale moves with skipped steps, --loss-scale's loads from a checkpoint)
    original = optimizer.get_loss_scale
    on_host = original().detach().to("cpu")

    @functools.wraps(original)
    def get_loss_scale():
        if ENABLED and _called_from_train() and feeding():  # (the frame first: the lock-free test)
            return on_host
        return original()

    optimizer.get_loss_scale = get_loss_scale
    return True
