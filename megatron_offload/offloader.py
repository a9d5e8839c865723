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

The offloader only performs transitions; *when* to perform them (memory budget, overlap with
forward/backward) is decided by `OffloadCoordinator`. It has no Megatron-training dependency and
works on CPU "devices" too (copies are then synchronous), which is how the CPU tests drive it.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

from .chunks import (DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, MIN_CHUNKS, Chunk, ChunkState, _first_fit, _unit_bytes,
                     _units, slot_bytes)
from .discovery import OFFLOADED_STATE_KEYS, Discovery, StateTensor, find_state_tensors, master_ids
from .host_buffer import PinnedHostBuffer
from .materialize import StateMaterialization
from .streams import CopyStreams

logger = logging.getLogger(__name__)


def _view(base: torch.Tensor, st: StateTensor, offset: int) -> torch.Tensor:
    """`st`'s bytes at `offset` of the uint8 tensor `base`, with its dtype and shape."""
    t = st.tensor
    return base[offset : offset + st.nbytes].view(t.dtype).view(t.shape)


class OptimizerStateOffloader(StateMaterialization):
    """Offloads the Adam moments and fp32 masters of one DistributedOptimizer.

    Args:
        dist_opt: a `megatron.core.optimizer.DistributedOptimizer` (or a duck-typed stand-in with
            `.optimizer`, `.shard_fp32_from_float16_groups`).
        streams: copy streams shared by every offloader of this device, so that several
            optimizers (dense + expert) queue their copies instead of fighting for the copy engine.
        chunk_bytes: granularity of freeing and reloading.
        name: for logs.
        copy_piece_bytes: split each chunk's copy into pieces of this size (0: one copy per chunk).
        by_parameter: pack all state tensors of a parameter into one chunk (the chunked step).
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
    ):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.fraction = float(fraction)
        self.by_parameter = by_parameter  # pack each parameter's state into one chunk (`_units`)
        self.kept: List[StateTensor] = []  # state tensors left resident by `fraction`
        self.dist_opt = dist_opt
        self.streams = streams
        self.chunk_bytes = int(chunk_bytes)
        self.copy_piece_bytes = int(copy_piece_bytes)
        self.name = name
        self.chunks: List[Chunk] = []
        self.host: Optional[PinnedHostBuffer] = None
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

    def refresh(self, stream_out: bool = False) -> None:
        """Re-discover the state tensors (after the first step or a load) and pack them into chunks.

        Only legal when every chunk is RESIDENT: the tensors are then all allocated and current.
        Costs one device copy of the state, once per discovery.

        stream_out: send each chunk to the host and free it as soon as it is packed, so that at
            most one chunk of packed state (and of the zeros that placeholders stand for, see
            `materialize_state`) exists at a time; all chunks end OFFLOADED. Costs a wait for
            each chunk's copy (start-up only). Otherwise all chunks end RESIDENT.
        """
        assert all(c.state is ChunkState.RESIDENT for c in self.chunks), self.chunks
        self.discovery = find_state_tensors(self.dist_opt, self.device)
        managed, self.kept = self._split_by_fraction(self.discovery.tensors)
        for st in self.kept:
            if st.owner is not None:
                # A placeholder the fraction keeps on the GPU: create its value there now.
                self._place(st, self._initial_value(st))
                continue
            # Packed by an earlier discovery (the split moves when tensors appear or are
            # replaced): a view into an old chunk buffer would keep all of that buffer alive.
            if st.tensor.untyped_storage().nbytes() > st.nbytes:
                st.tensor.data = st.tensor.detach().clone()
        # A parameter's state larger than `chunk_bytes` is a chunk of its own, and sets the slot size (see
        # below) that every chunk is padded to.
        units = _units(managed, self.by_parameter)
        total = sum(_unit_bytes(unit) for unit in units)
        chunk_bytes = min(self.chunk_bytes, max(MIN_CHUNK_BYTES, -(-total // MIN_CHUNKS)))
        largest = max([_unit_bytes(unit) for unit in units], default=0)
        target = max(chunk_bytes, largest)
        # Balanced: as many chunks as `target` needs, each about total / count, so that the last
        # one is not a small remainder padded up to the slot size (below). Up to 10 % of slack
        # until first fit manages with that count, else chunks of `target`.
        count = max(1, -(-total // target))
        per_chunk = -(-total // count)
        for size in [per_chunk * (100 + slack) // 100 for slack in range(11)] + [target]:
            layouts = _first_fit(units, max(largest, size))
            if len(layouts) <= count:
                break
        chunks = [Chunk(i, tensors, offsets, nbytes) for i, (tensors, offsets, nbytes) in enumerate(layouts)]
        # Every GPU buffer gets the size of the largest chunk (host copies stay exact). The caching
        # allocator never merges blocks of different segments: a chunk reloaded into the block
        # another, smaller chunk left behind leaves that one with no block of its size, and it
        # gets a new segment, i.e. *reserved* memory grows although allocated memory did not
        # (with two chunk sizes, a new segment at every reload; see [Note: one slot size] in
        # docs/design.md). With one slot size any freed chunk block takes any chunk.
        slot = slot_bytes(max((c.nbytes for c in chunks), default=0))
        for chunk in chunks:
            chunk.gpu_nbytes = slot
        # Pinned before anything is re-pointed: a refusal (host memory, `ulimit -l`) leaves every
        # chunk's GPU data as it was. Their old host copies are not needed (the GPU holds the
        # data), so the old buffer goes first, and the node never holds both.
        host_bytes = sum(c.nbytes for c in chunks)
        if self.host is None or self.host.nbytes != host_bytes:
            if self.host is not None:
                if self.device.type == "cuda":
                    # Why: a copy-out (the chunked step's) or reload may still be using the old
                    # buffer; unpinning and unmapping it under a DMA would corrupt or fault.
                    torch.cuda.synchronize(self.device)
                self.host.close()
                self.host = None
                for old in self.chunks:
                    old.host = None
            try:
                self.host = PinnedHostBuffer(host_bytes, pin=self.device.type == "cuda")
            except Exception:
                # Leave no placeholder behind: drop the state of every parameter that has one, so
                # that the optimizer creates it lazily in its first step, with the same values
                # (filling them here would allocate the whole state inside an error handler).
                inner = self.dist_opt.optimizer
                for p, state in list(inner.state.items()):
                    if any(isinstance(v, torch.Tensor) and v.is_meta for v in state.values()):
                        del inner.state[p]
                raise
        # The previous chunk buffers are released once every tensor in them has been re-pointed
        # into a new chunk (below), except one whose storage a kept tensor still is.
        kept_storages = {st.tensor.untyped_storage()._cdata for st in self.kept}
        retired = [old.buffer for old in self.chunks
                   if old.buffer is not None and old.buffer.untyped_storage()._cdata not in kept_storages]
        for old in self.chunks:
            old.buffer = old.host = None
        self.chunks = chunks
        base = 0
        for chunk in chunks:
            with self.streams.on_compute():
                self._pack(chunk)
            chunk.host = self.host.view(base, chunk.packed)
            base += chunk.nbytes
            if stream_out:
                self.start_copy_out([chunk])
                # The next chunk is allocated on the compute stream, which `free` orders after
                # this chunk's copy: it may take this chunk's block.
                self.free([chunk])
                if self.device.type == "cuda":
                    # Why: `empty_cache` below may unmap that block, which the copy may still
                    # be reading (start-up only: one wait per chunk).
                    self.streams.compute.synchronize()
            if self.device.type == "cuda":
                # The chunk's old storages are free now but cached as separate segments that
                # large activations (and the next chunk) cannot use. Returning them chunk by
                # chunk bounds the packing transient to one chunk instead of the whole state.
                # Runs once per discovery (start, first step, loads), never per step.
                torch.cuda.empty_cache()
        # Release them explicitly rather than when the last Python reference goes: on a GPU the
        # old buffers stayed allocated after every state tensor had been re-pointed (the whole
        # state a second time; see [Note: retired chunk buffers] in docs/design.md); the holder
        # was not identified. Nothing of ours reads them any more; the compute stream
        # orders the packing copies that read them before any reuse of the blocks.
        for buffer in retired:
            buffer.untyped_storage().resize_(0)
        self._signature = self.state_signature()
        if self.discovery.resident_other:
            logger.warning(
                "megatron-offload: %s keeps unknown state tensors on the GPU: %s",
                self.name,
                ", ".join(self.discovery.resident_other[:5]),
            )

    def _split_by_fraction(self, tensors: List[StateTensor]):
        """(offloaded, kept): a parameter-order prefix of the state tensors (of whole parameters
        with `by_parameter`) holding at most `fraction` of the bytes."""
        if self.fraction >= 1.0:
            return list(tensors), []
        budget = self.fraction * sum(st.nbytes for st in tensors)
        taken, offloaded = 0, []
        units = _units(tensors, self.by_parameter)
        for i, unit in enumerate(units):
            size = sum(st.nbytes for st in unit)
            if taken + size > budget:
                return offloaded, [st for rest in units[i:] for st in rest]
            taken += size
            offloaded.extend(unit)
        return offloaded, []

    @property
    def kept_bytes(self) -> int:
        """State bytes that `fraction` leaves on the GPU."""
        return sum(st.nbytes for st in self.kept)

    def _pack(self, chunk: Chunk) -> None:
        """Copy the chunk's tensors into one new buffer and point them there."""
        chunk.buffer = torch.empty(chunk.gpu_nbytes, dtype=torch.uint8, device=self.device)
        for st, offset in zip(chunk.tensors, chunk.offsets):
            t = st.tensor
            view = _view(chunk.buffer, st, offset)
            if st.owner is not None:
                current = st.owner[st.key]
                if current.is_meta and self._initial_state is None:
                    view.zero_()  # torch Adam's zeros, created in place
                else:
                    view.copy_(self._initial_value(st))
                self._place(st, view)
                continue
            view.copy_(t.detach())
            # `.data` keeps the object (a Parameter stays a Parameter, every alias stays valid);
            # the old storage is released once nothing else refers to it. A tensor that was a view
            # into someone else's storage no longer is: freeing the chunk cannot touch neighbours.
            t.data = view

    @staticmethod
    def _point_at(chunk: Chunk, base: torch.Tensor) -> None:
        """Point every state tensor of `chunk` at its bytes in `base` (the GPU buffer or the host
        copy). `.data` keeps each object, so every reference to it follows."""
        for st, offset in zip(chunk.tensors, chunk.offsets):
            st.tensor.data = _view(base, st, offset)

    def expose_host_copies(self) -> int:
        """Let readers see OFFLOADED state where it is, on the host: point those chunks' tensors
        at their host copies (CPU views of the pinned buffer) instead of bringing them back. A
        checkpoint save then needs no GPU memory and no H2D for them. The tensors stay there
        until the next forward (`hide_host_copies`) or reload (`start_copy_in`), so a save that
        reads them after the reader returned (dist-checkpointing writes after
        `sharded_state_dict`) still finds them. Returns the number of chunks exposed."""
        chunks = [c for c in self.chunks_in(ChunkState.OFFLOADED) if not c.on_host]
        if not chunks:
            return 0
        if self.device.type == "cuda":
            # Why: the host is about to read the copies itself. The compute stream waited for
            # them before the chunks were freed; the host never did.
            self.streams.d2h.synchronize()
        for chunk in chunks:
            # The GPU views (of the freed, zero-size storage) cannot be sliced anew until the
            # storage is re-allocated: keep them for `hide_host_copies`.
            chunk.gpu_views = [st.tensor.data for st in chunk.tensors]
            self._point_at(chunk, chunk.host)
            chunk.on_host = True
        return len(chunks)

    def host_writes_supported(self) -> bool:
        """Whether a writer of the whole state (a torch_dist checkpoint load) can run
        on the host copies (`expose_host_copies`) and leave the tensors it wrote where they are.

        That holds where the writer writes into the state tensors rather than replacing them, and
        keeps them where they are: torch Adam/AdamW (the optimizer megatron-core uses without TE
        or Apex), whose `load_state_dict` moves each state tensor to its parameter's device and
        dtype, i.e. keeps ours if the parameter is a master that is on the host too. So: every
        offloaded moment belongs to an offloaded master (not to an fp32 model parameter, which
        stays on the GPU), nothing is kept resident by `fraction`, no fused/capturable Adam (their
        `step` follows the parameter's device). TE FusedAdam rebuilds its state on load: no."""
        inner = getattr(self.dist_opt, "optimizer", None)
        if inner is None or type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            return False
        if self.kept or not self.chunks:
            return False
        if any(group.get("fused") or group.get("capturable") for group in inner.param_groups):
            return False
        masters = master_ids(self.dist_opt)  # (all offloaded: nothing is kept)
        return all(id(st.param) in masters for c in self.chunks for st in c.tensors)

    def send_out_now(self) -> None:
        """Every chunk OFFLOADED with a current host copy, without allocating on the GPU: the
        chunks still resident are copied out if their host copy is stale and freed, those coming
        back (their host copy is what they load) are freed once their H2D is done. The host does
        not wait here; `expose_host_copies` does."""
        self.settle_unmodified()  # COPYING_IN / RESIDENT -> COPYING_OUT, D2H where stale
        self.free(self.chunks_in(ChunkState.COPYING_OUT))

    def accept_host_writes(self) -> None:
        """A writer has run on the exposed host copies (`host_writes_supported`): what it wrote
        is in the pinned buffer, which is now the state. The chunks stay OFFLOADED; their host
        copies are current, so the next reload brings the written values and no D2H is owed."""
        if not self._state_tensors_unchanged():
            raise RuntimeError(
                f"megatron-offload: a writer of {self.name}'s optimizer state replaced state tensors "
                "while they were on the host; the state cannot be trusted. Please report this with "
                "your optimizer configuration.")
        for chunk in self.chunks:
            assert chunk.state is ChunkState.OFFLOADED and chunk.on_host, chunk
            chunk.host_valid = True
        self._signature = self.state_signature()

    def _state_tensors_unchanged(self) -> bool:
        """Whether the inner optimizer holds exactly the state tensors we packed (same objects)."""
        inner = self.dist_opt.optimizer
        masters = master_ids(self.dist_opt)
        current = set()
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) in masters:
                    current.add(id(p))
                for key, value in inner.state.get(p, {}).items():
                    if key in OFFLOADED_STATE_KEYS and isinstance(value, torch.Tensor):
                        current.add(id(value))
        return current == {id(st.tensor) for c in self.chunks for st in c.tensors}

    def hide_host_copies(self) -> int:
        """Undo `expose_host_copies` for chunks still OFFLOADED: point their tensors back at the
        (freed) GPU buffer. Called once the reader is certainly done (the next forward), because
        code outside the step treats the state as GPU tensors even while its storage is freed:
        `DistributedOptimizer.step` assigns each master its `.grad` (a CUDA tensor) before the
        inner step reloads it, which fails on a CPU view (the first step after a save, with a
        chunked step whose budget leaves chunks off; see [Note: host views and .grad] in
        docs/design.md). Returns the number of chunks hidden."""
        chunks = [c for c in self.chunks_in(ChunkState.OFFLOADED) if c.on_host]
        for chunk in chunks:
            for st, view in zip(chunk.tensors, chunk.gpu_views):
                st.tensor.data = view
            chunk.gpu_views = None
            chunk.on_host = False
        return len(chunks)

    @staticmethod
    def _place(st: StateTensor, tensor: torch.Tensor) -> None:
        """Replace a placeholder by `tensor` in its state dict (nothing else refers to it)."""
        st.owner[st.key] = tensor
        st.tensor, st.owner, st.key = tensor, None, None

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

    def _copy_pieces(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One asynchronous copy per `copy_piece_bytes` (one per chunk by default). Smaller pieces
        let other work interleave on GPUs whose streams share one hardware queue
        (CUDA_DEVICE_MAX_CONNECTIONS=1); the bytes moved are the same."""
        step = self.copy_piece_bytes or dst.numel()
        for start in range(0, dst.numel(), step):
            dst[start : start + step].copy_(src[start : start + step], non_blocking=True)

    def free(self, chunks: List[Chunk], host_waits: bool = False) -> int:
        """COPYING_OUT -> OFFLOADED: release the GPU storage of `chunks`. Returns bytes freed.

        host_waits: the host, too, waits for the copies still in flight (see
            `OffloadCoordinator._free_until` for why the forward's frees do)."""
        if not chunks:
            return 0
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
                    chunk.gpu_views = None
                    chunk.on_host = False
        with s.on_h2d() as stream:
            # Why: the new storage may be memory the compute stream freed a moment ago (on the
            # host) but whose last reader is still queued on the GPU.
            s.h2d_wait_for_compute()
            timer = s.stats.start_copy(stream, "h2d")
            for chunk in chunks:
                self._copy_pieces(chunk.packed, chunk.host)
                chunk.ready = s.record(stream)
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
        if self.host is not None:
            if self.streams.compute is not None:
                self.streams.compute.synchronize()
            self.host.close()
            self.host = None
