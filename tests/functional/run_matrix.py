"""Parallel layouts and checkpoints, each with and without --offload-optimizer-states (issue 5).

    python tests/functional/run_matrix.py --out /tmp/matrix [--gpus 4] [--iters 30] [--cases dp2,tp2,...] [--script upstream]

Every layout case runs the same small GPT (or small MoE GPT) twice through torchrun
(`-m megatron_offload`, or with --script upstream Megatron-LM's own pretrain_gpt.py under the
recorder; mock data, --deterministic-mode) and checks: losses bit-identical at every
iteration, identical final parameters and optimizer state on every rank, the state moved every
step, the bytes offloaded equal to the optimizer's own count of its moments and fp32 masters (so
nothing that should be off stays on the GPU), and peak reserved memory lower. Cases with
checkpoints add runs that load the case's torch_dist checkpoints (fully parallel save, the
default) and compare with the uninterrupted run:

  resume_offload    saved with offload, resumed with offload
  resume_plain      saved with offload, resumed without
  plain_to_offload  saved without, resumed with offload
  no_load_optim     --no-load-optim, without and with offload (masters rebuilt from the params)
  finetune          --finetune, without and with offload (iteration and optimizer start afresh)

Every case offloads with the streamed step (the default), "-chunked" cases with a 64 MiB step budget,
"-whole" cases with `--offload-step whole`.
`dp2-async-chunked` saves with --async-save in the middle of chunked training (the background writer
reads private copies of what is off the GPU while training goes on) and resumes from it.

Runs are independent processes, so they run concurrently: up to --runs-per-gpu ranks share a GPU
(CUDA_VISIBLE_DEVICES: two-GPU runs on pairs, four-GPU runs on all), and the runs of a case that do
not depend on each other start together. Sharing a GPU changes timing only: every run is
deterministic and its memory peaks are its own process's allocator statistics. Start-up (imports,
NCCL, checkpoint I/O) dominates these small runs, which is what the concurrency hides. Prints one
line per finished case and a pass/fail table; writes matrix_summary.json (after every case).
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import megatron_runs  # noqa: E402
from megatron_runs import model_args, reserved_saving_check, run_losses as losses, run_peak, save_growth_checks  # noqa: E402

# Swapped for megatron_runs.replay by --from-records.
launch = megatron_runs.launch
# Megatron arguments for every run of every case (--extra; e.g. TE layers where TE is installed).
EXTRA = []
# Arguments for the offloading runs only (--offload-extra; e.g. an --offload-* flag to compare), so
# that the baseline of every case stays the same run.
OFFLOAD_EXTRA = []
# The training script of every run (--script; the project's entry point unless told).
SCRIPT = [megatron_runs.MOCK_SCRIPT]

SMALL = dict(layers=4, hidden=512, heads=8, seq=512, mbs=2, gbs=16)
MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-2"]
CASES = {
    # name: (GPUs, extra Megatron args, model overrides, checkpoint runs)
    "dp2": (2, [], {}, ("no_load_optim", "finetune")),
    # (--sequence-parallel needs Transformer Engine's or Apex's LayerNorm: not on the test machines.)
    # Sequence 2048 as for the PP cases: at 512 the optimizer step was this small model's peak
    # (benchmarks/NOTES.md, seventeenth session), which no unchunked offload can lower.
    "tp2": (2, ["--tensor-model-parallel-size", "2"], {"seq": 2048}, ()),
    # PP stages and DP4 at sequence 2048. At 512, this 4-layer model's pipeline stages hold 2
    # layers' activations for 2 microbatches, less than the optimizer step's temporaries: the
    # step is their memory peak, and it needs the whole state (unchunked) or, chunked, the
    # embedding's (73 % of stage 0's state in one parameter). Measured on 4 x H200: pp2 0.70 ->
    # 0.72 GiB reserved (unchunked), 0.70 -> 0.76 (chunked, 2 chunks padded to the embedding's).
    # At 2048 the in-flight activations are the peak, as in real pipeline runs.
    "pp2": (2, ["--pipeline-model-parallel-size", "2"], {"seq": 2048}, ()),
    "pp2-vpp": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                {"seq": 2048}, ()),
    # Dense and expert DistributedOptimizers in one ChainedOptimizer.
    "ep2-moe": (2, MOE, {}, ()),
    # The same without linear biases, as MoE recipes run it: with TE layers megatron-core 0.19.2's
    # SequentialMLP experts add their bias in place to TE's output, which torch refuses with or
    # without the plugin (docs/design.md); without biases the expert optimizers run under TE.
    "ep2-moe-nobias": (2, MOE + ["--disable-bias-linear"], {}, ()),
    "overlap": (2, ["--overlap-grad-reduce", "--overlap-param-gather"], {}, ()),
    # Dynamic loss scaling from 2**32: the first steps overflow and are skipped.
    "fp16": (2, [], {"precision": "--fp16"}, ()),
    # Checkpoint interchange on the most sharded layout: fully parallel save over 4 DP ranks.
    # (Sequence 2048: at 512 the step's temporaries are within a few MiB of the activation peak
    # and 82 MiB of state per rank left reserved memory equal, 0.71 -> 0.71 GiB.)
    "dp4-clip": (4, ["--clip-grad", "0.3"], {"seq": 2048}, ("resume_offload", "resume_plain", "plain_to_offload")),
    # --async-save with the chunked step: the writer runs on while the next steps copy out.
    # (megatron-core saves synchronously without the persistent worker, and its default async
    # strategy, nvrx, needs nvidia-resiliency-ext.)
    "dp2-async-chunked": (2, ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"], {},
                          ("resume_offload",)),
}
# Every case offloads with the plugin's default engine, the streamed step (automatic budget). The
# "-chunked" cases bound it to SMALL_STEP_BUDGET on the layouts where the step is the small model's
# memory peak (PP stages) and on a chain of two DistributedOptimizers; with the automatic budget
# these small models keep all their state through the step, so the bound is what makes the
# step's pipeline run. The chunked cases on two layouts
# also save at half time and resume, with and without the plugin: a save in the middle of chunked
# training (state partly copied out, partly offloaded). The "-whole" cases run the whole step
# (--offload-step whole, the default under a quantized parameter gather).
CHUNKED_RESUMES = {"pp2": ("resume_offload",), "ep2-moe": ("resume_offload", "resume_plain")}
for _name in ("pp2", "pp2-vpp", "ep2-moe"):
    CASES[f"{_name}-chunked"] = CASES[_name][:3] + (CHUNKED_RESUMES.get(_name, ()),)
for _name in ("dp2", "ep2-moe"):
    CASES[f"{_name}-whole"] = CASES[_name][:3] + ((),)
OFFLOAD = ["--offload-optimizer-states"]
SMALL_STEP_BUDGET = ["--offload-step-budget-mb", "64"]


def offload_args(case):
    """The plugin's arguments of the case's offloading runs (--offload-extra last, so that it wins)."""
    engine = (["--offload-step", "whole"] if case.endswith("-whole")
              else SMALL_STEP_BUDGET if case.endswith("-chunked") else [])
    return OFFLOAD + engine + OFFLOAD_EXTRA


# Checkpoint runs resuming the case's own runs: which run's checkpoint, and with offloading?
RESUMES = {"resume_offload": ("offload", True), "resume_plain": ("offload", False),
           "plain_to_offload": ("baseline", True)}


class GpuSlots:
    """Which GPUs a run gets: aligned groups of its size, least loaded first, at most `per_gpu`
    ranks on any GPU at once."""

    def __init__(self, gpus, per_gpu):
        self.load = [0] * gpus
        self.per_gpu = per_gpu
        self.cv = threading.Condition()

    def _pick(self, n):
        groups = [list(range(i, i + n)) for i in range(0, len(self.load) - n + 1, n)]
        groups = [g for g in groups if max(self.load[d] for d in g) < self.per_gpu]
        return min(groups, key=lambda g: max(self.load[d] for d in g), default=None)

    def run(self, fn, n):
        with self.cv:
            self.cv.wait_for(lambda: self._pick(n) is not None)
            devices = self._pick(n)
            for d in devices:
                self.load[d] += 1
        try:
            return fn({"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))})
        finally:
            with self.cv:
                for d in devices:
                    self.load[d] -= 1
                self.cv.notify_all()


def attempt(call):
    """`call` returning its exception instead of raising it."""
    def run():
        try:
            return call()
        except Exception as err:  # (a run that failed or, from records, never finished)
            return err
    return run


def together(*calls):
    """Run independent zero-argument calls concurrently; their results in order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def run_case(name, iters, out, slots):
    nproc, extra, overrides, ckpt_runs = CASES[name]

    def start(run_name, args):
        return lambda: slots.run(lambda env: launch(run_name, args, nproc, out, script=SCRIPT[0], env_extra=env), nproc)

    half = iters // 2
    base = model_args(iters, **{**SMALL, **overrides}) + ["--deterministic-mode"] + extra + EXTRA
    ck = lambda kind: os.path.join(out, f"ckpt_{name}-{kind}")  # noqa: E731
    save = (lambda kind: ["--save", ck(kind), "--save-interval", str(half)]) if ckpt_runs else (lambda kind: [])
    for kind in ("baseline", "offload"):
        shutil.rmtree(ck(kind), ignore_errors=True)
    plain, offload = together(start(f"{name}-baseline", base + save("baseline")),
                              start(f"{name}-offload", base + save("offload") + offload_args(name)))
    checks = []

    def check(what, ok, detail=""):
        checks.append((what, bool(ok), detail))

    lb, lo = losses(plain), losses(offload)
    check("losses bit-identical", lb == lo and len(lb) == iters, f"{sum(a == b for a, b in zip(lb, lo))}/{len(lb)}")
    for r in range(nproc):
        pr, orr = plain["ranks"][r], offload["ranks"][r]
        check(f"rank {r} params identical", pr["params_sha256"] == orr["params_sha256"])
        check(f"rank {r} optimizer state identical", pr["optimizer_state_sha256"] == orr["optimizer_state_sha256"])
        off = orr.get("offloaded_bytes", 0)
        # Counted by the recorder from the optimizer itself (moments, masters), not by the plugin.
        expected = pr.get("adam_state_bytes", -1)
        check(f"rank {r} offloads all moments and masters", off == expected,
              f"{off / 2**30:.3f} of {expected / 2**30:.3f} GiB")
        # A skipped step (fp16 overflow) leaves the state as it was: its host copy is still
        # current and nothing needs to move. Every other step's state must.
        skipped_r = sum(it["skipped"] for it in orr["iterations"])
        moved = orr.get("cumulative_d2h_bytes", 0)
        check(f"rank {r} state moved after every step that was not skipped",
              off > 0 and moved >= off * (iters - skipped_r - 1), f"{moved / max(off, 1):.0f} x the state")
        if not name.endswith("-chunked"):  # (the chunked cases' small budget trades memory for time)
            check(f"rank {r} steady peak reserved lower", *reserved_saving_check(pr, orr, first=3))
    if ckpt_runs and name.endswith("-chunked"):
        # Only the small step budget has state off the GPU at a save (save_growth_check requires
        # it); with the automatic budget or the whole step these models save with it resident.
        for what, ok, detail in save_growth_checks(plain["ranks"], offload["ranks"]):
            check(what, ok, detail)

    def resumed(kind, source, with_offload, extra_args=()):
        args = base + ["--load", ck(source), "--ckpt-step", str(half), *extra_args] + (
            offload_args(name) if with_offload else [])
        return start(f"{name}-{kind}", args)

    # Every run that loads a checkpoint, started together.
    plans = {}
    for kind in ckpt_runs:
        if kind in RESUMES:
            plans[kind] = resumed(kind, *RESUMES[kind])
        else:
            # --finetune restarts at iteration 0: train `half` iterations like the resumed runs.
            flag = ["--no-load-optim"] if kind == "no_load_optim" else ["--finetune", "--train-iters", str(half)]
            plans[kind + "-plain"] = resumed(f"{kind}-plain", "baseline", False, flag)
            plans[kind + "-offload"] = resumed(f"{kind}-offload", "baseline", True, flag)
    # A checkpoint run that failed (or, from records, never finished) fails its own checks only.
    loaded = dict(zip(plans, together(*[attempt(c) for c in plans.values()]))) if plans else {}

    for kind in ckpt_runs:
        missing = [(k, loaded[k]) for k in ([kind] if kind in RESUMES else [kind + "-plain", kind + "-offload"])
                   if isinstance(loaded[k], Exception)]
        if missing:
            check(f"{kind}: ran", False, "; ".join(f"{k}: {str(err)[-300:]}" for k, err in missing))
            continue
        if kind in RESUMES:
            ref = offload if RESUMES[kind][0] == "offload" else plain
            run = loaded[kind]
            got, want = losses(run), losses(ref)[half:]
            check(f"{kind}: resumed losses identical", got == want, f"{sum(a == b for a, b in zip(got, want))}/{len(want)}")
            for r in range(nproc):
                check(f"{kind}: rank {r} final params identical",
                      run["ranks"][r]["params_sha256"] == ref["ranks"][r]["params_sha256"])
        else:
            # Both load the baseline's checkpoint without its optimizer state: the masters must be
            # rebuilt from the loaded params while the plugin has them off the GPU.
            a, b = loaded[kind + "-plain"], loaded[kind + "-offload"]
            la, lb_ = losses(a), losses(b)
            expect = half
            check(f"{kind}: losses identical with and without offload", la == lb_ and len(la) == expect,
                  f"{sum(x == y for x, y in zip(la, lb_))}/{len(la)}")
            for r in range(nproc):
                check(f"{kind}: rank {r} params and optimizer state identical",
                      a["ranks"][r]["params_sha256"] == b["ranks"][r]["params_sha256"]
                      and a["ranks"][r]["optimizer_state_sha256"] == b["ranks"][r]["optimizer_state_sha256"])
            if kind == "no_load_optim":
                # The loaded params are those of the checkpoint: the first resumed loss equals the
                # uninterrupted run's (the masters only matter from the first step on).
                check(f"{kind}: first resumed loss equals the uninterrupted run's", la[:1] == lb[half:half + 1])
    skipped = sum(it["skipped"] for it in offload["ranks"][0]["iterations"])
    return {
        "case": name,
        "gpus": nproc,
        "checks": checks,
        "skipped_steps": skipped,
        "offloaded_gib": [r.get("offloaded_bytes", 0) / 2**30 for r in offload["ranks"]],
        "peak_reserved_gib": {"baseline": [run_peak(r) / 2**30 for r in plain["ranks"]],
                              "offload": [run_peak(r) / 2**30 for r in offload["ranks"]]},
        "peak_allocated_gib": {"baseline": [run_peak(r, "max_allocated") / 2**30 for r in plain["ranks"]],
                               "offload": [run_peak(r, "max_allocated") / 2**30 for r in offload["ranks"]]},
    }


