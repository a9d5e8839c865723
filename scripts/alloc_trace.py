"""Where did reserved memory grow? Reads the allocator history that scripts/pretrain_gpt_mock.py
writes with MEGATRON_OFFLOAD_MEMHIST=<N> (memhist_rank0.npz; the benchmark's `@memhist` modifier)
and lists every new segment after start-up with the iteration phase and the allocation that
needed it, plus the largest allocations (chunks) freed and re-allocated per iteration.

    python scripts/alloc_trace.py memhist_rank0.npz [--min-mib 100] [--chunks] [--deferred] [--holes] [--peaks]
        [--layout-at EVENT] [--layout-growths N]

Needs only numpy (runs anywhere, no GPU).
"""

import argparse
import bisect

import numpy as np

MIB, GIB = 2**20, 2**30
# Allocator actions that add or remove device memory: whole segments (default allocator) or pages
# of an expandable segment.
MAPS = ("segment_alloc", "segment_map")
UNMAPS = ("segment_free", "segment_unmap")


def load(path):
    d = np.load(path)
    actions = [str(a) for a in d["actions"]]
    return {"action": np.array([actions[i] for i in d["action"]]), "size": d["size"], "addr": d["addr"],
            "time_us": d["time_us"] if "time_us" in d.files else None,
            "stream": d["stream"] if "stream" in d.files else np.zeros(len(d["size"]), dtype=np.int64)}


def request_after(trace, i):
    """The size of the event after #i: for a mapping, the allocation that needed it."""
    return trace["size"][i + 1] if i + 1 < len(trace["size"]) else 0


MICROBATCH_MARKER_BASE = 100  # scripts/pretrain_gpt_mock.py's microbatch markers


def marker_stream(trace):
    """The stream the pretraining script allocates its markers on: the one whose allocations are
    all marker-sized. None for histories whose markers shared the compute stream (before session
    11): there any small allocation of a marker's size would pass for one."""
    small = (trace["size"] % 512 == 0) & (trace["size"] < MIB) & (trace["size"] >= 512 * MICROBATCH_MARKER_BASE)
    allocs = trace["action"] == "alloc"
    candidates = set(trace["stream"][allocs & small].tolist()) - set(trace["stream"][allocs & ~small].tolist())
    return candidates.pop() if len(candidates) == 1 else None


def phase_labels(trace):
    """Label of every event: the last marker allocation seen, "iteration N <point>" from the
    iteration markers (512 * (1000 + 4 * N + k)), refined to "iteration N fwd|bwd <microbatch>"
    by the microbatch markers (512 * (100 + 2 * microbatch + b))."""
    names = ("begin", "step_begin", "step_end", "?")
    only = marker_stream(trace)
    labels, current, iteration = [], "startup", None
    for action, size, stream in zip(trace["action"], trace["size"], trace["stream"]):
        if action == "alloc" and size % 512 == 0 and size < MIB and (only is None or stream == only):
            code = size // 512
            if MICROBATCH_MARKER_BASE <= code < 1000 and iteration is not None:
                k = code - MICROBATCH_MARKER_BASE
                current = f"iteration {iteration} {('fwd', 'bwd')[k % 2]} {k // 2}"
            elif 0 <= code - 1000 < 4 * 10_000:
                iteration = (code - 1000) // 4
                current = f"iteration {iteration} {names[(code - 1000) % 4]}"
        labels.append(current)
    return labels


