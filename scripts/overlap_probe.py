"""Does a host<->device copy on a side stream slow the compute stream down, and does the answer
depend on CUDA_DEVICE_MAX_CONNECTIONS (Megatron's launch scripts set it to 1, which puts every
stream of the process into one hardware queue)?

    CUDA_DEVICE_MAX_CONNECTIONS=1 python scripts/overlap_probe.py [--gib 4] [--out probe.json]

Each pattern mimics what the offloader does after an optimizer step: the compute stream runs a
short "step", a copy stream waits on an event recorded after it and enqueues the copy, then the
compute stream gets ~150 ms of bf16 matmuls (the "forward"). Reported per pattern: the compute
span (first to last matmul, CUDA events on the compute stream), its ratio to the same matmuls with
no copy, and the copy's span and GB/s. Copy engines (`Tensor.copy_`) are compared with a Triton
kernel that moves the bytes with a few SMs through the pinned buffer's device mapping.
"""

import argparse
import json
import os
import statistics

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the probe then skips the SM copies
    triton = None

if triton is not None:

    @triton.jit
    def _sm_copy(src, dst, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


class _Ptr:
    """Lets Triton take a pinned host buffer: it only needs data_ptr() and dtype (UVA pointer)."""

    def __init__(self, t):
        self.dtype = t.dtype
        self._ptr = t.data_ptr()

    def data_ptr(self):
        return self._ptr


def sm_copy(dst, src, ctas):
    n = dst.numel()
    _sm_copy[(ctas,)](_Ptr(src), _Ptr(dst), n, BLOCK=4096, num_warps=8)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--matmuls", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    o = p.parse_args()
    conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default(8)")
    nbytes = int(o.gib * 2**30)
    dev = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
    host = torch.empty(nbytes // 4, dtype=torch.int32, pin_memory=True)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side_hi = torch.cuda.Stream(priority=-1)

    def ce(direction, piece_mib=0):
        def go(stream):
            d, s = (host, dev) if direction == "d2h" else (dev, host)
            step = (piece_mib * 2**20 // 4) or d.numel()
            for i in range(0, d.numel(), step):
                d[i : i + step].copy_(s[i : i + step], non_blocking=True)
                stream.record_event()  # as the offloader does per chunk
        return go

    def sm(direction, ctas):
        def go(stream):
            d, s = (host, dev) if direction == "d2h" else (dev, host)
            sm_copy(d, s, ctas)
        return go

    def run(copy, stream):
        for _ in range(3):
            torch.mm(a, b)  # the "step"
        step_done = compute.record_event()
        c0 = c1 = None
        if copy is not None:
            with torch.cuda.stream(stream):
                stream.wait_event(step_done)  # like d2h_wait_for_compute
                c0 = torch.cuda.Event(enable_timing=True)
                c0.record(stream)
                copy(stream)
                c1 = torch.cuda.Event(enable_timing=True)
                c1.record(stream)
        m0, m1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        m0.record(compute)
        for _ in range(o.matmuls):
            torch.mm(a, b)
        m1.record(compute)
        torch.cuda.synchronize()
        copy_ms = c0.elapsed_time(c1) if c0 is not None else 0.0
        # Copy start relative to the matmuls' start (negative: it started first).
        lag = m0.elapsed_time(c0) if c0 is not None else 0.0
        return m0.elapsed_time(m1), copy_ms, lag

    patterns = {"compute_only": (None, None)}
    for direction in ("d2h", "h2d"):
        patterns[f"ce_{direction}"] = (ce(direction), side)
        patterns[f"ce_{direction}_pieces32"] = (ce(direction, 32), side)
        if triton is not None:
            for ctas in (8, 16, 32):
                patterns[f"sm{ctas}_{direction}"] = (sm(direction, ctas), side)
            patterns[f"sm16_{direction}_hiprio"] = (sm(direction, 16), side_hi)
    results = {}
    for name, (copy, stream) in patterns.items():
        try:
            run(copy, stream)  # warm-up (and Triton compile)
            runs = [run(copy, stream) for _ in range(o.repeat)]
        except Exception as exc:  # noqa: BLE001 - report and go on
            results[name] = {"error": repr(exc)[:300]}
            print(f"conn={conn} {name}: ERROR {exc!r}"[:400], flush=True)
            continue
        mm = statistics.median(r[0] for r in runs)
        cp = statistics.median(r[1] for r in runs)
        results[name] = {"compute_ms": mm, "copy_ms": cp, "copy_start_ms": statistics.median(r[2] for r in runs),
                         "copy_gbps": nbytes / cp / 1e6 if cp else 0.0}
    base = results["compute_only"]["compute_ms"]
    for name, r in results.items():
        if "error" in r:
            continue
        r["compute_ratio"] = r["compute_ms"] / base
        print(f"conn={conn} {name:22s} compute {r['compute_ms']:7.1f} ms ({r['compute_ratio']:.3f}x)  "
              f"copy {r['copy_ms']:7.1f} ms  {r['copy_gbps']:5.1f} GB/s  start {r['copy_start_ms']:+.1f} ms",
              flush=True)
    # Correctness of the SM copy path (bytes really arrive).
    if triton is not None and "error" not in results.get("sm16_d2h", {"error": 1}):
        dev.random_(0, 2**31 - 1)
        sm_copy(host, dev, 16)
        torch.cuda.synchronize()
        ok_d2h = torch.equal(host, dev.cpu())
        host.random_(0, 2**31 - 1)
        sm_copy(dev, host, 16)
        torch.cuda.synchronize()
        ok_h2d = torch.equal(dev.cpu(), host)
        print(f"conn={conn} sm copy exact: d2h {ok_d2h} h2d {ok_h2d}", flush=True)
        results["sm_exact"] = {"d2h": ok_d2h, "h2d": ok_h2d}
    if o.out:
        with open(o.out, "w") as f:
            json.dump({"connections": conn, "gib": o.gib, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
