"""`--offload-state-fraction auto`'s calibration inside the coordinator: phase marks of the measured
iteration and the choice of the fraction (auto_fraction.py holds the arithmetic). Methods of
`OffloadCoordinator`; the attributes they use are set in its `__init__`.
"""

from __future__ import annotations

import math

from . import auto_fraction


class Calibration:
    """Marks the calibration iteration's phases and re-packs the state at the chosen fraction."""

    def _activation_bytes(self) -> int:
        """Allocated bytes that are not chunk buffers (the planner's growth is relative)."""
        return self._allocated() - self.resident_bytes

    def _any_in_group(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank of the job (a collective where there is a job: the
        maximum, as minus the minimum of the negated flags)."""
        if self._smallest_in_group is None:
            return bool(flag)
        return -self._smallest_in_group(-float(flag)) > 0

    def _host_lead_depth(self):
        """The host-lead bound for a layer hook: the calibration's while one is recorded
        (config.CALIBRATION_HOST_LEAD_LAYERS says why), else the run's own (None)."""
        return self.config.calibration_host_lead_layers if self._recorder is not None else None

    def _mark(self, label: str) -> None:
        if self._recorder is not None:
            self._recorder.mark(label, self._activation_bytes())

    def _choose_fraction(self) -> None:
        """End of the calibration iteration: pick the fraction and re-pack the offloaders with it,
        before their copy-out (due at the next forward) is enqueued.

        Every rank of the job gets here after the same step and makes the same collectives,
        whatever it holds (no offloader, stubs only, everything kept) and whether or not it
        measured: the choice's agreements span the job (`agree`)."""
        recorder, self._recorder = self._recorder, None
        self.streams.stats.stall_sink = None
        # Why agreed: a rank with no state of its own cannot see a skipped step, and one that
        # went on would wait in a collective that the others never make.
        if self._any_in_group(self._skipped_last_step):
            # A skipped step: the state was sent back out unchanged. Measure the next iteration.
            self.auto_fraction_at = self._iterations_done + 1
            return
        d2h, h2d = auto_fraction.bandwidth_of(self.streams.stats)
        first = self.auto_choice  # None in the first calibration iteration
        if recorder is None:
            # Nothing measured here (no training forward began the iteration on this rank): it
            # does not bound the others' free share and takes the share they agree on.
            choice = auto_fraction.Choice(1.0, 1.0, 0.0, 0.0, 0.0, d2h, h2d, free_upper=1.0,
                                          calibrations=first.calibrations + 1 if first else 1)
        else:
            timeline, stalls_ms = recorder.timeline()
            total = self.state_bytes + sum(off.kept_bytes for off in self.offloaders)
            # The second calibration keeps the first one's memory bound (`refine`): no room needed.
            room = self._memory_room() if first is None else math.inf
            choice = auto_fraction.choose(timeline, total, d2h, h2d, room, stalls_ms=stalls_ms)
            # Kept for a replay of this measurement against another profile (the benchmark's planner):
            # its own reading, before a second calibration's bounds (`refine`) and the job's `agree`.
            self.calibrations.append({"iteration": self._iterations_done, "marks": timeline, "stalls_ms": stalls_ms,
                                      "state_bytes": total, "d2h_gbps": d2h, "h2d_gbps": h2d,
                                      "free_fraction": choice.free_fraction, "free_upper": choice.free_upper,
                                      "iteration_ms": choice.iteration_ms})
            if first is not None:
                choice = auto_fraction.refine(first, choice, capped=self.config.second_calibration_capped)
        if self._smallest_in_group is not None:
            choice = auto_fraction.agree(choice, self._smallest_in_group)
        self.auto_choice = choice
        self.auto_fraction_at = None
        # Whether to calibrate once more: the job does if any rank needs it. Not in the very next
        # iteration: the first one at a new fraction makes new device allocations and runs longer
        # (likely its layout's memory mapped as it goes), while `refine` takes the second
        # calibration's first forward as measured. See [Note: second calibration] in docs/design.md.
        if first is None and self._any_in_group(auto_fraction.needs_second_calibration(choice)):
            self.auto_fraction_at = self._iterations_done + 2
        self._trace(f"auto_fraction:{choice.fraction:.2f}")
        self._announce_fn(choice.describe())
        # (Also 1.0 after a first choice below it: the second calibration's choice is applied.)
        if choice.fraction == self.state_fraction:
            return
        self.state_fraction = choice.fraction
        for off in self.offloaders:
            off.fraction = choice.fraction
            if off.chunks or off.kept:
                off.make_resident(will_modify=True)  # (the chunked step sent some out already)
                off.refresh()
        self._announce()
