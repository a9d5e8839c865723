"""Readers and writers of the optimizer state outside the step (checkpoint save and load, RL phase
switches, parameter reload) and the start-up offload. Methods of `OffloadCoordinator`; the
attributes they use are set in its `__init__`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time

from .chunks import ChunkState
from .offloader import OptimizerStateOffloader
from .phase import Phase

logger = logging.getLogger(__name__)


class Access(enum.Enum):
    """How one access in progress reaches the state (the coordinator's `_accesses` stack)."""

    HOST_READ = "host_read"  # reads what is off the GPU from the exposed host copies
    HOST_WRITE = "host_write"  # writes into the exposed host copies (a torch_dist load into torch Adam)
    GPU = "gpu"  # took the state back to the GPU first


class StateAccess:
    """Accesses run on the host copies where the caller accepts CPU tensors, else take the state
    back; nested accesses leave the state to the outermost."""

    def before_state_access(self, off: OptimizerStateOffloader, will_modify: bool,
                            host_copies_ok: bool = False, references_only: bool = False) -> None:
        """A reader or writer of `off`'s state outside the step is about to run. Accesses that
        accept CPU tensors (`host_copies_ok`), and any access nested in one, run on the host
        copies (`expose_host_copies`), so that no moment puts the state back on the GPU at once:
        a reader (a checkpoint save) sees what is off the GPU on the host; a writer (a torch_dist
        load) first sends everything out (`send_out_now`), then writes into the pinned buffer,
        where the optimizer writes in place (`OptimizerStateOffloader.host_writes_supported`).
        Other accesses get the state back.

        `references_only`: the access only collects references to the state tensors (a
        checkpoint save's `sharded_state_dict`), which an asynchronous save's writer reads later:
        the snapshots it is given may then fill in the background. Any other access nested in
        one waits for that fill first ([Note: background fill] in save_snapshot.py).

        Exception-safe: the access is recorded only once its preparation succeeded, so a failure
        here (e.g. an out-of-memory reload) leaves no access open; `state_access` pairs it with
        `after_state_access` whatever the access itself raises."""
        # Nesting is per offloader: an access inside another one to the same state follows it
        # (on the host inside a host access, on the GPU inside a GPU one); siblings (each
        # DistributedOptimizer of a chain) are independent.
        enclosing = [kind for o, kind in self._accesses if o is off]
        if enclosing and not references_only:
            # Why: it reads values, perhaps of snapshots an enclosing save is still filling.
            off.snapshots.wait_filled()
        on_host = (enclosing[-1] is not Access.GPU) if enclosing else host_copies_ok
        if on_host and not will_modify:
            kind = Access.HOST_READ
            started = time.perf_counter()
            if self.config.async_saves and not enclosing:
                # An asynchronous save hands GPU tensors to megatron-core's checkpoint worker by
                # CUDA IPC, and the worker holds them until its write is done, iterations later:
                # chunk buffers shared so could not be freed (nor their memory reused) meanwhile.
                # Everything leaves first; the save then reads host copies only (the D2H that a
                # save without the plugin makes the worker do while training waits), the large
                # ones from shared-memory snapshots that the worker maps without a copy.
                # Where those are filled from the GPU (every tensor a snapshot), nothing needs
                # to leave now: the copy-out starts, and the chunks stay until the next forward
                # frees them as after any step ([Note: device fill] in save_snapshot.py).
                if references_only and off.snapshots.device_fill:
                    self._start_copy_out_now(off)
                else:
                    self._send_out_now(off)
            off.expose_host_copies(for_async_writer=self.config.async_save_snapshots and not enclosing,
                                   references_only=references_only)
            self.host_read_seconds += time.perf_counter() - started
        elif on_host and self.config.host_loads and off.host_writes_supported():
            kind = Access.HOST_WRITE
            self._send_out_now(off)
            off.expose_host_copies(repoint=True)
            self._trace(f"host_write:{off.name}")
        else:
            kind = Access.GPU
            self._take_back(off, will_modify)
        self._suspended += 1
        self._accesses.append((off, kind))

    @property
    def snapshot_bytes(self) -> int:
        """Host bytes held in shared-memory snapshots for asynchronous saves (save_snapshot.py)."""
        return sum(off.snapshots.nbytes for off in self.offloaders)

    def pending_snapshot_fills(self) -> list:
        """The background snapshot fills (snapshot_fill.Fill) not known to have succeeded: a
        checkpoint writer handed a request now waits for them (`snapshot_fill.writer_waits`)."""
        return [fill for off in self.offloaders for fill in off.snapshots.pending_fills()]

    def snapshot_filling(self, tensor) -> bool:
        """Whether `tensor` is a view of a snapshot whose background fill has not finished (or not started)."""
        return any(off.snapshots.filling(tensor) for off in self.offloaders)

    def wait_snapshots_filled(self) -> None:
        """Block until every background snapshot fill has finished (never raises: save_snapshot)."""
        for off in self.offloaders:
            off.snapshots.wait_filled()

    @property
    def snapshot_fill_wait_seconds(self) -> float:
        """Host time spent waiting for background snapshot fills that had not finished, in all."""
        return sum((off.snapshots.fill_wait_seconds for off in self.offloaders), 0.0)

    @property
    def snapshot_collect_seconds(self) -> float:
        """Host time of the garbage collections snapshot takes ran to free a set, in all."""
        return sum((off.snapshots.collect_seconds for off in self.offloaders), 0.0)

    @property
    def open_state_accesses(self) -> tuple:
        """The state accesses in progress (`before_state_access` without its
        `after_state_access` yet), outermost first, as (offloader, `state_access.Access`) pairs.
        While any is open the step hooks stand aside (a checkpoint API's dummy step is no
        training step) and the next forward leaves host copies exposed; empty again once every
        access closed, whatever it raised."""
        return tuple(self._accesses)

    @property
    def pending_copy_out(self) -> tuple:
        """The offloaders whose state was stepped and whose copy-out is not enqueued yet (in the
        order of `offloaders`). Set by `optimizer_step_done`; emptied by the next `forward_begin`
        (or `start_pending_copy_out`), by a state access that takes the state back or writes
        it, and by `close`.
        Still set at the next `optimizer_step_done`: no forward reached the coordinator
        (`OffloadNotRunningError`)."""
        return tuple(self._copy_out_due)

    @contextlib.contextmanager
    def state_access(self, offloaders, will_modify: bool, host_copies_ok: bool = False,
                     references_only: bool = False):
        """`before_state_access` / `after_state_access` around a block, for each of `offloaders`.
        On any exception (in the preparation or the block) every access entered is closed again
        and the original exception propagates; a failure while closing is logged, never raised
        in its place."""
        entered = []
        try:
            for off in offloaders:
                self.before_state_access(off, will_modify=will_modify, host_copies_ok=host_copies_ok,
                                         references_only=references_only)
                entered.append(off)
            yield
        except BaseException:
            self._close_accesses(entered, will_modify, reraise=False)
            raise
        self._close_accesses(entered, will_modify, reraise=True)

    def _close_accesses(self, entered, modified: bool, reraise: bool) -> None:
        """Close every access in `entered` (last first), even when one of the closings fails;
        the first such failure is re-raised afterwards (`reraise`) or only logged (an error of
        the access itself is already propagating)."""
        first = None
        for off in reversed(entered):
            try:
                self.after_state_access(off, modified=modified)
            except Exception as err:  # noqa: BLE001
                if reraise and first is None:
                    first = err
                else:
                    logger.exception("megatron-offload: closing %s's state access failed", off.name)
        if first is not None:
            raise first

    def _send_out_now(self, off: OptimizerStateOffloader) -> None:
        """Every chunk of `off` OFFLOADED now (`send_out_now`); a copy-out owed since the step
        (stepped, still resident) is part of it."""
        if off in self._copy_out_due:
            self._copy_out_due.remove(off)
        off.send_out_now()

    def _start_copy_out_now(self, off: OptimizerStateOffloader) -> None:
        """Every chunk of `off` still on the GPU COPYING_OUT now, nothing freed (`settle_unmodified`):
        a copy-out owed since the step is enqueued now."""
        if off in self._copy_out_due:
            self._copy_out_due.remove(off)
        off.settle_unmodified()

    def _hide_host_copies(self) -> None:
        """A save that read state on the host (`before_state_access`) is done with the state
        tensors by the next forward (a synchronous save has written; an asynchronous one holds
        copies of the views it read, and the snapshots it read, which no one rewrites while it
        holds them: expose_host_copies), and so is a load that wrote there: the tensors still off
        the GPU point back at their GPU buffers before anything treats them as GPU tensors."""
        if self._accesses:
            return  # still inside a reader or writer
        for off in self.offloaders:
            if off.hide_host_copies():
                self._trace(f"host_copies_hidden:{off.name}")

    def _take_back(self, off: OptimizerStateOffloader, will_modify: bool) -> None:
        if off in self._copy_out_due:
            # Still resident and stepped; whoever takes it back sends it out again.
            self._copy_out_due.remove(off)
        off.make_resident(will_modify=will_modify)

    def offload_existing_state(self, materialize: bool = True) -> None:
        """Send out the state before the first forward: the fp32 masters (created with the
        optimizer), the moments when resuming, and with `materialize` the moments that torch
        Adam/AdamW would otherwise create lazily in the first step (identical zeros, step 0).
        Chunk by chunk: each is packed, copied out and freed before the next one is packed, so
        at most one chunk of packed state exists at a time (and the zeros of materialized
        moments are only ever created inside their chunk)."""
        try:
            for off in self.offloaders:
                self._take_back(off, will_modify=True)
                if materialize:
                    off.materialize_state()
                off.refresh(stream_out=True)
                self._announce()
        except BaseException:
            # E.g. pinning refused (host memory): detach completely, every tensor back on the GPU,
            # rather than leave hooks that would act on a half-packed state.
            self.close()
            raise
        if self.bytes_in(ChunkState.OFFLOADED):
            self.phase = Phase.OFFLOADED
            self._trace("offloaded")

    def release_startup_state(self) -> int:
        """Free whatever start-up left on the GPU and hand the cached memory back to the device,
        once, before the first forward: start-up created and freed the state chunk by chunk,
        and the allocator would keep those blocks (and the old per-tensor storages) in *reserved*
        memory for the whole run (every iteration's reserved memory then stays well above what
        it allocates; see [Note: start-up peak] in docs/design.md). Returns the bytes freed."""
        freed = self._free_until(0)
        self._hand_back_cached_memory()
        self._trace("startup_released")
        return freed

    def after_state_access(self, off: OptimizerStateOffloader, modified: bool) -> None:
        self._suspended -= 1
        opened, kind = self._accesses.pop()
        assert opened is off, (opened.name, off.name)  # accesses close in the order they nest
        if kind is Access.HOST_WRITE:
            # What it wrote is in the host copies, which stay exposed until the next forward
            # (dist-checkpointing fills a load template after `sharded_state_dict` returned).
            off.accept_host_writes()
            self.phase = Phase.FREEING if self._chunks(ChunkState.COPYING_OUT) else Phase.OFFLOADED
            return
        if any(o is off for o, _ in self._accesses):
            # Nested in another access to the same state (e.g. TE's `state_dict` inside a load's
            # `sharded_state_dict`): the state stays as it is until the outermost one closes,
            # which then re-discovers it if anything inside wrote.
            if modified:
                self._nested_writes.add(id(off))
            return
        if id(off) in self._nested_writes:
            self._nested_writes.discard(id(off))
            modified = True
        # A host reader leaves what was exposed on the host until the next forward (the save may
        # still read it: `_hide_host_copies`); what was resident is sent out as after any reader.
        if modified:
            # Tensors may have been created (dummy step) or replaced (load): find them again
            # and send the loaded values out.
            off.refresh()
            self._announce()
        off.start_copy_out()
        if self._chunks(ChunkState.COPYING_OUT):
            self.phase = Phase.FREEING
        elif (kind is Access.HOST_READ and self.config.async_saves and self.resident_bytes == 0
              and self.bytes_in(ChunkState.OFFLOADED)):
            self.phase = Phase.OFFLOADED  # (an asynchronous save sent everything out)
