"""When state may leave the GPU: the free budget of the first forward and the growth profile it
reads, as methods of `OffloadCoordinator` (this module's one job; its attributes are set by
`_init_memory_policy`). The way back, the last backward's reloads, is reload_policy.py.

The memory budget. Let S be the state bytes being offloaded, A0 the allocated bytes when the
iteration's first forward starts (state still resident) and g(t) the activation growth since then
(measured allocated bytes plus the state bytes freed so far). The goal is that allocated never
exceeds A0 - S + P, P being the iteration's peak growth; with r(t) state bytes still resident
that means r(t) + g(t) <= P. At each layer's forward pre-hook we free chunks until
r <= P - g(next hook) - margin (`_margin`), g being the growth profile measured on earlier
iterations; after the last hook (output layer and loss, unsampled until the forward's end) the
budget is 0.
Unknown P (first offloaded iteration) makes the budget 0: free everything at the first hook;
so does an empty profile (learned again after memory kept for good: `_forget_lasting_growth`)
and a copy-out already finished there (nothing left to pace: `_free_when_copied_out`).
"""

from __future__ import annotations

import time
from typing import List, Optional

from .chunks import ChunkState
from .phase import Phase


class MemoryPolicy:
    """The free budget (`_free_until`) and the growth profile."""

    def _init_memory_policy(self) -> None:
        # the first forward's growth per layer (running max; emptied by `_forget_lasting_growth`)
        self.profile: List[int] = []
        self.profile_end: Optional[int] = None
        self.peak_growth: Optional[int] = None
        self.free_host_wait_ms = 0.0  # host time in the forward's frees (their waits included)
        # Allocated bytes other than state when the latest sampled first forward began
        # (`_forget_lasting_growth`), and how often a lasting growth made the profile be learned again.
        self._sampled_base: Optional[int] = None
        self.profile_relearned = 0
        self.profile_relearned_bytes = 0  # the lasting growth those times, summed
        # Allocated bytes other than state at the first sampled forward's start, and how far the
        # latest first forward's start was above them: the memory kept for good (`_margin`).
        self._first_base: Optional[int] = None
        self.kept_for_good_bytes = 0

    def _forget_lasting_growth(self, sampling: bool) -> None:
        """At the iteration's first forward, before it samples (`sampling`): if memory other than
        the state (`_base_bytes`) grew by more than a chunk slot since the latest sampled forward
        began, that growth stayed allocated, yet that sample counted it as activation growth.
        Lower P by it and learn the profile again (this forward frees everything at its first
        hook, as an unknown profile does, and samples exact growth).

        Why: P and the profile are running maxima, and the first sample usually comes from the
        first iteration, which creates what lives on for the whole run. Transformer Engine's FP8
        layers make their FP8 weight copies and transposes in the first forward: counted as
        growth, they raised every later budget by up to their size, and the first forward's peak
        kept that much state above A0 - S + P (module docstring).

        P less the growth is the true peak growth where the lasting memory appeared before the
        peak (the FP8 copies). Where it appeared after it (in the step), P comes out too low
        until samples raise it again (`_update_peak_growth`): a budget that frees earlier than
        needed, costing copy-out waits, not allocated memory. A profile learned again from
        scratch costs one forward that waits for the whole copy-out at its first layer; its
        chunks, freed there, come back only at the end of the backward (their reload position is
        the first layer). Growth below one chunk slot (or the margin) is left alone: the frees
        move a chunk at a time. The base is taken as seen whenever the rule fires, sampling or
        not, so that one growth counts once. It also updates `kept_for_good_bytes` (`_margin`).
        See [Note: lasting growth] in docs/design.md."""
        base = self._base_bytes()
        if self._first_base is None and sampling:
            self._first_base = base
        if self._first_base is not None:
            self.kept_for_good_bytes = max(0, base - self._first_base)
        grown = base - self._sampled_base if self._sampled_base is not None else 0
        fires = (self.config.forget_lasting_growth and self.peak_growth is not None
                 and grown > max(self.config.margin_bytes, self._slot()))
        if fires:
            self.peak_growth = max(0, self.peak_growth - grown)
            self.profile = []
            self.profile_end = None
            self.profile_relearned += 1
            self.profile_relearned_bytes += grown
            self._trace("profile_relearned")
        if fires or sampling:
            self._sampled_base = base

    def _base_bytes(self) -> int:
        """Allocated bytes other than the optimizer state: less the chunk buffers on the GPU and
        the buffers of the state a fraction keeps there."""
        kept = sum(c.gpu_nbytes for off in self.offloaders for c in off.kept_chunks)
        return self._allocated() - self.resident_bytes - kept

    def _pace_layer(self, h: int) -> None:
        """Layer `h` of the iteration's first forward is about to run (`layer_forward_begin`):
        record the activation growth so far, and free the chunks being copied out down to the
        budget that leaves layer h+1 its growth (module docstring), or all of them where their
        copy-out is already over (`_free_when_copied_out`)."""
        if self.it.sample is None or not self.it.sample.active:
            return
        growth = self._growth()
        if h < len(self.profile):
            self.profile[h] = max(self.profile[h], growth)
        else:
            self.profile.append(growth)
        if not self._chunks(ChunkState.COPYING_OUT):
            return
        self._free_until(self._budget_at(h), position=h)
        if self.config.free_when_copied_out or (h == 0 and self.config.free_copied_before_forward):
            self._free_when_copied_out(h)

    def _budget_at(self, h: int) -> int:
        """State bytes that may stay allocated once hook `h` has freed (module docstring)."""
        if self.peak_growth is None:
            return 0
        # After the last hook nothing is sampled until the forward's end, and what runs there
        # (output layer, loss) may allocate temporaries above the end's level and free them
        # before it: the growth at the end (`profile_end`) would leave chunks resident through
        # that transient, which is then the iteration's peak. So the last interval counts as
        # reaching P: everything still copying out is freed at the last hook.
        upcoming = self.profile[h + 1] if h + 1 < len(self.profile) else self.peak_growth
        return max(0, self.peak_growth - upcoming - self._margin())

    def _margin(self) -> int:
        """Bytes the budget keeps free below the peak: the configured margin, or with
        `lasting_growth_margin` the memory kept for good (`kept_for_good_bytes`: allocated bytes
        other than state at this iteration's first forward, above those at the first sampled
        one; what was freed again no longer counts) where that is larger.

        Why: memory that the first forward creates and keeps (Transformer Engine's FP8 weight
        copies) lies among that forward's activations, and stays there as islands once the
        activations are gone. Frees paced to the total growth then leave enough bytes free, but in
        pieces between islands and resident chunks, and an activation that fits none of them maps
        new memory: *reserved* memory grows although allocated memory stays at A0 - S + P. Freeing
        that much earlier leaves them room they fit. Costs copy-out waits where a free comes
        before its chunk's copy-out is over, and it moves where the activations land, which can
        itself change reserved memory a little either way; nothing where nothing was kept.
        See [Note: lasting margin] in docs/design.md."""
        if not self.config.lasting_growth_margin:
            return self.config.margin_bytes
        return max(self.config.margin_bytes, self.kept_for_good_bytes)

    def _free_when_copied_out(self, h: int) -> None:
        """Once every chunk still COPYING_OUT has finished its copy, free them all before layer `h`
        (no stream waits for anything), not only what the budget asks. Called at the first layer
        (`free_copied_before_forward`, on by default) and, with `free_when_copied_out`, at every layer.

        Why: the budget frees a chunk at a time as the activations grow, and each freed block is
        then cut up by the activations placed in it. Where the state is small against the
        activations, what is left between them are holes that a later large request (the fp32
        logits) fits in none of: it maps new memory, and the reserved peak keeps part of what was
        offloaded. Freed together, adjacent chunk blocks merge before any activation takes part
        of them (with expandable segments; without, each chunk is a segment of its own). Where the
        copy-out is still running, nothing changes: freeing early would stall the compute stream.
        The reload position (`freed_at`, see `_after`) of a chunk freed here is the hook k at which
        `_free_until(self._budget_at(k))` would have freed it (same order, same profile), so that it
        becomes eligible for a reload when it would have without the switch: its memory may hold
        activations of hooks h..k-1 until their backward, and only `_fitting` keeps its reload out
        of new memory. At the first layer the rule fires only where the copy-out ended before the
        forward began, so the forward never waits on it either way; its cost on the reloads is the
        same as at later layers. At later layers it was measured slower, hence off by default (the
        benchmark's @freecopied). See [Note: free when copied out] in docs/design.md."""
        pending = self._chunks(ChunkState.COPYING_OUT)
        if not pending or not all(off.copied_out(chunk) for off, chunk in pending):
            return
        # The budget's frees at the later hooks, replayed: on entry `remaining <= _budget_at(h)`
        # (hook h's own frees just ran), and `profile[k + 1]`, which `_budget_at(k)` reads, is not
        # updated before hook k + 1, so the values read now are those the later hooks would see.
        due, hook, last = {}, h, max(h, len(self.profile) - 1)
        remaining = sum(chunk.gpu_nbytes for _, chunk in pending)
        for _, chunk in _in_free_order(pending):
            while hook < last and remaining <= self._budget_at(hook):
                hook += 1
            due[id(chunk)] = hook
            remaining -= chunk.gpu_nbytes
        self._free_until(0, position=h)
        self.it.freed_at.update(due)

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
        pending = _in_free_order(self._chunks(ChunkState.COPYING_OUT))
        remaining = sum(c.gpu_nbytes for _, c in pending)
        chosen = []
        for off, chunk in pending:
            if remaining <= budget:
                break
            chosen.append((off, chunk))
            remaining -= chunk.gpu_nbytes
            self.it.freed_at[id(chunk)] = position
        # With `host_waits_at_free` the host waits for the copy-out of what it frees, as the
        # compute stream must. The idea: a forward that needs the memory before the D2H is done
        # stalls the GPU here; a host that does not stall with it runs ahead by the whole stall
        # (which can be a large part of an iteration where the state is large against the copy
        # window), and memory freed meanwhile across streams (the weight gradients, which
        # Megatron's DDP accumulates on a stream of its own) is only reusable once the GPU gets
        # there: allocations made that far ahead map new memory. With the wait the reserved peak
        # came out lower in some iterations and not in others, and every step took a little
        # longer: not a clear gain, so off by default (OffloadConfig.host_waits_at_free; the benchmark's @hostwait).
        # See [Note: host waits at free] in docs/design.md.
        start = time.perf_counter()
        freed = sum(off.free(chunks, host_waits=self.config.host_waits_at_free) for off, chunks in _by_offloader(chosen))
        self.free_host_wait_ms += (time.perf_counter() - start) * 1e3
        if self.it.sample is not None:
            self.it.sample.freed += freed
        if freed and not self._chunks(ChunkState.COPYING_OUT):
            self.phase = Phase.OFFLOADED
            self._trace("offloaded")
            if position is not None:
                self._release_cache_at("offloaded")
        return freed

    def _growth(self) -> int:
        sample = self.it.sample
        return self._allocated() - sample.allocated_at_start + sample.freed

    def _update_peak_growth(self) -> None:
        """P, the iteration's peak activation growth (module doc).

        Measured exactly once, in the first sampled iteration, from the allocator's high-water
        mark: that iteration freed everything at its first hook, so at the peak all state bytes
        counted in the sample's `freed` were already off. The high-water mark only says something
        when this iteration raised it (it also remembers start-up transients). Afterwards, and
        when the mark did not move, P only grows from sampled growth values, which are exact where
        they were taken and never overestimate; it falls only by memory kept for good since a
        sample (`_forget_lasting_growth`), which that sample counted as growth.
        """
        sample = self.it.sample
        if sample is None:
            return
        sampled = max([self.profile_end or 0, *self.profile])
        peak = self._max_allocated()
        if self.peak_growth is None and sample.freed_at_first_hook and peak > sample.max_allocated_at_start:
            self.peak_growth = peak - sample.allocated_at_start + sample.freed
        self.peak_growth = max(self.peak_growth or 0, sampled)


def _by_offloader(pairs):
    """(offloader, chunk) pairs -> (offloader, [chunks]) in first-seen order: one transition call
    per offloader, so each batch waits once and records one event."""
    grouped = {}
    for off, chunk in pairs:
        grouped.setdefault(id(off), (off, []))[1].append(chunk)
    return list(grouped.values())


def _in_free_order(pairs):
    """(offloader, chunk) pairs in the order `_free_until` frees them: highest address first."""
    return sorted(pairs, key=lambda pair: -pair[1].address)
