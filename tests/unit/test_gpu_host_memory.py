"""Pinned host memory on a real GPU: forked children (the data loader's workers) must not copy it,
and a failed registration must leave CUDA usable. Needs CUDA and a Linux /proc; no megatron."""

import multiprocessing as mp

import pytest
import torch

from megatron_offload.host_buffer import PinnedHostBuffer
from megatron_offload.host_memory import GIB, HostMemoryError

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _report_mapping(conn, start):
    """In a forked child: whether the parent's buffer at `start` is mapped here."""
    with open("/proc/self/maps") as f:
        mapped = any(int(line.split("-", 1)[0], 16) <= start < int(line.split("-", 1)[1].split()[0], 16)
                     for line in f)
    conn.send(mapped)
    conn.close()


def test_forked_children_do_not_copy_the_pinned_buffer():
    """Linux copies DMA-pinned pages into a child at fork; each data-loader worker would hold a
    private copy of the whole state (host_buffer's [Note: pinned pages and fork]). With
    MADV_DONTFORK the range does not exist in a child at all: asked in each child (its own
    mappings), not read off the node's MemAvailable, which other jobs on the node move."""
    nbytes, children = 2 * GIB, 3
    buf = PinnedHostBuffer(nbytes)
    assert buf.pinning == "cudaHostRegister" and buf.dontfork
    buf.bytes.copy_(torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    # Why: the 2 GiB source stays cached otherwise, where later tests' long-lived tensors can
    # take part of it and keep it from going back (the phase switch test measures what goes back).
    torch.cuda.empty_cache()
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(children)]
    procs = [ctx.Process(target=_report_mapping, args=(w, buf.bytes.data_ptr())) for _, w in pipes]
    for p, (_, w) in zip(procs, pipes):
        p.start()
        w.close()  # (the child's end only: a child that dies before sending makes recv fail, not hang)
    mapped = [r.recv() if r.poll(30) else "no answer" for r, _ in pipes]
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    assert int(buf.bytes[nbytes - 1]) == 3
    buf.close()
    assert mapped == [False] * children, mapped


def test_a_failed_registration_leaves_cuda_usable():
    """cudaHostRegister with invalid flags fails; the error must not surface at the next kernel."""
    def bad_register(ptr, nbytes):
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0x7FFF))

    with pytest.raises(HostMemoryError, match="cudaHostRegister"):
        PinnedHostBuffer(64 * 2**20, register=bad_register)
    x = torch.ones(1024, device="cuda")
    assert float((x * 2).sum()) == 2048.0  # a launch check would raise the stale error here
