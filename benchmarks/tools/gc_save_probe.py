"""Objects an asynchronous save moves into Python's oldest garbage-collector generation, with and
without megatron-offload (CPU only: the unit tests' fake DistributedOptimizer at R1's tensor
count, megatron-core's real `dist_checkpointing.save` with its async strategy; the request is
planned and held, as the writer holds it, not written).

CPython runs a full collection once the objects moved into the oldest generation since the last
one exceed a quarter of those it holds; at R1's size such a collection stops training ~0.45 s.
Objects that are alive while young collections run (a save's request, its write items, the
plugin's snapshots and views) are moved there. Both runs save the same state tensors.

    PYENV_VERSION=3.12.1 .venv-ci/bin/python benchmarks/tools/gc_save_probe.py [--params 292] [--saves 3]
"""

import argparse
import collections
import gc
import inspect
import os
import socket
import sys
import tempfile

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "unit"))


def run(with_plugin: bool, params: int, saves: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from test_chunked_step_cpu import MegatronShapedDistOpt, make_grads
    from test_offloader_cpu import CPU, make_coord, one_iteration

    from megatron_offload.discovery import find_state_tensors
    from megatron_offload.megatron_state_methods import wrap_state_access

    class Fake(MegatronShapedDistOpt):
        step = MegatronShapedDistOpt.step_with_ready_grads

    opt = Fake(bf16_numels=tuple([2048] * params))
    coord = off = None
    if with_plugin:
        coord = make_coord(chunk_bytes=1 << 20, async_saves=True, async_save_snapshots=True,
                           async_save_background_fill=True)
        off = coord.add_optimizer(opt)

    def sharded(model_sd, is_loading=False, **_):
        if off is not None:  # (the plugin's tensors: host copies, then snapshots)
            named = [(st.name, st.tensor) for c in off.chunks for st in c.tensors]
        else:
            named = [(st.name, st.tensor) for st in find_state_tensors(opt, CPU).tensors]
        return {name: ShardedTensor.from_rank_offsets(name, t, replica_id=0) for name, t in named}

    opt.sharded_state_dict = sharded
    if coord is not None:
        wrap_state_access(coord, off, opt)
        coord.offload_existing_state()
    step = 0
    for _ in range(3):
        make_grads(list(opt.all_params()), step)
        one_iteration(opt, coord, step)
        step += 1
    kwargs = {"async_sharded_save": True}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        kwargs["async_strategy"] = "mcore"
    gc.collect()
    for n in range(saves):
        before = {id(o) for o in gc.get_objects(generation=2)}
        sd = opt.sharded_state_dict({})
        request = dist_checkpointing.save(sd, tempfile.mkdtemp(), **kwargs)
        if coord is not None:  # (as megatron_saves does once the request is with the writer)
            for fill in coord.pending_snapshot_fills():
                fill.start()
        tensors = len(sd)
        del sd
        gc.collect(1)  # young collections while the writer holds the request
        gc.collect(1)
        moved = [o for o in gc.get_objects(generation=2) if id(o) not in before]
        kinds = collections.Counter(type(o).__qualname__ for o in moved).most_common(6)
        print(f"{'plugin' if with_plugin else 'baseline'} save {n}: {tensors} state tensors, {len(moved)} objects "
              f"moved to the oldest generation ({len(moved) / tensors:.1f} per tensor): {kinds}", flush=True)
        make_grads(list(opt.all_params()), step)
        one_iteration(opt, coord, step)
        step += 1
        del request, moved
        gc.collect()
    if coord is not None:
        coord.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=292, help="parameters of the fake (R1: 292, 3 state tensors each)")
    p.add_argument("--saves", type=int, default=3)
    opts = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        run(False, opts.params, opts.saves)
        run(True, opts.params, opts.saves)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
