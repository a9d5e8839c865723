"""A GPT pretraining entry point shaped like Megatron-LM core_r0.19's pretrain_gpt.py, on mock data.

It parses arguments with `parse_and_validate_args` and calls `pretrain(cfg_container, ...)`, exactly
the two calls megatron-offload hooks in the upstream script; it knows nothing about offloading.
On megatron-core 0.17 and 0.18, which lack 0.19's helpers, it calls `pretrain` as those releases'
own pretrain_gpt.py does instead (see `main`).
Launch it through the plugin's launcher:

    torchrun --nproc-per-node 2 -m megatron_offload scripts/pretrain_gpt_mock.py <megatron args>

Only the pip wheel of megatron-core is needed (no Megatron-LM checkout, no dataset files).

With MEGATRON_OFFLOAD_RECORD=<dir> set, every rank writes <dir>/rank<N>.json: the loss of every
iteration (as exact float hex), per-iteration wall time, per-iteration peak allocated/reserved
memory (peak stats are reset before each iteration; the peak before the first one is kept as
`startup_peak`) and a SHA-256 digest of the final model parameters and optimizer state (skipped with
MEGATRON_OFFLOAD_NO_DIGEST=1). Tests and benchmarks compare those files; the recording adds one
compute-stream synchronisation per iteration.

With MEGATRON_OFFLOAD_NATIVE_ROUNDTRIP=1 the optimizer step is wrapped in megatron-core's own
`restore_from_cpu()` / `offload_to_cpu()` (the benchmark's `native-offload` variant).

With MEGATRON_OFFLOAD_MEMHIST=<N>, every rank also records the caching allocator's history from
start-up to the end of iteration N and writes it compactly to <dir>/memhist_rank<R>.npz (every
alloc/free/segment event with address, size and stream; marker allocations of
512 * (1000 + 4 * iteration + k) bytes tag iteration begin (k=0), step begin (1) and step end (2),
and of 512 * (100 + 2 * microbatch + b) bytes each microbatch's forward (b=0) and backward (b=1)).
Analyse it with scripts/alloc_trace.py.
"""

import contextlib
import hashlib
import dataclasses
import gc
import json
import os
import sys
import time
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_attr_wrapped_model
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, pretrain
from megatron.training.utils import is_first_or_last_pipeline_stage

# `pretrain` changed shape in each supported release; the installed release's own helpers are used
# where it has them (see `main`):
try:  # 0.19: the model is described by a GPTModelConfig in the config container
    from megatron.training.argument_utils import gpt_config_from_args
except ImportError:  # 0.17, 0.18: no GPTModelConfig; pretrain takes `model_provider` below
    gpt_config_from_args = None
try:  # 0.18 and later: the script parses the arguments and builds the config container
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
except ImportError:  # 0.17: pretrain parses the arguments itself (initialize_megatron)
    pretrain_cfg_container_from_args = parse_and_validate_args = None

BATCH_KEYS = (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32),
              ("position_ids", torch.int64))


