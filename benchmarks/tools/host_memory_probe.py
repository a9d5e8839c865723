"""Where pinned host memory goes when a process forks (the data loader's workers do).

    python benchmarks/tools/host_memory_probe.py --gib 4 [--workers 3]

For each way of pinning (PyTorch-style `torch.empty` + cudaHostRegister, as the plugin did before;
the plugin's PinnedHostBuffer; PyTorch's pinned allocator) it prints the node's MemAvailable drop
after pinning and a D2H fill, while forked children live, and while a DataLoader's workers run.
One GPU; a few seconds per mode.
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron_offload import host_memory  # noqa: E402
from megatron_offload.host_buffer import PinnedHostBuffer  # noqa: E402

GIB = 2**30


def available():
    time.sleep(0.5)
    return host_memory.read().available


def _sleeper(seconds):
    time.sleep(seconds)


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.zeros(4)


def pin(mode, nbytes):
    if mode == "register-torch-empty":
        t = torch.empty(nbytes, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        assert int(err) == 0, err
        return t, lambda: torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    if mode == "plugin":
        buf = PinnedHostBuffer(nbytes)
        return buf.bytes, buf.close
    if mode == "pin_memory":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), lambda: None
    raise ValueError(mode)


def probe(mode, nbytes, workers):
    row = {"mode": mode, "gib": nbytes / GIB}
    start = available()
    host, unpin = pin(mode, nbytes)
    gpu = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    host.copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    del gpu
    torch.cuda.empty_cache()
    row["pinned_drop_gib"] = (start - available()) / GIB
    ctx = mp.get_context("fork")
    children = [ctx.Process(target=_sleeper, args=(4,)) for _ in range(workers)]
    for c in children:
        c.start()
    row["with_%d_forked_children_drop_gib" % workers] = (start - available()) / GIB
    for c in children:
        c.join()
    loader = torch.utils.data.DataLoader(_Data(), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    row["with_dataloader_2_workers_drop_gib"] = (start - available()) / GIB
    del it, loader
    row["host_byte_kept"] = int(host[12345].item()) == 7
    unpin()
    del host, unpin  # (the closure holds the buffer too)
    row["after_free_drop_gib"] = (start - available()) / GIB
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--modes", default="register-torch-empty,plugin,pin_memory")
    p.add_argument("--out", default=None)
    opts = p.parse_args()
    torch.cuda.init()
    rows = [probe(m, int(opts.gib * GIB), opts.workers) for m in opts.modes.split(",")]
    if opts.out:
        json.dump(rows, open(opts.out, "w"), indent=1)


if __name__ == "__main__":
    main()
