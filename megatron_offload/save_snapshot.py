"""Shared-memory snapshots of the offloaded state for asynchronous checkpoint writers.

An asynchronous save (megatron-core's persistent checkpoint worker, `--async-save`) hands what it
reads to another process, which writes it while training goes on. CPU tensors reach that process in
two copies unless they are already in the right form: dist-checkpointing clones every CPU tensor
that is a view of a larger storage before `save` returns (`FileSystemWriterAsync.
prepare_write_data`; every view of the pinned buffer is one, see `PinnedHostBuffer`), and the
worker's queue moves every CPU storage that is not yet shared memory into shared memory. A tensor
that is its whole storage and already in shared memory costs neither: the worker maps its pages.

`SaveSnapshots` keeps such tensors, one per large state tensor, and fills them from the host
copies at save time: one memory copy, spread over a few threads, into pages faulted in once. A set
is reused by the next save once no earlier save holds it any more (megatron-core keeps its request,
hence the tensors, until the write is finalized), so the next step's copy-out can rewrite the
pinned buffer at once. Small tensors keep the buffer's views (cloned by the writer; cheap).

[Note: snapshot cost]
One set costs host memory equal to the offloaded bytes it covers, TE's fp16 / bf16 states twice theirs (held as the
fp32 values `get_unscaled_state` returns, see host_copies.py), in shared memory (/dev/shm, counted
against the node's MemAvailable) for as long as training runs; a second set is made only when a
save finds the first still held by one writing (so up to twice those bytes, kept once made). Where neither fits (`check`), the save falls back to the
buffer's views, which the writer copies itself. With a device fill the sets are page-locked too, so up to
three times the offloaded bytes are then locked, with the pinned buffer.

[Note: background fill]
With `background` (OffloadConfig.async_save_background_fill, for megatron-core's own strategy), a `take` for a reader
that only collects references returns at once and the copy runs in a thread of its own, after
the copy-out it reads has finished (`before`), from when the save's request is with the writer
(megatron_saves starts it, `Fill.start`; any wait starts it earlier): training goes on while the set fills. Everything that reads a set waits for its fill first:
* the checkpoint writer: megatron_saves hands the writer's function to megatron-core wrapped in
  `snapshot_fill.writer_waits`, which polls the flags of every fill not known to be done (`pending_fills`: a
  second save before the next forward reads the first one's set again) in the writer's process,
  and adds a finalize function, on every rank, that fails the save on every rank if any rank's
  fill failed (`snapshot_fill.check_written`);
* readers in this process that read values rather than take references (a gather of the state,
  TE's unscaling of 16-bit states, a copy of a view of a snapshot): `wait_filled`, called by
  their wrappers (state_access.py, host_copies.py, megatron_saves);
* anything that rewrites or frees what a fill reads (the next copy-out into the pinned buffer, a
  load into it, a re-pack, `close`): `wait_filled` too, which never raises (a failed fill fails
  every later save, through `check_written`, not the step that comes next).
In this mode every state tensor gets a snapshot (small ones too: a view would be cloned, a
read, by dist-checkpointing before the request is scheduled), and sets are shared by file name
(torch's `file_system` strategy, which `snapshot_fill.handed_over_by_name` selects while a request is handed
to the writer's process): such a storage crosses to it by name, not as a file descriptor that
the writer fetches over a socket of its own, tensor by tensor.

[Note: device fill]
A background fill on the host is one memory copy of every offloaded byte, on one core, while
training goes on, and the next copy-out into the pinned buffer must wait for it. On a CUDA device
the sets are page-locked in place instead (`device_fill`), and a save leaves the chunks it finds on
the GPU (the step before it wrote them: the usual case) where they are: their copy-out starts, a
second D2H copies them from there straight into the set the save takes (`copy_from_device`,
`HostCopies.expose_host_copies`), their tensors point at those snapshots until the next forward, and
that forward frees them as after any step, its wait covering both copies. The save then costs no
host copy and no GPU memory, and frees nothing: the wait for the copies moves to the next forward's
frees, by when they have had the rest of the save to run. With the copy feeder (the streamed step's
default) the second copy is fed like the copy-outs, behind them and in the order the chunks are
freed, about the in-flight bound queued, and only from when the fill's thread starts (once the
request is with the writer, or earlier where something waits for the fill): the save's own device
reads (megatron-core's planning, its copy of what stays on the GPU) would otherwise wait behind
every copy at once (copy_feeder.py). Without it the copy goes to the D2H stream at once, and those
reads wait behind it. The fill thread waits for those copies (at the feeder's pace) and copies on
the host only what the GPU no longer held (chunks the chunked step already freed) and TE's 16-bit
states served as fp32, which need the host's conversion (their copy-outs are enqueued at the save).
A claim (`copy_from_device`) serves only the background `take` of the save that made it: every such
save begins with `forget_claim`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import resource
import time
from typing import Callable, List, Optional

import torch

from . import host_buffer, host_memory
from .snapshot_fill import Fill, fill_pieces
from .snapshot_set import STORAGE_USE_COUNT, SnapshotSet

logger = logging.getLogger(__name__)

# Tensors below this stay views of the pinned buffer: each snapshot is one shared-memory file
# (one file descriptor while it lives) and small ones cost more in descriptors than in copies.
# (Sets shared by name, in background mode, keep no descriptor: every tensor gets one there.)
MIN_SNAPSHOT_BYTES = 1 << 20
# Sets kept at most: one being written by a pending save, one for the next save.
MAX_SETS = 2
# The copy into a set runs in pieces of at most this many bytes over COPY_THREADS threads (a
# CPU copy releases the GIL; one thread copies at a fraction of the memory bandwidth).
COPY_PIECE_BYTES = 64 << 20
COPY_THREADS = 8
# A background fill copies from one thread: each piece's copy is parallel inside torch already, and
# several threads each starting their own parallel copies contend with the training thread, which
# goes on meanwhile (a blocking fill may use them: nothing else runs then).
BACKGROUND_COPY_THREADS = 1
# A background fill starts when its save's request has been handed to the writer
# (megatron_saves calls `Fill.start`), not in `take`: a copy running beside
# dist-checkpointing's planning slows it down, and the training thread waits for that. True: in `take`.
BACKGROUND_FILL_AT_TAKE = False
# Background sets are page-locked and filled from the GPU where the save finds the values there
# ([Note: device fill]); False: always on the host (the benchmark's comparison).
DEVICE_FILL = True
# File descriptors left to everything else when sets are made (each snapshot keeps one open).
FD_MARGIN = 512


# References to a storage (tensors and storage objects); None where torch does not expose it. (A
# name of this module's own, for its checks: SnapshotSet counts with snapshot_set's.)
_STORAGE_USE_COUNT = STORAGE_USE_COUNT


def _bytes(tensors: List[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def shared_memory_free() -> Optional[int]:
    """Bytes free in /dev/shm (where torch's shared CPU storages live), or None if not there."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_descriptors(count: int) -> None:
    """Raise HostMemoryError if `count` more open files would leave fewer than FD_MARGIN of this
    process's limit (RLIMIT_NOFILE). A set of n snapshots keeps n open and its save briefly
    duplicates each again (the worker queue sends descriptors): `take` asks for 2n (none for
    sets shared by name, which keep none and cross by name). A queue
    that runs out of descriptors drops the request, and a blocking finalize then waits forever."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    used = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    if used + count + FD_MARGIN > soft:
        raise host_memory.HostMemoryError(
            f"megatron-offload: an asynchronous save's snapshot needs {count} file descriptors, {used} of "
            f"this process's {soft} are open (ulimit -n)")


def check_room(nbytes: int) -> None:
    """Raise HostMemoryError if a set of `nbytes` would not fit in shared memory or would leave
    the node less host memory than host_memory.RESERVE_BYTES."""
    free = shared_memory_free()
    if free is not None and nbytes > free:
        raise host_memory.HostMemoryError(
            f"megatron-offload: an asynchronous save's snapshot needs {nbytes / 2**30:.2f} GiB of shared "
            f"memory, /dev/shm has {free / 2**30:.2f} GiB free")
    if os.environ.get(host_memory.CHECK_ENV, "1") == "0":
        return
    memory = host_memory.read()
    headroom = memory.headroom
    if headroom is not None and nbytes + host_memory.RESERVE_BYTES > headroom:
        raise host_memory.HostMemoryError(
            f"megatron-offload: an asynchronous save's snapshot needs {nbytes / 2**30:.2f} GiB of host memory, "
            f"{headroom / 2**30:.2f} GiB can be taken ({memory.describe()})")


@dataclasses.dataclass(frozen=True)
class Fp32:
    """How `take` serves a source as fp32: `source.float()`, then times `scale` when one is given
    (Transformer Engine's `get_unscaled_state`: bf16 states unscaled by conversion alone, fp16
    states also multiplied by their scale, a CPU fp32 `[1]` tensor)."""

    scale: Optional[torch.Tensor] = None


def _layout(likes: List[torch.Tensor], unscaled: Optional[List[bool]] = None) -> list:
    """(shape, dtype) of each snapshot: the source's, or fp32 for a source served unscaled."""
    unscaled = unscaled or [False] * len(likes)
    return [(t.shape, torch.float32 if u else t.dtype) for t, u in zip(likes, unscaled)]


class SaveSnapshots:
    """Reusable shared-memory snapshots (module docstring). Before a set is made, `check` is
    called with its bytes and `check_fds` with its number of files (tests fake the machine)."""

    def __init__(self, check: Callable[[int], None] = check_room, threads: int = COPY_THREADS,
                 check_fds: Callable[[int], None] = check_descriptors,
                 register: Optional[Callable[[int, int], int]] = None,
                 unregister: Optional[Callable[[int], int]] = None):
        self.enabled = False  # the owner prepares a set for each layout it packs (`prepare`)
        # Fill in the background, every tensor, sets shared by name ([Note: background fill]);
        # set by the owner before any set is made.
        self.background = False
        # Sets page-locked so that `copy_from_device` can fill them ([Note: device fill]); set by
        # the owner (background mode on a CUDA device) before any set is made.
        self.device_fill = False
        self._fills: List[Fill] = []  # background fills not known to have succeeded
        self._sets: List[SnapshotSet] = []
        self._claimed = None  # (set, indices copied from the device) for the background `take` of the same save
        self._check = check
        self._check_fds = check_fds
        self._register = register or host_buffer._cuda_register
        self._unregister = unregister or host_buffer.cuda_unregister
        self._threads = threads
        self._warned = False
        self._warned_lock = False
        self.collections = 0  # garbage collections `take` ran to free a set, and their host time
        self.collect_seconds = 0.0
        self.fill_wait_seconds = 0.0  # host time `wait_filled` blocked for background fills not done
        self.device_bytes = 0  # bytes `take` handed out that `copy_from_device` had copied, in all

    def selects(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` gets a snapshot (else the save reads the buffer's view)."""
        nbytes = tensor.numel() * tensor.element_size()
        return nbytes > 0 if self.background else nbytes >= MIN_SNAPSHOT_BYTES

    @property
    def nbytes(self) -> int:
        """Host bytes held by all sets."""
        return sum(_bytes(s.tensors) for s in self._sets)

    def prepare(self, likes: List[torch.Tensor], unscaled: Optional[List[bool]] = None) -> bool:
        """Make a set for tensors shaped like `likes` now (start-up) rather than at the first save,
        which would otherwise wait for its memory to be faulted in. `unscaled`: which of them
        `take` will be given a scale for. Whether a set for them exists."""
        if _STORAGE_USE_COUNT is None or not likes:
            return False
        layout = _layout(likes, unscaled)
        self._keep(lambda s: s.fits(layout) or s.in_use())
        if any(s.fits(layout) for s in self._sets):
            return True
        if len(self._sets) >= MAX_SETS:
            return False
        return self._new_set(layout) is not None

    def take(self, sources: List[torch.Tensor], as_fp32: Optional[List[Optional[Fp32]]] = None,
             before: Optional[Callable[[], None]] = None, background: bool = False) -> Optional[List[torch.Tensor]]:
        """Copies of `sources` (contiguous CPU tensors), each its own shared-memory storage, from a
        free set (made if none is free and fewer than MAX_SETS exist). A source with an `Fp32`
        entry in `as_fp32` is served as fp32 instead: Transformer Engine's `get_unscaled_state`
        computed piece by piece (the same conversion and the same fp32 multiply per element, so
        the same bits). None if no set is free and none can be made: the caller hands out the
        sources themselves. `before` (the copy-out the sources wait for) runs first; with
        `background` (a reader that only collects references) both run in a thread, started by
        `Fill.start` (megatron_saves) or any wait, and the copies are valid only once it has finished
        ([Note: background fill])."""
        if _STORAGE_USE_COUNT is None:  # (no way to tell when a pending save lets go of a set)
            self._warn("this torch does not expose storage reference counts")
            return None
        as_fp32 = as_fp32 or [None] * len(sources)
        layout = _layout(sources, [f is not None for f in as_fp32])
        claimed, self._claimed = self._claimed, None
        # (only a background take follows the claim of its own save: `forget_claim` comes first;
        # the set was free when claimed, and the copies into it may still hold views of it)
        if background and claimed is not None and claimed[0].fits(layout):
            chosen, from_device = claimed
        else:
            chosen, from_device = self._choose(layout, len(sources)), frozenset()
        if chosen is None:
            return None
        self.device_bytes += _bytes([chosen.tensors[i] for i in from_device])
        rest = [i for i in range(len(sources)) if i not in from_device]
        pieces = self._pieces([chosen.tensors[i] for i in rest], [sources[i] for i in rest], [as_fp32[i] for i in rest])
        if background:
            self._fills.append(Fill(chosen.tensors, pieces, min(self._threads, BACKGROUND_COPY_THREADS), before,
                                    start=BACKGROUND_FILL_AT_TAKE))
        else:
            if before is not None:
                before()
            fill_pieces(pieces, self._threads)
        return list(chosen.tensors)

    def forget_claim(self) -> None:
        """A save begins: no claim of an earlier one (which failed before its `take`) may be used."""
        self._claimed = None

    def copy_from_device(self, likes: List[torch.Tensor], unscaled: List[bool],
                         device_sources: List[Optional[torch.Tensor]],
                         enqueue: Optional[Callable[[list], object]] = None) -> int:
        """Enqueue, for every source in `device_sources` that is not None (a device tensor holding
        the values the same save's background `take` will be given for that position), its copy
        into the set that take then hands out ([Note: device fill]); `likes` and `unscaled` give
        that take's layout. `enqueue` is given the copies, (position, destination, source), and
        returns what waits for them (`synchronize()`); by default they go to the current stream.
        Returns the bytes enqueued (0: nothing was, and `take` fills everything itself). The
        copies must have finished before the set is read: `take`'s `before` waits for them."""
        self._claimed = None
        if not self.device_fill or not any(src is not None for src in device_sources):
            return 0
        layout = _layout(likes, unscaled)
        chosen = self._choose(layout, len(likes))
        if chosen is None or not chosen.pinned:
            return 0
        copies = [(i, dst, src) for i, (dst, src, u) in enumerate(zip(chosen.tensors, device_sources, unscaled))
                  if src is not None and not u]
        if enqueue is not None:
            # (the set is not dropped while its copies wait: the save's tensors point at it)
            chosen.last_device_copy[0] = enqueue(copies)
        else:
            for _, dst, src in copies:
                dst.copy_(src.view(dst.shape), non_blocking=True)
            if any(src.is_cuda for _, _, src in copies):
                chosen.last_device_copy[0] = torch.cuda.Event()
                chosen.last_device_copy[0].record()
        self._claimed = (chosen, frozenset(i for i, _, _ in copies))
        return _bytes([dst for _, dst, _ in copies])

    def _choose(self, layout: list, count: int) -> Optional[SnapshotSet]:
        """A free set of `layout`, made if none is free and fewer than MAX_SETS exist; None (warned)
        if there is none and none can be made."""
        chosen = self._free_set(layout)
        if chosen is None and any(s.fits(layout) for s in self._sets):
            # Why: a finalized save's request can stay alive in a reference cycle of the save path
            # until the garbage collector runs (megatron-core 0.19 with torch 2.8): one collection
            # costs less than a new set's pages, or than the views' copies.
            started = time.perf_counter()
            gc.collect()
            self.collections += 1
            self.collect_seconds += time.perf_counter() - started
            chosen = self._free_set(layout)
        if chosen is None:
            # Sets of another layout (the state was re-packed) are dropped once free.
            self._keep(lambda s: s.fits(layout) or s.in_use())
            if len(self._sets) >= MAX_SETS:
                self._warn("every snapshot set is still held by an earlier save")
                return None
            return self._new_set(layout)
        try:  # (a reused set's save duplicates its descriptors again)
            self._check_fds(0 if self.background else count)
        except host_memory.HostMemoryError as err:
            self._warn(str(err))
            return None
        return chosen

    def _keep(self, keep: Callable[[SnapshotSet], bool]) -> None:
        """Drop the sets `keep` rejects, unlocking their pages (what a pending save still holds of
        them stays valid: only this process's page lock goes)."""
        kept = []
        for made in self._sets:
            if keep(made):
                kept.append(made)
            else:
                made.release()
        self._sets = kept
        if self._claimed is not None and self._claimed[0] not in kept:
            self._claimed = None

    def wait_filled(self) -> None:
        """Block until every background fill has finished: before anything reads a set's values
        in this process, or rewrites or frees what a fill reads. Never raises: a failed fill
        stays pending, and every later save fails (`check_written`, on every rank)."""
        if any(not f.done for f in self._fills):
            started = time.perf_counter()
            for fill in self._fills:
                fill.join()
            self.fill_wait_seconds += time.perf_counter() - started
        self._fills = [f for f in self._fills if f.error is not None]

    def pending_fills(self) -> List[Fill]:
        """The background fills not known to have succeeded (not started yet, running, or
        failed): what a writer handed a request now must wait for and check."""
        self._fills = [f for f in self._fills if not f.done or f.error is not None]
        return list(self._fills)

    def filling(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of a snapshot whose fill has not finished (or not started)."""
        if not self._fills or tensor.device.type != "cpu":
            return False
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr in f.storages and not f.done for f in self._fills)

    def _new_set(self, layout: list) -> Optional[SnapshotSet]:
        """A new set of `layout`, kept, if the machine has room for it (else None, warned)."""
        try:
            self._check(sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout))
            self._check_fds(0 if self.background else 2 * len(layout))
            made = SnapshotSet(layout, by_name=self.background, register=self._register if self.device_fill else None,
                               unregister=self._unregister)
        except (host_memory.HostMemoryError, RuntimeError) as err:
            self._warn(str(err))
            return None
        if self.device_fill and not made.pinned and not self._warned_lock:
            logger.warning("megatron-offload: an asynchronous save's snapshots could not be page-locked (CUDA "
                           "error %s); they are filled on the host from the pinned buffer instead",
                           made.register_error)
            self._warned_lock = True
        self._sets.append(made)
        return made

    def _free_set(self, layout: list) -> Optional[SnapshotSet]:
        return next((s for s in self._sets if s.fits(layout) and not s.in_use()), None)

    @staticmethod
    def _pieces(targets: List[torch.Tensor], sources: List[torch.Tensor], as_fp32: List[Optional[Fp32]]) -> list:
        pieces = []
        for dst, src, fp32 in zip(targets, sources, as_fp32):
            scale = fp32.scale if fp32 is not None else None
            d, s = dst.view(-1), src.reshape(-1)
            step = max(1, COPY_PIECE_BYTES // dst.element_size())
            pieces += [(d[i:i + step], s[i:i + step], scale) for i in range(0, d.numel(), step)]
        return pieces

    def _warn(self, why: str) -> None:
        if not self._warned:
            logger.warning("megatron-offload: an asynchronous save reads the offloaded state from the pinned "
                           "buffer's views, which the checkpoint writer copies while training waits (%s)", why)
            self._warned = True

    def drop_free(self) -> None:
        """Drop the sets no pending save holds (the layout is about to change, and the pinned
        buffer the fills read with it)."""
        self.wait_filled()
        if _STORAGE_USE_COUNT is not None:
            self._keep(lambda s: s.in_use())

    def close(self) -> None:
        """Drop every set (their shared memory goes once no pending save holds it)."""
        self.wait_filled()
        self._keep(lambda s: False)
