"""The planner's floor computation against the brief's hand analysis of R1, R2 and R3."""

import dataclasses
import os
import sys

import pytest

from megatron_offload import auto_fraction, planner
from megatron_offload.config import OffloadConfig
from megatron_offload.planner import GiB, PRESETS, Profile, Segment, free_bytes, predict


def test_r1_full_saving_floor_matches_the_brief():
    r1 = PRESETS["r1"]
    p = predict(r1, r1.state_bytes)
    # Brief: ~70 ms of delay before the first forward peak, ~20 ms of reload not hidden: ~1.14x.
    assert 65 <= p.stall_out_ms <= 80
    assert 15 <= p.stall_in_ms <= 25
    assert 1.12 <= p.ratio <= 1.16
    assert p.feasible


def test_r1_free_amount_matches_the_brief():
    # Brief: "at zero cost only ~3 GiB can move out in time".
    assert 2.7 * GiB <= free_bytes(PRESETS["r1"]) <= 3.4 * GiB


def test_suggested_fraction_moves_only_what_is_free():
    r1 = PRESETS["r1"]
    f = planner.suggested_fraction(r1)
    assert f * r1.state_bytes <= free_bytes(r1) < (f + 0.01) * r1.state_bytes
    assert predict(r1, f * r1.state_bytes).ratio <= 1.005


def test_r2_step_is_the_peak_so_unchunked_offload_saves_nothing():
    r2 = PRESETS["r2"]
    assert r2.max_unchunked_bytes == 0
    assert not predict(r2, 1 * GiB).feasible


def test_r3_full_saving_costs_little():
    r3 = PRESETS["r3"]
    p = predict(r3, r3.state_bytes)
    # Brief: 3.4 GiB out in ~67 ms against a ~55 ms window; back within the cool-down backwards.
    assert 5 <= p.stall_out_ms <= 20
    assert p.stall_in_ms <= 1


def test_more_bandwidth_never_costs_more_and_zero_offload_is_free():
    r1 = PRESETS["r1"]
    assert predict(r1, 0).ratio == pytest.approx(1.0)
    slow = predict(Profile(r1.segments, r1.state_bytes, 25, 25, 50), r1.state_bytes)
    fast = predict(Profile(r1.segments, r1.state_bytes, 100, 100, 200), r1.state_bytes)
    assert fast.iteration_ms < predict(r1, r1.state_bytes).iteration_ms < slow.iteration_ms


def test_stall_is_exact_for_a_single_forward():
    # One forward of 10 ms growing 0 -> 10 GiB, 5 GiB of state at 1 GiB/ms (~1073.7 GB/s):
    # the copy-out needs 5 ms; memory is needed once growth passes 5 GiB (t = 5 ms): no stall.
    gbps = GiB / 1e6
    prof = Profile([Segment("forward", 10, 0, 10 * GiB), Segment("backward", 10, 10 * GiB, 0),
                    Segment("step", 1, 0, 0)], 5 * GiB, gbps, gbps, 2 * gbps)
    assert predict(prof, 5 * GiB, dt_ms=0.01).stall_out_ms == pytest.approx(0, abs=0.05)
    # At half the bandwidth the copy-out ends exactly when the growth reaches the peak: no stall.
    half = Profile(prof.segments, prof.state_bytes, gbps / 2, gbps / 2, gbps)
    assert predict(half, 5 * GiB, dt_ms=0.01).stall_out_ms == pytest.approx(0, abs=0.05)
    # At a quarter, the last 5 GiB of growth can only follow the copy-out, which ends at 20 ms:
    # the 10 ms forward takes 20 ms.
    quarter = Profile(prof.segments, prof.state_bytes, gbps / 4, gbps / 4, gbps / 2)
    assert predict(quarter, 5 * GiB, dt_ms=0.01).stall_out_ms == pytest.approx(10, abs=0.1)


def test_cli_runs_each_preset(capsys):
    for name in PRESETS:
        planner.main(["--preset", name])
    out = capsys.readouterr().out
    assert "plan r1" in out and "streamed step holding" in out
    r2 = out[out.index("plan r2"):]
    assert "--offload-step-budget-mb 1536 (streamed step holding 1.5 GiB during the step): all 6.80 GiB off the peak" in r2
    assert "holding 3 GiB" in r2 and "does not fit" in r2.split("holding 3 GiB")[1].splitlines()[0]
    assert "--offload-step-budget-mb" not in out[out.index("plan r1"):out.index("plan r2")]


def test_profile_from_timeline_marks():
    g = GiB
    marks = [("iter_begin", 0, 10 * g), ("fwd_begin", 1, 10 * g), ("fwd_end", 61, 32 * g),
             ("bwd_begin", 61, 32 * g), ("bwd_end", 161, 10 * g), ("step_begin", 174, 10 * g),
             ("step_end", 202, 10 * g)]
    prof = planner.profile_from_timeline(marks, state_bytes=6.8 * g, step_peak_growth=2.4 * g)
    assert [(s.kind, s.ms) for s in prof.segments] == [
        ("gap", 1), ("forward", 60), ("backward", 100), ("gap", 13), ("step", 28)]
    assert prof.peak_growth == 22 * g
    assert prof.segments[1].growth_end == 22 * g and prof.segments[2].growth_end == 0
    assert prof.max_unchunked_bytes == pytest.approx(6.8 * g)
    assert predict(prof, 0).ratio == pytest.approx(1.0)


def test_profile_from_timeline_splits_the_steps_work_before_adam():
    """With the recorder's "adam_begin" mark the step is two segments: the work before Adam
    (gradient norm, clipping) at the gradients' level, then Adam with the step's growth."""
    g = GiB
    marks = [("iter_begin", 0, 10 * g), ("fwd_begin", 1, 10 * g), ("fwd_end", 61, 32 * g),
             ("bwd_begin", 61, 32 * g), ("bwd_end", 161, 11 * g), ("step_begin", 174, 11 * g),
             ("adam_begin", 184, 11 * g), ("step_end", 202, 10 * g)]
    prof = planner.profile_from_timeline(marks, state_bytes=6.8 * g, step_peak_growth=2.4 * g)
    assert [(s.kind, s.ms) for s in prof.segments] == [
        ("gap", 1), ("forward", 60), ("backward", 100), ("gap", 13), ("step_prep", 10), ("step", 18)]
    assert (prof.segments[4].growth_start, prof.segments[4].growth_end) == (1 * g, 1 * g)
    assert (prof.segments[5].growth_start, prof.segments[5].growth_end) == (2.4 * g, 2.4 * g)
    assert prof.max_unchunked_bytes == pytest.approx(6.8 * g)
    assert predict(prof, 0).ratio == pytest.approx(1.0)
    assert predict(prof, 0, streamed=True).ratio == pytest.approx(1.0)


def _prep_profile(prep_ms):
    # 1 GiB/ms each way alone, 1.5 GiB/ms both at once (0.75 each); 8 GiB of state. The forward
    # grows faster than the copy-out (its first 2 GiB fit); the backward releases 10 GiB in 4 ms,
    # so the reload (1 GiB/ms) has 4 of 8 GiB back when it ends. A 6 ms step, its first
    # `prep_ms` the work before Adam (0: one step segment, as marks without "adam_begin" give).
    gbps = GiB / 1e6
    step = [Segment("step_prep", prep_ms, 0, 0)] if prep_ms else []
    segs = [Segment("forward", 4, 0, 10 * GiB), Segment("backward", 4, 10 * GiB, 0)] + step + [
        Segment("step", 6 - prep_ms, 0, 0)]
    return Profile(segs, 8 * GiB, gbps, gbps, 1.5 * gbps)


