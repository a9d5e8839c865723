"""The caching allocator as the coordinator sees it: readers of its statistics and free blocks, and
the optional release of cached free memory (`--offload-release-cached-memory`). Methods of
`OffloadCoordinator`; the attributes they use are set in its `__init__`.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch


# Points of the iteration where `--offload-release-cached-memory` may hand free cached memory back
# to the driver: when the last chunk is freed in the first forward ("offloaded"), at each later
# microbatch's forward ("forward"), when the last backward begins, before any reload
# ("reload_window"), and after the optimizer step, the state resident ("step_end").
RELEASE_POINTS = ("offloaded", "forward", "reload_window", "step_end")


class CacheRelease:
    """Handing cached free memory back to the device, once per iteration at a chosen point."""

    def _release_cache_at(self, point: str) -> None:
        if self.config.release_cache and point in self.config.release_at:
            self._trace(f"release:{point}")
            self._release_cache()

    def _release_cache(self) -> None:
        """Return the allocator's free memory to the driver, now that the state is off the GPU.

        Why: the reserved peak is mapped memory, live or not. Each iteration frees the chunks in
        the forward and takes them back in the backward, and the blocks that activations and
        reloaded chunks leave free in between are not always the sizes later requests ask for:
        they stay mapped, the next request that fits none maps new memory above them, and the
        reserved peak creeps up over iterations (with memory mapped and free but unusable at the
        peak). With expandable segments `empty_cache` unmaps every free page, holes included, so
        what is mapped from here to the forward's peak is what the activations really use. Cost:
        the host waits once per iteration for the compute stream, and the pages are mapped again
        as the forward needs them (the first forward takes longer). It stops the creep, but every
        iteration's peak then depends on where that iteration's mapping lands, and a small model's
        peak came out higher with it than without: opt-in (`--offload-release-cached-memory`).
        See [Note: releasing cached memory] in docs/design.md.
        """
        start = time.perf_counter()
        self._hand_back_cached_memory()
        self.cache_releases += 1
        self.cache_release_ms += (time.perf_counter() - start) * 1e3

    def _hand_back_cached_memory(self) -> None:
        if self.device.type == "cuda":
            # Why: `free` made the compute stream wait for the copies, but returning the memory
            # to the device must not unmap pages a copy may still be reading: wait for it here
            # rather than rely on which stream the allocator synchronises before unmapping.
            self.streams.compute.synchronize()
        if self._empty_cache is not None:
            self._empty_cache()


def _free_block_reader(device: torch.device, stream) -> Optional[Callable[[], List[int]]]:
    """Reader of the free blocks of the caching allocator on `stream` (large pool only: chunks
    are > 1 MiB). Built on the allocator snapshot, which costs milliseconds per call with the
    default allocator and less with expandable segments (counted in fit_check_ms); called only in
    the reload window while chunks wait. See [Note: allocator query cost] in docs/design.md."""
    if not hasattr(torch.cuda, "memory_snapshot"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream_id = stream.cuda_stream

    def sizes() -> List[int]:
        free = []
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device") != index or seg.get("stream") != stream_id:
                continue
            if seg.get("segment_type") != "large":
                continue
            free.extend(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
        return free

    return sizes


def _allocator_stat(device: torch.device, which: str) -> Callable[[], int]:
    """Reader of the caching allocator's allocated bytes ("current", "peak", or "allocated": the
    cumulative bytes ever allocated).

    `torch.cuda.memory_allocated()` flattens and sorts the allocator's ~100 statistics on every
    call (see [Note: allocator query cost] in docs/design.md); the hooks read one number up to
    ~60 times per iteration, so read it straight from the nested statistics when this PyTorch has
    them."""
    if device.type != "cuda":
        return lambda: 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:
        try:
            raw(index)["allocated_bytes"]["all"][which]
            return lambda: raw(index)["allocated_bytes"]["all"][which]
        except (KeyError, TypeError, RuntimeError):
            pass
    if which == "allocated":
        return lambda: torch.cuda.memory_stats(index)["allocated_bytes.all.allocated"]
    public = torch.cuda.memory_allocated if which == "current" else torch.cuda.max_memory_allocated
    return lambda: public(index)
