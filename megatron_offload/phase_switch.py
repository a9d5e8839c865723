"""Phase switches: the whole optimizer state off the GPU and back between training phases (e.g. an
RL loop that generates with an inference engine on the same GPUs), through the same exact-size
pinned buffers and chunks as the per-step offload. A mixin of `OffloadCoordinator`.

    coord = megatron_wiring.coordinator or phase_switcher(optimizer)   # with or without the flag
                                                                        # (coordinator.phase_switcher)
    coord.offload_all().wait(); torch.cuda.empty_cache()                # memory back to the driver
    ... generate ...
    coord.restore_all()                                                 # asynchronous; the next
    ... train ...                                                       # step is ordered after it

Between steps only (not inside a forward, backward, step or checkpoint access). With
`--offload-optimizer-states` the per-step schedule stays consistent: `restore_all` leaves every
chunk resident with its host copy current, so the next forward frees it again without a copy, and
the plugin's checkpoint wrappers guard every reader and writer. A `phase_switcher` (no flag) has
no such wrappers: its `restore_all` marks the host copies stale (whatever writes the state before
the next `offload_all` is copied out again), and checkpoint saves and loads need the state back
(`restore_all`) first.
"""

from __future__ import annotations

from typing import List, Optional

from .chunks import ChunkState
from .phase import Phase


class PhaseSwitchError(RuntimeError):
    """A phase switch asked for where it cannot run."""


class SwitchHandle:
    """The copies of one phase switch: `wait()` blocks the host until they are done."""

    def __init__(self, events: List, nbytes: int):
        self._events = [e for e in events if e is not None]
        self.nbytes = nbytes  # bytes of GPU memory this switch freed (offload_all) or filled (restore_all)

    def done(self) -> bool:
        return all(e.query() for e in self._events)

    def wait(self) -> "SwitchHandle":
        for e in self._events:
            e.synchronize()
        return self


class PhaseSwitch:
    """`offload_all` / `restore_all` over the coordinator's offloaders (module docstring)."""

    def offload_all(self, release_memory: bool = False) -> SwitchHandle:
        """Every chunk of state off the GPU: copy out what changed since its host copy, then free.

        The frees are ordered after the copies on the compute stream, so training could go on at
        once; memory handed to another allocator (an inference engine) needs the copies done:
        `wait()`, then `torch.cuda.empty_cache()`. `release_memory=True` does both here."""
        self._check_switch("offload_all")
        self._hide_host_copies()
        self.start_pending_copy_out()
        if any(off.needs_refresh for off in self.offloaders):
            # State that was never packed (built without the per-step flag, or replaced by a
            # load): packed, copied out and freed chunk by chunk, as at start-up.
            self.offload_existing_state(materialize=False)
        for off in self.offloaders:
            off.start_copy_out()  # RESIDENT chunks: stepped since they were last copied out
            off.flush_copy_out()  # (with the feeder: every copy-out enqueued, its event known)
        events = [c.ready for off in self.offloaders for c in off.chunks_in(ChunkState.COPYING_OUT)]
        moved = self._free_until(0)
        self._trace("offload_all")
        handle = SwitchHandle(events, moved)
        if release_memory:
            handle.wait()
            self._hand_back_cached_memory()
        return handle

    def restore_all(self) -> SwitchHandle:
        """Every offloaded chunk back to the GPU, asynchronously. The compute stream is ordered
        after the copies (the host is not blocked); chunks end resident with their host copy
        current, so the per-step offload frees them again at the next forward without a copy."""
        self._check_switch("restore_all")
        # Why: a save may have left tensors at its snapshots, of chunks still on the GPU too
        # (an in-place device fill), which no copy-in below would point back.
        self._hide_host_copies()
        incoming = [(off, off.chunks_in(ChunkState.OFFLOADED)) for off in self.offloaders]
        moved = sum(off.start_copy_in(chunks) for off, chunks in incoming)
        events = [c.ready for _, chunks in incoming for c in chunks]
        for off in self.offloaders:
            if self.config.per_step:
                off.settle_unmodified()  # COPYING_IN -> COPYING_OUT, compute stream after the H2D
            else:
                # Nothing guards the writers here (module docstring): RESIDENT, host copy stale.
                off.make_resident(will_modify=True)
        self.phase = Phase.FREEING if self.bytes_in(ChunkState.COPYING_OUT) else self.phase
        self._trace("restore_all")
        return SwitchHandle(events, moved)

    def _check_switch(self, what: str) -> None:
        problem: Optional[str] = None
        if self.closed:
            problem = "the coordinator is closed"
        elif self._accesses:
            problem = "a checkpoint access is in progress"
        elif self.config.per_step and not self.it.between_steps:
            problem = f"the training iteration is in progress ({self.it.state.value})"
        elif any(off.kept_bytes for off in self.offloaders):
            problem = "part of the state is kept resident (--offload-state-fraction below 1)"
        if problem:
            raise PhaseSwitchError(f"megatron-offload: {what} runs between optimizer steps only, with the whole state "
                                   f"offloadable; here {problem}.")

