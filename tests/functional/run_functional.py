"""Functional runs: real Megatron GPT pretraining through torchrun, with and without offloading.

    python tests/functional/run_functional.py --out /tmp/func [--nproc 2] [--iters 30] [--script auto] [--parallel N]

The training script is Megatron-LM's own `pretrain_gpt.py` where one is found (--script auto:
$MEGATRON_LM_DIR, ../shared/megatron-lm or .upstream/megatron-lm), else the project's
scripts/pretrain_gpt_mock.py; --script mock|upstream|PATH chooses. Runs (mock data):
  baseline          no offload, saves a torch_dist checkpoint at iteration iters/2
  no_plugin         the script without megatron-offload at all (isolates Megatron's own behaviour)
  offload           --offload-optimizer-states (the streamed step), same checkpoint schedule
  offload_whole     the same with --offload-step whole (the whole state back for the step) and
                    --log-params-norm (under which the whole step is the default)
  offload_chunked   the streamed step with a 64 MiB step budget: its saves happen with state off
                    the GPU, so they test the bounded save
  resume_offload    offload, resumes the offload run's checkpoint at iters/2
  resume_whole      offload_whole, resumes the offload_whole run's checkpoint (not by default)
  resume_chunked    offload_chunked, resumes the offload_chunked run's checkpoint (saved with state
                    off the GPU; with --extra=--async-save (plus --use-persistent-ckpt-worker
                    --async-strategy mcore, else megatron-core saves synchronously: checked), by a
                    checkpoint worker that wrote while training went on)
  resume_plain      no offload, resumes the offload run's checkpoint   (checkpoint interchange)
  resume_baseline   no offload, resumes the baseline's checkpoint: Megatron's own resume, for telling
                    the plugin's share of a resume that differs from upstream's (not by default)
  plain_to_offload  offload, resumes the baseline's checkpoint        (checkpoint interchange)
  crash             offload, saves at iters/2, then every rank SIGKILLs itself mid-iteration 2
                    iterations later (tests/functional/recorded_launch.py, by process id)
  resume_after_crash offload, resumes the crashed run's last checkpoint
  model_only_plain  no offload, loads only the model of the offload run's checkpoint (--no-load-optim:
                    megatron-core refreshes the masters from it, `reload_model_params`); not by default
  model_only_offload the same with offloading: its losses and params equal model_only_plain's, and the
                    refresh writes into the host copies (no state on the GPU at start-up)
and checks: losses bit-identical at every iteration (as train_step returned them; Megatron's printed
losses follow from them by its logging rule, scripts/megatron_runs.megatron_printed), identical final parameters and optimizer state (SHA-256 per rank), steady peak
reserved memory lower by at least half the offloaded bytes, saves with state off the GPU bounded,
resumed runs continue with the uninterrupted run's losses. Prints a table; exits non-zero on any
failure.
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from megatron_runs import (  # noqa: E402
    choose_script, launch, launch_expecting_failure, megatron_printed, model_args, printed_losses, replay,
    reserved_saving_check, run_losses as losses, run_peak, save_growth_checks)

CASES = ("baseline,no_plugin,offload,offload_whole,offload_chunked,resume_offload,resume_plain,plain_to_offload,"
         "crash,resume_after_crash")
LOADS_FROM = {"resume_offload": "offload", "resume_whole": "offload_whole", "resume_chunked": "offload_chunked",
              "resume_plain": "offload",
              "plain_to_offload": "baseline", "resume_baseline": "baseline", "resume_after_crash": "crash",
              "model_only_plain": "offload", "model_only_offload": "offload"}
# Iterations left out of the steady-state memory comparison (start-up, first step's packing).
WARMUP = 3


def peak_reserved(run):
    return [run_peak(r) for r in run["ranks"]]


def compare_runs(runs, printed, iters, nproc):
    """[(what, ok, detail)]: every comparison between finished runs (losses, printed losses, params,
    optimizer state, bytes moved, memory, saves and loads). `runs` maps a case to its launch result
    ({"ranks": [rank record, ...], ...}), `printed` a case to {iteration: printed loss}. Kept apart
    from the launches so that the checks themselves are tested on recorded runs."""
    checks = []
    half = iters // 2

    def check(what, ok, detail=""):
        checks.append((what, bool(ok), detail))

    def same_printed(name, ref, first):
        """Printed losses equal from `first` on, except the second iteration of a resumed run,
        where Megatron prints the mean of its first two (megatron_printed): that one must differ
        from the uninterrupted run's line exactly as the rule says (checked per run above)."""
        want = {i: v for i, v in printed.get(ref, {}).items() if i >= first}
        got = {i: v for i, v in printed.get(name, {}).items() if i >= first}
        rule = {first + 1} if first > 1 else set()
        differ = sorted(i for i in want if got.get(i) != want[i])
        ok = bool(want) and len(want) == iters - first + 1 and set(differ) <= rule and got.keys() == want.keys()
        detail = f"({len(want) - len(differ)}/{len(want)} printed losses equal" + (
            "; differing: iteration %s (%s vs %s)" % (differ[0], got.get(differ[0]), want[differ[0]])
            if differ else "") + (f"; Megatron prints the mean of a run's first two at {first + 1}" if rule else "") + ")"
        return ok, detail

    def load_stays_off_the_gpu(name, fresh_run):
        """The plugin attaches before the resume's load, which writes into the host copies:
        start-up holds no more than a fresh start with offloading (a quarter of the state of
        slack; the moments that a load on the GPU allocates are two thirds of it)."""
        for r in range(nproc):
            rank = runs[name]["ranks"][r]
            fresh, resumed = (runs[n]["ranks"][r]["startup_peak"]["max_allocated"] for n in (fresh_run, name))
            state = rank.get("offloaded_bytes", 0)
            detail = (f"(start-up peak {resumed / 2**30:.2f} GiB, fresh start {fresh / 2**30:.2f} GiB, "
                      f"state {state / 2**30:.2f} GiB)")
            inner = rank.get("inner_optimizers") or []
            if any("transformer_engine" in o for o in inner):
                # TE FusedAdam rebuilds its state on load: the load cannot write into the
                # host copies and takes the state back (bounded load: torch Adam only).
                print(f"[INFO] {name}: rank {r} load on the GPU (TE FusedAdam) {detail}", flush=True)
                continue
            check(f"{name}: rank {r} the load brought no optimizer state to the GPU",
                  state > 0 and resumed <= fresh + state // 4, detail)

    if "baseline" in runs:
        b = runs["baseline"]
        if "no_plugin" in runs:
            check("no_plugin: losses bit-identical to the baseline (installed with the flag off changes nothing)",
                  losses(runs["no_plugin"]) == losses(b) and len(losses(b)) == iters)
        for name in ("offload", "offload_whole", "offload_chunked"):
            if name not in runs:
                continue
            o = runs[name]
            lb, lo = losses(b), losses(o)
            check(f"{name}: losses bit-identical at every iteration", lb == lo and len(lb) == iters,
                  f"({sum(x == y for x, y in zip(lb, lo))}/{len(lb)} equal)")
            check(f"{name}: printed losses identical at every iteration", *same_printed(name, "baseline", 1))
            for r in range(nproc):
                br, orr = b["ranks"][r], o["ranks"][r]
                check(f"{name}: rank {r} final params identical", br["params_sha256"] == orr["params_sha256"])
                check(f"{name}: rank {r} final optimizer state identical",
                      br["optimizer_state_sha256"] == orr["optimizer_state_sha256"])
                off_bytes = orr.get("offloaded_bytes", 0)
                moved = orr.get("cumulative_d2h_bytes", 0)
                check(f"{name}: rank {r} state actually moved", off_bytes > 0 and moved >= off_bytes * (iters - 1),
                      f"(d2h {moved / 2**30:.2f} GiB over the run)")
                if name in ("offload", "offload_whole"):
                    check(f"{name}: rank {r} steady peak reserved lower", *reserved_saving_check(br, orr, WARMUP))
            if name == "offload_chunked":  # (its tiny budget: most of the state is off at each save)
                for what, ok, detail in save_growth_checks(b["ranks"], o["ranks"]):
                    check(f"{name}: {what}", ok, detail)
    if "model_only_plain" in runs and "model_only_offload" in runs:
        name, plain = "model_only_offload", runs["model_only_plain"]
        got, want = losses(runs[name]), losses(plain)
        check(f"{name}: losses identical to the same model-only load without offloading",
              got == want and len(got) == iters - half, f"({sum(x == y for x, y in zip(got, want))}/{len(want)} equal)")
        check(f"{name}: printed losses identical", *same_printed(name, "model_only_plain", half + 1))
        for r in range(nproc):
            check(f"{name}: rank {r} final params identical",
                  runs[name]["ranks"][r]["params_sha256"] == plain["ranks"][r]["params_sha256"])
            check(f"{name}: rank {r} final optimizer state identical",
                  runs[name]["ranks"][r]["optimizer_state_sha256"] == plain["ranks"][r]["optimizer_state_sha256"])
        if "offload" in runs:
            load_stays_off_the_gpu(name, "offload")
    for name, ref, source in (("resume_offload", "offload", "offload"),
                              ("resume_whole", "offload_whole", "offload_whole"),
                              ("resume_chunked", "offload_chunked", "offload_chunked"),
                              ("resume_plain", "offload", "offload"),
                              ("plain_to_offload", "baseline", "baseline"),
                              ("resume_baseline", "baseline", "baseline"),
                              ("resume_after_crash", "offload", "crash")):
        if name in runs and ref in runs:
            got, want = losses(runs[name]), losses(runs[ref])[half:]
            check(f"{name}: resumed losses identical to the uninterrupted run", got == want and len(got) == iters - half,
                  f"({sum(x == y for x, y in zip(got, want))}/{len(want)} equal)")
            check(f"{name}: printed losses identical to the uninterrupted run", *same_printed(name, ref, half + 1))
            for r in range(nproc):
                check(f"{name}: rank {r} final params identical",
                      runs[name]["ranks"][r]["params_sha256"] == runs[ref]["ranks"][r]["params_sha256"])
            fresh_run = {"resume_chunked": "offload_chunked", "resume_whole": "offload_whole"}.get(name, "offload")
            if name not in ("resume_plain", "resume_baseline") and fresh_run in runs:
                load_stays_off_the_gpu(name, fresh_run)
        if name in runs and name != "resume_baseline" and "resume_baseline" in runs:
            # Where Megatron's own resume differs from the uninterrupted run (e.g. TE's FP8 params
            # with --fp8-param-gather), the plugin's resumes must still equal Megatron's own resume:
            # the checkpoints they load hold the same values (the runs were identical up to the save).
            check(f"{name}: identical to Megatron's own resume (resume_baseline)",
                  losses(runs[name]) == losses(runs["resume_baseline"])
                  and all(runs[name]["ranks"][r]["params_sha256"] == runs["resume_baseline"]["ranks"][r]["params_sha256"]
                          for r in range(nproc)))

    return checks


def run_cases(cases, start, loads_from, parallel):
    """{case: start(case)} for every case, at most `parallel` running at once, each started only once
    the case whose checkpoint it loads (`loads_from`) has finished. Cases are handed out in their
    order, but among cases ready at once which starts first is not fixed. A failure is raised once
    every started run has ended, the first in case order; a case whose source failed is not started
    (it re-raises the source's failure)."""
    if parallel <= 1:
        return {name: start(name) for name in cases}
    slots = threading.BoundedSemaphore(parallel)
    futures = {}

    def task(name, source):
        if source is not None:
            source.result()
        with slots:
            return start(name)

    # One thread per case: a case waiting for its source holds no slot, so a waiting case never keeps
    # a ready one from running.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(cases)) as pool:
        for name in cases:
            futures[name] = pool.submit(task, name, futures.get(loads_from.get(name)))
    return {name: future.result() for name, future in futures.items()}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/megatron_offload_functional")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--cases", default=CASES)
    p.add_argument("--script", default="auto", help="auto, mock, upstream, or a pretrain_gpt.py / Megatron-LM dir")
    p.add_argument("--extra", action="append", default=[],
                   help="extra Megatron args for every run (repeatable; each is split at spaces)")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at once on the same GPUs (a case starts once the run whose checkpoint it loads "
                        "has finished); the host-memory column then includes the other runs' memory, and "
                        "the save times are slowed by them")
    p.add_argument("--from-records", action="store_true",
                   help="launch nothing: the checks on the runs of --cases that finished in --out (a suite "
                        "cut short by a time limit); runs that never finished are left out and said so")
    opts = p.parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    script = choose_script(opts.script)
    print(f"training script: {script}", flush=True)
    cases = opts.cases.split(",")
    # A case that loads another's checkpoint needs that case earlier in the same call (checkpoints
    # are removed at the start).
    for name, source in ({} if opts.from_records else LOADS_FROM).items():
        if name in cases and (source not in cases or cases.index(source) > cases.index(name)):
            raise SystemExit(f"--cases: {name} needs {source} before it (it loads that run's checkpoint)")
    half = opts.iters // 2
    # Megatron prints every iteration's loss: those printed values are compared too.
    base = model_args(opts.iters) + ["--deterministic-mode", "--log-interval", "1"] + " ".join(opts.extra).split()
    ck = lambda name: os.path.join(opts.out, f"ckpt_{name}")  # noqa: E731

    def recorded_exit(name):
        """The exit code a finished run left in --out (megatron_runs._run), None if it never finished."""
        path = os.path.join(opts.out, f"{name}.exit")
        return int(open(path).read().strip() or 0) if os.path.exists(path) else None

    unfinished = []
    if opts.from_records:
        unfinished = [n for n in cases if recorded_exit(n) is None]
        if unfinished:
            print(f"--from-records: no finished run of {unfinished} in {opts.out}; checked without them", flush=True)
        cases = [n for n in cases if n not in unfinished]
    else:
        for name in ("baseline", "offload", "offload_whole", "offload_chunked", "crash"):
            shutil.rmtree(ck(name), ignore_errors=True)
        # Nothing of an earlier call in this folder may pass for this one's (--from-records reads these).
        for path in [*(f"{name}.exit" for name in cases), "functional_summary.json"]:
            if os.path.exists(os.path.join(opts.out, path)):
                os.remove(os.path.join(opts.out, path))

    runs, checks, printed = {}, [], {}

    def check(what, ok, detail=""):
        checks.append((what, bool(ok), detail))
        print(f"[{'PASS' if ok else 'FAIL'}] {what} {detail}", flush=True)

    for name in unfinished:
        check(f"{name}: finished", False, "(cut short: no exit code in --out)")

    save = lambda name: ["--save", ck(name), "--save-interval", str(half)]  # noqa: E731
    resume = lambda name: ["--load", ck(name), "--ckpt-step", str(half)]  # noqa: E731
    offload = ["--offload-optimizer-states"]
    plan = {
        # --log-params-norm reads the fp32 masters after every step: it must see resident data. The
        # whole step (the default under it) logs it; the baseline does not, so that run's peak holds
        # its temporaries and the baseline's does not (the reserved check is only stricter for it).
        # (Not on offload_chunked: the norm brings its state back right before each save, whose
        # reads from the host copies that case checks.)
        "baseline": base + save("baseline"),
        "offload": base + save("offload") + offload,
        "offload_whole": base + save("offload_whole") + offload + ["--offload-step", "whole", "--log-params-norm"],
        "offload_chunked": base + save("offload_chunked") + offload + ["--offload-step-budget-mb", "64"],
        "no_plugin": base,
        "resume_offload": base + resume("offload") + offload,
        "resume_whole": base + resume("offload_whole") + offload + ["--offload-step", "whole", "--log-params-norm"],
        "resume_chunked": base + resume("offload_chunked") + offload + ["--offload-step-budget-mb", "64"],
        "resume_plain": base + resume("offload"),
        "resume_baseline": base + resume("baseline"),
        "plain_to_offload": base + resume("baseline") + offload,
        "resume_after_crash": base + resume("crash") + offload,
        "model_only_plain": base + resume("offload") + ["--no-load-optim"],
        "model_only_offload": base + resume("offload") + ["--no-load-optim"] + offload,
    }

    def start(name):
        """Launch one case: the crash run's (exit code, log), any other run's records."""
        if name == "crash":
            code, log, _ = launch_expecting_failure(
                "crash", base + save("crash") + offload, opts.nproc, opts.out, script=script, timeout=600,
                env_extra={"MEGATRON_OFFLOAD_KILL_AT": str(half + 2)})
            return code, log
        env = {"MEGATRON_OFFLOAD_NO_PLUGIN": "1"} if name == "no_plugin" else None
        run = launch(name, plan[name], opts.nproc, opts.out, script=script, env_extra=env)
        print(f"{name}: {run['seconds']:.0f}s", flush=True)
        return run

    launched = {} if opts.from_records else run_cases(cases, start, LOADS_FROM, opts.parallel)
    for name in cases:
        if name == "crash":
            if opts.from_records:
                code = recorded_exit("crash")
                log = open(os.path.join(opts.out, "crash.log")).read()
            else:
                code, log = launched["crash"]
            saved = os.path.isdir(os.path.join(ck("crash"), f"iter_{half:07d}"))
            check("crash: every rank killed mid-iteration after a save", code != 0 and "killing rank" in log and saved,
                  f"(exit {code}, {log.count('killing rank')} rank(s) killed, checkpoint at {half}: {saved})")
            continue
        if not opts.from_records:
            runs[name] = launched[name]
        elif (code := recorded_exit(name)) != 0:
            check(f"{name}: finished", False, f"(exit {code})")
            continue
        else:
            try:
                runs[name] = replay(name, opts.nproc, opts.out)
            except (OSError, ValueError) as err:  # (json.JSONDecodeError is a ValueError)
                check(f"{name}: records readable", False, f"({err})")
                continue
        printed[name] = printed_losses(open(os.path.join(opts.out, f"{name}.log")).read())
        if "--async-save" in base and "--save" in plan[name]:
            # megatron-core turns --async-save off (and says so) without the persistent worker.
            log = open(os.path.join(opts.out, f"{name}.log")).read()
            check(f"{name}: the saves ran asynchronously", "Disabling --async-save" not in log
                  and "scheduled an async checkpoint save" in log)
        first = half + 1 if name.startswith(("resume", "plain_to", "model_only")) else 1
        want = megatron_printed(losses(runs[name]), first)
        differ = sorted(i for i in want if printed[name].get(i) != want[i])
        check(f"{name}: every printed loss is Megatron's logging of the recorded losses",
              want and not differ and printed[name].keys() == want.keys(),
              f"({len(want) - len(differ)}/{len(want)}" + (
                  f"; iteration {differ[0]}: printed {printed[name].get(differ[0])}, expected {want[differ[0]]}"
                  if differ else "") + ")")

    for what, ok, detail in compare_runs(runs, printed, opts.iters, opts.nproc):
        check(what, ok, detail)

    print("\n| case | seconds | peak reserved GiB per rank | offloaded GiB per rank | pinned GiB per rank | "
          "host MemAvailable drop GiB | save s (blocking) |")
    print("|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        print(f"| {name} | {run['seconds']:.0f} | "
              + ", ".join(f"{x / 2**30:.2f}" for x in peak_reserved(run)) + " | "
              + ", ".join(f"{r.get('offloaded_bytes', 0) / 2**30:.3f}" for r in run["ranks"]) + " | "
              + ", ".join(f"{r.get('pinned_bytes', 0) / 2**30:.3f}" for r in run["ranks"]) + " | "
              + f"{(run.get('host') or {}).get('drop', 0) / 2**30:.2f} | "
              + ", ".join(f"{sv['seconds']:.2f}" + (f" ({sv['plugin_seconds']:.2f} plugin)" if sv.get("plugin_seconds") else "")
                          for sv in run["ranks"][0].get("saves", []) if "seconds" in sv) + " |")
    for name, run in runs.items():  # where rank 0's save time went, and what its tensors were
        for sv in run["ranks"][0].get("saves", []):
            parts = sv.get("parts")
            if parts:
                forms = ", ".join(f"{k} {v['count']} ({v['bytes'] / 2**20:.0f} MiB)" for k, v in parts.get("forms", {}).items())
                print(f"{name} save after iteration {sv.get('after_iteration')}: {sv['seconds']:.3f} s = state dict "
                      f"{parts['state_dict_s']:.3f} + dist save {parts['dist_save_s']:.3f} + schedule "
                      f"{parts['schedule_s']:.3f} + other; plugin {sv.get('plugin_seconds', 0):.3f}"
                      + (f" (garbage collection {sv['plugin_collect_seconds']:.3f})" if sv.get("plugin_collect_seconds") else "")
                      + (f"; waits for snapshot fills {sv['plugin_fill_wait_seconds']:.3f}"
                         if sv.get("plugin_fill_wait_seconds") else "")
                      + (f"; Python's collector {sv['gc_ms'] / 1e3:.3f} ({sv.get('gc_full', 0)} full)" if sv.get("gc_ms", 0) >= 1 else "")
                      + f"; tensors: {forms}")
    failed = [c for c in checks if not c[1]]
    print(f"\n{len(checks) - len(failed)} passed, {len(failed)} failed")
    with open(os.path.join(opts.out, "functional_summary.json"), "w") as f:
        json.dump({"script": script, "extra": opts.extra, "from_records": opts.from_records, "checks": checks,
                   "cases": {n: {"seconds": r["seconds"], "peak_reserved": peak_reserved(r), "losses": losses(r),
                                 "printed_losses": printed.get(n), "host": r.get("host"),
                                 "saves": [rank.get("saves") for rank in r["ranks"]]}
                             for n, r in runs.items()}}, f, indent=1)
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
