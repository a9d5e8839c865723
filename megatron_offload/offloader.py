"""`OptimizerStateOffloader`: moves one DistributedOptimizer's state between GPU and pinned host memory.

The state is packed into chunks of about `chunk_bytes`: whole tensors, filled first-fit, copied
into one contiguous buffer per chunk and re-pointed there with `.data` (the tensor objects, and every
reference to them, stay the same). Freeing a chunk frees one large block, which the caching
allocator can hand to any activation up to that size; freeing many small per-tensor blocks instead
leaves holes that large activations cannot use, and *reserved* memory barely drops. Each chunk moves
through four states:

    RESIDENT ──start_copy_out()──▶ COPYING_OUT ──free()──▶ OFFLOADED ──start_copy_in()──▶ COPYING_IN
        ▲                              │ (GPU data still valid)                               │
        └──────────────── make_resident() (compute stream waits for the copy) ◀───────────────┘

* COPYING_OUT: a D2H copy is enqueued (or the host copy is already current); the GPU storage is
  still allocated and still correct, so readers between steps (checkpoint save, --log-params-norm)
  see resident data at no cost.
* OFFLOADED: the chunk buffer's storage is freed with `untyped_storage().resize_(0)`: the tensor
  *objects* (views into it) and every reference to them (`param.main_param`, the inner optimizer's
  param groups, `.grad` assignment in `prepare_grads`) stay valid, only their bytes are gone.
* COPYING_IN: storage re-allocated on the compute stream and an H2D copy enqueued.

Packing (discovery, chunk layout, re-pointing) is in packing.py, the checkpoint host-copy protocol
in host_copies.py and up-front state creation in materialize.py: mixins of this class over the state
set up in its `__init__`.

The offloader only performs transitions; *when* to perform them (memory budget, overlap with
forward/backward) is decided by `OffloadCoordinator`. It has no Megatron-training dependency and
works on CPU "devices" too (copies are then synchronous), which is how the CPU tests drive it.
"""

from __future__ import annotations

import itertools
import logging
from typing import List, Optional

import torch

from .chunks import DEFAULT_CHUNK_BYTES, Chunk, ChunkState
from .discovery import Discovery, StateTensor
from .host_buffer import PinnedHostBuffer
from .host_copies import HostCopies
from .materialize import StateMaterialization
from .packing import Packing
from .save_snapshot import SaveSnapshots
from .streams import CopyStreams

logger = logging.getLogger(__name__)
# Numbers every H2D enqueued by any offloader (`Chunk.copy_in_seq`): the order chunks arrive in.
_COPY_IN_SEQ = itertools.count(1)


