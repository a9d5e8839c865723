"""`OffloadCoordinator`: decides *when* optimizer state leaves and re-enters the GPU.

One coordinator per process drives every `OptimizerStateOffloader` (dense, expert, ...) of its
device through one training iteration:

    step ──▶ next forward begins: copy out (D2H enqueued; nothing freed yet)
         ──▶ first forward: free chunks layer by layer as late as the budget allows (all at once if copied)
         ──▶ ... microbatches (all state off the GPU at every activation peak) ...
         ──▶ last backward(s): reload chunks as the backward frees activations
         ──▶ finalize_model_grads: reload whatever is left (fallback trigger)
         ──▶ step: the compute stream waits for the reload (no host sync), Adam runs on the GPU.

It is told what to do by an `OffloadConfig` (config.py) and knows where the loop is by its
`IterationRecord` (iteration.py: a checked `IterationState`, rebuilt after every step). The
concerns live in their own modules, each a mixin of this class over the state set up in
`__init__` (imports go one way: they never import this module):

    registration      offloaders for the optimizers, hooks on the model's layers
    memory_policy     the first forward's free budget and its growth profile
    reload_policy     the last backward's reloads and the workspace they leave
    allocator         allocator readers and the optional release of cached memory
    chunked_schedule  which chunks load, step and leave during a chunked step
    calibration       `--offload-state-fraction auto`'s measured iteration
    state_access      checkpoint and other readers/writers outside the step; start-up offload
    phase_switch      the whole state off the GPU and back between training phases (RL)
    ledger            bytes by chunk state, reports
    lifecycle         the loop's hooks: inert once closed, their host time (`hook_clock`)

The coordinator imports nothing from `megatron.training`; any training loop can drive it through
`forward_begin` / `forward_end` / `backward_begin` / `grads_finalizing` / `optimizer_step_done`, with
`layer_forward_begin` / `layer_backward_begin` per layer where `watch_model`'s hooks are not installed.
`resident_bytes`, `pending_copy_out` and `open_state_accesses` say where things stand (read-only).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Callable, List, Optional

import torch

from . import auto_fraction
from .allocator import CacheRelease
from .calibration import Calibration
from .chunked_schedule import ChunkedStepSchedule
from .config import AllocatorProbes, OffloadConfig
from .copy_feeder import CopyOutFeeder
from .iteration import ForwardSample, IterationRecord, IterationState
from .ledger import Ledger
from .lifecycle import HookClock, lifecycle
from .memory_policy import MemoryPolicy
from .reload_policy import ReloadPolicy
from .offloader import ChunkState, OptimizerStateOffloader
from .phase import Phase
from .phase_switch import PhaseSwitch
from .registration import Registration, in_backward
from .state_access import StateAccess
from .streams import CopyStreams, HostLeadBound

logger = logging.getLogger(__name__)


class OffloadCoordinator(Registration, MemoryPolicy, ReloadPolicy, CacheRelease, ChunkedStepSchedule, Calibration, StateAccess,
                         PhaseSwitch, Ledger):
    """Drives every offloader of one process through the training iteration (module docstring)."""

    def __init__(
        self,
        config: OffloadConfig = OffloadConfig(),
        *,
        device: Optional[torch.device] = None,
        probes: AllocatorProbes = AllocatorProbes(),
        expected_forwards_per_iteration: Optional[Callable[[], int]] = None,
        announce: Optional[Callable[[str], None]] = None,
        smallest_in_group: Optional[Callable[[float], float]] = None,
    ):
        """`expected_forwards_per_iteration`: training forwards per iteration (microbatches times
        model chunks), read when a backward begins, to know when no forward follows; None: the
        reloads start at `grads_finalizing`. `smallest_in_group`: the minimum of a number over the
        ranks that step in lockstep with this one (a collective), for the automatic fraction."""
        device = torch.device("cuda") if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:  # ("cuda": the current device, by index)
            device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.device = device
        self.streams = CopyStreams(self.device, timing=config.timing)
        self.host_lead = HostLeadBound(self.streams.compute, config.host_lead_layers)
        self.expected_forwards = expected_forwards_per_iteration
        self._smallest_in_group = smallest_in_group
        self._announce_fn = announce or (lambda msg: logger.info("megatron-offload: %s", msg))
        self._announced_bytes = 0

        self._init_allocator_readers(probes)  # (allocator.py; injected by tests and CPU runs)
        self._memory_room = probes.memory_room or auto_fraction.memory_room(self.device)

        # What the run changes: the automatic fraction chooses the share and stops measuring;
        # the chunked step's bound may be set explicitly (tests).
        self.state_fraction = config.state_fraction
        self.auto_fraction_at = config.auto_fraction_at
        self.step_budget_bytes = config.step_budget_bytes
        self.auto_choice: Optional[auto_fraction.Choice] = None
        self._recorder: Optional[auto_fraction.PhaseRecorder] = None
        self.calibrations: List[dict] = []  # each calibration's timeline and choice (diagnostics)

        self.offloaders: List[OptimizerStateOffloader] = []
        self.closed = False  # set by close(): the lifecycle methods are inert from then on
        self.hook_clock = HookClock()  # host time in the lifecycle methods (lifecycle.py)
        self.phase = Phase.NO_STATE  # where the state is (phase.py)
        self.it = IterationRecord(state=IterationState.STARTUP)  # where the loop is (iteration.py)
        self._iterations_done = 0
        self._steps_done = 0  # iterations in which an optimizer stepped (not skipped)
        self._setup_collected = not config.collect_after_setup  # the one full collection after setup is done
        self.events: List[str] = []  # lifecycle trace, bounded; tests assert the order
        self._hook_handles = []
        self._copy_out_due: List[OptimizerStateOffloader] = []  # stepped, copy-out not enqueued yet
        # The copy-out starts at the step, fed by a host thread (copy_feeder.py; the streamed step's default).
        self.feeder = (CopyOutFeeder(self.streams, config.copy_out_in_flight_bytes)
                       if config.copy_out_in_flight_bytes else None)
        self._stepped_since_forward = False  # (with the feeder: the silent no-op check below)
        self._suspended = 0  # >0 inside checkpoint APIs: their dummy steps are not real steps
        # One entry per state access in progress, innermost last: (offloader, state_access.Access).
        self._accesses: List[tuple] = []
        self.host_read_seconds = 0.0  # host time spent preparing host reads (state_access), in all
        self._nested_writes: set = set()  # id() of offloaders written inside a nested access, until the outermost closes

        # Across iterations (each concern's module): the first forward's growth profile and the
        # backward's workspace, the chunked step's levels, and counters for the report.
        self._init_memory_policy()
        self._init_reload_policy()
        self._init_chunked_schedule()

    def _trace(self, what: str) -> None:
        self.events.append(what)
        if len(self.events) > 4096:
            del self.events[:2048]

    # ------------------------------------------------------------------------------------------
    # Training-loop lifecycle
    # ------------------------------------------------------------------------------------------
    @lifecycle
    def start_pending_copy_out(self) -> None:
        """Enqueue the copy-out of the last step (normally done by the next forward)."""
        self._stepped_since_forward = False
        for off in self._copy_out_due:
            off.start_copy_out()
            self._trace(f"copy_out:{off.name}")
        self._copy_out_due.clear()
        if self._chunks(ChunkState.COPYING_OUT):
            self.phase = Phase.FREEING

    @lifecycle
    def forward_begin(self, training: bool = True) -> None:
        first = training and self.it.forwards == 0
        # Every rank measures, even one with nothing offloaded (a fraction below its first
        # tensor): the choice ends in collectives over the whole job (`_choose_fraction`).
        if first and self.auto_fraction_at == self._iterations_done + 1:
            self._recorder = auto_fraction.PhaseRecorder(self.streams.compute)
            self.streams.stats.stall_sink = self._recorder.stalls
            self._mark("iter_begin")
        if training:
            self._mark("fwd_begin")
        # Any forward (training or evaluation) may need the memory: start the copy-out now.
        self.start_pending_copy_out()
        self._hide_host_copies()
        if not training:
            # Evaluation forwards need the memory too, but do not count as microbatches.
            self._free_until(0)
            return
        it = self.it
        it.forwards += 1
        it.position = 0
        if not first:
            if it.state is not IterationState.RELOAD_WINDOW:
                it.move_to(IterationState.LATER_FORWARDS)
                if self.phase is Phase.OFFLOADED:
                    self._release_cache_at("forward")
            return
        it.move_to(IterationState.FIRST_FORWARD)
        it.began_offloaded = self.bytes_in(ChunkState.OFFLOADED) == self.gpu_bytes
        # Sample how this forward's activations grow while there is something left to free (or
        # nothing is known yet); the sample's `freed` counts what leaves from here on.
        sampling = bool(self._chunks(ChunkState.COPYING_OUT)) or self.peak_growth is None
        self._forget_lasting_growth(sampling)
        if sampling:
            it.sample = ForwardSample(allocated_at_start=self._allocated(), max_allocated_at_start=self._max_allocated(),
                                      freed_at_first_hook=self.peak_growth is None)
        self._trace("forward_begin")

    @lifecycle
    def layer_forward_begin(self) -> None:
        """A pacing module (a transformer layer, then the output layer) is about to run its
        forward: call it once per module, in forward order, between `forward_begin(True)` and
        `forward_end()`. `watch_model` installs hooks that call it; a loop that reports its layers
        itself calls it instead of, never besides, those hooks.

        It counts the module's position in the forward (what `layer_backward_begin` refers to).
        In the iteration's first forward it also samples the activation growth and frees the
        chunks being copied out down to the budget that leaves the next module its growth, or all
        of them once copied (memory_policy.py's docstring). Does nothing before the first training
        forward (an evaluation between steps) and inside a backward (the recomputation of a
        checkpointed layer); a forward without autograd (full activation recompute) counts."""
        # A recomputation inside the backward does not count. A forward without autograd does:
        # with full activation recompute (`--recompute-granularity full`) every checkpointed
        # layer runs its forward under no_grad; skipping those hooks left the state resident
        # until the forward's end, so the first offloaded iteration peaked far above the later
        # ones, and reserved memory kept that high-water mark (see [Note: forwards without
        # autograd] in docs/design.md).
        if self.it.forwards == 0 or in_backward():
            return
        self.host_lead.mark(self._host_lead_depth())
        h = self.it.position
        self.it.position += 1
        self._pace_layer(h)

    @lifecycle
    def forward_end(self) -> None:
        it = self.it
        if it.forwards == 0:
            return
        if it.sample is not None and it.sample.active:
            growth = self._growth()
            self.profile_end = growth if self.profile_end is None else max(self.profile_end, growth)
            it.sample.active = False
        # The backward starts now and with it the activation peak: nothing may stay behind.
        self._free_until(0, position=it.position)
        if self.bytes_in(ChunkState.OFFLOADED):
            it.forward_end_max = max(it.forward_end_max, self._allocated())
        self._mark("fwd_end")

    @lifecycle
    def backward_begin(self) -> None:
        self._mark("bwd_begin")
        it = self.it
        if it.forwards == 0:
            return
        it.backwards += 1
        self._begin_workspace_sample(it.backwards == 1 and self.phase is not Phase.NO_STATE)
        if it.state is IterationState.RELOAD_WINDOW:
            return
        expected = self.expected_forwards() if self.expected_forwards is not None else None
        if expected is not None and it.forwards >= expected:
            # No forward will follow: from here on the backwards only release activations.
            it.move_to(IterationState.RELOAD_WINDOW)
            self._trace("reload_window")
            self._release_cache_at("reload_window")
            self._reload_up_to(self._reload_ceiling(), position=it.position)

    @lifecycle
    def backward_end(self) -> None:
        """The backward of one microbatch is enqueued (phase mark for the automatic fraction; the
        first backward's last workspace interval ends)."""
        self._mark("bwd_end")
        self._sample_workspace(None, last=True)

    @lifecycle
    def layer_backward_begin(self, position: Optional[int] = None) -> None:
        """The gradient of pacing module `position`'s output is ready: the backward has finished
        every pacing module after it, and module `position`'s own backward comes next. `position`
        counts the modules of the training forward from 0, as `layer_forward_begin` did; None
        where unknown (inside a recomputation): then no chunk waits for a module's backward.

        In the iteration's first backward it measures what one module's backward allocates (the
        workspace the reloads leave free). Once no forward follows in this iteration (the reload
        window), it starts the reload of the chunks freed before a module after `position` (the
        activations that could have taken their memory are released), latest freed first, while
        allocated memory stays under the reload ceiling and a free block takes each chunk
        (`_reload_up_to`); `grads_finalizing` reloads whatever is left."""
        self.host_lead.mark(self._host_lead_depth())
        self._sample_workspace(position)
        if self.it.state is IterationState.RELOAD_WINDOW and self.bytes_in(ChunkState.OFFLOADED):
            self._reload_up_to(self._reload_ceiling(), position=position)

    @lifecycle
    def grads_finalizing(self) -> None:
        """All backwards are enqueued: reload whatever is still off (fallback trigger)."""
        self._trace("grads_finalizing")
        self._hide_host_copies()  # (a loop that saves and steps without a forward in between)
        if self.config.chunked_step:
            # Only what the step's budget holds; the step loads the rest piece by piece.
            self.it.step_budget = self._step_budget()
            admitted = self._admissible(self._chunks(ChunkState.OFFLOADED), self.it.step_budget)
            self._room_for_fallback([c for _, c in admitted])
            self._admit(admitted, self.it.step_budget)
        else:
            self._room_for_fallback()
            self._reload_up_to(None)
        self._update_peak_growth()

    @lifecycle
    def optimizer_step_begin(self) -> None:
        """The training loop is about to call the (chained) optimizer's step."""
        self._mark("step_begin")

    def _before_inner_step(self, off: OptimizerStateOffloader) -> None:
        if self._suspended:
            return
        self._stepping(off)
        off.make_resident(will_modify=True)

    def _stepping(self, off: OptimizerStateOffloader) -> None:
        """`off`'s inner step begins (whole or chunked)."""
        self._trace(f"step_begin:{off.name}")
        self.phase = Phase.STEPPING
        if self.config.per_step:  # (without it nothing reports the step's end: no iteration to track)
            self.it.move_to(IterationState.STEPPING)
        self.it.stepped.add(id(off))

    def _after_inner_step(self, off: OptimizerStateOffloader) -> None:
        if self._suspended:
            return
        if off.needs_refresh:
            # The first step created the moments lazily (TE/Apex FusedAdam; torch Adam's are
            # created before the first forward); they exist only now. Packing needs every chunk
            # back (once; with the chunked step some have already left again).
            off.make_resident(will_modify=True)
            off.refresh()
            self._announce()
        self._trace(f"step_end:{off.name}")

    @lifecycle
    def optimizer_step_done(self) -> None:
        """After the whole (chained) optimizer step returned, whether it updated or skipped.

        The copy-out is only *scheduled* here; it is enqueued when the next forward begins
        (`start_pending_copy_out`). Why not now: a GPU's copy engine runs the copies given to it
        in order, and the training loop reads small results to the host right after the step
        (the loss, logging). Each such read is a D2H copy too; queued behind the copy-out of the
        optimizer state it blocks the host for all of it, and with the host blocked the next
        iteration is not enqueued: the GPU idles for about that copy's length every iteration
        (see [Note: copy-out at the next forward] in docs/design.md). By the
        first forward those reads are done, and nothing is lost: the copy-out only has to
        finish before the forward's first free. (Also after the parameter all-gather: on PCIe
        hosts the D2H and NCCL share the GPU's link.) With the feeder
        (`--offload-copy-out-in-flight-mb`, copy_feeder.py) it starts here, a bounded amount queued.
        """
        if self._copy_out_due or self._stepped_since_forward:
            # Why: the copy-out of the last step is started by the next forward_begin; a step
            # with it still pending means no forward reached the hooks, so the state never leaves
            # the GPU while everything looks fine (the silent no-op of issue 28).
            self.close()
            raise OffloadNotRunningError(
                "megatron-offload: a second optimizer step ran without a forward_begin() after the first, so "
                "the optimizer state never left the GPU. The training loop's forwards bypass the hooks: in "
                "Megatron a schedule that does not call megatron.core.pipeline_parallel.schedules.forward_step "
                "(e.g. --overlap-moe-expert-parallel-comm's combined 1F1B), in a custom loop a missing "
                "forward_begin()/backward_begin()/grads_finalizing() call (or start_pending_copy_out()).")
        self._skipped_last_step = False
        self._release_cache_at("step_end")
        if any(id(off) in self.it.stepped for off in self.offloaders):
            self._steps_done += 1
        for off in self.offloaders:
            if id(off) in self.it.stepped:
                self._copy_out_due.append(off)
            else:
                # Skipped step (inf/nan, grad-norm threshold) or a stub: the reload may be in
                # flight and the state is unchanged, so the host copy is still current: what
                # came back leaves again without a D2H, the rest stays off.
                off.settle_unmodified()
                # (A stub holds no state and never steps; one whose state is all kept does.)
                self._skipped_last_step = self._skipped_last_step or bool(off.chunks or off.kept)
                self._trace(f"skipped:{off.name}")
        self.it = IterationRecord()  # the next iteration starts here, in AFTER_STEP
        if self._step_level:
            self._last_step_level, self._step_level = self._step_level, 0
        self._iterations_done += 1
        if self.auto_fraction_at == self._iterations_done:  # (the calibration iteration, on every rank)
            self._mark("step_end")
            self._choose_fraction()  # (may re-pack: the copy-out below then sends the new chunks)
        if self.feeder is not None and self._copy_out_due:
            # The feeder lets the host's reads after the step through (copy_feeder.py): start now.
            self.start_pending_copy_out()
            self._stepped_since_forward = True
        if not self._setup_collected and self._steps_done >= SETUP_STEPS and not self.auto_fraction_at:
            self._collect_setup_garbage()  # (after the feeder's start: its copies run meanwhile)
        if self._chunks(ChunkState.COPYING_OUT) or self._copy_out_due:
            self.phase = Phase.FREEING
        self._trace("step_done")

    def _collect_setup_garbage(self) -> None:
        """One full garbage collection when the plugin's one-time work is over (first steps,
        packing, pinning, an automatic fraction's calibration).

        Why: that work leaves thousands of objects (per-tensor and per-chunk records, packed
        views, their lists) that the young collections move to the oldest generation. CPython
        collects that generation once the objects moved there since its last full collection
        exceed a quarter of those that survived it; in a process whose last full collection came
        early in start-up, the plugin's setup brings that moment into the training iterations, and
        a full collection of a training process's heap stalls that iteration. Collected here, in an
        iteration of start-up, the count starts again from the whole heap (see [Note: garbage
        collection after setup] in docs/design.md). A loop that turned automatic collection off
        (Megatron's --manual-gc) decides its collections itself: nothing is done then."""
        self._setup_collected = True
        if gc.isenabled():
            gc.collect()
            self._trace("setup_collected")

    def close(self) -> None:
        """Detach: hooks removed, every state tensor back on the GPU, pinned memory released; the
        lifecycle methods do nothing from then on (a loop may go on calling them)."""
        self.closed = True
        self._copy_out_due.clear()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for off in self.offloaders:
            off.close()
        if self.feeder is not None:
            self.feeder.close()


# Steps (not skipped) of one-time work before the setup's garbage is collected: the first creates and
# packs the state (TE's FusedAdam creates it only then), the next iteration's copy-out and reload use
# the host buffers for the first time. Skipped steps (fp16's loss-scale warm-up) do not count.
SETUP_STEPS = 2


class OffloadNotRunningError(RuntimeError):
    """Offloading was asked for but the training loop never let it run."""


def phase_switcher(optimizer, device: Optional[torch.device] = None, config: Optional[OffloadConfig] = None,
                   probes: AllocatorProbes = AllocatorProbes()) -> OffloadCoordinator:
    """A coordinator that only switches phases, for a loop that trains without the per-step
    offload: every DistributedOptimizer of `optimizer` (a ChainedOptimizer is walked) gets an
    offloader; nothing is moved until `offload_all`. Its step hooks bring the state back before
    a step that runs while it is off; checkpoint saves and loads need `restore_all` first."""
    # No per-step offload, hence no chunked step (nothing reports a step's end to bound it).
    config = dataclasses.replace(config or OffloadConfig(), per_step=False, chunked_step=False)
    coord = OffloadCoordinator(config, device=device, probes=probes)
    for i, dist_opt in enumerate(_distributed_optimizers(optimizer)):
        coord.add_optimizer(dist_opt, name=f"distopt{i}")
    return coord


def _distributed_optimizers(optimizer):
    if hasattr(optimizer, "chained_optimizers"):
        for sub in optimizer.chained_optimizers:
            yield from _distributed_optimizers(sub)
    else:
        yield optimizer
