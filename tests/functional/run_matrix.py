"""Parallel layouts, each with and without --offload-optimizer-states (issue 5), on 2 and 4 GPUs.

    python tests/functional/run_matrix.py --out /tmp/matrix [--gpus 4] [--iters 30] [--cases dp2,tp2,...]

Every case runs the same small GPT twice through torchrun (`-m megatron_offload`, mock data,
--deterministic-mode) and checks: losses bit-identical at every iteration, identical final
parameters and optimizer state on every rank, the state actually moved, and reports offloaded
bytes and peak reserved memory per rank. Two-GPU cases run side by side on a 4-GPU machine
(CUDA_VISIBLE_DEVICES pairs). Prints a pass/fail table; writes matrix_summary.json.

Checkpoint interchange (save with/without, resume with/without) lives in run_functional.py.
"""

import argparse
import concurrent.futures
import json
import os
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from megatron_runs import launch, model_args, run_peak  # noqa: E402

SMALL = dict(layers=4, hidden=512, heads=8, seq=512, mbs=2, gbs=16)
CASES = {
    # name: (GPUs, extra Megatron args, model overrides)
    "dp2": (2, [], {}),
    "tp2": (2, ["--tensor-model-parallel-size", "2"], {}),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"], {}),
    "pp2-vpp": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], {}),
    "ep2-moe": (2, ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
                    "--moe-token-dispatcher-type", "alltoall"], {}),
    "overlap": (2, ["--overlap-grad-reduce", "--overlap-param-gather"], {}),
    # Dynamic loss scaling from 2**32: the first steps overflow and are skipped.
    "fp16": (2, [], {"precision": "--fp16"}),
    "dp4-clip": (4, ["--clip-grad", "0.3"], {}),
}


def losses(run):
    return [it["loss"] for it in run["ranks"][-1]["iterations"]]


def run_case(name, iters, out, devices):
    nproc, extra, overrides = CASES[name]
    base = model_args(iters, **{**SMALL, **overrides}) + ["--deterministic-mode"] + extra
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
    plain = launch(f"{name}-baseline", base, nproc, out, env_extra=env)
    offload = launch(f"{name}-offload", base + ["--offload-optimizer-states"], nproc, out, env_extra=env)
    checks = []
    lb, lo = losses(plain), losses(offload)
    checks.append(("losses bit-identical", lb == lo and len(lb) == iters,
                   f"{sum(a == b for a, b in zip(lb, lo))}/{len(lb)}"))
    for r in range(nproc):
        pr, orr = plain["ranks"][r], offload["ranks"][r]
        checks.append((f"rank {r} params identical", pr["params_sha256"] == orr["params_sha256"], ""))
        checks.append((f"rank {r} optimizer state identical",
                       pr["optimizer_state_sha256"] == orr["optimizer_state_sha256"], ""))
        moved = orr.get("cumulative_d2h_bytes", 0)
        off = orr.get("offloaded_bytes", 0)
        checks.append((f"rank {r} state moved every step", off > 0 and moved >= off * (iters - 1),
                       f"{off / 2**30:.3f} GiB offloaded"))
    skipped = sum(it["skipped"] for it in offload["ranks"][0]["iterations"])
    return {
        "case": name,
        "gpus": nproc,
        "checks": checks,
        "skipped_steps": skipped,
        "offloaded_gib": [r.get("offloaded_bytes", 0) / 2**30 for r in offload["ranks"]],
        "peak_reserved_gib": {"baseline": [run_peak(r) / 2**30 for r in plain["ranks"]],
                              "offload": [run_peak(r) / 2**30 for r in offload["ranks"]]},
        "seconds": plain["seconds"] + offload["seconds"],
    }


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/megatron_offload_matrix")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--cases", default=",".join(CASES))
    opts = p.parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    cases = [c for c in opts.cases.split(",") if CASES[c][0] <= opts.gpus]
    free = list(range(opts.gpus))
    lock = threading.Condition()

    def run_with_devices(name):
        need = CASES[name][0]
        with lock:
            lock.wait_for(lambda: len(free) >= need)
            devices = [free.pop(0) for _ in range(need)]
        try:
            return run_case(name, opts.iters, opts.out, devices)
        except Exception as err:  # a failing case must not hide the others
            return {"case": name, "gpus": need, "checks": [("ran", False, str(err)[-2000:])]}
        finally:
            with lock:
                free.extend(devices)
                lock.notify_all()

    # Widest cases first so that they do not wait behind pairs of narrow ones.
    order = sorted(cases, key=lambda c: -CASES[c][0])
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.gpus // 2)) as pool:
        results = list(pool.map(run_with_devices, order))
    results.sort(key=lambda r: cases.index(r["case"]))

    print("\n| case | GPUs | result | offloaded GiB per rank | peak reserved GiB baseline -> offload (rank 0) | skipped steps | s |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for r in results:
        bad = [c for c in r["checks"] if not c[1]]
        failed += bool(bad)
        peaks = r.get("peak_reserved_gib")
        peak = f"{peaks['baseline'][0]:.2f} -> {peaks['offload'][0]:.2f}" if peaks else "-"
        print(f"| {r['case']} | {r['gpus']} | {'PASS' if not bad else 'FAIL: ' + '; '.join(c[0] + ' ' + c[2] for c in bad)[:300]} | "
              f"{', '.join(f'{x:.3f}' for x in r.get('offloaded_gib', []))} | {peak} | "
              f"{r.get('skipped_steps', '-')} | {r.get('seconds', 0):.0f} |")
    print(f"\n{len(results) - failed} passed, {failed} failed")
    with open(os.path.join(opts.out, "matrix_summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
