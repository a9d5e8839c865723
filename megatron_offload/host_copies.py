"""The checkpoint host-copy protocol of `OptimizerStateOffloader` (a mixin over its state): readers
and writers outside the step use the pinned host copies of offloaded chunks in place of the freed
GPU storage (exposed), and the offloader checks afterwards whether the state objects are still the
ones it packed.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .chunks import ChunkState
from .discovery import OFFLOADED_STATE_KEYS, StateTensor, master_ids
from .save_snapshot import Fp32


def _state_key(st: StateTensor) -> str:
    """The optimizer's name of `st`'s state (exp_avg, exp_avg_sq, master_param)."""
    return st.name.rsplit(".", 1)[1]


def _scales_of(inner, st: StateTensor):
    """The inner optimizer's scales dict of `st`'s parameter if `st` is a TE fp16 state stored
    scaled (the dict holds its scale under `st`'s key), else None."""
    scales, dtypes = getattr(inner, "_scales", None), getattr(inner, "name_to_dtype_map", None)
    if not isinstance(scales, dict) or not isinstance(dtypes, dict) or st.param is None:
        return None
    per_param, key = scales.get(st.param), _state_key(st)
    return per_param if dtypes.get(key) == torch.float16 and per_param and key in per_param else None


def _as_fp32(inner, st: StateTensor) -> Optional[Fp32]:
    """How an asynchronous save serves `st` as fp32 (TE's `get_unscaled_state` of it), or None to
    snapshot it as it is: fp16 states, times their scale (while exposed, the host copy
    `_scales_to_host` put in its place), and bf16 states, which TE unscales by conversion alone."""
    per_param = _scales_of(inner, st)
    if per_param is not None and st.tensor.dtype == torch.float16:
        return Fp32(per_param[_state_key(st)])
    dtypes = getattr(inner, "name_to_dtype_map", None)
    if (isinstance(dtypes, dict) and hasattr(inner, "get_unscaled_state") and st.param is not None
            and dtypes.get(_state_key(st)) == torch.bfloat16 and st.tensor.dtype == torch.bfloat16):
        return Fp32(None)
    return None


class _Served(NamedTuple):
    """A state served as an fp32 snapshot while its chunk is on the host (`_serve_unscaled`)."""

    tensor: torch.Tensor  # the state tensor (pointing at its host copy)
    # Its version counter then: an in-place write since makes the snapshot stale. (The tensors of
    # one chunk may share a counter: a write to any of them ends the serving of all, which is safe.)
    version: int
    key: str
    scale: Optional[torch.Tensor]  # fp16: the host copy of the scale the snapshot used
    alias: torch.Tensor  # the snapshot, as handed to readers

    def current(self, inner, param, skip_unscale: bool = False) -> bool:
        """Whether the snapshot is what TE's method would return now: the same state tensor,
        unwritten, with the same scale (fp16); bf16 asked without `skip_unscale` (which TE
        answers with the bf16 state itself)."""
        if inner.state[param].get(self.key) is not self.tensor or self.tensor._version != self.version:
            return False
        if self.scale is None:
            return not skip_unscale
        return inner._scales[param].get(self.key) is self.scale


class HostCopies:
    """Readers and writers on the host copies of offloaded chunks (module docstring)."""

    def expose_host_copies(self, for_async_writer: bool = False, repoint: bool = False,
                           references_only: bool = False) -> int:
        """Let readers see OFFLOADED state where it is, on the host: point those chunks' tensors
        at their host copies (CPU views of the pinned buffer) instead of bringing them back. A
        checkpoint save then needs no GPU memory and no H2D for them. The tensors stay there
        until the next forward (`hide_host_copies`) or reload (`start_copy_in`), so a save that
        reads them after the reader returned (dist-checkpointing writes after
        `sharded_state_dict`) still finds them. Returns the number of chunks exposed.

        An asynchronous save's writer runs on after the next copy-outs rewrote the pinned buffer:
        it must not keep these views. dist-checkpointing's writers clone every CPU tensor that is
        a view of a larger storage while the save runs (`FileSystemWriterAsync.
        prepare_write_data`), and every view here is (host_buffer.PinnedHostBuffer keeps a tail
        that no view covers); tests/unit/test_async_save_cpu.py checks it on megatron-core.
        `for_async_writer` spares the writer that copy (and its worker queue's second one): large
        tensors point at shared-memory snapshots of their host copies instead
        (save_snapshot.SaveSnapshots), which it maps as they are. `repoint` (a writer): chunks
        exposed already point at their host copies again first (below). Readers that unscale
        TE's fp16 states get host copies of the scales too (`_scales_to_host`).
        `references_only` (with `for_async_writer` and background snapshots): the reader only
        collects references, so the copy-out still in flight and the snapshots' fill finish in
        the background ([Note: background fill] in save_snapshot.py). Where the sets are filled
        from the GPU (`SaveSnapshots.device_fill`), COPYING_OUT chunks are exposed too, still on
        the GPU: their tensors point at snapshots copied from there, and the next forward frees
        them as after any step ([Note: device fill])."""
        offloaded = self.chunks_in(ChunkState.OFFLOADED)
        in_place = for_async_writer and references_only and self.snapshots.device_fill
        if repoint:
            # Why: a writer rewrites the host copies that a background fill may still be reading.
            self.snapshots.wait_filled()
            # Chunks still exposed to an earlier asynchronous save may point at its snapshots,
            # which its writer may still be reading: a writer (a load, the masters' refresh)
            # writes into the host copies themselves, which are the state, and unscaled
            # snapshots would go stale. (A reader leaves them: one nested in a save, e.g.
            # `state_dict` inside `sharded_state_dict`, must not turn the save's snapshots back
            # into views.)
            for chunk in offloaded:
                if chunk.on_host:
                    self._point_at(chunk, chunk.host)
                    self._stop_serving_unscaled(chunk)
        chunks = [c for c in (self.chunks_in(ChunkState.OFFLOADED, ChunkState.COPYING_OUT) if in_place else offloaded)
                  if not c.on_host]
        if not chunks:
            return 0
        background = for_async_writer and references_only and self.snapshots.background
        device_copies = None
        if in_place:
            self.snapshots.forget_claim()  # (a claim of an earlier save that failed before its take)
            device_copies = self._snapshot_from_device([c for c in chunks if c.state is ChunkState.COPYING_OUT], chunks)
        copied_out = None
        cuda = self.device.type == "cuda"
        if cuda or device_copies is not None:
            # Why: the host is about to read the copies itself. The compute stream waited for
            # them before the chunks were freed; the host never did. (A background fill waits
            # in its own thread, for everything enqueued on the D2H stream until now, and for
            # the copies into its snapshots that the feeder enqueues later.)
            if background:
                event, device = (self.streams.d2h.record_event(), self.device) if cuda else (None, None)

                def copied_out():  # (in the fill's thread: on this rank's device, not device 0)
                    if event is not None:
                        torch.cuda.set_device(device)
                        event.synchronize()
                    if device_copies is not None:
                        # (released now, then at the feeder's pace: flushing them would queue
                        # them all at once, and later device reads would wait behind them)
                        device_copies.synchronize(flush=False)
            else:
                if cuda:
                    self.streams.d2h.synchronize()
                if device_copies is not None:
                    device_copies.synchronize()
        for chunk in chunks:
            # The scales first: their device copy may fail, before anything points at the host.
            self._scales_to_host(chunk)
            # The GPU views (of the freed, zero-size storage, or of the live one of a chunk still
            # COPYING_OUT) cannot be sliced anew while it is freed: keep them for `hide_host_copies`.
            chunk.gpu_views = [st.tensor.data for st in chunk.tensors]
            self._point_at(chunk, chunk.host)
            chunk.on_host = True
        if for_async_writer and not self._point_at_snapshots(chunks, copied_out, background) and copied_out:
            copied_out()  # (no free set: the writer gets views of the host copies, read at once)
        return len(chunks)

    def prepare_snapshots(self) -> bool:
        """Make the snapshot set that an asynchronous save of the whole state will take
        (`_point_at_snapshots` after `send_out_now`: every chunk, in order), before any save."""
        return self.snapshots.prepare([st.tensor for c in self.chunks for st in c.tensors
                                       if self.snapshots.selects(st.tensor)], self._unscaled_layout())

    def _point_at_snapshots(self, chunks, copied_out=None, background: bool = False) -> bool:
        """The large tensors of `chunks` (pointing at their host copies) point at shared-memory
        snapshots of them instead, where a set is free or can be made (else they stay views:
        returns False). `copied_out`: what the fill waits for first; `background`: it fills in
        a thread (save_snapshot.SaveSnapshots.take).

        TE's fp16 and bf16 states are never read as they are: every reader asks
        `get_unscaled_state`, which makes a private fp32 tensor of each on the host (the writer's
        queue then copies it into shared memory while training waits). For them the set holds
        the fp32 values instead, and `get_unscaled_state` returns that snapshot
        (`_serve_unscaled`); the state tensor keeps pointing at its host copy."""
        inner = getattr(self.dist_opt, "optimizer", None)
        large = [(c, st) for c in chunks for st in c.tensors if self.snapshots.selects(st.tensor)]
        as_fp32 = [_as_fp32(inner, st) for _, st in large]
        copies = (self.snapshots.take([st.tensor.data for _, st in large], as_fp32, before=copied_out, background=background)
                  if large else None)
        for (chunk, st), copy, fp32 in zip(large, copies or [], as_fp32):
            if fp32 is None:
                st.tensor.data = copy
            else:
                self._serve_unscaled(chunk, st, copy, fp32)
        return copies is not None

    def _unscaled_layout(self) -> list:
        """Which of the tensors `prepare_snapshots` lists `_point_at_snapshots` will serve as fp32."""
        inner = getattr(self.dist_opt, "optimizer", None)
        return [_as_fp32(inner, st) is not None for c in self.chunks for st in c.tensors
                if self.snapshots.selects(st.tensor)]

    def _serve_unscaled(self, chunk, st: StateTensor, snapshot: torch.Tensor, fp32: Fp32) -> None:
        """Until `chunk` leaves the host, the inner optimizer's `get_unscaled_state` returns
        `snapshot` for `st` while it is still current (`_Served.current`) and asks the original
        method for everything else. The wrapper is an instance attribute, removed with the last
        served tensor (`_stop_serving_unscaled`)."""
        inner = self.dist_opt.optimizer
        if not self._unscaled:
            original = inner.get_unscaled_state
            served = self._unscaled

            def get_unscaled_state(param, state_name, *a, **k):
                found = served.get((id(param), state_name))
                if found is not None and found.current(inner, param, *a, **k):
                    return found.alias
                if getattr(inner, "name_to_dtype_map", {}).get(state_name) != torch.float32:
                    # Why: TE converts 16-bit states on the host, reading a host copy or snapshot
                    # that a background fill may not have finished (fp32 ones it returns as they are).
                    self.snapshots.wait_filled()
                return original(param, state_name, *a, **k)

            get_unscaled_state.megatron_offload_original = inner.__dict__.get("get_unscaled_state")
            inner.get_unscaled_state = get_unscaled_state
        key = (id(st.param), _state_key(st))
        # Why an alias: readers keep what they are given, and only a new tensor object on the
        # storage counts as a user of the set (`SnapshotSet.in_use`); the set's own object does not.
        self._unscaled[key] = _Served(st.tensor, st.tensor._version, _state_key(st), fp32.scale, snapshot.detach())
        chunk.served_unscaled.append(key)

    def _stop_serving_unscaled(self, chunk) -> None:
        for key in chunk.served_unscaled:
            self._unscaled.pop(key, None)
        chunk.served_unscaled = []
        inner = getattr(self.dist_opt, "optimizer", None)
        wrapper = getattr(inner, "__dict__", {}).get("get_unscaled_state")
        if not self._unscaled and hasattr(wrapper, "megatron_offload_original"):
            if wrapper.megatron_offload_original is None:
                del inner.get_unscaled_state  # (the class's method again)
            else:
                inner.get_unscaled_state = wrapper.megatron_offload_original

    def _scales_to_host(self, chunk) -> None:
        """Host copies of the scales that readers multiply `chunk`'s tensors by, while the chunk is
        read on the host. Transformer Engine's FusedAdam stores fp16 states (moments with
        --exp-avg-dtype/--exp-avg-sq-dtype fp16, masters with --main-params-dtype fp16) scaled,
        and every reader unscales them with `get_unscaled_state` (TE's own `state_dict`,
        megatron-core's `_get_main_param_and_optimizer_states`): `state.float().mul_(scale)`,
        the scale an fp32 `[1]` tensor in `optimizer._scales[param][key]` on the GPU, which a
        host tensor cannot be multiplied by. With a host copy of the scale the reader multiplies
        on the host; one fp32 multiply rounds the same there, so the save is bit-identical. (TE
        keeps scales for bf16 states too but never reads them outside its step: those stay.)
        Invariant: the optimizer's own scale tensors are back (`_scales_back`) whenever the chunk
        stops being on the host (reload or hide), i.e. before any step, which updates them on
        the GPU; a step that met a host scale would fail loudly, never use a stale one."""
        inner = getattr(self.dist_opt, "optimizer", None)
        assert not chunk.gpu_scales, chunk  # (never swapped twice: a copy is not the scale to restore)
        found = []
        for st in chunk.tensors:
            per_param = _scales_of(inner, st)
            if per_param is not None:
                found.append((per_param, _state_key(st), per_param[_state_key(st)]))
        # Every copy made before any is installed (a failing copy leaves none swapped).
        copies = [scale.to("cpu", copy=True) for _, _, scale in found]
        for (per_param, key, scale), copy in zip(found, copies):
            per_param[key] = copy
            chunk.gpu_scales.append((per_param, key, scale, copy))

    @staticmethod
    def _scales_back(chunk) -> None:
        """Undo `_scales_to_host`: the very scale tensors the optimizer made, on the GPU. (A scale
        that something replaced meanwhile, e.g. an optimizer load outside the plugin's wrappers,
        is newer than ours: it stays.)"""
        for per_param, key, scale, copy in chunk.gpu_scales:
            if per_param.get(key) is copy:
                per_param[key] = scale
        chunk.gpu_scales = []

    def host_writes_supported(self) -> bool:
        """Whether a writer of the whole state (a torch_dist checkpoint load) can run
        on the host copies (`expose_host_copies`) and leave the tensors it wrote where they are.

        That holds where the writer writes into the state tensors rather than replacing them, and
        keeps them where they are: torch Adam/AdamW (the optimizer megatron-core uses without TE
        or Apex), whose `load_state_dict` moves each state tensor to its parameter's device and
        dtype, i.e. keeps ours if the parameter is a master that is on the host too. So: every
        offloaded moment belongs to an offloaded master (not to an fp32 model parameter, which
        stays on the GPU), nothing is kept resident by `fraction`, no fused/capturable Adam (their
        `step` follows the parameter's device). TE FusedAdam rebuilds its state on load: no."""
        inner = getattr(self.dist_opt, "optimizer", None)
        if inner is None or type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            return False
        if self.kept or not self.chunks:
            return False
        if any(group.get("fused") or group.get("capturable") for group in inner.param_groups):
            return False
        masters = master_ids(self.dist_opt)  # (all offloaded: nothing is kept)
        return all(id(st.param) in masters for c in self.chunks for st in c.tensors)

    def send_out_now(self) -> None:
        """Every chunk OFFLOADED with a current host copy, without allocating on the GPU: the
        chunks still resident are copied out if their host copy is stale and freed, those coming
        back (their host copy is what they load) are freed once their H2D is done. The host does
        not wait here; `expose_host_copies` does."""
        self.settle_unmodified()  # COPYING_IN / RESIDENT -> COPYING_OUT, D2H where stale
        self.free(self.chunks_in(ChunkState.COPYING_OUT))

    def _snapshot_from_device(self, on_gpu, listed):
        """Enqueue the copies of `on_gpu`'s tensors (COPYING_OUT: their GPU buffers hold the
        values, and the compute stream is ordered after anything still writing them) into the
        snapshot set that `_point_at_snapshots(listed)` takes next, on the D2H stream after the
        chunks' own copy-outs; the chunks' `ready` then covers both, so that whoever frees them
        holds the compute stream until the GPU buffers have been read ([Note: device fill] in
        save_snapshot.py). With the copy feeder they are fed like copy-outs, in the order the
        chunks are freed, and what waits for them is returned (else None: the D2H stream's event
        covers them). The copy-outs of the chunks whose host copies the fill reads (not on the GPU,
        TE's 16-bit states served as fp32, or every chunk where no copy was enqueued) are
        enqueued now, before the caller's event."""
        inner = getattr(self.dist_opt, "optimizer", None)
        ids = {id(c) for c in on_gpu}
        large = [(c, st) for c in listed for st in c.tensors if self.snapshots.selects(st.tensor)]
        unscaled = [_as_fp32(inner, st) is not None for _, st in large]
        sources = [st.tensor.data if id(c) in ids and not u else None for (c, st), u in zip(large, unscaled)]
        host_read = {id(c) for (c, _), src in zip(large, sources) if src is None}
        self.flush_copy_out([c for c in listed if id(c) in host_read])
        if not any(src is not None for src in sources):
            return None
        likes = [st.tensor for _, st in large]
        if self.feeder is not None:
            fed = []

            def enqueue(copies):
                copies = sorted(copies, key=lambda copy: -large[copy[0]][0].address)  # (the free order)
                # Held until the fill's thread waits for them (it starts once the save's request is
                # with the writer): queued at once, they would delay the save's own device reads.
                fed.append(self.feeder.submit_copies([(large[i][0], dst, src) for i, dst, src in copies], held=True))
                return fed[0]

            self.snapshots.copy_from_device(likes, unscaled, sources, enqueue)
            if fed:
                return fed[0]
            # Nothing copied from the device (no set, or one not page-locked): the writer reads
            # every chunk's host copy, whose copy-out must come before the caller's event.
            self.flush_copy_out(listed)
            return None
        s = self.streams
        with s.on_d2h() as stream:
            # Why: the copies read what the step (or an H2D the compute stream waited for) wrote.
            s.d2h_wait_for_compute()
            s.delay(stream)  # (tests: copy-stream delays)
            timer = s.stats.start_copy(stream, "d2h")
            nbytes = self.snapshots.copy_from_device(likes, unscaled, sources)
            if not nbytes:
                return None
            ready = s.record(stream)
            s.stats.end_copy(timer, stream, nbytes)
        for chunk in on_gpu:
            chunk.ready = ready  # (one D2H stream: the later event covers the chunk's own copy-out)
        return None

    def accept_host_writes(self) -> None:
        """A writer has run on the exposed host copies (`host_writes_supported`): what it wrote
        is in the pinned buffer, which is now the state. The chunks stay OFFLOADED; their host
        copies are current, so the next reload brings the written values and no D2H is owed."""
        if not self._state_tensors_unchanged():
            raise RuntimeError(
                f"megatron-offload: a writer of {self.name}'s optimizer state replaced state tensors "
                "while they were on the host; the state cannot be trusted. Please report this with "
                "your optimizer configuration.")
        for chunk in self.chunks:
            assert chunk.state is ChunkState.OFFLOADED and chunk.on_host, chunk
            chunk.host_valid = True
        self._signature = self.state_signature()

    def _state_tensors_unchanged(self) -> bool:
        """Whether the inner optimizer holds exactly the state tensors we packed (same objects)."""
        inner = self.dist_opt.optimizer
        masters = master_ids(self.dist_opt)
        current = set()
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) in masters:
                    current.add(id(p))
                for key, value in inner.state.get(p, {}).items():
                    if key in OFFLOADED_STATE_KEYS and isinstance(value, torch.Tensor):
                        current.add(id(value))
        return current == {id(st.tensor) for c in self.chunks for st in c.tensors}

    def hide_host_copies(self) -> int:
        """Undo `expose_host_copies` for chunks still OFFLOADED (or still COPYING_OUT, exposed in
        place): point their tensors back at the (freed) GPU buffer. Called once the reader is
        certainly done (the next forward), because code outside the step treats the state as GPU
        tensors even while its storage is freed: `DistributedOptimizer.step` assigns each master
        its `.grad` (a CUDA tensor) before the inner step reloads it, which fails on a CPU view
        (the first step after a save, with a chunked step whose budget leaves chunks off; see
        [Note: host views and .grad] in docs/design.md). The optimizer's own scales come back too
        (`_scales_back`). Returns the number of chunks hidden."""
        chunks = [c for c in self.chunks if c.on_host]
        for chunk in chunks:
            for st, view in zip(chunk.tensors, chunk.gpu_views):
                st.tensor.data = view
            self._off_host(chunk)
        return len(chunks)

    def _off_host(self, chunk) -> None:
        """`chunk`, its tensors pointing at GPU memory again (hidden or reloaded), stops being read
        on the host: the optimizer's own scales come back with it (`_scales_back`)."""
        self._stop_serving_unscaled(chunk)
        self._scales_back(chunk)
        chunk.gpu_views = None
        chunk.on_host = False

    @staticmethod
    def _place(st: StateTensor, tensor: torch.Tensor) -> None:
        """Replace a placeholder by `tensor` in its state dict (nothing else refers to it)."""
        st.owner[st.key] = tensor
        st.tensor, st.owner, st.key = tensor, None, None
