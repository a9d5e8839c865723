"""When state may come back to the GPU: the reloads of the last backward, as methods of
`OffloadCoordinator` (this module's one job; its attributes are set by `_init_reload_policy`).
The free budget they mirror is memory_policy.py's.

Reloads in the last backward(s) follow the same rule in reverse: a chunk comes back when
allocated + its bytes stays below the highest allocated level seen at the end of a forward in
this iteration, which the state was already off for, and, since *reserved* memory is what runs
out, only once the backward has finished the layers that ran after its free (its reload position,
`IterationRecord.freed_at`: for a chunk `_free_when_copied_out` freed, the hook whose budget would have)
and the caching allocator holds one free block that takes it (`_reload_up_to`, `_fitting`).
"""

from __future__ import annotations

import bisect
import collections
import time
from typing import Deque, Dict, List, Optional, Tuple

from .chunks import ChunkState
from .memory_policy import _by_offloader
from .phase import Phase

# Free blocks smaller than this do not count as room for a layer's backward temporaries
# (`_fitting`): those are activation-sized, and a reload must not leave only crumbs.
# See [Note: backward workspace] in docs/design.md.
WORKSPACE_MIN_BLOCK = 64 * 2**20
# Iterations whose reload start is kept (`reload_starts`): a benchmark's run, bounded for long jobs.
RELOAD_STARTS_KEPT = 256


