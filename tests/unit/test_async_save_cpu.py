"""What an asynchronous torch_dist save keeps of the host copies it read (issue 23, --async-save).

The plugin exposes offloaded chunks to a save as views of its pinned buffer
(`HostCopies.expose_host_copies`) and lets training go on while the save's writer runs; the next
copy-outs rewrite that buffer. That is safe only because megatron-core's dist-checkpointing copies
every CPU tensor that is a view of a larger storage before `save` returns
(`FileSystemWriterAsync.prepare_write_data`), and because every view of the pinned buffer is one
(`PinnedHostBuffer` keeps a tail no view covers). This test runs the installed megatron-core's real
asynchronous save on the CPU (gloo, one process; in a subprocess, since the save starts a spawned
helper process) and checks that the request it returns holds no byte of the buffer, and that it
holds a shared-memory snapshot (save_snapshot.SaveSnapshots) as it is, without a copy.
"""

import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

SCRIPT = textwrap.dedent(r"""
    import json, os, socket, sys, tempfile
    import torch
    import torch.distributed as dist


    def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron_offload.host_buffer import PinnedHostBuffer

        # A buffer holding exactly one tensor (the case a tail protects), and one holding two.
        one = PinnedHostBuffer(4096, pin=False)
        two = PinnedHostBuffer(2 * 4096, pin=False)
        like = torch.empty(1024, dtype=torch.float32)
        tensors = {"only": one.view(0, like), "first": two.view(0, like), "second": two.view(4096, like)}
        for i, t in enumerate(tensors.values()):
            t.fill_(i + 1)
        # What an asynchronous save reads for large tensors: shared-memory snapshots.
        from megatron_offload.save_snapshot import SaveSnapshots
        snapshots = SaveSnapshots(check=lambda n: None)
        (snap,) = snapshots.take([torch.full((1024,), 4.0)])
        tensors["snapshot"] = snap
        sd = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
        kwargs = {"async_sharded_save": True}
        import inspect
        if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
            kwargs["async_strategy"] = "mcore"  # (the default, nvrx, needs nvidia-resiliency-ext)
        request = dist_checkpointing.save(sd, tempfile.mkdtemp(), **kwargs)
        buffers = [b._storage.untyped_storage().data_ptr() for b in (one, two)]
        kept = []
        for arg in request.async_fn_args:
            if isinstance(arg, list):
                for _, _, (_, tensor_data) in arg:
                    kept += [t for _, t in tensor_data]
        shares = [t.untyped_storage().data_ptr() in buffers for t in kept]
        # The snapshot is handed over as it is (no clone; its queue sends the shared memory).
        snapshot_kept = [t.untyped_storage().data_ptr() == snap.untyped_storage().data_ptr() for t in kept]
        # What the writer holds of the buffers is a copy: rewriting them now changes none of it.
        for name, t in tensors.items():
            if name != "snapshot":
                t.fill_(-1)
        values = sorted(float(t.float().mean()) for t in kept)
        # While the request lives the snapshot set is in use: the next save gets another set.
        (other,) = snapshots.take([torch.full((1024,), 5.0)])
        reused_while_held = other.data_ptr() == snap.data_ptr()
        dist.destroy_process_group()
        print(json.dumps({"kept": len(kept), "shares": shares, "values": values, "snapshot_kept": snapshot_kept,
                          "reused_while_held": reused_while_held, "snap_value": float(snap.mean())}))


    if __name__ == "__main__":
        main()
""")


def run_probe(tmp_path, text):
    """Run a probe script in its own process (the saves start helper processes); its last line."""
    script = tmp_path / "probe.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_async_save_copies_buffer_views_and_keeps_snapshots_as_they_are(tmp_path):
    result = run_probe(tmp_path, SCRIPT)
    assert result["kept"] == 4, result
    assert not any(result["shares"]), result
    assert result["values"] == [1.0, 2.0, 3.0, 4.0], result
    assert sum(result["snapshot_kept"]) == 1, result
    assert not result["reused_while_held"] and result["snap_value"] == 4.0, result


# What the queue probes share: megatron-core's async queue reads the CUDA device for its
# all-reduces and synchronizes after staging; on the CPU both go to the CPU (gloo, one process).
QUEUE_PRELUDE = textwrap.dedent(r"""
    import inspect, json, os, socket, tempfile, threading, time
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


    def init_gloo():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
""")

QUEUE_SCRIPT = QUEUE_PRELUDE + textwrap.dedent(r"""
    def main():
        init_gloo()
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron_offload.save_snapshot import SaveSnapshots

        snapshots = SaveSnapshots(check=lambda n: None)
        (snap,) = snapshots.take([torch.full((1024,), 4.0)])
        first = snap.data_ptr()
        kwargs = {"async_sharded_save": True}
        if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
            kwargs["async_strategy"] = "mcore"
        directory = tempfile.mkdtemp()
        request = dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", snap, replica_id=0)},
                                          directory, **kwargs)
        # The write itself (its worker threads need psutil) is not what is tested: a writer that
        # does nothing, and no metadata to finalize.
        request = request._replace(async_fn=noop, finalize_fns=[])
        queue = AsyncCallsQueue(persistent=False)
        queue.schedule_async_request(request)
        del request, snap  # the caller keeps nothing: only megatron-core's queue may
        pending = queue.get_num_unfinalized_calls()
        (other,) = snapshots.take([torch.full((1024,), 5.0)])
        reused_while_pending = other.data_ptr() == first
        del other
        queue.maybe_finalize_async_calls(blocking=True)
        (again,) = snapshots.take([torch.full((1024,), 6.0)])
        reused_after = again.data_ptr() == first
        dist.destroy_process_group()
        print(json.dumps({"pending": pending, "reused_while_pending": reused_while_pending,
                          "reused_after": reused_after}))


    def noop(*args, **kwargs):
        pass


    if __name__ == "__main__":
        main()
""")


