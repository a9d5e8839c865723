"""Phase switch benchmark (issue 23): the whole optimizer state off the GPU and back, three ways,
on the state of a real Megatron run, in one process:

  pinned ceiling   every state tensor copied into / out of preallocated pinned buffers
                   (`copy_(non_blocking=True)`, one copy per tensor): what plain pinned copies of
                   these tensors reach
  megatron         megatron-core's `offload_to_cpu()` / `restore_from_cpu()` (what RL frameworks call)
  plugin           `phase_switcher(optimizer)`: `offload_all(release_memory=True)` / `restore_all()`

    python benchmarks/tools/phase_switch_bench.py --out /tmp/phase [--rounds 10] [--gbs 8]

launches R1's model on one GPU for a few iterations without the per-step flag (the mock entry
point's recorder calls `measure` after training when MEGATRON_OFFLOAD_PHASE_BENCH is set) and prints
per-way round-trip times, GB/s, memory returned (allocated and reserved) and whether the state is
bit-identical to its copy taken before the first switch. Writes <out>/phase_switch.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

GIB = 2**30


def _state_tensors(optimizer):
    """The masters and every state tensor (what offload_to_cpu moves), looked up afresh: Megatron's
    restore_from_cpu replaces the state tensors by new objects."""
    from megatron_offload.megatron_wiring import iter_distributed_optimizers

    out = []
    for dist_opt in iter_distributed_optimizers(optimizer):
        inner = dist_opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                out.append(p)
                out += [v for _, v in sorted(inner.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    return out


def _memory():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _same(optimizer, reference):
    now = _state_tensors(optimizer)
    return len(now) == len(reference) and all(
        torch.equal(t.detach().cpu().view(-1).view(torch.uint8), r.view(-1).view(torch.uint8))
        for t, r in zip(now, reference))


def _round_trips(name, rounds, out_fn, in_fn, nbytes):
    """Times of `rounds` out+in pairs (each direction waited for), memory after each out."""
    rows = []
    start_allocated, _ = _memory()
    for _ in range(rounds):
        a0, r0 = _memory()
        t0 = time.perf_counter()
        out_fn()
        t1 = time.perf_counter()
        a1, r1 = _memory()
        in_fn()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        rows.append({"out_s": t1 - t0, "in_s": t2 - t1, "allocated_freed": a0 - a1, "reserved_freed": r0 - r1})
    steady = rows[1:] or rows
    rt = statistics.median(r["out_s"] + r["in_s"] for r in steady)
    end_allocated, _ = _memory()
    return {"way": name, "rounds": rows, "round_trip_s": rt, "first_round_trip_s": rows[0]["out_s"] + rows[0]["in_s"],
            # GPU memory the state takes after the last restore beyond what it took before the first
            # switch (the plugin's chunks are padded to one slot size): freed shares above 1 are this.
            "allocated_growth_after_restore": (end_allocated - start_allocated) / nbytes,
            "gbps_round_trip": 2 * nbytes / rt / 1e9,
            "reserved_freed_share": min(r["reserved_freed"] for r in steady) / nbytes,
            "allocated_freed_share": min(r["allocated_freed"] for r in steady) / nbytes}


def measure(optimizer, rounds):
    """Run the three ways on `optimizer`'s state (resident, between steps). Returns a dict."""
    from megatron_offload.coordinator import phase_switcher

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    tensors = _state_tensors(optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    reference = [t.detach().cpu() for t in tensors]
    results = {"state_bytes": nbytes, "tensors": len(tensors), "ways": []}

    # Pinned ceiling: the same tensors into preallocated pinned buffers and back.
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def ceiling_out():
        for h, t in zip(pinned, _state_tensors(optimizer)):
            h.copy_(t.detach(), non_blocking=True)
        torch.cuda.synchronize()

    def ceiling_in():
        for h, t in zip(pinned, _state_tensors(optimizer)):
            t.detach().copy_(h, non_blocking=True)

    results["ways"].append(_round_trips("pinned ceiling (copies only, memory kept)", 3, ceiling_out, ceiling_in, nbytes))
    pinned.clear()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # (the caching host allocator keeps freed pinned blocks)
    results["ways"][-1]["bit_identical"] = _same(optimizer, reference)

    # megatron-core's own API (RL frameworks' phase switch).
    results["ways"].append(_round_trips("megatron offload_to_cpu/restore_from_cpu", min(rounds, 3),
                                        optimizer.offload_to_cpu, optimizer.restore_from_cpu, nbytes))
    results["ways"][-1]["bit_identical"] = _same(optimizer, reference)

    # The plugin's phase switch, with no per-step flag.
    switcher = phase_switcher(optimizer)
    results["ways"].append(_round_trips("megatron-offload offload_all/restore_all", rounds,
                                        lambda: switcher.offload_all(release_memory=True),
                                        lambda: switcher.restore_all().wait(), nbytes))
    results["ways"][-1]["bit_identical"] = _same(optimizer, reference)
    results["ways"][-1]["pinned_bytes"] = switcher.pinned_bytes
    switcher.close()
    return results


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    sys.path.insert(0, os.path.join(repo, "scripts"))
    from megatron_runs import launch, model_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/megatron_offload_phase")
    p.add_argument("--rounds", type=int, default=10, help="plugin round trips (Megatron's: at most 3)")
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--iters", type=int, default=5, help="training iterations before the switches (> the 3 warm-up iterations of the lr schedule)")
    opts = p.parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    args = model_args(opts.iters, layers=24, hidden=2048, heads=16, seq=2048, mbs=2, gbs=opts.gbs)
    run = launch("phase_switch", args, 1, opts.out, env_extra={"MEGATRON_OFFLOAD_PHASE_BENCH": str(opts.rounds),
                                                         "MEGATRON_OFFLOAD_NO_DIGEST": "1"})
    res = run["ranks"][0].get("phase_bench")
    if not res:
        raise SystemExit("the run recorded no phase_bench")
    res["host"] = run.get("host")
    print(f"state {res['state_bytes'] / GIB:.2f} GiB in {res['tensors']} tensors, R1's model, --gbs {opts.gbs}")
    print("| way | round trip s (median, steady) | first s | GB/s (mean of the two directions) | reserved freed / state | "
          "allocated freed / state | allocated growth after restore / state | bit-identical after |")
    print("|---|---|---|---|---|---|---|---|")
    for w in res["ways"]:
        print(f"| {w['way']} | {w['round_trip_s']:.3f} | {w['first_round_trip_s']:.3f} | {w['gbps_round_trip']:.1f} | "
              f"{w['reserved_freed_share']:.3f} | {w['allocated_freed_share']:.3f} | "
              f"{w['allocated_growth_after_restore']:.3f} | {w['bit_identical']} |")
    ways = {w["way"].split()[0]: w for w in res["ways"]}
    plugin, native, ceiling = ways["megatron-offload"], ways["megatron"], ways["pinned"]
    res["speedup_vs_megatron"] = native["round_trip_s"] / plugin["round_trip_s"]
    res["ratio_to_ceiling"] = plugin["round_trip_s"] / ceiling["round_trip_s"]
    print(f"plugin vs megatron: {res['speedup_vs_megatron']:.1f}x faster; plugin / pinned ceiling: "
          f"{res['ratio_to_ceiling']:.3f}")
    with open(os.path.join(opts.out, "phase_switch.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
