"""Bookkeeping of the offloader and coordinator against CPU stand-ins of DistributedOptimizer.

On a CPU "device" copies are synchronous, but every transition (discovery, freeing with
resize_(0), host buffer layout, reload, skipped steps, checkpoint access) runs the same code as on
the GPU, and the results must match a run without offloading bit for bit.
"""

import pytest
import torch

from megatron_offload import (
    ChunkState,
    Phase,
    UnsupportedOptimizerStateError,
    find_state_tensors,
)
from megatron_offload.iteration import IterationState
from megatron_offload.chunks import TENSOR_ALIGNMENT

from fakes import (
    FakeDistOpt,
    FakePrecisionAwareDistOpt,
    assert_bitwise_equal,
    make_coordinator,
    make_grads,
    resident_snapshot,
    snapshot,
    step_beside,
    storage_bytes,
)

CPU = torch.device("cpu")
LAYERS = 4


def make_coord(**kw):
    kw.setdefault("chunk_bytes", 4096)
    kw.setdefault("expected_forwards_per_iteration", lambda: 2)
    return make_coordinator(device=CPU, **kw)


def one_iteration(opt, coord, step, skip=False, microbatches=2, check=None):
    """Mirror of Megatron's train_step as the wiring reports it to the coordinator."""
    for mb in range(microbatches):
        if coord is not None:
            coord.forward_begin(True)
            for _ in range(LAYERS):
                coord.layer_forward_begin()
            coord.forward_end()
            if check is not None:
                check("after_forward", mb)
            coord.backward_begin()
            for _ in range(LAYERS):
                coord.layer_backward_begin()
    if coord is not None:
        coord.grads_finalizing()
    make_grads(opt.all_params(), step)
    if not skip:
        opt.step()
    if coord is not None:
        coord.optimizer_step_done()


def offloaded_tensors(opt):
    return [st.tensor for st in find_state_tensors(opt, CPU).tensors]


@pytest.mark.parametrize("factory", [
    lambda: FakeDistOpt(),
    lambda: FakePrecisionAwareDistOpt(),
    lambda: FakePrecisionAwareDistOpt(store_param_remainders=True, moment_dtype=torch.bfloat16),
], ids=["torch-adamw", "te-fusedadam-fp32-master", "te-fusedadam-int16-remainders-bf16-moments"])
def test_training_bit_identical_and_state_freed(factory):
    ref, opt = factory(), factory()
    coord = make_coord()
    off = coord.add_optimizer(opt)

    def check(where, mb):
        # After every forward the state must be off the "GPU": storage freed, objects intact.
        if coord.state_bytes:
            assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes
            for st in off.discovery.tensors:
                assert storage_bytes(st.tensor) == 0, st.name
                assert st.tensor.numel() > 0  # shape and object survive
        # Model weights are never freed.
        for group in getattr(opt, "shard_fp32_groups", []):
            for view in group:
                assert storage_bytes(view) > 0
        for group in getattr(opt, "shard_float16_groups", []):
            for view in group:
                assert storage_bytes(view) > 0

    for step in range(6):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step, check=check)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert coord.state_bytes > 0
    assert coord.phase is Phase.FREEING


def test_materialized_state_is_identical_to_lazy_and_packed_once():
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()  # as the Megatron wiring does at attach
    # Moments exist (and are packed) before the first step; nothing to re-discover at step 1.
    assert all("exp_avg" in opt.optimizer.state[p] for p in opt.all_params())
    refreshes = []
    original = off.refresh
    off.refresh = lambda: (refreshes.append(1), original())
    for step in range(4):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert refreshes == []


def test_materialize_leaves_existing_state_alone():
    opt = FakePrecisionAwareDistOpt()
    make_grads(opt.all_params(), 0)
    opt.step()  # TE created the state (as a resumed run's load does): not initialized again
    coord = make_coord()
    off = coord.add_optimizer(opt)
    assert off.materialize_state() == 0


def test_copies_split_into_pieces_stay_exact():
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord(chunk_bytes=16384, copy_piece_bytes=1000)  # pieces not aligned to tensors
    coord.add_optimizer(opt)
    for step in range(4):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))


def test_discovery_selects_masters_and_moments_only():
    opt = FakeDistOpt(fp32_numels=(7, 5), bf16_numels=(300, 1000))
    # Before the first step only the fp32 masters exist (moments are created lazily).
    assert [st.name for st in find_state_tensors(opt, CPU).tensors] == [
        "group0.param2.master", "group0.param3.master"]
    make_grads(opt.all_params(), 0)
    opt.step()
    names = [st.name for st in find_state_tensors(opt, CPU).tensors]
    # fp32 shard params (views into the param buffer) never appear; their moments do.
    assert names == [
        "group0.param0.exp_avg", "group0.param0.exp_avg_sq",
        "group0.param1.exp_avg", "group0.param1.exp_avg_sq",
        "group0.param2.master", "group0.param2.exp_avg", "group0.param2.exp_avg_sq",
        "group0.param3.master", "group0.param3.exp_avg", "group0.param3.exp_avg_sq",
    ]
    # torch AdamW's step counters stay where they are (CPU scalars, never moved).
    for p in opt.all_params():
        assert "step" in opt.optimizer.state[p]
        assert all(st.tensor is not opt.optimizer.state[p]["step"] for st in find_state_tensors(opt, CPU).tensors)


def test_host_buffer_exact_size_and_reused():
    opt = FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    one_iteration(opt, coord, 0)
    host = off.host
    assert host.nbytes == sum(c.nbytes for c in off.chunks) == coord.pinned_bytes
    assert host.nbytes - off.state_bytes < TENSOR_ALIGNMENT * len(off.discovery.tensors)
    for step in range(1, 4):
        one_iteration(opt, coord, step)
    assert off.host is host  # allocated once, reused every step


def test_a_small_state_is_split_into_several_chunks(monkeypatch):
    """A state smaller than MIN_CHUNKS chunks still gets about MIN_CHUNKS of them: one chunk is
    what packing holds twice and the hole a freed chunk leaves, so it must stay small against the
    state (a one-chunk state doubled the start-up peak of the small PP2 runs)."""
    from megatron_offload import packing

    monkeypatch.setattr(packing, "MIN_CHUNK_BYTES", 256)
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord(chunk_bytes=2**30)  # far larger than the whole state
    off = coord.add_optimizer(opt)
    for step in range(3):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    largest = max(st.nbytes for st in off.discovery.tensors)
    assert len(off.chunks) >= packing.MIN_CHUNKS // 2, off.chunks
    assert all(c.nbytes <= max(-(-off.state_bytes // packing.MIN_CHUNKS), largest) + TENSOR_ALIGNMENT
               for c in off.chunks), off.chunks
    monkeypatch.setattr(packing, "MIN_CHUNK_BYTES", 2**30)  # the floor wins over the split
    with coord.state_access([off], will_modify=True):
        pass  # the state back, re-packed when the access closes
    assert len(off.chunks) == 1


def test_large_tensors_do_not_leave_half_empty_padded_chunks():
    """Every chunk is padded to the largest, so chunks must be (nearly) full: with large tensors
    among small ones, packing strictly in order closed a chunk before each large tensor, and the
    GPU buffers came to ~3x the state on the PP2 matrix cases (the step, with all of it back,
    became the run's peak)."""
    sizes = (300, 8192, 300, 300, 8192, 300, 300, 8192, 300)
    ref, opt = FakeDistOpt(bf16_numels=sizes), FakeDistOpt(bf16_numels=sizes)
    coord = make_coord(chunk_bytes=4096)  # smaller than the large tensors: they set the slot
    off = coord.add_optimizer(opt)
    for step in range(3):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    slot = off.chunks[0].gpu_nbytes
    assert slot >= 8192 * 4
    assert len(off.chunks) <= -(-off.state_bytes // (8192 * 4)) + 1, off.chunks
    # Balanced chunks: the padding is a few per cent, not a chunk.
    assert coord.gpu_bytes <= 1.1 * off.state_bytes + len(off.chunks) * 512, (coord.gpu_bytes, off.state_bytes)


def test_chunks_are_balanced_so_the_last_one_is_not_a_padded_remainder():
    """15 tensors of 16 KiB with 100 KiB chunks: filled up to 100 KiB, the chunks hold 6, 6 and 3
    tensors and the third is padded to 96 KiB (GPU buffers 1.2x the state); balanced, 3 x 5."""
    sizes = (4096,) * 5
    ref, opt = FakeDistOpt(bf16_numels=sizes), FakeDistOpt(bf16_numels=sizes)
    coord = make_coord(chunk_bytes=100 * 1024)
    off = coord.add_optimizer(opt)
    for step in range(2):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
    assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert len(off.chunks) == 3, off.chunks
    assert coord.gpu_bytes <= 1.05 * off.state_bytes, (coord.gpu_bytes, off.state_bytes)


def test_every_chunk_buffer_has_one_slot_size_and_the_host_copy_is_exact():
    """Chunks of different packed sizes get GPU buffers of one size, so that the block any chunk
    frees takes any other chunk (the caching allocator never merges blocks across segments)."""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    for step in range(3):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
    assert len({c.nbytes for c in off.chunks}) > 1, off.chunks  # the case this is about
    slot = off.chunks[0].gpu_nbytes
    assert slot == max(c.nbytes for c in off.chunks)
    coord.start_pending_copy_out()
    for chunk in off.chunks:
        assert chunk.gpu_nbytes == slot
        assert chunk.host.numel() == chunk.nbytes
    assert coord.gpu_bytes == slot * len(off.chunks)
    assert off.pinned_bytes == sum(c.nbytes for c in off.chunks)
    coord.forward_begin(training=False)  # an evaluation forward frees every chunk
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes
    assert all(storage_bytes(c.buffer) == 0 for c in off.chunks)
    coord.grads_finalizing()  # reload, padding untouched by the copies
    for chunk in off.chunks:
        assert storage_bytes(chunk.buffer) == slot
    make_grads(opt.all_params(), 3)
    opt.step()
    make_grads(ref.all_params(), 3)
    ref.step()
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


@pytest.mark.parametrize("layout", ["ascending", "descending"])
def test_copy_out_and_free_go_from_the_highest_address_down(layout, monkeypatch):
    """The top chunk's freed block joins the free space above it; the copy-out runs in the same
    order so that the first free waits only for the first copy."""
    from megatron_offload.chunks import Chunk

    opt = FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    one_iteration(opt, coord, 0)
    n = len(off.chunks)
    assert n > 2
    fake = {id(c): (i if layout == "ascending" else n - i) * 2**20 for i, c in enumerate(off.chunks)}
    monkeypatch.setattr(Chunk, "address", property(lambda c: 0 if c.state is ChunkState.OFFLOADED else fake[id(c)]))
    moves = []  # (chunk, new state), in the order the chunks move
    move_to = Chunk.move_to
    monkeypatch.setattr(Chunk, "move_to", lambda c, state: (moves.append((c, state)), move_to(c, state))[1])
    coord.forward_begin(training=False)  # copy-out, then every chunk freed
    copied = [c for c, state in moves if state is ChunkState.COPYING_OUT]
    freed = [c for c, state in moves if state is ChunkState.OFFLOADED]
    want = sorted(off.chunks, key=lambda c: -fake[id(c)])
    assert [c.index for c in copied] == [c.index for c in want]
    assert [c.index for c in freed] == [c.index for c in want]


@pytest.mark.parametrize("fraction", [0.3, 0.75])
def test_state_fraction_keeps_the_rest_resident_and_untouched(fraction):
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord(state_fraction=fraction)
    off = coord.add_optimizer(opt)
    kept_storages = {}

    def check(where, mb):
        if not off.kept:
            return
        assert_kept_packed(off)
        for st in off.kept:  # never freed, never moved (the same storage every time)
            assert kept_storages.setdefault(st.name, st.tensor.untyped_storage().data_ptr()) == \
                st.tensor.untyped_storage().data_ptr(), st.name
        assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes  # the rest is off

    for step in range(4):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step, check=check)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    total = off.state_bytes + off.kept_bytes
    assert off.kept and off.chunks
    assert off.state_bytes <= fraction * total
    assert off.state_bytes > fraction * total - max(st.nbytes for st in off.kept)
    assert total == sum(st.nbytes for st in find_state_tensors(opt, CPU).tensors)
    assert off.pinned_bytes == sum(c.nbytes for c in off.chunks)  # only the offloaded part
    assert "kept on the GPU" in coord.describe()


def assert_kept_packed(off, buffers_at_most=None):
    """The kept tensors live in the offloader's kept buffers (chunk-sized, exactly as large as
    their layout), not in blocks of their own nor in an old chunk buffer."""
    buffers = {c.buffer.untyped_storage().data_ptr(): c.buffer for c in off.kept_chunks}
    assert off.kept_chunks and len(buffers) == len(off.kept_chunks) <= (buffers_at_most or len(off.kept))
    for c in off.kept_chunks:
        assert storage_bytes(c.buffer) == c.gpu_nbytes < c.nbytes + 512
    for st in off.kept:
        assert st.tensor.untyped_storage().data_ptr() in buffers, st.name
    assert sum(st.nbytes for st in off.kept) <= sum(c.nbytes for c in off.kept_chunks)


def test_tensors_kept_after_a_new_split_are_packed_anew():
    """When a re-discovery moves the split, a tensor packed before and kept now must not stay a
    view into the old chunk buffer (it would keep the whole buffer alive): it moves into the new
    kept buffers, and the old chunk buffer is released."""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord(chunk_bytes=2**20)  # one chunk: every tensor a view into one buffer
    off = coord.add_optimizer(opt)
    one_iteration(ref, None, 0)
    one_iteration(opt, coord, 0)  # everything packed into chunks
    assert len(off.chunks) == 1
    with coord.state_access([off], will_modify=True):
        old = off.chunks[0].buffer
        off.fraction = 0.4  # re-split when the access closes
    assert len(off.kept) > 1
    assert_kept_packed(off, buffers_at_most=1)  # (they fit one chunk of 1 MiB)
    assert storage_bytes(old) == 0
    for step in range(1, 3):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
    assert_bitwise_equal(snapshot(ref), snapshot(opt))


def test_lifecycle_order_and_bytes_moved():
    opt = FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    one_iteration(opt, coord, 0)
    assert coord.phase is Phase.FREEING
    coord.events.clear()
    one_iteration(opt, coord, 1)
    ev = coord.events
    # Without a memory model the window cannot reload anything: finalize is the fallback trigger.
    # The previous step's copy-out is enqueued when this iteration's forward begins, not at the
    # end of the step (host reads of the loss must not queue behind it on the copy engine).
    order = [ev.index(name) for name in
             ("copy_out:optimizer", "forward_begin", "offloaded", "reload_window", "grads_finalizing",
              "reload_start", "step_begin:optimizer", "step_done")]
    assert order == sorted(order), ev
    assert ev.count("copy_out:optimizer") == 1, ev
    stats = coord.streams.stats
    # Step 0's state went out in iteration 1; step 1's copy-out waits for the next forward.
    # Only the packed bytes move: the slot padding of the GPU buffers never crosses PCIe.
    assert stats.cumulative_d2h_bytes == coord.pinned_bytes < coord.gpu_bytes
    assert stats.cumulative_h2d_bytes == coord.pinned_bytes
    coord.start_pending_copy_out()
    assert stats.cumulative_d2h_bytes == 2 * coord.pinned_bytes


def test_skipped_step_reuses_host_copy_and_keeps_results():
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    for step in range(5):
        skip = step in (2, 3)
        one_iteration(ref, None, step, skip=skip)
        coord.start_pending_copy_out()  # the previous step's, normally enqueued by the forward
        d2h_before = coord.streams.stats.cumulative_d2h_bytes
        one_iteration(opt, coord, step, skip=skip)
        if skip:
            # Nothing changed: the host copy is current, no D2H needed to send it out again.
            assert coord.streams.stats.cumulative_d2h_bytes == d2h_before
            assert "skipped:optimizer" in coord.events
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert coord.phase is Phase.FREEING


def test_skipped_first_steps_before_state_exists():
    ref, opt = FakeDistOpt(fp32_numels=()), FakeDistOpt(fp32_numels=())
    coord = make_coord()
    coord.add_optimizer(opt)
    for step in range(4):
        one_iteration(ref, None, step, skip=step < 2)
        one_iteration(opt, coord, step, skip=step < 2)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))


