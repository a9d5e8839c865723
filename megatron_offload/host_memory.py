"""The node's host memory as its out-of-memory killer sees it, and the check made before pinning.

Pinned (page-locked) memory can be neither swapped nor reclaimed: what a rank pins is gone from the
node until the rank exits. So before pinning we compare the request with what is left, and refuse
with a message rather than let the kernel kill a rank (SIGKILL, no message) minutes later.

"Left" is the smaller of the node's `MemAvailable` and the headroom under this process's cgroup
limit (v2 `memory.max` - `memory.current`, or v1 `memory.limit_in_bytes` - `memory.usage_in_bytes`).
`MemTotal` is never used: on some virtual machines memory is plugged in as it is touched, so
`MemTotal` (and with it `MemAvailable`) starts low and grows. Where that makes the check refuse
wrongly, `MEGATRON_OFFLOAD_HOST_MEMORY_CHECK=0` turns it off.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

GIB = 2**30
# Left free after pinning: the rest of the rank (Python, CUDA context, data loader) still grows.
RESERVE_BYTES = 1 * GIB
CHECK_ENV = "MEGATRON_OFFLOAD_HOST_MEMORY_CHECK"


class HostMemoryError(RuntimeError):
    """Pinning the optimizer state would not fit in this node's host memory, or failed."""


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """One reading; None where this machine does not expose the figure."""

    available: Optional[int] = None  # /proc/meminfo MemAvailable
    cgroup_limit: Optional[int] = None  # None: no limit set
    cgroup_used: Optional[int] = None
    rss: Optional[int] = None  # this process's VmRSS

    @property
    def headroom(self) -> Optional[int]:
        """Bytes that can still be pinned: MemAvailable, capped by the cgroup's headroom."""
        figures = [self.available]
        if self.cgroup_limit is not None and self.cgroup_used is not None:
            figures.append(self.cgroup_limit - self.cgroup_used)
        figures = [f for f in figures if f is not None]
        return min(figures) if figures else None

    def describe(self) -> str:
        def gib(x):
            return "n/a" if x is None else f"{x / GIB:.1f} GiB"

        text = f"MemAvailable {gib(self.available)}"
        if self.cgroup_limit is not None:
            text += f", cgroup {gib(self.cgroup_used)} of {gib(self.cgroup_limit)}"
        return text + f", this process's RSS {gib(self.rss)}"


def _meminfo_kib(path: str, key: str) -> Optional[int]:
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == key:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> Optional[int]:
    """An integer file of the cgroup tree; None for 'max', a missing file or an absurd v1 'no limit'."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= 2**60 else value  # cgroup v1 writes ~2^63 for "no limit"


def _cgroup_dir(proc_root: str, cgroup_root: str) -> Optional[str]:
    """This process's memory cgroup directory (v2 unified, else v1 `memory` controller)."""
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].lstrip("/")
        if controllers == "":  # v2
            return os.path.join(cgroup_root, path)
        if "memory" in controllers.split(","):  # v1
            return os.path.join(cgroup_root, "memory", path)
    return None


def read(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> HostMemory:
    available = _meminfo_kib(os.path.join(proc_root, "meminfo"), "MemAvailable")
    rss = _meminfo_kib(os.path.join(proc_root, "self", "status"), "VmRSS")
    limit = used = None
    # This process's cgroup as /proc names it, else the root of the mounted tree (a container that
    # mounts its own cgroup at /sys/fs/cgroup while /proc shows the host's path).
    for directory in filter(None, (_cgroup_dir(proc_root, cgroup_root), cgroup_root)):
        for limit_name, used_name, cache_key in (("memory.max", "memory.current", "inactive_file"),
                                                 ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                  "total_inactive_file")):
            limit = _read_int(os.path.join(directory, limit_name))
            if limit is not None:
                used = _read_int(os.path.join(directory, used_name))
                # Inactive page cache counts as used but is reclaimed before the OOM killer acts.
                cache = _stat_value(os.path.join(directory, "memory.stat"), cache_key)
                if used is not None and cache:
                    used = max(0, used - cache)
                break
        if limit is not None:
            break
    return HostMemory(available=available, cgroup_limit=limit, cgroup_used=used, rss=rss)


def _stat_value(path: str, key: str) -> Optional[int]:
    """One `key value` line of a cgroup memory.stat file."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return None


def check_can_pin(nbytes: int, memory: Optional[HostMemory] = None, what: str = "optimizer state") -> None:
    """Raise HostMemoryError if pinning `nbytes` more would leave less than RESERVE_BYTES.

    Each rank checks when it pins, so ranks of one node that pin later see what the earlier ones
    took. Ranks that pin at the same moment can each see the same headroom; the reserve covers
    small overlaps only."""
    if nbytes <= 0 or os.environ.get(CHECK_ENV, "1") == "0":
        return
    memory = read() if memory is None else memory
    headroom = memory.headroom
    if headroom is None or nbytes + RESERVE_BYTES <= headroom:
        return
    local = os.environ.get("LOCAL_WORLD_SIZE")
    per_node = (f" With {local} ranks on this node that is about {int(local) * nbytes / GIB:.1f} GiB "
                "for the node." if local and local.isdigit() and int(local) > 1 else "")
    raise HostMemoryError(
        f"megatron-offload: --offload-optimizer-states needs {nbytes / GIB:.2f} GiB of pinned host memory "
        f"for this rank's {what}, but only {headroom / GIB:.2f} GiB can be taken ({memory.describe()}; "
        f"{RESERVE_BYTES / GIB:.0f} GiB is kept free).{per_node} Pinned memory cannot be swapped: "
        "offload less (--offload-state-fraction), spread the state over more data-parallel ranks, or drop "
        f"--offload-optimizer-states. If this machine adds memory as it is used, set {CHECK_ENV}=0.")
