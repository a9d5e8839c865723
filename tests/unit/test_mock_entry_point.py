"""scripts/pretrain_gpt_mock.py on the installed megatron-core (CI: 0.17.1, 0.18.2 and 0.19.2), on CPU.

The script runs through the plugin's launcher in a subprocess (this file is its driver), with
Megatron's `pretrain` replaced by a stand-in that binds the script's call to the real `pretrain`'s
signature and then does on CPU what `pretrain` starts with: parses the arguments where `pretrain`
does (0.17), builds the model as that release does (0.19: from the config container's
GPTModelConfig; 0.17, 0.18: through the script's `model_provider`, called as `get_model` calls it),
builds the mock datasets through the script's provider and runs one forward and backward pass
through the script's `forward_step` (tensors meant for "cuda" stay on the CPU). On 0.19 the script's
`model_provider` (what 0.17 and 0.18 train) must build the very model 0.19's GPTModelBuilder builds.
"""

import ast
import contextlib
import functools
import inspect
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
MOCK = os.path.join(REPO, "scripts", "pretrain_gpt_mock.py")
RESULT = "MOCK_ENTRY_RESULT "
MBS, SEQ = 2, 32


def _argv(case, tmp):
    from benchmark import MOE
    from megatron_runs import model_args

    # The functional suite's arguments (tests/functional/run_functional.py), small.
    argv = model_args(2, layers=2, hidden=64, heads=4, seq=SEQ, mbs=MBS, gbs=MBS) + [
        "--deterministic-mode", "--log-interval", "1", "--save", tmp, "--save-interval", "1",
        "--offload-optimizer-states", "--use-cpu-initialization"]
    if case == "moe":  # the benchmark's MoE preset; the alltoall dispatcher makes CUDA streams when built
        argv += ["allgather" if a == "alltoall" else a for a in MOE]
    return argv


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_mock_script_trains_on_the_installed_megatron_core(tmp_path, case):
    from megatron_runs import DETERMINISM_ENV  # (--deterministic-mode asks for NCCL_ALGO)

    env = dict(os.environ, **DETERMINISM_ENV, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MOCK_ENTRY_STORE=f"file://{tmp_path}/store",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    for var in ("MEGATRON_OFFLOAD_RECORD", "MEGATRON_OFFLOAD_MEMORY_FRACTION"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *_argv(case, str(tmp_path / "ckpt"))],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    assert out.returncode == 0 and lines, (out.stdout[-2000:] + out.stderr[-4000:])
    result = json.loads(lines[-1][len(RESULT):])
    from megatron_offload import compat

    if compat._release(result["megatron_core"]) >= (0, 19):
        assert result["model_from"] == "GPTModelConfig"
        assert result["model_provider_builds_the_same_model"] is True
        assert result["te_layer_spec_call_the_same"] is True
    else:
        assert result["model_from"] == "model_provider"
    assert result["batch_keys"] == ["tokens", "labels", "loss_mask", "position_ids"]
    assert result["num_tokens"] == MBS * SEQ and math.isfinite(result["loss"]) and result["loss"] > 0


# ------------------------------------------------------------------------------------------------
# The driver (run as a script by the test above)
# ------------------------------------------------------------------------------------------------
def _provider_keywords(get_model):
    """The keyword sets `get_model` calls the model provider with, one per call site."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(get_model)))
    return [[kw.arg for kw in node.keywords] for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "model_provider_func"]


def _same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return ([type(m).__name__ for m in a.modules()] == [type(m).__name__ for m in b.modules()]
            and sa.keys() == sb.keys()
            and all(not isinstance(v, torch.Tensor) or v.equal(sb[k]) for k, v in sa.items()))


@contextlib.contextmanager
def _te_spec_calls(modules):
    """Records the bound arguments of get_gpt_layer_with_transformer_engine_spec (which needs TE
    itself to run) instead of calling it, wherever `modules` bind it."""
    from megatron.core.models.gpt import gpt_layer_specs

    real, calls = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec, []

    @functools.wraps(real)
    def record(*a, **k):
        bound = inspect.signature(real).bind(*a, **k)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))

    for module in modules:
        module.get_gpt_layer_with_transformer_engine_spec = record
    try:
        yield calls
    finally:
        for module in modules:
            module.get_gpt_layer_with_transformer_engine_spec = real


class _OnCpu(torch.overrides.TorchFunctionMode):
    """Tensors made or moved to "cuda" stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if str(a).startswith("cuda") else a for a in args)
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _pretrain_on_cpu(call, script):
    """What `pretrain` starts with, on CPU, for the script's call (bound to the real signature)."""
    from torch.utils.data import DataLoader

    import megatron.training.training as training
    from megatron.core import package_info, parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module
    from megatron.training import get_args, global_vars

    assert call["model_type"] is ModelType.encoder_or_decoder
    assert call["forward_step_func"] is script.forward_step
    assert call["train_valid_test_dataset_provider"] is script.datasets_provider
    assert script.datasets_provider.is_distributed
    if global_vars._GLOBAL_ARGS is None:  # 0.17: pretrain parses them (initialize_megatron does this)
        import megatron.training.initialize as init

        args = init.parse_args(call["extra_args_provider"], False)
        init.validate_args(args, call["args_defaults"])
        init.set_global_variables(args)
    args = get_args()
    assert args.offload_optimizer_states and args.tokenizer_type == "NullTokenizer"
    torch.distributed.init_process_group("gloo", init_method=os.environ["MOCK_ENTRY_STORE"], world_size=1, rank=0)
    parallel_state.initialize_model_parallel()
    values = {"pre_process": True, "post_process": True, "vp_stage": None, "config": None,
              "pg_collection": ProcessGroupCollection.use_mpu_process_groups()}
    calls = [{k: values[k] for k in keywords} for keywords in _provider_keywords(training.get_model)]
    for kwargs in calls:  # every way get_model calls a model provider fits the script's
        inspect.signature(script.model_provider).bind(**kwargs)
    plain = next(kwargs for kwargs in calls if "vp_stage" not in kwargs)  # (no virtual pipeline)
    result = {"megatron_core": package_info.__version__, "model_provider_builds_the_same_model": None,
              "te_layer_spec_call_the_same": None}
    model_cfg = getattr(call.get("cfg_container"), "model", None)
    if model_cfg is not None:  # 0.19: pretrain builds the model from the container's GPTModelConfig
        import megatron.training.models.gpt as gpt_models

        assert call["model_provider"] is None
        torch.manual_seed(1)
        model = model_cfg.get_builder_cls()(model_cfg).build_model(values["pg_collection"], True, True)
        torch.manual_seed(1)
        result["model_provider_builds_the_same_model"] = _same_model(model, script.model_provider(**plain))
        model_cfg.transformer.transformer_impl = "transformer_engine"
        with _te_spec_calls([gpt_models, specs]) as by_builder:
            gpt_models.default_layer_spec(model_cfg, None)
        with _te_spec_calls([gpt_models, specs]) as by_script:
            script.gpt_layer_spec(model_cfg.transformer)
        result["te_layer_spec_call_the_same"] = bool(by_builder) and by_builder == by_script
        model_cfg.transformer.transformer_impl = "local"
        result["model_from"] = "GPTModelConfig"
    else:
        assert call["model_provider"] is script.model_provider
        model = call["model_provider"](**plain)
        result["model_from"] = "model_provider"
        from megatron.training.arguments import core_transformer_config_from_args

        te_config = core_transformer_config_from_args(args)
        te_config.transformer_impl = "transformer_engine"
        with _te_spec_calls([specs]) as by_script:
            script.gpt_layer_spec(te_config)  # (its arguments bind to this release's signature)
        assert by_script

    train_ds, _, _ = script.datasets_provider([4 * MBS, MBS, 0])
    result["batch_keys"] = list(train_ds[0])
    model = Float16Module(model.config, model)  # as get_model wraps it for --bf16
    model.train()
    # The CPU has no CUDA RNG states, nor CUDA buffers.
    type(tensor_parallel.get_cuda_rng_tracker()).fork = lambda self, *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    with _OnCpu():
        output, loss_func = script.forward_step(iter(DataLoader(train_ds, batch_size=MBS)), model)
        loss, num_tokens, report = loss_func(output)
        loss.backward()
    assert set(report) == {"lm loss"}
    result.update(loss=loss.item(), num_tokens=int(num_tokens))
    return result