def test_stub_optimizer_is_ignored():
    class Stub:
        optimizer = None
        is_stub_optimizer = True

    coord = make_coord()
    off = coord.add_optimizer(Stub())
    one_iteration(FakeDistOpt(), coord, 0)
    assert off.chunks == [] and coord.state_bytes == 0


def test_two_optimizers_share_streams_and_stay_exact():
    refs = [FakeDistOpt(seed=1), FakeDistOpt(seed=2)]
    opts = [FakeDistOpt(seed=1), FakeDistOpt(seed=2)]
    coord = make_coord()
    offs = [coord.add_optimizer(o, name=f"o{i}") for i, o in enumerate(opts)]
    assert offs[0].streams is offs[1].streams

    class Chain:
        def __init__(self, members):
            self.members = members

        def all_params(self):
            return [p for m in self.members for p in m.all_params()]

        def step(self):
            for m in self.members:
                m.step()

    for step in range(4):
        one_iteration(Chain(refs), None, step)
        one_iteration(Chain(opts), coord, step)
        for r, o in zip(refs, opts):
            assert_bitwise_equal(snapshot(r), snapshot(o))
    assert coord.bytes_in(ChunkState.RESIDENT) == coord.gpu_bytes  # copy-out due at next forward
    coord.start_pending_copy_out()
    assert coord.bytes_in(ChunkState.COPYING_OUT) == coord.gpu_bytes


def test_checkpoint_read_while_offloaded_sees_current_values_without_new_d2h():
    opt = FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    for step in range(2):
        one_iteration(opt, coord, step)
    expected = snapshot(opt)
    coord.forward_begin(True)
    coord.forward_end()  # everything freed, as in the middle of an iteration
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes
    d2h = coord.streams.stats.cumulative_d2h_bytes
    coord.before_state_access(off, will_modify=False)
    assert_bitwise_equal(expected, snapshot(opt))
    coord.after_state_access(off, modified=False)
    assert coord.streams.stats.cumulative_d2h_bytes == d2h
    assert coord.bytes_in(ChunkState.COPYING_OUT) == coord.gpu_bytes


def test_load_replacing_tensors_is_rediscovered():
    opt = FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    for step in range(2):
        one_iteration(opt, coord, step)
    coord.before_state_access(off, will_modify=True)
    # A load that replaces the state tensor objects (DistOpt / TE FusedAdam do this).
    new_values = {}
    for p in opt.all_params():
        st = opt.optimizer.state[p]
        st["exp_avg"] = torch.full_like(st["exp_avg"], 0.5)
        new_values[id(p)] = st["exp_avg"]
    coord.after_state_access(off, modified=True)
    found = {id(st.tensor) for st in off.discovery.tensors}
    assert all(id(t) in found for t in new_values.values())
    # The loaded values survive a full offload/reload cycle.
    coord.forward_begin(True)
    coord.forward_end()
    coord.grads_finalizing()
    with coord.state_access([off], will_modify=False):
        assert all(torch.all(t == 0.5) for t in new_values.values())


def test_view_master_is_packed_out_of_foreign_storage():
    opt = FakeDistOpt(fp32_numels=(), bf16_numels=(8, 8))
    big = torch.arange(32, dtype=torch.float32)
    neighbour = big[16:]
    master = opt.shard_fp32_from_float16_groups[0][0]
    master.data = big[:8]  # a view of a larger storage, as one fp8 path produces
    coord = make_coord()
    coord.add_optimizer(opt)
    coord.offload_existing_state()  # packs, sends out and frees the chunk holding the master
    assert storage_bytes(master) == 0
    assert master.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert torch.equal(neighbour, torch.arange(16, 32, dtype=torch.float32))  # untouched
    coord.grads_finalizing()
    with coord.state_access(coord.offloaders, will_modify=False):
        assert torch.equal(master, torch.arange(8, dtype=torch.float32))


def test_fp8_moment_is_refused():
    opt = FakeDistOpt(fp32_numels=(), bf16_numels=(8,))
    p = opt.all_params()[0]
    opt.optimizer.state[p]["exp_avg"] = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(UnsupportedOptimizerStateError, match="fp8"):
        find_state_tensors(opt, CPU)


def test_unknown_state_tensor_left_resident_and_reported():
    opt = FakeDistOpt(fp32_numels=(), bf16_numels=(8,))
    p = opt.all_params()[0]
    opt.optimizer.state[p]["mystery"] = torch.zeros(8)
    found = find_state_tensors(opt, CPU)
    assert found.resident_other == ["group0.param0.mystery"]
    assert all("mystery" not in st.name for st in found.tensors)


class SimulatedMemory:
    """An allocator model: base + activations + every state byte whose storage is allocated."""

    def __init__(self, opt, base=100_000):
        self.opt, self.base, self.act, self.max = opt, base, 0, 0

    def state_bytes(self):
        seen, total = set(), 0
        tensors = [t for g in self.opt.shard_fp32_from_float16_groups for t in g if t is not None]
        for st in self.opt.optimizer.state.values():
            tensors += [v for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"]
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += storage_bytes(t)
        return total

    def allocated(self):
        value = self.base + self.act + self.state_bytes()
        self.max = max(self.max, value)
        return value

    def max_allocated(self):
        return self.max


def simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes, microbatches=2, trace=None,
                        backward_layer=None, loss_transient=0, lasting_layer_bytes=0):
    """One training iteration on `mem`. `lasting_layer_bytes`: what each layer of the first
    iteration's first forward allocates for good (as Transformer Engine's FP8 weight copies)."""
    for mb in range(microbatches):
        if coord:
            coord.forward_begin(True)
        for h in range(LAYERS):
            if coord:
                coord.layer_forward_begin()
                if trace is not None and mb == 0:
                    trace.append(coord.bytes_in(ChunkState.COPYING_OUT, ChunkState.RESIDENT))
            mem.act += layer_bytes
            if step == 0 and mb == 0:
                mem.base += lasting_layer_bytes
            mem.allocated()
        mem.act += logits_bytes
        mem.allocated()
        # The loss's temporaries (e.g. the fp32 cross entropy over the logits), freed before
        # the forward step returns.
        mem.act += loss_transient
        mem.allocated()
        mem.act -= loss_transient
        if coord:
            coord.forward_end()
            coord.backward_begin()
        mem.act -= logits_bytes
        mem.allocated()
        for h in reversed(range(LAYERS)):
            if backward_layer is not None:
                backward_layer()  # the layer after h ran its backward (its temporaries are freed)
            if coord:
                coord.layer_backward_begin(h)  # the gradient of layer h's output is ready
            mem.act -= layer_bytes
            mem.allocated()
        if backward_layer is not None:
            backward_layer()  # layer 0 and the embedding ran their backward
        if coord:
            coord.backward_end()
    if coord:
        coord.grads_finalizing()
    make_grads(opt.all_params(), step)
    opt.step()
    mem.allocated()
    if coord:
        coord.optimizer_step_done()


def warmed_up_pair(layer_bytes, logits_bytes, margin, copies_running=False, offload_at_start=False, state_fraction=1.0,
                   coord_kw=None, **iteration_kw):
    """A reference optimizer and an offloaded one, each with its simulated memory, after the two
    iterations that measure the growth profile: (ref, opt, ref_mem, mem, coord). With
    `copies_running` every copy-out is still in flight when the forward frees (as on a GPU where
    the copy-out runs into the forward), so the budget paces the frees; else (CPU copies are
    synchronous) the copy-out is over by the first hook, which then frees it all.
    `offload_at_start`: the masters leave at start-up, as the Megatron wiring has them. `coord_kw`:
    more of the coordinator's keywords (`make_coordinator`)."""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    ref_mem, mem = SimulatedMemory(ref), SimulatedMemory(opt)
    coord = make_coord(margin_bytes=margin, memory_allocated=mem.allocated,
                       max_memory_allocated=mem.max_allocated, state_fraction=state_fraction, **(coord_kw or {}))
    coord.add_optimizer(opt)
    if offload_at_start:
        coord.offload_existing_state()
    if copies_running:
        coord.streams.record = lambda stream: _FinishedCopy(False)
    for step in range(2):
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes, **iteration_kw)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes, **iteration_kw)
    return ref, opt, ref_mem, mem, coord


def test_memory_budget_frees_late_and_takes_state_off_the_peak():
    layer_bytes, logits_bytes, margin = 40_000, 30_000, 1024
    ref, opt, ref_mem, mem, coord = warmed_up_pair(layer_bytes, logits_bytes, margin, copies_running=True)
    state = coord.state_bytes
    assert state > 0
    ref_mem.max = mem.max = 0
    for step in range(2, 5):
        trace = []
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes, trace=trace)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
        # Freed as late as the budget allows: all state still resident for the first layers ...
        assert trace[0] == coord.gpu_bytes and trace[1] == coord.gpu_bytes, trace
        # ... and all of it gone by the last layer, before the activation peak.
        assert trace[-1] == 0, trace
    act_peak = LAYERS * layer_bytes + logits_bytes
    assert ref_mem.max >= ref_mem.base + act_peak + state
    # The whole state is off the peak (the margin is the only slack allowed).
    assert mem.max <= ref_mem.max - state + margin, (mem.max, ref_mem.max, state)
    assert coord.profile_relearned == 0


LASTING_LAYER, LASTING_LOGITS, LASTING_MARGIN = 40_000, 30_000, 1024
LASTING_KW = dict(loss_transient=10_000)  # (a peak after the last hook: P is more than the sampled growth)


def lasting_memory_run(lasting, margin=LASTING_MARGIN, fraction=1.0, **coord_kw):
    """Three iterations after the two that measure the profile, on a run whose first forward
    keeps `lasting` bytes per layer for good (`simulated_iteration`'s lasting_layer_bytes), the
    state off at start-up and every copy-out running into the forward: (coordinator, the resident
    state bytes at each hook per iteration). Checks that the state stays bit-exact and off the
    peak (within the configured `margin`) and that the base leaves out state buffers."""
    ref, opt, ref_mem, mem, coord = warmed_up_pair(LASTING_LAYER, LASTING_LOGITS, margin, copies_running=True,
                                                   offload_at_start=True, state_fraction=fraction, coord_kw=coord_kw,
                                                   lasting_layer_bytes=lasting, **LASTING_KW)
    ref_mem.max = mem.max = 0
    traces = []
    for step in range(2, 5):
        traces.append([])
        simulated_iteration(ref, None, ref_mem, step, LASTING_LAYER, LASTING_LOGITS, **LASTING_KW)
        simulated_iteration(opt, coord, mem, step, LASTING_LAYER, LASTING_LOGITS, trace=traces[-1], **LASTING_KW)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert mem.max <= ref_mem.max - coord.state_bytes + margin, (mem.max, ref_mem.max - coord.state_bytes)
    assert coord._base_bytes() == mem.base  # (between iterations: no activations)
    return coord, traces


def test_memory_kept_for_good_by_the_first_forward_does_not_count_as_activation_growth():
    """Transformer Engine's FP8 layers allocate their weight copies in the first iteration's
    first forward and keep them. That iteration's sample (the first, before any state exists)
    counts them as growth; P and the profile would then let as many state bytes stay through
    every later first forward's peak. The next first forward sees the lasting growth, lowers P
    by it and learns the profile again; from then on the frees are paced as without the lasting
    memory and the state is off the peak. (Here without the margin that memory adds to the budget:
    the next test.)"""
    margin = LASTING_MARGIN

    def run(lasting, fraction=1.0):
        return lasting_memory_run(lasting, fraction=fraction, lasting_growth_margin=False)

    lasting = 20_000  # per layer: LAYERS x 20000 bytes, several chunks
    coord, traces = run(lasting)
    assert LAYERS * lasting > 2 * coord.offloaders[0].chunks[0].gpu_nbytes + margin
    assert coord.profile_relearned == 1 and coord.profile_relearned_bytes == LAYERS * lasting
    plain, plain_traces = run(0)
    assert plain.profile_relearned == 0
    assert coord.peak_growth == plain.peak_growth  # (lowered by exactly what stayed)
    assert traces == plain_traces and plain_traces[0][0] == plain.gpu_bytes and plain_traces[0][-1] == 0, traces
    # With a fraction, the base leaves out the kept chunks' buffers (`run` checks it against the
    # simulated memory); the lasting growth is still seen, once.
    half, _ = run(lasting, fraction=0.5)
    assert half.profile_relearned == 1 and half.profile_relearned_bytes == LAYERS * lasting
    assert sum(off.kept_bytes for off in half.offloaders) > 2 * margin