def test_the_streamed_steps_copy_out_waits_for_the_work_before_adam():
    """Nothing is stepped before the gradients are clipped: the streamed step sends out only
    during Adam (0.75 GiB/ms shared: 3 GiB in 4 ms, not 4.5 in 6), so the next first forward has
    more left to copy out and the floor is higher; the reload goes on alone during that work."""
    split, one = predict(_prep_profile(2), 8 * GiB, dt_ms=0.01, streamed=True), \
        predict(_prep_profile(0), 8 * GiB, dt_ms=0.01, streamed=True)
    assert split.sent_in_step == pytest.approx(3 * GiB, rel=1e-3)
    assert one.sent_in_step == pytest.approx(4.5 * GiB, rel=1e-3)
    assert split.stall_out_ms > one.stall_out_ms and split.iteration_ms > one.iteration_ms
    # The work before Adam takes its own 2 ms (6 of 8 GiB back by its end, alone at 1 GiB/ms); Adam's
    # 4 ms hold the last 2 GiB at the shared rate (2.7 ms).
    assert split.segment_ms[2:] == pytest.approx([2, 4], abs=0.02)
    # The whole step: its Adam waits only for what did not come back during the work before it
    # (4 GiB after the backward; 2 of them during the 2 ms, alone at 1 GiB/ms).
    whole_split, whole_one = predict(_prep_profile(2), 8 * GiB, dt_ms=0.01), predict(_prep_profile(0), 8 * GiB,
                                                                                       dt_ms=0.01)
    assert whole_one.stall_in_ms == pytest.approx(4, abs=0.05)
    assert whole_split.stall_in_ms == pytest.approx(2, abs=0.05)


def test_the_lead_ends_where_the_step_begins_with_its_work_before_adam():
    """The host's lead (built while the first forward waits for the copy-out) ends at the step's
    first segment, its host sync: the work before Adam, where the marks have it, then takes its
    whole baseline time even where it was launch-bound, as a step segment would."""
    gbps = GiB / 1e6

    def floor(prep_busy):
        segs = [Segment("forward", 4, 0, 10 * GiB, 1.0), Segment("backward", 10, 10 * GiB, 0),
                Segment("step_prep", 2, 0, 0, prep_busy), Segment("step", 3, 0, 0)]
        return predict(Profile(segs, 8 * GiB, gbps, gbps, 2 * gbps), 8 * GiB, dt_ms=0.01)

    assert floor(None).stall_out_ms > 0  # (the forward waits: the lead that would be absorbed)
    assert floor(0.5).iteration_ms == pytest.approx(floor(None).iteration_ms, abs=0.02)


def test_chunked_step_floor_for_r2():
    """R2: an unchunked step saves nothing; a chunked one holding 1.5 GiB (3 chunks) can take the
    whole state off, at the cost of streaming what the backward could not reload through the
    step (both directions at once: 50 GB/s each with both_gbps 100)."""
    r2 = PRESETS["r2"]
    s = r2.state_bytes
    assert not predict(r2, s).feasible
    p = predict(r2, s, step_budget=1.5 * GiB, piece_growth=0.2 * GiB)
    assert p.feasible
    # The backward reloads at most the budget (the ceiling allows 0.9 GiB at forward end anyway);
    # the rest, >= 5.3 GiB, streams at 50 GB/s: >= ~114 ms against a 26 ms step.
    lower = (s - 1.5 * GiB) / 50e6 - 26
    assert lower <= p.stall_in_ms <= (s - 0.0) / 50e6
    # Nothing to copy out before the forwards but the 1.5 GiB held: no stall there (+0.9 GiB growth).
    assert p.stall_out_ms == 0
    # A budget above the peak growth does not fit.
    assert not predict(r2, s, step_budget=3.0 * GiB, piece_growth=0.2 * GiB).feasible
    # R1 with room for everything: the chunked step can only hide reload behind its own compute
    # (the first pieces run while the last ones load), i.e. gain at most the step's 28 ms.
    r1 = PRESETS["r1"]
    whole, pieces = predict(r1, r1.state_bytes), predict(r1, r1.state_bytes, step_budget=r1.state_bytes)
    assert whole.iteration_ms - 28 - 1 <= pieces.iteration_ms <= whole.iteration_ms


def test_median_marks_keep_one_slow_phase_from_moving_the_floor():
    clean = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 53.0, 20 * GiB),
             ("bwd_begin", 53.0, 20 * GiB), ("bwd_end", 143.0, 0), ("step_begin", 160.0, 0), ("step_end", 190.0, 0)]
    other = [(label, t * 1.01, alloc) for label, t, alloc in clean]
    slow = list(clean)
    slow[2] = ("fwd_end", 73.0, 20 * GiB)  # a 20 ms stall in one forward; everything after shifts
    slow[3:] = [(label, t + 20.0, alloc) for label, t, alloc in clean[3:]]
    merged = planner.median_marks([clean, slow, other])
    assert [m[0] for m in merged] == [m[0] for m in clean]
    assert merged[2][1] - merged[1][1] == pytest.approx(52.0 * 1.01)  # the median forward
    assert merged[-1][1] == pytest.approx(190.0 + 0.52)  # every other phase: the clean runs' own
    state = 6 * GiB

    def floor(marks):
        return planner.predict(planner.profile_from_timeline(marks, state), state).ratio

    assert abs(floor(merged) - floor(clean)) < 0.01 < abs(floor(slow) - floor(clean))
    # One timeline, or timelines of other phases, are left as they are.
    assert planner.median_marks([slow]) == slow
    assert planner.median_marks([clean, clean[:-2]]) == clean
    # A skipped step first (its marks lack "adam_begin": no inner optimizer ran): the most common
    # phases, the two iterations with the mark, still count.
    def with_adam(marks, after):
        k = [m[0] for m in marks].index("step_begin")
        return marks[:k + 1] + [("adam_begin", marks[k][1] + after, 0)] + marks[k + 1:]

    merged = planner.median_marks([clean, with_adam(clean, 10.0), with_adam(other, 12.0)])
    labels = [m[0] for m in merged]
    assert labels == [m[0] for m in with_adam(clean, 0)]
    assert merged[labels.index("adam_begin")][1] - merged[labels.index("step_begin")][1] == pytest.approx(11.0)


@pytest.mark.parametrize("content", [None, "{not json", '{"state_gib": 1}'])
def test_planner_cli_answers_bad_profiles_in_one_line(tmp_path, content, capsys):
    from megatron_offload import planner

    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as err:
        planner.main(["--profile", str(path)])
    assert err.value.code == 2
    text = capsys.readouterr().err
    want = "cannot read --profile" if content is None else "is not a profile"
    assert "megatron-offload-plan: error: " in text and want in text and "Traceback" not in text, text


def test_the_streamed_step_sends_out_during_the_step_and_lowers_the_floor():
    """Issue 24's schedule: stepped chunks leave during the step, so the next iteration starts
    with that much already off the GPU; the step starts on the chunks already back."""
    r1 = PRESETS["r1"]
    x = r1.state_bytes
    unchunked, chunked = predict(r1, min(x, r1.max_unchunked_bytes)), predict(r1, x, step_budget=x)
    streamed = predict(r1, x, streamed=True)
    assert streamed.feasible and 0 < streamed.sent_in_step <= x
    assert streamed.iteration_ms < chunked.iteration_ms <= unchunked.iteration_ms
    assert streamed.stall_out_ms < chunked.stall_out_ms  # (what left during the step)
    assert predict(r1, 0, streamed=True).ratio == pytest.approx(1.0)
    assert predict(r1, x).sent_in_step == 0  # (not streamed)


def test_the_streamed_step_sends_what_the_shared_link_carries_in_the_step():
    # A 5 ms step at 1 GiB/ms each way (both 2 GiB/ms): 5 of 8 GiB leave during it; the rest
    # leaves in the next forward, which needs room only after 6 ms of its 10.
    gbps = GiB / 1e6
    prof = Profile([Segment("forward", 10, 0, 10 * GiB), Segment("backward", 10, 10 * GiB, 0),
                    Segment("step", 5, 0, 0)], 8 * GiB, gbps, gbps, 2 * gbps)
    p = predict(prof, 8 * GiB, dt_ms=0.01, streamed=True)
    assert p.sent_in_step == pytest.approx(5 * GiB, rel=1e-6)
    assert p.stall_out_ms == pytest.approx(0, abs=0.05)
    assert predict(prof, 8 * GiB, dt_ms=0.01).iteration_ms >= p.iteration_ms  # (unchunked)


