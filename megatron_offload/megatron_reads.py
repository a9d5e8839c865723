"""Megatron's host reads right after the optimizer step, answered on the host where they can be.

megatron.training.training's `train_step` reduces the update flag and the grad norm over the
model-parallel group right after `optimizer.step()` (`logical_and_across_model_parallel_group`,
`reduce_max_stat_across_model_parallel_group`; `training_log` the learning rate): a GPU tensor of a
host value, an all-reduce and `.item()`. Each `.item()` is a D2H copy, and the GPU's copy engine
runs D2H copies in order: with the copy-out feeder on (copy_feeder.py) it waits behind the copy-out
queued at that moment, the host stalled and the compute stream idle. With a group of one rank (no
tensor or pipeline parallelism) the reduction is the value itself, so it is answered on the host,
to the same bits (Megatron's float32 round trip included); larger groups, device values (a grad
norm that the clipping returns as a CUDA tensor) and runs without the feeder keep Megatron's own.
Other reads after the step are not covered (`train` reads `optimizer.get_loss_scale()` each
iteration). See [Note: reads after the step] in docs/design.md.
"""

from __future__ import annotations

import functools
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


def install(patch, training, feeding: Callable[[], bool]) -> None:
    """Wrap both reductions in `training` (megatron.training.training, where train_step and
    training_log look them up) with `patch(module, name, make_wrapper)` (megatron_wiring._patch)."""
    patch(training, "logical_and_across_model_parallel_group", _on_host_when_alone(logical_and_alone, feeding))
    patch(training, "reduce_max_stat_across_model_parallel_group", _on_host_when_alone(reduce_max_alone, feeding))