def test_memory_kept_for_good_is_kept_free_below_the_peak_too():
    """The lasting memory (TE's FP8 weight copies) lies among the first forward's activations; the
    frees paced to the total leave room in pieces between it, and activations that fit none map
    new memory (reserved grows, allocated does not). So the budget's margin is at least the
    lasting bytes: the frees are exactly those of a run without lasting memory whose margin is
    that large, earlier than with the configured margin alone, and the state is still off the peak."""
    margin, lasting = LASTING_MARGIN, 5_000
    run = lasting_memory_run

    coord, traces = run(lasting, margin)
    kept = coord.kept_for_good_bytes
    assert coord.profile_relearned == 1 and kept == coord.profile_relearned_bytes == LAYERS * lasting > 2 * margin
    assert coord._margin() == kept
    wide, wide_traces = run(0, kept)  # no lasting memory, the same margin configured
    assert wide.profile_relearned == 0 and wide._margin() == kept
    assert traces == wide_traces, (traces, wide_traces)
    rule_off, off_traces = run(lasting, margin, lasting_growth_margin=False)
    assert rule_off._margin() == margin
    # Earlier: at some hook less state is still resident, and at none more.
    assert all(a <= b for t, u in zip(traces, off_traces) for a, b in zip(t, u)), (traces, off_traces)
    assert traces != off_traces, traces


def test_the_lasting_margin_follows_the_memory_still_kept():
    """Memory kept across iterations and freed again later (a buffer that lived for a while)
    stops counting: the margin is the memory above the first sample's base now, not the sum of
    every growth the rule saw. Without the rule (`forget_lasting_growth` off) it is measured all
    the same."""
    coord, _ = lasting_memory_run(5_000)
    kept = coord.kept_for_good_bytes
    assert kept == LAYERS * 5_000 and coord._margin() == kept
    reader = coord._allocated
    # (between iterations; each line moves the memory other than state by `extra` from the line before)
    shift = 0
    for extra, expected in ((3 * kept, 4 * kept), (-3 * kept, kept), (-kept, LASTING_MARGIN)):
        shift += extra
        coord._allocated = lambda shift=shift: reader() + shift
        coord._forget_lasting_growth(sampling=True)  # (what each iteration's first forward_begin calls)
        assert coord._margin() == expected, (extra, coord._margin())
    plain, _ = lasting_memory_run(5_000, forget_lasting_growth=False)
    assert plain.profile_relearned == 0 and plain._margin() == LAYERS * 5_000


def test_memory_kept_for_good_counts_once_where_no_forward_samples_after_it():
    """A rank whose state stays on the GPU (a fraction below its first tensor: no chunk, so no
    first forward samples after the first) still sees the first iteration's lasting memory: the
    growth is taken as seen when the rule fires, and never counted again."""
    opt = FakeDistOpt()
    mem = SimulatedMemory(opt)
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                       state_fraction=1e-6)
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(5):
        simulated_iteration(opt, coord, mem, step, 40_000, 30_000, lasting_layer_bytes=20_000)
    assert not coord._chunks(*ChunkState) and coord.peak_growth is not None
    assert coord.profile_relearned == 1 and coord.profile_relearned_bytes == LAYERS * 20_000

def test_a_peak_between_the_last_layer_and_the_forward_end_finds_the_state_off():
    """The functional model on 2 x H200: after the last pacing hook (the output layer) the loss
    allocates its fp32 temporaries and frees them before the forward ends. The growth sampled at
    the forward's end misses that transient; a budget taken from it kept 0.18 GiB of state
    resident through the iteration's peak (allocated 3.38 GiB against 3.20 possible)."""
    layer_bytes, logits_bytes, transient, margin = 40_000, 30_000, 50_000, 1024
    ref, opt, ref_mem, mem, coord = warmed_up_pair(layer_bytes, logits_bytes, margin, copies_running=True,
                                                   loss_transient=transient)
    state = coord.state_bytes
    assert transient - margin > coord.offloaders[0].chunks[0].gpu_nbytes  # room for a chunk to stay
    ref_mem.max = mem.max = 0
    for step in range(2, 4):
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes, loss_transient=transient)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes, loss_transient=transient)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert mem.max <= ref_mem.max - state + margin, (mem.max, ref_mem.max - state, state)


def test_full_recompute_forwards_without_autograd_still_free_at_the_layer_hooks():
    """--recompute-granularity full runs every checkpointed layer's forward under no_grad: the
    first forward must still free the state at its first layer (no profile yet), not at its end."""
    opt = FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    seen = []
    coord.forward_begin(True)
    with torch.no_grad():
        for _ in range(LAYERS):
            coord.layer_forward_begin()
            seen.append(coord.bytes_in(ChunkState.OFFLOADED))
    coord.forward_end()
    assert seen[0] == coord.gpu_bytes > 0, seen
    coord.close()


def test_watch_models_hooks_report_each_layer_to_the_public_driver():
    """The hooks `watch_model` installs call `layer_forward_begin` before each layer's forward and
    `layer_backward_begin(h)` when the gradient of layer h's output is ready (last layer first)."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    coord = make_coord()
    coord.add_optimizer(FakeDistOpt())
    coord.offload_existing_state()
    model = Model()
    assert coord.watch_model([model]) == 3
    calls = []
    forward, backward = coord.layer_forward_begin, coord.layer_backward_begin
    coord.layer_forward_begin = lambda: (calls.append("F"), forward())[1]
    coord.layer_backward_begin = lambda position=None: (calls.append(position), backward(position))[1]
    coord.forward_begin(True)
    loss = model(torch.ones(2, 4)).sum()
    coord.forward_end()
    coord.backward_begin()
    loss.backward()
    assert calls == ["F", "F", "F", 2, 1, 0]
    coord.close()


def test_startup_state_is_freed_before_the_first_forward_and_training_stays_exact():
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    off = coord.offloaders[0]
    live = []  # state bytes with storage on the device at each chunk's packing
    # Private on purpose: the start-up transient exists only between two chunks' packing inside
    # one refresh(), a moment no public call marks.
    original_pack = off._pack

    def pack(chunk):
        storages = {}
        for st in off.discovery.tensors:
            if not st.tensor.is_meta:
                storages[st.tensor.untyped_storage().data_ptr()] = st.tensor.untyped_storage().nbytes()
        masters = sum(t.numel() * t.element_size() for g in opt.shard_fp32_from_float16_groups for t in g)
        live.append(sum(storages.values()) - masters)  # above what the model built anyway
        original_pack(chunk)

    off._pack = pack
    coord.offload_existing_state()
    # Chunk by chunk: every chunk was sent out and freed before the next was packed, and the
    # moments' zeros never existed outside their chunk (at most one chunk above the masters).
    assert len(live) == len(off.chunks) > 2
    assert max(live) <= off.chunks[0].gpu_nbytes, (live, off.chunks[0].gpu_nbytes)
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes > 0
    assert coord.phase is Phase.OFFLOADED
    assert coord.release_startup_state() == 0
    for step in range(3):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    coord.close()


def test_reload_starts_in_last_backward_within_budget():
    layer_bytes, logits_bytes = 40_000, 30_000
    opt = FakeDistOpt()
    mem = SimulatedMemory(opt)
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated,
                       max_memory_allocated=mem.max_allocated)
    coord.add_optimizer(opt)
    for step in range(2):
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
    coord.events.clear()
    simulated_iteration(opt, coord, mem, 2, layer_bytes, logits_bytes)
    ev = coord.events
    order = [ev.index(name) for name in
             ("copy_out:optimizer", "forward_begin", "offloaded", "reload_window", "reload_start",
              "grads_finalizing", "step_begin:optimizer", "step_done")]
    assert order == sorted(order), ev
    # Nothing reloaded during the first microbatch's backward (another forward follows it).
    assert ev.index("reload_window") > ev.index("forward_begin")


def test_each_iterations_first_reload_and_the_position_rules_deferrals_are_recorded():
    """`reload_starts` holds, per iteration, the backward position passed to the hook whose reload
    enqueued the iteration's first chunk (the benchmark reads how far into the last backward the
    reload began), and `reloads_deferred_for_position` the offloaded chunks each reload call left
    out because the backward had not yet passed the hook they were freed before."""
    layer_bytes, logits_bytes = 40_000, 30_000
    opt = FakeDistOpt()
    mem = SimulatedMemory(opt)
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated)
    coord.add_optimizer(opt)
    seen, held_back, at_hook = [], [0], [None]
    trace, reload_up_to = coord._trace, coord._reload_up_to

    def traced(what):
        if what == "reload_start":
            seen.append((coord._iterations_done, at_hook[0]))
        trace(what)

    def counted(ceiling, position=None):
        at_hook[0] = -1 if position is None else position
        if position is not None:
            held_back[0] += sum(1 for _, c in coord._chunks(ChunkState.OFFLOADED)
                                if not (coord.it.freed_at.get(id(c)) is None or coord.it.freed_at[id(c)] > position))
        return reload_up_to(ceiling, position=position)

    coord._trace, coord._reload_up_to = traced, counted
    for step in range(4):
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
    # (No state before the first step: iterations 1-3 reload, in their last backward.)
    assert list(coord.reload_starts) == seen and [i for i, _ in seen] == [1, 2, 3], (list(coord.reload_starts), seen)
    assert all(0 <= p < LAYERS for _, p in seen), seen
    assert coord.reloads_deferred_for_position == held_back[0] > 0
    # Where no free block takes a chunk in the backward, the fallback reloads everything: -1.
    opt = FakeDistOpt()
    mem = SimulatedMemory(opt)
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                       free_block_sizes=lambda: [])
    coord.add_optimizer(opt)
    for step in range(3):
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
    assert list(coord.reload_starts) == [(1, -1), (2, -1)]


def test_startup_transient_in_high_water_mark_does_not_inflate_the_budget():
    """A start-up transient above the training peak (e.g. packing) leaves the allocator's
    high-water mark useless for measuring P; the budget must then come from sampled growth,
    and the state must still be off the activation peak."""
    layer_bytes, logits_bytes, margin = 40_000, 30_000, 1024
    ref, opt = FakeDistOpt(), FakeDistOpt()
    ref_mem, mem = SimulatedMemory(ref), SimulatedMemory(opt)
    mem.max = 10**9  # transient far above anything training will reach
    coord = make_coord(margin_bytes=margin, memory_allocated=mem.allocated,
                       max_memory_allocated=mem.max_allocated)
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(2):
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
    assert coord.peak_growth < 10**6
    peaks = []
    for step in range(2, 4):
        mem.max = 0
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
        peaks.append(mem.max)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    act_peak = LAYERS * layer_bytes + logits_bytes
    assert max(peaks) <= mem.base + act_peak + margin, (peaks, mem.base + act_peak)


def test_pipeline_schedule_opens_the_reload_window_only_after_the_last_forward():
    """1F1B-like order (two warm-up forwards, then F/B pairs, then cool-down backwards): no
    reload may start before the last forward, or that forward would need the memory again."""
    opt = FakeDistOpt()
    coord = make_coord(expected_forwards_per_iteration=lambda: 4, memory_allocated=lambda: 0)
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    order = ["F", "F", "B", "F", "B", "F", "B", "B"]
    for step in range(3):
        for i, phase in enumerate(order):
            if phase == "F":
                coord.forward_begin(True)
                coord.layer_forward_begin()
                coord.forward_end()
            else:
                coord.backward_begin()
                remaining_forwards = order[i + 1:].count("F")
                assert (coord.it.state is IterationState.RELOAD_WINDOW) == (remaining_forwards == 0), (step, i)
                if remaining_forwards:
                    assert coord.bytes_in(ChunkState.COPYING_IN) == 0
        coord.grads_finalizing()
        make_grads(opt.all_params(), step)
        opt.step()
        coord.optimizer_step_done()


def test_evaluation_forwards_do_not_count_as_microbatches():
    opt = FakeDistOpt()
    coord = make_coord(expected_forwards_per_iteration=lambda: 1)
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    coord.forward_begin(False)  # evaluation between steps frees, but is no microbatch
    coord.forward_end()
    assert coord.it.forwards == 0
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes
    one_iteration(opt, coord, 0, microbatches=1)
    assert coord.phase is Phase.FREEING


def test_a_save_reads_offloaded_state_from_the_host_and_a_load_brings_it_back():
    """A save (sharded_state_dict, not loading) sees what is off the GPU on the host: nothing is
    reloaded, the values are the state's, and they stay readable after the call returns (the
    checkpoint is written afterwards); the next reload points the tensors back at the GPU. A load
    template counts as a write: the state comes back and what is loaded is sent out again."""
    from megatron_offload.megatron_state_methods import wrap_state_access

    opt = FakeDistOpt()
    saved = {}

    def sharded_state_dict(model_sharded_state_dict, is_loading=False):
        if not is_loading:
            saved.update(snapshot(opt))
        return {"state": {i: dict(s) for i, s in enumerate(opt.optimizer.state.values())}}

    def load_state_dict(state_dict):
        for p in opt.all_params():  # a load that replaces the tensors, as DistOpt / TE do
            opt.optimizer.state[p]["exp_avg"] = torch.full_like(opt.optimizer.state[p]["exp_avg"], 0.25)

    opt.sharded_state_dict = sharded_state_dict
    opt.load_state_dict = load_state_dict
    coord = make_coord()
    off = coord.add_optimizer(opt)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    one_iteration(opt, coord, 0)
    expected = snapshot(opt)  # resident right after the step
    coord.forward_begin(True)
    coord.forward_end()  # everything off the GPU, as between two microbatches
    opt.sharded_state_dict({}, False)  # a save
    assert_bitwise_equal(saved, expected)
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes  # nothing came back
    assert all(c.on_host and storage_bytes(c.buffer) == 0 for c in off.chunks)
    assert_bitwise_equal(snapshot(opt), expected)  # still readable after the call
    opt.sharded_state_dict({}, is_loading=True)  # a load template: counts as a write
    assert not any(c.on_host for c in off.chunks)
    assert all(storage_bytes(st.tensor) == storage_bytes(c.buffer) > 0 for c in off.chunks for st in c.tensors)
    opt.load_state_dict({})
    replaced = [opt.optimizer.state[p]["exp_avg"] for p in opt.all_params()]
    assert {id(t) for t in replaced} <= {id(st.tensor) for st in off.discovery.tensors}
    coord.forward_end()
    assert all(storage_bytes(t) == 0 for t in replaced)  # the loaded tensors are offloaded too
    coord.grads_finalizing()
    with coord.state_access([off], will_modify=False):
        assert all(torch.all(t == 0.25) for t in replaced)


@pytest.mark.parametrize("copies_running", [True, False])
def test_reload_waits_until_the_backward_released_what_reused_the_chunk(copies_running):
    """A chunk freed before layer h may hold activations of layers h, h+1, ...: reloading it
    before their backward finished makes the caching allocator grow a new segment. Every reload
    in the backward must come after the layers that ran after its free (with the copy-out over
    before the forward, all are freed at its first hook: after the hook whose budget would have)."""
    layer_bytes, logits_bytes = 40_000, 30_000
    ref, opt = FakeDistOpt(), FakeDistOpt()
    ref_mem, mem = SimulatedMemory(ref), SimulatedMemory(opt)
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated,
                       max_memory_allocated=mem.max_allocated)
    coord.add_optimizer(opt)
    if copies_running:
        coord.streams.record = lambda stream: _FinishedCopy(False)
    reloads = []  # (position the backward has reached, position before which the chunk was freed)

    def recording(report, position_now):
        def recorded(*args):
            before = {id(c) for off in coord.offloaders for c in off.chunks_in(ChunkState.OFFLOADED)}
            report(*args)
            after = {id(c) for off in coord.offloaders for c in off.chunks_in(ChunkState.OFFLOADED)}
            reloads.extend((position_now(*args), coord.it.freed_at.get(cid)) for cid in before - after)
        return recorded

    coord.backward_begin = recording(coord.backward_begin, lambda: coord.it.position)
    coord.layer_backward_begin = recording(coord.layer_backward_begin, lambda position=None: position)
    for step in range(5):
        reloads.clear()
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    in_backward = reloads  # (grads_finalizing's reloads, of whatever is left, are not recorded)
    assert in_backward, reloads  # the window reloads some chunks early ...
    assert all(h is not None and h > p for p, h in in_backward), reloads  # ... never too early
    # Latest-freed chunks return first.
    assert [h for _, h in in_backward] == sorted((h for _, h in in_backward), reverse=True), reloads


@pytest.mark.parametrize("fits", [True, False])
def test_reload_in_the_backward_only_into_a_free_block_that_fits(fits):
    """Free bytes are not enough: without a single free block of the chunk's size the caching
    allocator would add a segment, so the reload waits (finally for grads_finalizing)."""
    layer_bytes, logits_bytes = 40_000, 30_000
    ref, opt = FakeDistOpt(), FakeDistOpt()
    ref_mem, mem = SimulatedMemory(ref), SimulatedMemory(opt)
    blocks = []
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated,
                       max_memory_allocated=mem.max_allocated, free_block_sizes=lambda: list(blocks))
    coord.add_optimizer(opt)
    for step in range(4):
        largest = max(c.gpu_nbytes for c in coord.offloaders[0].chunks) if coord.offloaders[0].chunks else 0
        blocks[:] = [10 * largest] if fits else []  # no single free block at all
        coord.events.clear()
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    ev = coord.events
    assert coord.fit_checks > 0
    if fits:
        assert ev.index("reload_start") < ev.index("grads_finalizing"), ev
        assert coord.reloads_deferred_for_fit == 0
    else:
        assert ev.index("reload_start") > ev.index("grads_finalizing"), ev
        assert coord.reloads_deferred_for_fit > 0


@pytest.mark.parametrize("every", [False, True, None], ids=["first-iterations", "every-iteration", "default"])
@pytest.mark.parametrize("switch", [True, False], ids=["release", "no-release"])
@pytest.mark.parametrize("fits", ["all", "all-but-one", "none"])
def test_fallback_reload_hands_back_free_blocks_too_small_for_it(fits, switch, every):
    """grads_finalizing's reload of the chunks still off, in an iteration whose first forward found
    every chunk off (after the start-up offload; after an evaluation): when they fit no set of free
    blocks (best-fit, in reload order), the cached memory goes back to the device first, so that
    they are not mapped above blocks that are free but too small. When they all fit, and in
    iterations that began with the chunks on the GPU, nothing is released (with the diagnostic
    `fallback_release_every_iteration`, those iterations release too where nothing fits)."""
    layer_bytes, logits_bytes = 40_000, 30_000
    ref, opt = FakeDistOpt(), FakeDistOpt()
    ref_mem, mem = SimulatedMemory(ref), SimulatedMemory(opt)
    blocks, released = [], []
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                       # (no room inside the backward: every chunk is left to the fallback)
                       free_block_sizes=lambda: list(blocks) if "grads_finalizing" in coord.events else [],
                       release_before_unfitted_reload=switch,
                       **({} if every is None else {"fallback_release_every_iteration": every}),
                       empty_cache=lambda: released.append(coord.it.forwards))
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    coord.release_startup_state()
    released.clear()
    releasing = fits != "all" and switch
    releasing_steps = (0, 1, 2, 3) if every else (0, 2)  # (the default: the first iterations only)
    for step in range(4):
        sizes = [c.gpu_nbytes for c in coord.offloaders[0].chunks]
        # One free block per chunk, exactly its size (512-byte rounding included), less the largest's
        # when one must not fit; never room for two in one block.
        blocks[:] = {"all": [(n + 511) // 512 * 512 for n in sizes],
                     "all-but-one": sorted((n + 511) // 512 * 512 for n in sizes)[:-1],
                     "none": []}[fits]
        if step == 2:  # an evaluation in between frees every chunk again
            coord.forward_begin(False)
            coord.forward_end()
        coord.events.clear()
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
        ev = coord.events
        if releasing and step in releasing_steps:
            # Before the fallback's reload, after the backward.
            assert ev.index("grads_finalizing") < ev.index("release:fallback") < ev.index("reload_start"), ev
        else:
            assert "release:fallback" not in ev, ev
    assert len(released) == (len(releasing_steps) if releasing else 0), released
    coord.close()


@pytest.mark.parametrize("cached", ["none", "one-chunk", "plenty"])
def test_fallback_release_reads_the_counters_before_the_snapshot(cached):
    """The allocator's counters (reserved minus allocated) decide first: less cached than one chunk,
    nothing to hand back (no snapshot, no release); less than all chunks, release without a
    snapshot; otherwise the snapshot's blocks decide (here: none fits)."""
    layer_bytes, logits_bytes = 40_000, 30_000
    opt = FakeDistOpt()
    mem = SimulatedMemory(opt)
    snapshots, released, mapped = [0], [], [0]

    def blocks():
        if "grads_finalizing" not in coord.events:
            return []
        snapshots[0] += 1
        return []

    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                       free_block_sizes=blocks, free_mapped=lambda: mapped[0],
                       empty_cache=lambda: released.append(1))
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    coord.release_startup_state()
    released.clear()
    sizes = [(c.gpu_nbytes + 511) // 512 * 512 for c in coord.offloaders[0].chunks]
    mapped[0] = {"none": min(sizes) - 1, "one-chunk": sum(sizes) - 1, "plenty": 10 * sum(sizes)}[cached]
    coord.events.clear()
    simulated_iteration(opt, coord, mem, 0, layer_bytes, logits_bytes)
    assert released == ([] if cached == "none" else [1])
    assert snapshots[0] == (1 if cached == "plenty" else 0)
    coord.close()


def _workspace_pair(microbatches, blocks, temporaries, **config):
    """A reference optimizer and an offloaded one with simulated memory, for the workspace tests:
    the allocator's free blocks are `blocks`, its cumulative counter `temporaries[0]` plus the
    chunks on the GPU. (ref, opt, ref_mem, mem, coord)"""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    ref_mem, mem = SimulatedMemory(ref), SimulatedMemory(opt)
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                       free_block_sizes=lambda: list(blocks), expected_forwards_per_iteration=lambda: microbatches,
                       # Chunks only come back within a backward, so within one this counts them as
                       # the allocator's cumulative counter would.
                       allocated_total=lambda: temporaries[0] + coord.bytes_in(
                           ChunkState.RESIDENT, ChunkState.COPYING_IN, ChunkState.COPYING_OUT),
                       **config)
    coord.add_optimizer(opt)
    return ref, opt, ref_mem, mem, coord