def get_batch(data_iterator, vp_stage=None):
    """Tokens, labels, loss mask, (no) attention mask, position ids; TP rank 0 reads and broadcasts."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = [data[key].to("cuda", dtype, non_blocking=True) for key, dtype in BATCH_KEYS]
    else:
        shape = (args.micro_batch_size, args.seq_length)
        batch = [torch.empty(shape, dtype=dtype, device="cuda") for _, dtype in BATCH_KEYS]
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        for t in batch:
            torch.distributed.broadcast(
                t,
                parallel_state.get_tensor_model_parallel_src_rank(),
                group=parallel_state.get_tensor_model_parallel_group(),
            )
    tokens, labels, loss_mask, position_ids = batch
    return tokens, labels, loss_mask, None, position_ids


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    # The model chunk is wrapped (DDP, Float16Module): its virtual stage is on the inner module.
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def gpt_layer_spec(config, vp_stage=None):
    """The layer spec megatron-core 0.19's GPTModelBuilder picks (default_layer_spec), for 0.17 and
    0.18 (no GPTModelConfig there), for the models this project runs: dense or MoE, local or TE
    layers (not reproduced: experimental attention, heterogeneous, inference or ModelOpt specs)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = config.transformer_impl == "transformer_engine"
    if config.num_moe_experts is not None:
        return specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage)
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
            qk_l2_norm=config.qk_l2_norm, use_te_activation_func=config.use_te_activation_func)
    return specs.get_gpt_layer_local_spec(
        qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
        normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """The GPT model on megatron-core 0.17 and 0.18, whose `pretrain` takes a model provider (called
    with these keywords) instead of 0.19's GPTModelConfig: the model 0.19's GPTModelBuilder builds
    from the same arguments."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if args.spec is not None or args.yaml_cfg is not None or args.mtp_num_layers is not None:
        raise NotImplementedError("pretrain_gpt_mock.py on megatron-core < 0.19: no --spec, --yaml-cfg or MTP")
    if config is None:
        config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config, transformer_layer_spec=gpt_layer_spec(config, vp_stage), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage, pg_collection=pg_collection,
    )


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split="99,1,0",
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )

    def built_on_this_rank():
        return is_first_or_last_pipeline_stage(vp_stage) and (
            parallel_state.get_tensor_model_parallel_rank() == 0
        )

    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, built_on_this_rank, config
    ).build()


# ------------------------------------------------------------------------------------------------
# Optional recording for tests and benchmarks (MEGATRON_OFFLOAD_RECORD=<dir>)
# ------------------------------------------------------------------------------------------------
def distributed_optimizers(opt):
    """The non-stub DistributedOptimizers inside a (nested) ChainedOptimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if hasattr(opt, "chained_optimizers"):
        for sub in opt.chained_optimizers:
            yield from distributed_optimizers(sub)
    elif isinstance(opt, DistributedOptimizer) and not opt.is_stub_optimizer:
        yield opt


def _from_coordinator(read, default=0):
    """`read(coordinator)` of this process's megatron-offload, or `default` without one."""
    try:
        from megatron_offload import megatron_wiring
    except ImportError:
        return default
    coord = megatron_wiring.coordinator
    return read(coord) if coord is not None else default


def _offloaded_bytes_now():
    """GPU bytes of megatron-offload's chunks that are off the GPU right now."""
    def read(coord):
        from megatron_offload import ChunkState

        return coord.bytes_in(ChunkState.OFFLOADED)

    return _from_coordinator(read)


def _snapshot_bytes():
    """Host bytes of megatron-offload's shared-memory snapshots for asynchronous saves."""
    return _from_coordinator(lambda coord: coord.snapshot_bytes)


def _snapshot_fill_wait_seconds():
    """Host seconds megatron-offload waited for background snapshot fills, in all."""
    return _from_coordinator(lambda coord: coord.snapshot_fill_wait_seconds, 0.0)


def _snapshot_device_bytes():
    """Snapshot bytes megatron-offload's saves copied from the GPU ([Note: device fill]), in all."""
    return _from_coordinator(lambda coord: sum(off.snapshots.device_bytes for off in coord.offloaders), 0)


def _snapshot_collect_seconds():
    """megatron-offload's host time in garbage collections that freed a snapshot set, so far."""
    return _from_coordinator(lambda coord: coord.snapshot_collect_seconds, 0.0)


def _host_read_seconds():
    """megatron-offload's host time preparing host reads so far."""
    return _from_coordinator(lambda coord: coord.host_read_seconds, 0.0)


def write_gpu_timeline(profiler, path):
    """The profiled iteration's GPU activity, compactly: [start us, duration us, stream, kind,
    bytes or 0, name] per kernel / memcpy / memset, from the profiler's trace (what a timeline
    viewer would show, small enough to bring back from a lent machine)."""
    import gzip
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        profiler.export_chrome_trace(tmp.name)
        trace = json.load(open(tmp.name))
    rows = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        args = e.get("args", {})
        rows.append([e["ts"], e["dur"], args.get("stream", e.get("tid")), cat,
                     args.get("bytes", 0), e.get("name", "")[:100]])
    rows.sort()
    with gzip.open(path, "wt") as f:
        json.dump(rows, f)


_MARKER_STREAM = []

# Milliseconds the cyclic garbage collector has run in this process so far (gc.callbacks), and
# its collections so far: per generation, and the objects the full (generation 2) ones collected.
_GC_CLOCK = [0.0, None]
_GC_COUNTS = {"gc_gen0": 0, "gc_gen1": 0, "gc_full": 0, "gc_full_collected": 0}


def _tensor_forms(state):
    """Count and bytes of the tensors a sharded state dict hands to dist-checkpointing, by form:
    `cuda`, `cpu_shared` (a whole shared-memory storage: the worker maps it), `cpu_view` (part of a
    larger storage: cloned while training waits), `cpu_private` (a whole private storage: the
    worker's queue moves it into shared memory), and `factories` (ShardedTensorFactory: the save
    builds its tensors from `.data`; counted with that tensor's bytes). Every tensor handed to the
    save is counted, replicas this rank does not write included."""
    forms = {}

    def add(form, nbytes):
        count, total = forms.get(form, (0, 0))
        forms[form] = (count + 1, total + nbytes)

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif type(x).__name__ == "ShardedTensorFactory":  # (before `.data`: a factory has one too)
            t = getattr(x, "data", None)
            add("factories", t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0)
        elif isinstance(getattr(x, "data", None), torch.Tensor):
            t = x.data
            nbytes = t.numel() * t.element_size()
            if t.is_cuda:
                add("cuda", nbytes)
            elif t.untyped_storage().nbytes() != nbytes:
                add("cpu_view", nbytes)
            else:
                add("cpu_shared" if t.is_shared() else "cpu_private", nbytes)

    walk(state)
    return {k: {"count": c, "bytes": b} for k, (c, b) in forms.items()}


@contextlib.contextmanager
def _save_parts():
    """Seconds of one `save_checkpoint` spent in building the state dict, in dist_checkpointing.save
    (planning, metadata exchange, clones of views) and in scheduling the asynchronous request (the
    worker queue's pickling and the worker's preload, which training waits for), with the forms of
    the tensors saved (`_tensor_forms`)."""
    import megatron.core.dist_checkpointing as dc
    import megatron.training.checkpointing as ckpt

    parts = {"state_dict_s": 0.0, "dist_save_s": 0.0, "schedule_s": 0.0}
    originals = {}

    def timed(module, name, key, census=False):
        fn = getattr(module, name, None)
        if fn is None:
            return
        originals[(module, name)] = fn

        def wrapper(*a, **k):
            if census:  # (timed apart: the caller takes it out of the save's seconds)
                t = time.perf_counter()
                state = a[0] if a else k.get("sharded_state_dict")
                parts["forms"] = _tensor_forms(state)
                parts["census_s"] = parts.get("census_s", 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            profiler = _save_profiler()
            try:
                return fn(*a, **k) if profiler is None else profiler.runcall(fn, *a, **k)
            finally:
                parts[key] += time.perf_counter() - t
                if profiler is not None:
                    _write_save_profile(profiler, key)
        setattr(module, name, wrapper)

    timed(ckpt, "generate_state_dict", "state_dict_s")
    timed(dc, "save", "dist_save_s", census=True)
    timed(ckpt, "schedule_async_save", "schedule_s")
    try:
        yield parts
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def _save_profiler():
    """A profiler for one timed part of a save where BENCH_PROFILE_SAVE names a folder (the
    profiler's own cost is in that save's seconds: time such runs apart)."""
    if not os.environ.get("BENCH_PROFILE_SAVE"):
        return None
    import cProfile
    return cProfile.Profile()


def _write_save_profile(profiler, key):
    """Appends the functions that took most of this part, cumulative and own time, to
    BENCH_PROFILE_SAVE/<key>_rank<R>.txt."""
    import io
    import pstats
    folder = os.environ["BENCH_PROFILE_SAVE"]
    os.makedirs(folder, exist_ok=True)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(folder, f"{key}_rank{rank}.txt"), "a") as f:
        f.write(f"==== {key} at {time.time():.3f}\n{text.getvalue()}\n")


def _gc_timer(phase, info):
    if phase == "start":
        _GC_CLOCK[1] = time.perf_counter()
    elif _GC_CLOCK[1] is not None:
        _GC_CLOCK[0] += (time.perf_counter() - _GC_CLOCK[1]) * 1e3
        _GC_CLOCK[1] = None
        gen = info.get("generation")
        _GC_COUNTS[("gc_gen0", "gc_gen1", "gc_full")[min(gen or 0, 2)]] += 1
        if gen == 2:
            _GC_COUNTS["gc_full_collected"] += info.get("collected", 0)


gc.callbacks.append(_gc_timer)


def _allocator_counters():
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_allocs": stats.get("num_device_alloc", 0),
            "device_frees": stats.get("num_device_free", 0)}


