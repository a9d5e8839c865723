"""Megatron's checkpoint saves and the snapshots that fill in the background.

An asynchronous save's shared-memory snapshots may still be filling when its state dict is
returned ([Note: background fill] in save_snapshot.py). Here, megatron-core's side of it:
dist-checkpointing's reads in the training process (`wait_if_the_save_reads_snapshots`), the
request handed to the writer's process (`AsyncCallsQueue.schedule_async_request`: the writer waits
for the fills, every rank checks them at finalize) and a save run synchronously
(`AsyncRequest.execute_sync`: the fills finish first).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator

import torch

from . import snapshot_fill


def read_before_the_writer(value) -> Iterator[torch.Tensor]:
    """The tensors of a sharded state dict that dist-checkpointing reads in this process before
    its writer runs: all but the data of plain ShardedTensors that are contiguous and their whole
    storage, which go to the writer as they are (a view is cloned for it, a non-contiguous tensor
    made contiguous, a factory's build function computes, an object is pickled)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from read_before_the_writer(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from read_before_the_writer(item)
    elif type(value) is ShardedTensor and isinstance(value.data, torch.Tensor):
        t = value.data
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            yield t
    elif hasattr(value, "data"):  # ShardedTensorFactory, ShardedObject, ...
        yield from read_before_the_writer(value.data)


def wait_if_the_save_reads_snapshots(coord, state) -> None:
    """Before dist-checkpointing gets a save's state dict: if it would read a snapshot that is
    still filling in the background (`read_before_the_writer`), wait for the fills now."""
    if any(coord.snapshot_filling(t) for t in read_before_the_writer(state)):
        coord.wait_snapshots_filled()


def _wrap_schedule_async_request(original, current: Callable):
    """With background fills configured, every request megatron-core schedules gets, on every
    rank, a first finalize function that fails the save on all ranks if any rank's fill failed
    (`snapshot_fill.check_written`); where fills are pending, the writer's function waits for
    their flags first (`snapshot_fill.writer_waits`) and the request crosses to the writer with
    its snapshots by name, and the fills start once it is there."""

    @functools.wraps(original)
    def wrapper(queue, async_request, *a, **k):
        coord = current()
        if coord is None or not coord.config.async_save_background_fill:
            return original(queue, async_request, *a, **k)
        fills = coord.pending_snapshot_fills()
        async_request = async_request._replace(
            finalize_fns=[functools.partial(snapshot_fill.check_written, fills), *async_request.finalize_fns])
        if not fills:
            return original(queue, async_request, *a, **k)
        if async_request.async_fn is None or getattr(async_request, "preload_fn", None) is None:
            # No writer to wait, or no wait for the worker to take the request (it may then be
            # pickled after this returns): the fills finish here.
            for fill in fills:
                fill.join()
            return original(queue, async_request, *a, **k)
        async_request = async_request._replace(
            async_fn=functools.partial(snapshot_fill.writer_waits, [f.flag for f in fills], async_request.async_fn))
        try:
            # (megatron-core's persistent worker takes the request before this returns: pickled by then)
            with snapshot_fill.handed_over_by_name():
                return original(queue, async_request, *a, **k)
        finally:
            # Why: started only now, the copies do not compete with the save's planning above,
            # which the training thread waits for; the writer waits for the flags meanwhile.
            for fill in fills:
                fill.start()

    return wrapper


def _wrap_execute_sync(original, current: Callable):
    """A save that dist-checkpointing runs in this process (not asynchronous) writes the
    snapshots here: the fills finish first, and a failed one fails it on every rank."""

    @functools.wraps(original)
    def wrapper(async_request, *a, **k):
        coord = current()
        if coord is not None and coord.config.async_save_background_fill:
            coord.wait_snapshots_filled()
            snapshot_fill.check_written(coord.pending_snapshot_fills())
        return original(async_request, *a, **k)

    return wrapper


def install(patch, current: Callable) -> None:
    """Wrap megatron-core's async queue and request with `patch(module, name, make_wrapper)`
    (megatron_wiring._patch); `current()`: the coordinator of this process, or None."""
    from megatron.core.dist_checkpointing.strategies import async_utils

    patch(async_utils.AsyncCallsQueue, "schedule_async_request",
          lambda original: _wrap_schedule_async_request(original, current))
    patch(async_utils.AsyncRequest, "execute_sync", lambda original: _wrap_execute_sync(original, current))
