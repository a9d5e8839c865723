"""How the two copy directions share the link in one profiled iteration.

    python benchmarks/tools/copy_overlap.py TIMELINE.json.gz [--bin-ms 20] [--mark multi_tensor_apply]

Input: a compact timeline of the benchmark's `@prof` / `@prof13` (rows [start us, duration us,
stream, kind, bytes, name]; timeline_diff.py reads the same). The copies counted are memcpy rows
that move bytes between the host and the device on any stream but the compute stream (the
plugin's copy streams; the compute stream's own copies are the model's), by direction from the
row's name ("HtoD" / "DtoH"). Each row is taken to move its bytes at a constant rate over its
duration.

Printed, in ms from the timeline's first row: per direction its bytes, first start and last end,
and its rate while it copied alone and while the other direction copied too; the time both
copied at once and their rate together then; bytes per direction in bins of `--bin-ms`; and,
with `--mark`, the first start and last end of the compute stream's kernels whose name holds
that text (e.g. the optimizer step's `multi_tensor_apply`).
"""

from __future__ import annotations

import argparse
import collections
from typing import Dict, List, Sequence, Tuple

from timeline_diff import compute_stream, load, union

DIRECTIONS = (("H2D", "HtoD"), ("D2H", "DtoH"))


def copies(rows: Sequence) -> Dict[str, List[Tuple[float, float, int]]]:
    """{direction: [(start us, end us, bytes)]}, sorted, off the compute stream."""
    compute = compute_stream(rows)
    out: Dict[str, List[Tuple[float, float, int]]] = {d: [] for d, _ in DIRECTIONS}
    for start, dur, stream, kind, nbytes, name in rows:
        if kind != "gpu_memcpy" or stream == compute or not nbytes or dur <= 0:
            continue
        for direction, tag in DIRECTIONS:
            if tag in name:
                out[direction].append((start, start + dur, nbytes))
    return {d: sorted(v) for d, v in out.items()}


def overlap(start: float, end: float, spans: List[Tuple[float, float]]) -> float:
    """Length of [start, end) inside the disjoint `spans`."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def split(rows: List[Tuple[float, float, int]], other: List[Tuple[float, float]]):
    """(bytes, us) of `rows` while `other` was copying too, and while it was not."""
    both_bytes = both_us = alone_bytes = alone_us = 0.0
    for start, end, nbytes in rows:
        shared = overlap(start, end, other)
        share = shared / (end - start)
        both_bytes += nbytes * share
        alone_bytes += nbytes * (1 - share)
        both_us += shared
        alone_us += end - start - shared
    return both_bytes, both_us, alone_bytes, alone_us


def binned(rows: List[Tuple[float, float, int]], origin: float, bin_us: float) -> Dict[int, float]:
    """{bin index: bytes} with each row's bytes spread evenly over its duration."""
    out: Dict[int, float] = collections.defaultdict(float)
    for start, end, nbytes in rows:
        rate = nbytes / (end - start)
        k = int((start - origin) // bin_us)
        while origin + k * bin_us < end:
            lo, hi = max(start, origin + k * bin_us), min(end, origin + (k + 1) * bin_us)
            if hi > lo:
                out[k] += rate * (hi - lo)
            k += 1
    return dict(out)


def gbps(nbytes: float, us: float) -> float:
    return nbytes / us / 1e3 if us else float("nan")


def report(rows: Sequence, bin_ms: float = 20.0, mark: str = "") -> List[str]:
    origin = min(r[0] for r in rows)
    by_dir = copies(rows)
    spans = {d: union(v) for d, v in by_dir.items()}
    # (bytes, us) of each direction while the other copied too, then while it did not.
    splits = {d: split(by_dir[d], spans[o]) for (d, _), (o, _) in zip(DIRECTIONS, reversed(DIRECTIONS))}
    lines = []
    for (direction, _), (other, _) in zip(DIRECTIONS, reversed(DIRECTIONS)):
        rows_d = by_dir[direction]
        if not rows_d:
            lines.append(f"{direction}: no copies")
            continue
        both_b, both_us, alone_b, alone_us = splits[direction]
        total = sum(r[2] for r in rows_d)
        lines.append(f"{direction}: {total / 1e9:.2f} GB in {len(rows_d)} rows, {(rows_d[0][0] - origin) / 1e3:.1f} to "
                     f"{(max(r[1] for r in rows_d) - origin) / 1e3:.1f} ms; alone {alone_us / 1e3:.1f} ms at "
                     f"{gbps(alone_b, alone_us):.1f} GB/s, with {other} {both_us / 1e3:.1f} ms at "
                     f"{gbps(both_b, both_us):.1f} GB/s")
    together = sum(overlap(a, b, spans["D2H"]) for a, b in spans["H2D"])
    if together:
        moved = sum(s[0] for s in splits.values())
        lines.append(f"both directions at once: {together / 1e3:.1f} ms, {gbps(moved, together):.1f} GB/s together")
    if mark:
        compute = compute_stream(rows)
        hits = [r for r in rows if r[2] == compute and r[3] == "kernel" and mark in r[5]]
        if hits:
            lines.append(f"compute-stream kernels with '{mark}': {len(hits)}, {(hits[0][0] - origin) / 1e3:.1f} to "
                         f"{(max(r[0] + r[1] for r in hits) - origin) / 1e3:.1f} ms")
        else:
            lines.append(f"compute-stream kernels with '{mark}': none")
    bin_us = bin_ms * 1e3
    bins = {d: binned(v, origin, bin_us) for d, v in by_dir.items()}
    keys = sorted(set().union(*[set(b) for b in bins.values()]))
    if keys:
        lines.append(f"GB per {bin_ms:g} ms bin (bin start ms: H2D / D2H)")
        lines.append(", ".join(f"{k * bin_ms:g}: {bins['H2D'].get(k, 0) / 1e9:.2f} / {bins['D2H'].get(k, 0) / 1e9:.2f}"
                               for k in keys))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline", help="a compact timeline (gpu_timeline_iter<N>.json.gz)")
    parser.add_argument("--bin-ms", type=float, default=20.0)
    parser.add_argument("--mark", default="", help="report the compute stream's kernels whose name holds this")
    args = parser.parse_args(argv)
    print("\n".join(report(load(args.timeline), args.bin_ms, args.mark)))


if __name__ == "__main__":
    main()