def _benchmark():
    """scripts/benchmark.py as a module (its planner comparison and variants)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
    import benchmark

    return benchmark


def _host_bound_profile(busy):
    # 1 GiB/ms each way. The forwards grow 2.5 GiB/ms (the copy-out cannot keep up) and, with
    # `busy`, were launch-bound in the baseline: the GPU needs only `busy` of their 4 ms.
    gbps = GiB / 1e6
    segs = [Segment("forward", 4, 0, 10 * GiB, busy), Segment("backward", 10, 10 * GiB, 0),
            Segment("forward", 4, 0, 10 * GiB, busy), Segment("backward", 10, 10 * GiB, 0),
            Segment("step", 5, 0, 0)]
    return Profile(segs, 8 * GiB, gbps, gbps, 2 * gbps)


def test_a_wait_is_partly_absorbed_where_the_baseline_was_launch_bound():
    """While compute waits for the copy-out (8 GiB at 1 GiB/ms: the first forward ends at 8 ms,
    not 4), the host keeps launching; the GPU is then 4 ms behind, and runs the second forward,
    launch-bound in the baseline, in its own 2 ms: 2 ms of the 4 ms wait are absorbed. Without
    `busy_ms` (every phase GPU-bound) the whole wait stays."""
    gpu_bound = predict(_host_bound_profile(None), 8 * GiB, dt_ms=0.01)
    assert gpu_bound.iteration_ms == pytest.approx(37.0, abs=0.05)
    assert gpu_bound.stall_out_ms == pytest.approx(4.0, abs=0.05)
    lead = predict(_host_bound_profile(2.0), 8 * GiB, dt_ms=0.01)
    assert lead.iteration_ms == pytest.approx(35.0, abs=0.05)
    assert lead.baseline_ms == gpu_bound.baseline_ms == 33.0


def test_without_a_wait_the_gpu_never_runs_ahead_of_the_host():
    # busy_ms only matters after a wait: with nothing offloaded the baseline's timeline is the
    # prediction, however fast the GPU could run the phases.
    assert predict(_host_bound_profile(1.0), 0, dt_ms=0.01).iteration_ms == pytest.approx(33.0, abs=1e-6)
    r1 = PRESETS["r1"]
    x = r1.state_bytes
    fast = Profile([dataclasses.replace(s, busy_ms=s.ms / 2) for s in r1.segments], x)
    assert predict(fast, 0).ratio == pytest.approx(1.0)
    assert predict(fast, x).iteration_ms < predict(r1, x).iteration_ms


def test_the_benchmark_floor_takes_the_busy_iteration_of_the_baseline(capsys):
    """scripts/benchmark.py: the baseline's iteration marked with the GPU lagging the host
    (`busy_timelines`) gives the phases' busy_ms; the floor then counts the host's lead, and the
    floor without it is printed beside it. Labels that differ from the marked iterations' are
    ignored (a busy iteration of another schedule)."""
    benchmark = _benchmark()

    marks = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 81.0, 20 * GiB),
             ("bwd_begin", 81.0, 20 * GiB), ("bwd_end", 171.0, 0), ("fwd_begin", 171.0, 0),
             ("fwd_end", 251.0, 20 * GiB), ("bwd_begin", 251.0, 20 * GiB), ("bwd_end", 341.0, 0),
             ("step_begin", 345.0, 0), ("step_end", 375.0, 0)]
    fast = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 51.0, 20 * GiB),
            ("bwd_begin", 51.0, 20 * GiB), ("bwd_end", 141.0, 0), ("fwd_begin", 141.0, 0),
            ("fwd_end", 191.0, 20 * GiB), ("bwd_begin", 191.0, 20 * GiB), ("bwd_end", 281.0, 0),
            ("step_begin", 285.0, 0), ("step_end", 315.0, 0)]
    timeline = {"iteration": 10, "marks": marks, "step_peak_growth": 0}

    def results(busy):
        base = {"timeline": timeline, "timelines": [timeline], "busy_timelines": busy, "offloaded_gib": [0]}
        return {"baseline": base, "offload": {"offloaded_gib": [8.0], "ratio": 1.2, "kept_gib": [0]}}

    plain = benchmark.compare_with_planner(results([]), 55.0)["offload"]
    lead = benchmark.compare_with_planner(results([{"iteration": 8, "marks": fast, "step_peak_growth": 0}]),
                                          55.0)["offload"]
    other = benchmark.compare_with_planner(results([{"iteration": 8, "marks": fast[:-2], "step_peak_growth": 0}]),
                                           55.0)["offload"]
    assert lead["predicted_ratio"] < plain["predicted_ratio"] == other["predicted_ratio"]
    assert lead["predicted_ratio_without_lead"] == pytest.approx(plain["predicted_ratio"])
    assert "predicted_ratio_without_lead" not in plain and "predicted_ratio_without_lead" not in other
    assert "the host's lead from the baseline's iteration 8" in capsys.readouterr().out


def test_the_benchmark_takes_the_floor_of_the_engine_a_run_used(capsys):
    """A run whose step was chunked and whose copy-out the feeder started in the step (the streamed
    step, the default engine) is held against the streamed-step floor; a whole step, or a chunked one
    without the feeder, against the planner's floor for its step."""
    benchmark = _benchmark()
    marks = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 81.0, 20 * GiB),
             ("bwd_begin", 81.0, 20 * GiB), ("bwd_end", 171.0, 0), ("step_begin", 175.0, 0), ("step_end", 205.0, 0)]
    timeline = {"iteration": 10, "marks": marks, "step_peak_growth": 0}
    base = {"timeline": timeline, "timelines": [timeline], "busy_timelines": [], "offloaded_gib": [0]}
    run = lambda budget, pieces: {"offloaded_gib": [8.0], "ratio": 1.2, "kept_gib": [0], "median_ms": 300.0,  # noqa: E731
                                  "step_budget_gib": [budget], "feeder_enqueued_pieces": [pieces]}
    rows = benchmark.compare_with_planner({"baseline": base, "streamed": run(20.0, 128), "chunked": run(20.0, None),
                                           "whole": run(0.0, 0), "whole-fed": run(0.0, 128),
                                           "bounded": run(1.0, 128), "bounded6": run(6.0, 128)}, 55.0)
    assert rows["streamed"]["engine_floor_ratio"] == rows["streamed"]["predicted_ratio_streamed"]
    assert rows["streamed"]["predicted_ratio_streamed"] != rows["streamed"]["predicted_ratio"]
    for name in ("chunked", "whole", "whole-fed"):
        assert rows[name]["engine_floor_ratio"] == rows[name]["predicted_ratio"], name
    # A budget below the state: the streamed step held to it (dearer than with the whole state as budget).
    prof = planner.profile_from_timeline(marks, 8 * GiB, 0, 55.0, 55.0, 110.0)
    bounded = planner.predict(prof, 8 * GiB, step_budget=GiB, streamed=True)
    assert rows["bounded"]["engine_floor_ratio"] == pytest.approx(bounded.ratio)
    assert rows["bounded"]["engine_floor_ratio"] > rows["bounded"]["predicted_ratio_streamed"]
    # Each run's own floor is named with the engine it models.
    out = capsys.readouterr().out
    named = lambda name, which: (f"planner {name}: the run's own floor ({which}) "  # noqa: E731
                                 f"{rows[name]['engine_floor_ratio']:.3f}x") in out
    assert named("streamed", "the streamed step")
    assert named("bounded", "the streamed step held to its budget, 1.00 GiB")
    # A budget below the state: both comparisons are against the streamed step held to it, not the
    # unbounded streamed floor nor the chunked step's (with 6 GiB of 8 the three differ here).
    six = planner.predict(prof, 8 * GiB, step_budget=6 * GiB, streamed=True)
    row = rows["bounded6"]
    assert row["predicted_ratio"] != pytest.approx(six.ratio)
    assert row["engine_floor_ratio"] == pytest.approx(six.ratio)
    assert row["measured_ratio_over_engine_floor"] == pytest.approx(1.2 / six.ratio)
    assert row["measured_over_engine_floor_ms"] == pytest.approx(300.0 / six.iteration_ms)
    assert named("bounded6", "the streamed step held to its budget, 6.00 GiB")
    assert (f"held to its budget, 6.00 GiB) {six.ratio:.3f}x = {six.iteration_ms:.0f} ms; measured "
            f"{300.0 / six.iteration_ms - 1:+.1%} in ms") in out
    assert f"as ratios 1.200x / {six.ratio:.3f}x = {1.2 / six.ratio - 1:+.1%}" in out
    assert all(named(name, "the floor of its step, above") for name in ("chunked", "whole", "whole-fed"))