@pytest.mark.parametrize("by_position", [True, False], ids=["by-position", "wsmax"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_reloads_leave_room_for_the_intervals_still_to_come_not_the_output_layers(by_position, microbatches):
    """The first backward interval (loss and output layer) allocates four times a layer's backward.
    A free block that holds a chunk and a layer's workspace, but not a chunk and the output
    layer's, takes reloads inside the backward once it is past the output layer: each interval is
    measured under the position of the hook that began it, and a reload at hook p leaves room for
    the largest of those still to come (0..p). With `workspace_by_position=False` (the
    benchmark's @wsmax) every reload must leave the largest of all: none fits until the fallback."""
    layer_bytes, logits_bytes, workspace = 40_000, 30_000, 3 * 4096
    blocks, temporaries, calls = [], [0], [0]
    ref, opt, ref_mem, mem, coord = _workspace_pair(microbatches, blocks, temporaries, workspace_by_position=by_position)

    def interval_temporaries():  # LAYERS + 1 intervals per backward, the output layer's first
        temporaries[0] += 4 * workspace if calls[0] % (LAYERS + 1) == 0 else workspace
        calls[0] += 1

    for step in range(4):
        slot = max((c.gpu_nbytes for c in coord.offloaders[0].chunks), default=0)
        blocks[:] = [slot + 2 * workspace]
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes, microbatches=microbatches)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes, microbatches=microbatches,
                            backward_layer=interval_temporaries)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert coord.backward_workspace == 4 * workspace
    assert coord.workspace_per_interval == {LAYERS: 4 * workspace, **{k: workspace for k in range(LAYERS)}}
    assert coord._workspace_for(LAYERS) == 4 * workspace and coord._workspace_for(None) == 4 * workspace
    assert coord._workspace_for(LAYERS - 1) == (workspace if by_position else 4 * workspace)
    # Iterations 2 and 3 (the first measured a whole backward before the window's reloads; with one
    # microbatch its window was that backward): inside the backward by position, at the fallback without.
    starts = [where for done, where in coord.reload_starts if done >= 2]
    assert len(starts) == 2, list(coord.reload_starts)
    assert all(0 <= where < LAYERS for where in starts) if by_position else starts == [-1, -1], starts
    # Several model chunks share the positions (one chunk's intervals were measured): the largest.
    before = coord.model_chunks
    coord.watch_model([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    assert coord.model_chunks == before + 2 and coord._workspace_for(LAYERS - 1) == 4 * workspace
    coord.model_chunks = before
    # An interval begun at a hook of unknown position (inside a recomputation) is measured under
    # None, and from then on every reload leaves the largest of all.
    coord.it.workspace_mark = coord._allocated_total() - coord._own_allocations
    coord.it.workspace_key = None
    temporaries[0] += workspace
    coord._sample_workspace(0)
    assert coord.workspace_per_interval[None] == workspace
    assert coord._workspace_for(LAYERS - 1) == 4 * workspace
    coord.close()


@pytest.mark.parametrize("keep", [True, False], ids=["workspace", "no-workspace-rule"])
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("room", [True, False])
def test_reloads_leave_the_next_layers_backward_its_workspace(room, microbatches, keep):
    """What one layer's backward allocates (measured in the first backward, from the allocator's
    cumulative counter, less the reloads' own chunks) must stay free in blocks it can use after a
    reload's placement; otherwise the next layer's temporaries get new memory (R1: the reserved
    peak of most iterations). With one microbatch the first backward is the reload window.
    `keep_backward_workspace=False` (the benchmark's `@nows`) is the rule before: one chunk that
    fits a free block reloads in the window even if it leaves no workspace."""
    layer_bytes, logits_bytes = 40_000, 30_000
    blocks, temporaries = [], [0]
    ref, opt, ref_mem, mem, coord = _workspace_pair(microbatches, blocks, temporaries, keep_backward_workspace=keep)
    workspace = 3 * 4096

    def layer_temporaries():
        temporaries[0] += workspace

    for step in range(4):
        slot = max((c.gpu_nbytes for c in coord.offloaders[0].chunks), default=0)
        # One block: with room, it holds every chunk and the workspace; without, one chunk and half of it.
        blocks[:] = [10 * slot + 2 * workspace] if room else [slot + workspace // 2]
        coord.events.clear()
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes, microbatches=microbatches)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes, microbatches=microbatches,
                            backward_layer=layer_temporaries)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    assert coord.backward_workspace == (workspace if keep else 0)
    ev = coord.events
    if room or not keep:
        assert ev.index("reload_start") < ev.index("grads_finalizing"), ev
        assert coord.reloads_deferred_for_fit == 0 or not keep
    else:
        assert ev.index("reload_start") > ev.index("grads_finalizing"), ev
        assert coord.reloads_deferred_for_fit > 0


def test_large_slots_tile_the_activations_that_fill_their_holes():
    from megatron_offload.chunks import slot_bytes

    MiB = 2**20
    # R1: 15 chunks of ~487 MiB packed; their 498 MiB holes could not take the 500 MiB logits.
    assert slot_bytes(497 * MiB + 12345) == 512 * MiB
    assert slot_bytes(512 * MiB) == 512 * MiB
    assert slot_bytes(528 * MiB) == 576 * MiB
    # From 128 MiB, a slot just short of a granule takes it (256 MiB activations fill it exactly).
    assert slot_bytes(250 * MiB) == 256 * MiB
    assert slot_bytes(130 * MiB) == 130 * MiB
    assert slot_bytes(126 * MiB) == 126 * MiB
    # Smaller slots keep the allocator's own granularity.
    assert slot_bytes(27 * MiB + 1) == 28 * MiB
    assert slot_bytes(5000) == 5120


def r1_shaped_state():
    """State tensors (size and owner only) shaped like R1's model on one rank (no position embedding
    or final norm): the word embedding (32000 x 2048), then 24 layers' weights and biases, each a
    master and two moments in fp32."""
    from types import SimpleNamespace

    numels = [32000 * 2048]
    for _ in range(24):
        numels += [2048 * 6144, 6144, 2048 * 2048, 2048, 2048, 2048, 8192 * 2048, 8192, 2048 * 8192, 2048, 2048, 2048]
    tensors = []
    for numel in numels:
        owner = object()
        tensors += [SimpleNamespace(nbytes=4 * numel, param=owner, name=f"{name}") for name in ("master", "exp_avg",
                                                                                              "exp_avg_sq")]
    return tensors


@pytest.mark.parametrize("chunk_mib, chunks, slot_mib", [(256, 57, 256), (512, 29, 512), (128, 61, 256)])
def test_layout_keeps_slots_at_the_size_asked_for_by_splitting_large_parameter_states(chunk_mib, chunks, slot_mib):
    """Whole parameters as units, the embedding's 750 MiB of state would set every slot to 768 MiB at any
    chunk size below it; split (here into single tensors, the fewest GPU bytes), the slots are the size
    asked for, or the largest tensor's (250 MiB, rounded to 256) where that is larger; the state is
    padded by at most 2 %."""
    from megatron_offload.chunks import _units, layout_chunks, slot_bytes

    MiB = 2**20
    tensors = r1_shaped_state()
    state = sum(t.nbytes for t in tensors)
    layouts = layout_chunks(_units(tensors, True), chunk_mib * MiB)
    slot = slot_bytes(max(nbytes for _, _, nbytes in layouts))
    assert (len(layouts), slot) == (chunks, slot_mib * MiB), (len(layouts), slot / MiB)
    assert sorted(id(t) for lay in layouts for t in lay[0]) == sorted(id(t) for t in tensors)
    if chunk_mib >= 256:
        assert len(layouts) * slot <= 1.02 * state, len(layouts) * slot / state
    homes = {}
    for k, (packed, _, _) in enumerate(layouts):
        for t in packed:
            homes.setdefault(id(t.param), set()).add(k)
    assert any(len(h) > 1 for h in homes.values())  # some parameter's state is split


def small_state(numels):
    from types import SimpleNamespace

    tensors = []
    for numel in numels:
        owner = object()
        tensors += [SimpleNamespace(nbytes=4 * numel, param=owner, name=name) for name in ("master", "exp_avg",
                                                                                          "exp_avg_sq")]
    return tensors


@pytest.mark.parametrize("case", ["r1-at-1-gib", "split-saves-2.8-percent"])
def test_layout_keeps_parameters_whole_where_splitting_saves_little(case):
    """At 1 GiB every parameter's state of R1's shape (750 MiB at most) fits a chunk, and whole
    parameters pad it no more than single tensors do; in the small state, single tensors would
    take 140 KiB of buffers against 144 KiB, within 3 %: nothing is split (a split parameter holds
    chunks in the step)."""
    from megatron_offload.chunks import _units, layout_chunks, slot_bytes

    if case == "r1-at-1-gib":
        tensors, chunk_bytes = r1_shaped_state(), 2**30
    else:
        tensors, chunk_bytes = small_state([256, 1536, 1024, 2048, 512, 256, 1024, 2048, 1024, 1536]), 32768
    layouts = layout_chunks(_units(tensors, True), chunk_bytes)
    homes = {}
    for k, (packed, _, _) in enumerate(layouts):
        for t in packed:
            homes.setdefault(id(t.param), set()).add(k)
    assert all(len(h) == 1 for h in homes.values())
    if case != "r1-at-1-gib":
        assert len(layouts) * slot_bytes(max(nbytes for _, _, nbytes in layouts)) == 144 * 1024


@pytest.mark.parametrize("config", ["fp32-master", "int16-remainders-bf16-moments", "fp16-moments", "fp16-master"])
def test_te_state_is_created_by_te_chunk_by_chunk_before_the_first_step(config, monkeypatch):
    """TE FusedAdam creates every state tensor of every parameter (masters too) in its first
    step: the whole state at once, among that iteration's activations. The offloader creates it
    before the first forward instead, with TE's own `initialize_state`, one chunk's parameters at a
    time, and training is bit-identical to TE's lazy creation."""
    kw = dict(numels=(300, 1000, 4096, 512, 2048, 700), **{
        "fp32-master": {}, "int16-remainders-bf16-moments": dict(store_param_remainders=True, moment_dtype=torch.bfloat16),
        "fp16-moments": dict(moment_dtype=torch.float16), "fp16-master": dict(master_weight_dtype=torch.float16)}[config])
    ref, opt = FakePrecisionAwareDistOpt(**kw), FakePrecisionAwareDistOpt(**kw)
    coord = make_coord(chunk_bytes=8192)
    off = coord.add_optimizer(opt)
    live, initialize = [], opt.optimizer.initialize_state

    def watched(param, store_param_remainders):
        initialize(param, store_param_remainders)
        live.append(sum(t.numel() * t.element_size() for s in opt.optimizer.state.values()
                        for t in s.values() if isinstance(t, torch.Tensor) and not t.is_meta
                        and t.untyped_storage().nbytes() > 0))
    monkeypatch.setattr(opt.optimizer, "initialize_state", watched)
    coord.offload_existing_state()
    assert len(live) == len(opt.all_params())  # each parameter initialized once, by TE
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes  # all of it sent out
    # Never the whole state at once: at most the chunk being packed and one parameter's state.
    largest = max(sum(st.nbytes for c in off.chunks for st in c.tensors if st.param is p) for p in opt.all_params())
    assert max(live) <= off.chunks[0].gpu_nbytes + largest < off.state_bytes, (live, largest)
    assert all(k in opt.optimizer.state[p] for p in opt.all_params() for k in ("exp_avg", "master_param"))
    for step in range(4):
        for o, c in ((ref, None), (opt, coord)):
            if c is not None:
                c.forward_begin(True)
                c.forward_end()
                c.grads_finalizing()
            make_grads(o.all_params(), step)
            o.step()
            if c is not None:
                c.optimizer_step_done()
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    # TE's per-state scales were created as its lazy initialisation creates them (and their
    # values, in the snapshots above, stepped alike).
    assert [sorted(ref.optimizer._scales.get(p, {})) for p in ref.all_params()] == \
        [sorted(opt.optimizer._scales.get(p, {})) for p in opt.all_params()]



def test_te_releases_whose_initialize_state_takes_only_the_param_are_called_so():
    opt = FakePrecisionAwareDistOpt()
    seen, initialize = [], opt.optimizer.initialize_state
    opt.optimizer.initialize_state = lambda param: (seen.append(param), initialize(param, False))
    coord = make_coord()
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    assert len(seen) == len(opt.all_params())


@pytest.mark.parametrize("release", [True, False])
def test_cached_memory_released_once_per_iteration_after_the_state_left(release):
    """--offload-release-cached-memory: one empty_cache per training iteration, at the moment the
    last chunk is freed (not before: the blocks must be free; not in evaluation forwards)."""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    seen = []  # (training forwards so far, all state off) at each call
    coord = make_coord(release_cache=release, empty_cache=lambda: seen.append(
        (coord.it.forwards, coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes)))
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    coord.release_startup_state()
    assert seen == [(0, True)]  # the start-up release, with or without the option
    coord.forward_begin(False)
    coord.forward_end()
    for step in range(4):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    # Step 0 creates no new state to free in its forward (it was sent out at start-up); every
    # later iteration's forward frees it all once.
    if release:
        assert seen[1:] == [(1, True)] * 3, seen
        assert coord.cache_releases == 3
    else:
        assert seen[1:] == [] and coord.cache_releases == 0
    coord.close()


def test_release_points_each_release_once_where_they_say():
    """The other release points (measured against "offloaded" in the benchmark): at each later
    microbatch's forward while everything is off, when the reload window opens (before any
    reload), after the step (state resident). None of them changes a result."""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    seen = []  # (point traced just before, bytes offloaded / all bytes) at each call
    coord = make_coord(release_cache=True, release_at=("forward", "reload_window", "step_end"),
                       expected_forwards_per_iteration=lambda: 3,
                       empty_cache=lambda: seen.append(
                           (coord.events[-1], coord.bytes_in(ChunkState.OFFLOADED) / coord.gpu_bytes)))
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    coord.release_startup_state()
    seen.clear()
    for step in range(3):
        one_iteration(ref, None, step, microbatches=3)
        one_iteration(opt, coord, step, microbatches=3)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    later_iteration = [("release:forward", 1.0), ("release:forward", 1.0), ("release:reload_window", 1.0),
                       ("release:step_end", 0.0)]
    # Step 0: the state starts off the GPU (start-up release), so its first forward frees nothing.
    assert seen == [("release:forward", 1.0), ("release:forward", 1.0), ("release:reload_window", 1.0),
                    ("release:step_end", 0.0)] + later_iteration * 2, seen
    with pytest.raises(ValueError, match="unknown release point"):
        make_coord(release_at=("mid_step",))
    coord.close()


class _CopyEvent:
    """Stands in for a CUDA event recorded after a copy (CPU copies are synchronous)."""

    def __init__(self, log):
        self.log = log

    def query(self):
        return False  # (in flight: the forward's frees wait for it)

    def synchronize(self):
        self.log.append(self)


@pytest.mark.parametrize("host_waits", [True, False])
def test_the_forwards_frees_make_the_host_wait_for_the_copy_out(host_waits):
    """With `host_waits_at_free` (off by default) a free in the forward, which stalls the compute
    stream until the chunk's D2H is done, makes the host wait for that copy too, once per copy in
    flight; without it the host never waits there."""
    layer_bytes, logits_bytes = 40_000, 30_000
    ref, opt = FakeDistOpt(), FakeDistOpt()
    ref_mem, mem = SimulatedMemory(ref), SimulatedMemory(opt)
    coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                       host_waits_at_free=host_waits)
    coord.add_optimizer(opt)
    waited = []
    coord.streams.record = lambda stream: _CopyEvent(waited)  # every copy "records" an event
    for step in range(3):
        waited.clear()
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    # The last iteration's copy-out: one event per chunk, each freed in the forward.
    chunks = len(coord.offloaders[0].chunks)
    assert chunks > 1
    assert len(waited) == (chunks if host_waits else 0), (len(waited), chunks)