def _drive(argv):
    import megatron.training
    import megatron.training.training as training

    # What the script's Recorder relies on (MEGATRON_OFFLOAD_RECORD): train_step(..., optimizer at
    # index 3, ..., iteration=), train(forward_step_func, model, optimizer, ...), save_checkpoint.
    train_step = list(inspect.signature(training.train_step).parameters)
    assert train_step[3] == "optimizer" and "iteration" in train_step, train_step
    assert list(inspect.signature(training.train).parameters)[:3] == ["forward_step_func", "model", "optimizer"]
    assert callable(training.save_checkpoint)
    real = training.pretrain

    def pretrain(*a, **k):
        call = inspect.signature(real).bind(*a, **k)
        call.apply_defaults()
        result = _pretrain_on_cpu(call.arguments, sys.modules["__main__"])
        print(RESULT + json.dumps(result), flush=True)
        raise SystemExit(0)

    megatron.training.pretrain = training.pretrain = pretrain
    from megatron_offload.__main__ import main as launch

    launch([MOCK, *argv])
    raise SystemExit("the script returned without calling pretrain")


if __name__ == "__main__":
    _drive(sys.argv[1:])


def test_digest_reads_the_inner_tensors_of_a_tensor_subclass():
    """TE's Float8Tensor params (--fp8-param-gather) have no .numpy(): the recorder's digest hashes
    the inner tensors a traceable subclass declares (its data and scale), so two runs whose FP8
    params differ in one byte of either get different digests."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    import pretrain_gpt_mock

    a, b = torch.arange(4, dtype=torch.float32), torch.ones(4)
    plain = list(pretrain_gpt_mock._raw_tensors(a))
    assert plain == [a.numpy().tobytes()]
    wrapped = list(pretrain_gpt_mock._raw_tensors(two_tensor.TwoTensor(a, b)))
    assert wrapped == [a.numpy().tobytes(), b.numpy().tobytes()]
    b2 = b.clone()
    b2[3] = 2.0
    assert list(pretrain_gpt_mock._raw_tensors(two_tensor.TwoTensor(a, b2))) != wrapped


def test_digest_of_a_subclass_without_flatten_skips_a_stale_cache():
    """A quantized tensor that does not declare its inner tensors: every tensor attribute, by name;
    a cache marked stale (`<name>_invalid`, as TE marks its FP8 transpose) is not state."""
    import pretrain_gpt_mock

    class Quantized(torch.Tensor):
        @staticmethod
        def __new__(cls, data, scale, transpose, stale):
            t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32)
            t._data, t._scale_inv, t._transpose, t._transpose_invalid = data, scale, transpose, stale
            return t

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

        def detach(self):
            return self

    data, scale = torch.arange(4, dtype=torch.uint8), torch.tensor([0.5])
    garbage = torch.full((4,), 7, dtype=torch.uint8)
    got = list(pretrain_gpt_mock._raw_tensors(Quantized(data, scale, garbage, True)))
    assert got == [data.numpy().tobytes(), scale.numpy().tobytes()]
    fresh = list(pretrain_gpt_mock._raw_tensors(Quantized(data, scale, garbage, False)))
    assert fresh == [data.numpy().tobytes(), scale.numpy().tobytes(), garbage.numpy().tobytes()]


def test_save_census_tells_the_forms_of_the_saved_tensors():
    """The save breakdown's census (issue 23): a view of a larger storage, a whole shared
    storage, a whole private one and a factory are each counted as such."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import pretrain_gpt_mock

    class Sharded:  # stands for ShardedTensor: the tensor is `.data`
        def __init__(self, data):
            self.data = data

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    big = torch.zeros(64)
    factory = ShardedTensorFactory("f", torch.zeros(2), lambda *a: None, lambda *a: None)  # (has `.data` too)
    state = {"a": Sharded(big[:16]), "b": [Sharded(torch.zeros(8).share_memory_()), Sharded(torch.zeros(4))],
             "c": {"d": factory, "e": 3}}
    forms = pretrain_gpt_mock._tensor_forms(state)
    assert forms == {"cpu_view": {"count": 1, "bytes": 64}, "cpu_shared": {"count": 1, "bytes": 32},
                     "cpu_private": {"count": 1, "bytes": 16}, "factories": {"count": 1, "bytes": 8}}