def test_without_busy_times_the_floors_are_the_ones_before_the_lead_was_modelled():
    # Computed by the planner of c7b8dab (no host-lead model) on the presets, to the last bit.
    r1, r2, r3 = PRESETS["r1"], PRESETS["r2"], PRESETS["r3"]
    assert predict(r1, r1.state_bytes).iteration_ms == 773.6499999998439
    assert predict(r2, r2.state_bytes, step_budget=1.5 * GiB, piece_growth=0.2 * GiB).iteration_ms == 950.8166333437865
    assert predict(r1, r1.state_bytes, streamed=True).iteration_ms == 728.2999999999108
    assert predict(r3, r3.state_bytes).iteration_ms == 645.3999999999573
    assert free_bytes(r1) == 3486999995.6000004


def test_the_lead_ends_at_the_steps_host_sync():
    """The gradient norm's `.item()` at the start of the step makes the host wait for the GPU: a
    lead built in the forwards does not shorten the step, chunked or not (the step is as long as
    in the baseline here, launch-bound or not, when nothing comes back during it)."""
    gbps = GiB / 1e6

    def prof(step_busy):
        return Profile([Segment("forward", 4, 0, 10 * GiB, 2.0), Segment("backward", 10, 10 * GiB, 0),
                        Segment("step", 5, 0, 0, step_busy)], 8 * GiB, gbps, gbps, 20 * gbps)

    for kw in ({}, {"step_budget": 8 * GiB}):
        plain = predict(prof(None), 8 * GiB, dt_ms=0.01, **kw)
        assert plain.stall_out_ms > 3.9 and plain.stall_in_ms == pytest.approx(0, abs=0.05)
        assert predict(prof(2.0), 8 * GiB, dt_ms=0.01, **kw).iteration_ms == pytest.approx(plain.iteration_ms)
        assert predict(prof(0.0), 8 * GiB, dt_ms=0.01, **kw).iteration_ms == pytest.approx(plain.iteration_ms)


def test_a_phase_counts_as_launch_bound_only_when_clearly_shorter_on_the_gpu():
    marks = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 81.0, 20 * GiB),
             ("bwd_begin", 81.0, 20 * GiB), ("bwd_end", 171.0, 0), ("step_begin", 175.0, 0), ("step_end", 205.0, 0)]
    busy = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 51.0, 20 * GiB),
            ("bwd_begin", 51.0, 20 * GiB), ("bwd_end", 137.0, 0), ("step_begin", 141.0, 0), ("step_end", 171.0, 0)]
    prof = planner.profile_from_timeline(marks, 6 * GiB, busy_marks=busy)
    got = {s.kind: s.busy_ms for s in prof.segments}
    # The forward 50 of 80 ms: launch-bound; the backward 86 of 90 ms: within a single iteration's noise.
    assert got["forward"] == pytest.approx(50.0) and got["backward"] is None and got["step"] is None


def test_the_benchmarks_busy_iteration_is_never_timed():
    benchmark = _benchmark()

    for warmup in (2, 6, 8):
        at = benchmark.busy_iteration("baseline", warmup)
        # Megatron's train_step iterations count from 0; summarize() times iterations[warmup:].
        assert 1 <= at < warmup
    assert benchmark.busy_iteration("offload", 8) is None and benchmark.busy_iteration("baseline", 1) is None


def test_the_host_launches_the_step_while_compute_waits_for_the_reload():
    # 2 GiB back at 0.1 GiB/ms take 20 ms, the last backward 10: the step waits ~10 ms for the
    # reload, meanwhile the host launches it, and the GPU then runs it in its own 2 of 5 ms.
    gbps = GiB / 1e6

    def prof(step_busy):
        return Profile([Segment("forward", 4, 0, 10 * GiB), Segment("backward", 10, 10 * GiB, 0),
                        Segment("step", 5, 0, 0, step_busy)], 2 * GiB, gbps, 0.1 * gbps, 2 * gbps)

    plain, fast = predict(prof(None), 2 * GiB, dt_ms=0.01), predict(prof(2.0), 2 * GiB, dt_ms=0.01)
    assert plain.stall_in_ms == pytest.approx(10.0, abs=0.1) and plain.stall_out_ms == 0
    assert plain.iteration_ms - fast.iteration_ms == pytest.approx(3.0, abs=0.05)


def test_benchmark_variants_with_another_copy_out_in_flight():
    benchmark = _benchmark()

    fed = benchmark.variant_args("offload-chunked-fed1024")
    assert fed == benchmark.variant_args("offload-chunked-fed")[:-1] + ["1024"] and "--offload-chunked-step" in fed
    assert benchmark.variant_args("offload-fed512")[-2:] == ["--offload-copy-out-in-flight-mb", "512"]
    assert "--offload-chunked-step" not in benchmark.variant_args("offload-fed512")
    with pytest.raises(SystemExit):
        benchmark.variant_args("offload-fedx")


def test_the_automatic_fractions_saving_is_reported_for_every_rank(capsys):
    benchmark = _benchmark()
    marks = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 51.0, 20 * GiB),
             ("bwd_begin", 51.0, 20 * GiB), ("bwd_end", 141.0, 0), ("step_begin", 145.0, 0), ("step_end", 175.0, 0)]
    timeline = {"iteration": 10, "marks": marks, "step_peak_growth": 0}
    base = {"timeline": timeline, "timelines": [timeline], "offloaded_gib": [0, 0], "max_reserved_gib": [30.0, 30.0]}
    auto = {"offloaded_gib": [3.0, 3.0], "kept_gib": [4.0, 4.0], "ratio": 1.01, "reserved_saved_gib": 2.0,
            "max_reserved_gib": [28.0, 29.0], "auto_fraction": []}
    row = benchmark.compare_with_planner({"baseline": base, "offload-auto": auto}, 55.0)["offload-auto"]
    free = row["planner_free_gib"]
    assert 0 < free and row["saved_of_free_per_rank"] == [pytest.approx(2.0 / free), pytest.approx(1.0 / free)]
    assert f"(per rank: {2.0 / free:.0%} / {1.0 / free:.0%})" in capsys.readouterr().out


