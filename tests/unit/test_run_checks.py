"""The functional runs' checks themselves (scripts/megatron_runs.py), on made-up rank records."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

from megatron_runs import save_growth_check  # noqa: E402

MiB = 2**20


def rank(grew, state=0):
    return {"saves": [{"allocated_before": 1000 * MiB, "max_allocated": (1000 + grew) * MiB}],
            "offloaded_bytes": state * MiB}


def test_a_save_that_reads_host_copies_passes():
    ok, detail = save_growth_check(rank(10), rank(12, state=256))
    assert ok, detail


def test_a_save_that_brings_the_state_back_fails():
    ok, detail = save_growth_check(rank(10), rank(10 + 256, state=256))
    assert not ok, detail


def test_no_save_recorded_fails():
    ok, _ = save_growth_check(rank(10), {"saves": [], "offloaded_bytes": 256 * MiB})
    assert not ok


def test_offloaded_at_save_is_the_least_over_the_saves():
    from megatron_runs import offloaded_at_save

    saves = [{"offloaded_before": 300 * MiB}, {"offloaded_before": 0}]
    assert offloaded_at_save({"saves": saves}) == 0
    assert offloaded_at_save({"saves": saves[:1]}) == 300 * MiB
    assert offloaded_at_save({"saves": []}) == 0
