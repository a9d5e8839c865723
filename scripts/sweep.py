"""Size sweep: measured step time with offloading against the planner's floor, from transfers far
longer than the compute windows to far shorter (issue 3).

    python scripts/sweep.py --nproc 2 --out /tmp/sweep [--gbs 4,8,16,32,64] [--iters 16 --warmup 6]
    python scripts/sweep.py --merge a/sweep.json b/sweep.json 16=r1/benchmark.json --out /tmp/sweep

`--merge`: no runs; the rows of earlier sweeps (sizes measured in separate calls) and of benchmark
runs at other sizes (`GBS=benchmark.json`, R1's own size is 16, re-planned here) in one table and
one plot.

The state per rank is fixed by the model (R1's, 7.1 GiB); what changes is the compute around it:
each global batch size gives gbs / (mbs * DP) microbatches per iteration, i.e. forward windows
from one microbatch (where R1's copy-out is about twice a forward: the transfer cannot hide) to
sixteen (it hides easily). For each size, baseline and offload run side by side
(scripts/benchmark.py), the floor comes from the baseline's measured phase timeline and the copy
ceiling measured once at the start, and the table reports measured / floor.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--gbs", default="4,8,16,32,64")
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--variants", default="baseline,offload")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for every run (see benchmark.py)")
    p.add_argument("--out", default="/tmp/megatron_offload_sweep")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="no runs: merge sweep.json / GBS=benchmark.json")
    opts = p.parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    if opts.merge:
        return merge(opts.merge, opts.out, keep=set(opts.variants.split(",")))
    ceilings_path = os.path.join(opts.out, "ceilings.json")
    subprocess.run([sys.executable, os.path.join(HERE, "copy_ceilings.py"), "--sizes-gib", "4",
                    "--devices", str(opts.nproc), "--out", ceilings_path], check=True)
    ceilings = json.load(open(ceilings_path))[-1]
    # Every rank copies at the same moment: the ceilings of all GPUs at once (benchmark.planner_rates).
    together = ceilings.get("all_devices") or ceilings
    gbps = min(together["d2h_gbps"], together["h2d_gbps"])
    rows = []
    for gbs in [int(x) for x in opts.gbs.split(",")]:
        out = os.path.join(opts.out, f"gbs{gbs}")
        cmd = [sys.executable, os.path.join(HERE, "benchmark.py"), "--preset", "r1", "--nproc", str(opts.nproc),
               "--iters", str(opts.iters), "--warmup", str(opts.warmup), "--variants", opts.variants,
               "--no-ceilings", "--gbps", str(gbps), "--both-gbps", str(together["both_gbps"]), "--out", out,
               f"--extra=--global-batch-size {gbs}"] + [f"--env={kv}" for kv in opts.env]
        done = subprocess.run(cmd)
        path = os.path.join(out, "benchmark.json")
        if done.returncode != 0 or not os.path.exists(path):
            rows.append({"gbs": gbs, "error": f"benchmark exit {done.returncode}"})
            continue
        rows += rows_of(gbs, json.load(open(path)))
        with open(os.path.join(opts.out, "sweep.json"), "w") as f:
            json.dump({"ceilings": ceilings, "rows": rows}, f, indent=1)
    print(f"\nsweep, R1 model, {opts.nproc} GPUs, copy ceiling {gbps:.1f} GB/s per direction")
    table(rows)
    plot(rows, os.path.join(opts.out, "sweep.png"))


def rows_of(gbs, data):
    """Sweep rows of one benchmark.json (its planner section; recomputed when it has none)."""
    planned = data.get("planner")
    if not planned:
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        import benchmark

        benchmark.report(data["results"], data.get("ceilings"))
        planned = benchmark.compare_with_planner(data["results"], *benchmark.planner_rates(data.get("ceilings")))
    rows = []
    for name, plan in planned.items():
        r = data["results"][name]
        rows.append({"gbs": gbs, "variant": name, "baseline_ms": data["results"]["baseline"]["median_ms"],
                     "ms": r["median_ms"], "measured_ratio": plan["measured_ratio"],
                     "floor_ratio": plan.get("engine_floor_ratio", plan["predicted_ratio"]),
                     "measured_over_floor": plan["measured_ratio"] / plan.get("engine_floor_ratio",
                                                                              plan["predicted_ratio"]),
                     "saved_fraction": r.get("saved_fraction_of_offloaded"),
                     "losses_identical": r.get("losses_identical")})
    return rows


def merge(paths, out, keep):
    """`keep`: the variants to take from benchmark.json files (which may hold others)."""
    rows = []
    for item in paths:
        gbs, _, path = item.rpartition("=")
        data = json.load(open(path))
        rows += data["rows"] if "rows" in data else [r for r in rows_of(int(gbs), data) if r["variant"] in keep]
    rows.sort(key=lambda r: (r["gbs"], r.get("variant", "")))
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"merged_from": paths, "rows": rows}, f, indent=1)
    table(rows)
    plot(rows, os.path.join(out, "sweep.png"))


def plot(rows, path):
    """Measured step time against the floor (both as x the run without offloading) per size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no sweep plot")
        return
    good = sorted((r for r in rows if "error" not in r), key=lambda r: r["gbs"])
    if not good:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for variant in sorted({r["variant"] for r in good}):
        pts = [r for r in good if r["variant"] == variant]
        xs = [r["gbs"] for r in pts]
        ax.plot(xs, [r["measured_ratio"] for r in pts], "o-", label=f"{variant}: measured")
        ax.plot(xs, [r["floor_ratio"] for r in pts], "s--", label=f"{variant}: planner floor")
        for r in pts:
            ax.annotate(f"{r['measured_over_floor']:.3f}", (r["gbs"], r["measured_ratio"]),
                        textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["gbs"] for r in good])
    ax.set_xticklabels([str(r["gbs"]) for r in good])
    ax.set_xlabel("global batch size (R1 model, DP=2, micro-batch 2): microbatches per rank = gbs / 4")
    ax.set_ylabel("step time / no offload")
    ax.set_title("Size sweep: measured vs computed floor (labels: measured / floor)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def table(rows):
    print("| global batch | variant | baseline ms | ms | x | floor x | measured / floor | reserved saved / offloaded | losses identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['gbs']} | - | {r['error']} | | | | | | |")
            continue
        print(f"| {r['gbs']} | {r['variant']} | {r['baseline_ms']:.0f} | {r['ms']:.0f} | {r['measured_ratio']:.3f} | "
              f"{r['floor_ratio']:.3f} | {r['measured_over_floor']:.3f} | {r['saved_fraction'] or float('nan'):.2f} | "
              f"{r['losses_identical']} |")


if __name__ == "__main__":
    main()
