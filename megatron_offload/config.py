"""What the coordinator is told: `OffloadConfig` (the user's choices, frozen) and `AllocatorProbes`
(how it reads the device's memory; tests and CPU runs inject their own).

Both are plain data with no Megatron import: any training loop builds them. Megatron's flags map
onto `OffloadConfig` in `megatron_args.config_from_args`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, FrozenSet, List, Optional

from .allocator import RELEASE_POINTS
from .chunks import DEFAULT_CHUNK_BYTES

DEFAULT_MARGIN_BYTES = 64 * 2**20
# The host-lead bound where weight gradients are freed through another stream (DDP's AccumulateGrad
# nodes on the stream they were built under: streams.HostLeadBound); elsewhere none.
DEFERRED_FREES_HOST_LEAD_LAYERS = 1
# The host-lead bound in the automatic fraction's calibration iterations, whatever the run's (the
# default of OffloadConfig.calibration_host_lead_layers). Why: with the host at most one layer ahead,
# the phases after a copy stall run at the host's pace as without offloading, instead of the GPU's
# own while it catches up with a host that ran ahead: the planner's profile (no busy marks in-run)
# takes every phase as the baseline would run it. What it may cost: the bound's own waits can leave
# the GPU idle between layers, lengthening the phases the calibration measures beyond those of a
# run without the bound. See [Note: calibration host lead] in docs/design.md.
CALIBRATION_HOST_LEAD_LAYERS = 1


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """The offloading choices of one process; fixed for the run.

    Values the run itself changes later (the automatic fraction's choice, its iteration) start
    from here and live on the coordinator. The field defaults are the whole step (the state back
    for one `step()`); Megatron's flags default to the streamed step (`chunked_step=True` with
    the copy-out fed, `megatron_args.step_engine`), which needs megatron-core's
    DistributedOptimizer methods (chunked_step.py)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # size of the chunks the state is packed into
    margin_bytes: int = DEFAULT_MARGIN_BYTES  # kept free below the forward's peak when freeing late
    copy_piece_bytes: int = 0  # 0: each chunk's copy in one piece
    # The host runs at most this many layer hooks ahead of the compute stream (0: no bound;
    # streams.HostLeadBound says why a large lead grows reserved memory where gradients are freed
    # through another stream). 0 assumes they are not: a loop whose DDP built its AccumulateGrad
    # nodes on a side stream re-creates them (upstream_fixes.grad_accumulators_on_current_stream)
    # or sets DEFERRED_FREES_HOST_LEAD_LAYERS. (The automatic fraction's calibration iterations take
    # calibration_host_lead_layers instead, unless that is None.)
    host_lead_layers: int = 0
    # >0 (copy_feeder.py): start the copy-out at the step (each piece, with the chunked step) and let
    # a host thread keep about this many bytes of it queued on the GPU; 0: at the next forward.
    copy_out_in_flight_bytes: int = 0
    state_fraction: float = 1.0  # share of the state that leaves the GPU
    auto_fraction_at: Optional[int] = None  # `auto`: the iteration measured to choose the fraction
    chunked_step: bool = False  # step piece by piece, its resident state bounded (the streamed step)
    step_budget_bytes: int = 0  # the chunked step's bound (0: chosen at each step)
    release_cache: bool = False  # hand cached free memory back to the driver once per iteration
    release_at: FrozenSet[str] = frozenset({"offloaded"})  # where (allocator.RELEASE_POINTS)
    timing: bool = True  # CUDA events around the copies, for the per-iteration log
    host_loads: bool = True  # checkpoint loads may write into the host copies
    async_saves: bool = False  # checkpoint saves are asynchronous (state_access: nothing resident is read)
    # ... through megatron-core's own strategy, whose queue keeps a save's request until its write is
    # finalized: large tensors are read from shared-memory snapshots (save_snapshot.py)
    async_save_snapshots: bool = False
    # ... filled in the background, every state tensor, shared by file name: whoever hands them to
    # the writer makes it wait for the fill (megatron_saves does, for megatron-core's queue; see
    # [Note: background fill] in save_snapshot.py)
    async_save_background_fill: bool = False
    per_step: bool = True  # offload after every step (the flag); False: phase switches only (phase_switch.py)
    # One full garbage collection once setup is over (OffloadCoordinator._collect_setup_garbage);
    # CPU tests that drive many short-lived coordinators turn it off.
    collect_after_setup: bool = True
    # Diagnostic switches (the benchmark sets them to measure alternatives; defaults are the product):
    keep_backward_workspace: bool = True  # reloads leave room for the next layer's backward
    # ... for the largest interval still to come, not of the whole backward (ReloadPolicy._workspace_for)
    workspace_by_position: bool = True
    backward_reloads: bool = True  # reloads inside the last backward (else all at finalize)
    host_waits_at_free: bool = False  # the forward's frees also block the host
    # Where every copy-out of the iteration has finished before the first forward's first layer,
    # that hook frees all of it, not only what the budget asks (MemoryPolicy._free_when_copied_out).
    free_copied_before_forward: bool = True
    # The same at any layer hook of the first forward (a diagnostic: the benchmark's @freecopied).
    free_when_copied_out: bool = False
    # The fallback reload first hands mapped free memory back when the chunks fit no free block
    # (ReloadPolicy._room_for_fallback).
    release_before_unfitted_reload: bool = True
    # ... in every iteration, not only one whose first forward found every chunk off (a diagnostic:
    # the benchmark's @fbrelall; whether the hand-back pays where activations cut the chunks' holes
    # in later iterations too).
    fallback_release_every_iteration: bool = False
    # Memory kept for good since the latest sample lowers P and the profile is learned again
    # (MemoryPolicy._forget_lasting_growth; False: the benchmark's @keepprofile).
    forget_lasting_growth: bool = True
    # ... and the forward's frees keep at least that much free below the peak (MemoryPolicy._margin;
    # False: margin_bytes alone, as where the user gave --offload-memory-margin-mb, and the
    # benchmark's @nolastmargin).
    lasting_growth_margin: bool = True
    # The host-lead bound of the automatic fraction's calibration iterations (None: the run's own).
    calibration_host_lead_layers: Optional[int] = CALIBRATION_HOST_LEAD_LAYERS
    # The second calibration's reading bounded by the first's untrimmed estimate
    # (auto_fraction.refine; False: not where the second had no copy waits, the benchmark's @calnocap).
    second_calibration_capped: bool = True

    def __post_init__(self):
        object.__setattr__(self, "release_at", frozenset(self.release_at))
        unknown = self.release_at - set(RELEASE_POINTS)
        if unknown:
            raise ValueError(f"unknown release point(s) {sorted(unknown)}; known: {RELEASE_POINTS}")
        if not 0.0 <= self.state_fraction <= 1.0:
            raise ValueError(f"state_fraction must be within [0, 1], got {self.state_fraction}")
        if (self.chunk_bytes <= 0 or self.margin_bytes < 0 or self.copy_piece_bytes < 0 or self.step_budget_bytes < 0
                or self.copy_out_in_flight_bytes < 0 or self.host_lead_layers < 0
                or (self.calibration_host_lead_layers or 0) < 0):
            raise ValueError(f"sizes must be positive (chunk) or non-negative: {self}")


@dataclasses.dataclass(frozen=True)
class AllocatorProbes:
    """Readers of the device's memory. None: the CUDA caching allocator's own (allocator.py);
    on a CPU device the readers that make sense there."""

    allocated: Optional[Callable[[], int]] = None  # bytes allocated now
    max_allocated: Optional[Callable[[], int]] = None  # high-water mark of allocated bytes
    allocated_total: Optional[Callable[[], int]] = None  # bytes ever allocated (cumulative)
    free_block_sizes: Optional[Callable[[], List[int]]] = None  # the allocator's free blocks
    free_mapped: Optional[Callable[[], int]] = None  # reserved minus allocated bytes (cheap)
    memory_room: Optional[Callable[[], float]] = None  # bytes a larger resident share could use
    empty_cache: Optional[Callable[[], None]] = None  # hand cached free memory back