def test_save_parts_times_each_part_and_puts_the_originals_back():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import megatron.core.dist_checkpointing as dc
    import megatron.training.checkpointing as ckpt
    import pretrain_gpt_mock

    def current():
        return dc.save, ckpt.generate_state_dict, getattr(ckpt, "schedule_async_save", None)

    before = current()
    with pretrain_gpt_mock._save_parts() as parts:
        with pytest.raises(TypeError):  # (the wrapper times a failing call too, and re-raises)
            dc.save()
        assert current()[0] is not before[0]
    assert current() == before
    assert parts["dist_save_s"] > 0 and parts["schedule_s"] == 0 and parts["forms"] == {}


def test_the_recorder_reads_losses_and_periods_at_the_end():
    """The recorder keeps each loss as train_step returned it and reads it when it writes (a read right
    after train_step would wait behind the copy-out in flight); periods are start to start."""
    from pretrain_gpt_mock import finish_iterations

    iterations = [{"start_s": 10.0, "loss": None}, {"start_s": 10.25, "loss": None}, {"start_s": 10.75, "loss": None}]
    loss = torch.tensor(2.5)
    finish_iterations(iterations, {0: loss, 2: torch.tensor(0.1)})
    loss.add_(1.0)  # (the recorder keeps a copy; here the value was read already)
    assert [it["loss"] for it in iterations] == [(2.5).hex(), None, float(torch.tensor(0.1)).hex()]
    assert [it.get("period_ms") for it in iterations] == [250.0, 500.0, None]