def _marker_allocation(nbytes):
    """A tiny allocation, freed at once, on a stream of its own: scripts/alloc_trace.py reads its
    size as a tag and, by its stream, never mistakes a real allocation of that size for one."""
    if not _MARKER_STREAM:
        _MARKER_STREAM.append(torch.cuda.Stream())
    with torch.cuda.stream(_MARKER_STREAM[0]):
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def memhist_marker(iteration, k):
    """Tags a point of the iteration in the allocator history."""
    _marker_allocation(512 * (1000 + 4 * (iteration or 0) + k))


def memhist_microbatch_marker(microbatch, backward):
    """Tags the start of a microbatch's forward or backward."""
    _marker_allocation(512 * (MICROBATCH_MARKER_BASE + 2 * microbatch + int(backward)))


MICROBATCH_MARKER_BASE = 100  # below every iteration marker (1000 + 4 * iteration + k); < 1 MiB: small pool


def _plugin_coordinator():
    """megatron-offload's coordinator, or None without it (looked up, not imported: a run without
    the plugin stays without it)."""
    return getattr(sys.modules.get("megatron_offload.megatron_wiring"), "coordinator", None)


def _plugin_exposed_so_far():
    """megatron-offload's (before free, before step) wait totals so far, or None without it. Read
    after the compute stream's sync at an iteration's end, so that iteration's waits are complete."""
    coord = _plugin_coordinator()
    return list(coord.streams.stats.exposed_so_far()) if coord is not None else None


def _plugin_hook_ms_so_far(hook=None):
    """Host ms spent in megatron-offload's lifecycle hooks so far (in `hook` alone, if named), or
    None without it."""
    coord = _plugin_coordinator()
    if coord is None:
        return None
    return coord.hook_clock.total_ms if hook is None else coord.hook_clock.ms.get(hook, 0.0)


def _plugin_host_lead_wait_ms_so_far():
    """Host ms the plugin's host-lead bound has held the host so far, or None without it."""
    coord = _plugin_coordinator()
    return coord.host_lead.wait_ms if coord is not None else None


# The benchmark's diagnostic modes (scripts/benchmark.py's '@' modifiers) as overrides of the
# plugin's OffloadConfig; the plugin itself reads no such variable.
DIAGNOSTIC_ENV = {
    "MEGATRON_OFFLOAD_RELEASE_AT": ("release_at", lambda v: frozenset(v.split(","))),
    "MEGATRON_OFFLOAD_WORKSPACE": ("keep_backward_workspace", lambda v: v != "0"),
    "MEGATRON_OFFLOAD_WORKSPACE_BY_POSITION": ("workspace_by_position", lambda v: v != "0"),
    "MEGATRON_OFFLOAD_BACKWARD_RELOADS": ("backward_reloads", lambda v: v != "0"),
    "MEGATRON_OFFLOAD_HOST_WAIT": ("host_waits_at_free", lambda v: v == "1"),
    "MEGATRON_OFFLOAD_FREE_COPIED": ("free_when_copied_out", lambda v: v == "1"),
    "MEGATRON_OFFLOAD_FREE_COPIED_FIRST": ("free_copied_before_forward", lambda v: v != "0"),
    "MEGATRON_OFFLOAD_HOST_LEAD": ("host_lead_layers", int),
    "MEGATRON_OFFLOAD_FALLBACK_RELEASE": ("release_before_unfitted_reload", lambda v: v != "0"),
    "MEGATRON_OFFLOAD_FALLBACK_RELEASE_ALL": ("fallback_release_every_iteration", lambda v: v == "1"),
    "MEGATRON_OFFLOAD_FORGET_LASTING": ("forget_lasting_growth", lambda v: v != "0"),
    "MEGATRON_OFFLOAD_LASTING_MARGIN": ("lasting_growth_margin", lambda v: v != "0"),
    # "run": the calibration under the run's own bound; a number: that many layers.
    "MEGATRON_OFFLOAD_CAL_HOST_LEAD": ("calibration_host_lead_layers", lambda v: None if v == "run" else int(v)),
    "MEGATRON_OFFLOAD_CAL_CAP": ("second_calibration_capped", lambda v: v != "0"),
    "MEGATRON_OFFLOAD_BACKGROUND_FILL": ("async_save_background_fill", lambda v: v != "0"),
}


