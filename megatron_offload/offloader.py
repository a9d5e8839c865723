"""`OptimizerStateOffloader`: moves one DistributedOptimizer's state between GPU and pinned host memory.

The state is split into chunks of about `chunk_bytes` (whole tensors, in parameter order). Each chunk
moves through four states:

    RESIDENT ──start_copy_out()──▶ COPYING_OUT ──free()──▶ OFFLOADED ──start_copy_in()──▶ COPYING_IN
        ▲                              │ (GPU data still valid)                               │
        └──────────────── make_resident() (compute stream waits for the copy) ◀───────────────┘

* COPYING_OUT: a D2H copy is enqueued (or the host copy is already current); the GPU storage is
  still allocated and still correct, so readers between steps (checkpoint save, --log-params-norm)
  see resident data at no cost.
* OFFLOADED: the GPU storage is freed with `untyped_storage().resize_(0)`: the tensor *objects*
  (and every reference to them: `param.main_param`, the inner optimizer's param groups, `.grad`
  assignment in `prepare_grads`) stay valid, only their bytes are gone.
* COPYING_IN: storage re-allocated on the compute stream and an H2D copy enqueued.

The offloader only performs transitions; *when* to perform them (memory budget, overlap with
forward/backward) is decided by `OffloadCoordinator`. It has no Megatron-training dependency and
works on CPU "devices" too (copies are then synchronous), which is how the CPU tests drive it.
"""

from __future__ import annotations

import enum
import logging
from typing import List, Optional

import torch

from .discovery import Discovery, StateTensor, find_state_tensors
from .host_buffer import PinnedHostBuffer, align_up
from .streams import CopyStreams, TransferStats

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 128 * 2**20


class ChunkState(enum.Enum):
    RESIDENT = "resident"
    COPYING_OUT = "copying_out"
    OFFLOADED = "offloaded"
    COPYING_IN = "copying_in"


class Chunk:
    """Whole state tensors, adjacent in parameter order, moved and freed together."""

    def __init__(self, index: int, tensors: List[StateTensor], host_offsets: List[int]):
        self.index = index
        self.tensors = tensors
        self.host_offsets = host_offsets
        self.host_views: List[torch.Tensor] = []
        self.nbytes = sum(t.nbytes for t in tensors)
        self.state = ChunkState.RESIDENT
        # The copy that must finish before the GPU storage may be freed (COPYING_OUT) or read
        # (COPYING_IN). None when no copy is in flight.
        self.ready: Optional[torch.cuda.Event] = None

    def __repr__(self):
        return f"Chunk({self.index}, {self.nbytes} B, {self.state.value})"