def test_the_per_iteration_waits_come_from_a_loaded_plugin_and_never_load_it(monkeypatch):
    """The recorder's `exposed_ms` per iteration: the plugin's wait totals where its wiring is loaded
    and attached, None where it is not loaded (without loading it: a run without the plugin stays
    without it) or attached to nothing."""
    import types

    import pretrain_gpt_mock

    name = "megatron_offload.megatron_wiring"
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert pretrain_gpt_mock._plugin_exposed_so_far() is None
    assert name not in sys.modules
    stats = types.SimpleNamespace(exposed_so_far=lambda: (1.5, 2.5))
    wiring = types.SimpleNamespace(coordinator=types.SimpleNamespace(streams=types.SimpleNamespace(stats=stats)))
    monkeypatch.setitem(sys.modules, name, wiring)
    assert pretrain_gpt_mock._plugin_exposed_so_far() == [1.5, 2.5]
    wiring.coordinator = None
    assert pretrain_gpt_mock._plugin_exposed_so_far() is None


def test_the_per_iteration_host_times_come_from_a_loaded_plugin_and_never_load_it(monkeypatch):
    """The recorder's `hook_ms`, `finalize_host_ms` and `host_lead_wait_ms`: the plugin's running
    totals (all hooks, `grads_finalizing` alone, 0 before its first call; the host-lead bound's
    waits) where its wiring is loaded and attached, None otherwise (without loading it)."""
    import types

    import pretrain_gpt_mock

    from megatron_offload.lifecycle import HookClock

    name = "megatron_offload.megatron_wiring"
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert pretrain_gpt_mock._plugin_hook_ms_so_far("grads_finalizing") is None
    assert pretrain_gpt_mock._plugin_host_lead_wait_ms_so_far() is None
    assert name not in sys.modules
    clock = HookClock()
    clock.ms.update(layer_forward_begin=3.0)
    coord = types.SimpleNamespace(hook_clock=clock, host_lead=types.SimpleNamespace(wait_ms=7.5))
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(coordinator=coord))
    assert pretrain_gpt_mock._plugin_hook_ms_so_far("grads_finalizing") == 0.0
    clock.ms["grads_finalizing"] = 2.0
    assert pretrain_gpt_mock._plugin_hook_ms_so_far("grads_finalizing") == 2.0
    assert pretrain_gpt_mock._plugin_hook_ms_so_far() == 5.0
    assert pretrain_gpt_mock._plugin_host_lead_wait_ms_so_far() == 7.5
    # The recorder writes each iteration's totals under the names the benchmark reads, and each
    # timeline's record index.
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import benchmark

    source = open(MOCK).read()
    for key in ("hook_ms", *benchmark.PER_ITERATION_HOST_MS):
        assert f'"{key}": _plugin_' in source, key
    assert '"record": len(self.iterations)' in source