def set_diagnostics_from_env():
    chosen = {field: parse(os.environ[var]) for var, (field, parse) in DIAGNOSTIC_ENV.items() if os.environ.get(var)}
    if chosen:  # (imports nothing of the plugin otherwise: isolating runs stay without it)
        from megatron_offload import megatron_args

        megatron_args.DIAGNOSTICS.update(chosen)
    threads, at_take = os.environ.get("MEGATRON_OFFLOAD_FILL_THREADS"), os.environ.get("MEGATRON_OFFLOAD_FILL_AT_TAKE")
    on_host = os.environ.get("MEGATRON_OFFLOAD_HOST_FILL")
    if threads or at_take == "1" or on_host == "1":  # (the benchmark's @fill8, @fillearly, @hostfill: module constants)
        from megatron_offload import save_snapshot

        if threads:
            save_snapshot.BACKGROUND_COPY_THREADS = int(threads)
        if at_take == "1":
            save_snapshot.BACKGROUND_FILL_AT_TAKE = True
        if on_host == "1":
            save_snapshot.DEVICE_FILL = False
    if os.environ.get("MEGATRON_OFFLOAD_DEVICE_READS") == "1":
        from megatron_offload import megatron_reads

        megatron_reads.ENABLED = False  # Megatron's own reductions after the step (@devreads)


def finish_iterations(iterations, losses):
    """At the end of a run: each iteration's loss (`losses`: index -> the loss train_step returned,
    kept on the GPU until now) as a float's hex, and its start-to-start `period_ms` (none for the
    last, which has no next start)."""
    for i, loss in losses.items():
        iterations[i]["loss"] = float(loss).hex()
    for it, following in zip(iterations, iterations[1:]):
        it["period_ms"] = (following["start_s"] - it["start_s"]) * 1e3


_SLEEP_CYCLES_PER_MS = []


def _gpu_sleep_ms(ms):
    """Keep the current stream busy for about `ms` milliseconds (the clock rate measured once)."""
    if not _SLEEP_CYCLES_PER_MS:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(10**7)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS.append(10**7 / max(begin.elapsed_time(end), 1e-3))
    torch.cuda._sleep(int(ms * _SLEEP_CYCLES_PER_MS[0]))


def _raw_tensors(t):
    """The bytes behind a tensor, for digests. A tensor subclass (TE's Float8Tensor with
    --fp8-param-gather) has no .numpy(): its inner tensors are what training keeps (the FP8 data
    and its scale), so they are hashed, in the order `__tensor_flatten__` declares them (else every
    tensor attribute, by name). A cache the subclass marks stale (`<name>_invalid`, TE's transpose)
    is left out: its bytes are not state."""
    t = t.detach()
    if type(t) is not torch.Tensor:
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
        else:
            names = sorted(k for k, v in vars(t).items() if isinstance(v, torch.Tensor))
        if names:
            for name in names:
                inner = getattr(t, name)
                if inner is not None and not getattr(t, f"{name}_invalid", False):
                    yield from _raw_tensors(inner)
            return
    yield t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


