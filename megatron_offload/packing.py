"""Packing of `OptimizerStateOffloader` (a mixin over its state): discover the state tensors, lay
them out in chunks (chunks.py), copy each chunk's tensors into one buffer and re-point them there.
"""

from __future__ import annotations

import logging
from typing import List

import torch

from .chunks import (MIN_CHUNK_BYTES, MIN_CHUNKS, Chunk, ChunkState, _first_fit, _unit_bytes, _units, layout_chunks,
                     slot_bytes)
from .discovery import StateTensor, find_state_tensors
from .host_buffer import PinnedHostBuffer, align_up

logger = logging.getLogger("megatron_offload.offloader")


def _view(base: torch.Tensor, st: StateTensor, offset: int) -> torch.Tensor:
    """`st`'s bytes at `offset` of the uint8 tensor `base`, with its dtype and shape."""
    t = st.tensor
    return base[offset : offset + st.nbytes].view(t.dtype).view(t.shape)


class Packing:
    """Discovery and packing of the state into chunks (module docstring)."""

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
        # The snapshot sets of the old layout go before the new buffer is pinned (save_snapshot).
        self.snapshots.drop_free()
        self.discovery = find_state_tensors(self.dist_opt, self.device)
        managed, kept = self._split_by_fraction(self.discovery.tensors)
        units = _units(managed, self.by_parameter)
        layouts = layout_chunks(units, self._chunk_bytes_for(sum(_unit_bytes(unit) for unit in units)))
        chunks = [Chunk(i, tensors, offsets, nbytes) for i, (tensors, offsets, nbytes) in enumerate(layouts)]
        # Every GPU buffer gets the size of the largest chunk (host copies stay exact). The caching
        # allocator never merges blocks of different segments: a chunk reloaded into the block
        # another, smaller chunk left behind leaves that one with no block of its size, and it
        # gets a new segment, i.e. *reserved* memory grows although allocated memory did not
        # (with two chunk sizes, a new segment at every reload; see [Note: one slot size] in
        # docs/design.md). With one slot size any freed chunk block takes any chunk.
        # Phase switches alone (no per-step frees and reloads) bring the state back once and keep
        # it: padding would only hold GPU memory (`uniform_slots`).
        slot = slot_bytes(max((c.nbytes for c in chunks), default=0))
        for chunk in chunks:
            chunk.gpu_nbytes = slot if self.uniform_slots else align_up(chunk.nbytes, 512)
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
        # The previous chunk buffers (kept ones included) are released once every tensor in them
        # has been re-pointed into a new one (below).
        retired = [old.buffer for old in self.chunks + self.kept_chunks if old.buffer is not None]
        self.kept = kept  # (only now: a refused pin above leaves the old split with the old chunks)
        self._pack_kept()
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
        if self.snapshots.enabled:
            # Why: the first asynchronous save of this layout would otherwise wait for the
            # set's pages to be faulted in.
            self.prepare_snapshots()
        if self.discovery.resident_other:
            logger.warning(
                "megatron-offload: %s keeps unknown state tensors on the GPU: %s",
                self.name,
                ", ".join(self.discovery.resident_other[:5]),
            )

    def _pack_kept(self) -> None:
        """Pack the tensors that `fraction` keeps on the GPU into buffers sized like chunks (from
        the kept bytes, as `refresh` sizes chunks from the offloaded ones), one at a time; they
        are never freed or copied out.

        Why not leave them where the optimizer (or an earlier packing) put them: about three
        allocator blocks per parameter, each walked by the allocator snapshot behind `_fitting` on
        every call (several times the snapshot's cost with the whole state in chunks; see [Note:
        allocator query cost] in docs/design.md). A tensor packed before by an earlier discovery
        must not stay a view into an old chunk buffer either (it would keep all of that buffer
        alive)."""
        units = _units(self.kept, self.by_parameter)
        chunk_bytes = self._chunk_bytes_for(sum(_unit_bytes(unit) for unit in units))
        layouts = _first_fit(units, chunk_bytes)
        self.kept_chunks = [Chunk(-1 - i, tensors, offsets, nbytes)
                            for i, (tensors, offsets, nbytes) in enumerate(layouts)]
        for chunk in self.kept_chunks:
            chunk.gpu_nbytes = align_up(chunk.nbytes, 512)
            with self.streams.on_compute():
                self._pack(chunk)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # (as for the chunks below: bounds the transient to one)

    def _chunk_bytes_for(self, total: int) -> int:
        """Chunk size for `total` packed bytes: `chunk_bytes`, but at least MIN_CHUNKS chunks for
        a small state (not below MIN_CHUNK_BYTES; see [Note: small states] in docs/design.md)."""
        return min(self.chunk_bytes, max(MIN_CHUNK_BYTES, -(-total // MIN_CHUNKS)))

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
