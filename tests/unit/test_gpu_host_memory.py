"""Pinned host memory on a real GPU: forked children (the data loader's workers) must not copy it,
and a failed registration must leave CUDA usable. Needs CUDA and a Linux /proc; no megatron."""

import multiprocessing as mp
import time

import pytest
import torch

from megatron_offload import host_memory
from megatron_offload.host_buffer import PinnedHostBuffer
from megatron_offload.host_memory import GIB, HostMemoryError

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _available():
    time.sleep(0.5)  # let the kernel's counters settle
    return host_memory.read().available


def _sleep(seconds):
    time.sleep(seconds)


def test_forked_children_do_not_copy_the_pinned_buffer():
    """Linux copies DMA-pinned pages into a child at fork; each data-loader worker would hold a
    private copy of the whole state (host_buffer's [Note: pinned pages and fork])."""
    nbytes, children = 2 * GIB, 3
    before = _available()
    buf = PinnedHostBuffer(nbytes)
    assert buf.pinning == "cudaHostRegister" and buf.dontfork
    buf.bytes.copy_(torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pinned = before - _available()
    procs = [mp.get_context("fork").Process(target=_sleep, args=(3,)) for _ in range(children)]
    for p in procs:
        p.start()
    with_children = before - _available()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    assert int(buf.bytes[nbytes - 1]) == 3
    buf.close()
    # Each forked copy would cost `nbytes`; allow a quarter of one for the children's own pages.
    assert with_children - pinned < nbytes // 4, (pinned / GIB, with_children / GIB)


def test_a_failed_registration_leaves_cuda_usable():
    """cudaHostRegister with invalid flags fails; the error must not surface at the next kernel."""
    def bad_register(ptr, nbytes):
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0x7FFF))

    with pytest.raises(HostMemoryError, match="cudaHostRegister"):
        PinnedHostBuffer(64 * 2**20, register=bad_register)
    x = torch.ones(1024, device="cuda")
    assert float((x * 2).sum()) == 2048.0  # a launch check would raise the stale error here
