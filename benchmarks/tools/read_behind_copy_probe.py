"""Does a small device-to-host read (Megatron's loss / update-flag `.item()` after the optimizer
step) wait behind a large copy-out enqueued before it, and does feeding the copy-out in pieces,
a bounded number in flight, let the read through without slowing the copy-out?

    python benchmarks/tools/read_behind_copy_probe.py [--gib 4] [--piece-mib 64] [--depth 2] [--out probe.json]

Why it matters: the plugin enqueues the copy-out of the stepped state when the next forward
begins, because enqueued right after the step it held up the host's read that follows the step
by the whole copy (benchmarks/NOTES.md, 2026-11-21). Issue 24's streamed step wants the copy-out
to start inside the step; that only pays if the read is not held up, e.g. with a feeder that
keeps a few pieces in flight.

Each trial: a "step" kernel, then the copy-out of --gib GiB on a side stream (waiting on the
step), then ~--compute-ms of bf16 matmuls on the compute stream (the rest of the step, the
all-reduce, the next forward), then `.item()` of a scalar computed after them. Reported per mode
(median over --repeat trials): host ms from the first launch to the read's return, the same with
no copy at all (the compute alone), the host ms to enqueue the compute (a feeder thread holding
the GIL would show there), and the copy-out's span and GB/s (CUDA events on its stream).

Modes:
  none      no copy (reference);
  bulk      one copy, enqueued before the compute (what the plugin did before deferring it);
  pieces    the same bytes as --piece-mib copies, all enqueued at once;
  fed       a host thread enqueues the pieces, at most --depth in flight (it waits on the oldest
            piece's event, with the GIL released, before enqueuing the next);
  deferred  one copy enqueued after the read (what the plugin does now: copy-out at the next forward).
  fed-polled   fed, the thread polling the oldest piece's event (sleeping between polls) instead of
               blocking in its synchronize: does a blocked CUDA call in the thread hold the read up?
  fed-pinread  fed, the read copied into pinned host memory (non-blocking, then its event) instead of
               `.item()`'s pageable copy: is it the pageable copy's path that waits?

Run once per CUDA_DEVICE_MAX_CONNECTIONS setting that matters (Megatron's scripts set 1).
"""

import argparse
import collections
import json
import os
import statistics
import threading
import time

import torch


def feed(pieces, depth, stream, device, started, polled=False):
    """Enqueue `pieces` ((dst, src) pairs) on `stream`, at most `depth` in flight."""
    torch.cuda.set_device(device)
    inflight = collections.deque()
    with torch.cuda.stream(stream):
        started.set()
        for dst, src in pieces:
            while len(inflight) >= depth:
                oldest = inflight.popleft()
                if polled:
                    while not oldest.query():
                        time.sleep(0.0002)
                else:
                    oldest.synchronize()  # (releases the GIL while it waits)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            inflight.append(ev)


def trial(mode, src, dst, a, b, matmuls, piece, depth, compute, side, scalar):
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    thread = None
    t0 = time.perf_counter()
    step = torch.cuda.Event()
    (a.mul_(1.0)).sum()  # the "step"
    step.record(compute)
    pieces = [(dst[i:i + piece], src[i:i + piece]) for i in range(0, src.numel(), piece)]
    fed = mode.startswith("fed")
    if mode in ("bulk", "pieces") or fed:
        side.wait_event(step)
        begin.record(side)
        if mode == "bulk":
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
        elif mode == "pieces":
            with torch.cuda.stream(side):
                for d, s in pieces:
                    d.copy_(s, non_blocking=True)
        else:
            started = threading.Event()
            thread = threading.Thread(target=feed, args=(pieces, depth, side, src.device, started,
                                                         mode == "fed-polled"))
            thread.start()
            started.wait()
    out = a
    for _ in range(matmuls):
        out = torch.matmul(a, b)
    flag = out.float().sum()
    launch_ms = (time.perf_counter() - t0) * 1e3  # host time to enqueue it all (a feeder taking the GIL shows here)
    if mode == "fed-pinread":
        scalar.copy_(flag, non_blocking=True)
        done = torch.cuda.Event()
        done.record(compute)
        done.synchronize()
        value = scalar.item()
    else:
        value = flag.item()  # the read
    read_ms = (time.perf_counter() - t0) * 1e3
    if mode == "deferred":
        side.wait_event(step)
        begin.record(side)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
    if thread is not None:
        thread.join()
    if mode != "none":
        end.record(side)
    torch.cuda.synchronize()
    copy_ms = begin.elapsed_time(end) if mode != "none" else 0.0
    del value
    return read_ms, copy_ms, launch_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--piece-mib", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--compute-ms", type=float, default=40.0, help="matmul time after the step (calibrated)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    opts = p.parse_args()
    if opts.depth < 1 or opts.piece_mib < 1:
        p.error("--depth and --piece-mib must be >= 1")
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = int(opts.gib * 2**30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
    # Calibrate the matmul count to about --compute-ms.
    torch.matmul(a, b)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / 10 * 1e3
    matmuls = max(1, round(opts.compute_ms / per))
    piece = opts.piece_mib * 2**20
    results = {"connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset"), "gib": opts.gib,
               "piece_mib": opts.piece_mib, "depth": opts.depth, "matmuls": matmuls, "matmul_ms": per, "modes": {}}
    scalar = torch.empty((), dtype=torch.float32, pin_memory=True)
    for mode in ("none", "bulk", "pieces", "fed", "deferred", "fed-polled", "fed-pinread"):
        args = (src, dst, a, b, matmuls, piece, opts.depth, compute, side, scalar)
        trial(mode, *args)  # warm-up
        runs = [trial(mode, *args) for _ in range(opts.repeat)]
        read = statistics.median(r[0] for r in runs)
        copy = statistics.median(r[1] for r in runs)
        launch = statistics.median(r[2] for r in runs)
        results["modes"][mode] = {"read_ms": read, "copy_ms": copy, "launch_ms": launch,
                                  "copy_gbps": nbytes / copy / 1e6 if copy else None}
    none = results["modes"]["none"]["read_ms"]
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={results['connections']}: {opts.gib} GiB copy-out, {matmuls} matmuls "
          f"({matmuls * per:.1f} ms), pieces {opts.piece_mib} MiB, depth {opts.depth}")
    print("| mode | read returns after ms | x compute alone | host ms to enqueue | copy-out ms | GB/s |")
    print("|---|---|---|---|---|---|")
    for mode, r in results["modes"].items():
        gbps = f"{r['copy_gbps']:.1f}" if r["copy_gbps"] else "-"
        print(f"| {mode} | {r['read_ms']:.1f} | {r['read_ms'] / none:.2f} | {r['launch_ms']:.1f} | {r['copy_ms']:.1f} "
              f"| {gbps} |")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
