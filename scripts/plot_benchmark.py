"""Plots of a benchmark.json written by scripts/benchmark.py (needs matplotlib).

    python scripts/plot_benchmark.py <benchmark.json> [--out-prefix benchmarks/results/r1]

Writes <prefix>_frontier.png (median step time against peak reserved memory, rank 0, one point per
variant: the memory/time frontier) and <prefix>_memory.png (allocated memory at the phase
boundaries of the marked iteration, per variant, with each variant's peak reserved as a dashed
line). Only what the runs recorded is drawn: the marks are CUDA events and `memory_allocated()` at
forward/backward/step boundaries, not a continuous trace, so peaks inside a phase show only in the
dashed peak-reserved lines.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GiB = 2**30


def frontier(results, path, title):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        x, y = r["max_reserved_gib"][0], r["median_ms"]
        ax.scatter([x], [y], s=40)
        ax.annotate(f"{name}\n{r.get('ratio', float('nan')):.2f}x", (x, y), textcoords="offset points",
                    xytext=(6, 4), fontsize=8)
    ax.set_xlabel("peak reserved memory, rank 0 (GiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory(results, path, title):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, r) in enumerate(results.items()):
        t = r.get("timeline")
        if not t:
            continue
        xs = [m[1] for m in t["marks"]]
        ys = [m[2] / GiB for m in t["marks"]]
        line, = ax.step(xs, ys, where="post", label=f"{name} (iteration {t['iteration']})")
        ax.axhline(r["max_reserved_gib"][0], color=line.get_color(), ls="--", lw=0.8)
    ax.set_xlabel("time in the iteration (ms)")
    ax.set_ylabel("GiB allocated at phase boundaries (dashed: peak reserved)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("benchmark_json")
    p.add_argument("--out-prefix", default=None)
    p.add_argument("--title", default=None)
    opts = p.parse_args(argv)
    data = json.load(open(opts.benchmark_json))
    prefix = opts.out_prefix or os.path.splitext(opts.benchmark_json)[0]
    title = opts.title or f"preset {data.get('preset', '?')}, {data.get('nproc', '?')} GPUs"
    frontier(data["results"], prefix + "_frontier.png", title)
    memory(data["results"], prefix + "_memory.png", title)
    print(f"wrote {prefix}_frontier.png, {prefix}_memory.png")


if __name__ == "__main__":
    main()