class Recorder:
    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.iterations = []
        self.model = None
        self.optimizer = None
        self.state_at = None
        self.startup_peak = None
        self.saves = []
        self._losses = {}  # iteration index -> the loss as train_step returned it (read at write())
        self._marks = None
        self.timelines = []  # one per marked iteration (MEGATRON_OFFLOAD_TIMELINE_AT)
        self.busy_timelines = []  # the same, the GPU made to lag the host first (MEGATRON_OFFLOAD_BUSY_AT)

    def install(self):
        import megatron.training.training as training

        set_diagnostics_from_env()

        train_step, train = training.train_step, training.train

        profile_iters = {int(x) for x in os.environ.get("MEGATRON_OFFLOAD_PROFILE_ITERS", "").split(",") if x}
        state_at = os.environ.get("MEGATRON_OFFLOAD_STATE_DIGEST_AT")
        # Iterations whose phases are marked: "10" or "10,11,12".
        timeline_at = {int(x) for x in os.environ.get("MEGATRON_OFFLOAD_TIMELINE_AT", "").split(",") if x}
        # Iterations marked after a GPU sleep long enough for the host to launch the forwards and
        # backwards ahead of the GPU: their phase durations are the GPU's own (the planner's
        # busy_ms; a phase that took longer in a normal iteration was bound by the host).
        busy_at = {int(x) for x in os.environ.get("MEGATRON_OFFLOAD_BUSY_AT", "").split(",") if x}
        import megatron.core.pipeline_parallel.schedules as schedules

        def marked(fn, phase):
            def wrapper(*a, **k):
                if self.memhist:
                    memhist_microbatch_marker(self._microbatches[phase], phase == "bwd")
                    self._microbatches[phase] += 1
                self.mark(f"{phase}_begin")
                out = fn(*a, **k)
                self.mark(f"{phase}_end")
                return out
            return wrapper

        schedules.forward_step = marked(schedules.forward_step, "fwd")
        schedules.backward_step = marked(schedules.backward_step, "bwd")

        memhist_until = int(os.environ.get("MEGATRON_OFFLOAD_MEMHIST", "0") or 0)

        def recording_train_step(*a, **k):
            iteration = k.get("iteration")
            if self.memhist:
                memhist_marker(iteration, 0)
                self._microbatches = {"fwd": 0, "bwd": 0}
                if iteration > memhist_until:
                    self.dump_memhist()
            if state_at is not None and iteration == int(state_at):
                self.state_at = {"iteration": iteration, **self.component_digests(a[3])}
            optimizer = a[3]
            if self.memhist and not getattr(optimizer, "_memhist_marked", False):
                step_fn = optimizer.step

                def marker_step(*x, **y):
                    memhist_marker(self._iteration, 1)
                    out = step_fn(*x, **y)
                    memhist_marker(self._iteration, 2)
                    return out

                optimizer.step = marker_step
                optimizer._memhist_marked = True
            self._iteration = iteration
            # (Sleep 1.5 x the fastest iteration so far that slept for no such purpose: longer
            # than the host needs to launch the forwards and backwards; none before the first.)
            earlier = [it["ms"] for it in self.iterations if not it.get("busy")] if iteration in busy_at else []
            busy = bool(earlier)
            timeline = busy or iteration in timeline_at
            if timeline:
                if busy:
                    _gpu_sleep_ms(1.5 * min(earlier) + 50)
                # Phase marks (CUDA events + allocated bytes) for the planner, one iteration.
                self._marks = []
                self.mark("iter_begin")
                self._pre_step_peak, self._step_peak = (0, 0), self._marks[0][2]
                step = optimizer.step

                def marked_step(*x, **y):
                    self._pre_step_peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
                    self.mark("step_begin")
                    torch.cuda.reset_peak_memory_stats()
                    out = step(*x, **y)
                    self.mark("step_end")
                    self._step_peak = torch.cuda.max_memory_allocated()
                    return out

                optimizer.step = marked_step
                inner_unmark = self._mark_first_inner_step(optimizer)
            profiler = None
            if iteration in profile_iters and torch.distributed.get_rank() == 0:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                profiler.__enter__()
            if self.startup_peak is None:
                self.startup_peak = {"max_allocated": torch.cuda.max_memory_allocated(),
                                     "max_reserved": torch.cuda.max_memory_reserved()}
            # Peaks per iteration (the run's peak is the max over these and the start-up peak).
            torch.cuda.reset_peak_memory_stats()
            counters = _allocator_counters()
            gc_before, gc_counts_before = _GC_CLOCK[0], dict(_GC_COUNTS)
            start = time.perf_counter()
            result = train_step(*a, **k)
            if profiler is not None:
                torch.cuda.synchronize()
                profiler.__exit__(None, None, None)
                with open(os.path.join(self.out_dir, f"profile_iter{iteration}.txt"), "w") as f:
                    f.write(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
                    f.write("\n")
                    f.write(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
                write_gpu_timeline(profiler, os.path.join(self.out_dir, f"gpu_timeline_iter{iteration}.json.gz"))
            # The compute stream only: a device-wide sync would also wait for megatron-offload's
            # copy-out, which by design overlaps the next iteration's forward.
            torch.cuda.current_stream().synchronize()
            peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            if timeline:
                optimizer.step = step
                inner_unmark()
                peaks = tuple(max(x, y) for x, y in zip(peaks, self._pre_step_peak))
                first, base = self._marks[0][1], self._marks[0][2]
                (self.busy_timelines if busy else self.timelines).append({
                    "iteration": iteration,
                    # The index of this iteration's record in `iterations` (appended below): Megatron's
                    # number starts at a loaded checkpoint's and skips `--iterations-to-skip`.
                    "record": len(self.iterations),
                    "marks": [(label, first.elapsed_time(ev), alloc) for label, ev, alloc in self._marks],
                    "step_peak_growth": self._step_peak - base,
                })
                self._marks = None
            loss = result[0].get("lm loss") if isinstance(result[0], dict) else None
            if loss is not None:
                # Read at write(), not here. Why: a read is a D2H copy, and it would wait behind
                # megatron-offload's copy-out in flight (host stalled, GPU idle), a cost that
                # Megatron's loop does not pay every iteration (it reads the loss at log intervals).
                self._losses[len(self.iterations)] = loss.detach().clone() if torch.is_tensor(loss) else loss
            self.iterations.append(
                {
                    "ms": (time.perf_counter() - start) * 1e3,
                    # perf_counter at the start: write() adds each iteration's start-to-start
                    # "period_ms" (Megatron's own work between train_step calls included).
                    "start_s": start,
                    "loss": None,
                    "skipped": int(result[1]),
                    "max_allocated": peaks[0],
                    "max_reserved": peaks[1],
                    # What explains a slow iteration (the soak's outliers): Python GC time, and the
                    # allocator's retries (cache flushed, then allocated again) and device
                    # allocations / frees (mapping growth) during the iteration.
                    "gc_ms": _GC_CLOCK[0] - gc_before,
                    **{k: v - gc_counts_before[k] for k, v in _GC_COUNTS.items()},
                    "busy": busy,  # (its time includes the GPU sleep)
                    **{k: v - counters[k] for k, v in _allocator_counters().items()},
                    # The plugin's compute-stream waits since the start, (before free, before step) ms:
                    # the benchmark takes the timed iterations' share (start-up offloads excluded).
                    "exposed_ms": _plugin_exposed_so_far(),
                    # The host time in the plugin's hooks since the start (the benchmark takes the
                    # timed iterations' share).
                    "hook_ms": _plugin_hook_ms_so_far(),
                    # Of it, `grads_finalizing` (its work runs before Megatron's finalize_model_grads,
                    # which enqueues the gradients' reduction unless --overlap-grad-reduce launched it in
                    # the backward), and the host-lead bound's waits (in the layer hooks): the benchmark
                    # prints both beside the GPU's gap before the step.
                    "finalize_host_ms": _plugin_hook_ms_so_far("grads_finalizing"),
                    "host_lead_wait_ms": _plugin_host_lead_wait_ms_so_far(),
                }
            )
            return result

        def recording_train(forward_step_func, model, optimizer, *a, **k):
            self.model, self.optimizer = model, optimizer
            if os.environ.get("MEGATRON_OFFLOAD_NATIVE_ROUNDTRIP"):
                # Megatron's own alternative (benchmark variant `native-offload`): state to the
                # CPU after every step, synchronously, and back before the next one.
                step = optimizer.step

                def roundtrip_step(*x, **y):
                    optimizer.restore_from_cpu()
                    out = step(*x, **y)
                    optimizer.offload_to_cpu()
                    return out

                optimizer.step = roundtrip_step
            try:
                out = train(forward_step_func, model, optimizer, *a, **k)
            except SystemExit:  # --exit-interval: train() exits from inside; record first
                self.write()
                raise
            if self.memhist:
                self.dump_memhist()
            if os.environ.get("MEGATRON_OFFLOAD_PHASE_BENCH"):  # benchmarks/tools/phase_switch_bench.py
                sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                "benchmarks", "tools"))
                import phase_switch_bench

                self.phase_bench = phase_switch_bench.measure(optimizer, int(os.environ["MEGATRON_OFFLOAD_PHASE_BENCH"]))
            self.write()
            return out

        save_checkpoint = training.save_checkpoint

        def recording_save_checkpoint(*a, **k):
            # Memory of a checkpoint save on its own: peak above what was allocated before it.
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            off_gpu = _offloaded_bytes_now()
            prep, collected, fill_waited = _host_read_seconds(), _snapshot_collect_seconds(), _snapshot_fill_wait_seconds()
            from_device = _snapshot_device_bytes()
            gc_before, gc_counts_before = _GC_CLOCK[0], dict(_GC_COUNTS)
            t0 = time.perf_counter()
            with _save_parts() as parts:
                out = save_checkpoint(*a, **k)
            # What training waits for (--async-save: the scheduling), less the census's own time.
            seconds = time.perf_counter() - t0 - parts.get("census_s", 0.0)
            self.saves.append({"allocated_before": before, "max_allocated": torch.cuda.max_memory_allocated(),
                               "seconds": seconds,
                               # of which the plugin's preparation of host reads (send-out, snapshots)
                               "plugin_seconds": _host_read_seconds() - prep,
                               # ... of which garbage collections that freed a snapshot set
                               "plugin_collect_seconds": _snapshot_collect_seconds() - collected,
                               # ... waits for background snapshot fills (SaveSnapshots.wait_filled: a
                               # reader's or a guard's; not the scheduling's own join, for a request
                               # without a preload function)
                               "plugin_fill_wait_seconds": _snapshot_fill_wait_seconds() - fill_waited,
                               # ... snapshot bytes copied from the GPU, not on the host
                               "plugin_device_fill_bytes": _snapshot_device_bytes() - from_device,
                               "snapshot_bytes": _snapshot_bytes(),  # shared memory for async saves, after it
                               "max_reserved": torch.cuda.max_memory_reserved(),
                               "offloaded_before": off_gpu,  # state bytes off the GPU when the save began
                               "after_iteration": len(self.iterations),
                               # Python's automatic collections inside the save (any process pays them)
                               "gc_ms": _GC_CLOCK[0] - gc_before,
                               "gc_full": _GC_COUNTS["gc_full"] - gc_counts_before["gc_full"],
                               # where the time went, and the forms of the tensors the save read
                               "parts": parts})
            return out

        training.train_step = recording_train_step
        training.train = recording_train
        training.save_checkpoint = recording_save_checkpoint

    memhist = False
    _iteration = 0
    _microbatches = {"fwd": 0, "bwd": 0}

    def start_memhist(self):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=2_000_000)
        self.memhist = True

    def dump_memhist(self):
        """Compact the allocator history into an npz (a pickle of it would be ~10x larger)."""
        import numpy as np

        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.memhist = False
        trace = snap["device_traces"][torch.cuda.current_device()]
        actions = sorted({e["action"] for e in trace})
        code = {a: i for i, a in enumerate(actions)}
        segments = [{k: v for k, v in seg.items() if k in ("address", "total_size", "stream", "segment_type",
                                                              "is_expandable", "allocated_size")}
                    for seg in snap["segments"] if seg.get("device", 0) == torch.cuda.current_device()]
        os.makedirs(self.out_dir, exist_ok=True)
        np.savez_compressed(
            os.path.join(self.out_dir, f"memhist_rank{torch.distributed.get_rank()}.npz"),
            action=np.array([code[e["action"]] for e in trace], dtype=np.int8),
            addr=np.array([e["addr"] for e in trace], dtype=np.int64),
            size=np.array([e["size"] for e in trace], dtype=np.int64),
            stream=np.array([e["stream"] for e in trace], dtype=np.int64),
            time_us=np.array([e["time_us"] for e in trace], dtype=np.int64),
            actions=np.array(actions),
            segments=np.array(json.dumps(segments)),
        )

    def _mark_first_inner_step(self, optimizer):
        """Mark "adam_begin" when the first inner optimizer's step is called (after Megatron's
        gradient norm and clipping: the planner's "step_prep" ends there). Wraps each inner
        optimizer's `step` as an instance attribute, which runs before the step's pre-hooks (so
        before megatron-offload's wait for its reload) and around an installed piecewise step.
        Returns what undoes it; a wrapper something else replaced meanwhile is left alone."""
        marked, wrapped = [False], []
        for dist_opt in distributed_optimizers(optimizer):
            inner = dist_opt.optimizer
            own = inner.__dict__.get("step")  # (None: the class's step)
            call = own if own is not None else inner.step

            def first_marked(*a, _call=call, **k):
                if not marked[0]:
                    marked[0] = True
                    self.mark("adam_begin")
                return _call(*a, **k)

            inner.step = first_marked
            wrapped.append((inner, own, first_marked))

        def undo():
            for inner, own, wrapper in wrapped:
                if inner.__dict__.get("step") is wrapper:
                    if own is None:
                        del inner.step
                    else:
                        inner.step = own
        return undo

    def mark(self, label):
        if self._marks is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((label, event, torch.cuda.memory_allocated()))

    def component_digests(self, optimizer):
        """Per-component SHA-256 of the optimizer state plus its scalar hyperparameters."""
        out = {}
        for i, dist_opt in enumerate(distributed_optimizers(optimizer)):
            inner = dist_opt.optimizer
            digests = {}
            for gi, group in enumerate(inner.param_groups):
                out[f"opt{i}.group{gi}"] = {k: (v if isinstance(v, (int, float, str, bool, type(None), tuple)) else str(v))
                                            for k, v in group.items() if k != "params"}
                for p in group["params"]:
                    items = [("param", p)] + sorted(inner.state.get(p, {}).items())
                    for key, t in items:
                        if isinstance(t, torch.Tensor):
                            h = digests.setdefault(key, hashlib.sha256())
                            for raw in _raw_tensors(t):
                                h.update(raw)
            for key, h in digests.items():
                out[f"opt{i}.{key}"] = h.hexdigest()
        return out

    def digest(self):
        """SHA-256 over model params and every optimizer state tensor, in a fixed order."""
        try:
            from megatron_offload import megatron_wiring

            coord = megatron_wiring.coordinator
        except ImportError:
            coord = None
        # Bring offloaded state back before reading it (accesses nest: the context closes them
        # last-opened first, which a chain of two DistributedOptimizers needs).
        access = (coord.state_access(coord.offloaders, will_modify=False) if coord is not None
                  else contextlib.nullcontext())
        params, state = hashlib.sha256(), hashlib.sha256()
        with access:
            for chunk in self.model:
                for name, p in chunk.named_parameters():
                    params.update(name.encode())
                    for raw in _raw_tensors(p):
                        params.update(raw)

            for dist_opt in distributed_optimizers(self.optimizer):
                inner = dist_opt.optimizer
                for group in inner.param_groups:
                    for p in group["params"]:
                        tensors = [p] + [v for k, v in sorted(inner.state.get(p, {}).items())
                                         if isinstance(v, torch.Tensor)]
                        for t in tensors:
                            for raw in _raw_tensors(t):
                                state.update(raw)
        return params.hexdigest(), state.hexdigest()

    def adam_state_bytes(self):
        """Bytes of Adam moments and fp32 master shards as the optimizer itself holds them (every
        state tensor but `step`, plus `shard_fp32_from_float16_groups`), counted independently of
        the plugin's discovery: what an offloading run should have taken off the GPU."""
        total = 0
        for dist_opt in distributed_optimizers(self.optimizer):
            for state in dist_opt.optimizer.state.values():
                total += sum(v.numel() * v.element_size() for k, v in state.items()
                             if isinstance(v, torch.Tensor) and k != "step")
            for group in getattr(dist_opt, "shard_fp32_from_float16_groups", None) or []:
                total += sum(t.numel() * t.element_size() for t in group if t is not None)
        return total

    def write(self):
        rank = torch.distributed.get_rank()
        finish_iterations(self.iterations, self._losses)
        if os.environ.get("MEGATRON_OFFLOAD_NO_DIGEST"):
            params_digest = state_digest = None
        else:
            params_digest, state_digest = self.digest()
        extra = {}
        try:
            from megatron_offload import megatron_wiring

            coord = megatron_wiring.coordinator
            if coord is not None:
                coord.harvest()  # fold what the log has not picked up yet into the run totals
                moved = coord.streams.stats.harvested
                extra = {
                    "transfer": {"d2h_gbps": moved.d2h_gbps, "h2d_gbps": moved.h2d_gbps,
                                 "exposed_d2h_ms": moved.exposed_d2h_ms, "exposed_h2d_ms": moved.exposed_h2d_ms,
                                 "iterations": len(self.iterations)},
                    "offloaded_bytes": coord.state_bytes,
                    "kept_bytes": sum(off.kept_bytes for off in coord.offloaders),
                    "chunk_count": sum(len(off.chunks) for off in coord.offloaders),
                    "auto_fraction": dataclasses.asdict(coord.auto_choice) if coord.auto_choice else None,
                    "auto_calibrations": coord.calibrations,
                    "step_budget_bytes": coord.step_budgets[-1] if coord.step_budgets else None,
                    # the most chunks a streamed step held for parameters split over several
                    "step_waiting": max(coord.step_waiting) if coord.step_waiting else None,
                    "pinned_bytes": coord.pinned_bytes,
                    "cumulative_d2h_bytes": coord.streams.stats.cumulative_d2h_bytes,
                    "cumulative_h2d_bytes": coord.streams.stats.cumulative_h2d_bytes,
                    "lifecycle_tail": coord.events[-12:],
                    "fit_checks": coord.fit_checks,
                    "fit_check_ms": coord.fit_check_ms,
                    "fit_skips": coord.fit_skips,  # answered by the allocator counters alone
                    # copy-out pieces enqueued by the host thread itself, not the feeder's (copy_feeder.py)
                    "feeder_flushed_pieces": coord.feeder.flushed_pieces if coord.feeder is not None else None,
                    "feeder_enqueued_pieces": coord.feeder.enqueued_pieces if coord.feeder is not None else None,
                    "reloads_deferred_for_fit": coord.reloads_deferred_for_fit,
                    "reloads_deferred_for_position": coord.reloads_deferred_for_position,
                    # first forwards that found memory kept for good since the last sample
                    # (MemoryPolicy._forget_lasting_growth)
                    "profile_relearned": coord.profile_relearned,
                    "profile_relearned_bytes": coord.profile_relearned_bytes,
                    # (iterations done, backward position of the iteration's first reload; -1: fallback;
                    # None: unknown, inside a recomputation)
                    "reload_starts": list(coord.reload_starts),
                    "backward_workspace": coord.backward_workspace,
                    # per backward interval, keyed by the hook position that began it (str: JSON keys)
                    "workspace_by_position": {str(k): v for k, v in coord.workspace_per_interval.items()},
                    "cache_releases": coord.cache_releases,
                    "cache_release_ms": coord.cache_release_ms,
                    "free_host_wait_ms": coord.free_host_wait_ms,
                    "host_lead_waits": coord.host_lead.waits,
                    "host_lead_wait_ms": coord.host_lead.wait_ms,
                    # host ms and calls per lifecycle hook over the whole run
                    "hook_host_ms": dict(coord.hook_clock.ms),
                    "hook_calls": dict(coord.hook_clock.calls),
                    # The first forward's activation growth per pacing hook (running max over the
                    # iterations since it was last learned again) and its peak: the budget's input,
                    # against the planner's linear phases.
                    "growth_profile": list(coord.profile),
                    "peak_growth": coord.peak_growth,
                }
        except ImportError:
            pass
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(
                {
                    "rank": rank,
                    "iterations": self.iterations,
                    "params_sha256": params_digest,
                    "optimizer_state_sha256": state_digest,
                    "state_at": self.state_at,
                    "startup_peak": self.startup_peak,
                    "saves": self.saves,
                    "phase_bench": getattr(self, "phase_bench", None),
                    "timeline": self.timelines[0] if self.timelines else None,  # (the first; readers of old records)
                    "timelines": self.timelines,
                    "busy_timelines": self.busy_timelines,
                    "adam_state_bytes": self.adam_state_bytes(),
                    # Which optimizer megatron-core chose (TE FusedAdam when TE is installed).
                    "inner_optimizers": [f"{type(d.optimizer).__module__}.{type(d.optimizer).__qualname__}"
                                         for d in distributed_optimizers(self.optimizer)],
                    # Whether the caching allocator ran with expandable segments (set by the
                    # user, or turned on by the plugin): None where the snapshot does not say.
                    "expandable_segments": _expandable_segments(),
                    **extra,
                },
                f,
                indent=1,
            )


