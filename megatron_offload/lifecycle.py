"""The coordinator's lifecycle methods (what a training loop calls: `forward_begin`,
`layer_forward_begin`, ..., `optimizer_step_done`): inert once the coordinator is closed, and
their host time counted per method (`HookClock`). The time includes what a hook blocks on (the
host-lead bound's and the frees' waits, counted apart in `host_lead.wait_ms` and
`free_host_wait_ms`) and the automatic fraction's calibration; not the optimizer-step hooks
(`_before_inner_step`, `_after_inner_step`) nor the Megatron wrappers around the coordinator."""

from __future__ import annotations

import functools
import time
from typing import Dict


class HookClock:
    """Host milliseconds spent in each lifecycle method, and its calls. Outermost calls only: a
    lifecycle method that calls another is counted once, under its own name. One hook runs at a
    time: on the loop's thread, or (`layer_backward_begin`, a gradient hook) on autograd's device
    thread while the loop waits in `backward()`; the copy feeder's thread calls none of them."""

    def __init__(self):
        self.ms: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}
        self.inside = False

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())


def lifecycle(method):
    """A lifecycle method of `OffloadCoordinator`: does nothing after `close()` (a loop that caught
    an error of ours, or detached on purpose, may keep calling the hooks, which must then not move
    state); counted in the coordinator's `hook_clock` otherwise."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, *a, **k):
        if self.closed:
            return None
        clock = self.hook_clock
        if clock.inside:
            return method(self, *a, **k)
        clock.inside = True
        start = time.perf_counter()
        try:
            return method(self, *a, **k)
        finally:
            clock.inside = False
            clock.ms[name] = clock.ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3
            clock.calls[name] = clock.calls.get(name, 0) + 1

    return wrapper