def test_the_recorder_marks_the_first_inner_step_of_an_iteration_once_and_undoes_it(tmp_path):
    """The planner's "step_prep" ends where the first inner optimizer's step is called: the
    recorder marks "adam_begin" there once per marked iteration (a chained optimizer steps several
    inner ones), through an instance `step` that runs before the step's pre-hooks (megatron-offload
    waits for its reload in one) and around one already installed (the piecewise step); undone
    after, except where something else replaced the wrapper meanwhile."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import pretrain_gpt_mock
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    calls = []

    class Inner(torch.optim.SGD):
        def step(self, closure=None):
            calls.append(("class", id(self)))

    def distributed(inner):
        dist_opt = object.__new__(DistributedOptimizer)
        dist_opt.__dict__.update(optimizer=inner, is_stub_optimizer=False)
        return dist_opt

    class Chained:
        def __init__(self, *subs):
            self.chained_optimizers = list(subs)

    plain, installed = (Inner([torch.nn.Parameter(torch.zeros(1))], lr=0.1) for _ in range(2))
    marks = []
    plain.register_step_pre_hook(lambda *a: marks.append("pre-hook"))

    def piecewise():
        calls.append(("installed", id(installed)))

    installed.step = piecewise
    recorder = pretrain_gpt_mock.Recorder(str(tmp_path))
    recorder.mark = marks.append
    undo = recorder._mark_first_inner_step(Chained(distributed(plain), distributed(installed)))
    plain.step()
    installed.step()
    plain.step()
    assert marks == ["adam_begin", "pre-hook", "pre-hook"]  # (once, and before the step's pre-hooks)
    assert calls == [("class", id(plain)), ("installed", id(installed)), ("class", id(plain))]
    undo()
    assert "step" not in plain.__dict__ and installed.step is piecewise
    # A wrapper replaced meanwhile (the piecewise step restores its own) stays replaced.
    undo = recorder._mark_first_inner_step(Chained(distributed(installed)))

    def other():
        pass

    installed.step = other
    undo()
    assert installed.step is other


def test_a_marked_iteration_has_adam_begin_between_the_steps_marks(tmp_path, monkeypatch):
    """The recorder's train_step, as installed, on a marked iteration (MEGATRON_OFFLOAD_TIMELINE_AT):
    its timeline reads iter_begin, step_begin, adam_begin, step_end (the planner's step_prep ends at
    the inner optimizer's step), and the inner optimizer has its own step back after it. The CUDA
    surface the recorder reads is faked: events count their records."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.training.training as training
    import pretrain_gpt_mock
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    clock = [0.0]

    class Event:
        def __init__(self, **_):
            self.t = None

        def record(self):
            clock[0] += 1.0
            self.t = clock[0]

        def elapsed_time(self, other):
            return other.t - self.t

    class Stream:
        def synchronize(self):
            pass

    for name, value in (("Event", Event), ("memory_allocated", lambda: 0), ("max_memory_allocated", lambda: 0),
                        ("max_memory_reserved", lambda: 0), ("reset_peak_memory_stats", lambda: None),
                        ("memory_stats", lambda: {}), ("current_stream", Stream), ("synchronize", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    for module, name in ((training, "train"), (training, "save_checkpoint"), (schedules, "forward_step"),
                         (schedules, "backward_step")):
        monkeypatch.setattr(module, name, getattr(module, name))  # (restored after the test)
    monkeypatch.setenv("MEGATRON_OFFLOAD_TIMELINE_AT", "3")
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    dist_opt = object.__new__(DistributedOptimizer)
    dist_opt.__dict__.update(optimizer=inner, is_stub_optimizer=False)

    class Chained:
        chained_optimizers = [dist_opt]

        def step(self):
            inner.step()

    def train_step(*a, **k):
        a[3].step()
        return {"lm loss": torch.tensor(1.0)}, 0, None

    monkeypatch.setattr(training, "train_step", train_step)
    recorder = pretrain_gpt_mock.Recorder(str(tmp_path))
    recorder.install()
    chained = Chained()
    for iteration in (2, 3):
        training.train_step(None, None, None, chained, iteration=iteration)
    assert len(recorder.timelines) == 1 and recorder.timelines[0]["iteration"] == 3
    assert [m[0] for m in recorder.timelines[0]["marks"]] == ["iter_begin", "step_begin", "adam_begin", "step_end"]
    assert "step" not in inner.__dict__  # (the inner optimizer's own step back; the outer one's is its bound method)
    training.train_step(None, None, None, chained, iteration=4)  # (not marked: nothing recorded)
    assert len(recorder.timelines) == 1 and recorder._marks is None