def test_the_benchmark_also_compares_measured_with_modelled_milliseconds(capsys):
    """The floor's ratio divides by the baseline's marked phases, the measured ratio by its
    measured step: milliseconds against the modelled iteration read the floor without that."""
    benchmark = _benchmark()
    marks = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 81.0, 20 * GiB),
             ("bwd_begin", 81.0, 20 * GiB), ("bwd_end", 171.0, 0), ("step_begin", 175.0, 0), ("step_end", 205.0, 0)]
    timeline = {"iteration": 10, "marks": marks, "step_peak_growth": 0}
    base = {"timeline": timeline, "timelines": [timeline], "busy_timelines": [], "offloaded_gib": [0]}
    offload = {"offloaded_gib": [8.0], "ratio": 1.2, "kept_gib": [0], "median_ms": 300.0}
    row = benchmark.compare_with_planner({"baseline": base, "offload": offload}, 55.0)["offload"]
    assert row["measured_over_predicted_ms"] == pytest.approx(300.0 / row["predicted_ms"])
    assert row["measured_over_streamed_ms"] > 0
    out = capsys.readouterr().out
    assert f"in ms 300 = {300.0 / row['predicted_ms'] - 1:+.1%} of the modelled" in out
    # The run's floor as ratios too: the measured ratio over the floor's.
    assert row["measured_ratio_over_engine_floor"] == pytest.approx(1.2 / row["engine_floor_ratio"])
    assert (f"the run's own floor (the floor of its step, above) {row['engine_floor_ratio']:.3f}x = "
            f"{row['predicted_ms']:.0f} ms; measured {300.0 / row['predicted_ms'] - 1:+.1%} in ms") in out
    assert f"as ratios 1.200x / {row['engine_floor_ratio']:.3f}x = {1.2 / row['engine_floor_ratio'] - 1:+.1%}" in out
    # Records without the median (older JSON) print and store no such comparison.
    del offload["median_ms"]
    row = benchmark.compare_with_planner({"baseline": base, "offload": offload}, 55.0)["offload"]
    assert row["measured_over_predicted_ms"] is None and row["measured_over_engine_floor_ms"] is None
    out = capsys.readouterr().out
    assert " in ms" not in out and "of its modelled" not in out
    # The ratios need no median.
    assert row["measured_ratio_over_engine_floor"] == pytest.approx(1.2 / row["engine_floor_ratio"])
    assert f"as ratios 1.200x / {row['engine_floor_ratio']:.3f}x" in out


def test_simulated_segments_add_up_and_phase_totals_group_them():
    """segment_ms holds each segment's simulated time (stalls in the segment that waits) and sums
    to the iteration; phase_totals groups segments as the benchmark's per-phase excess reads them."""
    prof = PRESETS["r1"]
    for kwargs in ({}, {"streamed": True}, {"step_budget": 2 * GiB}):
        p = predict(prof, prof.max_unchunked_bytes if not kwargs else prof.state_bytes, **kwargs)
        assert len(p.segment_ms) == len(prof.segments)
        assert sum(p.segment_ms) == pytest.approx(p.iteration_ms)
        assert all(ms >= g.ms - 1e-6 for ms, g in zip(p.segment_ms, prof.segments))  # (no busy times: no lead)
    whole = predict(prof, prof.max_unchunked_bytes)
    assert whole.segment_ms[0] == pytest.approx(prof.segments[0].ms + whole.stall_out_ms)  # the first forward waits
    r2 = PRESETS["r2"]  # (its step waits for the reload in both step branches)
    step = [g.kind for g in r2.segments].index("step")
    for kwargs in ({"streamed": True}, {"step_budget": 2 * GiB}):
        p = predict(r2, r2.state_bytes, **kwargs)
        assert p.stall_in_ms > 0 and p.segment_ms[step] == pytest.approx(r2.segments[step].ms + p.stall_in_ms)
    segs = [Segment("gap", 2, 0, 0), Segment("forward", 10, 0, 1), Segment("backward", 20, 1, 0),
            Segment("forward", 11, 0, 1), Segment("backward", 21, 1, 0), Segment("gap", 3, 0, 0),
            Segment("step", 5, 0, 0)]
    benchmark = _benchmark()
    assert benchmark.phase_totals(segs) == {"before the forwards": 2, "first forward": 10, "rest": 31,
                                          "last backward": 21, "before the step": 3, "step": 5}
    assert benchmark.phase_totals(segs, [1] * 7)["rest"] == 2
    # A gap after the step is the rest's; one before it, only where it follows the last backward.
    tail = segs + [Segment("gap", 7, 0, 0)]
    assert benchmark.phase_totals(tail)["rest"] == 38 and benchmark.phase_totals(tail)["before the step"] == 3
    between = segs[:3] + [Segment("gap", 4, 0, 0)] + segs[3:]
    assert benchmark.phase_totals(between)["rest"] == 35 and benchmark.phase_totals(between)["before the step"] == 3
    # The step's work before Adam (the recorder's "adam_begin") is the step's, not the gap's before it.
    prep = segs[:-1] + [Segment("step_prep", 2, 0, 0), Segment("step", 3, 0, 0)]
    assert benchmark.phase_totals(prep)["step"] == 5 and benchmark.phase_totals(prep)["before the step"] == 3
    no_backward = [Segment("forward", 10, 0, 1), Segment("gap", 4, 0, 0), Segment("step", 5, 0, 0)]
    assert benchmark.phase_totals(no_backward)["rest"] == 4 and benchmark.phase_totals(no_backward)["before the step"] == 0


def test_the_benchmark_splits_a_runs_excess_over_its_floor_by_phase(capsys):
    """measured minus modelled ms per phase group, the loop's time outside the marks (start to
    start minus the marked span) before the forwards on both sides; with almost nothing offloaded
    the floor is the baseline's phases, so the excess is the variant's phases over the baseline's."""
    benchmark = _benchmark()

    def marks(first_forward, step, gap=4):
        t, out = 0.0, [("iter_begin", 0.0, 0)]
        for label, ms, alloc in (("fwd_begin", 1, 0), ("fwd_end", first_forward, 20 * GiB), ("bwd_begin", 0, 20 * GiB),
                                 ("bwd_end", 90, 0), ("fwd_begin", 0, 0), ("fwd_end", 80, 20 * GiB),
                                 ("bwd_begin", 0, 20 * GiB), ("bwd_end", 90, 0), ("step_begin", gap, 0),
                                 ("step_end", step, 0)):
            t += ms
            out.append((label, t, alloc))
        return out

    def run(first_forward, step, loop, gap=4, **extra):
        timeline = {"iteration": 8, "marks": marks(first_forward, step, gap), "step_peak_growth": 0}
        span = timeline["marks"][-1][1]
        return {"timeline": timeline, "timelines": [timeline], "busy_timelines": [], "kept_gib": [0],
                "median_ms": span + loop, "ratio": 1.0, **extra}

    base = run(80, 30, loop=10, offloaded_gib=[0])
    offload = run(100, 60, loop=5, offloaded_gib=[2**-10])
    row = benchmark.compare_with_planner({"baseline": base, "offload": offload}, 55.0)["offload"]
    expected = {"before the forwards": -5, "first forward": 20, "rest": 0, "last backward": 0, "before the step": 0,
                "step": 30}
    assert row["phase_excess_ms"] == pytest.approx(expected, abs=0.2)
    out = capsys.readouterr().out
    assert "before the forwards -5.0, first forward +20.0, rest " in out and "step +30.0; in all +45.0" in out
    assert "the step's work before Adam not marked" in out and row["step_prep_ms"] is None
    # The same against the streamed step's floor (a run whose copy-out was fed from the step on).
    fed = dict(offload, feeder_enqueued_pieces=[5], step_budget_gib=[1.0])
    row = benchmark.compare_with_planner({"baseline": base, "offload": fed}, 55.0)["offload"]
    assert row["engine_floor_ratio"] == pytest.approx(row["predicted_ratio_streamed"])
    assert row["phase_excess_ms"] == pytest.approx(expected, abs=0.2)
    # A longer gap between the last backward and the step is its own group's.
    late = run(100, 60, loop=5, gap=24, offloaded_gib=[2**-10])
    row = benchmark.compare_with_planner({"baseline": base, "offload": late}, 55.0)["offload"]
    assert row["phase_excess_ms"] == pytest.approx(dict(expected, **{"before the step": 20}), abs=0.2)
    # With the recorder's "adam_begin" (here 10 ms into the baseline's step) the floor has the step's
    # work before Adam, and the line says how long it was.
    def marked(run_):
        timeline = dict(run_["timeline"])
        k = [m[0] for m in timeline["marks"]].index("step_begin")
        timeline["marks"] = timeline["marks"][:k + 1] + [("adam_begin", timeline["marks"][k][1] + 10.0, 0)] + \
            timeline["marks"][k + 1:]
        return dict(run_, timeline=timeline, timelines=[timeline])

    row = benchmark.compare_with_planner({"baseline": marked(base), "offload": marked(offload)}, 55.0)["offload"]
    assert row["step_prep_ms"] == pytest.approx(10.0)
    assert "the step's work before Adam 10.0 ms" in capsys.readouterr().out
    assert row["phase_excess_ms"] == pytest.approx(expected, abs=0.2)  # (the step's groups as before)
    # Without the variant's marks (older records) nothing is split.
    del offload["timelines"]
    assert "phase_excess_ms" not in benchmark.compare_with_planner({"baseline": base, "offload": offload}, 55.0)["offload"]


