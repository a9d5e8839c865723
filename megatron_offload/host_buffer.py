"""Page-locked host memory of an exact size, allocated once and sliced into views.

PyTorch's caching host allocator (`torch.empty(..., pin_memory=True)`) rounds every request up to a
power of two: a 20.4 GiB request pins 32 GiB. We instead map anonymous memory of exactly the size
we need (rounded up to a page) and page-lock it in place with `cudaHostRegister`, once per
offloader. Copies into and out of registered memory are true asynchronous DMA transfers.

[Note: pinned pages and fork]
The mapping is marked MADV_DONTFORK before it is pinned. Linux copies every page that may be
DMA-pinned into a child at fork time, eagerly, instead of sharing it copy-on-write (so that the
device keeps writing into the parent's pages). Megatron forks its data-loader workers after the
optimizer is built, so without DONTFORK each worker received a private, resident copy of the whole
pinned state: the node lost the pinned bytes once per worker, in memory no training process's RSS
shows (the children's), and a large state got ranks killed by the OOM killer. The workers never
touch the state; with DONTFORK the range simply does not exist in them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import tempfile
from typing import Callable, Optional

import torch

from . import host_memory
from .host_memory import HostMemoryError

logger = logging.getLogger(__name__)

# Every slice starts on this boundary so that a uint8 slice can be reinterpreted as any dtype and
# so that DMA transfers start on a cache line.
ALIGNMENT = 64


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def _cuda_register(ptr: int, nbytes: int) -> int:
    """cudaHostRegister(ptr, nbytes, default flags); the CUDA error code."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def cuda_unregister(ptr: int) -> int:
    """cudaHostUnregister(ptr); the CUDA error code."""
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def _cuda_error_string(err: int) -> str:
    try:
        return str(torch.cuda.cudart().cudaGetErrorString(err))
    except Exception:  # noqa: BLE001 - only for the message
        return f"CUDA error {err}"


def clear_cuda_error() -> Optional[int]:
    """Reset CUDA's per-thread last error (cudaGetLastError) after a failed runtime call.

    A failed cudaHostRegister also records its error as the thread's last error, and PyTorch checks
    that after every kernel launch: left there, the next kernel raises `invalid argument` far from
    the cause. torch binds no cudaGetLastError, so call it in the libcudart this process loaded
    (dlopen of an already loaded path returns the same library, hence the same error state).
    Every libcudart loaded is cleared (another package may have brought a second one). Returns the
    first non-zero error cleared (0: none), or None where no libcudart is loaded (a statically
    linked runtime: the stale error then surfaces at the next kernel launch)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line and "/" in line}
    except OSError:
        return None
    found = None
    for path in sorted(paths):
        try:
            err = int(ctypes.CDLL(path).cudaGetLastError())
        except (OSError, AttributeError):
            continue
        found = err if not found else found
    if found is None:
        logger.warning("megatron-offload: no libcudart found to clear CUDA's last error after a failed registration")
    return found


@contextlib.contextmanager
def _node_pin_lock():
    """An exclusive lock shared by every process of this machine (released by the kernel if the
    holder dies)."""
    path = os.path.join(tempfile.gettempdir(), "megatron_offload_pin.lock")
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class PinnedHostBuffer:
    """`nbytes` of host memory, page-locked when CUDA is available.

    `pinning` says how: "cudaHostRegister" (exact size), or "pageable" (no CUDA: CPU tests).
    Pinning that cannot be done raises HostMemoryError (with the CUDA error cleared): there is no
    fallback, since copies to pageable memory are synchronous and half as fast, and PyTorch's
    pinned allocator would need up to twice the bytes that just failed.

    check: called with `nbytes` before anything is pinned (host_memory.check_can_pin; tests fake
        the machine's figures). register: cudaHostRegister (tests inject failures).
    """

    def __init__(self, nbytes: int, pin: bool = True,
                 check: Callable[[int], None] = host_memory.check_can_pin,
                 register: Optional[Callable[[int, int], int]] = None):
        self.nbytes = int(nbytes)
        self.pinning = "pageable"
        self.dontfork = False
        self._registered_ptr = None
        self._map = None
        pin = pin and (register is not None or torch.cuda.is_available())  # (nbytes == 0: nothing to pin, below)
        if self.nbytes == 0:
            self._storage = torch.empty(0, dtype=torch.uint8)
            return
        if not pin:
            self._map_anonymous()
            return
        # Why: the ranks of a node pin at the same moment; one at a time, each check sees what the
        # others have already taken instead of all passing against the same MemAvailable.
        with _node_pin_lock():
            check(self.nbytes)
            self._pin(register)

    def _map_anonymous(self) -> None:
        """Anonymous and private memory: page-aligned, zero-filled, backed only where touched.

        The storage is ALIGNMENT bytes longer than `nbytes`, a tail no view covers: every view is
        then a view of a larger storage, which checkpoint writers copy before an asynchronous
        save returns (`HostCopies.expose_host_copies`), where a tensor that is its whole storage
        would be handed over as it is (and moved into shared memory by a writer process's queue:
        the pinned buffer itself)."""
        self._map = mmap.mmap(-1, align_up(self.nbytes + ALIGNMENT, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE)
        self._storage = torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes + ALIGNMENT)

    def _pin(self, register: Optional[Callable[[int, int], int]]) -> None:
        self._map_anonymous()
        # Why: see [Note: pinned pages and fork]; must precede the pinning.
        self._map.madvise(mmap.MADV_DONTFORK)
        self.dontfork = True
        register = register or _cuda_register
        ptr = self._storage.data_ptr()
        err = register(ptr, self.nbytes)
        if err != 0:
            clear_cuda_error()
            self._release()
            raise HostMemoryError(
                f"megatron-offload: cudaHostRegister of {self.nbytes / 2**30:.2f} GiB failed "
                f"({_cuda_error_string(err)}); {host_memory.read().describe()}. Check the locked-memory limit "
                "(`ulimit -l`, or the container's memlock limit) and the host memory left for this rank, "
                "or run without --offload-optimizer-states.")
        self._registered_ptr = ptr
        self.pinning = "cudaHostRegister"

    @property
    def bytes(self) -> torch.Tensor:
        """The whole buffer as one uint8 tensor of `nbytes` (without the tail)."""
        return self._storage[: self.nbytes]

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A host tensor of `like`'s dtype and shape backed by bytes [offset, offset + nbytes)."""
        assert offset % ALIGNMENT == 0, offset
        nbytes = like.numel() * like.element_size()
        assert offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        return self._storage[offset : offset + nbytes].view(like.dtype).view(like.shape)

    def close(self) -> None:
        """Unpin. Views taken from this buffer must not be used for copies afterwards; the memory
        itself goes when the last view does."""
        if self._registered_ptr is not None:
            cuda_unregister(self._registered_ptr)
            self._registered_ptr = None
        self.pinning = "pageable"

    def _release(self) -> None:
        """Drop our references: the tensor made by `torch.frombuffer` keeps the mapping alive, and
        the mapping is unmapped when the last tensor or view over it goes (closing it explicitly
        would unmap it under views still in use)."""
        self._storage = torch.empty(0, dtype=torch.uint8)
        self._map = None

    def __del__(self):  # best effort; interpreter shutdown may already have torn CUDA down
        try:
            self.close()
        except Exception:
            pass
