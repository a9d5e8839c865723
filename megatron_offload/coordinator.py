"""`OffloadCoordinator`: decides *when* optimizer state leaves and re-enters the GPU.

One coordinator per process drives every `OptimizerStateOffloader` (dense, expert, ...) of its
device through one training iteration:

    step ──▶ next forward begins: copy out (D2H enqueued; nothing freed yet)
         ──▶ first forward: free chunks layer by layer, as late as the memory budget allows
         ──▶ ... microbatches (all state off the GPU at every activation peak) ...
         ──▶ last backward(s): reload chunks as the backward frees activations
         ──▶ finalize_model_grads: reload whatever is left (fallback trigger)
         ──▶ step: the compute stream waits for the reload (no host sync), Adam runs on the GPU.

The memory budget. Let S be the state bytes being offloaded, A0 the allocated bytes when the
iteration's first forward starts (state still resident) and g(t) the activation growth since then
(measured allocated bytes plus the state bytes freed so far). The goal is that allocated never
exceeds A0 - S + P, P being the iteration's peak growth; with r(t) state bytes still resident
that means r(t) + g(t) <= P. At each layer's forward pre-hook we free chunks until
r <= P - g(next hook) - margin, g being the growth profile measured on earlier iterations.
Unknown P (first offloaded iteration) makes the budget 0: free everything at the first hook.
Reloads in the last backward(s) follow the same rule in reverse: a chunk comes back when
allocated + its bytes stays below the highest allocated level seen at the end of a forward in
this iteration, which the state was already off for, and, since *reserved* memory is what runs
out, only once the backward has finished the layers that ran after its free and the caching
allocator holds one free block that takes it (`_reload_up_to`, `_fitting`).

The coordinator imports nothing from `megatron.training`; any training loop can drive it through
`forward_begin` / `forward_end` / `backward_begin` / `grads_finalizing` / `optimizer_step_done`.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import logging
import math
import time
from typing import Callable, Iterable, List, Optional

import torch

from . import auto_fraction, chunked_step, host_memory
from .offloader import DEFAULT_CHUNK_BYTES, ChunkState, OptimizerStateOffloader
from .streams import CopyStreams, TransferTotals

logger = logging.getLogger(__name__)

DEFAULT_MARGIN_BYTES = 64 * 2**20
# The chunked step keeps at least this many chunks' room for state during the step: one being
# stepped, the next one loading, the previous one still copying out (its D2H must finish before its
# memory can take the one after next).
STEP_WINDOW_CHUNKS = 3
# Free blocks smaller than this do not count as room for a layer's backward temporaries
# (`_fitting`): those are activation-sized, and a reload must not leave only crumbs.
# See [Note: backward workspace] in docs/design.md.
WORKSPACE_MIN_BLOCK = 64 * 2**20
# Points of the iteration where `--offload-release-cached-memory` may hand free cached memory back
# to the driver: when the last chunk is freed in the first forward ("offloaded"), at each later
# microbatch's forward ("forward"), when the last backward begins, before any reload
# ("reload_window"), and after the optimizer step, the state resident ("step_end").
RELEASE_POINTS = ("offloaded", "forward", "reload_window", "step_end")


class Phase(enum.Enum):
    """Where the coordinator is in the iteration (for assertions, logs and tests)."""

    NO_STATE = "no_state"  # before the first optimizer step created the state
    FREEING = "freeing"  # after a step: state copying out, freed during the next forward
    OFFLOADED = "offloaded"  # everything that is going to be freed is freed
    RELOADING = "reloading"  # in the last backward(s): state coming back
    STEPPING = "stepping"  # inside the inner optimizer step: state resident


class OffloadCoordinator:
    def __init__(
        self,
        device: Optional[torch.device] = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        margin_bytes: int = DEFAULT_MARGIN_BYTES,
        expected_forwards_per_iteration: Optional[Callable[[], int]] = None,
        memory_allocated: Optional[Callable[[], int]] = None,
        max_memory_allocated: Optional[Callable[[], int]] = None,
        timing: bool = True,
        announce: Optional[Callable[[str], None]] = None,
        copy_piece_bytes: int = 0,
        free_block_sizes: Optional[Callable[[], List[int]]] = None,
        state_fraction: float = 1.0,
        auto_fraction_at: Optional[int] = None,
        memory_room: Optional[Callable[[], float]] = None,
        smallest_in_group: Optional[Callable[[float], float]] = None,
        chunked_step: bool = False,
        step_budget_bytes: int = 0,
        release_cache: bool = False,
        empty_cache: Optional[Callable[[], None]] = None,
        release_at: Iterable[str] = ("offloaded",),
        allocated_total: Optional[Callable[[], int]] = None,
        keep_backward_workspace: bool = True,
        host_waits_at_free: bool = False,
        host_loads: bool = True,
    ):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self.streams = CopyStreams(self.device, timing=timing)
        self.chunk_bytes = chunk_bytes
        self.copy_piece_bytes = copy_piece_bytes
        self.state_fraction = state_fraction
        self.margin_bytes = margin_bytes
        self.expected_forwards = expected_forwards_per_iteration
        self._allocated = memory_allocated or _allocator_stat(self.device, "current")
        self._max_allocated = max_memory_allocated or _allocator_stat(self.device, "peak")
        # Sizes of the caching allocator's free blocks that a reload on the compute stream could
        # use without a new segment (None: no such check, e.g. on CPU).
        self._free_block_sizes = free_block_sizes
        if self._free_block_sizes is None and self.device.type == "cuda" and memory_allocated is None:
            self._free_block_sizes = _free_block_reader(self.device, self.streams.compute)
        # `--offload-state-fraction auto`: offload everything until iteration `auto_fraction_at`,
        # measure it, then keep resident what cannot move for free (auto_fraction.py).
        self.auto_fraction_at = auto_fraction_at
        self.auto_choice: Optional[auto_fraction.Choice] = None
        self._memory_room = memory_room or auto_fraction.memory_room(self.device)
        # Minimum of a number over the ranks that step in lockstep with this one (a collective;
        # None: this rank decides alone), for the automatic fraction (auto_fraction.agree).
        self._smallest_in_group = smallest_in_group
        self._recorder: Optional[auto_fraction.PhaseRecorder] = None
        self._iterations_done = 0
        # Bytes ever allocated (the allocator's cumulative counter), to measure what one layer's
        # backward allocates: that much free memory stays free while chunks reload (`_fitting`).
        self._allocated_total = allocated_total or _allocator_stat(self.device, "allocated")
        # False: reloads ignore the next layer's workspace (`_fitting`; the earlier rule, kept as
        # a switch so that the benchmark can measure both in one call).
        self.keep_backward_workspace = keep_backward_workspace
        # The forward's frees block the host until their copy-out is done (`_free_until`; off by
        # default: not shown to help, and the host's wait costs step time; see [Note: host waits
        # at free] in docs/design.md).
        self.host_waits_at_free = host_waits_at_free
        self.free_host_wait_ms = 0.0  # host time in the forward's frees (their waits included)
        self.backward_workspace = 0  # most bytes one layer's backward allocated (own reloads excluded)
        self._workspace_mark: Optional[int] = None
        self._own_allocations = 0  # chunk bytes the reloads allocated (on the compute stream)
        self._backwards = 0  # backwards begun this iteration
        self.fit_checks = 0  # calls of _free_block_sizes, and their host time
        self.fit_check_ms = 0.0
        self.reloads_deferred_for_fit = 0
        # Once per training iteration, when the last offloaded chunk is freed, hand the caching
        # allocator's free memory back to the driver (`_release_cache`).
        self.release_cache = release_cache
        # Where in the iteration (RELEASE_POINTS; "offloaded" unless measuring the others).
        self.release_at = frozenset(release_at)
        unknown = self.release_at - set(RELEASE_POINTS)
        if unknown:
            raise ValueError(f"unknown release point(s) {sorted(unknown)}; known: {RELEASE_POINTS}")
        self._empty_cache = empty_cache or (torch.cuda.empty_cache if self.device.type == "cuda" else None)
        self.cache_releases = 0
        self.cache_release_ms = 0.0
        # The chunked step (module doc of chunked_step.py): state resident during the step is
        # bounded by `step_budget_bytes` (0: chosen at each step, `_step_budget`).
        self.chunked_step = chunked_step
        self.step_budget_bytes = step_budget_bytes
        self.step_budgets: List[int] = []  # the budget of each chunked step so far (bounded)
        self._step_order = {}  # id(offloader) -> its chunks in the order the chunked step takes them
        self._stepped_out: List = []  # (offloader, chunk) copied out during the step, oldest first
        self._step_budget_now = 0
        self._step_level = 0  # highest allocated level at a piece's start, this step and the last
        self._last_step_level = 0
        self._skipped_last_step = False
        self.offloaders: List[OptimizerStateOffloader] = []
        self.phase = Phase.NO_STATE
        self.events: List[str] = []  # lifecycle trace, bounded; tests assert the order
        self._hook_handles = []
        self._copy_out_due: List[OptimizerStateOffloader] = []  # stepped, copy-out not enqueued yet
        self._suspended = 0  # >0 inside checkpoint APIs: their dummy steps are not real steps
        # One entry per state access in progress (nested ones inside others): "host_read" or
        # "host_write" where it runs on the exposed host copies, "gpu" where it took the state back.
        self._accesses: List[str] = []
        self._nested_writes = False  # a write inside a nested access, applied when the outermost closes
        # Writers may run on the host copies (`before_state_access`); off where the load path
        # needs the state on the GPU (e.g. Megatron's fully parallel load exchanges it over NCCL).
        self.host_loads = host_loads

        # Per-iteration counters.
        self._train_forwards = 0
        self._stepped = set()  # ids of offloaders whose inner step ran this iteration
        self._sampling = False  # first training forward of the iteration: sample memory per layer
        self._a0: Optional[int] = None  # allocated at this iteration's first forward (if sampled)
        self._m0 = 0
        self._freed_at_first_hook = False  # no profile yet: everything freed at the first hook
        self._freed_this_iter = 0
        self._position = 0  # pacing modules entered in the current training forward
        self._freed_at = {}  # id(chunk) -> position before which it was freed this iteration
        self._fwd_end_max = 0
        self._window_open = False

        # Growth profile of the first forward, running max over iterations (see module doc).
        self.profile: List[int] = []
        self.profile_end: Optional[int] = None
        self.peak_growth: Optional[int] = None
        self._announce_fn = announce or (lambda msg: logger.info("megatron-offload: %s", msg))
        self._announced_bytes = 0

    # ------------------------------------------------------------------------------------------
    # Registration
    # ------------------------------------------------------------------------------------------
    def add_optimizer(self, dist_opt, name: str = "optimizer") -> OptimizerStateOffloader:
        """Offload one DistributedOptimizer (a ChainedOptimizer: add each one inside it)."""
        if hasattr(dist_opt, "chained_optimizers"):
            raise TypeError(
                "megatron-offload: add_optimizer takes one DistributedOptimizer; for a ChainedOptimizer add "
                "each of its DistributedOptimizers (megatron_offload.megatron_wiring.iter_distributed_optimizers)")
        if not (getattr(dist_opt, "is_stub_optimizer", False) or (
                hasattr(dist_opt, "optimizer") and hasattr(dist_opt, "shard_fp32_from_float16_groups"))):
            raise TypeError(
                f"megatron-offload: add_optimizer needs a megatron-core DistributedOptimizer (the sharded "
                f"state it moves: inner optimizer, fp32 master shards), got a {type(dist_opt).__name__}; "
                "build the optimizer with use_distributed_optimizer=True (--use-distributed-optimizer)")
        off = OptimizerStateOffloader(dist_opt, self.streams, self.chunk_bytes, name=name,
                                      copy_piece_bytes=self.copy_piece_bytes, fraction=self.state_fraction,
                                      by_parameter=self.chunked_step)
        self.offloaders.append(off)
        inner = getattr(dist_opt, "optimizer", None)
        if inner is None or getattr(dist_opt, "is_stub_optimizer", False):
            return off
        if self.chunked_step:
            uninstall = chunked_step.install_piecewise_step(
                dist_opt,
                make_pieces=lambda off=off: self._begin_chunked_step(off),
                before_piece=lambda k, off=off: self._before_piece(off, k),
                after_piece=lambda k, off=off: self._after_piece(off, k),
                enabled=lambda: not self._suspended,
                after_step=lambda off=off: self._after_inner_step(off),
            )
            self._hook_handles.append(_Undo(uninstall))
        else:
            self._hook_handles.append(
                inner.register_step_pre_hook(lambda opt, a, k, off=off: self._before_inner_step(off))
            )
            self._hook_handles.append(
                inner.register_step_post_hook(lambda opt, a, k, off=off: self._after_inner_step(off))
            )
        return off

    def watch_model(self, model_chunks: Iterable[torch.nn.Module]) -> int:
        """Hook the layers whose forward/backward pace the freeing and reloading. Returns count."""
        count = 0
        for chunk in model_chunks:
            for module in pacing_modules(chunk):
                self._hook_handles.append(module.register_forward_pre_hook(self._on_layer_forward))
                self._hook_handles.append(module.register_forward_hook(self._on_layer_output))
                count += 1
        return count

    def _trace(self, what: str) -> None:
        self.events.append(what)
        if len(self.events) > 4096:
            del self.events[:2048]

    # ------------------------------------------------------------------------------------------
    # Byte accounting
    # ------------------------------------------------------------------------------------------
    def _chunks(self, *states: ChunkState):
        return [(off, c) for off in self.offloaders for c in off.chunks if c.state in states]

    def bytes_in(self, *states: ChunkState) -> int:
        return sum(off.bytes_in(*states) for off in self.offloaders)

    @property
    def state_bytes(self) -> int:
        """Optimizer-state bytes under management (what leaves the GPU)."""
        return sum(off.state_bytes for off in self.offloaders)

    @property
    def gpu_bytes(self) -> int:
        """GPU bytes of all chunk buffers (state plus alignment and slot padding)."""
        return self.bytes_in(*ChunkState)

    @property
    def pinned_bytes(self) -> int:
        return sum(off.pinned_bytes for off in self.offloaders)

    def _free_until(self, budget: int, position: Optional[int] = None) -> int:
        """Free COPYING_OUT chunks (in order) until at most `budget` of them stay allocated.
        `position`: the pacing module about to run (activations from it on may reuse the
        memory); None when unknown (evaluation)."""
        # Highest address first. Freed memory is only useful to a large activation in one piece:
        # the top chunk's block joins the free space above it (with expandable segments the whole
        # pool is one segment, and adjacent free blocks merge), so an activation that fits no
        # hole goes there rather than above every chunk still resident, which would raise the
        # high-water mark of the segment, i.e. *reserved* memory. Without expandable segments
        # each chunk is a segment of its own and the order does not matter.
        pending = sorted(self._chunks(ChunkState.COPYING_OUT), key=lambda pair: -pair[1].address)
        remaining = sum(c.gpu_nbytes for _, c in pending)
        chosen = []
        for off, chunk in pending:
            if remaining <= budget:
                break
            chosen.append((off, chunk))
            remaining -= chunk.gpu_nbytes
            self._freed_at[id(chunk)] = position
        # With `host_waits_at_free` the host waits for the copy-out of what it frees, as the
        # compute stream must. The idea: a forward that needs the memory before the D2H is done
        # stalls the GPU here; a host that does not stall with it runs ahead by the whole stall
        # (which can be a large part of an iteration where the state is large against the copy
        # window), and memory freed meanwhile across streams (the weight gradients, which
        # Megatron's DDP accumulates on a stream of its own) is only reusable once the GPU gets
        # there: allocations made that far ahead map new memory. With the wait the reserved peak
        # came out lower in some iterations and not in others, and every step took a little
        # longer: not a clear gain, so off by default (MEGATRON_OFFLOAD_HOST_WAIT=1 turns it on).
        # See [Note: host waits at free] in docs/design.md.
        start = time.perf_counter()
        freed = sum(off.free(chunks, host_waits=self.host_waits_at_free) for off, chunks in _by_offloader(chosen))
        self.free_host_wait_ms += (time.perf_counter() - start) * 1e3
        self._freed_this_iter += freed
        if freed and not self._chunks(ChunkState.COPYING_OUT):
            self.phase = Phase.OFFLOADED
            self._trace("offloaded")
            if position is not None:
                self._release_cache_at("offloaded")
        return freed

    def _release_cache_at(self, point: str) -> None:
        if self.release_cache and point in self.release_at:
            self._trace(f"release:{point}")
            self._release_cache()

    def _release_cache(self) -> None:
        """Return the allocator's free memory to the driver, now that the state is off the GPU.

        Why: the reserved peak is mapped memory, live or not. Each iteration frees the chunks in
        the forward and takes them back in the backward, and the blocks that activations and
        reloaded chunks leave free in between are not always the sizes later requests ask for:
        they stay mapped, the next request that fits none maps new memory above them, and the
        reserved peak creeps up over iterations (with memory mapped and free but unusable at the
        peak). With expandable segments `empty_cache` unmaps every free page, holes included, so
        what is mapped from here to the forward's peak is what the activations really use. Cost:
        the host waits once per iteration for the compute stream, and the pages are mapped again
        as the forward needs them (the first forward takes longer). It stops the creep, but every
        iteration's peak then depends on where that iteration's mapping lands, and a small model's
        peak came out higher with it than without: opt-in (`--offload-release-cached-memory`).
        See [Note: releasing cached memory] in docs/design.md.
        """
        start = time.perf_counter()
        self._hand_back_cached_memory()
        self.cache_releases += 1
        self.cache_release_ms += (time.perf_counter() - start) * 1e3

    def _hand_back_cached_memory(self) -> None:
        if self.device.type == "cuda":
            # Why: `free` made the compute stream wait for the copies, but returning the memory
            # to the device must not unmap pages a copy may still be reading: wait for it here
            # rather than rely on which stream the allocator synchronises before unmapping.
            self.streams.compute.synchronize()
        if self._empty_cache is not None:
            self._empty_cache()

    def _reload_up_to(self, ceiling: Optional[int], position: Optional[int] = None) -> int:
        """Start H2D for OFFLOADED chunks while allocated + their bytes stays <= ceiling.

        `position`: the backward has finished every pacing module after this one. A chunk freed
        before module h is then only eligible once h > position, i.e. once the activations that
        may have been placed in its memory (those of modules h, h+1, ...) are released. Reloading
        earlier, by `allocated` alone, finds enough free bytes but not in one piece: the caching
        allocator then creates a new segment and *reserved* memory grows by the chunk while
        allocated looks fine. Latest-freed chunks come back first, mirroring the order in which
        the backward releases memory. This rule alone did not lower reserved memory measurably
        (the activations of the last microbatch are not placed like the first's); `_fitting`
        below is what did. See [Note: reload order] in docs/design.md.
        """
        todo = self._chunks(ChunkState.OFFLOADED)
        if position is not None:
            todo = [(off, c) for off, c in todo if _after(self._freed_at.get(id(c)), position)]
            todo.sort(key=lambda pair: -_rank(self._freed_at.get(id(pair[1]))))
        if not todo:
            return 0
        allocated = self._allocated() if ceiling is not None else 0
        # The chunked step holds at most its budget: what comes back now is held until stepped.
        cap = self._backward_reload_cap()
        resident = self._resident_bytes()
        chosen = []
        for off, chunk in todo:
            if ceiling is not None and allocated + chunk.gpu_nbytes > ceiling:
                break
            if resident + chunk.gpu_nbytes > cap:
                break
            chosen.append((off, chunk))
            allocated += chunk.gpu_nbytes
            resident += chunk.gpu_nbytes
        if ceiling is not None and chosen and self._free_block_sizes is not None:
            chosen = self._fitting(chosen)
        moved = sum(off.start_copy_in(chunks) for off, chunks in _by_offloader(chosen))
        self._own_allocations += moved
        if moved:
            if self.phase is not Phase.RELOADING:
                self._trace("reload_start")
            self.phase = Phase.RELOADING
        return moved

    def _fitting(self, chosen):
        """The leading chunks of `chosen` that fit the allocator's free blocks as they are now,
        leaving the next layer's backward its workspace.

        Enough free *bytes* (the ceiling above) is not enough: the caching allocator never
        merges blocks across segments, so a chunk that fits no single free block gets a new
        segment and reserved memory grows for good. The blocks are assigned best-fit, as the
        allocator would. A chunk left out is retried at the next backward hook; the fallback in
        `grads_finalizing` reloads whatever is left, when the backward has released everything.

        The workspace: each layer's backward allocates temporaries and frees them before the
        next layer's (a few activation-sized blocks per layer). A chunk placed in the holes the
        last layer's temporaries left sends the next layer's to new memory: that is what set the
        reserved peak of most iterations, in the last backward, by temporaries' requests made
        while more than enough memory was mapped but free and no hole took them (see [Note:
        backward workspace] in docs/design.md). So after the placement, the free blocks of at
        least WORKSPACE_MIN_BLOCK (or a chunk slot) must still hold what one layer's backward
        allocated (`backward_workspace`, measured in the iteration's first backward).
        """
        start = time.perf_counter()
        blocks = sorted(self._free_block_sizes())
        smallest_useful = min(WORKSPACE_MIN_BLOCK, self._slot())
        self.fit_checks += 1
        self.fit_check_ms += (time.perf_counter() - start) * 1e3
        fitted = []
        for off, chunk in chosen:
            need = (chunk.gpu_nbytes + 511) // 512 * 512  # the allocator's rounding of large requests
            i = bisect.bisect_left(blocks, need)
            if i == len(blocks):
                break
            after = list(blocks)
            rest = after.pop(i) - need
            if rest > 0:
                bisect.insort(after, rest)
            if sum(b for b in after if b >= smallest_useful) < self.backward_workspace:
                break
            blocks = after
            fitted.append((off, chunk))
        self.reloads_deferred_for_fit += len(chosen) - len(fitted)
        return fitted

    def _sample_workspace(self) -> None:
        """At a backward hook of the iteration's first backward: what the layer just finished
        allocated (the allocator's cumulative counter, less the reloads' own chunks)."""
        if self._workspace_mark is None or not self.keep_backward_workspace:
            return
        now = self._allocated_total() - self._own_allocations
        self.backward_workspace = max(self.backward_workspace, now - self._workspace_mark)
        self._workspace_mark = now

    # ------------------------------------------------------------------------------------------
    # Training-loop lifecycle
    # ------------------------------------------------------------------------------------------
    def start_pending_copy_out(self) -> None:
        """Enqueue the copy-out of the last step (normally done by the next forward)."""
        for off in self._copy_out_due:
            off.start_copy_out()
            self._trace(f"copy_out:{off.name}")
        self._copy_out_due.clear()
        if self._chunks(ChunkState.COPYING_OUT):
            self.phase = Phase.FREEING

    def forward_begin(self, training: bool = True) -> None:
        first = training and self._train_forwards == 0
        if first and self.auto_fraction_at == self._iterations_done + 1 and self.state_bytes:
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
        self._train_forwards += 1
        self._position = 0
        if not first:
            if self.phase is Phase.OFFLOADED and not self._window_open:
                self._release_cache_at("forward")
            return
        self._freed_at.clear()
        self._freed_this_iter = 0
        self._fwd_end_max = 0
        self._sampling = bool(self._chunks(ChunkState.COPYING_OUT)) or self.peak_growth is None
        self._a0 = self._allocated() if self._sampling else None
        self._m0 = self._max_allocated() if self._sampling else 0
        self._freed_at_first_hook = self.peak_growth is None
        self._trace("forward_begin")

    def _growth(self) -> int:
        return self._allocated() - self._a0 + self._freed_this_iter

    def _on_layer_forward(self, module, args) -> None:
        # A recomputation inside the backward does not count. A forward without autograd does:
        # with full activation recompute (`--recompute-granularity full`) every checkpointed
        # layer runs its forward under no_grad; skipping those hooks left the state resident
        # until the forward's end, so the first offloaded iteration peaked far above the later
        # ones, and reserved memory kept that high-water mark (see [Note: forwards without
        # autograd] in docs/design.md).
        if self._train_forwards == 0 or _in_backward():
            return
        h = self._position
        self._position += 1
        if not self._sampling:
            return
        growth = self._growth()
        if h < len(self.profile):
            self.profile[h] = max(self.profile[h], growth)
        else:
            self.profile.append(growth)
        if not self._chunks(ChunkState.COPYING_OUT):
            return
        if self.peak_growth is None:
            budget = 0
        else:
            if h + 1 < len(self.profile):
                upcoming = self.profile[h + 1]
            else:
                upcoming = self.profile_end if self.profile_end is not None else self.peak_growth
            budget = max(0, self.peak_growth - upcoming - self.margin_bytes)
        self._free_until(budget, position=h)

    def _on_layer_output(self, module, args, output) -> None:
        if self._train_forwards == 0 or not torch.is_grad_enabled() or self.phase is Phase.NO_STATE:
            return
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            # The gradient of module h's output exists when every module after h finished its
            # backward. Unknown position inside a recomputation (see _on_layer_forward).
            position = None if _in_backward() else self._position - 1
            tensor.register_hook(lambda grad, p=position: self._on_layer_backward(grad, p))

    def forward_end(self) -> None:
        if self._train_forwards == 0:
            return
        if self._sampling:
            growth = self._growth()
            self.profile_end = growth if self.profile_end is None else max(self.profile_end, growth)
            self._sampling = False
        # The backward starts now and with it the activation peak: nothing may stay behind.
        self._free_until(0, position=self._position)
        if self.bytes_in(ChunkState.OFFLOADED):
            self._fwd_end_max = max(self._fwd_end_max, self._allocated())
        self._mark("fwd_end")

    def backward_begin(self) -> None:
        self._mark("bwd_begin")
        if self._train_forwards == 0:
            return
        self._backwards += 1
        # The first backward of each iteration measures the workspace (`_fitting`); a later one
        # would count the same layers again. Its first interval includes the loss and output
        # layer's backward, which the reloads started just below must also leave room for.
        self._workspace_mark = (self._allocated_total() - self._own_allocations
                                if self._backwards == 1 and self.phase is not Phase.NO_STATE else None)
        if self._window_open:
            return
        expected = self.expected_forwards() if self.expected_forwards is not None else None
        if expected is not None and self._train_forwards >= expected:
            # No forward will follow: from here on the backwards only release activations.
            self._window_open = True
            self._trace("reload_window")
            self._release_cache_at("reload_window")
            self._reload_up_to(self._reload_ceiling(), position=self._position)

    def backward_end(self) -> None:
        """The backward of one microbatch is enqueued (phase mark for the automatic fraction)."""
        self._mark("bwd_end")

    def _on_layer_backward(self, grad, position: Optional[int] = None):
        self._sample_workspace()
        if self._window_open and self.bytes_in(ChunkState.OFFLOADED):
            self._reload_up_to(self._reload_ceiling(), position=position)
        return None

    def _reload_ceiling(self) -> int:
        """Allocated bytes the backward's reloads may reach: the highest level of a forward's end
        in this iteration, which the state was already off for. With the chunked step, also the
        level the last step reached with its budget resident (before its Adam temporaries): when
        the step is the iteration's peak (full recompute), waiting for the forwards' level
        left the whole budget to load between the backward and the step, exposed as a wait
        before it. See [Note: chunked-step budget] in docs/design.md."""
        if not self.chunked_step:
            return self._fwd_end_max
        return max(self._fwd_end_max, self._last_step_level)

    def grads_finalizing(self) -> None:
        """All backwards are enqueued: reload whatever is still off (fallback trigger)."""
        self._trace("grads_finalizing")
        self._hide_host_copies()  # (a loop that saves and steps without a forward in between)
        if self.chunked_step:
            # Only what the step's budget holds; the step loads the rest piece by piece.
            self._step_budget_now = self._step_budget()
            self._admit(self._chunks(ChunkState.OFFLOADED), self._step_budget_now)
        else:
            self._reload_up_to(None)
        self._update_peak_growth()

    def _update_peak_growth(self) -> None:
        """P, the iteration's peak activation growth (module doc).

        Measured exactly once, in the first sampled iteration, from the allocator's high-water
        mark: that iteration freed everything at its first hook, so at the peak all state bytes
        counted in `_freed_this_iter` were already off. The high-water mark only says something
        when this iteration raised it (it also remembers start-up transients). Afterwards, and
        when the mark did not move, P only grows from sampled growth values, which are exact where
        they were taken and never overestimate.
        """
        if self._a0 is None:
            return
        sampled = max([self.profile_end or 0, *self.profile])
        peak = self._max_allocated()
        if self.peak_growth is None and self._freed_at_first_hook and peak > self._m0:
            self.peak_growth = peak - self._a0 + self._freed_this_iter
        self.peak_growth = max(self.peak_growth or 0, sampled)

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
        self._stepped.add(id(off))

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
        hosts the D2H and NCCL share the GPU's link.)
        """
        if self._copy_out_due:
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
        for off in self.offloaders:
            if id(off) in self._stepped:
                self._copy_out_due.append(off)
            else:
                # Skipped step (inf/nan, grad-norm threshold) or a stub: the reload may be in
                # flight and the state is unchanged, so the host copy is still current: what
                # came back leaves again without a D2H, the rest stays off.
                off.settle_unmodified()
                self._skipped_last_step = self._skipped_last_step or bool(off.chunks)
                self._trace(f"skipped:{off.name}")
        self._stepped.clear()
        self._stepped_out.clear()
        self._step_order.clear()
        self._step_budget_now = 0
        if self._step_level:
            self._last_step_level, self._step_level = self._step_level, 0
        self._train_forwards = 0
        self._backwards = 0
        self._workspace_mark = None
        self._window_open = False
        self._iterations_done += 1
        if self._recorder is not None:
            self._mark("step_end")
            self._choose_fraction()
        if self._chunks(ChunkState.COPYING_OUT) or self._copy_out_due:
            self.phase = Phase.FREEING
        self._trace("step_done")

    # ------------------------------------------------------------------------------------------
    # Chunked step (chunked_step.py): piece k of an offloader's step is its chunk k
    # ------------------------------------------------------------------------------------------
    def _step_budget(self) -> int:
        """Chunk bytes that may be resident during the step.

        The step should not set the iteration's peak: allocated memory there may reach what the
        forwards reached with the state off (`_fwd_end_max`, the same ceiling as the backward's
        reloads), less one chunk's worth of Adam temporaries (a foreach Adam over a piece
        allocates a few piece-sized lists) and the margin. Never below STEP_WINDOW_CHUNKS chunks,
        which the pipeline needs; when the activations leave more room, the whole state. See
        [Note: chunked-step budget] in docs/design.md.
        """
        slot = self._slot()
        if self.step_budget_bytes:
            return max(self.step_budget_bytes, slot)
        floor = STEP_WINDOW_CHUNKS * slot
        if not self._fwd_end_max:
            return floor
        other = self._allocated() - self._resident_bytes()
        return max(floor, self._fwd_end_max - other - slot - self.margin_bytes)

    def _backward_reload_cap(self) -> float:
        """Most chunk bytes the backward may bring back: unbounded for the unchunked step; for
        the chunked step its budget (the explicit one, else the last step's, else the minimum:
        the automatic budget reads memory the backward's activations still hold)."""
        if not self.chunked_step:
            return float("inf")
        if self.step_budget_bytes:
            return self._step_budget()
        return self.step_budgets[-1] if self.step_budgets else STEP_WINDOW_CHUNKS * self._slot()

    def _slot(self) -> int:
        return max((c.gpu_nbytes for _, c in self._chunks(*ChunkState)), default=0)

    def _resident_bytes(self) -> int:
        """GPU bytes of the chunk buffers that are allocated (in any state but OFFLOADED)."""
        return self.bytes_in(ChunkState.RESIDENT, ChunkState.COPYING_IN, ChunkState.COPYING_OUT)

    def _admit(self, todo, budget: int, force_first: bool = False) -> None:
        """Start the reload of the OFFLOADED chunks of `todo` ((offloader, chunk), in step order)
        while the state resident stays within `budget`, freeing chunks the step has already
        copied out to make room. `force_first`: the first one is needed now, budget or not."""
        for i, (off, chunk) in enumerate(todo):
            if chunk.state is not ChunkState.OFFLOADED:
                continue
            needed_now = force_first and i == 0
            over = self._resident_bytes() + chunk.gpu_nbytes - budget
            if over > 0:
                self._free_stepped(over, keep_latest=not needed_now)
                if self._resident_bytes() + chunk.gpu_nbytes > budget and not needed_now:
                    return
            self._own_allocations += off.start_copy_in([chunk])

    def _free_stepped(self, nbytes: int, keep_latest: bool = True) -> None:
        """Free chunks the step copied out, oldest copy first, until `nbytes` are freed or none
        is left. `free` makes the compute stream wait for the chunk's D2H, so with `keep_latest`
        the chunk stepped last is never taken: its D2H was enqueued just now, and waiting for it
        would hold the next piece's Adam, hence the next D2H, behind it: the D2H engine would
        idle during every piece and the H2D into its room would wait for both (each piece then
        takes clearly longer than its copies alone; see [Note: freeing stepped chunks] in
        docs/design.md). Left in flight, it is
        the next piece's room to free, by when its copy has run during that piece's Adam. The
        window is then: one chunk leaving, one stepped, one or more arriving (STEP_WINDOW_CHUNKS)."""
        candidates = self._stepped_out[:-1] if keep_latest else list(self._stepped_out)
        for off, chunk in candidates:
            if nbytes <= 0:
                break
            self._stepped_out.remove((off, chunk))
            if chunk.state is ChunkState.COPYING_OUT:
                nbytes -= off.free([chunk])

    def _begin_chunked_step(self, off: OptimizerStateOffloader):
        """The pieces of `off`'s step: chunks already back (or coming) first, then the rest."""
        self._stepping(off)
        if not self._step_budget_now:
            self._step_budget_now = self._step_budget()
        self.step_budgets = (self.step_budgets + [self._step_budget_now])[-64:]
        rank = {ChunkState.RESIDENT: 0, ChunkState.COPYING_OUT: 0, ChunkState.COPYING_IN: 1,
                ChunkState.OFFLOADED: 2}
        order = sorted(off.chunks, key=lambda c: rank[c.state])
        self._step_order[id(off)] = order
        # One piece per chunk (a parameter's state is never split across chunks), then one for
        # the parameters with no chunk: state kept by the fraction, or not created yet.
        return chunked_step.complete_pieces(off.dist_opt.optimizer, chunked_step.pieces_by_last_chunk(order))

    def _before_piece(self, off: OptimizerStateOffloader, k: int) -> None:
        order = self._step_order[id(off)]
        if k >= len(order):
            return
        self._admit([(off, c) for c in order[k:]], self._step_budget_now, force_first=True)
        off.make_resident(will_modify=True, chunks=[order[k]])
        self._step_level = max(self._step_level, self._allocated())

    def _after_piece(self, off: OptimizerStateOffloader, k: int) -> None:
        order = self._step_order[id(off)]
        if k >= len(order):
            return
        # Copy the stepped chunk out now only if a chunk still to be stepped (this optimizer's
        # or a later one's in the chain) needs its room; otherwise it stays resident and leaves
        # with the next forward like an unchunked step's state: a D2H enqueued now would also
        # hold up the loss read that follows the step (optimizer_step_done).
        later = order[k + 1:] + [c for o in self.offloaders if id(o) not in self._stepped for c in o.chunks]
        if not any(c.state is ChunkState.OFFLOADED for c in later):
            return
        off.start_copy_out([order[k]])
        self._stepped_out.append((off, order[k]))
        self._admit([(off, c) for c in order[k + 1:]], self._step_budget_now)

    # ------------------------------------------------------------------------------------------
    # Automatic fraction (auto_fraction.py)
    # ------------------------------------------------------------------------------------------
    def _activation_bytes(self) -> int:
        """Allocated bytes that are not chunk buffers (the planner's growth is relative)."""
        return self._allocated() - self._resident_bytes()

    def _mark(self, label: str) -> None:
        if self._recorder is not None:
            self._recorder.mark(label, self._activation_bytes())

    def _choose_fraction(self) -> None:
        """End of the calibration iteration: pick the fraction and re-pack the offloaders with it,
        before their copy-out (due at the next forward) is enqueued."""
        recorder, self._recorder = self._recorder, None
        self.streams.stats.stall_sink = None
        if self._skipped_last_step:
            # A skipped step: the state was sent back out unchanged. Measure the next iteration.
            self.auto_fraction_at = self._iterations_done + 1
            return
        timeline, stalls_ms = recorder.timeline()
        d2h, h2d = auto_fraction.bandwidth_of(self.streams.stats)
        first = self.auto_choice  # None in the first calibration iteration
        total = self.state_bytes + sum(off.kept_bytes for off in self.offloaders)
        # The second calibration keeps the first one's memory bound (`refine`): no room needed.
        room = self._memory_room() if first is None else math.inf
        choice = auto_fraction.choose(timeline, total, d2h, h2d, room, stalls_ms=stalls_ms)
        if first is not None:
            choice = auto_fraction.refine(first, choice)
        if self._smallest_in_group is not None:
            # Every rank of the group gets here in the same iteration: a step is skipped on all
            # ranks or on none (Megatron reduces inf/nan and the grad norm across them).
            choice = auto_fraction.agree(choice, self._smallest_in_group)
        self.auto_choice = choice
        self.auto_fraction_at = None
        if first is None:
            second = auto_fraction.needs_second_calibration(choice)
            if self._smallest_in_group is not None:
                # A collective in the next calibration: the group takes it if any rank needs it
                # (the maximum, as minus the minimum of the negated flags).
                second = -self._smallest_in_group(-float(second)) > 0
            if second:
                self.auto_fraction_at = self._iterations_done + 1
        self._trace(f"auto_fraction:{choice.fraction:.2f}")
        self._announce_fn(choice.describe())
        if choice.fraction >= 1.0 or choice.fraction == self.state_fraction:
            return
        self.state_fraction = choice.fraction
        for off in self.offloaders:
            off.fraction = choice.fraction
            if off.chunks:
                off.make_resident(will_modify=True)  # (the chunked step sent some out already)
                off.refresh()
        self._announce()

    # ------------------------------------------------------------------------------------------
    # Readers and writers of the state outside the step (checkpointing, RL, param reload)
    # ------------------------------------------------------------------------------------------
    def before_state_access(self, off: OptimizerStateOffloader, will_modify: bool,
                            host_copies_ok: bool = False) -> None:
        """A reader or writer of `off`'s state outside the step is about to run. Accesses that
        accept CPU tensors (`host_copies_ok`), and any access nested in one, run on the host
        copies (`expose_host_copies`), so that no moment puts the state back on the GPU at once:
        a reader (a checkpoint save) sees what is off the GPU on the host; a writer (a torch_dist
        load) first sends everything out (`send_out_now`), then writes into the pinned buffer,
        where the optimizer writes in place (`OptimizerStateOffloader.host_writes_supported`).
        Other accesses get the state back.

        Exception-safe: the access is recorded only once its preparation succeeded, so a failure
        here (e.g. an out-of-memory reload) leaves no access open; `state_access` pairs it with
        `after_state_access` whatever the access itself raises."""
        on_host = host_copies_ok or (bool(self._accesses) and self._accesses[-1] != "gpu")
        if on_host and not will_modify:
            kind = "host_read"
            off.expose_host_copies()
        elif on_host and self.host_loads and off.host_writes_supported():
            kind = "host_write"
            if off in self._copy_out_due:
                self._copy_out_due.remove(off)  # (stepped, still resident: sent out just below)
            off.send_out_now()
            off.expose_host_copies()
            self._trace(f"host_write:{off.name}")
        else:
            kind = "gpu"
            self._take_back(off, will_modify)
        self._suspended += 1
        self._accesses.append(kind)

    @contextlib.contextmanager
    def state_access(self, offloaders, will_modify: bool, host_copies_ok: bool = False):
        """`before_state_access` / `after_state_access` around a block, for each of `offloaders`.
        On any exception (in the preparation or the block) every access entered is closed again
        and the original exception propagates; a failure while closing is logged, never raised
        in its place."""
        entered = []
        try:
            for off in offloaders:
                self.before_state_access(off, will_modify=will_modify, host_copies_ok=host_copies_ok)
                entered.append(off)
            yield
        except BaseException:
            for off in reversed(entered):
                try:
                    self.after_state_access(off, modified=will_modify)
                except Exception:  # noqa: BLE001 - the access's own error is the one to report
                    logger.exception("megatron-offload: closing %s's state access after an error failed too", off.name)
            raise
        for off in reversed(entered):
            self.after_state_access(off, modified=will_modify)

    def _hide_host_copies(self) -> None:
        """A save that read state on the host (`before_state_access`) has finished writing by the
        next forward (Megatron's save is synchronous; async save is refused), and so has a load
        that wrote there: the tensors still off the GPU point back at their GPU buffers before
        anything treats them as GPU tensors."""
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
        kind = self._accesses.pop()
        if kind == "host_write":
            # What it wrote is in the host copies, which stay exposed until the next forward
            # (dist-checkpointing fills a load template after `sharded_state_dict` returned).
            off.accept_host_writes()
            self.phase = Phase.FREEING if self._chunks(ChunkState.COPYING_OUT) else Phase.OFFLOADED
            return
        if self._accesses:
            # Nested in another access (e.g. TE's `state_dict` inside a load's
            # `sharded_state_dict`): the state stays as it is until the outermost one closes, which
            # then re-discovers it if anything inside wrote.
            self._nested_writes = self._nested_writes or modified
            return
        modified, self._nested_writes = modified or self._nested_writes, False
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

    # ------------------------------------------------------------------------------------------
    # Reporting
    # ------------------------------------------------------------------------------------------
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
        pinning = sorted({off.host.pinning for off in self.offloaders if off.host is not None})
        return (
            f"rank {rank}: offloading {self.state_bytes / 2**30:.3f} GiB of optimizer state "
            f"(masters {masters / 2**30:.3f} GiB, moments {(self.state_bytes - masters) / 2**30:.3f}"
            f" GiB) from {len(self.offloaders)} optimizer(s) in "
            f"{sum(len(o.chunks) for o in self.offloaders)} chunks; pinned host "
            f"{self.pinned_bytes / 2**30:.3f} GiB ({', '.join(pinning) or 'none'})"
            + (f"; {kept / 2**30:.3f} GiB kept on the GPU (--offload-state-fraction "
               f"{self.state_fraction:g})" if kept else "")
            + f"; host memory now: {host_memory.read().describe()}"
        )

    def harvest(self) -> TransferTotals:
        return self.streams.stats.harvest()

    def close(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for off in self.offloaders:
            off.close()


class OffloadNotRunningError(RuntimeError):
    """Offloading was asked for but the training loop never let it run."""


class _Undo:
    """A removable handle for something that is undone by a function."""

    def __init__(self, undo: Callable[[], None]):
        self.remove = undo


def _by_offloader(pairs):
    """(offloader, chunk) pairs -> (offloader, [chunks]) in first-seen order: one transition call
    per offloader, so each batch waits once and records one event."""
    grouped = {}
    for off, chunk in pairs:
        grouped.setdefault(id(off), (off, []))[1].append(chunk)
    return list(grouped.values())


def _after(freed_at: Optional[int], position: int) -> bool:
    """Chunk freed before module `freed_at` is eligible once the backward finished it."""
    return freed_at is None or freed_at > position


def _rank(freed_at: Optional[int]) -> float:
    return float("inf") if freed_at is None else freed_at


def _in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. recomputing a checkpointed layer)."""
    return torch._C._current_autograd_node() is not None


def _free_block_reader(device: torch.device, stream) -> Optional[Callable[[], List[int]]]:
    """Reader of the free blocks of the caching allocator on `stream` (large pool only: chunks
    are > 1 MiB). Built on the allocator snapshot, which costs milliseconds per call with the
    default allocator and less with expandable segments (counted in fit_check_ms); called only in
    the reload window while chunks wait. See [Note: allocator query cost] in docs/design.md."""
    if not hasattr(torch.cuda, "memory_snapshot"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream_id = stream.cuda_stream

    def sizes() -> List[int]:
        free = []
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device") != index or seg.get("stream") != stream_id:
                continue
            if seg.get("segment_type") != "large":
                continue
            free.extend(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
        return free

    return sizes


def _allocator_stat(device: torch.device, which: str) -> Callable[[], int]:
    """Reader of the caching allocator's allocated bytes ("current", "peak", or "allocated": the
    cumulative bytes ever allocated).

    `torch.cuda.memory_allocated()` flattens and sorts the allocator's ~100 statistics on every
    call (see [Note: allocator query cost] in docs/design.md); the hooks read one number up to
    ~60 times per iteration, so read it straight from the nested statistics when this PyTorch has
    them."""
    if device.type != "cuda":
        return lambda: 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:
        try:
            raw(index)["allocated_bytes"]["all"][which]
            return lambda: raw(index)["allocated_bytes"]["all"][which]
        except (KeyError, TypeError, RuntimeError):
            pass
    if which == "allocated":
        return lambda: torch.cuda.memory_stats(index)["allocated_bytes.all.allocated"]
    public = torch.cuda.memory_allocated if which == "current" else torch.cuda.max_memory_allocated
    return lambda: public(index)


def pacing_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules whose forward pre-hooks pace freeing: every element of a `layers` ModuleList
    (Megatron's TransformerBlock / MambaStack), then the output layer. Falls back to the model's
    direct children when it has no such list."""
    found: List[torch.nn.Module] = []
    output_layers: List[torch.nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers":
            found.extend(module)
        elif name.split(".")[-1] == "output_layer":
            output_layers.append(module)
    if not found:
        found = list(model.children())
    return found + output_layers


def _first_grad_tensor(output) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            t = _first_grad_tensor(item)
            if t is not None:
                return t
    return None
