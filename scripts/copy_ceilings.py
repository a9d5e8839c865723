"""PCIe copy ceilings on this GPU: pinned D2H, pinned H2D, and both directions at once.

    python scripts/copy_ceilings.py [--sizes-gib 0.25,1,4] [--repeat 5] [--out ceilings.json] [--devices N]

Host memory is page-locked exactly as megatron-offload does it (`PinnedHostBuffer`, i.e.
cudaHostRegister), the device side is a plain allocation. Each figure is the median over
`--repeat` timed copies (CUDA events) after one warm-up; GB/s are 10^9 bytes per second. The
benchmark uses the largest size's medians as the ceiling that achieved bandwidth is compared to.
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_offload.host_buffer import PinnedHostBuffer  # noqa: E402


def _time_ms(fn, repeat):
    times = []
    fn()  # warm-up
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copy_set(device, nbytes):
    """Pinned host buffers (as megatron-offload pins them), device buffers and one stream per
    direction on `device`, for the copies that `_enqueue` times."""
    with torch.cuda.device(device):
        host_out, host_in = PinnedHostBuffer(nbytes), PinnedHostBuffer(nbytes)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        h_out, h_in = host_out.view(0, src), host_in.view(0, src)
        h_in.copy_(src)
        return dict(device=device, hosts=(host_out, host_in), src=src, dst=dst, h_out=h_out, h_in=h_in,
                    d2h=torch.cuda.Stream(device), h2d=torch.cuda.Stream(device))


def _enqueue(g, kind):
    """Enqueue copy set `g`'s D2H, H2D or both at once ("d2h", "h2d", "both") on its side
    streams, between what the current stream did before and does after (the timing events)."""
    with torch.cuda.device(g["device"]):
        current = torch.cuda.current_stream()
        names = ("d2h", "h2d") if kind == "both" else (kind,)
        for name in names:
            g[name].wait_stream(current)  # after the start event (both before either copy)
        for name in names:
            with torch.cuda.stream(g[name]):
                if name == "d2h":
                    g["h_out"].copy_(g["src"], non_blocking=True)
                else:
                    g["dst"].copy_(g["h_in"], non_blocking=True)
        for name in names:
            current.wait_stream(g[name])  # the end event covers every copy


def _close(g):
    for host in g["hosts"]:
        host.close()


KINDS = (("d2h", 1), ("h2d", 1), ("both", 2))  # and the bytes moved, in buffers


def measure(sizes_gib, repeat=5):
    results = []
    for gib in sizes_gib:
        nbytes = int(gib * 2**30)
        g = _copy_set(torch.cuda.current_device(), nbytes)
        row = {"gib": gib, "pinning": g["hosts"][0].pinning}
        for kind, factor in KINDS:
            ms = _time_ms(lambda: _enqueue(g, kind), repeat)
            row[f"{kind}_gbps"] = factor * nbytes / ms / 1e6
        assert torch.equal(g["dst"][:4096].cpu(), g["src"][:4096].cpu()) and torch.equal(
            g["h_out"][:4096], g["src"][:4096].cpu()), "copy check failed"
        results.append(row)
        _close(g)
    return results


def measure_all_devices(gib, repeat=5, count=None):
    """The same three copies on the first `count` GPUs (default all) at once, as in a data-parallel run where every
    rank steps (and copies) at the same moment: the GPUs of one host share its root complex and
    memory, so each may get less than alone. Host memory is pinned once per GPU (each rank pins
    its own). Returns per-GPU GB/s, the slowest GPU's median, per direction and both at once."""
    devices = list(range(count or torch.cuda.device_count()))
    nbytes = int(gib * 2**30)
    per = [_copy_set(d, nbytes) for d in devices]

    def launch(g, kind):
        """Enqueue one timed copy set on GPU g; returns its (start, end) events."""
        with torch.cuda.device(g["device"]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _enqueue(g, kind)
            end.record()
        return start, end

    row = {"gib": gib, "devices": len(devices), "pinning": per[0]["hosts"][0].pinning}
    for kind, factor in KINDS:
        rates = {g["device"]: [] for g in per}
        for i in range(repeat + 1):  # the first round warms up
            for d in devices:
                torch.cuda.synchronize(d)
            events = [(g["device"], launch(g, kind)) for g in per]  # every GPU starts within ~100 us
            for d in devices:
                torch.cuda.synchronize(d)
            if i:
                for d, (start, end) in events:
                    rates[d].append(factor * nbytes / start.elapsed_time(end) / 1e6)
        medians = [statistics.median(r) for r in rates.values()]
        row[f"{kind}_gbps_per_device"] = medians
        row[f"{kind}_gbps"] = min(medians)
    for g in per:
        _close(g)
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-gib", default="0.25,1,4")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--devices", type=int, default=0,
                   help="also the largest size on this many GPUs at once (recorded as all_devices)")
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("copy_ceilings: needs a CUDA GPU")
    rows = measure([float(x) for x in opts.sizes_gib.split(",")], opts.repeat)
    print("| GiB | pinning | D2H GB/s | H2D GB/s | both at once GB/s (sum) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gib']:g} | {r['pinning']} | {r['d2h_gbps']:.1f} | {r['h2d_gbps']:.1f} | {r['both_gbps']:.1f} |")
    together = None
    if opts.devices > 1 and torch.cuda.device_count() >= opts.devices:
        size = float(opts.sizes_gib.split(",")[-1])
        try:
            together = measure_all_devices(size, opts.repeat, opts.devices)
        except Exception as error:  # the one-GPU ceilings above still stand
            print(f"copy_ceilings: {opts.devices} GPUs at once failed: {error!r}")
            together = None
    if opts.devices > 1 and together:
        print(f"all {together['devices']} GPUs at once, {size:g} GiB each (slowest GPU): D2H "
              f"{together['d2h_gbps']:.1f}, H2D {together['h2d_gbps']:.1f}, both {together['both_gbps']:.1f} GB/s "
              f"(per GPU: both {', '.join(f'{x:.1f}' for x in together['both_gbps_per_device'])})")
        rows[-1]["all_devices"] = together
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
