"""Pinned host memory on a real GPU: forked children (the data loader's workers) must not copy it,
and a failed registration must leave CUDA usable. Needs CUDA and a Linux /proc; no megatron."""

import multiprocessing as mp
import time

import pytest
import torch

from megatron_offload.host_buffer import PinnedHostBuffer
from megatron_offload.host_memory import GIB, HostMemoryError

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _report_own_memory(conn, start, seconds):
    """In a forked child: whether the parent's buffer at `start` is mapped here, and this process's
    private bytes (pages copied into it, as a pinned range copied at fork would be)."""
    with open("/proc/self/maps") as f:
        mapped = any(int(line.split("-", 1)[0], 16) <= start < int(line.split("-", 1)[1].split()[0], 16)
                     for line in f)
    private = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1]) * 1024
    conn.send((mapped, private))
    conn.close()
    time.sleep(seconds)


def test_forked_children_do_not_copy_the_pinned_buffer():
    """Linux copies DMA-pinned pages into a child at fork; each data-loader worker would hold a
    private copy of the whole state (host_buffer's [Note: pinned pages and fork]).

    Measured in each child (its own mappings and private pages), not as the node's MemAvailable,
    which other jobs on the node move while the test runs."""
    nbytes, children = 2 * GIB, 3
    buf = PinnedHostBuffer(nbytes)
    assert buf.pinning == "cudaHostRegister" and buf.dontfork
    buf.bytes.copy_(torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    # Why: the 2 GiB source stays cached otherwise, and later tests' long-lived tensors split it,
    # so their freed memory can no longer go back (the phase switch test measures that).
    torch.cuda.empty_cache()
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(children)]
    procs = [ctx.Process(target=_report_own_memory, args=(w, buf.bytes.data_ptr(), 1)) for _, w in pipes]
    for p in procs:
        p.start()
    reports = [r.recv() for r, _ in pipes]
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    assert int(buf.bytes[nbytes - 1]) == 3
    buf.close()
    assert not any(mapped for mapped, _ in reports), reports
    # A copied buffer would be `nbytes` of private pages in each child; allow a quarter of one
    # for the child's own pages.
    assert all(private < nbytes // 4 for _, private in reports), [private / GIB for _, private in reports]


def test_a_failed_registration_leaves_cuda_usable():
    """cudaHostRegister with invalid flags fails; the error must not surface at the next kernel."""
    def bad_register(ptr, nbytes):
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0x7FFF))

    with pytest.raises(HostMemoryError, match="cudaHostRegister"):
        PinnedHostBuffer(64 * 2**20, register=bad_register)
    x = torch.ones(1024, device="cuda")
    assert float((x * 2).sum()) == 2048.0  # a launch check would raise the stale error here
