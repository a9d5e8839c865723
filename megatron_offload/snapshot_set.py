"""One set of shared-memory snapshots for an asynchronous save (save_snapshot.SaveSnapshots):
a whole shared storage per tensor, page-locked in place for a device fill, and whether anything
besides the set still holds one of them.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, List, Optional

import torch

from . import host_buffer
from .snapshot_fill import shared

logger = logging.getLogger(__name__)

# References to a storage (tensors and storage objects); None where torch does not expose it.
STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(tensor: torch.Tensor) -> int:
    """References to `tensor`'s storage, this call's own storage object included."""
    return int(STORAGE_USE_COUNT(tensor.untyped_storage()._cdata))


def _unregister_all(unregister: Callable[[int], int], ptrs: List[int], copied) -> None:
    if copied[0] is not None:
        copied[0].synchronize()  # (a device copy may still be writing into these pages)
    failed = [err for err in (unregister(ptr) for ptr in ptrs) if err]
    ptrs.clear()
    if failed:
        host_buffer.clear_cuda_error()  # (else the next kernel launch raises it)
        logger.warning("megatron-offload: unlocking an asynchronous save's snapshot set failed (CUDA error %s)",
                       failed[0])


class SnapshotSet:
    """One snapshot per large tensor of a save, in the order the save's tensors were listed.
    With `register` (device fills) every snapshot is page-locked in place, so that a D2H copy
    writes into it directly (`SaveSnapshots.copy_from_device`); `pinned` says whether that
    succeeded. The pages are unlocked again when the set is dropped (`release`) or collected."""

    def __init__(self, layout: list, by_name: bool = False,
                 register: Optional[Callable[[int, int], int]] = None,
                 unregister: Callable[[int], int] = host_buffer.cuda_unregister):
        self.tensors = [shared(torch.empty(shape, dtype=dtype), by_name) for shape, dtype in layout]
        self._own = [_use_count(t) for t in self.tensors]
        self.layout = layout
        self.pinned = False
        self.register_error = 0  # the CUDA error of a registration that failed
        self.last_device_copy = [None]  # event after the last copies `copy_from_device` enqueued
        registered: List[int] = []
        self._release = weakref.finalize(self, _unregister_all, unregister, registered, self.last_device_copy)
        if register is None:
            return
        for t in self.tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue
            err = register(t.data_ptr(), nbytes)
            if err:
                host_buffer.clear_cuda_error()  # (else the next kernel launch raises it)
                self.release()
                self.register_error = err
                return
            registered.append(t.data_ptr())
        self.pinned = True

    def release(self) -> None:
        """Unlock the pages (once; after any device copy into them has finished)."""
        self.pinned = False
        self._release()

    def in_use(self) -> bool:
        """Whether anything besides this set still refers to a snapshot (a pending save's request,
        state tensors still pointing at it, or an unscaled reader serving it)."""
        return any(_use_count(t) > own for t, own in zip(self.tensors, self._own))

    def fits(self, layout: list) -> bool:
        return self.layout == layout
