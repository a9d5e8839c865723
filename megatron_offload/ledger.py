"""The coordinator's ledger of all chunks of all its offloaders: bytes by state, and the one-line
reports of what is under management. Methods of `OffloadCoordinator`.
"""

from __future__ import annotations

import torch

from . import host_memory
from .chunks import ChunkState
from .streams import TransferTotals


class Ledger:
    """Byte accounting over every chunk, and reporting."""

    def _chunks(self, *states: ChunkState):
        return [(off, c) for off in self.offloaders for c in off.chunks if c.state in states]

    def bytes_in(self, *states: ChunkState) -> int:
        return sum(off.bytes_in(*states) for off in self.offloaders)

    @property
    def state_bytes(self) -> int:
        """Optimizer-state bytes under management (what leaves the GPU)."""
        return sum(off.state_bytes for off in self.offloaders)

    @property
    def resident_bytes(self) -> int:
        """GPU bytes of the chunk buffers allocated now: every chunk but the OFFLOADED ones
        (a chunk copying out holds its buffer until it is freed). At most `gpu_bytes`."""
        return self.bytes_in(ChunkState.RESIDENT, ChunkState.COPYING_IN, ChunkState.COPYING_OUT)

    @property
    def gpu_bytes(self) -> int:
        """GPU bytes of all chunk buffers (state plus alignment and slot padding)."""
        return self.bytes_in(*ChunkState)

    @property
    def pinned_bytes(self) -> int:
        return sum(off.pinned_bytes for off in self.offloaders)

    def _announce(self) -> None:
        """One line per rank whenever the amount under management changes (masters at start,
        moments after the first step, new tensors after a load)."""
        if self.state_bytes and self.state_bytes != self._announced_bytes:
            self._announced_bytes = self.state_bytes
            self._announce_fn(self.describe())

    def describe(self) -> str:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        masters = sum(
            st.nbytes
            for off in self.offloaders
            for c in off.chunks
            for st in c.tensors
            if st.name.endswith((".master", ".master_param"))
        )
        kept = sum(off.kept_bytes for off in self.offloaders)
        # The chunks' GPU buffer sizes: packing balances and rounds the requested size and never
        # splits a state tensor (chunks.layout_chunks), so the size used can differ from the one
        # asked for. One size per run where the buffers are padded
        # to the largest chunk (per-step offloading); else the largest, "up to".
        sizes = {c.gpu_nbytes for off in self.offloaders for c in off.chunks}
        slot = max(sizes, default=0)
        pinning = sorted({off.host.pinning for off in self.offloaders if off.host is not None})
        return (
            f"rank {rank}: offloading {self.state_bytes / 2**30:.3f} GiB of optimizer state "
            f"(masters {masters / 2**30:.3f} GiB, moments {(self.state_bytes - masters) / 2**30:.3f}"
            f" GiB) from {len(self.offloaders)} optimizer(s) in "
            f"{sum(len(o.chunks) for o in self.offloaders)} chunks of {'up to ' if len(sizes) > 1 else ''}"
            f"{slot / 2**20:.0f} MiB; pinned host "
            f"{self.pinned_bytes / 2**30:.3f} GiB ({', '.join(pinning) or 'none'})"
            + (f"; {kept / 2**30:.3f} GiB kept on the GPU (--offload-state-fraction "
               f"{self.state_fraction:g})" if kept else "")
            + f"; host memory now: {host_memory.read().describe()}"
        )

    def harvest(self) -> TransferTotals:
        return self.streams.stats.harvest()
