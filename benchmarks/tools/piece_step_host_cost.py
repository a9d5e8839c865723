"""Host time of one optimizer step taken whole and in pieces (chunked_step.step_in_pieces), on the CPU.

    python benchmarks/tools/piece_step_host_cost.py [--params 292] [--pieces 1,20,29] [--repeats 20]

Tiny parameters, so that the kernels cost next to nothing and what is left is the Python of the
piecewise step and of torch AdamW's per-call loops (each piece's `step()` walks every parameter).
Prints the median host time per step for the whole step and for each piece count.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron_offload import chunked_step  # noqa: E402


def median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=int, default=292, help="parameters of the optimizer (R1's local layers: 292)")
    p.add_argument("--pieces", default="1,20,29", help="piece counts, comma-separated")
    p.add_argument("--repeats", type=int, default=20)
    o = p.parse_args(argv)
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(o.params)]
    for q in params:
        q.grad = torch.ones(4)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    opt.step()  # (creates the state)
    print(f"torch {torch.__version__}, {o.params} parameters, median of {o.repeats}")
    print(f"whole step: {median_ms(opt.step, o.repeats):.2f} ms")
    for n in (int(x) for x in o.pieces.split(",")):
        pieces = [params[i::n] for i in range(n)]
        ms = median_ms(lambda: chunked_step.step_in_pieces(opt, pieces), o.repeats)
        print(f"{n} pieces: {ms:.2f} ms")


if __name__ == "__main__":
    main()
