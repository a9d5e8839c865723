"""Chunks: how state tensors are packed into contiguous buffers (the layout, pure functions of
tensor sizes), and the states a chunk moves through, with the one table of legal moves.

A chunk is whole state tensors packed into one buffer and moved together; every chunk's GPU buffer
has the offloader's common slot size.
"""

from __future__ import annotations

import enum
from typing import List, Optional

import torch

from .discovery import StateTensor
from .host_buffer import align_up

# Small enough for the free blocks that long-lived allocations leave between the activations (see
# [Note: chunk layout] in docs/design.md).
DEFAULT_CHUNK_BYTES = 256 * 2**20
# Tensors start on this boundary inside a chunk buffer (vectorised kernels want >= 16 bytes).
TENSOR_ALIGNMENT = 256
# The caching allocator rounds requests of 10 MiB and more up to 2 MiB (smaller ones to 512 B);
# chunk slots use the same granularity.
SLOT_ALIGNMENT = 2 * 2**20
# Slots of 256 MiB and more are rounded up to this (from 128 MiB those within 1/16 below a
# multiple of it, too). A freed slot is a hole that the next forward's
# activations fill, and the large ones (attention scores, fp32 logits) come in power-of-two-like
# sizes; a slot a little short of them is the worst case: such a request finds only holes just too
# small, maps new memory (reserved memory creeps up every iteration), and where a smaller block
# does take the hole, the remainder is a crumb. See [Note: slot rounding] in docs/design.md. The
# padding costs GPU bytes only while a chunk is resident.
LARGE_SLOT_GRANULE = 64 * 2**20
# A state smaller than this many chunks of `chunk_bytes` is split into this many (but not below
# MIN_CHUNK_BYTES). One chunk is what packing holds twice (start-up, after the first step and
# loads) and what a freed chunk leaves as one hole among activations; with a small state a whole-
# state chunk made both as large as the state itself, and start-up then peaked above the whole run
# without offloading. See [Note: small states] in docs/design.md.
MIN_CHUNKS = 8
MIN_CHUNK_BYTES = 16 * 2**20