class OptimizerStateOffloader(Packing, HostCopies, StateMaterialization):
    """Offloads the Adam moments and fp32 masters of one DistributedOptimizer.

    Args:
        dist_opt: a `megatron.core.optimizer.DistributedOptimizer` (or a duck-typed stand-in with
            `.optimizer`, `.shard_fp32_from_float16_groups`).
        streams: copy streams shared by every offloader of this device, so that several
            optimizers (dense + expert) queue their copies instead of fighting for the copy engine.
        chunk_bytes: granularity of freeing and reloading.
        name: for logs.
        copy_piece_bytes: split each chunk's copy into pieces of this size (0: one copy per chunk).
        by_parameter: pack the state tensors of a parameter into one chunk unless it is larger
            than half a chunk (the chunked step; chunks.layout_chunks).
        uniform_slots: give every chunk buffer the largest chunk's size, so that any freed chunk
            block takes any chunk (the per-step offload; packing.py). False: each chunk its own
            size (phase switches only, where the state comes back once and stays).
        fraction: share of the state bytes to offload (0 < fraction <= 1). The rest stays on the
            GPU untouched (not packed, never copied): whole tensors, the last ones in parameter
            order. Every byte costs the same to move and frees the same, so which ones stay is
            immaterial to the saving; the last ones keep the offloaded prefix contiguous.
    """

    def __init__(
        self,
        dist_opt,
        streams: CopyStreams,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        name: str = "optimizer",
        copy_piece_bytes: int = 0,
        fraction: float = 1.0,
        by_parameter: bool = False,
        uniform_slots: bool = True,
    ):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.fraction = float(fraction)
        self.by_parameter = by_parameter  # a parameter's state as one packing unit (`_units`)
        self.uniform_slots = uniform_slots
        self.kept: List[StateTensor] = []  # state tensors left resident by `fraction`
        # Buffers the kept tensors are packed into (never freed or copied out; `Packing._pack_kept`).
        self.kept_chunks: List[Chunk] = []
        self.dist_opt = dist_opt
        self.streams = streams
        self.chunk_bytes = int(chunk_bytes)
        self.copy_piece_bytes = int(copy_piece_bytes)
        self.name = name
        self.chunks: List[Chunk] = []
        self.host: Optional[PinnedHostBuffer] = None
        # (copy_feeder.py) when set, copy-outs are fed by its thread; a chunk it has
        # not enqueued yet has no `ready`, so `flush_copy_out` enqueues it first wherever one is needed.
        self.feeder = None
        self.snapshots = SaveSnapshots()  # for asynchronous saves (expose_host_copies); empty until one
        # (id(param), key) -> host_copies._Served: TE's 16-bit states that the inner optimizer's
        # `get_unscaled_state` serves from fp32 snapshots while on the host
        self._unscaled: dict = {}
        self.discovery = Discovery([], [])
        self.stats = streams.stats
        self._signature = None
        # Fills a parameter's state placeholders with the optimizer's own initial values
        # (TE FusedAdam's `initialize_state`; None: torch Adam's zeros). See `materialize_state`.
        self._initial_state = None

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

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state this offloader moves (chunk padding excluded)."""
        return sum(c.state_bytes for c in self.chunks)

    @property
    def pinned_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes

    def bytes_in(self, *states: ChunkState) -> int:
        """GPU bytes (chunk buffers, padding included) of the chunks in `states`."""
        return sum(c.gpu_nbytes for c in self.chunks if c.state in states)

    def chunks_in(self, *states: ChunkState) -> List[Chunk]:
        return [c for c in self.chunks if c.state in states]

    # ----------------------------------------------------------------------------------------
    # Transitions
    # ----------------------------------------------------------------------------------------
    def start_copy_out(self, chunks: Optional[List[Chunk]] = None) -> None:
        """RESIDENT -> COPYING_OUT for `chunks` (default: every RESIDENT chunk): enqueue the D2H of
        those whose host copy is stale. Does not free anything.

        Called on the host after the inner optimizer step was enqueued (the whole step: at the
        next forward; the chunked step: after each piece), or after a skipped step / checkpoint API.
        """
        if chunks is None:
            chunks = self.chunks_in(ChunkState.RESIDENT)
        assert all(c.state is ChunkState.RESIDENT for c in chunks), chunks
        # In the order the coordinator frees them (highest address first), so that the first
        # free waits for the first copy, not for the last.
        stale = sorted((c for c in chunks if not c.host_valid), key=lambda c: -c.address)
        for chunk in chunks:
            if chunk.host_valid:
                chunk.move_to(ChunkState.COPYING_OUT)
                chunk.ready = None
        if not stale:
            return
        # Why: these copies rewrite host copies that the background fill of an asynchronous
        # save's snapshots may still be reading (save_snapshot.py).
        self.snapshots.wait_filled()
        if self.feeder is not None:
            for chunk in stale:
                chunk.move_to(ChunkState.COPYING_OUT)
                chunk.host_valid = True  # (its D2H is fed in order; `ready` once it is enqueued)
            self.feeder.submit(self, stale)
            return
        s = self.streams
        with s.on_d2h() as stream:
            # Why: the D2H must read the state only after the compute stream has finished writing
            # it (the Adam step enqueued just before this call).
            s.d2h_wait_for_compute()
            timer = s.stats.start_copy(stream, "d2h")
            for chunk in stale:
                self._copy_pieces(chunk.host, chunk.packed)
                chunk.ready = s.record(stream)
                chunk.move_to(ChunkState.COPYING_OUT)
                chunk.host_valid = True
            s.stats.end_copy(timer, stream, sum(c.nbytes for c in stale))

    def flush_copy_out(self, chunks: Optional[List[Chunk]] = None) -> None:
        """Every copy-out of `chunks` (default: all) the feeder still holds, enqueued now: their
        `ready` events exist afterwards."""
        if self.feeder is not None:
            self.feeder.flush(self.chunks if chunks is None else chunks)

    def _copy_pieces(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One asynchronous copy per `copy_piece_bytes` (one per chunk by default). Smaller pieces
        let other work interleave on GPUs whose streams share one hardware queue
        (CUDA_DEVICE_MAX_CONNECTIONS=1); the bytes moved are the same."""
        step = self.copy_piece_bytes or dst.numel()
        for start in range(0, dst.numel(), step):
            dst[start : start + step].copy_(src[start : start + step], non_blocking=True)

    def copied_out(self, chunk: Chunk) -> bool:
        """Whether COPYING_OUT `chunk` can be freed with no stream waiting: its host copy is current
        and no piece of its D2H is still queued (feeder) or running (`ready`)."""
        if self.feeder is not None and self.feeder.pending(chunk):
            return False
        return chunk.ready is None or chunk.ready.query()

    def free(self, chunks: List[Chunk], host_waits: bool = False) -> int:
        """COPYING_OUT -> OFFLOADED: release the GPU storage of `chunks`. Returns bytes freed.

        host_waits: the host, too, waits for the copies still in flight (see
            `OffloadCoordinator._free_until` for why the forward's frees do)."""
        if not chunks:
            return 0
        self.flush_copy_out(chunks)
        s = self.streams
        pending = [c.ready for c in chunks if c.ready is not None]
        if pending and host_waits:
            for ev in pending:
                s.host_wait(ev)
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
            chunk.move_to(ChunkState.OFFLOADED)  # (checked before the storage goes)
            # Every state tensor of the chunk is a view of this storage.
            chunk.buffer.untyped_storage().resize_(0)
            chunk.ready = None
            freed += chunk.gpu_nbytes
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
                chunk.buffer.untyped_storage().resize_(chunk.gpu_nbytes)
                if chunk.on_host:  # a reader saw it on the host (expose_host_copies): back here
                    self._point_at(chunk, chunk.buffer)
                    self._off_host(chunk)
        with s.on_h2d() as stream:
            # Why: the new storage may be memory the compute stream freed a moment ago (on the
            # host) but whose last reader is still queued on the GPU.
            s.h2d_wait_for_compute()
            timer = s.stats.start_copy(stream, "h2d")
            for chunk in chunks:
                self._copy_pieces(chunk.packed, chunk.host)
                chunk.ready = s.record(stream)
                chunk.copy_in_seq = next(_COPY_IN_SEQ)
                chunk.move_to(ChunkState.COPYING_IN)
            s.stats.end_copy(timer, stream, sum(c.nbytes for c in chunks))
        return sum(c.gpu_nbytes for c in chunks)

    def make_resident(self, will_modify: bool, chunks: Optional[List[Chunk]] = None) -> None:
        """`chunks` (default: all) -> RESIDENT (or COPYING_OUT, see below), with the compute
        stream ordered after any copy of theirs in flight. Host never blocks.

        will_modify: the caller is about to write the state (the inner step, a checkpoint load).
            Then every chunk ends RESIDENT and its host copy is marked stale. Otherwise (a reader
            such as a checkpoint save) chunks whose host copy is current end COPYING_OUT, so that
            they can be freed again without another D2H.
        """
        if chunks is None:
            chunks = self.chunks
        for chunk in chunks:
            if chunk.on_host and chunk.state is not ChunkState.OFFLOADED:  # exposed in place (expose_host_copies)
                self._point_at(chunk, chunk.buffer)
                self._off_host(chunk)
        self.flush_copy_out(chunks)
        self.start_copy_in([c for c in chunks if c.state is ChunkState.OFFLOADED])
        s = self.streams
        pending = [c for c in chunks if c.ready is not None]
        if pending:
            # Why: COPYING_IN chunks are read by what follows (the Adam kernel, a checkpoint
            # writer); COPYING_OUT chunks are about to be *written* by the Adam step or a load
            # while the D2H may still be reading them.
            kinds = {c.state for c in pending}
            label = "h2d" if ChunkState.COPYING_IN in kinds else "d2h"
            with s.stats.exposed_wait(s.compute, label):
                for chunk in pending:
                    s.compute_wait(chunk.ready)
        for chunk in chunks:
            chunk.ready = None
            if will_modify:
                chunk.host_valid = False
            chunk.move_to(ChunkState.COPYING_OUT if chunk.host_valid else ChunkState.RESIDENT)

    def settle_unmodified(self) -> None:
        """After a step that did not run (inf/nan, grad-norm skip): the state is unchanged, so
        the host copy of every chunk that came back is still current. Chunks in flight back
        become COPYING_OUT (freed again without a D2H) once the compute stream is ordered after
        their copy; OFFLOADED chunks stay where they are."""
        incoming = self.chunks_in(ChunkState.COPYING_IN)
        if incoming:
            s = self.streams
            # Why: freeing them later hands their memory to compute-stream allocations, which
            # must run after the H2D that is still writing it.
            with s.stats.exposed_wait(s.compute, "h2d"):
                for chunk in incoming:
                    s.compute_wait(chunk.ready)
            for chunk in incoming:
                chunk.ready = None
                chunk.move_to(ChunkState.COPYING_OUT)
        self.start_copy_out()

    def close(self) -> None:
        """Bring everything back and release the pinned buffer (end of training, detaching)."""
        self.make_resident(will_modify=True)
        self.snapshots.close()  # (first: a background fill may still read the pinned buffer)
        if self.host is not None:
            if self.streams.compute is not None:
                self.streams.compute.synchronize()
            self.host.close()
            self.host = None