def test_the_benchmark_keeps_every_iteration_and_names_where_reserved_memory_grew(capsys):
    """summarize keeps each rank's per-iteration peaks and counters; report names the iterations
    (from 1) whose peak reserved memory exceeded the one before, with that iteration's counters."""
    benchmark = _benchmark()

    def it(reserved_mib, gc_full=0, allocs=0):
        return {"ms": 10.0, "loss": "0x1p+0", "skipped": 0, "max_allocated": 100 << 20,
                "max_reserved": reserved_mib << 20, "gc_full": gc_full, "device_allocs": allocs}

    run = {"ranks": [{"iterations": [it(200), it(300, allocs=2), it(300), it(350, gc_full=1, allocs=1)]}],
           "seconds": 1.0}
    r = benchmark.summarize(run, warmup=1)
    cols = r["per_iteration"][0]
    assert cols["max_reserved_mib"] == [200, 300, 300, 350]
    assert cols["gc_full"] == [0, 0, 0, 1] and cols["gc_gen1"] == [None] * 4
    assert r["growth_profile_mib"] == [] and r["peak_growth_mib"] == 0  # (records without the budget's profile)
    benchmark.report({"offload": r}, None)
    out = capsys.readouterr().out
    assert ("offload rank 0: peak reserved MiB per iteration [200, 300, 300, 350]; grew at 2: 200->300 "
            "device_allocs=2; 4: 300->350 gc_full=1 device_allocs=1; full collections in [4]") in out
    run["ranks"][0].update(growth_profile=[1 << 20, 3 << 20], peak_growth=5 << 20)
    profiled = benchmark.summarize(run, warmup=1)
    assert profiled["growth_profile_mib"] == [1.0, 3.0] and profiled["peak_growth_mib"] == 5.0


def test_the_benchmark_reports_the_waits_of_the_timed_iterations_beside_the_whole_runs():
    """The exposed waits per iteration over the timed iterations, from each iteration's cumulative
    record (the first ones, with the start-up offload's or a calibration's waits, left out), beside
    the whole run's average; records without the per-iteration totals keep the whole run's."""
    benchmark = _benchmark()
    cumulative = [[100.0, 40.0], [190.0, 60.0], [192.0, 70.0], [195.0, 80.0], [197.0, 91.0]]
    iterations = [{"exposed_ms": c} for c in cumulative]
    assert benchmark.timed_waits(iterations, warmup=2) == [(197.0 - 190.0) / 3, (91.0 - 60.0) / 3]
    assert benchmark.timed_waits(iterations, warmup=0) == [197.0 / 5, 91.0 / 5]
    assert benchmark.timed_waits(iterations, warmup=5) is None  # (nothing timed)
    assert benchmark.timed_waits([{"exposed_ms": None}] * 3, warmup=1) is None  # (no plugin)
    assert benchmark.timed_waits([{}] * 3, warmup=1) is None  # (older records)
    r = {"transfer": {"exposed_d2h_ms": 197.0, "exposed_h2d_ms": 91.0, "iterations": 5},
         "timed_exposed_ms": benchmark.timed_waits(iterations, warmup=2)}
    assert benchmark.waits_text(r) == ("before free 2.3 ms, before step 10.3 ms over the timed iterations "
                                       "(whole run 39.4 / 18.2)")
    del r["timed_exposed_ms"]
    assert benchmark.waits_text(r) == "before free 39.4 ms, before step 18.2 ms (whole run)"


def test_the_benchmark_reports_the_plugins_host_time_in_its_hooks(capsys):
    """Host ms per timed iteration in the plugin's hooks, from rank 0's cumulative per-iteration
    record, and the three hooks that took most over the run, in the transfer note; records without
    them say so."""
    benchmark = _benchmark()
    assert benchmark.timed_hook_ms([{"hook_ms": c} for c in (50.0, 60.0, 64.0, 70.0)], warmup=1) == (70.0 - 50.0) / 3
    assert benchmark.timed_hook_ms([{"hook_ms": c} for c in (50.0, 60.0)], warmup=0) == 30.0
    assert benchmark.timed_hook_ms([{"hook_ms": None}] * 3, warmup=1) is None  # (no plugin)
    assert benchmark.timed_hook_ms([{}] * 3, warmup=1) is None  # (older records)
    assert benchmark.timed_waits([{"exposed_ms": (4.0, 2.0)}, {"exposed_ms": (10.0, 8.0)}], warmup=0) == [5.0, 4.0]

    def it(hook_ms):
        return {"ms": 10.0, "loss": "0x1p+0", "skipped": 0, "max_allocated": 1 << 20, "max_reserved": 1 << 20,
                "exposed_ms": [0.0, 0.0], "hook_ms": hook_ms}

    rank0 = {"iterations": [it(40.0), it(48.0), it(57.0)],
             "transfer": {"d2h_gbps": 50.0, "h2d_gbps": 50.0, "exposed_d2h_ms": 0.0, "exposed_h2d_ms": 0.0,
                          "iterations": 3},
             "hook_host_ms": {"forward_begin": 1.0, "layer_forward_begin": 30.0, "layer_backward_begin": 20.0,
                              "grads_finalizing": 6.0},
             "hook_calls": {"forward_begin": 12, "layer_forward_begin": 300, "layer_backward_begin": 300,
                            "grads_finalizing": 3}}
    r = benchmark.summarize({"ranks": [rank0, {"iterations": [it(0.0)] * 3}], "seconds": 1.0}, warmup=1)
    assert r["timed_hook_ms"] == 8.5
    benchmark.report({"offload": r}, {"d2h_gbps": 55.0, "h2d_gbps": 55.0})
    out = capsys.readouterr().out
    assert ("host time in hooks 8.5 ms per timed iteration (whole run, most: layer_forward_begin 30 ms / 300 "
            "calls, layer_backward_begin 20 ms / 300 calls, grads_finalizing 6 ms / 3 calls)") in out
    assert "offload: achieved D2H 50.0 GB/s (91% of ceiling), H2D 50.0 GB/s (91%); exposed" in out
    # A call without ceilings (--no-ceilings) still gets the plugin's counters, without the shares.
    benchmark.report({"offload": r}, None)
    out = capsys.readouterr().out
    assert "offload: achieved D2H 50.0 GB/s, H2D 50.0 GB/s; exposed" in out and "cached-memory releases" in out
    assert "held for split parameters" not in out  # (no streamed step recorded)
    r["step_budget_gib"], r["step_waiting"] = [0.75], [2]
    benchmark.report({"offload": r}, None)
    assert "; step budget 0.75 GiB, up to 2 chunks held for split parameters" in capsys.readouterr().out
    r["timed_hook_ms"] = None
    benchmark.report({"offload": r}, {"d2h_gbps": 55.0, "h2d_gbps": 55.0})
    assert "host time in hooks: not recorded" in capsys.readouterr().out


