"""Launching Megatron GPT runs through torchrun and the megatron-offload launcher (shared by the
functional tests, the benchmark and the demo). Each rank of a run writes a JSON record
(scripts/pretrain_gpt_mock.py, MEGATRON_OFFLOAD_RECORD)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
SAFE_ENV = {  # never let NCCL / PyTorch / NVSHMEM use NVLink multicast on shared machines
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
DETERMINISM_ENV = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
# The runs load only checkpoints that runs of the same suite wrote: let TE 2.20.2 load the pickled
# FP8 (delayed scaling) metadata it otherwise refuses, with or without the plugin.
OWN_CHECKPOINTS_ENV = {"NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1"}

NO_FUSION = (
    "--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
    "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm"
).split()


def model_args(iters, layers=4, hidden=1024, heads=16, seq=1024, mbs=4, gbs=16, precision="--bf16"):
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
        "--train-iters", str(iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "3", "--weight-decay", "0.1", "--clip-grad", "1.0", precision,
        "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "32000", "--seed", "1234", "--log-interval", "5", "--eval-iters", "0",
        "--eval-interval", "100000", "--ckpt-format", "torch_dist",
        *NO_FUSION,
    ]


_ports_lock = threading.Lock()
_ports_given = set()


def free_port():
    """A free TCP port never handed out before by this process (runs may start concurrently)."""
    with _ports_lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _ports_given:
                _ports_given.add(port)
                return port


def _command(name, args, nproc, out, script, env_extra):
    record = os.path.join(out, name)
    shutil.rmtree(record, ignore_errors=True)
    os.makedirs(record)
    env = dict(os.environ)
    env.update(DETERMINISM_ENV)
    env.update(OWN_CHECKPOINTS_ENV)
    env.update(env_extra or {})
    env.update(SAFE_ENV)  # last: never overridable
    env["MEGATRON_OFFLOAD_RECORD"] = record
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    script = os.path.join(REPO, script)  # (an absolute path stays as it is)
    if (os.path.basename(script) == os.path.basename(MOCK_SCRIPT) and "MEGATRON_OFFLOAD_KILL_AT" not in env
            and "MEGATRON_OFFLOAD_NO_PLUGIN" not in env):
        entry = ["-m", "megatron_offload", script]  # the mock records itself
    else:  # any other script (Megatron-LM's own): the recorder is installed around it
        entry = [RECORDED_LAUNCH, script]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), *entry, *args,
    ]
    return cmd, env, record


RECORDED_LAUNCH = os.path.join(REPO, "tests", "functional", "recorded_launch.py")
MOCK_SCRIPT = "scripts/pretrain_gpt_mock.py"


def upstream_script(explicit=None):
    """Megatron-LM's own pretrain_gpt.py: `explicit` (a file or a Megatron-LM directory), else
    $MEGATRON_LM_DIR, else ../shared/megatron-lm or .upstream/megatron-lm beside this repository
    (the GPU machines get it carried there); None if none exists."""
    candidates = [explicit, os.environ.get("MEGATRON_LM_DIR"),
                  os.path.join(os.path.dirname(REPO), "shared", "megatron-lm"),
                  os.path.join(REPO, ".upstream", "megatron-lm")]
    for c in filter(None, candidates):
        path = c if c.endswith(".py") else os.path.join(c, "pretrain_gpt.py")
        if os.path.isfile(path):
            return os.path.abspath(path)
    return None


def choose_script(choice):
    """The training script for a `--script` choice: mock (the project's entry point), upstream
    (Megatron-LM's own pretrain_gpt.py, which must exist), auto (upstream where found, else mock),
    or a path to a pretrain_gpt.py / Megatron-LM directory."""
    if choice == "mock":
        return MOCK_SCRIPT
    found = upstream_script(None if choice in ("auto", "upstream") else choice)
    if found is None and choice != "auto":
        raise SystemExit(f"no Megatron-LM pretrain_gpt.py found for --script {choice}")
    return found or MOCK_SCRIPT


def launch_expecting_failure(name, args, nproc, out, script=MOCK_SCRIPT, timeout=300,
                             env_extra=None):
    """Run a command that should be refused; returns (exit code, log text, seconds)."""
    code, elapsed, _ = _launch_with_fresh_port(name, args, nproc, out, script, env_extra, timeout)
    return code, open(os.path.join(out, f"{name}.log")).read(), elapsed


def _launch_with_fresh_port(name, args, nproc, out, script, env_extra, timeout, attempts=3):
    """(exit code, seconds, record dir). The rendezvous port is picked free but released before
    torchrun binds it: a concurrent run (or its NCCL sockets) can take it first, and torchrun then
    exits with EADDRINUSE before any rank starts. Only that failure is retried, on a new port."""
    for attempt in range(attempts):
        cmd, env, record = _command(name, args, nproc, out, script, env_extra)
        code, elapsed = _run(name, cmd, env, out, timeout)
        if code == 0 or attempt == attempts - 1:
            break
        log = open(os.path.join(out, f"{name}.log")).read()
        if "EADDRINUSE" not in log or "The server socket has failed to listen" not in log:
            break
    return code, elapsed, record


def _mem_available():
    from megatron_offload import host_memory  # (REPO is on sys.path: see below)

    return host_memory.read().available


class HostSampler:
    """The node's MemAvailable every `interval` seconds while a run lives (what the OOM killer goes
    by; the training processes' RSS misses their children and the kernel's share)."""

    def __init__(self, interval=0.5):
        self.interval, self.samples = interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        t0 = time.time()
        while True:
            value = _mem_available()
            if value is not None:
                self.samples.append((round(time.time() - t0, 2), value))
            if self._stop.wait(self.interval):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self):
        """Before the run, the lowest during it, and the drop between them (bytes)."""
        if not self.samples:
            return None
        before, lowest = self.samples[0][1], min(v for _, v in self.samples)
        return {"available_before": before, "available_min": lowest, "drop": before - lowest,
                "samples": self.samples[::4]}


def _run(name, cmd, env, out, timeout):
    """Run to <out>/<name>.log, record the exit code in <out>/<name>.exit and the node's host memory
    in <out>/<name>.host.json; (exit code, seconds)."""
    start = time.time()
    # A run cut short leaves no exit code: none from an earlier run in the same folder may remain.
    if os.path.exists(os.path.join(out, f"{name}.exit")):
        os.remove(os.path.join(out, f"{name}.exit"))
    with open(os.path.join(out, f"{name}.log"), "w") as log, HostSampler() as sampler:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO)
    with open(os.path.join(out, f"{name}.exit"), "w") as f:
        f.write(str(proc.returncode))
    with open(os.path.join(out, f"{name}.host.json"), "w") as f:
        json.dump(sampler.summary(), f)
    return proc.returncode, time.time() - start


def host_summary(name, out):
    """The node's host memory during a finished run (HostSampler.summary), or None."""
    path = os.path.join(out, f"{name}.host.json")
    return json.load(open(path)) if os.path.exists(path) else None


def replay(name, nproc, out):
    """A finished run's records, read back instead of launching it (re-evaluating checks)."""
    record = os.path.join(out, name)
    ranks = [json.load(open(os.path.join(record, f"rank{r}.json"))) for r in range(nproc)]
    return {"name": name, "ranks": ranks, "seconds": 0.0, "host": host_summary(name, out)}


def launch(name, args, nproc, out, script=MOCK_SCRIPT, timeout=600, env_extra=None):
    code, elapsed, record = _launch_with_fresh_port(name, args, nproc, out, script, env_extra, timeout)
    if code != 0:
        tail = open(os.path.join(out, f"{name}.log")).read()[-4000:]
        raise RuntimeError(f"{name} failed (exit {code}) after {elapsed:.0f}s:\n{tail}")
    ranks = [json.load(open(os.path.join(record, f"rank{r}.json"))) for r in range(nproc)]
    return {"name": name, "ranks": ranks, "seconds": elapsed, "host": host_summary(name, out)}




def run_losses(run):
    """Per-iteration losses (float hex) of a run: the last rank is on the last pipeline stage,
    which reports the loss (with DP every rank of that stage has it)."""
    return [it["loss"] for it in run["ranks"][-1]["iterations"]]


def save_growth(rank_record):
    """GPU memory a rank's checkpoint saves allocated above what was allocated before them."""
    return max((sv["max_allocated"] - sv["allocated_before"] for sv in rank_record.get("saves", [])), default=None)


def save_growth_check(plain_rank, offload_rank):
    """(ok, detail): a save with state off the GPU reads it from the host copies, so it allocates no
    more than the run without offloading (whose state is on the GPU anyway) plus a quarter of the
    state: bringing the state back would cost all of it. Holds only where some state was off the
    GPU when every save began (otherwise there is nothing to bring back and the check says nothing)."""
    grew_plain, grew = save_growth(plain_rank), save_growth(offload_rank)
    state = offload_rank.get("offloaded_bytes", 0)
    off = offloaded_at_save(offload_rank)
    ok = (grew is not None and grew_plain is not None and state > 0 and off > 0
          and grew <= grew_plain + state // 4)
    detail = (f"save +{(grew or 0) / 2**20:.0f} MiB (without offloading +{(grew_plain or 0) / 2**20:.0f} MiB; "
              f"state {state / 2**20:.0f} MiB, of which at least {off / 2**20:.0f} MiB off the GPU when a save began)")
    return ok, detail


def save_growth_checks(plain_ranks, offload_ranks):
    """[(what, ok, detail)]: `save_growth_check` on every rank, except a rank with nothing off the
    GPU at a save whose whole state was one step piece: one chunk, or the chunks of one parameter
    split over several (the step held back all of them but the last, `step_waiting`). Such a state
    leaves the step only once its last piece stepped, so its saves begin while it is still being
    copied out and the check would say nothing. Any other rank with nothing off fails, as before.
    At least one rank must have been checked."""
    checks, skipped = [], []
    for r, (plain, ours) in enumerate(zip(plain_ranks, offload_ranks, strict=True)):
        if offloaded_at_save(ours) == 0 and _state_was_one_piece(ours):
            skipped.append(r)
            continue
        checks.append((f"rank {r} checkpoint save reads what is off the GPU from the host",
                       *save_growth_check(plain, ours)))
    checks.append(("some rank saved with state off the GPU", len(skipped) < len(offload_ranks),
                   f"(one-piece ranks with nothing off at a save: {skipped})" if skipped else ""))
    return checks


def _state_was_one_piece(rank_record):
    """Whether a rank's whole state was one piece of the chunked step: one chunk, or all its chunks
    but one held back at a step (`step_waiting`, the most: chunks waiting for a split parameter's rest).
    With several optimizers on a rank `chunk_count` sums theirs while `step_waiting` is one
    optimizer's, so such a rank is not skipped (the strict side)."""
    count = rank_record.get("chunk_count")
    return bool(count) and (rank_record.get("step_waiting") or 0) >= count - 1


def reserved_saving_check(plain_rank, offload_rank, first, share=0.5):
    """(ok, detail): peak reserved memory over iterations[first:] lower by at least `share` of the
    offloaded bytes. A plain `<` passed on differences (0.02-0.05 GiB) far inside the spread of
    identical runs (up to 0.49 GiB); half the state is far outside it and far below what the
    plugin takes off where the forward is the peak."""
    plain, ours = run_peak(plain_rank, first=first), run_peak(offload_rank, first=first)
    state = offload_rank.get("offloaded_bytes", 0)
    ok = state > 0 and plain - ours >= share * state
    return ok, (f"steady peak reserved {plain / 2**30:.2f} -> {ours / 2**30:.2f} GiB: saved "
                f"{(plain - ours) / 2**30:.2f} of {state / 2**30:.2f} GiB offloaded (needs >= {share:.0%})")


def megatron_printed(recorded, first_iteration):
    """{iteration: loss as megatron-core 0.19 prints it with --log-interval 1} for a run whose
    `recorded` losses (float hex, from train_step) begin at `first_iteration`.

    Megatron's training_log does not reset its loss accumulator after the first iteration a
    process logs (`is_first_iteration`: "log stats but don't reset accumulators"), so the next
    line prints the float32 sum of both over 2: the mean of a run's first two iterations, in a
    fresh run and after every resume alike. Every other line is the iteration's own loss."""
    import numpy as np

    out = {}
    values = [float.fromhex(x) for x in recorded]
    for k, value in enumerate(values):
        if k == 1:
            value = float(np.float32(values[0]) + np.float32(values[1])) / 2.0
        out[first_iteration + k] = "{:.6E}".format(value)
    return out


def printed_losses(log_text):
    """{iteration: 'lm loss' as Megatron printed it} from a run's log (the user's view of a run;
    the recorder's losses come from train_step's return value)."""
    found = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+)", log_text):
        found[int(m.group(1))] = m.group(2)
    return found


def offloaded_at_save(rank_record):
    """Least state (GPU bytes of chunks) that was off the GPU when one of a rank's saves began."""
    return min((sv.get("offloaded_before", 0) for sv in rank_record.get("saves", [])), default=0)


def run_peak(rank_record, key="max_reserved", first=0):
    """A rank's peak over iterations[first:] (plus the start-up peak when first == 0)."""
    values = [it[key] for it in rank_record["iterations"][first:]]
    if first == 0 and rank_record.get("startup_peak"):
        values.append(rank_record["startup_peak"][key])
    return max(values)