class ReloadPolicy:
    """The memory-aware reloads (`_reload_up_to`, `_fitting`, `_room_for_fallback`) and the
    backward workspace they leave room for."""

    def _init_reload_policy(self) -> None:
        # What each interval of the first backward allocated (own reloads excluded), keyed by the
        # position of the hook that began it (`_workspace_for`; None: a hook of unknown position).
        self.workspace_per_interval: Dict[Optional[int], int] = {}
        self.model_chunks = 0  # model chunks `watch_model` hooked (their positions coincide)
        self._own_allocations = 0  # chunk bytes the reloads allocated (on the compute stream)
        self.fit_checks = 0  # calls of _free_block_sizes, and their host time
        self.fit_skips = 0  # fit checks answered by the counters alone (nothing could fit)
        self.fit_check_ms = 0.0
        self.reloads_deferred_for_fit = 0
        # Where each iteration's reloads began, for the benchmark (the last RELOAD_STARTS_KEPT):
        # (iterations done, the `position` of that first `_reload_up_to`; -1: the fallback at
        # grads_finalizing; None: a hook of unknown position, inside a recomputation). An
        # iteration without an entry brought its state back in the step (the chunked step's
        # admission). And the chunks the position rule held back, counted once per call that did.
        self.reload_starts: Deque[Tuple[int, Optional[int]]] = collections.deque(maxlen=RELOAD_STARTS_KEPT)
        self.reloads_deferred_for_position = 0

    def _reload_up_to(self, ceiling: Optional[int], position: Optional[int] = None) -> int:
        """Start H2D for OFFLOADED chunks while allocated + their bytes stays <= ceiling.

        `position`: the backward has finished every pacing module after this one. A chunk freed
        before module h is then only eligible once h > position, i.e. once the activations that
        may have been placed in its memory (those of modules h, h+1, ...) are released (a chunk
        `_free_when_copied_out` freed earlier than its budget would have is eligible from that
        budget's hook on, and `_fitting` alone keeps it out of memory activations still hold). Reloading
        earlier, by `allocated` alone, finds enough free bytes but not in one piece: the caching
        allocator then creates a new segment and *reserved* memory grows by the chunk while
        allocated looks fine. Latest-freed chunks come back first, mirroring the order in which
        the backward releases memory. This rule alone did not lower reserved memory measurably
        (the activations of the last microbatch are not placed like the first's); `_fitting`
        below is what did. See [Note: reload order] in docs/design.md.
        """
        todo = self._chunks(ChunkState.OFFLOADED)
        if position is not None:
            eligible = [(off, c) for off, c in todo if _after(self.it.freed_at.get(id(c)), position)]
            self.reloads_deferred_for_position += len(todo) - len(eligible)
            todo = sorted(eligible, key=lambda pair: -_rank(self.it.freed_at.get(id(pair[1]))))
        if not todo:
            return 0
        allocated = self._allocated() if ceiling is not None else 0
        # The chunked step holds at most its budget: what comes back now is held until stepped.
        cap = self._backward_reload_cap()
        resident = self.resident_bytes
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
            chosen = self._fitting(chosen, self._workspace_for(position))
        moved = sum(off.start_copy_in(chunks) for off, chunks in _by_offloader(chosen))
        self._own_allocations += moved
        if moved:
            if self.phase is not Phase.RELOADING:
                self._trace("reload_start")
                where = position if position is not None else -1 if ceiling is None else None
                self.reload_starts.append((self._iterations_done, where))
            self.phase = Phase.RELOADING
        return moved

    def _fitting(self, chosen, workspace: Optional[int] = None):
        """The leading chunks of `chosen` that fit the allocator's free blocks as they are now,
        leaving the next layer's backward its `workspace` (default: `backward_workspace`).

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
        allocated (measured in the iteration's first backward; `_workspace_for`).
        """
        if workspace is None:
            workspace = self.backward_workspace
        # The snapshot walks every block of the allocator (milliseconds a call); the counters say
        # in microseconds when even all free bytes together could not take the first chunk and
        # leave the workspace (`chosen` is never empty here).
        if (self._free_mapped is not None
                and self._free_mapped() < _request_bytes(chosen[0][1]) + workspace):
            self.fit_skips += 1
            self.reloads_deferred_for_fit += len(chosen)
            return []
        start = time.perf_counter()
        blocks = sorted(self._free_block_sizes())
        smallest_useful = min(WORKSPACE_MIN_BLOCK, self._slot())
        self.fit_checks += 1
        self.fit_check_ms += (time.perf_counter() - start) * 1e3
        fitted = []
        for off, chunk in chosen:
            after = list(blocks)
            if not _take_best_fit(after, _request_bytes(chunk)):
                break
            if sum(b for b in after if b >= smallest_useful) < workspace:
                break
            blocks = after
            fitted.append((off, chunk))
        self.reloads_deferred_for_fit += len(chosen) - len(fitted)
        return fitted

    def _room_for_fallback(self, chunks=None) -> None:
        """Before the fallback reload (`grads_finalizing`) of an iteration whose first forward
        found every chunk off the GPU: if the chunks it reloads (`chunks`; default: every chunk
        still off) fit no set of the allocator's free blocks (best-fit, in the order they are
        reloaded), hand the mapped free memory back to the device first.

        Why: the reload would map new memory above blocks that are free but too small, and that
        memory stays mapped: reserved grows for good by the chunks that did not fit. The free
        blocks are too small where they were cut by activations laid out with no chunk among
        them, i.e. in the first iteration after a start-up offload, an evaluation or
        `offload_all`, and that iteration's mapping then stays the peak of every later one. In
        the other iterations the activations sat in the memory the forward freed chunks from,
        and what the fallback maps is reused from the iteration before: no release there (it
        would cost a host wait and new mappings every iteration). Where the activations' layout
        does not follow the chunks' (Transformer Engine's FP8 layers), reserved memory grows once
        more, in the iteration after; a release there would recur in nearly every iteration, and
        the allocator frees this cache itself before it reports out of memory (the diagnostic
        `fallback_release_every_iteration` releases anyway). Once the backward has released its
        activations, what is free is cache; the next forward maps again only what it uses.
        With the streamed step `chunks` are those its budget admits at `grads_finalizing` (with
        the automatic budget usually all of them); the step brings the rest back into the room
        of chunks it has sent out. Not with `backward_reloads=False` (a diagnostic whose fit
        reader answers "nothing fits"). See [Note: fallback release] in docs/design.md."""
        if (not self.config.release_before_unfitted_reload or not self.config.backward_reloads
                or self._free_block_sizes is None
                or not (self.it.began_offloaded or self.config.fallback_release_every_iteration)):
            return
        if chunks is None:
            chunks = [c for _, c in self._chunks(ChunkState.OFFLOADED)]
        todo = [_request_bytes(c) for c in chunks]
        if not todo:
            return
        free = self._free_mapped() if self._free_mapped is not None else None
        if free is not None and free < min(todo):
            return  # (less cached than one chunk: nothing worth a wait for the compute stream)
        # (The counters saying that not even all free bytes together hold them: no snapshot.)
        if free is None or free >= sum(todo):
            start = time.perf_counter()
            blocks = sorted(self._free_block_sizes())
            self.fit_checks += 1
            self.fit_check_ms += (time.perf_counter() - start) * 1e3
            if all(_take_best_fit(blocks, need) for need in todo):
                return
        self._trace("release:fallback")
        self._release_cache()

    def _begin_workspace_sample(self, first: bool) -> None:
        """At `backward_begin`: the first backward of each iteration (`first`) measures the
        workspace (`_fitting`); a later one would count the same layers again. Its first interval,
        keyed by the forward's module count, runs until the gradient of the last pacing module's
        output is ready (the loss's backward; the output layer's own is the next interval where it
        is a pacing module); the reloads started at `backward_begin` leave room for it too."""
        it = self.it
        it.workspace_mark = self._allocated_total() - self._own_allocations if first else None
        it.workspace_key = it.position

    def _sample_workspace(self, next_key: Optional[int], last: bool = False) -> None:
        """At a backward hook of the iteration's first backward: what the interval since the last
        hook allocated (the allocator's cumulative counter, less the reloads' own chunks), kept
        under the position of the hook that began it (`workspace_key`); `next_key` begins the
        next one (`layer_backward_begin`'s position). `last`: the backward's end, which ends the
        measurement."""
        it = self.it
        if it.workspace_mark is None or not self.config.keep_backward_workspace:
            return
        now = self._allocated_total() - self._own_allocations
        used = now - it.workspace_mark
        key = it.workspace_key
        self.workspace_per_interval[key] = max(self.workspace_per_interval.get(key, 0), used)
        it.workspace_mark = None if last else now
        it.workspace_key = next_key

    @property
    def backward_workspace(self) -> int:
        """The most any interval of the first backward allocated (0 before one was measured)."""
        return max(self.workspace_per_interval.values(), default=0)

    def _workspace_for(self, position: Optional[int]) -> int:
        """The room a reload at backward hook `position` leaves (`_fitting`): the most any
        interval still to come in this backward allocated, i.e. those begun at hooks 0..position
        (positions count down through the backward; `backward_begin`'s is the forward's count, so
        there it is every interval). The last interval (layer 0 and the embedding's backward,
        closed by `backward_end`) is always still to come: the room is never below it.

        Why not the largest of all: the intervals of the loss and the output layer (logits over
        the vocabulary, in fp32 for the loss) grow with the vocabulary and the tokens of a
        microbatch, a transformer layer's do not; where they are the largest, demanding their room
        of every later reload would hold chunks back that the layers' temporaries leave room for.
        The figures are what each interval allocated in all, reused temporaries counted again: an
        upper bound of what it holds at once. The largest of all is kept where an interval still
        to come was never measured (a hook of unknown position; a loop that does not call
        `backward_end`), where several model chunks share the positions (the first backward
        measures one chunk's intervals; `watch_model` counts them, a loop that calls the layer
        hooks itself sets `model_chunks`), and with the rule off (the benchmark's @wsmax). See
        [Note: backward workspace] in docs/design.md."""
        ws = self.workspace_per_interval
        if (position is None or not self.config.workspace_by_position or None in ws or self.model_chunks > 1
                or any(k not in ws for k in range(position + 1))):
            return self.backward_workspace
        return max(ws[k] for k in range(position + 1))

    def _reload_ceiling(self) -> int:
        """Allocated bytes the backward's reloads may reach: the highest level of a forward's end
        in this iteration, which the state was already off for. With the chunked step, also the
        level the last step reached with its budget resident (before its Adam temporaries): when
        the step is the iteration's peak (full recompute), waiting for the forwards' level
        left the whole budget to load between the backward and the step, exposed as a wait
        before it. See [Note: chunked-step budget] in docs/design.md."""
        if not self.config.chunked_step:
            return self.it.forward_end_max
        return max(self.it.forward_end_max, self._last_step_level)


def _take_best_fit(blocks: List[int], need: int) -> bool:
    """Place a request of `need` bytes in the smallest of the sorted free `blocks` that holds it,
    as the caching allocator would (the block's rest stays free); False where none does."""
    i = bisect.bisect_left(blocks, need)
    if i == len(blocks):
        return False
    rest = blocks.pop(i) - need
    if rest > 0:
        bisect.insort(blocks, rest)
    return True


def _request_bytes(chunk) -> int:
    """What the caching allocator takes for the chunk's buffer (large requests round up to 512)."""
    return (chunk.gpu_nbytes + 511) // 512 * 512


def _after(freed_at: Optional[int], position: int) -> bool:
    """A chunk whose reload position is `freed_at` (the module it was freed before, or where its
    budget would have freed it: `_free_when_copied_out`) is eligible once the backward finished it."""
    return freed_at is None or freed_at > position


def _rank(freed_at: Optional[int]) -> float:
    return float("inf") if freed_at is None else freed_at