def slot_bytes(largest_chunk: int) -> int:
    """GPU bytes of every chunk buffer of an offloader whose largest chunk packs `largest_chunk`."""
    slot = align_up(largest_chunk, SLOT_ALIGNMENT if largest_chunk >= 10 * 2**20 else 512)
    rounded = align_up(slot, LARGE_SLOT_GRANULE)
    # (Smaller slots just short of a granule, e.g. chunks of at most 256 MiB packed to 250, too.)
    if slot >= 4 * LARGE_SLOT_GRANULE or (slot >= 2 * LARGE_SLOT_GRANULE and rounded - slot <= slot // 16):
        slot = rounded
    return slot


def _units(tensors: List[StateTensor], by_parameter: bool) -> List[List[StateTensor]]:
    """The packing units: one per tensor, or with `by_parameter` the state tensors of one
    parameter together (discovery lists them per parameter). The chunked step (chunked_step.py)
    steps a parameter once all of its state is resident, so a parameter whose master and moments
    lay in chunks far apart would hold both chunks on the GPU for the whole span between them.
    Without it, whole tensors pack with less padding (a large parameter's three tensors need not
    share one slot)."""
    if not by_parameter:
        return [[st] for st in tensors]
    units: List[List[StateTensor]] = []
    for st in tensors:
        if units and st.param is not None and units[-1][0].param is st.param:
            units[-1].append(st)
        else:
            units.append([st])
    return units


def _unit_bytes(unit: List[StateTensor]) -> int:
    return sum(align_up(st.nbytes, TENSOR_ALIGNMENT) for st in unit)


def _first_fit(units: List[List[StateTensor]], target: int) -> list:
    """Chunk layouts [tensors, offsets, packed bytes] with each unit (one parameter's tensors) in
    the first chunk that has room for it. Filling chunks strictly in order would close a chunk
    half-empty before every large unit (an embedding's master and moments), and every chunk is
    padded to the largest: a small state then took several times its size in GPU buffers, and
    the step, which has them all back, became the run's peak (see [Note: small states] in
    docs/design.md). Chunks then hold parameters out of order; correctness does not depend on
    that order (the fraction split is made before packing, the chunked step steps chunk by chunk
    and holds a chunk until all of its parameters are stepped), only how long a chunk holding
    part of a split parameter stays resident in the step."""
    layouts = []
    for unit in units:
        size = _unit_bytes(unit)
        layout = next((lay for lay in layouts if lay[2] + size <= target), None)
        if layout is None:
            layout = [[], [], 0]
            layouts.append(layout)
        for st in unit:
            layout[0].append(st)
            layout[1].append(layout[2])
            layout[2] = align_up(layout[2] + st.nbytes, TENSOR_ALIGNMENT)
    return layouts


def _split_larger_than(units: List[List[StateTensor]], limit: int) -> List[List[StateTensor]]:
    """`units`, with every unit of several tensors that packs to more than `limit` bytes split
    into one unit per tensor (kept in order, so that first fit tends to put them in neighbouring
    chunks; a chunk held for a split parameter stays resident in the step until its last part is
    stepped)."""
    out: List[List[StateTensor]] = []
    for unit in units:
        if len(unit) > 1 and _unit_bytes(unit) > limit:
            out.extend([st] for st in unit)
        else:
            out.append(unit)
    return out


def layout_chunks(units: List[List[StateTensor]], chunk_bytes: int) -> list:
    """The chunk layouts ([tensors, offsets, packed bytes], see `_first_fit`) of `units` in chunks
    of at most `chunk_bytes` (or of the largest state tensor, where that is larger): of the
    layouts with whole units and with the units larger than a chunk, than half a chunk, or all
    of them split into single tensors, one whose slot (`slot_bytes`: every buffer is padded to it)
    is not larger than `chunk_bytes`'s, and of those within 3 % of the fewest GPU bytes, the one
    with the fewest split units.

    A parameter's state split over chunks is stepped by the streamed step once all of its chunks
    are back (chunked_schedule.py), which holds the first ones longer. Kept whole, a state larger
    than a chunk set the size of every slot whatever size was asked for, and slots larger than the
    free blocks that long-lived allocations leave between the activations make every reload map
    new memory; a state larger than half a chunk, unable to share a chunk with another of its
    size, padded its chunk by up to half a slot. See [Note: chunk layout] in docs/design.md. A
    single state tensor larger than `chunk_bytes` is a chunk of its own and sets the slot size.
    """
    if not units:
        return []
    # (splits, GPU bytes, slot, layouts) per way of splitting
    options = []
    for limit in (None, chunk_bytes, chunk_bytes // 2, 0):
        split = units if limit is None else _split_larger_than(units, limit)
        if options and len(split) == len(units) + options[-1][0]:
            continue  # (nothing more split at this limit: the layout already tried)
        layouts = _balanced_layout(split, chunk_bytes)
        slot = _slot_of(layouts)
        options.append((len(split) - len(units), len(layouts) * slot, slot, layouts))
    # Slots larger than the size asked for (or than the largest tensor's chunk) only if all are.
    allowed = slot_bytes(max([chunk_bytes] + [_unit_bytes([st]) for unit in units for st in unit]))
    options = [o for o in options if o[2] <= allowed] or options
    # The fewest splits among those within 3 % of the fewest GPU bytes.
    fewest = min(o[1] for o in options)
    return min((o for o in options if o[1] <= fewest * 103 // 100), key=lambda o: (o[0], o[1]))[3]


def _balanced_layout(units: List[List[StateTensor]], chunk_bytes: int) -> list:
    """`layout_chunks` for one set of units."""
    total = sum(_unit_bytes(unit) for unit in units)
    largest = max([_unit_bytes(unit) for unit in units], default=0)
    target = max(chunk_bytes, largest)
    # Balanced: as many chunks as `target` needs, each about total / count, so that the last
    # one is not a small remainder padded up to the slot size. Up to 10 % of slack until first
    # fit manages with that count, else chunks of `target`. A size past `target` is tried capped
    # at it, too: its slot may round up to the next granule (`slot_bytes`), the capped one not.
    count = max(1, -(-total // target))
    per_chunk = -(-total // count)
    tried = []
    for size in [per_chunk * (100 + slack) // 100 for slack in range(11)] + [target]:
        size = max(largest, size)
        new = [_first_fit(units, s) for s in ([size, target] if size > target else [size])]
        tried.extend(new)
        layouts = min(new, key=len)
        if len(layouts) <= count:
            break
    # Of the layouts tried with no more chunks than that one (or 10 % more than `count`), and the
    # tightest (chunks of at most the largest unit), the one with the fewest GPU bytes: every
    # buffer is padded to the largest chunk, and whole parameters as units on a small state padded
    # much of it at the balanced sizes (see [Note: small states] in docs/design.md).
    tried.append(_first_fit(units, largest))
    most = max(len(layouts), -(-count * 11 // 10))
    return min((lay for lay in tried if len(lay) <= most),
               key=lambda lay: (len(lay) * _slot_of(lay), len(lay)))


def _slot_of(layouts: list) -> int:
    """The slot every chunk of `layouts` (non-empty) is padded to."""
    return slot_bytes(max(nbytes for _, _, nbytes in layouts))


class ChunkState(enum.Enum):
    RESIDENT = "resident"  # on the GPU, host copy stale (or none)
    COPYING_OUT = "copying_out"  # on the GPU and still valid; host copy current or its D2H in flight (`ready`)
    OFFLOADED = "offloaded"  # GPU storage freed; the host copy is the state
    COPYING_IN = "copying_in"  # GPU storage re-allocated, H2D in flight (`ready`)


class IllegalTransition(AssertionError):
    """A chunk was asked to move between states the protocol does not connect."""


# Every move a chunk may make (the self-loops: make_resident of a chunk already there). Anything
# else is a bug in the caller's sequencing, caught here instead of as wrong numbers later.
TRANSITIONS = {
    ChunkState.RESIDENT: {ChunkState.RESIDENT, ChunkState.COPYING_OUT},  # start_copy_out
    ChunkState.COPYING_OUT: {ChunkState.COPYING_OUT, ChunkState.OFFLOADED,  # free
                             ChunkState.RESIDENT},  # make_resident(will_modify)
    ChunkState.OFFLOADED: {ChunkState.COPYING_IN},  # start_copy_in
    ChunkState.COPYING_IN: {ChunkState.RESIDENT, ChunkState.COPYING_OUT},  # make_resident, settle_unmodified
}


class Chunk:
    """Whole state tensors packed into one buffer and moved together."""

    def __init__(self, index: int, tensors: List[StateTensor], offsets: List[int], nbytes: int):
        self.index = index
        self.tensors = tensors
        self.offsets = offsets  # of each tensor inside `buffer`
        self.nbytes = nbytes  # packed bytes (alignment padding included): what is copied and kept on the host
        self.gpu_nbytes = nbytes  # GPU buffer size (>= nbytes): the offloader's common slot size, where uniform
        self.buffer: Optional[torch.Tensor] = None  # uint8, `gpu_nbytes` on the device
        self.host: Optional[torch.Tensor] = None  # uint8 view of the pinned host buffer, `nbytes`
        self.state = ChunkState.RESIDENT
        # True while the host copy equals the GPU state: set when a D2H is enqueued, cleared when
        # anything may write the GPU state (the inner step, a checkpoint load).
        self.host_valid = False
        # The copy that must finish before the GPU storage may be freed (COPYING_OUT) or read
        # (COPYING_IN). None when no copy is in flight.
        self.ready: Optional[torch.cuda.Event] = None
        # Position of this chunk's latest H2D among all H2D copies enqueued (one H2D stream for
        # every offloader: chunks arrive in this order). Set by `start_copy_in`.
        self.copy_in_seq = 0
        # OFFLOADED and its state tensors point at `host` (CPU views) for a reader
        # (`expose_host_copies`) instead of at the freed GPU buffer, until the next forward or
        # reload (`hide_host_copies`, `start_copy_in`).
        self.on_host = False
        self.gpu_views: Optional[List[torch.Tensor]] = None  # the tensors' GPU views while on_host
        # (scales dict, key, GPU scale, host copy) of TE's fp16 states while on_host (`_scales_to_host`)
        self.gpu_scales: List[tuple] = []
        # (id(param), key) of its tensors the inner optimizer serves unscaled from snapshots while
        # on_host (host_copies._serve_unscaled)
        self.served_unscaled: List[tuple] = []

    def move_to(self, state: ChunkState) -> None:
        """The only way a chunk changes state: checked against TRANSITIONS."""
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"chunk {self.index}: {self.state.value} -> {state.value} is not a legal move")
        self.state = state

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def address(self) -> int:
        """Device address of the GPU buffer (0 while it is freed)."""
        return self.buffer.data_ptr() if self.buffer is not None and self.state is not ChunkState.OFFLOADED else 0

    @property
    def packed(self) -> torch.Tensor:
        """The bytes that hold state: the first `nbytes` of the (allocated) GPU buffer."""
        return self.buffer[: self.nbytes]

    def __repr__(self):
        return f"Chunk({self.index}, {self.nbytes}/{self.gpu_nbytes} B, {self.state.value})"
