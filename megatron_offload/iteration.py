"""Where one process is in the training iteration: the state the coordinator's hooks branch on,
its checked transitions, and the record of one iteration (built anew after every step).

    STARTUP ──first forward──▶ FIRST_FORWARD ──next forward──▶ LATER_FORWARDS
                                     │                               │
                                     └────── last backward begins ───┴──▶ RELOAD_WINDOW
    any of them ──inner optimizer step──▶ STEPPING ──step done──▶ AFTER_STEP ──first forward──▶ ...

`Phase` (phase.py) says where the *state* is; this says where the *loop* is.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, List, Optional, Set, Tuple

from .chunks import IllegalTransition


class IterationState(enum.Enum):
    STARTUP = "startup"  # no optimizer step has run yet, no training forward in this iteration
    AFTER_STEP = "after_step"  # a step ran; the next training forward has not begun
    FIRST_FORWARD = "first_forward"  # the iteration's first training forward (frees, samples)
    LATER_FORWARDS = "later_forwards"  # a later microbatch's forward (or its backward)
    RELOAD_WINDOW = "reload_window"  # no forward follows this iteration: the backwards reload
    STEPPING = "stepping"  # inside an inner optimizer step


_BETWEEN = {IterationState.STARTUP, IterationState.AFTER_STEP}

# state -> the states it may move to. A forward after the reload window opened (more forwards
# than the schedule announced) leaves the window open: the state stays where it is.
TRANSITIONS: Dict[IterationState, Set[IterationState]] = {
    IterationState.STARTUP: {IterationState.FIRST_FORWARD, IterationState.STEPPING, IterationState.AFTER_STEP},
    IterationState.AFTER_STEP: {IterationState.FIRST_FORWARD, IterationState.STEPPING, IterationState.AFTER_STEP},
    IterationState.FIRST_FORWARD: {IterationState.LATER_FORWARDS, IterationState.RELOAD_WINDOW,
                                   IterationState.STEPPING, IterationState.AFTER_STEP},
    IterationState.LATER_FORWARDS: {IterationState.LATER_FORWARDS, IterationState.RELOAD_WINDOW,
                                    IterationState.STEPPING, IterationState.AFTER_STEP},
    IterationState.RELOAD_WINDOW: {IterationState.RELOAD_WINDOW, IterationState.STEPPING, IterationState.AFTER_STEP},
    # A chain of optimizers (dense, expert) steps one inner optimizer after the other.
    IterationState.STEPPING: {IterationState.STEPPING, IterationState.AFTER_STEP},
}


@dataclasses.dataclass
class ForwardSample:
    """Memory sampled in the iteration's first forward, to learn how the activations grow."""

    allocated_at_start: int  # allocated when the first forward began
    max_allocated_at_start: int  # the allocator's high-water mark then
    freed_at_first_hook: bool  # no growth profile yet: everything is freed at the first layer
    freed: int = 0  # state bytes freed since the sample began
    active: bool = True  # until the first forward ends


@dataclasses.dataclass
class IterationRecord:
    """What one iteration has done so far; `OffloadCoordinator` starts a new one after each step."""

    state: IterationState = IterationState.AFTER_STEP
    forwards: int = 0  # training forwards begun
    backwards: int = 0  # backwards begun
    position: int = 0  # pacing modules entered in the current training forward
    sample: Optional[ForwardSample] = None  # of the first forward, when it sampled
    # id(chunk) -> its reload position: the layer it was freed before (or whose budget would have
    # freed it: MemoryPolicy._free_when_copied_out)
    freed_at: Dict[int, Optional[int]] = dataclasses.field(default_factory=dict)
    forward_end_max: int = 0  # highest allocated level at a forward's end with state off
    workspace_mark: Optional[int] = None  # allocator total at the last backward hook (first backward)
    workspace_key: Optional[int] = None  # position of that hook (the interval being measured)
    stepped: Set[int] = dataclasses.field(default_factory=set)  # id() of offloaders that stepped
    # The chunked step: each offloader's chunks in stepping order, the chunks that may leave after
    # each piece (`ChunkedStepSchedule._leaving_after`), what left during the step (the last
    # `latest_out` entries after the latest piece), budget.
    step_order: Dict[int, list] = dataclasses.field(default_factory=dict)
    leaving_after: Dict[int, list] = dataclasses.field(default_factory=dict)
    stepped_out: List[Tuple] = dataclasses.field(default_factory=list)
    latest_out: int = 0
    step_budget: int = 0
    # The first training forward found every chunk off the GPU (start-up, after an evaluation or
    # offload_all): its activations were laid out with no chunk among them (_room_for_fallback).
    began_offloaded: bool = False

    def move_to(self, new: IterationState) -> None:
        if new not in TRANSITIONS[self.state]:
            # The training loop called the hooks in an order no schedule produces.
            raise IllegalTransition(
                f"megatron-offload: {self.state.value} -> {new.value} is not a step of any training iteration "
                f"(forwards {self.forwards}, backwards {self.backwards}); the loop calls the hooks out of order")
        self.state = new

    @property
    def between_steps(self) -> bool:
        """No training forward yet in this iteration."""
        return self.state in _BETWEEN