def test_the_benchmark_shows_each_ranks_calibrations_and_what_the_cap_made_of_them(capsys):
    """Every rank's two calibration readings, replayed through `refine` with the cap and without,
    beside the share the job agreed on: where rank 1 read high, the cap decided."""
    benchmark = _benchmark()

    def cal(iteration, trimmed, untrimmed, stalls=0.1):
        return {"iteration": iteration, "free_fraction": trimmed, "free_upper": untrimmed, "stalls_ms": stalls,
                "d2h_gbps": 50.0, "h2d_gbps": 50.0, "state_bytes": 1 << 30,
                # a first forward 30 ms longer than the later one (trimmed: a 670 ms iteration)
                "marks": [["iter_begin", 0.0, 0], ["fwd_begin", 0.0, 0], ["fwd_end", 80.0, 0], ["fwd_begin", 80.0, 0],
                          ["fwd_end", 130.0, 0], ["step_end", 700.0, 0]]}

    def it():
        return {"ms": 10.0, "loss": "0x1p+0", "skipped": 0, "max_allocated": 1 << 20, "max_reserved": 1 << 20}

    ranks = [{"iterations": [it()] * 3, "auto_calibrations": [cal(3, 0.381, 0.469, 128.0), cal(5, 0.385, 0.473)],
              "auto_fraction": {"free_fraction": 0.465}},
             {"iterations": [it()] * 3, "auto_calibrations": [cal(3, 0.378, 0.465, 90.0), cal(5, 0.484, 0.677)],
              "auto_fraction": {"free_fraction": 0.465}}]
    r = benchmark.summarize({"ranks": ranks, "seconds": 1.0}, warmup=1)
    assert [[c["iteration"] for c in recs] for recs in r["auto_readings"]] == [[3, 5], [3, 5]]
    assert r["auto_readings"][1][1]["iteration_ms"] == 670.0 and "marks" not in r["auto_readings"][1][1]
    assert benchmark.reading(dict(cal(5, 0.4, 0.5), iteration_ms=612.5))["iteration_ms"] == 612.5  # (the plugin's)
    assert benchmark.readings_text(r["auto_readings"], r["auto_fraction"]) == (
        "per rank, first then second calibration (free share trimmed / untrimmed; the first's lower bound the job's "
        "smallest, 0.378): rank 0 0.381 / 0.469, then "
        "0.385 / 0.473 -> 0.469 capped, 0.473 without the cap; rank 1 0.378 / 0.465, then 0.484 / 0.677 -> "
        "0.465 capped, 0.677 without the cap; the job agreed on 0.465")
    # A second calibration that waited (more than planner.FREE_COST of its iteration) is not lifted.
    waited = [[benchmark.reading(c) for c in (cal(3, 0.378, 0.465), cal(5, 0.484, 0.677, stalls=50.0))]]
    assert "-> 0.465 capped, 0.465 without the cap" in benchmark.readings_text(waited, [])
    assert "agreed" not in benchmark.readings_text(waited, [])
    # Each rank's lower bound is the job's first choice (the smallest first reading), as `agree` set it.
    lower = [[benchmark.reading(c) for c in (cal(3, 0.50, 0.60), cal(5, 0.40, 0.45))],
             [benchmark.reading(c) for c in (cal(3, 0.38, 0.40), cal(5, 0.39, 0.41))]]
    assert "rank 0 0.500 / 0.600, then 0.400 / 0.450 -> 0.450 capped" in benchmark.readings_text(lower, [])


def test_summarize_and_report_carry_rank_0s_waits_of_the_timed_iterations(capsys):
    """summarize takes rank 0's cumulative waits over iterations[warmup:] (and rank 0's growth
    profile), and the report's transfer note prints them beside the whole run's average."""
    benchmark = _benchmark()

    def it(exposed):
        return {"ms": 10.0, "loss": "0x1p+0", "skipped": 0, "max_allocated": 1 << 20, "max_reserved": 1 << 20,
                "exposed_ms": exposed}

    rank0 = {"iterations": [it([100.0, 40.0]), it([190.0, 60.0]), it([193.0, 66.0]), it([196.0, 72.0])],
             "transfer": {"d2h_gbps": 50.0, "h2d_gbps": 50.0, "exposed_d2h_ms": 196.0, "exposed_h2d_ms": 72.0,
                          "iterations": 4},
             "growth_profile": [2 << 20], "peak_growth": 4 << 20,
             "reload_starts": [[1, 23], [2, 21], [3, -1], [4, None]], "reloads_deferred_for_position": 17,
             "profile_relearned": 1, "profile_relearned_bytes": 3 << 29,
             "backward_workspace": 3 << 20, "workspace_by_position": {"0": 1 << 20, "2": 3 << 20, "1": 2 << 20}}
    rank1 = {"iterations": [it([0.0, 0.0])] * 4, "growth_profile": [9 << 20], "peak_growth": 9 << 20,
             "reload_starts": [[1, 5]], "reloads_deferred_for_position": 3}
    r = benchmark.summarize({"ranks": [rank0, rank1], "seconds": 1.0}, warmup=2)
    assert r["timed_exposed_ms"] == [3.0, 6.0]
    assert r["growth_profile_mib"] == [2.0] and r["peak_growth_mib"] == 4.0
    assert r["reload_starts"] == [[1, 23], [2, 21], [3, -1], [4, None]]
    assert r["reloads_deferred_for_position"] == [17, 3]
    benchmark.report({"offload": r}, {"d2h_gbps": 55.0, "h2d_gbps": 55.0})
    out = capsys.readouterr().out
    assert ("exposed waits per iteration: before free 3.0 ms, before step 6.0 ms over the timed iterations "
            "(whole run 49.0 / 18.0)") in out
    assert "(backward workspace 3 MiB (by position: 2:3, 1:2, 0:1)), chunks held back" in out
    assert ("chunks held back by the position rule 17 (once per hook); growth profile learned again 1 times "
            "(1.50 GiB kept for good); first reload per iteration at backward "
            "position 1:23, 2:21, 3:-1, 4:?;") in out
    del r["reload_starts"], r["profile_relearned_bytes"]  # (records before either was kept)
    benchmark.report({"offload": r}, {"d2h_gbps": 55.0, "h2d_gbps": 55.0})
    out = capsys.readouterr().out
    assert "first reload per iteration: not recorded" in out and "learned again 1 times; first" in out


def test_the_benchmark_times_iterations_start_to_start_where_the_records_allow():
    """median_ms is the start-to-start period (Megatron's work between train_step calls, where a
    read may wait behind the copy-out in flight, included); train_step alone is kept beside it;
    older records without periods fall back to train_step."""
    benchmark = _benchmark()

    def it(ms, period=None):
        return {"ms": ms, "loss": "0x1p+0", "skipped": 0, "max_allocated": 1 << 20, "max_reserved": 1 << 20,
                **({} if period is None else {"period_ms": period})}

    run = {"ranks": [{"iterations": [it(50.0, 99.0), it(10.0, 30.0), it(10.0, 31.0), it(10.0, 32.0), it(10.0)]}],
           "seconds": 1.0}
    r = benchmark.summarize(run, warmup=1)
    assert r["median_ms"] == 31.0 and r["median_train_step_ms"] == 10.0 and r["median_of"] == "start to start"
    assert r["per_iteration"][0]["period_ms"] == [99.0, 30.0, 31.0, 32.0, None]
    old = {"ranks": [{"iterations": [it(50.0), it(10.0), it(12.0), it(14.0)]}], "seconds": 1.0}
    assert benchmark.summarize(old, warmup=1)["median_ms"] == 12.0
    assert benchmark.summarize(old, warmup=1)["median_of"] == "train_step"
    # The soak's percentiles also over periods, where recorded.
    soak = benchmark.soak_stats([it(10.0, 20.0 + i % 7) for i in range(9)] + [it(10.0)], warmup=0, window=4)
    assert soak["p50_ms"] == 10.0 and soak["p50_period_ms"] == 22.0 and soak["p99_period_ms"] == 26.0
    assert "p50_period_ms" not in benchmark.soak_stats([it(10.0)] * 10, warmup=0, window=4)