def main():
    """Parse the arguments and train, as the installed release's own pretrain_gpt.py calls `pretrain`."""
    defaults = {"tokenizer_type": "NullTokenizer"}
    datasets_provider.is_distributed = True
    if parse_and_validate_args is None:  # 0.17: pretrain parses the arguments itself
        pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step, args_defaults=defaults)
        return
    args = parse_and_validate_args(args_defaults=defaults)
    if gpt_config_from_args is None:  # 0.18: a container without a model config (it warns), and a model provider
        pretrain(pretrain_cfg_container_from_args(args), datasets_provider, model_provider,
                 ModelType.encoder_or_decoder, forward_step)
        return
    pretrain(  # 0.19
        pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )


def _expandable_segments():
    flags = [seg.get("is_expandable") for seg in torch.cuda.memory_snapshot()]
    return None if not flags or None in flags else any(flags)


if __name__ == "__main__":
    if os.environ.get("MEGATRON_OFFLOAD_MEMORY_FRACTION"):
        # A per-GPU memory cap for max-fit experiments (scripts/max_fit.py).
        torch.cuda.set_per_process_memory_fraction(
            float(os.environ["MEGATRON_OFFLOAD_MEMORY_FRACTION"]), device=int(os.environ.get("LOCAL_RANK", 0)))
    if os.environ.get("MEGATRON_OFFLOAD_RECORD") and not os.environ.get("MEGATRON_OFFLOAD_RECORDER_INSTALLED"):
        recorder = Recorder(os.environ["MEGATRON_OFFLOAD_RECORD"])
        recorder.install()
        if os.environ.get("MEGATRON_OFFLOAD_MEMHIST"):
            recorder.start_memhist()
    main()