class _FinishedCopy:
    """A copy's event whose copy is over (`done`: a bool, or a callable asked at each query) or
    still running."""

    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done() if callable(self.done) else self.done

    def synchronize(self):
        pass


@pytest.mark.parametrize("copies_done", [True, False, "some", "from-the-second-hook"])
@pytest.mark.parametrize("rule", ["off", "before-forward", "any-hook"])
def test_a_finished_copy_out_is_freed_whole_only_where_the_rule_allows(rule, copies_done):
    """Where every copy-out has finished by the first forward's first hook, that hook frees all of
    it (`free_copied_before_forward`, the default); with `free_when_copied_out` so does any later
    hook that first finds them finished. A copy still running (all or only some of them), one
    that finishes after the first hook under the first rule alone, or both rules off leave the
    budget's late frees as they were. Training stays bit-exact either way."""
    layer_bytes, logits_bytes, margin = 40_000, 30_000, 1024
    ref, opt = FakeDistOpt(), FakeDistOpt()
    ref_mem, mem = SimulatedMemory(ref), SimulatedMemory(opt)
    coord = make_coord(margin_bytes=margin, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                       free_copied_before_forward=rule != "off", free_when_copied_out=rule == "any-hook")
    coord.add_optimizer(opt)
    recorded = []

    def record(stream):  # ("some": every other copy still running)
        recorded.append(1)
        if copies_done == "from-the-second-hook":  # (hook h runs with `position` h + 1)
            return _FinishedCopy(lambda: coord.it.position >= 2)
        return _FinishedCopy(copies_done if copies_done != "some" else len(recorded) % 2 == 0)

    coord.streams.record = record
    for step in range(4):
        trace = []
        simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
        simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes, trace=trace)
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
    # (the last iteration: the growth profile is known, so the budget alone frees late)
    assert trace[-1] == 0, trace
    if copies_done is True and rule != "off":
        assert trace[0] == 0, trace
    elif copies_done == "from-the-second-hook" and rule == "any-hook":
        assert trace[0] == coord.gpu_bytes and trace[1] == 0, trace
    else:
        assert trace[0] == coord.gpu_bytes and trace[1] == coord.gpu_bytes and trace[2] > 0, trace


@pytest.mark.parametrize("rule", ["first-hook", "every-hook"])
@pytest.mark.parametrize("margin", [1024, 4464])  # (4464: a hook whose budget equals what remains)
def test_chunks_freed_early_keep_the_reload_positions_the_budget_would_have_given_them(margin, rule):
    """Freeing a finished copy-out at once moves the frees, not the reloads: each chunk's
    `freed_at` (the backward position after which it may come back) is the hook at which the
    budget frees it without the rule, chunk by chunk in address order. "first-hook": copies done
    before the forward, the default rule; "every-hook": copies done from the second hook on,
    `free_when_copied_out`."""
    layer_bytes, logits_bytes = 40_000, 30_000
    positions = {}
    for switch in (False, True):
        opt, ref = FakeDistOpt(), FakeDistOpt()
        mem, ref_mem = SimulatedMemory(opt), SimulatedMemory(ref)
        coord = make_coord(margin_bytes=margin, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                           free_copied_before_forward=switch and rule == "first-hook",
                           free_when_copied_out=switch and rule == "every-hook")
        off = coord.add_optimizer(opt)
        if rule == "first-hook":
            coord.streams.record = lambda stream: _FinishedCopy(True)
        else:  # (hook h runs with `position` h + 1)
            coord.streams.record = lambda stream, c=coord: _FinishedCopy(lambda: c.it.position >= 2)
        by_address, seen = [], []
        forward_begin, forward_end = coord.forward_begin, coord.forward_end
        # (each run's chunks in descending address order before the forward frees any, and their
        # positions at its end)
        coord.forward_begin = lambda *a: (by_address.append(sorted(off.chunks, key=lambda c: -c.address)),
                                          forward_begin(*a))[1]
        coord.forward_end = lambda: (seen.append([coord.it.freed_at.get(id(c)) for c in by_address[-1]]),
                                     forward_end())[1]
        for step in range(4):
            trace = []
            simulated_iteration(ref, None, ref_mem, step, layer_bytes, logits_bytes)
            simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes, trace=trace)
            assert_bitwise_equal(snapshot(ref), snapshot(opt))
        positions[switch] = seen[-2]  # (the last iteration's first forward)
        freed_by = 0 if rule == "first-hook" else 1  # (the hook after which the rule left nothing)
        assert trace[:freed_by] == [coord.gpu_bytes] * freed_by and (trace[freed_by] == 0) == switch, trace
    assert None not in positions[False] and len(set(positions[False])) > 1, positions  # spread over hooks
    assert positions[True] == positions[False], positions


