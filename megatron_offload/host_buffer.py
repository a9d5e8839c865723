"""Page-locked host memory of an exact size, allocated once and sliced into views.

PyTorch's caching host allocator (`torch.empty(..., pin_memory=True)`) rounds every request up to a
power of two: a 20.4 GiB request pins 32 GiB. We instead take ordinary pageable memory of exactly the
size we need and page-lock it in place with `cudaHostRegister`, once per offloader. Copies into and
out of registered memory are true asynchronous DMA transfers, like copies to caching-allocator
pinned memory.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Every slice starts on this boundary so that a uint8 slice can be reinterpreted as any dtype and
# so that DMA transfers start on a cache line.
ALIGNMENT = 64


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class PinnedHostBuffer:
    """`nbytes` of host memory, page-locked when CUDA is available.

    `pinning` says how: "cudaHostRegister" (exact size), "caching-host-allocator" (fallback when
    registration fails, e.g. under a low `ulimit -l`), or "pageable" (no CUDA: CPU tests).
    """

    def __init__(self, nbytes: int, pin: bool = True):
        self.nbytes = int(nbytes)
        self.pinning = "pageable"
        self._registered_ptr = None
        self._storage = torch.empty(self.nbytes, dtype=torch.uint8)
        if not (pin and torch.cuda.is_available() and self.nbytes > 0):
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self._storage.data_ptr(), self.nbytes, 0)
        if int(err) == 0:
            self._registered_ptr = self._storage.data_ptr()
            self.pinning = "cudaHostRegister"
            return
        logger.warning(
            "megatron-offload: cudaHostRegister of %.2f GiB failed (%s); falling back to PyTorch's "
            "pinned allocator, which rounds the allocation up to a power of two. Check `ulimit -l`.",
            self.nbytes / 2**30,
            cudart.cudaGetErrorString(err),
        )
        self._storage = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.pinning = "caching-host-allocator"

    @property
    def is_pinned(self) -> bool:
        return self.pinning != "pageable"

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A host tensor of `like`'s dtype and shape backed by bytes [offset, offset + nbytes)."""
        assert offset % ALIGNMENT == 0, offset
        nbytes = like.numel() * like.element_size()
        assert offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        return self._storage[offset : offset + nbytes].view(like.dtype).view(like.shape)

    def close(self) -> None:
        """Unpin. Views taken from this buffer must not be used for copies afterwards."""
        if self._registered_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None
        self.pinning = "pageable"

    def __del__(self):  # best effort; interpreter shutdown may already have torn CUDA down
        try:
            self.close()
        except Exception:
            pass
