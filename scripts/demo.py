"""Demo: a small GPT on mock data, on every local GPU, with and without --offload-optimizer-states.

    python scripts/demo.py [--preset small|r1] [--iters 20]

Prints a table of step time and peak memory per variant (see scripts/benchmark.py for the
columns). Needs CUDA GPUs and megatron-core; it says so and exits otherwise.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="/tmp/megatron_offload_demo")
    opts = p.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("megatron-offload demo: PyTorch is not installed (pip install -e . installs it).")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        sys.exit("megatron-offload demo: no CUDA GPU is visible on this machine. The demo trains a GPT "
                 "with Megatron on the local GPUs; run it on a GPU node (the CPU tests run anywhere: "
                 "bash scripts/run_cpu_tests.sh).")
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        sys.exit("megatron-offload demo: megatron-core is not installed (pip install -e '.[megatron]' installs it).")
    import benchmark

    nproc = torch.cuda.device_count()
    print(f"megatron-offload demo: preset {opts.preset} on {nproc} GPU(s), {opts.iters} iterations per variant",
          flush=True)
    benchmark.main(["--preset", opts.preset, "--nproc", str(nproc), "--iters", str(opts.iters),
                    "--warmup", str(max(1, opts.iters // 3)), "--variants", "baseline,offload",
                    "--out", opts.out])


if __name__ == "__main__":
    main()