def test_a_chunk_is_copied_out_only_with_no_piece_queued_or_running():
    """`copied_out`: a chunk the copy feeder still holds pieces of is not out, even without a
    `ready` event yet (that is what a free would then wait for); otherwise its event decides, and
    a chunk whose host copy was current (no event) is out."""
    import types

    opt = FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    one_iteration(opt, coord, 0)
    chunk = off.chunks[0]
    queued = {True}
    off.feeder = types.SimpleNamespace(pending=lambda c: True in queued)
    chunk.ready = None
    assert not off.copied_out(chunk)
    queued.clear()
    assert off.copied_out(chunk)
    chunk.ready = _FinishedCopy(False)
    assert not off.copied_out(chunk)
    chunk.ready = _FinishedCopy(True)
    assert off.copied_out(chunk)
    off.feeder, chunk.ready = None, None


def train_in_lockstep(ref, opt, coord, steps):
    """The same steps on the reference (plain optimizer) and on the offloaded one."""
    for step in steps:
        make_grads(ref.all_params(), step)
        ref.step()
        one_iteration(opt, coord, step)


def fake_checkpoint_api(opt):
    """DistributedOptimizer's checkpoint methods as a torch_dist load uses them, on a fake:
    `sharded_state_dict(is_loading=True)` runs `load_state_dict(state_dict())` nested (as 0.19's
    does) and returns a template referencing the live state tensors, which dist-checkpointing then
    fills in place; `load_state_dict` loads the inner torch optimizer's own state dict (torch keeps
    each tensor whose device and dtype match its parameter's) and copies in the values of
    `opt.loaded` (index -> {"param"|key: tensor}; `_set_main_param_and_optimizer_states`)."""
    opt.loaded = None

    def template():
        return {i: {"param": p, **{k: v for k, v in opt.optimizer.state[p].items() if k != "step"}}
                for i, p in enumerate(opt.all_params())}

    def sharded_state_dict(model_sharded_state_dict, is_loading=False):
        if is_loading:
            opt.load_state_dict(opt.state_dict())
        return template()

    def state_dict():
        return opt.optimizer.state_dict()

    def load_state_dict(state_dict):
        opt.optimizer.load_state_dict(opt.optimizer.state_dict())
        for i, tensors in template().items():
            for k, t in tensors.items():
                if opt.loaded is not None:
                    t.detach().copy_(opt.loaded[i][k])

    opt.sharded_state_dict, opt.state_dict, opt.load_state_dict = sharded_state_dict, state_dict, load_state_dict


def torch_dist_load(opt, loaded):
    """What megatron.training's load_checkpoint does with the optimizer: the template, filled in
    place by dist_checkpointing, then `load_state_dict`."""
    opt.loaded = loaded
    for i, tensors in opt.sharded_state_dict({}, is_loading=True).items():
        for k, t in tensors.items():
            t.detach().copy_(loaded[i][k])
    opt.load_state_dict({})


def loaded_values(opt, scale):
    """A checkpoint's worth of state for `opt`: every master and moment, changed."""
    return {i: {"param": p.detach() * scale + 1,
                **{k: v.detach() * scale for k, v in opt.optimizer.state[p].items() if k != "step"}}
            for i, p in enumerate(opt.all_params())}


@pytest.mark.parametrize("when", ["mid_iteration", "after_the_step"])
def test_a_checkpoint_load_writes_into_the_host_copies_and_brings_nothing_back(when):
    """A torch_dist load with the state off the GPU: the template's tensors are the host copies,
    dist-checkpointing and load_state_dict write there, no chunk is allocated on the GPU and
    nothing is copied in during the load, no D2H is owed afterwards (the host copies are the
    state), and training continues from the loaded values bit-exactly (against an optimizer that
    had them set directly). Right after a step the stepped state is first sent out (its host copy
    is stale), still without bringing anything back."""
    from megatron_offload.megatron_state_methods import wrap_state_access

    ref, opt = FakeDistOpt(fp32_numels=()), FakeDistOpt(fp32_numels=())
    coord = make_coord()
    off = coord.add_optimizer(opt)
    fake_checkpoint_api(opt)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    train_in_lockstep(ref, opt, coord, range(2))
    assert off.host_writes_supported()
    if when == "mid_iteration":
        coord.forward_begin(True)
        coord.forward_end()  # all of it off the GPU, as between two microbatches
    else:
        assert coord.bytes_in(ChunkState.RESIDENT) == coord.gpu_bytes  # stepped, copy-out not enqueued
    loaded = loaded_values(ref, 0.5)
    for i, p in enumerate(ref.all_params()):  # the reference gets them directly
        p.detach().copy_(loaded[i]["param"])
        for k, v in ref.optimizer.state[p].items():
            if k != "step":
                v.copy_(loaded[i][k])
    opt.loaded = loaded
    h2d = coord.streams.stats.cumulative_h2d_bytes
    torch_dist_load(opt, loaded)
    assert coord.streams.stats.cumulative_h2d_bytes == h2d  # nothing came back
    assert all(storage_bytes(c.buffer) == 0 and c.on_host and c.host_valid for c in off.chunks)
    assert "host_write:optimizer" in coord.events
    if when == "mid_iteration":  # the rest of the iteration, then two more
        coord.backward_begin()
        coord.grads_finalizing()
        make_grads(opt.all_params(), 2)
        opt.step()
        coord.optimizer_step_done()
    else:
        one_iteration(opt, coord, 2)
    make_grads(ref.all_params(), 2)
    ref.step()
    train_in_lockstep(ref, opt, coord, range(3, 5))
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))


def fake_reload_model_params(opt):
    """DistributedOptimizer.reload_model_params on a fake: the model's params copied into the
    masters in place (`_copy_model_params_to_main_params`)."""
    def reload_model_params(state_dict=None):
        for model, master in zip(opt.model_bf16, opt.shard_fp32_from_float16_groups[0]):
            master.data.copy_(model)

    opt.reload_model_params = reload_model_params


def load_new_model(ref, opt):
    """A model-only checkpoint: new model params for both; `ref`'s masters set from them directly."""
    g = torch.Generator().manual_seed(7)
    loaded = [torch.randn(m.shape, generator=g).to(torch.bfloat16) for m in ref.model_bf16]
    for o in (ref, opt):
        for model, new in zip(o.model_bf16, loaded):
            model.copy_(new)
    for model, master in zip(ref.model_bf16, ref.shard_fp32_from_float16_groups[0]):
        master.detach().copy_(model)


@pytest.mark.parametrize("when", ["at_start_up", "after_two_steps"])
def test_a_model_only_load_refreshes_the_masters_on_the_host_and_brings_nothing_back(when):
    """`reload_model_params` (a model-only load: --no-load-optim, --finetune) copies the model's
    params into the fp32 masters (DistributedOptimizer._copy_model_params_to_main_params, in
    place). With the state off the GPU it writes into the masters' host copies: no chunk is
    allocated on the GPU, nothing is copied in, and training goes on bit-exactly against an
    optimizer whose masters were refreshed directly."""
    from megatron_offload.megatron_state_methods import wrap_state_access

    ref, opt = FakeDistOpt(fp32_numels=()), FakeDistOpt(fp32_numels=())
    fake_reload_model_params(opt)
    coord = make_coord()
    off = coord.add_optimizer(opt)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    steps = 2 if when == "after_two_steps" else 0
    train_in_lockstep(ref, opt, coord, range(steps))
    load_new_model(ref, opt)
    h2d = coord.streams.stats.cumulative_h2d_bytes
    opt.reload_model_params()
    assert coord.streams.stats.cumulative_h2d_bytes == h2d  # nothing came back
    assert all(storage_bytes(c.buffer) == 0 and c.on_host and c.host_valid for c in off.chunks)
    assert "host_write:optimizer" in coord.events
    train_in_lockstep(ref, opt, coord, range(steps, steps + 3))
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))


def test_a_host_write_after_an_asynchronous_save_leaves_the_pending_save_alone(monkeypatch):
    """After an asynchronous save the state tensors point at its snapshots until the next forward,
    while its writer may still read them. A host write in between (here the masters' refresh of a
    model-only load) must write into the host copies, which are the state, not into the
    snapshots: the pending save keeps what it read, and training goes on from the written values
    bit-exactly."""
    from megatron_offload import save_snapshot
    from megatron_offload.megatron_state_methods import wrap_state_access

    monkeypatch.setattr(save_snapshot, "MIN_SNAPSHOT_BYTES", 0)  # (these tensors are small)
    ref, opt = FakeDistOpt(fp32_numels=()), FakeDistOpt(fp32_numels=())
    held = []

    def save(model_sharded_state_dict, is_loading=False):  # the pending request keeps detached tensors
        held.extend(st.tensor.detach() for c in off.chunks for st in c.tensors)

    fake_reload_model_params(opt)
    opt.sharded_state_dict = save
    coord = make_coord(async_saves=True, async_save_snapshots=True)
    off = coord.add_optimizer(opt)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    train_in_lockstep(ref, opt, coord, range(2))
    opt.sharded_state_dict({})
    assert held and all(t.is_shared() for t in held)  # the save read snapshots
    saved = [t.clone() for t in held]
    load_new_model(ref, opt)
    opt.reload_model_params()  # no forward since the save
    assert all(torch.equal(a, b) for a, b in zip(saved, held))
    train_in_lockstep(ref, opt, coord, range(2, 5))
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))


def test_a_writer_that_replaces_state_tensors_on_the_host_is_refused():
    """host_writes_supported promises that the writer keeps the tensor objects; one that replaces
    them would leave the optimizer with tensors the offloader does not know, on the CPU."""
    from megatron_offload.megatron_state_methods import wrap_state_access

    opt = FakeDistOpt(fp32_numels=())
    coord = make_coord()
    off = coord.add_optimizer(opt)
    fake_checkpoint_api(opt)

    def replacing_load(state_dict):
        for p in opt.all_params():
            opt.optimizer.state[p]["exp_avg"] = torch.zeros_like(opt.optimizer.state[p]["exp_avg"])

    opt.load_state_dict = replacing_load
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    one_iteration(opt, coord, 0)
    with pytest.raises(RuntimeError, match="replaced state tensors"):
        opt.load_state_dict({})


def te_checkpoint_api(opt):
    """DistributedOptimizer's checkpoint methods around TE FusedAdam, as megatron-core 0.19.2 runs a
    torch_dist save or load (distrib_optimizer.py): `state_dict()` calls TE's (which unscales every
    state) and keeps the param groups; `load_state_dict(sd)` with the state allocated loads TE's own
    `state_dict()["state"]` back into TE (TE rebuilds every state tensor), then writes the loaded
    values (`sd["param_state"]`) with `set_scaled_state` (`_set_main_param_and_optimizer_states`);
    `sharded_state_dict` runs `load_state_dict(state_dict())` nested when loading, and returns the
    unscaled states (`_get_main_param_and_optimizer_states`: get_unscaled_state)."""
    inner = opt.optimizer

    def state_dict():
        return {"optimizer": {k: v for k, v in inner.state_dict().items() if k != "state"}}

    def load_state_dict(sd):
        own = inner.state_dict()
        groups = [{**saved, "params": current["params"]}
                  for saved, current in zip(sd["optimizer"]["param_groups"], own["param_groups"])]
        inner.load_state_dict({"state": own["state"], "param_groups": groups})
        for i, tensors in (sd.get("param_state") or {}).items():
            p = opt.all_params()[i]
            for k, v in tensors.items():
                inner.set_scaled_state(p, "master_param" if k == "param" else k, v)

    def sharded_state_dict(model_sharded_state_dict, is_loading=False):
        if is_loading:
            opt.load_state_dict(opt.state_dict())
        else:
            opt.state_dict()  # (the param groups: TE unscales every state for them)
        out = {}
        for i, p in enumerate(opt.all_params()):
            tensors = {k: inner.get_unscaled_state(p, k) for k in inner.state[p]}
            tensors["param"] = tensors.pop("master_param")
            out[i] = tensors
        return out

    opt.state_dict, opt.load_state_dict, opt.sharded_state_dict = state_dict, load_state_dict, sharded_state_dict


def te_resume(opt):
    """A torch_dist load of the checkpoint `opt` would save now (a resume): the template's values
    are the unscaled states (cloned: dist-checkpointing reads them from the file)."""
    saved = {i: {k: v.clone() for k, v in t.items()} for i, t in opt.sharded_state_dict({}).items()}
    opt.sharded_state_dict({}, is_loading=True)
    opt.load_state_dict({**opt.state_dict(), "param_state": saved})


def te_offloaded(opt):
    """A coordinator driving `opt` (a stand-in with TE's checkpoint API) as the Megatron wiring
    does: its state readers and writers wrapped, the state sent out before the first step."""
    from megatron_offload.megatron_state_methods import wrap_state_access

    te_checkpoint_api(opt)
    coord = make_coord()
    off = coord.add_optimizer(opt)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    return coord, off


@pytest.mark.parametrize("config", ["fp32-master", "int16-remainders-bf16-moments", "fp16-moments"])
def test_a_te_checkpoint_load_rebuilds_the_state_which_is_sent_out_again(config):
    """TE's `load_state_dict` replaces every state tensor by a new one (megatron-core runs it in
    every checkpoint load): the load takes the state back to the GPU, the offloader finds the new
    tensors and sends them out, and training goes on as without offloading. TE's round trip keeps
    fp32 masters, int16 remainders and bf16 moments exactly (a resume changes nothing); fp16
    moments are re-scaled."""
    kw = {"fp32-master": {}, "fp16-moments": dict(moment_dtype=torch.float16),
          "int16-remainders-bf16-moments": dict(store_param_remainders=True, moment_dtype=torch.bfloat16)}[config]
    plain, ref, opt = (FakePrecisionAwareDistOpt(**kw) for _ in range(3))
    te_checkpoint_api(ref)
    coord, off = te_offloaded(opt)
    for step in range(2):
        for o, c in ((plain, None), (ref, None), (opt, coord)):
            one_iteration(o, c, step)
    coord.forward_begin(True)
    coord.forward_end()  # all of it off the GPU
    packed = [st.tensor for st in off.discovery.tensors]  # (held: ids stay unique)
    dtypes = [{k: t.dtype for k, t in opt.optimizer.state[p].items()} for p in opt.all_params()]
    te_resume(ref)
    te_resume(opt)
    current = [t for p in opt.all_params() for t in opt.optimizer.state[p].values()]
    assert not {id(t) for t in current} & {id(t) for t in packed}  # TE rebuilt every state tensor...
    assert {id(t) for t in current} == {id(st.tensor) for st in off.discovery.tensors}  # ...found again
    assert [{k: t.dtype for k, t in opt.optimizer.state[p].items()} for p in opt.all_params()] == dtypes
    coord.forward_begin(True)
    coord.forward_end()
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes
    assert all(storage_bytes(t) == 0 for t in current)  # the new tensors are off the GPU
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    if config != "fp16-moments":
        assert_bitwise_equal(snapshot(plain), snapshot(ref))
    for step in range(2, 4):
        for o, c in ((plain, None), (ref, None), (opt, coord)):
            one_iteration(o, c, step)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
        if config != "fp16-moments":
            assert_bitwise_equal(snapshot(plain), snapshot(ref))


