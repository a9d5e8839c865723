"""Where does an asynchronous save's blocked time go? megatron-core's own async save (`--async-save
--use-persistent-ckpt-worker --async-strategy mcore`) of one rank's state, by the form the state's
tensors take when the save reads them (issue 23: with the plugin a save blocks training longer than
without it; the recorder's save breakdown says where in a real run).

    python benchmarks/tools/async_save_probe.py [--forms cuda,snapshot,shared,private,view]
        [--mib 512] [--tensors 96] [--saves 3] [--gap 3] [--out probe.json]

Forms (one process each, since the checkpoint worker persists):
  cuda      GPU tensors (what a save without the plugin reads; the worker copies them out itself);
  snapshot  tensors in shared-memory snapshots (save_snapshot.SaveSnapshots: the plugin's large tensors);
  shared    fresh tensors moved to shared memory before the save (`share_memory_()`);
  private   fresh private CPU tensors (what TE's `get_unscaled_state` returns for fp16/bf16 states);
  view      views of one host buffer (host_buffer.PinnedHostBuffer: the plugin's small tensors),
            which dist-checkpointing clones.
Per save (the first starts the worker and is reported apart): `prepare` (making the tensors;
snapshot: the copy into the set), `save` (dist_checkpointing.save: planning, clones), `schedule`
(AsyncCallsQueue.schedule_async_request: the queue's pickling and the worker's preload, which
training waits for), and `write` (until the write is finalized). Blocked time in Megatron's
save_checkpoint is about save + schedule. Saves are `--gap` seconds apart: after each write the
worker runs a full garbage collection (megatron-core's `async_loop`; long in a process that
imported torch and megatron), and a save scheduled before it ends waits for it, which training
never meets with saves minutes apart. On a machine without CUDA (`cuda` skipped) the probe
runs megatron-core's CUDA calls as no-ops (a sitecustomize for the probe and its worker).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# For the probe process and its spawned worker on a machine without CUDA.
NO_CUDA = """
import torch
if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
"""


def one_form(form: str, mib: int, count: int, saves: int, gap: float) -> dict:
    import inspect
    import socket
    import time

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron_offload.host_buffer import ALIGNMENT, PinnedHostBuffer
    from megatron_offload.save_snapshot import SaveSnapshots

    numel = (mib * 2**20 // 4 // count) // ALIGNMENT * ALIGNMENT
    sources = [torch.randn(numel) for _ in range(count)]
    gpu = [s.cuda() for s in sources] if form == "cuda" else None
    snapshots = SaveSnapshots(check=lambda n: None, check_fds=lambda n: None)
    buffer = PinnedHostBuffer(count * numel * 4 + ALIGNMENT, pin=cuda) if form == "view" else None
    queue = AsyncCallsQueue(persistent=True)
    kwargs = {"async_sharded_save": True}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        kwargs["async_strategy"] = "mcore"
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(saves):
            t0 = time.perf_counter()
            if form == "cuda":
                tensors = [g.clone() for g in gpu]
                torch.cuda.synchronize()
            elif form == "snapshot":
                tensors = snapshots.take(sources)
            elif form == "shared":
                tensors = [s.clone().share_memory_() for s in sources]
            elif form == "private":
                tensors = [s.clone() for s in sources]
            else:
                tensors = [buffer.view(j * numel * 4, s) for j, s in enumerate(sources)]
                for t, s in zip(tensors, sources):
                    t.copy_(s)
            t1 = time.perf_counter()
            state = {f"t{j}": ShardedTensor.from_rank_offsets(f"t{j}", t, replica_id=0) for j, t in enumerate(tensors)}
            os.makedirs(os.path.join(root, str(i)))
            request = dist_checkpointing.save(state, os.path.join(root, str(i)), **kwargs)
            t2 = time.perf_counter()
            queue.schedule_async_request(request)
            t3 = time.perf_counter()
            del request, state, tensors
            queue.maybe_finalize_async_calls(blocking=True)
            t4 = time.perf_counter()
            time.sleep(gap)  # (the worker's collection after the write: module docstring)
            rows.append({"prepare": t1 - t0, "save": t2 - t1, "schedule": t3 - t2, "write": t4 - t3})
    queue.close()
    dist.destroy_process_group()
    later = rows[1:] or rows
    return {"form": form, "mib": mib, "tensors": count, "saves": saves, "gap_s": gap, "first": rows[0],
            "median_later": {k: statistics.median(r[k] for r in later) for k in rows[0]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forms", default="cuda,snapshot,shared,private,view")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=96)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--gap", type=float, default=3.0, help="seconds between a save's end and the next save")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a child process: one form)
    opts = p.parse_args(argv)
    if opts.one:
        print(json.dumps(one_form(opts.one, opts.mib, opts.tensors, opts.saves, opts.gap)))
        return 0
    import torch

    forms = [f for f in opts.forms.split(",") if f != "cuda" or torch.cuda.is_available()]
    results = []
    with tempfile.TemporaryDirectory() as site:
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(NO_CUDA)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [site, REPO, os.environ.get("PYTHONPATH")])))
        for form in forms:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", form, "--mib", str(opts.mib),
                                  "--tensors", str(opts.tensors), "--saves", str(opts.saves), "--gap", str(opts.gap)],
                                 capture_output=True, text=True, env=env, timeout=900)
            if out.returncode != 0:
                print(f"{form}: failed\n{out.stderr[-2000:]}", flush=True)
                results.append({"form": form, "failed": out.stderr[-2000:]})
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(row)
            m = row["median_later"]
            print(f"{form:9s} {opts.mib} MiB in {opts.tensors} tensors: save {m['save'] * 1e3:7.1f} ms, schedule "
                  f"{m['schedule'] * 1e3:7.1f} ms (blocked ~{(m['save'] + m['schedule']) * 1e3:.0f} ms), prepare "
                  f"{m['prepare'] * 1e3:.0f} ms, write {m['write'] * 1e3:.0f} ms; first save "
                  f"{(row['first']['save'] + row['first']['schedule']) * 1e3:.0f} ms", flush=True)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all("failed" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
