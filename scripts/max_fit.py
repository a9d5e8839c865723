"""Max-fit: under a fixed per-GPU memory cap, the largest model (layers) each variant trains.

    python scripts/max_fit.py --cap-gib 40 [--nproc 2] [--variants baseline,offload,recompute,recompute+offload]
    python scripts/max_fit.py --cap-gib 40 --layers 24,30 --variants baseline,offload,recompute,cpu-offload

For each variant, bisects the number of layers of the R1-shaped GPT (hidden 2048, seq 2048,
mbs 2) between --min-layers and --max-layers with short runs (--iters) under
torch.cuda.set_per_process_memory_fraction(cap / total); a run that ends with a CUDA
out-of-memory error does not fit. Reports, per variant, the largest fitting depth and its median
step time and tokens/s. Long: every probe is a torchrun start (about a minute for R1).
With --layers, no bisection: every variant is probed at each listed depth (fits or not, and its
step time where it fits), which answers "at a depth the baseline cannot train, which variants
can, and how fast" in a few probes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import PRESETS, variant_args  # noqa: E402
from megatron_runs import launch, model_args  # noqa: E402


def probe(variant, layers, opts, fraction):
    shape = dict(PRESETS["r1"], layers=layers)
    args = model_args(opts.iters, **shape) + variant_args(variant)
    name = f"fit-{variant}-{layers}"
    try:
        run = launch(name, args, opts.nproc, opts.out, env_extra={"MEGATRON_OFFLOAD_MEMORY_FRACTION": str(fraction)})
    except RuntimeError:
        # The whole log: with two ranks' tracebacks the OOM line can lie far above the tail.
        with open(os.path.join(opts.out, f"{name}.log"), errors="replace") as f:
            if "out of memory" in f.read().lower():
                return None
        raise
    steps = [it["ms"] for it in run["ranks"][0]["iterations"][opts.iters // 2:]]
    return statistics.median(steps)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cap-gib", type=float, required=True)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--min-layers", type=int, default=8)
    p.add_argument("--max-layers", type=int, default=64)
    p.add_argument("--variants", default="baseline,offload,recompute,recompute+offload")
    p.add_argument("--layers", default="", help="comma-separated depths to probe every variant at (no bisection)")
    p.add_argument("--out", default="/tmp/megatron_offload_maxfit")
    opts = p.parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    try:  # not through torch: a CUDA context in this driver would sit on GPU 0 during the runs
        mib = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        sys.exit("max_fit: needs CUDA GPUs (nvidia-smi)")
    total = float(mib) * 2**20
    fraction = min(1.0, opts.cap_gib * 2**30 / total)
    tokens = PRESETS["r1"]["gbs"] * 2048
    if opts.layers:
        return probe_at(opts, fraction, tokens, [int(x) for x in opts.layers.split(",")])
    results = {}
    for variant in opts.variants.split(","):
        lo, hi, best = opts.min_layers, opts.max_layers, None
        while lo <= hi:
            mid = (lo + hi) // 2
            ms = probe(variant, mid, opts, fraction)
            print(f"{variant}: {mid} layers -> {'OOM' if ms is None else f'{ms:.0f} ms'}", flush=True)
            if ms is None:
                hi = mid - 1
            else:
                best, lo = (mid, ms), mid + 1
        results[variant] = {"layers": best[0] if best else None, "ms": best[1] if best else None,
                            "tokens_per_s": tokens / (best[1] / 1e3) if best else None}
    print(f"\nmax-fit under {opts.cap_gib:g} GiB per GPU ({opts.nproc} GPUs, R1 shape)")
    print("| variant | largest layers that fit | ms/iter | tokens/s |")
    print("|---|---|---|---|")
    for v, r in results.items():
        print(f"| {v} | {r['layers']} | {r['ms'] or float('nan'):.0f} | {r['tokens_per_s'] or float('nan'):.0f} |")
    with open(os.path.join(opts.out, "max_fit.json"), "w") as f:
        json.dump({"cap_gib": opts.cap_gib, "results": results}, f, indent=1)


def probe_at(opts, fraction, tokens, depths):
    rows = []
    for layers in depths:
        for variant in opts.variants.split(","):
            ms = probe(variant, layers, opts, fraction)
            print(f"{variant}: {layers} layers -> {'OOM' if ms is None else f'{ms:.0f} ms'}", flush=True)
            rows.append({"variant": variant, "layers": layers, "fits": ms is not None, "ms": ms,
                         "tokens_per_s": tokens / (ms / 1e3) if ms else None})
    print(f"\nmax-fit probes under {opts.cap_gib:g} GiB per GPU ({opts.nproc} GPUs, R1 shape)")
    print("| layers | variant | fits | ms/iter | tokens/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['variant']} | {'yes' if r['fits'] else 'OOM'} | "
              f"{r['ms'] or float('nan'):.0f} | {r['tokens_per_s'] or float('nan'):.0f} |")
    with open(os.path.join(opts.out, "max_fit.json"), "w") as f:
        json.dump({"cap_gib": opts.cap_gib, "probes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