TE_SCALED = {"bf16-moments": dict(moment_dtype=torch.bfloat16), "fp16-moments": dict(moment_dtype=torch.float16),
             "fp16-master": dict(master_weight_dtype=torch.float16),
             "fp16-exp_avg-only": dict(exp_avg_dtype=torch.float16)}


def te_scaled(config):
    kw = dict(TE_SCALED[config])
    if "moment_dtype" not in kw and "exp_avg_dtype" in kw:  # (one moment fp16, the other fp32)
        kw = dict(exp_avg_dtype=kw["exp_avg_dtype"], exp_avg_sq_dtype=torch.float32)
    return FakePrecisionAwareDistOpt(**kw)


def te_scaled_all_off(config):
    """(ref, opt, coord, off): a TE stand-in and its twin under the plugin, two steps taken, then
    a first forward that sends all of the twin's state off the GPU."""
    ref, opt = te_scaled(config), te_scaled(config)
    te_checkpoint_api(ref)
    coord, off = te_offloaded(opt)
    for step in range(2):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
    coord.forward_begin(True)
    coord.forward_end()
    return ref, opt, coord, off


def holder(off, tensor):
    """The chunk of `off` that holds `tensor`."""
    (chunk,) = [c for c in off.chunks if any(st.tensor is tensor for st in c.tensors)]
    return chunk


@pytest.mark.parametrize("config", list(TE_SCALED))
def test_a_te_save_reads_the_host_copies_with_host_copies_of_the_scales(config):
    """A save reads TE's state through `get_unscaled_state` (TE's `state_dict`, megatron-core's
    `_get_main_param_and_optimizer_states`). bf16 states (and fp32 masters) are only cast; fp16
    ones are multiplied by their scale, a `[1]` tensor in `optimizer._scales` kept on the GPU,
    which a host copy cannot be multiplied by. So while an fp16 state is read on the host its scale
    is a host copy (never the optimizer's own tensor), and the optimizer's own are back before the
    next step: every read on the host, nothing comes back to the GPU, every byte as without us."""
    ref, opt, coord, off = te_scaled_all_off(config)
    inner = opt.optimizer
    own = {(id(p), k): t for p, d in inner._scales.items() for k, t in d.items()}
    fp16 = {k for k, dtype in inner.name_to_dtype_map.items() if dtype == torch.float16}
    assert own and ({k for _, k in own} >= fp16)
    reads, unscale = [], inner.get_unscaled_state

    def watched(param, state_name, skip_unscale=False):
        on_host = holder(off, inner.state[param][state_name]).on_host
        scale = inner._scales.get(param, {}).get(state_name)
        # fp16: a host copy; anything else: untouched (the optimizer's own, or none)
        right_scale = ((scale is not own[(id(param), state_name)] and scale.device.type == "cpu")
                       if state_name in fp16 else (scale is own.get((id(param), state_name))))
        reads.append((state_name, on_host, right_scale))
        return unscale(param, state_name, skip_unscale)

    inner.get_unscaled_state = watched
    h2d = coord.streams.stats.cumulative_h2d_bytes
    saved = opt.sharded_state_dict({})
    expected = ref.sharded_state_dict({})
    for i in expected:
        assert_bitwise_equal(saved[i], expected[i])
    assert reads and {name for name, _, _ in reads} == {"exp_avg", "exp_avg_sq", "master_param"}
    assert all(on_host and right for _, on_host, right in reads), reads
    assert coord.streams.stats.cumulative_h2d_bytes == h2d  # nothing came back
    coord.forward_begin(True)
    assert all(t is own[(id(p), k)] for p, d in inner._scales.items() for k, t in d.items())
    assert not any(c.gpu_scales for c in off.chunks)
    coord.forward_end()
    assert coord.bytes_in(ChunkState.OFFLOADED) == coord.gpu_bytes
    for step in range(2, 4):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))


@pytest.mark.parametrize("then", ["gpu_reader", "writer"])
def test_a_reader_after_a_host_read_of_te_fp16_states_gets_the_optimizers_own_scales(then):
    """After a save read fp16 states on the host (their scales swapped for host copies), anything
    that takes the state back before the next forward (a reader on the GPU, a writer) reloads the
    chunks: the optimizer's own scale tensors come back with them, so that reader and the next step
    see TE's scales, and training stays bit-exact."""
    ref, opt, coord, off = te_scaled_all_off("fp16-moments")
    inner = opt.optimizer
    own = {(id(p), k): t for p, d in inner._scales.items() for k, t in d.items()}
    opt.sharded_state_dict({})  # a save: on the host, scales swapped
    assert any(c.on_host and c.gpu_scales for c in off.chunks)

    def own_scales():
        return (all(t is own[(id(p), k)] for p, d in inner._scales.items() for k, t in d.items())
                and not any(c.gpu_scales for c in off.chunks))

    with coord.state_access([off], will_modify=then == "writer"):
        assert own_scales()
    for step in range(2, 4):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
        assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))
    assert own_scales()


@pytest.mark.parametrize("case", ["fp32-params", "fraction", "fused", "te", "host-loads-off"])
def test_writers_that_cannot_run_on_the_host_get_the_state_back(case):
    """Where a load would move or replace the state tensors, it runs as before: the state comes
    back to the GPU, the loaded values are re-discovered and sent out again. fp32 model params
    (their moments would follow them to the GPU), state kept resident by a fraction, fused Adam
    (its step follows the params), TE FusedAdam (rebuilds its state), or loads turned off
    (Megatron's fully parallel load exchanges GPU tensors)."""
    from megatron_offload.megatron_state_methods import wrap_state_access

    kw = {}
    if case == "fp32-params":
        opt = FakeDistOpt()  # fp32 params (views of the fp32 buffer) have offloaded moments
    elif case == "te":
        opt = FakePrecisionAwareDistOpt()
    else:
        opt = FakeDistOpt(fp32_numels=())
    if case == "fraction":
        kw["state_fraction"] = 0.5
    if case == "host-loads-off":
        kw["host_loads"] = False
    if case == "fused":
        for group in opt.optimizer.param_groups:
            group["fused"] = True  # (as torch keeps it; the CPU step never reads it here)
    coord = make_coord(**kw)
    off = coord.add_optimizer(opt)
    if case != "te":
        fake_checkpoint_api(opt)
    wrap_state_access(coord, off, opt)
    coord.offload_existing_state()
    if case == "fused":
        assert not off.host_writes_supported()
        return
    one_iteration(opt, coord, 0)
    coord.forward_begin(True)
    coord.forward_end()
    assert off.host_writes_supported() == (case == "host-loads-off")  # (that one: the coordinator's choice)
    h2d = coord.streams.stats.cumulative_h2d_bytes
    coord.before_state_access(off, will_modify=True, host_copies_ok=True)
    assert coord.streams.stats.cumulative_h2d_bytes > h2d  # the state came back
    assert not any(c.on_host for c in off.chunks)
    coord.after_state_access(off, modified=True)
    assert "host_write:optimizer" not in coord.events


def test_steps_whose_forwards_bypass_the_hooks_fail_loudly():
    """--overlap-moe-expert-parallel-comm's combined 1F1B never called the patched forward_step:
    the copy-out never started, the state stayed on the GPU and only "d2h 0.00 GiB" was logged.
    Driven here with only what that path still calls: the reload trigger and the step."""
    from megatron_offload.coordinator import OffloadNotRunningError

    opt = FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(2):
        coord.grads_finalizing()
        make_grads(opt.all_params(), step)
        opt.step()
        if step == 0:
            coord.optimizer_step_done()
        else:
            with pytest.raises(OffloadNotRunningError, match="overlap-moe-expert-parallel-comm"):
                coord.optimizer_step_done()
    assert coord.closed
    # A loop that caught the error and goes on calling the hooks moves nothing any more, and the
    # optimizer steps without us (a step hook left behind would trace "step_begin").
    before = [c.state for c in off.chunks] if (off := coord.offloaders[0]).chunks else []
    events = list(coord.events)
    one_iteration(opt, coord, 2)
    assert [c.state for c in off.chunks] == before and not coord.pending_copy_out
    assert coord.events == events


def test_add_optimizer_refuses_what_it_cannot_offload():
    coord = make_coord()
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(TypeError, match="DistributedOptimizer.*got a AdamW"):
        coord.add_optimizer(plain)

    class Chained:
        chained_optimizers = [FakeDistOpt()]

    with pytest.raises(TypeError, match="ChainedOptimizer"):
        coord.add_optimizer(Chained())
    assert coord.offloaders == []


@pytest.mark.parametrize("where", ["preparation", "access", "access_and_closing"])
def test_checkpoint_access_is_exception_safe(where, monkeypatch, caplog):
    """A failure while preparing an access (a reload that runs out of memory), inside it (a save
    that raises) or also while closing it leaves no access open: before, a caught exception left
    the coordinator believing it was inside a checkpoint access, so it skipped the reload before
    the next step (Adam on freed storage). The original error is the one raised."""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(2):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
    coord.forward_begin(True)  # state leaving / off the GPU, as at a save between steps
    if where == "preparation":
        monkeypatch.setattr(off, "make_resident", lambda **k: (_ for _ in ()).throw(MemoryError("reload")))
    if where == "access_and_closing":
        monkeypatch.setattr(off, "start_copy_out", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("close")))
    with pytest.raises(MemoryError, match="reload" if where == "preparation" else "save"):
        with coord.state_access([off], will_modify=False):
            raise MemoryError("save")
    monkeypatch.undo()
    assert coord.open_state_accesses == ()
    if where == "access_and_closing":
        assert "closing" in caplog.text
    coord.forward_end()
    coord.backward_begin()
    coord.grads_finalizing()
    for step in range(2, 4):  # the steps still reload first: training stays bit-exact
        step_beside(ref, opt, coord, step)
        coord.forward_begin(True)
        coord.forward_end()
        coord.backward_begin()
        coord.grads_finalizing()


@pytest.mark.parametrize("inner_writes", [False, True])
def test_nested_accesses_on_the_gpu_leave_the_state_to_the_outermost(inner_writes, monkeypatch):
    """With TE FusedAdam the torch_dist load cannot write into the host copies, so a resume's
    `sharded_state_dict(is_loading=True)` takes the state back and calls `state_dict` inside: the
    inner reader started the copy-out on closing, and the outer writer's re-discovery then found
    chunks in flight (AssertionError at every TE resume with offloading, one H200)."""
    ref, opt = FakeDistOpt(), FakeDistOpt()
    coord = make_coord(host_loads=False)
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(2):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
    with coord.state_access([off], will_modify=not inner_writes):
        with coord.state_access([off], will_modify=inner_writes):
            assert all(c.state is ChunkState.RESIDENT for c in off.chunks)
        assert all(c.state is ChunkState.RESIDENT for c in off.chunks)  # still ours to use
    assert coord.open_state_accesses == ()
    assert all(c.state is not ChunkState.RESIDENT for c in off.chunks)  # sent out again
    refreshes = []
    monkeypatch.setattr(off, "refresh", lambda refresh=off.refresh: (refreshes.append(1), refresh())[1])
    with coord.state_access([off], will_modify=False):
        pass
    assert refreshes == []  # no write of the nested access is left to re-discover
    for step in range(2, 4):
        one_iteration(ref, None, step)
        one_iteration(opt, coord, step)
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))