def row(r):
    bad = [c for c in r["checks"] if not c[1]]
    peaks = r.get("peak_reserved_gib")
    peak = f"{peaks['baseline'][0]:.2f} -> {peaks['offload'][0]:.2f}" if peaks else "-"
    result = "PASS" if not bad else "FAIL: " + "; ".join(f"{c[0]} {c[2]}".strip() for c in bad)[:400]
    return (f"| {r['case']} | {r['gpus']} | {result} | {len(r['checks']) - len(bad)}/{len(r['checks'])} | "
            f"{', '.join(f'{x:.3f}' for x in r.get('offloaded_gib', [])) or '-'} | {peak} | "
            f"{r.get('skipped_steps', '-')} | {r.get('seconds', 0):.0f} |")


HEADER = ("| case | GPUs | result | checks | offloaded GiB per rank | peak reserved GiB baseline -> offload "
          "(rank 0) | skipped steps | s |\n|---|---|---|---|---|---|---|---|")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/megatron_offload_matrix")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--runs-per-gpu", type=int, default=3, help="ranks of different runs sharing one GPU")
    p.add_argument("--extra", action="append", default=[],
                   help="extra Megatron args for every run (repeatable; each is split at spaces), e.g. "
                        "--extra=--transformer-impl=transformer_engine")
    p.add_argument("--offload-extra", action="append", default=[],
                   help="extra arguments for the runs that offload only (repeatable; split at spaces), e.g. "
                        "--offload-extra=--offload-release-cached-memory")
    p.add_argument("--script", default="mock",
                   help="mock (the project's entry point), upstream (Megatron-LM's own pretrain_gpt.py), auto, or a path")
    p.add_argument("--from-records", action="store_true",
                   help="launch nothing: re-evaluate the checks on the records of a finished matrix in --out")
    opts = p.parse_args(argv)
    EXTRA[:] = " ".join(opts.extra).split()
    OFFLOAD_EXTRA[:] = " ".join(opts.offload_extra).split()
    SCRIPT[0] = megatron_runs.choose_script(opts.script)
    print(f"training script: {SCRIPT[0]}", flush=True)
    if opts.from_records:
        global launch
        launch = lambda name, args, nproc, out, script=None, env_extra=None: megatron_runs.replay(name, nproc, out)  # noqa: E731
    os.makedirs(opts.out, exist_ok=True)
    requested = opts.cases.split(",")
    unknown = [c for c in requested if c not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    cases = [c for c in requested if CASES[c][0] <= opts.gpus]
    slots = GpuSlots(opts.gpus, opts.runs_per_gpu)
    lock = threading.Lock()
    results = []
    start = time.time()

    def run_one(name):
        began = time.time()
        try:
            result = run_case(name, opts.iters, opts.out, slots)
        except Exception as err:  # a failing case must not hide the others
            result = {"case": name, "gpus": CASES[name][0], "checks": [("ran", False, str(err)[-1500:])]}
        result["seconds"] = time.time() - began
        with lock:
            results.append(result)
            print(f"[{time.time() - start:.0f}s] {row(result)}", flush=True)
            with open(os.path.join(opts.out, "matrix_summary.json"), "w") as f:
                json.dump(results, f, indent=1)
        return result

    # Every case at once; GpuSlots bounds how many runs share the GPUs. Widest cases first, so
    # that they do not wait behind pairs of narrow ones.
    order = sorted(cases, key=lambda c: -CASES[c][0])
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(order)) as pool:
        list(pool.map(run_one, order))
    results.sort(key=lambda r: cases.index(r["case"]))
    print("\n" + HEADER)
    for r in results:
        print(row(r))
    failed = sum(any(not c[1] for c in r["checks"]) for r in results)
    print(f"\n{len(results) - failed} passed, {failed} failed, {time.time() - start:.0f} s")
    with open(os.path.join(opts.out, "matrix_summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
