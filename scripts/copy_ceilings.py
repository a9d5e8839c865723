"""PCIe copy ceilings on this GPU: pinned D2H, pinned H2D, and both directions at once.

    python scripts/copy_ceilings.py [--sizes-gib 0.25,1,4] [--repeat 5] [--out ceilings.json]

Host memory is page-locked exactly as megatron-offload does it (`PinnedHostBuffer`, i.e.
cudaHostRegister), the device side is a plain allocation. Each figure is the median over
`--repeat` timed copies (CUDA events) after one warm-up; GB/s are 10^9 bytes per second. The
benchmark uses the largest size's medians as the ceiling that achieved bandwidth is compared to.
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_offload.host_buffer import PinnedHostBuffer  # noqa: E402


def _time_ms(fn, repeat):
    times = []
    fn()  # warm-up
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(sizes_gib, repeat=5):
    results = []
    d2h_stream, h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()
    for gib in sizes_gib:
        nbytes = int(gib * 2**30)
        host_out, host_in = PinnedHostBuffer(nbytes), PinnedHostBuffer(nbytes)
        dev_src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        dev_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        h_out = host_out.view(0, dev_src)
        h_in = host_in.view(0, dev_src)
        h_in.copy_(dev_src)

        def d2h():
            h_out.copy_(dev_src, non_blocking=True)

        def h2d():
            dev_dst.copy_(h_in, non_blocking=True)

        def both():
            current = torch.cuda.current_stream()
            for s in (d2h_stream, h2d_stream):
                s.wait_stream(current)  # start together, after the timing event
            with torch.cuda.stream(d2h_stream):
                d2h()
            with torch.cuda.stream(h2d_stream):
                h2d()
            current.wait_stream(d2h_stream)  # the end event covers both copies
            current.wait_stream(h2d_stream)

        row = {"gib": gib, "pinning": host_out.pinning}
        for name, fn, moved in (("d2h", d2h, nbytes), ("h2d", h2d, nbytes), ("both", both, 2 * nbytes)):
            ms = _time_ms(fn, repeat)
            row[f"{name}_gbps"] = moved / ms / 1e6
        assert torch.equal(dev_dst[:4096].cpu(), dev_src[:4096].cpu()) and torch.equal(
            h_out[:4096], dev_src[:4096].cpu()), "copy check failed"
        results.append(row)
        del dev_src, dev_dst
        host_out.close()
        host_in.close()
    return results


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-gib", default="0.25,1,4")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("copy_ceilings: needs a CUDA GPU")
    rows = measure([float(x) for x in opts.sizes_gib.split(",")], opts.repeat)
    print("| GiB | pinning | D2H GB/s | H2D GB/s | both at once GB/s (sum) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gib']:g} | {r['pinning']} | {r['d2h_gbps']:.1f} | {r['h2d_gbps']:.1f} | {r['both_gbps']:.1f} |")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
