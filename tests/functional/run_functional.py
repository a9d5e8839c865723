"""Functional runs: real Megatron GPT pretraining through torchrun, with and without offloading.

    python tests/functional/run_functional.py --out /tmp/func [--nproc 2] [--iters 30]

Runs (each through `torchrun -m megatron_offload scripts/pretrain_gpt_mock.py`, mock data):
  baseline        no offload, saves a torch_dist checkpoint at iteration iters/2
  offload         --offload-optimizer-states, same checkpoint schedule
  resume_offload  offload, resumes the offload run's checkpoint at iters/2
  resume_plain    no offload, resumes the offload run's checkpoint   (checkpoint interchange)
  plain_to_offload offload, resumes the baseline's checkpoint        (checkpoint interchange)
and checks: losses bit-identical at every iteration, identical final parameters and optimizer
state (SHA-256 per rank), peak reserved memory lower with offloading, resumed runs continue with
the uninterrupted run's losses. Prints a table; exits non-zero on any failure.
"""

import argparse
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from megatron_runs import launch, model_args, run_losses as losses, run_peak, save_growth_check  # noqa: E402


def peak_reserved(run):
    return [run_peak(r) for r in run["ranks"]]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/megatron_offload_functional")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--cases", default="baseline,offload,resume_offload,resume_plain,plain_to_offload")
    p.add_argument("--extra", default="", help="extra Megatron args for every run")
    opts = p.parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    cases = opts.cases.split(",")
    half = opts.iters // 2
    base = model_args(opts.iters) + ["--deterministic-mode"] + opts.extra.split()
    ck = lambda name: os.path.join(opts.out, f"ckpt_{name}")  # noqa: E731
    for name in ("baseline", "offload"):
        shutil.rmtree(ck(name), ignore_errors=True)

    runs, checks = {}, []

    def check(what, ok, detail=""):
        checks.append((what, bool(ok), detail))
        print(f"[{'PASS' if ok else 'FAIL'}] {what} {detail}", flush=True)

    save = lambda name: ["--save", ck(name), "--save-interval", str(half)]  # noqa: E731
    resume = lambda name: ["--load", ck(name), "--ckpt-step", str(half)]  # noqa: E731
    plan = {
        # --log-params-norm reads the fp32 masters after every step: it must see resident data.
        # Both runs log it, so that its temporaries count in both peaks.
        "baseline": base + save("baseline") + ["--log-params-norm"],
        "offload": base + save("offload") + ["--offload-optimizer-states", "--log-params-norm"],
        "resume_offload": base + resume("offload") + ["--offload-optimizer-states"],
        "resume_plain": base + resume("offload"),
        "plain_to_offload": base + resume("baseline") + ["--offload-optimizer-states"],
    }
    for name in cases:
        runs[name] = launch(name, plan[name], opts.nproc, opts.out)
        print(f"{name}: {runs[name]['seconds']:.0f}s", flush=True)

    if "baseline" in runs and "offload" in runs:
        b, o = runs["baseline"], runs["offload"]
        lb, lo = losses(b), losses(o)
        check("offload: losses bit-identical at every iteration", lb == lo and len(lb) == opts.iters,
              f"({sum(x == y for x, y in zip(lb, lo))}/{len(lb)} equal)")
        for r in range(opts.nproc):
            check(f"offload: rank {r} final params identical",
                  b["ranks"][r]["params_sha256"] == o["ranks"][r]["params_sha256"])
            check(f"offload: rank {r} final optimizer state identical",
                  b["ranks"][r]["optimizer_state_sha256"] == o["ranks"][r]["optimizer_state_sha256"])
            rb, ro = peak_reserved(b)[r], peak_reserved(o)[r]
            off_bytes = o["ranks"][r].get("offloaded_bytes", 0)
            check(f"offload: rank {r} peak reserved lower", ro < rb,
                  f"({rb / 2**30:.2f} -> {ro / 2**30:.2f} GiB, saved {(rb - ro) / 2**30:.2f} of "
                  f"{off_bytes / 2**30:.2f} GiB offloaded)")
            saves = o["ranks"][r].get("saves", [])
            training_peak = max(it["max_allocated"] for it in o["ranks"][r]["iterations"])
            save_peak = max((sv["max_allocated"] for sv in saves), default=0)
            check(f"offload: rank {r} checkpoint save stays within training peak + state",
                  saves and save_peak <= training_peak + off_bytes,
                  f"(save peak {save_peak / 2**30:.2f} GiB, training peak {training_peak / 2**30:.2f} GiB)")
            if "baseline" in runs:
                ok, detail = save_growth_check(b["ranks"][r], o["ranks"][r])
                check(f"offload: rank {r} checkpoint save brings no offloaded state back", ok, f"({detail})")
            moved = o["ranks"][r].get("cumulative_d2h_bytes", 0)
            check(f"offload: rank {r} state actually moved", off_bytes > 0 and moved >= off_bytes * (opts.iters - 1),
                  f"(d2h {moved / 2**30:.2f} GiB over the run)")
    for name, ref, source in (("resume_offload", "offload", "offload"),
                              ("resume_plain", "offload", "offload"),
                              ("plain_to_offload", "baseline", "baseline")):
        if name in runs and ref in runs:
            got, want = losses(runs[name]), losses(runs[ref])[half:]
            check(f"{name}: resumed losses identical to the uninterrupted run", got == want,
                  f"({sum(x == y for x, y in zip(got, want))}/{len(want)} equal)")
            for r in range(opts.nproc):
                check(f"{name}: rank {r} final params identical",
                      runs[name]["ranks"][r]["params_sha256"] == runs[ref]["ranks"][r]["params_sha256"])
            if name != "resume_plain" and "offload" in runs:
                # The plugin attaches before the resume's load, which writes into the host copies:
                # start-up holds no more than a fresh start with offloading (a quarter of the state
                # of slack; the moments that a load on the GPU allocates are two thirds of it).
                for r in range(opts.nproc):
                    fresh, resumed = (runs[n]["ranks"][r]["startup_peak"]["max_allocated"] for n in ("offload", name))
                    state = runs[name]["ranks"][r].get("offloaded_bytes", 0)
                    check(f"{name}: rank {r} the load brought no optimizer state to the GPU",
                          state > 0 and resumed <= fresh + state // 4,
                          f"(start-up peak {resumed / 2**30:.2f} GiB, fresh start {fresh / 2**30:.2f} GiB, "
                          f"state {state / 2**30:.2f} GiB)")

    print("\n| case | seconds | peak reserved GiB per rank | offloaded GiB per rank | pinned GiB per rank |")
    print("|---|---|---|---|---|")
    for name, run in runs.items():
        print(f"| {name} | {run['seconds']:.0f} | "
              + ", ".join(f"{x / 2**30:.2f}" for x in peak_reserved(run)) + " | "
              + ", ".join(f"{r.get('offloaded_bytes', 0) / 2**30:.3f}" for r in run["ranks"]) + " | "
              + ", ".join(f"{r.get('pinned_bytes', 0) / 2**30:.3f}" for r in run["ranks"]) + " |")
    failed = [c for c in checks if not c[1]]
    print(f"\n{len(checks) - len(failed)} passed, {len(failed)} failed")
    with open(os.path.join(opts.out, "functional_summary.json"), "w") as f:
        json.dump({"checks": checks, "cases": {n: {"seconds": r["seconds"], "peak_reserved": peak_reserved(r),
                   "losses": losses(r)} for n, r in runs.items()}}, f, indent=1)
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
