"""Diagnostics for a GPU session (kept for the team): where the offload run's step time goes and
which optimizer-state component differs after a resume.

    python scripts/diagnose.py --out DIR [--what profile,resume,alloc]
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_runs import launch, model_args  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--what", default="alloc,resume,profile")
    p.add_argument("--nproc", type=int, default=2)
    o = p.parse_args()
    os.makedirs(o.out, exist_ok=True)
    what = o.what.split(",")
    if "alloc" in what:
        import torch

        x = torch.empty(1, device="cuda")
        for fn in (torch.cuda.memory_allocated, torch.cuda.max_memory_allocated):
            t = time.perf_counter()
            for _ in range(1000):
                fn()
            print(f"{fn.__name__}: {(time.perf_counter() - t) * 1e3:.3f} us/call", flush=True)
        del x
    if "resume" in what:
        ck = os.path.join(o.out, "ckpt")
        base = model_args(20) + ["--deterministic-mode"]
        a = launch("resume_ref", base + ["--save", ck, "--save-interval", "10"], o.nproc, o.out,
                   env_extra={"MEGATRON_OFFLOAD_STATE_DIGEST_AT": "10"})
        b = launch("resume_run", base + ["--load", ck, "--ckpt-step", "10"], o.nproc, o.out,
                   env_extra={"MEGATRON_OFFLOAD_STATE_DIGEST_AT": "10"})
        sa, sb = a["ranks"][0]["state_at"], b["ranks"][0]["state_at"]
        for key in sorted(set(sa) | set(sb)):
            same = sa.get(key) == sb.get(key)
            print(f"resume state {key}: {'same' if same else 'DIFFERS'}", flush=True)
            if not same:
                print(f"   uninterrupted: {sa.get(key)}\n   resumed:       {sb.get(key)}", flush=True)
        json.dump({"uninterrupted": sa, "resumed": sb}, open(os.path.join(o.out, "resume_state.json"), "w"), indent=1)
    if "profile" in what:
        from benchmark import PRESETS

        run = launch("profile_offload", model_args(14, **PRESETS["r1"]) + ["--offload-optimizer-states"],
                     o.nproc, o.out, env_extra={"MEGATRON_OFFLOAD_PROFILE_ITERS": "12"})
        print("offload ms/iter:", [round(i["ms"]) for i in run["ranks"][0]["iterations"]], flush=True)


if __name__ == "__main__":
    main()
