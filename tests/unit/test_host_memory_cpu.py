"""Host memory: the reading, the check before pinning, and the pinned buffer's failure path.

The machine's figures are faked (a /proc and a cgroup tree in a temporary directory; an injected
cudaHostRegister), so these run without CUDA."""

import mmap
import os

import pytest
import torch

from megatron_offload import host_memory
from megatron_offload.host_buffer import PinnedHostBuffer
from megatron_offload.host_memory import GIB, HostMemoryError

from fakes import FakeDistOpt, make_coordinator


def fake_machine(tmp_path, available_gib, cgroup=None, rss_gib=2.0):
    """A /proc with MemAvailable and VmRSS, and optionally a cgroup v2 limit (limit, used) in GiB."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {int(512 * 2**20)} kB\nMemFree:        1 kB\n"
        f"MemAvailable:   {int(available_gib * 2**20)} kB\n")
    (proc / "self" / "status").write_text(f"Name:\tpython\nVmRSS:\t{int(rss_gib * 2**20)} kB\n")
    (proc / "self" / "cgroup").write_text("0::/job.slice\n")
    (cg / "job.slice").mkdir(parents=True)
    limit, used = cgroup if cgroup else ("max", 0)
    (cg / "job.slice" / "memory.max").write_text(f"{limit if limit == 'max' else int(limit * GIB)}\n")
    (cg / "job.slice" / "memory.current").write_text(f"{int(used * GIB)}\n")
    return str(proc), str(cg)


def test_reading_takes_the_smaller_of_memavailable_and_the_cgroup_headroom(tmp_path):
    proc, cg = fake_machine(tmp_path, available_gib=100, cgroup=(40, 30))
    mem = host_memory.read(proc, cg)
    assert mem.available == 100 * GIB and mem.cgroup_limit == 40 * GIB and mem.cgroup_used == 30 * GIB
    assert mem.headroom == 10 * GIB
    assert mem.rss == 2 * GIB
    proc, cg = fake_machine(tmp_path / "b", available_gib=100)  # memory.max = "max": no limit
    assert host_memory.read(proc, cg).headroom == 100 * GIB


def test_check_refuses_what_does_not_fit_and_names_the_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv(host_memory.CHECK_ENV, raising=False)
    proc, cg = fake_machine(tmp_path, available_gib=100, cgroup=(40, 30))
    mem = host_memory.read(proc, cg)
    host_memory.check_can_pin(8 * GIB, mem)  # 8 + 1 reserve <= 10: fits
    with pytest.raises(HostMemoryError) as err:
        host_memory.check_can_pin(int(9.5 * GIB), mem)
    text = str(err.value)
    assert "9.50 GiB of pinned host memory" in text and "only 10.00 GiB" in text
    assert "cgroup 30.0 GiB of 40.0 GiB" in text and "8 ranks on this node" in text
    assert "--offload-state-fraction" in text and host_memory.CHECK_ENV in text
    monkeypatch.setenv(host_memory.CHECK_ENV, "0")
    host_memory.check_can_pin(int(9.5 * GIB), mem)  # turned off


def test_pinning_is_checked_first_and_a_refusal_pins_nothing(monkeypatch):
    registered = []

    def register(ptr, nbytes):
        registered.append(nbytes)
        return 0

    def refuse(nbytes):
        raise HostMemoryError("no room")

    with pytest.raises(HostMemoryError, match="no room"):
        PinnedHostBuffer(4096, check=refuse, register=register)
    assert registered == []
    buf = PinnedHostBuffer(5000, check=lambda n: None, register=register)
    assert registered == [5000] and buf.nbytes == 5000 and buf.pinning == "cudaHostRegister"
    assert buf.dontfork  # see host_buffer's [Note: pinned pages and fork]
    assert buf._storage.data_ptr() % mmap.PAGESIZE == 0
    buf._registered_ptr = None  # (nothing was really registered)


def test_a_failed_registration_raises_clears_the_cuda_error_and_frees(monkeypatch):
    from megatron_offload import host_buffer

    cleared = []
    monkeypatch.setattr(host_buffer, "clear_cuda_error", lambda: cleared.append(True) or 1)
    monkeypatch.setattr(host_buffer, "_cuda_error_string", lambda err: "out of memory")
    with pytest.raises(HostMemoryError, match=r"cudaHostRegister of .* failed \(out of memory\).*ulimit -l"):
        PinnedHostBuffer(3 * 4096, check=lambda n: None, register=lambda ptr, n: 2)
    assert cleared == [True]


def test_unpinned_buffers_are_not_hidden_from_children():
    buf = PinnedHostBuffer(4096, pin=False)
    assert buf.pinning == "pageable" and not buf.dontfork


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_refused_pin_leaves_the_offloader_unattached(monkeypatch, fraction):
    """A refused pin raises out of the start-up offload, which detaches the coordinator (hooks
    removed, placeholders filled): the optimizer trains exactly as without offloading, and the
    offloader claims no state (nothing offloaded, nothing kept)."""
    from megatron_offload import packing
    from fakes import assert_bitwise_equal, make_grads, snapshot

    def refusing(nbytes, pin=True):
        raise HostMemoryError("no room")

    ref, opt = FakeDistOpt(), FakeDistOpt()
    monkeypatch.setattr(packing, "PinnedHostBuffer", refusing)
    coord = make_coordinator(device=torch.device("cpu"), chunk_bytes=4096,
                               expected_forwards_per_iteration=lambda: 1, state_fraction=fraction)
    off = coord.add_optimizer(opt)
    with pytest.raises(HostMemoryError):
        coord.offload_existing_state()
    assert off.chunks == [] and off.host is None
    assert off.kept == [] and off.kept_chunks == [] and off.kept_bytes == 0
    for step in range(2):  # the optimizer still works as if nothing had happened
        for o in (ref, opt):
            make_grads(o.all_params(), step)
            o.step()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


def test_reclaimable_page_cache_is_not_counted_against_the_cgroup(tmp_path):
    proc, cg = fake_machine(tmp_path, available_gib=100, cgroup=(40, 30))
    (tmp_path / "cgroup" / "job.slice" / "memory.stat").write_text(
        f"anon 123\nfile 999\ninactive_file {int(8 * GIB)}\nactive_file 5\n")
    assert host_memory.read(proc, cg).headroom == 18 * GIB  # 40 - (30 - 8)


def test_a_container_cgroup_mounted_at_the_root_is_found(tmp_path):
    """/proc shows the host's cgroup path while the container mounts its own tree at the root."""
    proc, cg = fake_machine(tmp_path, available_gib=100)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/kubepods/pod123/abc\n")
    (tmp_path / "cgroup" / "memory.max").write_text(str(50 * GIB) + "\n")
    (tmp_path / "cgroup" / "memory.current").write_text(str(45 * GIB) + "\n")
    assert host_memory.read(proc, cg).headroom == 5 * GIB


def test_pins_of_one_node_are_checked_one_at_a_time():
    """The check and the pinning run under one node-wide lock: a rank that pins second sees what
    the first took (all ranks checking against the same MemAvailable passed together before)."""
    import fcntl
    import tempfile

    from megatron_offload import host_buffer

    seen = []

    def check(nbytes):
        path = os.path.join(tempfile.gettempdir(), "megatron_offload_pin.lock")
        with open(path, "a+") as f:  # held by the buffer being built: a second taker must fail
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("free")
                fcntl.flock(f, fcntl.LOCK_UN)
            except BlockingIOError:
                seen.append("held")

    buf = host_buffer.PinnedHostBuffer(4096, check=check, register=lambda ptr, n: 0)
    buf._registered_ptr = None
    assert seen == ["held"]