class OptimizerStateOffloader:
    """Offloads the Adam moments and fp32 masters of one DistributedOptimizer.

    Args:
        dist_opt: a `megatron.core.optimizer.DistributedOptimizer` (or a duck-typed stand-in with
            `.optimizer`, `.shard_fp32_from_float16_groups`).
        streams: copy streams shared by every offloader of this device, so that several
            optimizers (dense + expert) queue their copies instead of fighting for the copy engine.
        chunk_bytes: granularity of freeing and reloading.
        name: for logs.
    """

    def __init__(
        self,
        dist_opt,
        streams: CopyStreams,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        name: str = "optimizer",
    ):
        self.dist_opt = dist_opt
        self.streams = streams
        self.chunk_bytes = int(chunk_bytes)
        self.name = name
        self.chunks: List[Chunk] = []
        self.host: Optional[PinnedHostBuffer] = None
        self.discovery = Discovery([], [])
        # True while the host copy equals the GPU state (set when a D2H is enqueued; cleared when
        # anything may write the GPU state: the inner step, a checkpoint load).
        self.host_valid = False
        self.stats = streams.stats
        self._signature = None

    def state_signature(self):
        """Cheap fingerprint of the inner optimizer's state layout: changes when the first step
        creates the moments lazily, or when a load replaces the state dicts."""
        inner = getattr(self.dist_opt, "optimizer", None)
        if inner is None or getattr(self.dist_opt, "is_stub_optimizer", False):
            return None
        return (len(inner.state), sum(len(v) for v in inner.state.values()),
                tuple(id(v) for v in list(inner.state.values())[:1]))

    @property
    def needs_refresh(self) -> bool:
        return self.state_signature() != self._signature

    # ----------------------------------------------------------------------------------------
    # Discovery
    # ----------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.streams.device

    def refresh(self) -> None:
        """Re-discover the state tensors (after the first step or a load) and rebuild the chunks.

        Only legal when every chunk is RESIDENT: the tensors are then all allocated and current.
        """
        assert all(c.state is ChunkState.RESIDENT for c in self.chunks), self.chunks
        self.discovery = find_state_tensors(self.dist_opt, self.device)
        chunks: List[Chunk] = []
        current: List[StateTensor] = []
        offsets: List[int] = []
        host_bytes = 0
        for st in self.discovery.tensors:
            current.append(st)
            offsets.append(host_bytes)
            host_bytes += align_up(st.nbytes)
            if sum(t.nbytes for t in current) >= self.chunk_bytes:
                chunks.append(Chunk(len(chunks), current, offsets))
                current, offsets = [], []
        if current:
            chunks.append(Chunk(len(chunks), current, offsets))
        if self.host is None or self.host.nbytes != host_bytes:
            if self.host is not None:
                self.host.close()
            self.host = PinnedHostBuffer(host_bytes, pin=self.device.type == "cuda")
        for chunk in chunks:
            chunk.host_views = [
                self.host.view(off, st.tensor) for off, st in zip(chunk.host_offsets, chunk.tensors)
            ]
        self.chunks = chunks
        self.host_valid = False
        self._signature = self.state_signature()
        if self.discovery.resident_other:
            logger.warning(
                "megatron-offload: %s keeps unknown state tensors on the GPU: %s",
                self.name,
                ", ".join(self.discovery.resident_other[:5]),
            )

    @property
    def state_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def pinned_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes

    def bytes_in(self, *states: ChunkState) -> int:
        return sum(c.nbytes for c in self.chunks if c.state in states)

    def chunks_in(self, *states: ChunkState) -> List[Chunk]:
        return [c for c in self.chunks if c.state in states]

    # ----------------------------------------------------------------------------------------
    # Transitions
    # ----------------------------------------------------------------------------------------
    def start_copy_out(self) -> None:
        """RESIDENT -> COPYING_OUT for every chunk: enqueue the D2H unless the host copy is current.

        Called on the host right after the inner optimizer step was enqueued (or after a skipped
        step / a checkpoint API). Does not free anything.
        """
        resident = self.chunks_in(ChunkState.RESIDENT)
        if not resident:
            return
        if self.host_valid:
            for chunk in resident:
                chunk.state = ChunkState.COPYING_OUT
                chunk.ready = None
            return
        s = self.streams
        with s.on_d2h() as stream:
            # Why: the D2H must read the state only after the compute stream has finished writing
            # it (the Adam step enqueued just before this call).
            s.d2h_wait_for_compute()
            timer = s.stats.start_copy(stream, "d2h")
            for chunk in resident:
                for st, host in zip(chunk.tensors, chunk.host_views):
                    host.copy_(st.tensor.detach(), non_blocking=True)
                chunk.ready = s.record(stream)
                chunk.state = ChunkState.COPYING_OUT
            s.stats.end_copy(timer, stream, sum(c.nbytes for c in resident))
        self.host_valid = True

    def free(self, chunks: List[Chunk]) -> int:
        """COPYING_OUT -> OFFLOADED: release the GPU storage of `chunks`. Returns bytes freed."""
        if not chunks:
            return 0
        s = self.streams
        pending = [c.ready for c in chunks if c.ready is not None]
        if pending:
            # Why: the allocator hands a freed block to the very next compute-stream allocation,
            # while the copy stream may still be reading it for the host copy. Holding the compute
            # stream at the copy's event makes every later kernel that could touch the reused
            # memory run after the copy. (D2H copies run in order on one stream, so the last
            # event covers the earlier ones; we still wait on each, it is free on the host.)
            with s.stats.exposed_wait(s.compute, "d2h"):
                for ev in pending:
                    s.compute_wait(ev)
        freed = 0
        for chunk in chunks:
            assert chunk.state is ChunkState.COPYING_OUT, chunk
            for st in chunk.tensors:
                st.tensor.untyped_storage().resize_(0)
            chunk.state = ChunkState.OFFLOADED
            chunk.ready = None
            freed += chunk.nbytes
        return freed

    def start_copy_in(self, chunks: List[Chunk]) -> int:
        """OFFLOADED -> COPYING_IN: re-allocate on the compute stream and enqueue the H2D."""
        if not chunks:
            return 0
        s = self.streams
        with s.on_compute():
            # Allocate on the compute stream: the caching allocator may return memory that kernels
            # already enqueued there (e.g. the backward) are still using; the event below orders
            # our writes after them.
            for chunk in chunks:
                assert chunk.state is ChunkState.OFFLOADED, chunk
                for st in chunk.tensors:
                    st.tensor.untyped_storage().resize_(st.nbytes)
        with s.on_h2d() as stream:
            # Why: the new storage may be memory the compute stream freed a moment ago (on the
            # host) but whose last reader is still queued on the GPU.
            s.h2d_wait_for_compute()
            timer = s.stats.start_copy(stream, "h2d")
            for chunk in chunks:
                for st, host in zip(chunk.tensors, chunk.host_views):
                    st.tensor.detach().copy_(host, non_blocking=True)
                chunk.ready = s.record(stream)
                chunk.state = ChunkState.COPYING_IN
            s.stats.end_copy(timer, stream, sum(c.nbytes for c in chunks))
        return sum(c.nbytes for c in chunks)

    def make_resident(self, will_modify: bool) -> None:
        """Every chunk -> RESIDENT (or COPYING_OUT, see below), with the compute stream ordered
        after any copy in flight. Host never blocks.

        will_modify: the caller is about to write the state (the inner step, a checkpoint load).
            Then every chunk ends RESIDENT and the host copy is marked stale. Otherwise (a reader
            such as a checkpoint save) chunks whose host copy is current end COPYING_OUT, so that
            they can be freed again without another D2H.
        """
        self.start_copy_in(self.chunks_in(ChunkState.OFFLOADED))
        s = self.streams
        pending = [c for c in self.chunks if c.ready is not None]
        if pending:
            # Why: COPYING_IN chunks are read by what follows (the Adam kernel, a checkpoint
            # writer); COPYING_OUT chunks are about to be *written* by the Adam step or a load
            # while the D2H may still be reading them.
            kinds = {c.state for c in pending}
            label = "h2d" if ChunkState.COPYING_IN in kinds else "d2h"
            with s.stats.exposed_wait(s.compute, label):
                for chunk in pending:
                    s.compute_wait(chunk.ready)
        for chunk in self.chunks:
            chunk.ready = None
            if will_modify or not self.host_valid:
                chunk.state = ChunkState.RESIDENT
            else:
                chunk.state = ChunkState.COPYING_OUT
        if will_modify:
            self.host_valid = False

    def close(self) -> None:
        """Bring everything back and release the pinned buffer (end of training, detaching)."""
        self.make_resident(will_modify=True)
        if self.host is not None:
            if self.streams.compute is not None:
                self.streams.compute.synchronize()
            self.host.close()
            self.host = None
