"""Where two profiled iterations spend their GPU time differently: each stream's totals, the compute
stream's busy time, and the kernels whose time changed, on the compute stream or beside it.

    python benchmarks/tools/timeline_diff.py BASELINE.json.gz OTHER.json.gz [--top 12]

Input: the compact timelines the benchmark's `@prof` writes (`gpu_timeline_iter<N>.json.gz`, one
row [start us, duration us, stream, kind, bytes, name] per kernel, memcpy or memset; see
`scripts/pretrain_gpt_mock.py`). Stream ids differ between processes, so each file's compute stream
is the one with the most kernel time. A kernel that runs beside the compute stream in one run and
on it in the other shows as time moved between the two columns: what the compute stream gained
that the baseline's phases (hence the planner's floor) ran concurrently.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from typing import Dict, List, Sequence, Tuple

Row = Sequence  # [start us, duration us, stream, kind, bytes, name]


def load(path: str) -> List[Row]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def compute_stream(rows: List[Row]):
    """The stream with the most kernel time."""
    time = collections.Counter()
    for start, dur, stream, kind, _, _ in rows:
        if kind == "kernel":
            time[stream] += dur
    if not time:
        raise SystemExit("timeline_diff: a timeline without kernels (no compute stream to compare)")
    return time.most_common(1)[0][0]


def union(spans) -> List[Tuple[float, float]]:
    """Disjoint, sorted intervals covering `spans` ((start, end, ...) tuples)."""
    merged: List[List[float]] = []
    for start, end, *_ in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def busy_ms(rows: List[Row], stream) -> Tuple[float, float]:
    """(busy, span) of `stream` in ms: the union of its rows' intervals, and first start to last end."""
    merged = union((r[0], r[0] + r[1]) for r in rows if r[2] == stream)
    if not merged:
        return 0.0, 0.0
    return sum(b - a for a, b in merged) / 1e3, (merged[-1][1] - merged[0][0]) / 1e3


def per_stream(rows: List[Row]) -> Dict[tuple, List[float]]:
    """{(stream, kind): [count, ms, GiB]}."""
    out: Dict[tuple, List[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for _, dur, stream, kind, nbytes, _ in rows:
        entry = out[(stream, kind)]
        entry[0] += 1
        entry[1] += dur / 1e3
        entry[2] += (nbytes or 0) / 2**30
    return dict(out)


def by_name(rows: List[Row], compute) -> Dict[str, List[float]]:
    """{name: [ms on the compute stream, count there, ms on other streams, count there]} (copies
    off the compute stream excluded: they are the plugin's own streams, reported per stream)."""
    out: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0, 0.0, 0])
    for _, dur, stream, kind, _, name in rows:
        if stream == compute:
            out[name][0] += dur / 1e3
            out[name][1] += 1
        elif kind != "gpu_memcpy":
            out[name][2] += dur / 1e3
            out[name][3] += 1
    return dict(out)


def compare(a: List[Row], b: List[Row], top: int = 12) -> List[str]:
    """Report lines: each run's streams, compute busy and span, then the `top` names by how much
    the compute stream's time for them changed from `a` to `b`."""
    lines = []
    names = {}
    for label, rows in (("A", a), ("B", b)):
        compute = compute_stream(rows)
        busy, span = busy_ms(rows, compute)
        lines.append(f"{label}: compute stream {compute}: busy {busy:.1f} ms of a {span:.1f} ms span")
        for (stream, kind), (count, ms, gib) in sorted(per_stream(rows).items(), key=lambda kv: str(kv[0])):
            where = "compute" if stream == compute else "other"
            lines.append(f"  stream {stream} ({where}) {kind}: {count} rows, {ms:.1f} ms"
                         + (f", {gib:.2f} GiB" if gib else ""))
        names[label] = by_name(rows, compute)
    lines.append("compute ms B-A | A compute ms (n) | B compute ms (n) | A other ms (n) | B other ms (n) | name")
    empty = [0.0, 0, 0.0, 0]
    keys = set(names["A"]) | set(names["B"])
    ranked = sorted(keys, key=lambda k: -abs(names["B"].get(k, empty)[0] - names["A"].get(k, empty)[0]))
    for name in ranked[:top]:
        x, y = names["A"].get(name, empty), names["B"].get(name, empty)
        lines.append(f"{y[0] - x[0]:+.1f} | {x[0]:.1f} ({x[1]}) | {y[0]:.1f} ({y[1]}) | {x[2]:.1f} ({x[3]}) | "
                     f"{y[2]:.1f} ({y[3]}) | {name}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="the reference timeline (e.g. baseline@prof's)")
    parser.add_argument("b", help="the timeline to compare (e.g. offload@prof's)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    print("\n".join(compare(load(args.a), load(args.b), args.top)))


if __name__ == "__main__":
    main()