def test_the_benchmark_replays_each_calibration_of_the_automatic_fraction(capsys):
    """An `offload-auto` row with rank 0's calibrations: the free share replayed on the calibration's
    own marks at the call's rates (trimmed as in-run, and untrimmed) beside the baseline's, and the
    phases of both. A calibration whose first forward ran 30 ms longer than the baseline's (the
    copy beside it) reads a larger untrimmed share; trimmed it reads the baseline's."""
    benchmark = _benchmark()
    marks = [("iter_begin", 0.0, 0), ("fwd_begin", 1.0, 0), ("fwd_end", 81.0, 20 * GiB),
             ("bwd_begin", 81.0, 20 * GiB), ("bwd_end", 171.0, 0), ("fwd_begin", 171.0, 0),
             ("fwd_end", 251.0, 20 * GiB), ("bwd_begin", 251.0, 20 * GiB), ("bwd_end", 341.0, 0),
             ("step_begin", 345.0, 0), ("step_end", 375.0, 0)]
    stretched = [(label, t + 30.0 if k >= 2 else t, act) for k, (label, t, act) in enumerate(marks)]
    state = 8 * GiB
    cal = {"iteration": 3, "marks": stretched, "stalls_ms": 4.5, "state_bytes": state, "d2h_gbps": 8.0,
           "h2d_gbps": 9.0, "free_fraction": 0.25, "free_upper": 0.5}
    timeline = {"iteration": 10, "marks": marks, "step_peak_growth": 0}
    base = {"timeline": timeline, "timelines": [timeline], "busy_timelines": [], "offloaded_gib": [0],
            "max_reserved_gib": [40.0]}
    auto = {"offloaded_gib": [4.0], "ratio": 1.01, "kept_gib": [4.0], "reserved_saved_gib": 4.0,
            "max_reserved_gib": [36.0], "auto_fraction": [{"fraction": 0.5}], "auto_calibrations": [cal]}
    benchmark.compare_with_planner({"baseline": base, "offload-auto": auto}, 10.0)
    out = [line for line in capsys.readouterr().out.splitlines() if "calibration at iteration 3" in line]
    assert len(out) == 1

    def free(m, out=10.0, into=10.0, both=20.0):
        return planner.free_bytes(planner.profile_from_timeline(m, state, 0.0, out, into, both)) / state

    cut = auto_fraction.first_forward_as_the_others(stretched)
    trimmed, untrimmed, on_base = free(cut), free(stretched), free(marks)
    assert trimmed == pytest.approx(on_base) and untrimmed > on_base + 0.01
    # At the calibration's own rates (both ways at the in-run share of their sum): slower, less free.
    own, own_untrimmed = free(cut, 8.0, 9.0, 0.68 * 17.0), free(stretched, 8.0, 9.0, 0.68 * 17.0)
    assert own < trimmed and own_untrimmed < untrimmed
    assert (f"replayed at its rates 8.0 / 9.0 / both 11.6 GB/s {own:.3f} (untrimmed {own_untrimmed:.3f}), at the "
            f"ceilings 10.0 / both 20.0 GB/s {trimmed:.3f} (untrimmed {untrimmed:.3f}); on the baseline's marks "
            f"{on_base:.3f}") in out[0]
    assert "its own reading free 0.250 (untrimmed 0.500, stalls 4.5 ms removed)" in out[0]
    assert ("first forward 110.0 / 80.0, later forwards 80.0 / 80.0, last backward 90.0 / 90.0, step 30.0 / 30.0, "
            "marked span 405.0 / 375.0") in out[0]


def test_the_calibrations_bound_has_a_benchmark_modifier_the_mock_understands():
    benchmark = _benchmark()
    import pretrain_gpt_mock

    (var, value), = benchmark.MODIFIERS["calrun"].items()
    field, parse = pretrain_gpt_mock.DIAGNOSTIC_ENV[var]
    assert field == "calibration_host_lead_layers" and parse(value) is None and parse("2") == 2
    assert field in {f.name for f in dataclasses.fields(OffloadConfig)}
    (var, value), = benchmark.MODIFIERS["calnocap"].items()
    field, parse = pretrain_gpt_mock.DIAGNOSTIC_ENV[var]
    assert field == "second_calibration_capped" and parse(value) is False and parse("1") is True
    assert field in {f.name for f in dataclasses.fields(OffloadConfig)}
    for modifier, field, off in (("wsmax", "workspace_by_position", False), ("nows", "keep_backward_workspace", False),
                                 ("keepprofile", "forget_lasting_growth", False),
                                 ("nolastmargin", "lasting_growth_margin", False),
                                 ("syncfill", "async_save_background_fill", False)):
        (var, value), = benchmark.MODIFIERS[modifier].items()
        assert pretrain_gpt_mock.DIAGNOSTIC_ENV[var][0] == field and pretrain_gpt_mock.DIAGNOSTIC_ENV[var][1](value) is off


def test_the_benchmark_sets_the_gpus_gap_before_the_step_beside_the_plugins_host_time_there(capsys):
    """Per marked iteration: the GPU's gap between the last backward and the step, and every rank's
    share of the cumulative host ms in grads_finalizing and in host-lead waits in that iteration
    (the recorder numbers iterations from 0, as the records' index); records without them print the
    gap alone."""
    benchmark = _benchmark()

    def it(finalize, lead):
        return {"ms": 10.0, "loss": "0x1p+0", "skipped": 0, "max_allocated": 1 << 20, "max_reserved": 1 << 20,
                "finalize_host_ms": finalize, "host_lead_wait_ms": lead}

    def marks(gap):
        t, out = 0.0, [("iter_begin", 0.0, 0)]
        for label, ms in (("fwd_begin", 1), ("fwd_end", 50), ("bwd_begin", 0), ("bwd_end", 90), ("step_begin", gap),
                          ("step_end", 40)):
            t += ms
            out.append((label, t, 0))
        return out

    ranks = [{"iterations": [it(5.0, 0.0), it(6.0, 1.0), it(26.0, 1.5)]},
             {"iterations": [it(4.0, 0.0), it(4.5, 0.0), it(7.5, 0.0)]}]
    r = benchmark.summarize({"ranks": ranks, "seconds": 1.0}, warmup=1)
    assert r["per_iteration"][0]["finalize_host_ms"] == [5.0, 1.0, 20.0]
    assert r["per_iteration"][1]["host_lead_wait_ms"] == [0.0, 0.0, 0.0]
    # Megatron's numbers (here from a loaded checkpoint's 40) differ from the records' index.
    r["timelines"] = [{"iteration": 41, "record": 1, "marks": marks(4.0)},
                      {"iteration": 42, "record": 2, "marks": marks(30.0)}]
    assert benchmark.before_step_text("offload", r).endswith(
        "2: 4.0 (grads_finalizing 1.0 / 0.5, host-lead waits over the iteration 1.0 / 0.0); "
        "3: 30.0 (grads_finalizing 20.0 / 3.0, host-lead waits over the iteration 0.5 / 0.0)")
    benchmark.report({"offload": r}, None)
    assert "offload: before the step, rank 0's GPU gap per marked iteration" in capsys.readouterr().out
    # Without the plugin's records (the baseline, older JSON): the gaps alone; a record missing in
    # the middle gives no share for the iteration after it.
    plain = benchmark.summarize({"ranks": [{"iterations": [it(None, None)] * 3}], "seconds": 1.0}, warmup=1)
    plain["timelines"] = [{k: v for k, v in t.items() if k != "record"} | {"iteration": t["record"]}
                          for t in r["timelines"]]  # (older records: no index; a fresh run's numbers)
    assert benchmark.before_step_text("baseline", plain).endswith("2: 4.0; 3: 30.0")
    gappy = benchmark.per_iteration([it(5.0, 0.0), it(None, None), it(7.0, 1.0)])
    assert gappy["finalize_host_ms"] == [5.0, None, None]
    assert benchmark.before_step_text("x", {"timelines": []}) is None