def test_every_chunk_move_is_checked_against_the_transition_table():
    """A chunk changes state only through Chunk.move_to: freeing a chunk whose copy-out was never
    started (its host copy would be stale) or reloading one twice is refused before anything
    happens to its storage."""
    from megatron_offload.chunks import TRANSITIONS, IllegalTransition

    opt = FakeDistOpt()
    coord = make_coord()
    off = coord.add_optimizer(opt)
    coord.offload_existing_state()
    one_iteration(opt, coord, 0)  # stepped: every chunk RESIDENT, its copy-out due
    chunk = off.chunks[0]
    assert chunk.state is ChunkState.RESIDENT
    with pytest.raises(IllegalTransition, match="resident -> offloaded"):
        off.free([chunk])
    assert chunk.state is ChunkState.RESIDENT and chunk.buffer.untyped_storage().nbytes() > 0
    off.start_copy_out([chunk])
    off.free([chunk])
    with pytest.raises(IllegalTransition, match="offloaded -> copying_out"):
        chunk.move_to(ChunkState.COPYING_OUT)
    # The table is closed over the states and every state can reach every other one.
    assert set(TRANSITIONS) == set(ChunkState)
    for state in ChunkState:
        seen, todo = set(), [state]
        while todo:
            for nxt in TRANSITIONS[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert seen == set(ChunkState), state


def test_sibling_accesses_each_send_their_state_out_again():
    """`state_access` over two offloaders (a dense and an expert optimizer, as --log-params-norm
    with the chunked step does) closes them one after the other: neither is nested in the other,
    so both are sent out again (a first version took the second for nested and left it resident
    through every later forward)."""
    opts = [FakeDistOpt(), FakeDistOpt()]
    coord = make_coord()
    offs = [coord.add_optimizer(o, name=f"o{i}") for i, o in enumerate(opts)]
    coord.offload_existing_state()
    for step in range(2):
        for mb in range(2):
            coord.forward_begin(True)
            for _ in range(LAYERS):
                coord.layer_forward_begin()
            coord.forward_end()
            coord.backward_begin()
        coord.grads_finalizing()
        for o in opts:
            make_grads(o.all_params(), step)
            o.step()
        coord.optimizer_step_done()
    with coord.state_access(offs, will_modify=False):
        pass
    assert coord.open_state_accesses == ()
    coord.forward_begin(True)
    for _ in range(LAYERS):
        coord.layer_forward_begin()
    coord.forward_end()
    for off in offs:
        assert all(c.state is ChunkState.OFFLOADED for c in off.chunks), (off.name, off.chunks)


def test_the_iteration_moves_through_its_states_and_a_new_record_follows_each_step():
    opt = FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    seen = []
    for step in range(2):
        record = coord.it
        seen.append(record.state)
        for mb in range(2):
            coord.forward_begin(True)
            seen.append(coord.it.state)
            coord.forward_end()
            coord.backward_begin()
            seen.append(coord.it.state)
        make_grads(opt.all_params(), step)
        coord.grads_finalizing()
        opt.step()
        seen.append(coord.it.state)
        coord.optimizer_step_done()
        assert coord.it is not record and coord.it.forwards == 0 and not coord.it.stepped
    S = IterationState
    one = [S.FIRST_FORWARD, S.FIRST_FORWARD, S.LATER_FORWARDS, S.RELOAD_WINDOW, S.STEPPING]
    assert seen == [S.STARTUP] + one + [S.AFTER_STEP] + one


def test_hooks_out_of_order_raise_and_extra_forwards_keep_the_reload_window():
    from megatron_offload.chunks import IllegalTransition

    opt = FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    one_iteration(opt, coord, 0)
    coord.forward_begin(True)
    coord.forward_end()
    coord.backward_begin()
    coord.forward_begin(True)
    coord.forward_end()
    coord.backward_begin()
    assert coord.it.state is IterationState.RELOAD_WINDOW
    coord.forward_begin(True)  # a forward the schedule did not announce: the window stays open
    assert coord.it.state is IterationState.RELOAD_WINDOW
    inside_the_step = []

    def forward_inside_the_step(optimizer, args, kwargs):  # (runs after the coordinator's step hook)
        inside_the_step.append(coord.it.state)
        with pytest.raises(IllegalTransition, match="stepping -> first_forward|stepping -> later_forwards"):
            coord.forward_begin(True)

    opt.optimizer.register_step_pre_hook(forward_inside_the_step)
    make_grads(opt.all_params(), 1)
    opt.step()
    assert inside_the_step == [IterationState.STEPPING]


def test_a_device_without_index_matches_its_tensors():
    """Tensors live on "cuda:0"; a coordinator built with device="cuda" must still find them."""
    from megatron_offload.discovery import same_device

    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert same_device(cuda0, cuda) and same_device(cuda1, cuda)
    assert same_device(cuda0, cuda0) and not same_device(cuda1, cuda0)
    assert not same_device(CPU, cuda) and same_device(CPU, CPU)


def test_fit_check_skips_the_allocator_snapshot_when_the_counters_rule_out_any_fit():
    """The snapshot (`free_block_sizes`) walks every block of the allocator; where reserved minus
    allocated cannot hold the first chunk plus the backward workspace, no block can, and the
    answer must be the one the snapshot would give, without taking it."""
    layer_bytes, logits_bytes = 40_000, 30_000
    results = {}
    for mapped in (None, 0, 10**12):
        opt = FakeDistOpt()
        mem = SimulatedMemory(opt)
        snapshots = [0]

        def blocks():
            snapshots[0] += 1
            return [10**9]

        probes = {} if mapped is None else {"free_mapped": lambda: mapped}
        coord = make_coord(margin_bytes=1024, memory_allocated=mem.allocated, max_memory_allocated=mem.max_allocated,
                           free_block_sizes=blocks, **probes)
        coord.add_optimizer(opt)
        for step in range(3):
            simulated_iteration(opt, coord, mem, step, layer_bytes, logits_bytes)
        results[mapped] = (snapshots[0], coord.fit_skips, coord.reloads_deferred_for_fit, snapshot(opt))
    (snaps_plain, skips_plain, _, state_plain), (snaps, skips, deferred, state) = results[None], results[0]
    assert snaps_plain > 0 and skips_plain == 0  # the snapshot answered, and reloads fitted
    assert snaps == 0 and skips > 0 and deferred >= skips  # nothing fits: no snapshot taken
    assert_bitwise_equal(state_plain, state)  # the reloads at finalize still bring everything back
    assert results[10**12][:3] == results[None][:3]  # room by the counters: the snapshot decides, as before


def test_fit_pre_check_never_changes_what_fits():
    """The counters' bound (reserved minus allocated, at least every free block of the snapshot
    plus free bytes elsewhere) may only skip snapshots whose answer is "nothing": over random
    block layouts, chunk sizes, workspaces and slots, `_fitting` with the bound chooses exactly
    what it chooses without it, and defers the same number of reloads."""
    import random

    from megatron_offload.reload_policy import ReloadPolicy

    class Chunk:
        def __init__(self, nbytes):
            self.gpu_nbytes = nbytes

    class Policy(ReloadPolicy):
        def __init__(self, blocks, free_mapped, workspace, slot):
            self._init_reload_policy()
            self._free_block_sizes = lambda: list(blocks)
            self._free_mapped = free_mapped
            self.workspace_per_interval = {None: workspace}
            self._slot = lambda: slot

    rng = random.Random(1)
    skipped = 0
    for _ in range(20000):
        unit = rng.choice([1, 512, 1000, 2**20])
        blocks = [rng.randint(0, 400) * unit for _ in range(rng.randint(0, 6))]
        elsewhere = rng.choice([0, 0, rng.randint(0, 300) * unit])  # other streams and pools
        chosen = [(None, Chunk(rng.randint(1, 300) * unit + rng.choice([0, rng.randint(0, 511)])))
                  for _ in range(rng.randint(1, 4))]
        workspace = rng.choice([0, rng.randint(0, 300) * unit])
        slot = rng.choice([64, 512, 2**26, 10**12])
        plain = Policy(blocks, None, workspace, slot)
        bounded = Policy(blocks, lambda: sum(blocks) + elsewhere, workspace, slot)
        assert plain._fitting(list(chosen)) == bounded._fitting(list(chosen))
        assert plain.reloads_deferred_for_fit == bounded.reloads_deferred_for_fit
        skipped += bounded.fit_skips
    assert skipped > 1000  # the bound did skip snapshots, not only pass them through


@pytest.mark.parametrize("enabled, skipped, expected", [
    (True, (), [0, 1, 1, 1, 1, 1]),
    (False, (), [0] * 6),
    # fp16's loss-scale warm-up: skipped steps create nothing (TE creates its state at the first
    # real step), so the collection waits for two real ones.
    (True, (0, 1, 2), [0, 0, 0, 0, 1, 1]),
], ids=["gc-on", "manual-gc", "skipped-first-steps"])
def test_one_full_garbage_collection_after_setup_unless_the_loop_manages_gc(enabled, skipped, expected, monkeypatch):
    """Setup's objects would otherwise bring CPython's first full collection into the training
    iterations; a loop that turned automatic collection off (--manual-gc) is left alone."""
    import megatron_offload.coordinator as coordinator

    calls = []
    monkeypatch.setattr(coordinator.gc, "collect", lambda *a, **k: calls.append(a) or 0)
    monkeypatch.setattr(coordinator.gc, "isenabled", lambda: enabled)
    opt = FakeDistOpt()
    coord = make_coord(collect_after_setup=True)
    coord.add_optimizer(opt)
    done = []
    for step in range(6):
        one_iteration(opt, coord, step, skip=step in skipped)
        done.append(len(calls))
    assert done == expected
    assert ("setup_collected" in coord.events) is enabled


class _FakeGpuEvent:
    """A recorded point of a fake stream: complete once the fake GPU has run `done` points."""

    def __init__(self, gpu, index):
        self.gpu, self.index = gpu, index

    def query(self):
        return self.index < self.gpu["done"]

    def synchronize(self):
        self.gpu["waited_for"].append(self.index)
        self.gpu["done"] = max(self.gpu["done"], self.index + 1)


def test_the_host_lead_bound_waits_only_for_the_point_depth_marks_back():
    from megatron_offload.streams import HostLeadBound

    gpu = {"done": 0, "waited_for": [], "recorded": 0}

    def new_event():
        gpu["recorded"] += 1
        return _FakeGpuEvent(gpu, gpu["recorded"] - 1)

    bound = HostLeadBound(None, 2, new_event=new_event)
    bound.mark(), bound.mark()
    assert gpu["waited_for"] == []  # two points outstanding: within the bound
    bound.mark()  # the third: the host waits for the first
    assert gpu["waited_for"] == [0] and bound.waits == 1
    gpu["done"] = 3  # the GPU caught up: no wait, however many marks follow
    bound.mark()
    assert gpu["waited_for"] == [0] and bound.waits == 1
    bound.mark(), bound.mark()
    assert gpu["waited_for"] == [0, 3] and bound.waits == 2
    # Without a stream (a CPU device) the bound is off, whatever the depth.
    off = HostLeadBound(None, 2)
    off.mark(), off.mark(), off.mark(depth=1)
    assert off.depth == 0 and off.waits == 0
    # A bound of 0 records nothing; a mark given its own depth waits as that bound would.
    gpu.update(done=0, waited_for=[], recorded=0)
    zero = HostLeadBound(None, 0, new_event=new_event)
    zero.mark(), zero.mark()
    assert gpu["recorded"] == 0
    zero.mark(depth=1), zero.mark(depth=1)
    assert gpu["waited_for"] == [0] and zero.waits == 1 and zero.depth == 0
    four = HostLeadBound(None, 4, new_event=new_event)  # (tighter for one mark than its own)
    four.mark(), four.mark(depth=1)
    assert gpu["waited_for"] == [0, 2] and four.waits == 1


def test_the_coordinator_marks_the_host_lead_at_every_layer_hook(monkeypatch):
    from megatron_offload import coordinator as coordinator_module

    opt = FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    marks = []
    coord.host_lead.mark = lambda depth=None: marks.append(coord.it.state)
    one_iteration(opt, coord, 0)
    one_iteration(opt, coord, 1)
    # Every forward and backward layer hook of both microbatches of both iterations.
    assert len(marks) == 2 * 2 * 2 * LAYERS
    # Not an evaluation forward between iterations, nor a recomputation inside a backward.
    coord.forward_begin(False)
    coord.layer_forward_begin()
    coord.forward_end()
    coord.forward_begin(True)
    monkeypatch.setattr(coordinator_module, "in_backward", lambda: True)
    coord.layer_forward_begin()
    assert len(marks) == 2 * 2 * 2 * LAYERS


def test_the_hook_clock_counts_each_outermost_lifecycle_call_once():
    """`hook_clock` counts every lifecycle call the loop makes, under its own name and once (a
    lifecycle method called from another, as `forward_begin` calls `start_pending_copy_out`,
    counts in the caller's time only), resets after an exception, and counts nothing once closed."""
    opt = FakeDistOpt()
    coord = make_coord()
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    for step in range(1, 3):
        one_iteration(opt, coord, step)
    clock = coord.hook_clock
    per_iteration = {"forward_begin": 2, "layer_forward_begin": 2 * LAYERS, "forward_end": 2, "backward_begin": 2,
                     "layer_backward_begin": 2 * LAYERS, "grads_finalizing": 1, "optimizer_step_done": 1}
    assert clock.calls == {name: 2 * n for name, n in per_iteration.items()}, clock.calls
    assert set(clock.ms) == set(clock.calls) and all(ms >= 0.0 for ms in clock.ms.values())
    assert clock.total_ms == pytest.approx(sum(clock.ms.values()))
    coord.start_pending_copy_out()  # called by the loop itself: its own entry
    assert clock.calls["start_pending_copy_out"] == 1

    def failing():
        raise RuntimeError("in a hook")

    coord._hide_host_copies, hide = failing, coord._hide_host_copies
    with pytest.raises(RuntimeError, match="in a hook"):
        coord.grads_finalizing()
    coord._hide_host_copies = hide
    assert not clock.inside and clock.calls["grads_finalizing"] == 3  # (two iterations, then the failing call)
    coord.close()
    before = dict(clock.calls)
    assert coord.forward_begin(True) is None
    assert clock.calls == before


def test_the_hook_clock_counts_milliseconds_of_the_host(monkeypatch):
    """What `hook_clock` adds per call is the host clock's difference, in milliseconds."""
    from megatron_offload import lifecycle

    class Loop:
        closed = False

        def __init__(self):
            self.hook_clock = lifecycle.HookClock()

        @lifecycle.lifecycle
        def forward_begin(self):
            return "ran"

    ticks = iter([10.0, 10.25, 20.0, 20.5])
    monkeypatch.setattr(lifecycle.time, "perf_counter", lambda: next(ticks))
    loop = Loop()
    assert loop.forward_begin() == "ran" and loop.forward_begin() == "ran"
    assert loop.hook_clock.ms == {"forward_begin": pytest.approx(750.0)}
    assert loop.hook_clock.calls == {"forward_begin": 2}


@pytest.mark.parametrize("engine, expected", [
    ({}, "in 4 chunks of 4 MiB;"),  # whole step: each state tensor a unit of its own
    # streamed: a parameter's state larger than half a chunk is packed tensor by tensor, too
    ({"chunked_step": True}, "in 4 chunks of 4 MiB;"),
    ({"per_step": False}, "in 4 chunks of up to 4 MiB;"),  # phase switches only: no padding
], ids=["whole-step", "streamed-step", "phase-switches"])
def test_start_up_line_gives_the_chunk_size_used(engine, expected):
    """A state tensor is never split: a tensor larger than `--offload-chunk-size-mb` (here a 4 MB
    master and its two 4 MB moments against 1 MiB asked) is a chunk of its own, and per-step
    offloading pads every chunk's buffer to the largest. The start-up line gives the size used,
    not the one asked for."""
    opt = FakeDistOpt(bf16_numels=(1_000_000, 1000, 64))
    opt.step()  # (the moments exist)
    coord = make_coord(chunk_bytes=2**20, **engine)
    coord.add_optimizer(opt)
    coord.offload_existing_state()
    chunks = coord.offloaders[0].chunks
    big = {st.name for c in chunks for st in c.tensors if st.name.startswith("group0.param2.")}
    assert len(big) == 3
    homes = [c.index for c in chunks for st in c.tensors if st.name in big]
    assert len(homes) == 3 and len(set(homes)) == 3, homes
    sizes = {c.gpu_nbytes for c in chunks}
    assert (len(sizes) == 1) == engine.get("per_step", True), sizes
    line = coord.describe()
    assert expected in line, line
    coord.close()