def test_megatron_cores_queue_holds_a_snapshot_set_until_the_save_is_finalized(tmp_path):
    """The snapshots' reuse rule rests on megatron-core's async queue (`AsyncCallsQueue`, the
    trainer side of both its persistent and its per-save worker) keeping a save's request, hence
    the tensors it writes, until the save is finalized (and, with torch 2.8, a reference cycle
    of the save path until the garbage collector runs, which `take` then does). (Run with the
    per-save worker: the persistent one needs a GPU; its queue-side bookkeeping is the same
    `async_calls`.) Run through the installed megatron-core
    with nothing else holding the snapshot: the set is not reused while the save is pending, and
    is reused once it is finalized."""
    result = run_probe(tmp_path, QUEUE_SCRIPT)
    assert result == {"pending": 1, "reused_while_pending": False, "reused_after": True}, result


BACKGROUND_SCRIPT = QUEUE_PRELUDE + textwrap.dedent(r"""
    def record(path):
        def write(*args, **kwargs):  # megatron-core's writer, reduced to reading what it writes
            seen = [t for arg in args if isinstance(arg, list) for item in arg
                    if isinstance(item, tuple) and len(item) == 3 for _, t in item[2][1]]
            with open(path, "w") as f:
                json.dump({"at": time.time(), "sums": [float(t.sum()) for t in seen]}, f)
        return write


    def child(channel, out):
        from megatron_offload import snapshot_fill
        flag, snap = channel.get()
        out.put("received")
        snapshot_fill.writer_waits([flag], lambda: out.put((time.time(), float(snap.sum()))))


    def main():
        init_gloo()
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron_offload import megatron_saves, megatron_wiring, snapshot_fill
        from megatron_offload.config import OffloadConfig
        from megatron_offload.save_snapshot import SaveSnapshots

        snapshots = SaveSnapshots(check=lambda n: None)
        snapshots.background = True

        class Coordinator:  # what the wiring asks of the coordinator
            config = OffloadConfig(async_save_snapshots=True, async_save_background_fill=True)

            def pending_snapshot_fills(self):
                return snapshots.pending_fills()

        megatron_saves.install(megatron_wiring._patch, Coordinator)
        result = {}

        # 1. megatron-core's queue (its per-save worker: the persistent one needs a GPU): the
        #    writer's function runs in the worker only once the fill, released 1 s later, is done.
        gate = threading.Event()
        (snap,) = snapshots.take([torch.full((1024,), 4.0)], before=lambda: gate.wait(30), background=True)
        kwargs = {"async_sharded_save": True}
        if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
            kwargs["async_strategy"] = "mcore"
        request = dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", snap, replica_id=0)},
                                          tempfile.mkdtemp(), **kwargs)
        path = os.path.join(tempfile.mkdtemp(), "written.json")
        request = request._replace(async_fn=record(path), finalize_fns=[])
        queue = AsyncCallsQueue(persistent=False)
        queue.schedule_async_request(request)
        released = time.time() + 1.0
        threading.Timer(1.0, gate.set).start()
        del request, snap
        queue.maybe_finalize_async_calls(blocking=True)
        with open(path) as f:
            written = json.load(f)
        result["queue"] = {"sums": written["sums"], "after_release": written["at"] >= released - 0.05,
                           "pending": queue.get_num_unfinalized_calls()}

        # 2. A spawned process (as megatron-core's persistent worker is) gets a snapshot and its
        #    flag by name, under handed_over_by_name, and reads it once filled.
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        channel, out = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=child, args=(channel, out))
        proc.start()
        gate = threading.Event()
        (snap,) = snapshots.take([torch.full((2048,), 5.0)], before=lambda: gate.wait(60), background=True)
        (fill,) = snapshots.pending_fills()
        ptr = snap.untyped_storage().data_ptr()
        with snapshot_fill.handed_over_by_name():
            channel.put((fill.flag, snap))
            assert out.get(timeout=120) == "received"  # (pickled by the queue's feeder thread)
        fill.start()  # (as megatron_saves does once the request is with the writer)
        time.sleep(0.5)
        released = time.time()
        gate.set()
        at, total = out.get(timeout=120)
        proc.join(60)
        result["spawned"] = {"sum": total, "after_release": at >= released - 0.05,
                             "same_storage": snap.untyped_storage().data_ptr() == ptr}
        dist.destroy_process_group()
        print(json.dumps(result))


    if __name__ == "__main__":
        main()
""")


def test_the_writer_waits_for_a_background_fill_through_megatron_cores_queue(tmp_path):
    """[Note: background fill]: megatron-core's real asynchronous save, scheduled through the
    wiring's `schedule_async_request` wrapper, runs its writer only once the fill of the snapshot
    it writes has finished (released a second after scheduling), finalizes cleanly, and writes
    the filled bytes; a spawned process (the persistent worker's kind) gets a snapshot by name
    (its storage not copied on the way) and reads it once filled."""
    result = run_probe(tmp_path, BACKGROUND_SCRIPT)
    assert result["queue"] == {"sums": [4096.0], "after_release": True, "pending": 0}, result
    assert result["spawned"] == {"sum": 10240.0, "after_release": True, "same_storage": True}, result
