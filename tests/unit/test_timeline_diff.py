"""benchmarks/tools/timeline_diff.py on synthetic timelines (no GPU)."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "tools"))

import timeline_diff  # noqa: E402


def _timelines():
    """A: ten 1 ms matmuls on stream 7, five 0.5 ms accumulations beside them on stream 21 (each
    inside a matmul). B (another process: other stream ids): the same matmuls on stream 3, the
    accumulations after each of the first five on stream 3 too, and a copy on stream 9."""
    a = [[i * 1000.0, 1000.0, 7, "kernel", 0, "mm"] for i in range(10)]
    a += [[i * 1000.0 + 200, 500.0, 21, "kernel", 0, "acc"] for i in range(5)]
    b = []
    t = 0.0
    for i in range(10):
        b.append([t, 1000.0, 3, "kernel", 0, "mm"])
        t += 1000.0
        if i < 5:
            b.append([t, 500.0, 3, "kernel", 0, "acc"])
            t += 500.0
    b.append([0.0, 4000.0, 9, "gpu_memcpy", 2**30, "Memcpy DtoH"])
    return a, b


def test_moved_kernels_show_as_compute_time_gained_and_side_time_lost():
    a, b = _timelines()
    assert timeline_diff.compute_stream(a) == 7 and timeline_diff.compute_stream(b) == 3
    assert timeline_diff.busy_ms(a, 7) == (10.0, 10.0)
    assert timeline_diff.busy_ms(b, 3) == (12.5, 12.5)
    lines = timeline_diff.compare(a, b, top=2)
    table = lines[lines.index(next(x for x in lines if x.startswith("compute ms B-A"))) + 1:]
    # The accumulations moved: +2.5 ms on the compute stream, 2.5 ms fewer beside it; the
    # matmuls did not change.
    assert table[0] == "+2.5 | 0.0 (0) | 2.5 (5) | 2.5 (5) | 0.0 (0) | acc"
    assert table[1] == "+0.0 | 10.0 (10) | 10.0 (10) | 0.0 (0) | 0.0 (0) | mm"
    assert "  stream 9 (other) gpu_memcpy: 1 rows, 4.0 ms, 1.00 GiB" in lines


def test_overlapping_rows_count_once_in_busy_time():
    rows = [[0.0, 1000.0, 1, "kernel", 0, "x"], [500.0, 1000.0, 1, "kernel", 0, "y"],
            [3000.0, 500.0, 1, "kernel", 0, "z"], [0.0, 9000.0, 2, "kernel", 0, "other stream"]]
    assert timeline_diff.busy_ms(rows, 1) == (2.0, 3.5)
    assert timeline_diff.busy_ms(rows, 5) == (0.0, 0.0)


def test_main_reads_gzipped_files(tmp_path, capsys):
    a, b = _timelines()
    paths = []
    for name, rows in (("a.json.gz", a), ("b.json.gz", b)):
        path = tmp_path / name
        with gzip.open(path, "wt") as f:
            json.dump(rows, f)
        paths.append(str(path))
    timeline_diff.main(paths + ["--top", "1"])
    out = capsys.readouterr().out
    assert "B: compute stream 3: busy 12.5 ms of a 12.5 ms span" in out
    assert out.rstrip().endswith("| acc")


def test_a_timeline_without_kernels_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="without kernels"):
        timeline_diff.compare([[0.0, 5.0, 9, "gpu_memcpy", 1, "Memcpy DtoH"]], _timelines()[1])
