"""benchmarks/tools/copy_overlap.py on a synthetic timeline (no GPU)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "tools"))

import copy_overlap  # noqa: E402

MS = 1000.0  # timeline units are microseconds


def _timeline():
    """Compute: ten 10 ms kernels on stream 7 (the last four named "adam"). H2D on stream 28: two
    20 ms rows of 1.1 GB (55 GB/s), at 0-20 and 20-40 ms. D2H on stream 24: one 30 ms row of
    1.5 GB (50 GB/s) at 30-60 ms, so 10 ms of it beside the second H2D row. A 1 GB device copy on
    the compute stream, which is the model's and not counted."""
    rows = [[i * 10 * MS, 10 * MS, 7, "kernel", 0, "adam" if i >= 6 else "mm"] for i in range(10)]
    rows += [[0.0, 20 * MS, 28, "gpu_memcpy", 1_100_000_000, "Memcpy HtoD (Pinned -> Device)"],
             [20 * MS, 20 * MS, 28, "gpu_memcpy", 1_100_000_000, "Memcpy HtoD (Pinned -> Device)"],
             [30 * MS, 30 * MS, 24, "gpu_memcpy", 1_500_000_000, "Memcpy DtoH (Device -> Pinned)"],
             [5 * MS, 1 * MS, 7, "gpu_memcpy", 1_000_000_000, "Memcpy DtoD (Device -> Device)"]]
    return rows


def test_directions_rates_and_time_together():
    lines = copy_overlap.report(_timeline(), bin_ms=20, mark="adam")
    h2d, d2h, both, marked, _, bins = lines
    # H2D: 30 ms alone (1.65 GB), 10 ms beside the D2H (0.55 GB) -> 55 GB/s both ways.
    assert h2d == "H2D: 2.20 GB in 2 rows, 0.0 to 40.0 ms; alone 30.0 ms at 55.0 GB/s, with D2H 10.0 ms at 55.0 GB/s"
    assert d2h == "D2H: 1.50 GB in 1 rows, 30.0 to 60.0 ms; alone 20.0 ms at 50.0 GB/s, with H2D 10.0 ms at 50.0 GB/s"
    assert both == "both directions at once: 10.0 ms, 105.0 GB/s together"
    assert marked == "compute-stream kernels with 'adam': 4, 60.0 to 100.0 ms"
    # Bytes spread over each row's duration: the D2H row's 1.5 GB over 30-60 ms.
    assert bins == "0: 1.10 / 0.00, 20: 1.10 / 0.50, 40: 0.00 / 1.00"


def test_split_and_bins_conserve_bytes():
    rows = copy_overlap.copies(_timeline())
    assert [len(rows[d]) for d in ("H2D", "D2H")] == [2, 1]  # (the compute stream's DtoD left out)
    both_b, both_us, alone_b, alone_us = copy_overlap.split(rows["D2H"], copy_overlap.union(rows["H2D"]))
    assert both_b + alone_b == pytest.approx(1.5e9) and both_us + alone_us == pytest.approx(30 * MS)
    assert sum(copy_overlap.binned(rows["H2D"], 0.0, 7 * MS).values()) == pytest.approx(2.2e9)


def test_no_copies_in_one_direction():
    rows = [r for r in _timeline() if "DtoH" not in r[5]]
    lines = copy_overlap.report(rows)
    assert lines[1] == "D2H: no copies" and not any(line.startswith("both directions") for line in lines)
