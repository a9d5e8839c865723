"""The streamed step's schedule (the default engine, `--offload-step streamed`): piece k of an offloader's step steps the
parameters whose state is complete once its chunk k (in stepping order) is back; which chunks are loaded ahead, stepped
and sent out behind within the step's memory budget.
Methods of `OffloadCoordinator` (chunked_step.py installs the piecewise step that calls them); their
attributes are set by `_init_chunked_schedule`.
"""

from __future__ import annotations

from typing import List

from . import chunked_step
from .chunks import ChunkState
from .offloader import OptimizerStateOffloader

# The chunked step keeps at least this many chunks' room for state during the step: one being
# stepped, the next one loading, the previous one still copying out (its D2H must finish before its
# memory can take the one after next).
STEP_WINDOW_CHUNKS = 3


class ChunkedStepSchedule:
    """The step budget and the admission, stepping and early release of chunks during the step."""

    def _init_chunked_schedule(self) -> None:
        self.step_budgets: List[int] = []  # the budget of each chunked step so far (bounded)
        self.step_waiting: List[int] = []  # beside each: the most chunks held back (`_most_waiting`)
        self._step_level = 0  # highest allocated level at a piece's start, this step and the last
        self._last_step_level = 0
        self._skipped_last_step = False

    def _step_budget(self, waiting: int = 0) -> int:
        """Chunk bytes that may be resident during the step.

        The step should not set the iteration's peak: allocated memory there may reach what the
        forwards reached with the state off (`it.forward_end_max`, the same ceiling as the backward's
        reloads), less one chunk's worth of Adam temporaries (a foreach Adam over a piece
        allocates a few piece-sized lists) and the margin. Never below STEP_WINDOW_CHUNKS chunks,
        which the pipeline needs, plus `waiting` (`_most_waiting`); when the activations leave
        more room, the whole state. See [Note: chunked-step budget] in docs/design.md.
        """
        floor = self._step_floor(waiting)
        if self.step_budget_bytes:
            return floor
        if not self.it.forward_end_max:
            return floor
        other = self._allocated() - self.resident_bytes
        return max(floor, self.it.forward_end_max - other - self._slot() - self.config.margin_bytes)

    def _step_floor(self, waiting: int) -> int:
        """The least step budget: the explicit one but at least one chunk, else STEP_WINDOW_CHUNKS
        chunks; plus `waiting` chunks either way (held back for split parameters)."""
        slot = self._slot()
        if self.step_budget_bytes:
            return max(self.step_budget_bytes, (1 + waiting) * slot)
        return (STEP_WINDOW_CHUNKS + waiting) * slot

    def _backward_reload_cap(self) -> float:
        """Most chunk bytes the backward may bring back: unbounded for the unchunked step; for
        the chunked step its budget (the explicit one, else the last step's, else the minimum:
        the automatic budget reads memory the backward's activations still hold)."""
        if not self.config.chunked_step:
            return float("inf")
        if self.step_budget_bytes:
            return self._step_budget()
        return self.step_budgets[-1] if self.step_budgets else STEP_WINDOW_CHUNKS * self._slot()

    def _slot(self) -> int:
        return max((c.gpu_nbytes for _, c in self._chunks(*ChunkState)), default=0)

    def _admit(self, todo, budget: int, force_first: bool = False) -> None:
        """Start the reload of the OFFLOADED chunks of `todo` ((offloader, chunk), in step order)
        while the state resident stays within `budget`, freeing chunks the step has already
        copied out to make room. `force_first`: the first one is needed now, budget or not."""
        for i, (off, chunk) in enumerate(todo):
            if chunk.state is not ChunkState.OFFLOADED:
                continue
            needed_now = force_first and i == 0
            over = self.resident_bytes + chunk.gpu_nbytes - budget
            if over > 0:
                self._free_stepped(over, keep_latest=not needed_now)
                if self.resident_bytes + chunk.gpu_nbytes > budget and not needed_now:
                    return
            self._own_allocations += off.start_copy_in([chunk])

    def _admissible(self, todo, budget: int):
        """The leading OFFLOADED chunks of `todo` that fit `budget` beside the resident state, without
        freeing anything (outside a step nothing stepped can be freed): what `_admit` reloads there."""
        resident, out = self.resident_bytes, []
        for off, chunk in todo:
            if chunk.state is not ChunkState.OFFLOADED:
                continue
            if resident + chunk.gpu_nbytes > budget:
                break
            resident += chunk.gpu_nbytes
            out.append((off, chunk))
        return out

    def _free_stepped(self, nbytes: int, keep_latest: bool = True) -> None:
        """Free chunks the step copied out, oldest copy first, until `nbytes` are freed or none
        is left. `free` makes the compute stream wait for the chunk's D2H, so with `keep_latest`
        the chunk stepped last is never taken: its D2H was enqueued just now, and waiting for it
        would hold the next piece's Adam, hence the next D2H, behind it: the D2H engine would
        idle during every piece and the H2D into its room would wait for both (each piece then
        takes clearly longer than its copies alone; see [Note: freeing stepped chunks] in
        docs/design.md). Left in flight, it is
        the next piece's room to free, by when its copy has run during that piece's Adam. The
        window is then: one chunk leaving, one stepped, one or more arriving (STEP_WINDOW_CHUNKS).
        (A piece that completes a parameter split over several chunks sends them all out at once;
        all of them count as the latest.)"""
        latest = self.it.latest_out if keep_latest else 0
        candidates = self.it.stepped_out[:max(0, len(self.it.stepped_out) - latest)]
        for off, chunk in candidates:
            if nbytes <= 0:
                break
            self.it.stepped_out.remove((off, chunk))
            if chunk.state is ChunkState.COPYING_OUT:
                nbytes -= off.free([chunk])

    def _begin_chunked_step(self, off: OptimizerStateOffloader):
        """The pieces of `off`'s step: chunks already back first, then those coming back in the
        order they arrive, then the rest.

        Why arrival order: the backward reloads the latest-freed chunks first (the reverse of
        their index order); stepping in index order made the first piece wait for the last
        chunk to arrive, so the step, and the copy-out behind each piece, began only once the
        whole reload was done. See [Note: step order] in docs/design.md."""
        self._stepping(off)
        rank = {ChunkState.RESIDENT: 0, ChunkState.COPYING_OUT: 0, ChunkState.COPYING_IN: 1,
                ChunkState.OFFLOADED: 2}
        order = sorted(off.chunks, key=lambda c: (rank[c.state],
                                                  c.copy_in_seq if c.state is ChunkState.COPYING_IN else 0))
        self.it.step_order[id(off)] = order
        pieces = chunked_step.pieces_by_last_chunk(order)
        leaving = self.it.leaving_after[id(off)] = self._leaving_after(order, pieces)
        waiting = self._most_waiting(order, leaving)
        if not self.it.step_budget:
            self.it.step_budget = self._step_budget(waiting)
        else:
            # Set at grads_finalizing (its admission) or by an earlier optimizer of a chain, without
            # this order's held-back chunks: raised to this optimizer's own least.
            self.it.step_budget = max(self.it.step_budget, self._step_floor(waiting))
        self.step_budgets = (self.step_budgets + [self.it.step_budget])[-64:]
        self.step_waiting = (self.step_waiting + [waiting])[-64:]
        # One piece per chunk: the parameters whose state is complete once that chunk is back
        # (empty for a chunk holding only the first part of a parameter split over several), then
        # one for the parameters with no chunk: state kept by the fraction, or not created yet.
        return chunked_step.complete_pieces(off.dist_opt.optimizer, pieces)

    @staticmethod
    def _leaving_after(order, pieces) -> List[list]:
        """Entry k: the chunks of `order` whose every parameter has been stepped once piece k (of
        `pieces`, `pieces_by_last_chunk(order)`) is, in `order`. A chunk holds whole parameters (then it
        leaves after its own piece) unless the packing split a parameter larger than half a chunk
        over several (`chunks.layout_chunks`): then a chunk with part of it stays until the piece of
        its last part, since sending it out earlier would leave a host copy that the step then
        makes stale."""
        piece_of = {id(p): k for k, piece in enumerate(pieces) for p in piece}
        leaving: List[list] = [[] for _ in order]
        for chunk in order:
            leaving[max(piece_of[id(st.param)] for st in chunk.tensors)].append(chunk)
        return leaving

    @staticmethod
    def _most_waiting(order, leaving) -> int:
        """The most chunks that, at one piece, have been stepped but cannot leave yet (they hold
        part of a parameter stepped by a later piece, `_leaving_after`): what the step must hold
        beyond its usual window. 0 where no parameter is split."""
        left_at = {id(chunk): j for j, chunks in enumerate(leaving) for chunk in chunks}
        # A chunk at i leaving after piece j > i waits through pieces i + 1 .. j (one pass: this
        # runs at every step, over every chunk).
        change = [0] * (len(order) + 1)
        for i, chunk in enumerate(order):
            if left_at[id(chunk)] > i:
                change[i + 1] += 1
                change[left_at[id(chunk)] + 1] -= 1
        most = waiting = 0
        for delta in change:
            waiting += delta
            most = max(most, waiting)
        return most

    def _before_piece(self, off: OptimizerStateOffloader, k: int) -> None:
        order = self.it.step_order[id(off)]
        if k >= len(order):
            return
        self._admit([(off, c) for c in order[k:]], self.it.step_budget, force_first=True)
        off.make_resident(will_modify=True, chunks=[order[k]])
        self._step_level = max(self._step_level, self._allocated())

    def _after_piece(self, off: OptimizerStateOffloader, k: int) -> None:
        order = self.it.step_order[id(off)]
        if k >= len(order):
            return
        # Copy the stepped chunk out now only if a chunk still to be stepped (this optimizer's
        # or a later one's in the chain) needs its room; otherwise it stays resident and leaves
        # with the next forward like an unchunked step's state: a D2H enqueued now would also
        # hold up the loss read that follows the step (optimizer_step_done).
        # With the feeder (copy_feeder.py) that read is not held up: every stepped chunk leaves now.
        later = order[k + 1:] + [c for o in self.offloaders if id(o) not in self.it.stepped for c in o.chunks]
        if self.feeder is None and not any(c.state is ChunkState.OFFLOADED for c in later):
            return
        leaving = self.it.leaving_after[id(off)][k]
        if leaving:
            off.start_copy_out(leaving)
            self.it.stepped_out.extend((off, chunk) for chunk in leaving)
            self.it.latest_out = len(leaving)
        self._admit([(off, c) for c in order[k + 1:]], self.it.step_budget)