def iteration_peaks(trace, labels):
    """Per iteration: (iteration, highest reserved, label there, allocated there). Reserved is
    rebuilt from the mapping events, allocated from alloc / free_completed; "there" is the most
    allocated while reserved stayed at its peak (a mapping precedes the request that needed it),
    so reserved - allocated is what was mapped but free at the tightest point. The markers' own
    bytes are left out where they have a stream of their own."""
    peaks = {}
    allocated = reserved = 0
    markers = marker_stream(trace)
    for action, size, label, stream in zip(trace["action"], trace["size"], labels, trace["stream"]):
        if stream == markers:
            continue
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action in MAPS:
            reserved += size
        elif action in UNMAPS:
            reserved -= size
        if not label.startswith("iteration "):
            continue
        iteration = int(label.split()[1])
        best = peaks.get(iteration)
        if best is None or reserved > best[1] or (reserved == best[1] and allocated > best[3]):
            peaks[iteration] = (iteration, reserved, label, allocated)
    return [peaks[k] for k in sorted(peaks)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("npz")
    p.add_argument("--min-mib", type=float, default=100.0, help="segments smaller than this are not listed")
    p.add_argument("--chunks", action="store_true", help="also list allocations/frees >= --min-mib after start-up")
    p.add_argument("--deferred", action="store_true",
                   help="frees that waited for another stream's event: at the peak and per phase")
    p.add_argument("--holes", action="store_true",
                   help="at every growth of reserved memory after iteration 0: the mapped but free bytes "
                        "and the largest free hole the request could not use")
    p.add_argument("--peaks", action="store_true",
                   help="per iteration: the highest reserved memory, where it was, and how much of it was free")
    p.add_argument("--layout-at", type=int, action="append", default=[], metavar="EVENT",
                   help="the event's stream just before event #EVENT (e.g. a growth --holes lists): live blocks "
                        "and free holes in address order")
    p.add_argument("--layout-growths", type=int, default=0, metavar="N",
                   help="--layout-at the first N growths --holes lists whose request is >= --min-mib")
    o = p.parse_args()
    trace = load(o.npz)
    labels = phase_labels(trace)
    allocated = reserved = peak = 0
    for i, (action, size, addr) in enumerate(zip(trace["action"], trace["size"], trace["addr"])):
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action in MAPS:
            reserved += size
        elif action in UNMAPS:
            reserved -= size
        peak = max(peak, reserved)
        late = labels[i] != "startup"
        if late and action in MAPS and size >= o.min_mib * MIB:
            wanted = request_after(trace, i)
            print(f"#{i:7d} {labels[i]:24s} new segment {size / MIB:8.1f} MiB for a {wanted / MIB:.1f} MiB "
                  f"request: reserved {reserved / GIB:6.2f} GiB, allocated {allocated / GIB:6.2f} GiB")
        elif late and o.chunks and action in ("alloc", "free_completed") and size >= o.min_mib * MIB:
            print(f"#{i:7d} {labels[i]:24s} {action:14s} {size / MIB:8.1f} MiB at {addr:#x}, "
                  f"allocated {allocated / GIB:6.2f} GiB")
    print(f"peak reserved in the trace: {peak / GIB:.2f} GiB")
    if o.deferred:
        deferred_report(trace, labels)
    if o.peaks:
        for iteration, reserved, label, allocated in iteration_peaks(trace, labels):
            print(f"iteration {iteration:3d}: peak reserved {reserved / GIB:6.2f} GiB at {label:24s} "
                  f"allocated {allocated / GIB:6.2f} GiB, mapped but free {(reserved - allocated) / GIB:5.2f} GiB")
    growths = growth_holes(trace, labels) if (o.holes or o.layout_growths) else []
    o.layout_at += layout_events(growths, o.min_mib * MIB, o.layout_growths)
    for event in o.layout_at:
        if not 0 <= event < len(trace["action"]):
            p.error(f"--layout-at {event}: the trace has events 0 to {len(trace['action']) - 1}")
    if o.holes:
        for i, label, mapped, wanted, free, largest in growths:
            print(f"#{i:7d} {label:24s} mapped {mapped / MIB:6.0f} MiB for a {wanted / MIB:6.1f} MiB request while "
                  f"{free / GIB:.2f} GiB were mapped but free, the largest hole {largest / MIB:.0f} MiB")
    for event in o.layout_at:
        print(f"before #{event} ({trace['action'][event]} {trace['size'][event] / MIB:.1f} MiB, {labels[event]}), "
              f"stream {trace['stream'][event]}:")
        for start, size, items in layout_at(trace, labels, event):
            print(f"  mapped {start:#x} {size / MIB:.0f} MiB")
            for item in items:
                if item[0] == "hole":
                    print(f"    hole {item[1] / MIB:8.1f} MiB")
                else:
                    print(f"    used {item[1] / MIB:8.1f} MiB in {item[2]} blocks (largest {item[3] / MIB:.1f} MiB), "
                          f"allocated in {', '.join(item[4][:3])}{' ...' if len(item[4]) > 3 else ''}")


def free_holes(live, mapped):
    """Sizes of the mapped address ranges that no live block covers. live: {addr: size};
    mapped: [(start, end)] of mapped pages (expandable segments) or segments."""
    blocks = sorted(live.items())
    holes = []
    for start, end in merge_adjacent(mapped):
        j = bisect.bisect_left(blocks, (start, -1))
        cursor = start
        while j < len(blocks) and blocks[j][0] < end:
            addr, size = blocks[j]
            if addr > cursor:
                holes.append(addr - cursor)
            cursor = max(cursor, addr + size)
            j += 1
        if cursor < end:
            holes.append(end - cursor)
    return holes


def growth_holes(trace, labels):
    """(event, label, bytes mapped, request, free mapped bytes, largest free hole) at every mapping
    after start-up and iteration 0: a request that found no hole large enough among the free
    mapped bytes (fragmentation) shows as a large free total with a smaller largest hole (what it
    found on R1: benchmarks/NOTES.md)."""
    # Per stream: a request only ever takes blocks of its own stream's segments.
    live, mapped, out = {}, {}, []
    for i, (action, size, addr, stream) in enumerate(zip(trace["action"], trace["size"], trace["addr"],
                                                          trace["stream"])):
        own_live, own_mapped = live.setdefault(stream, {}), mapped.setdefault(stream, [])
        if action in MAPS and labels[i] != "startup" \
                and not labels[i].startswith("iteration 0 "):
            holes = free_holes(own_live, own_mapped) or [0]
            wanted = request_after(trace, i)
            out.append((i, labels[i], size, wanted, sum(holes), max(holes)))
        if action == "alloc":
            own_live[addr] = size
        elif action == "free_completed":
            own_live.pop(addr, None)
        elif action in MAPS:
            own_mapped.append((addr, addr + size))
        elif action in UNMAPS:
            mapped[stream] = unmap(own_mapped, addr, size)
    return out


def merge_adjacent(ranges):
    """[(start, end)] sorted, each run of ranges that meet end to start as one."""
    merged = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def unmap(mapped, addr, size):
    """`mapped` ([(start, end)]) without [addr, addr + size)."""
    kept = []
    for start, end in mapped:
        if end <= addr or start >= addr + size:
            kept.append((start, end))
            continue
        if start < addr:
            kept.append((start, addr))
        if end > addr + size:
            kept.append((addr + size, end))
    return kept


def layout_at(trace, labels, event, min_hole=2 * MIB):
    """The memory of event #`event`'s stream just before it, in address order: per mapped range,
    runs of live blocks as ("used", bytes, blocks, largest block, the phases that allocated them,
    earliest first) and free holes of at least `min_hole` as ("hole", bytes). Shows what separates
    the holes that a request could not use (growth_holes). Pages an expandable segment mapped side
    by side form one range; segments of the default allocator stay apart (no block spans two)."""
    stream = trace["stream"][event]
    live, pages, segments = {}, [], []
    for i in range(event):
        if trace["stream"][i] != stream:
            continue
        action, size, addr = trace["action"][i], int(trace["size"][i]), int(trace["addr"][i])
        if action == "alloc":
            live[addr] = (size, labels[i], i)
        elif action == "free_completed":
            live.pop(addr, None)
        elif action == "segment_map":
            pages.append((addr, addr + size))
        elif action in MAPS:
            segments.append((addr, addr + size))
        elif action in UNMAPS:
            pages, segments = unmap(pages, addr, size), unmap(segments, addr, size)
    ranges = sorted(merge_adjacent(pages) + segments)
    blocks = sorted(live.items())
    out = []
    for start, end in ranges:
        items, run, cursor = [], [], start

        def close_run():
            if run:
                first = {}
                for _, label, i in run:
                    first[label] = min(i, first.get(label, i))
                items.append(("used", sum(b for b, _, _ in run), len(run), max(b for b, _, _ in run),
                              sorted(first, key=first.get)))
                run.clear()
        for addr, (size, label, i) in blocks[bisect.bisect_left(blocks, (start, )):]:
            if addr >= end:
                break
            if addr - cursor >= min_hole:
                close_run()
                items.append(("hole", addr - cursor))
            run.append((size, label, i))
            cursor = max(cursor, addr + size)
        close_run()
        if end - cursor >= min_hole:
            items.append(("hole", end - cursor))
        out.append((start, end - start, items))
    return out


def layout_events(growths, min_request, count):
    """The events of the first `count` growths (growth_holes rows) whose request is >= min_request."""
    return [g[0] for g in growths if g[3] >= min_request][:count]


def deferred_report(trace, labels):
    """At the trace's reserved peak: live bytes, and bytes whose free was requested but waits for
    an event of another stream (a block used on a stream it was not allocated on, through
    record_stream); and per phase, how many frees waited and for how long (host time)."""
    reserved = peak = peak_at = 0
    for i, (action, size) in enumerate(zip(trace["action"], trace["size"])):
        reserved += size if action in MAPS else 0
        reserved -= size if action in UNMAPS else 0
        if reserved > peak:
            peak, peak_at = reserved, i
    live, pending, waits = {}, {}, {}
    for i, (action, size, addr) in enumerate(zip(trace["action"], trace["size"], trace["addr"])):
        if action == "alloc":
            live[addr] = size
        elif action == "free_requested":
            pending[addr] = i
        elif action == "free_completed":
            live.pop(addr, None)
            j = pending.pop(addr, None)
            if j is not None and i - j > 1 and trace["time_us"] is not None:
                count, nbytes, longest = waits.get(labels[j], (0, 0, 0.0))
                waited = (trace["time_us"][i] - trace["time_us"][j]) / 1e3
                waits[labels[j]] = (count + 1, nbytes + size, max(longest, waited))
        if i == peak_at:
            at_peak = (sum(live.values()), sum(live[a] for a in pending if a in live))
    print(f"at the reserved peak ({peak / GIB:.2f} GiB, event #{peak_at}, {labels[peak_at]}): "
          f"{at_peak[0] / GIB:.2f} GiB allocated, of which {at_peak[1] / GIB:.2f} GiB freed but waiting "
          f"for another stream's event; {(peak - at_peak[0]) / GIB:.2f} GiB free in the segments")
    for label, (count, nbytes, longest) in waits.items():
        print(f"  {label:24s} {count:6d} frees waited for another stream ({nbytes / GIB:.2f} GiB, "
              f"longest {longest:.1f} ms host time)")


if __name__ == "__main__":
    main()
