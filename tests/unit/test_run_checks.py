"""The functional runs' checks themselves (scripts/megatron_runs.py), on made-up rank records."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

from megatron_runs import save_growth_check  # noqa: E402

MiB = 2**20


def rank(grew, state=0, off=None):
    off = state if off is None else off
    return {"saves": [{"allocated_before": 1000 * MiB, "max_allocated": (1000 + grew) * MiB,
                       "offloaded_before": off * MiB}],
            "offloaded_bytes": state * MiB}


def test_a_save_that_reads_host_copies_passes():
    ok, detail = save_growth_check(rank(10), rank(12, state=256))
    assert ok, detail


def test_a_save_that_brings_the_state_back_fails():
    ok, detail = save_growth_check(rank(10), rank(10 + 256, state=256))
    assert not ok, detail


def test_a_save_with_nothing_off_the_gpu_proves_nothing_and_fails():
    """The unchunked step saves with the whole state resident: no state to bring back, so a
    passing bound there would say nothing about the bounded save."""
    ok, detail = save_growth_check(rank(10), rank(10, state=256, off=0))
    assert not ok and "at least 0 MiB off" in detail


def test_no_save_recorded_fails():
    ok, _ = save_growth_check(rank(10), {"saves": [], "offloaded_bytes": 256 * MiB})
    assert not ok


def test_offloaded_at_save_is_the_least_over_the_saves():
    from megatron_runs import offloaded_at_save

    saves = [{"offloaded_before": 300 * MiB}, {"offloaded_before": 0}]
    assert offloaded_at_save({"saves": saves}) == 0
    assert offloaded_at_save({"saves": saves[:1]}) == 300 * MiB
    assert offloaded_at_save({"saves": []}) == 0


def test_sweep_merge_takes_rows_of_sweeps_and_the_kept_variants_of_a_benchmark(tmp_path, capsys):
    import json

    import sweep

    def row(gbs, ratio, floor):
        return {"gbs": gbs, "variant": "offload", "baseline_ms": 100.0, "ms": 100.0 * ratio, "measured_ratio": ratio,
                "floor_ratio": floor, "measured_over_floor": ratio / floor, "saved_fraction": 1.0,
                "losses_identical": True}

    a, b, bench = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "bench.json"
    a.write_text(json.dumps({"rows": [row(64, 1.06, 1.05)]}))
    b.write_text(json.dumps({"rows": [row(4, 1.66, 1.69)]}))
    result = {"median_ms": 120.0, "saved_fraction_of_offloaded": 0.9, "losses_identical": True}
    plan = {"measured_ratio": 1.2, "predicted_ratio": 1.18}
    bench.write_text(json.dumps({
        "results": {"baseline": {"median_ms": 100.0}, "offload": result, "offload@release": result},
        "planner": {"offload": plan, "offload@release": plan}}))
    sweep.merge([str(a), f"16={bench}", str(b)], str(tmp_path), keep={"baseline", "offload"})
    merged = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [(r["gbs"], r["variant"]) for r in merged] == [(4, "offload"), (16, "offload"), (64, "offload")]
    assert merged[1]["measured_over_floor"] == 1.2 / 1.18
    assert "| 16 | offload | 100 | 120 | 1.200 | 1.180 | 1.017 |" in capsys.readouterr().out


def test_alloc_trace_finds_the_hole_a_request_could_not_use():
    import numpy as np

    from alloc_trace import free_holes, growth_holes, phase_labels

    assert free_holes({0: 4, 8: 2}, [(0, 10), (10, 12)]) == [4, 2]  # adjacent mappings merge
    marker = 512 * (1000 + 4 * 1)  # the pretraining script's "iteration 1 begin" marker
    events = [("segment_map", 100 * MiB, 0), ("alloc", 40 * MiB, 0), ("alloc", 40 * MiB, 40 * MiB),
              ("alloc", 20 * MiB, 80 * MiB), ("alloc", marker, 10 * 2**30), ("free_completed", 40 * MiB, 0),
              ("segment_map", 60 * MiB, 100 * MiB), ("alloc", 50 * MiB, 100 * MiB)]
    trace = {"action": np.array([e[0] for e in events]), "size": np.array([e[1] for e in events]),
             "addr": np.array([e[2] for e in events]), "stream": np.zeros(len(events), dtype=np.int64)}
    labels = phase_labels(trace)
    assert labels[0] == "startup" and labels[-1] == "iteration 1 begin"
    assert growth_holes(trace, labels) == [(6, "iteration 1 begin", 60 * MiB, 50 * MiB, 40 * MiB, 40 * MiB)]
    # Another stream's free memory is no use to the request.
    trace["stream"] = np.array([7, 7, 7, 7, 0, 7, 0, 0])
    assert growth_holes(trace, labels) == [(6, "iteration 1 begin", 60 * MiB, 50 * MiB, 0, 0)]


def test_alloc_trace_layout_shows_what_separates_the_holes():
    import numpy as np

    from alloc_trace import layout_at, layout_events, phase_labels

    marker = 512 * (1000 + 4 * 1)
    events = [("segment_map", 100 * MiB, 0, 0), ("alloc", 40 * MiB, 0, 0), ("alloc", 10 * MiB, 40 * MiB, 0),
              ("alloc", 30 * MiB, 51 * MiB, 0),  # a 1 MiB gap: below min_hole, not listed
              ("alloc", 15 * MiB, 85 * MiB, 3),  # another stream's block inside the range: not this stream's
              ("alloc", marker, 10 * 2**30, 5), ("free_completed", 40 * MiB, 0, 0),  # iteration 1: a hole
              ("alloc", 2 * MiB, 81 * MiB, 0),  # allocated in iteration 1, after the others
              ("segment_map", 20 * MiB, 200 * MiB, 0), ("segment_unmap", 10 * MiB, 210 * MiB, 0),
              ("segment_alloc", 20 * MiB, 100 * MiB, 0),  # a default-allocator segment beside the pages
              ("alloc", 60 * MiB, 300 * MiB, 0)]  # the event whose layout is asked for
    trace = {key: np.array([e[k] for e in events]) for k, key in enumerate(("action", "size", "addr", "stream"))}
    labels = phase_labels(trace)
    got = layout_at(trace, labels, len(events) - 1)
    assert got == [(0, 100 * MiB, [("hole", 40 * MiB),
                                   ("used", 42 * MiB, 3, 30 * MiB, ["startup", "iteration 1 begin"]),
                                   ("hole", 17 * MiB)]),
                   (100 * MiB, 20 * MiB, [("hole", 20 * MiB)]),  # not merged with the pages before it
                   (200 * MiB, 10 * MiB, [("hole", 10 * MiB)])]
    growths = [(7, "x", 1, 600 * MiB, 0, 0), (9, "x", 1, 50 * MiB, 0, 0), (12, "x", 1, 500 * MiB, 0, 0),
               (15, "x", 1, 700 * MiB, 0, 0)]
    assert layout_events(growths, 100 * MiB, 2) == [7, 12]


def test_alloc_trace_labels_microbatches_and_finds_each_iterations_peak():
    import numpy as np

    from alloc_trace import iteration_peaks, phase_labels

    def marker(code):  # the pretraining script's markers: allocated and freed at once, on their stream
        return [("alloc", 512 * code, 10 * 2**30, 5), ("free_completed", 512 * code, 10 * 2**30, 5)]

    events = [("segment_map", 100 * MiB, 0, 0), ("alloc", 30 * MiB, 0, 0),
              *marker(1000 + 4 * 1), *marker(100 + 0), ("alloc", 50 * MiB, 30 * MiB, 0),  # iteration 1, fwd 0
              *marker(100 + 1), ("free_completed", 50 * MiB, 30 * MiB, 0),  # bwd 0
              *marker(100 + 2), ("segment_map", 40 * MiB, 100 * MiB, 0), ("alloc", 60 * MiB, 30 * MiB, 0),  # fwd 1
              *marker(1000 + 4 * 1 + 1), ("free_completed", 60 * MiB, 30 * MiB, 0),  # step_begin
              *marker(1000 + 4 * 2), ("segment_unmap", 40 * MiB, 100 * MiB, 0),  # iteration 2
              ("alloc", 512 * (1000 + 4 * 7), 0, 0)]  # a real allocation of a marker's size: no marker
    trace = {key: np.array([e[k] for e in events]) for k, key in enumerate(("action", "size", "addr", "stream"))}
    labels = phase_labels(trace)
    assert [labels[i] for i in (6, 9, 13)] == ["iteration 1 fwd 0", "iteration 1 bwd 0", "iteration 1 fwd 1"]
    assert labels[-1] == "iteration 2 begin"
    peaks = iteration_peaks(trace, labels)
    # Iteration 1's reserved peak (140 MiB) is where fwd 1 mapped more; "there" is after its 60 MiB request.
    assert peaks == [(1, 140 * MiB, "iteration 1 fwd 1", 90 * MiB), (2, 100 * MiB, "iteration 2 begin", 30 * MiB + 512 * 1028)]


def iters(*reserved):
    return {"iterations": [{"max_reserved": r * MiB} for r in reserved], "offloaded_bytes": 0}


def test_reserved_saving_needs_half_the_state_after_warm_up():
    from megatron_runs import reserved_saving_check

    plain = iters(9000, 4000, 4000)  # a start-up spike in iteration 0 is not counted
    ours = dict(iters(3000, 3490, 3500), offloaded_bytes=1000 * MiB)
    ok, detail = reserved_saving_check(plain, ours, first=1)
    assert ok, detail
    ours = dict(iters(3000, 3600, 3960), offloaded_bytes=1000 * MiB)  # 40 MiB: inside the noise
    ok, detail = reserved_saving_check(plain, ours, first=1)
    assert not ok and "saved 0.04 of 0.98 GiB" in detail
    assert not reserved_saving_check(plain, iters(1, 1, 1), first=1)[0]  # nothing offloaded


def test_printed_losses_are_read_per_iteration():
    from megatron_runs import printed_losses

    log = (" [2026-11-24 15:21:18] iteration       21/      30 | consumed samples:  336 | "
           "elapsed time per iteration (ms): 778.1 | lm loss: 1.374460E+00 | loss scale: 1.0 |\n"
           "[rank0] iteration 22/30 | lm loss: 1.499969E+00 | grad norm: 2.1 |\n")
    assert printed_losses(log) == {21: "1.374460E+00", 22: "1.499969E+00"}


def test_soak_stats_report_tail_latency_and_reserved_creep():
    from benchmark import soak_stats

    its = [{"ms": 100.0, "max_reserved": 1000 * MiB} for _ in range(320)]
    its[150].update(ms=400.0, gc_ms=250.0, alloc_retries=1)  # one outlier: p99 of 300 is the 297th
    for it in its[-100:]:
        it["max_reserved"] = 1010 * MiB
    s = soak_stats(its, warmup=20)
    assert s["iterations"] == 300 and s["p50_ms"] == 100.0 and s["max_ms"] == 400.0
    assert s["p99_ms"] == 100.0 and 151 in s["slowest_iterations"]
    outlier = next(o for o in s["slowest"] if o["iteration"] == 151)
    assert outlier["gc_ms"] == 250.0 and outlier["alloc_retries"] == 1 and outlier["device_allocs"] is None
    assert len(s["ms"]) == len(s["max_reserved_mib"]) == 300 and s["max_reserved_mib"][-1] == 1010
    assert abs(s["reserved_creep"] - 0.01) < 1e-9
    assert s["gc_slow_at"] == [[151, 250.0]] and s["gc_full_at"] == []
    its[1].update(gc_ms=600.0, gc_full=1)  # a full collection in warm-up is reported too
    assert soak_stats(its, warmup=20)["gc_full_at"] == [[2, 600.0]]
    assert soak_stats(its[:150], warmup=20) is None  # too short for two windows


def test_benchmark_losses_are_identical_only_over_the_whole_run(capsys):
    """The benchmark compared losses over the common prefix only, so a variant with no (or a
    truncated set of) losses counted as identical."""
    from benchmark import report

    def variant(losses):
        return {"median_ms": 1.0, "max_reserved_gib": [1.0], "max_allocated_gib": [1.0], "steady_max_reserved_gib": [1.0],
                "offloaded_gib": [0.5], "pinned_gib": [0.5], "losses": losses}

    results = {"baseline": variant(["0x1p+0", "0x1p-1"]), "offload": variant([]), "offload@again": variant(["0x1p+0", None]),
               "offload-chunk64": variant(["0x1p+0", "0x1p-1"])}
    report(results, None)
    assert results["offload"]["losses_identical"] is False
    assert results["offload@again"]["losses_identical"] is False
    assert results["offload-chunk64"]["losses_identical"] is True


def test_benchmark_reports_each_checkpoint_save(capsys):
    from benchmark import report

    def variant(saves):
        return {"median_ms": 1.0, "max_reserved_gib": [1.0], "max_allocated_gib": [1.0], "steady_max_reserved_gib": [1.0],
                "offloaded_gib": [0.5], "pinned_gib": [0.5], "losses": ["0x1p+0"], "saves": saves}

    report({"baseline": variant([]), "offload": variant([
        {"seconds": 0.21, "plugin_seconds": 0.05, "allocated_before": 10 * MiB, "max_allocated": 10 * MiB},
        {"seconds": 0.26, "plugin_seconds": 0.09, "plugin_collect_seconds": 0.03, "allocated_before": 10 * MiB,
         "max_allocated": 10 * MiB}])}, None)
    out = capsys.readouterr().out
    assert ("offload: checkpoint saves blocked the loop 0.21 s (plugin 0.05 s, GPU +0 MiB, snapshots 0.00 GiB of host "
            "memory), 0.26 s (plugin 0.09 s of which a garbage collection 0.03 s, GPU +0 MiB") in out
    assert "baseline: checkpoint saves" not in out


def test_save_growth_checks_skip_only_a_one_piece_rank_with_nothing_off():
    """A rank whose state is one chunk holds it through the chunked step (DP2 rank 1 of the
    matrix's dp2-async-chunked, before a parameter's state could be split): it is left out, the
    other rank still checked. So is a rank whose state is one parameter split over several chunks,
    all but the last held back by the step (that rank since). A rank of several chunks with
    nothing off and fewer held back is checked, and fails."""
    from megatron_runs import save_growth_checks

    def one_chunk(record):
        return dict(record, chunk_count=1)

    checks = save_growth_checks([rank(10), rank(10)], [rank(12, state=256), one_chunk(rank(10, state=256, off=0))])
    assert [c[0] for c in checks] == ["rank 0 checkpoint save reads what is off the GPU from the host",
                                      "some rank saved with state off the GPU"]
    assert all(ok for _, ok, _ in checks) and "[1]" in checks[-1][2]
    # One split parameter in three chunks, two held back at a step: left out as well.
    split = dict(rank(10, state=168, off=0), chunk_count=3, step_waiting=2)
    checks = save_growth_checks([rank(10), rank(10)], [rank(12, state=256), split])
    assert [ok for _, ok, _ in checks] == [True, True] and "[1]" in checks[-1][2]
    # The same chunks with at most one held back: checked, and it fails.
    checks = save_growth_checks([rank(10), rank(10)],
                                [rank(12, state=256), dict(split, step_waiting=1)])
    assert [ok for _, ok, _ in checks] == [True, False, True]
    # Two held back of four chunks: the threshold follows the chunk count, so it is checked.
    checks = save_growth_checks([rank(10), rank(10)], [rank(12, state=256), dict(split, chunk_count=4)])
    assert [ok for _, ok, _ in checks] == [True, False, True]
    # A save that brought the state back on the checked rank still fails.
    checks = save_growth_checks([rank(10), rank(10)],
                                [rank(10 + 256, state=256), one_chunk(rank(10, state=256, off=0))])
    assert not checks[0][1]
    # Several chunks, nothing off, the whole state brought back by the save: not skipped, fails.
    checks = save_growth_checks([rank(10), rank(10)],
                                [rank(12, state=256), dict(rank(10 + 2048, state=2048, off=0), chunk_count=4)])
    assert [ok for _, ok, _ in checks] == [True, False, True]
    # Nothing checked at all: fails.
    checks = save_growth_checks([rank(10)], [one_chunk(rank(10, state=256, off=0))])
    assert [ok for _, ok, _ in checks] == [False]


def test_runs_may_load_te_fp8_metadata_of_their_own_checkpoints_and_stay_off_nvlink_multicast(tmp_path):
    """TE 2.20.2 refuses to load delayed-scaling FP8 metadata (a pickle) unless told; the suite's
    runs load only checkpoints the suite wrote, so its resumes set it (a run may still override)."""
    from megatron_runs import _command

    _, env, _ = _command("resume", [], 1, str(tmp_path), "scripts/pretrain_gpt_mock.py", None)
    assert env["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    _, env, _ = _command("resume", [], 1, str(tmp_path), "scripts/pretrain_gpt_mock.py",
                         {"NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "0", "NCCL_NVLS_ENABLE": "1"})
    assert env["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"
