"""The caching allocator as the plugin sees it: readers of its statistics and free blocks, the
optional release of cached free memory (`--offload-release-cached-memory`; methods of
`OffloadCoordinator`, their attributes set by `_init_allocator_readers`), and the process's allocator
setting (expandable segments, chosen before anything is allocated).
"""

from __future__ import annotations

import os
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

    def _init_allocator_readers(self, probes) -> None:
        """The allocator readers (`config.AllocatorProbes`: tests and CPU runs inject them) and the
        release counters."""
        self._allocated = probes.allocated or _allocator_stat(self.device, "current")
        self._max_allocated = probes.max_allocated or _allocator_stat(self.device, "peak")
        self._allocated_total = probes.allocated_total or _allocator_stat(self.device, "allocated")
        self._empty_cache = probes.empty_cache or (torch.cuda.empty_cache if self.device.type == "cuda" else None)
        # Sizes of the allocator's free blocks that a reload on the compute stream could use
        # without a new segment (None: no such check, e.g. on CPU; `[]`: nothing ever fits, so
        # no reload inside the backward).
        self._free_block_sizes = probes.free_block_sizes
        if not self.config.backward_reloads:
            self._free_block_sizes = lambda: []
        elif self._free_block_sizes is None and self.device.type == "cuda" and probes.allocated is None:
            self._free_block_sizes = _free_block_reader(self.device, self.streams.compute)
        # Reserved minus allocated bytes, read from the allocator's counters (microseconds): an
        # upper bound of what all free blocks together hold, to skip the snapshot when nothing
        # can fit (`_fitting`). None: no such bound (tests that inject their own readers).
        self._free_mapped = probes.free_mapped
        if self._free_mapped is None and self.device.type == "cuda" and probes.allocated is None:
            reserved, allocated = _allocator_stat(self.device, "current", "reserved_bytes"), self._allocated
            self._free_mapped = lambda: reserved() - allocated()
        self.cache_releases = 0
        self.cache_release_ms = 0.0

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


def _allocator_stat(device: torch.device, which: str, stat: str = "allocated_bytes") -> Callable[[], int]:
    """Reader of the caching allocator's allocated bytes ("current", "peak", or "allocated": the
    cumulative bytes ever allocated), or of another of its byte statistics (`stat`, e.g.
    "reserved_bytes").

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
            raw(index)[stat]["all"][which]
            return lambda: raw(index)[stat]["all"][which]
        except (KeyError, TypeError, RuntimeError):
            pass
    if stat != "allocated_bytes":
        return lambda: torch.cuda.memory_stats(index)[f"{stat}.all.{which}"]
    if which == "allocated":
        return lambda: torch.cuda.memory_stats(index)["allocated_bytes.all.allocated"]
    public = torch.cuda.memory_allocated if which == "current" else torch.cuda.max_memory_allocated
    return lambda: public(index)


# ----------------------------------------------------------------------------------------------
# The process's allocator setting (chosen when Megatron validates its arguments)
# ----------------------------------------------------------------------------------------------
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def allocator_choice(alloc_conf: Optional[str]):
    """(enable, note): whether to turn on expandable segments, and what to tell the user.

    With PyTorch's default caching allocator much or all of the offloaded memory stays *reserved*:
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
                   "PyTorch's default caching allocator less of the offloaded memory comes off reserved "
                   "memory (activations split the freed chunks' segments), and the GPU can peak higher "
                   f"than the offloaded bytes suggest. Add {EXPANDABLE_SEGMENTS} to get all of it.")


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
