"""The Megatron wiring on CPU, against the installed megatron-core (0.17 to 0.19: arguments, validation,
step-aside, the pip wheel's missing Makefile, the launcher, the source patch, the version check)."""

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import megatron.training.arguments  # noqa: E402,F401  (a missing or broken megatron fails the suite, never skips it)

import megatron_offload  # noqa: E402
from megatron_offload import OffloadArgumentError, allocator, auto_fraction, megatron_wiring  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCH = os.path.join(REPO, "patches", "megatron-core-0.19-training-init.patch")


@pytest.fixture(scope="module", autouse=True)
def installed():
    megatron_offload.install()


def parse(argv):
    import megatron.training.arguments as arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    return parser.parse_args(argv)


def test_install_is_idempotent_and_wraps_by_module_attribute():
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.training.arguments as arguments
    import megatron.training.training as training

    before = arguments.add_megatron_arguments
    megatron_offload.install()
    assert arguments.add_megatron_arguments is before
    for fn in (arguments.add_megatron_arguments, arguments.validate_args,
               training.setup_model_and_optimizer, training.get_megatron_optimizer, training.finalize_model_grads,
               training.calc_params_l2_norm, schedules.forward_step, schedules.backward_step):
        assert getattr(fn, "_megatron_offload", False), fn


def test_flags_registered_with_defaults():
    a = parse([])
    assert a.offload_optimizer_states is False
    assert a.offload_chunk_size_mb == 256 and a.offload_memory_margin_mb is None
    a = parse(["--offload-optimizer-states", "--offload-chunk-size-mb", "64"])
    assert a.offload_optimizer_states and a.offload_chunk_size_mb == 64


def test_the_margin_is_64_mib_or_the_lasting_memory_unless_given():
    """Not given: 64 MiB, or the memory kept for good where larger (MemoryPolicy._margin). Given
    (0 included): exactly that, the lasting memory left out."""
    from megatron_offload import megatron_args

    on = ["--offload-optimizer-states", "--use-distributed-optimizer"]
    config = megatron_args.config_from_args(parse(on))
    assert config.margin_bytes == 64 * 2**20 and config.lasting_growth_margin
    for mb in (0, 128):
        config = megatron_args.config_from_args(parse(on + ["--offload-memory-margin-mb", str(mb)]))
        assert config.margin_bytes == mb * 2**20 and not config.lasting_growth_margin
    a = parse(on + ["--offload-memory-margin-mb", "-1"])
    with pytest.raises(OffloadArgumentError, match="--offload-memory-margin-mb"):
        megatron_wiring.validate_args(a)


def test_validate_args_rejects_before_megatron_validation(capsys):
    import megatron.training.arguments as arguments

    a = parse(["--offload-optimizer-states", "--optimizer-cpu-offload", "--use-distributed-optimizer"])
    with pytest.raises(SystemExit) as exit_info:
        arguments.validate_args(a)
    assert exit_info.value.code == 2
    assert "--optimizer-cpu-offload" in capsys.readouterr().err


def test_bad_chunk_size_rejected():
    a = parse(["--offload-optimizer-states", "--use-distributed-optimizer", "--offload-chunk-size-mb", "0"])
    with pytest.raises(OffloadArgumentError, match="--offload-chunk-size-mb"):
        megatron_wiring.validate_args(a)


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5"])
def test_state_fraction_outside_zero_one_rejected(value):
    a = parse(["--offload-optimizer-states", "--use-distributed-optimizer", "--offload-state-fraction", value])
    with pytest.raises(OffloadArgumentError, match="--offload-state-fraction"):
        megatron_wiring.validate_args(a)
    a = parse(["--offload-optimizer-states", "--use-distributed-optimizer", "--offload-state-fraction", "0.4"])
    megatron_wiring.validate_args(a)
    assert a.offload_state_fraction == 0.4 and parse([]).offload_state_fraction == 1.0


def test_steps_aside_when_megatron_defines_the_flag(monkeypatch, capsys):
    monkeypatch.setattr(megatron_wiring, "_stepped_aside", False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--offload-optimizer-states", action="store_true")  # a dev-branch Megatron
    megatron_wiring.add_arguments(parser)
    assert megatron_wiring._stepped_aside
    assert "--offload-chunk-size-mb" not in parser._option_string_actions
    assert "steps aside" in capsys.readouterr().out
    # ...and then neither validates nor attaches.
    megatron_wiring.validate_args(argparse.Namespace(offload_optimizer_states=True, optimizer_cpu_offload=True))


def test_prebuilt_dataset_helpers_skip_make(monkeypatch):
    import megatron.core.datasets.utils as dataset_utils

    def no_make(*a, **k):
        raise AssertionError("make must not run when helpers_cpp imports")

    monkeypatch.setattr(subprocess, "run", no_make)
    assert dataset_utils.compile_helpers() is None


def test_non_distributed_optimizer_is_refused():
    class Float16Optimizer:
        pass

    with pytest.raises(OffloadArgumentError, match="--use-distributed-optimizer"):
        list(megatron_wiring.iter_distributed_optimizers(Float16Optimizer()))


# What a training script's `initialize_megatron` does first, on every supported release.
PARSE_AND_VALIDATE = """
try:  # megatron-core 0.18 and later
    from megatron.training.arguments import parse_and_validate_args
except ImportError:  # 0.17: initialize_megatron calls the names megatron.training.initialize imported
    import megatron.training.initialize as _init

    def parse_and_validate_args(args_defaults={}):
        args = _init.parse_args(None, False)
        _init.validate_args(args, args_defaults)
        return args
"""


def _run_launcher(tmp_path, extra, alloc_conf=None):
    script = tmp_path / "train.py"
    script.write_text(PARSE_AND_VALIDATE + textwrap.dedent("""
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
        import os
        print("PARSED offload_optimizer_states =", args.offload_optimizer_states, flush=True)
        print("ALLOC_CONF =", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), flush=True)
    """))
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-4", "--mock-data", "--vocab-size", "128", *extra]
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    return subprocess.run([sys.executable, "-m", "megatron_offload", str(script), *argv],
                          capture_output=True, text=True, env=env, timeout=300)


def test_launcher_runs_unmodified_script_with_flag(tmp_path):
    out = _run_launcher(tmp_path, ["--offload-optimizer-states", "--use-distributed-optimizer"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PARSED offload_optimizer_states = True" in out.stdout


def test_launcher_prints_rejection(tmp_path):
    out = _run_launcher(tmp_path, ["--offload-optimizer-states", "--use-distributed-optimizer",
                                   "--optimizer-cpu-offload"])
    assert out.returncode == 2
    assert "error: megatron-offload refuses this configuration" in out.stderr
    assert "Traceback" not in out.stderr
    assert "moves the Adam step itself to the CPU" in out.stderr


def test_launcher_usage_without_script():
    out = subprocess.run([sys.executable, "-m", "megatron_offload"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 2 and "torchrun" in out.stdout


def test_source_patch_applies_to_megatron_core_and_activates_the_plugin(tmp_path):
    import megatron.training

    # `megatron` is a namespace package: locate it through a regular subpackage.
    src = os.path.dirname(os.path.dirname(os.path.abspath(megatron.training.__file__)))
    shutil.copytree(src, tmp_path / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    check = subprocess.run(["git", "apply", "--check", PATCH], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    subprocess.run(["git", "apply", PATCH], cwd=tmp_path, check=True)
    probe = textwrap.dedent("""
        import megatron, megatron.training
        import megatron.training.arguments as arguments
        assert megatron.training.__file__.startswith(%r), megatron.training.__file__
        assert getattr(arguments.add_megatron_arguments, "_megatron_offload", False)
        print("ACTIVE")
    """ % str(tmp_path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert "ACTIVE" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("conf, enable, noted", [
    (None, True, True),
    ("", True, True),
    ("max_split_size_mb:512", False, True),
    ("expandable_segments:False", False, True),
    ("expandable_segments:True", False, False),
    ("max_split_size_mb:512, expandable_segments:true", False, False),
])
def test_allocator_choice_enables_expandable_segments_only_when_unconfigured(conf, enable, noted):
    turn_on, note = allocator.allocator_choice(conf)
    assert turn_on == enable
    assert (note is not None) == noted
    if noted:
        assert "expandable_segments" in note


@pytest.mark.parametrize("flag, preset, expected", [
    (True, None, "expandable_segments:True"),
    (True, "expandable_segments:False", "expandable_segments:False"),
    (False, None, "None"),
])
def test_launcher_turns_on_expandable_segments_only_with_the_flag_and_no_user_setting(tmp_path, flag, preset,
                                                                                        expected):
    extra = ["--use-distributed-optimizer"] + (["--offload-optimizer-states"] if flag else [])
    out = _run_launcher(tmp_path, extra, alloc_conf=preset)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"ALLOC_CONF = {expected}" in out.stdout


def test_state_fraction_auto_is_accepted_and_anything_else_not_a_number_refused():
    a = parse(["--offload-optimizer-states", "--use-distributed-optimizer", "--offload-state-fraction", "auto"])
    megatron_wiring.validate_args(a)
    assert a.offload_state_fraction == "auto"
    with pytest.raises(SystemExit):
        parse(["--offload-state-fraction", "most"])


def test_the_streamed_step_is_the_default_engine_and_whole_is_one_flag_away():
    from megatron_offload import megatron_args

    on = ["--offload-optimizer-states", "--use-distributed-optimizer"]
    default = parse(on)
    megatron_wiring.validate_args(default)
    config = megatron_args.config_from_args(default)
    assert config.chunked_step and config.copy_out_in_flight_bytes == megatron_args.DEFAULT_IN_FLIGHT_MB * 2**20
    assert megatron_args.step_engine_note(default) == "streamed step"
    whole = parse(on + ["--offload-step", "whole"])
    megatron_wiring.validate_args(whole)
    config = megatron_args.config_from_args(whole)
    assert not config.chunked_step and config.copy_out_in_flight_bytes == 0
    # The older flag still asks for the streamed step; an explicit in-flight amount wins either way.
    old = parse(on + ["--offload-chunked-step", "--offload-copy-out-in-flight-mb", "0"])
    megatron_wiring.validate_args(old)
    config = megatron_args.config_from_args(old)
    assert config.chunked_step and config.copy_out_in_flight_bytes == 0
    fed_whole = megatron_args.config_from_args(parse(on + ["--offload-step", "whole",
                                                            "--offload-copy-out-in-flight-mb", "256"]))
    assert not fed_whole.chunked_step and fed_whole.copy_out_in_flight_bytes == 256 * 2**20
    with pytest.raises(SystemExit):
        parse(on + ["--offload-step", "chunky"])
    # The alias beside --offload-step whole, in either order, is refused (not last-wins); beside
    # --offload-step streamed it says the same thing.
    for argv in (["--offload-chunked-step", "--offload-step", "whole"], ["--offload-step", "whole", "--offload-chunked-step"]):
        with pytest.raises(OffloadArgumentError, match="--offload-chunked-step asks for the streamed step"):
            megatron_wiring.validate_args(parse(on + argv))
    both = parse(on + ["--offload-step", "streamed", "--offload-chunked-step"])
    megatron_wiring.validate_args(both)
    assert megatron_args.config_from_args(both).chunked_step


@pytest.mark.parametrize("flag,reason", [
    ("--fp8-param-gather", "--fp8-param-gather quantizes all parameters at once"),
    ("--fp4-param-gather", "--fp4-param-gather quantizes all parameters at once"),
    ("--log-params-norm", "--log-params-norm reads every master right after the step"),
    ("--offload-state-fraction", "the automatic fraction models the whole step")])
def test_flags_that_read_or_quantize_all_masters_default_to_the_whole_step_and_say_so(flag, reason):
    from megatron_offload import megatron_args

    a = argparse.Namespace(**vars(parse(["--offload-optimizer-states", "--use-distributed-optimizer"])))
    setattr(a, flag[2:].replace("-", "_"), "auto" if flag == "--offload-state-fraction" else True)
    megatron_wiring.validate_args(a)
    config = megatron_args.config_from_args(a)
    assert not config.chunked_step and config.copy_out_in_flight_bytes == 0
    assert megatron_args.step_engine_note(a) == f"whole step ({reason})"
    a.offload_step = "streamed"
    quantized = flag.endswith("-param-gather")
    if not quantized:  # asked for, it runs (the norm brings the state back first; auto on its own model)
        megatron_wiring.validate_args(a)
        assert megatron_args.config_from_args(a).chunked_step
        assert megatron_args.step_engine_note(a) == "streamed step"
    else:
        with pytest.raises(OffloadArgumentError, match="--offload-step streamed"):
            megatron_wiring.validate_args(a)
    # A step budget asks for the streamed step: taken with the norm or auto, refused with a quantized gather.
    a.offload_step, a.offload_step_budget_mb = None, 256
    if not quantized:
        megatron_wiring.validate_args(a)
        assert megatron_args.config_from_args(a).chunked_step
    else:
        with pytest.raises(OffloadArgumentError, match="--offload-step-budget-mb"):
            megatron_wiring.validate_args(a)
    # A negative budget is an out-of-range value, not a request for the streamed step.
    a.offload_step_budget_mb = -5
    with pytest.raises(OffloadArgumentError, match="must be >= 0"):
        megatron_wiring.validate_args(a)


def test_step_budget_flag():
    a = parse(["--offload-optimizer-states", "--use-distributed-optimizer", "--offload-step-budget-mb", "1536"])
    megatron_wiring.validate_args(a)
    assert a.offload_step_budget_mb == 1536 and parse([]).offload_step_budget_mb == 0
    whole = parse(["--offload-optimizer-states", "--use-distributed-optimizer", "--offload-step", "whole",
                   "--offload-step-budget-mb", "512"])
    with pytest.raises(OffloadArgumentError, match=r"asks for the whole step \(--offload-step whole\): drop one"):
        megatron_wiring.validate_args(whole)
    negative = parse(["--offload-optimizer-states", "--use-distributed-optimizer", "--offload-step-budget-mb", "-1"])
    with pytest.raises(OffloadArgumentError, match="--offload-step-budget-mb"):
        megatron_wiring.validate_args(negative)


def test_host_lead_flag_defaults_by_where_ddp_frees_gradients_and_refuses_negative_values():
    from megatron_offload import megatron_args
    from megatron_offload.config import DEFERRED_FREES_HOST_LEAD_LAYERS

    on = ["--offload-optimizer-states", "--use-distributed-optimizer"]
    # DDP's accumulators re-created on the compute stream (the default): no bound.
    assert megatron_args.config_from_args(parse(on)).host_lead_layers == 0
    # Left on DDP's stream: its weight gradients' frees are deferred, the bound's case.
    kept = parse(on + ["--offload-keep-ddp-grad-stream"])
    assert megatron_args.config_from_args(kept).host_lead_layers == DEFERRED_FREES_HOST_LEAD_LAYERS > 0
    fp8 = parse(on)
    fp8.fp8 = "hybrid"  # (re-created under FP8 too: no bound)
    assert megatron_args.config_from_args(fp8).host_lead_layers == 0
    # What the user gives wins either way.
    for given in (["--offload-host-lead-layers", "0"] + ["--offload-keep-ddp-grad-stream"],
                  ["--offload-host-lead-layers", "3"]):
        a = parse(on + given)
        megatron_wiring.validate_args(a)
        assert megatron_args.config_from_args(a).host_lead_layers == int(given[1])
    with pytest.raises(OffloadArgumentError, match="--offload-host-lead-layers"):
        megatron_wiring.validate_args(parse(on + ["--offload-host-lead-layers", "-1"]))


def test_copy_out_in_flight_flag_reaches_the_config_and_refuses_negative_values():
    from megatron_offload import megatron_args

    assert parse([]).offload_copy_out_in_flight_mb is None  # resolved by the step engine
    a = parse(["--offload-optimizer-states", "--use-distributed-optimizer", "--offload-copy-out-in-flight-mb", "256"])
    megatron_wiring.validate_args(a)
    assert megatron_args.config_from_args(a).copy_out_in_flight_bytes == 256 * 2**20
    negative = parse(["--offload-optimizer-states", "--use-distributed-optimizer",
                      "--offload-copy-out-in-flight-mb", "-1"])
    with pytest.raises(OffloadArgumentError, match="--offload-copy-out-in-flight-mb"):
        megatron_wiring.validate_args(negative)


def test_cached_memory_release_is_opt_in():
    assert parse([]).offload_release_cached_memory is False
    assert parse(["--offload-release-cached-memory"]).offload_release_cached_memory is True


def test_params_norm_brings_the_state_back_only_with_the_chunked_step(monkeypatch):
    seen = []

    class Coord(megatron_offload.OffloadCoordinator):  # its real state_access and config type
        def __init__(self):  # (so that a renamed field fails here; no device or offloaders)
            self.config = megatron_offload.OffloadConfig(chunked_step=True)
            self.offloaders = ["a", "b"]

        def before_state_access(self, off, will_modify, host_copies_ok=False, **kw):
            seen.append(("before", off, will_modify))

        def after_state_access(self, off, modified):
            seen.append(("after", off, modified))

    norm = megatron_wiring._wrap_calc_params_l2_norm(lambda model: seen.append("norm") or 1.5)
    monkeypatch.setattr(megatron_wiring, "coordinator", Coord())
    assert norm(None) == 1.5
    assert seen == [("before", "a", False), ("before", "b", False), "norm", ("after", "b", False),
                    ("after", "a", False)]
    seen.clear()
    megatron_wiring.coordinator.config = megatron_offload.OffloadConfig(chunked_step=False)
    assert norm(None) == 1.5 and seen == ["norm"]


@pytest.mark.parametrize("built_by_name", [True, False])
def test_offloaders_attach_when_the_optimizer_is_built_before_a_resume_loads(monkeypatch, built_by_name):
    """setup_model_and_optimizer builds the optimizer, then loads a checkpoint into it: with the
    flag on, the plugin attaches in between (so the load writes into the host copies), once; an
    optimizer built some other way gets it after setup, as before; without the flag, never."""
    import types

    import megatron.training.global_vars as global_vars

    order = []
    model = [types.SimpleNamespace(config=types.SimpleNamespace(finalize_model_grads_func=None))]
    optimizer = object()
    get_optimizer = megatron_wiring._wrap_get_megatron_optimizer(lambda config, chunks: optimizer)

    def setup():
        opt = get_optimizer("config", model) if built_by_name else optimizer
        order.append("load_checkpoint")
        return model, opt, None

    def attach(m, opt, args):
        order.append("attach")
        monkeypatch.setattr(megatron_wiring, "coordinator", types.SimpleNamespace(offloaders=[]))

    monkeypatch.setattr(megatron_wiring, "attach", attach)
    monkeypatch.setattr(megatron_wiring, "_attached_to", lambda opt: opt is optimizer and "attach" in order)
    monkeypatch.setattr(megatron_wiring, "coordinator", None)
    for flag in (True, False):
        order.clear()
        monkeypatch.setattr(megatron_wiring, "coordinator", None)
        monkeypatch.setattr(global_vars, "get_args", lambda: argparse.Namespace(offload_optimizer_states=flag))
        assert megatron_wiring._wrap_setup_model_and_optimizer(setup)()[1] is optimizer
        if not flag:
            assert order == ["load_checkpoint"]
        elif built_by_name:
            assert order == ["attach", "load_checkpoint"]
        else:
            assert order == ["load_checkpoint", "attach"]
    get_optimizer("config", model)  # outside setup: never attaches
    assert order == ["load_checkpoint"]


def test_a_step_with_the_flag_and_nothing_attached_fails_loudly(monkeypatch):
    """A script that built its optimizer without the hooked functions (or imported them before
    install()) used to train with the flag and offload nothing, silently."""
    import megatron.training.global_vars as global_vars

    log = megatron_wiring._wrap_training_log(lambda *a, **k: "logged")
    monkeypatch.setattr(megatron_wiring, "coordinator", None)
    monkeypatch.setattr(megatron_wiring, "_stepped_aside", False)
    monkeypatch.setattr(global_vars, "get_args", lambda: argparse.Namespace(offload_optimizer_states=False))
    assert log() == "logged"  # flag off: nothing to say
    monkeypatch.setattr(global_vars, "get_args", lambda: argparse.Namespace(offload_optimizer_states=True))
    with pytest.raises(megatron_wiring.OffloadNotRunningError, match="never attached.*install\\(\\) first"):
        log()
    monkeypatch.setattr(megatron_wiring, "_stepped_aside", True)  # Megatron's own flag: not ours
    assert log() == "logged"


def test_every_hook_point_matches_the_installed_megatron():
    from megatron_offload import compat

    assert compat.mismatches() == []
    compat.check()
    assert compat.version_problem() is None  # (CI runs this suite on the oldest and newest releases supported)


def test_copies_of_hooked_functions_imported_by_name_are_wrapped_too():
    """megatron-core 0.17's initialize_megatron calls the validate_args that megatron.training.initialize
    imported by name: wrapping only megatron.training.arguments' left the plugin's checks (and the
    allocator setting) out of every run there."""
    import megatron.training.initialize as initialize

    from megatron_offload import compat

    assert compat.aliases_of("megatron.training.arguments", "validate_args") == [initialize]
    if hasattr(initialize, "validate_args"):  # 0.17
        assert getattr(initialize.validate_args, "_megatron_offload", False)


def test_a_changed_or_missing_hook_point_is_one_clear_error(monkeypatch):
    """A Megatron whose functions moved or changed shape is refused at install(), naming each
    mismatch, instead of wrappers passing through (or indexing the wrong argument) silently."""
    import megatron.core.pipeline_parallel.schedules as schedules

    from megatron_offload import compat

    def forward_step(model, forward_step_func, data_iterator):  # model moved to the front
        pass

    monkeypatch.setattr(schedules, "forward_step", forward_step)
    points = compat.HOOK_POINTS + (("megatron.training.training", "no_such_function", (), ()),)
    with pytest.raises(compat.IncompatibleMegatronError) as err:
        compat.check(points)
    text = str(err.value)
    assert "schedules.forward_step('model', 'forward_step_func', 'data_iterator') does not start with" in text
    assert "megatron.training.training.no_such_function is missing" in text
    assert f"megatron-core {compat.megatron_core_version()}; supported: megatron-core 0.17 to 0.19" in text


@pytest.mark.parametrize("megatron_core, torch_version, inside", [
    ("0.17.1", "2.8.0", True),
    ("0.19.2", "2.14.1+cu130", True),
    ("0.18.0rc0", "2.9.0a0+50eac811a6", True),  # pre-releases and NGC builds count as their release
    ("0.16.1", "2.11.0", False),
    ("0.20.0", "2.11.0", False),
    ("0.19.2", "2.7.1", False),
    ("0.19.2", "2.15.0", False),
    (None, "2.11.0", False),
])
def test_version_ranges(megatron_core, torch_version, inside):
    from megatron_offload import compat

    problem = compat.version_problem({"megatron-core": megatron_core, "torch": torch_version})
    if inside:
        assert problem is None
    else:
        assert problem == (f"megatron-offload {megatron_offload.__version__} supports megatron-core 0.17 to 0.19 and "
                           f"torch 2.8 to 2.14; found megatron-core {megatron_core or '(none found)'} and "
                           f"torch {torch_version}")


def test_a_release_outside_the_supported_range_is_refused_at_install_before_anything_is_patched(monkeypatch):
    """It used to get a note at most (0.21) or fail somewhere inside Megatron's imports (0.16)."""
    from megatron_offload import compat

    monkeypatch.setattr(megatron_wiring, "_installed", False)
    monkeypatch.setattr(megatron_wiring, "_patch", lambda *a: pytest.fail("patched before the version check"))
    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.16.1")
    monkeypatch.delenv(compat.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(compat.UnsupportedVersionError) as err:
        megatron_offload.install()
    text = str(err.value)
    assert "\n" not in text
    assert "supports megatron-core 0.17 to 0.19 and torch 2.8 to 2.14" in text
    assert f"found megatron-core 0.16.1 and torch {compat.torch_version()}" in text
    assert isinstance(err.value, compat.IncompatibleMegatronError)  # (what the launcher reports)
    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.19.2")
    monkeypatch.setattr(compat, "torch_version", lambda: "2.15.0")
    with pytest.raises(compat.UnsupportedVersionError, match="found megatron-core 0.19.2 and torch 2.15.0"):
        megatron_offload.install()
    monkeypatch.setenv(compat.ALLOW_UNSUPPORTED_ENV, "1")  # the way to try one anyway: a note
    assert "torch 2.15.0 (trying anyway: MEGATRON_OFFLOAD_ALLOW_UNSUPPORTED=1)" in compat.check_versions()


def test_the_launcher_refuses_an_unsupported_release_in_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('TRAINING RAN')\n")
    launch = ("import sys, megatron_offload.compat as c; c.megatron_core_version = lambda: '0.20.0'; "
              "from megatron_offload.__main__ import main; main(sys.argv[1:])")
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("MEGATRON_OFFLOAD_ALLOW_UNSUPPORTED", None)
    out = subprocess.run([sys.executable, "-c", launch, str(script), "--offload-optimizer-states"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 1 and "TRAINING RAN" not in out.stdout
    assert "Traceback" not in out.stderr
    line = [x for x in out.stderr.splitlines() if x.startswith("megatron_offload: ")]
    assert len(line) == 1 and "found megatron-core 0.20.0 and torch" in line[0], out.stderr[-2000:]
    assert "supports megatron-core 0.17 to 0.19 and torch 2.8 to 2.14" in line[0]
    env["MEGATRON_OFFLOAD_ALLOW_UNSUPPORTED"] = "1"
    out = subprocess.run([sys.executable, "-c", launch, str(script)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0 and "TRAINING RAN" in out.stdout, out.stderr[-2000:]


def test_a_megatron_that_does_not_import_is_one_clear_error(monkeypatch):
    """megatron.training of megatron-core 0.17 and 0.18 imports PyYAML, which the wheel does not declare:
    a bare ModuleNotFoundError from deep inside Megatron's imports became one line with the fix."""
    import builtins

    from megatron_offload import compat

    real_import = builtins.__import__

    def no_yaml(name, *a, **k):
        if name == "megatron.training.arguments":
            raise ModuleNotFoundError("No module named 'yaml'", name="yaml")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    with pytest.raises(compat.IncompatibleMegatronError) as err:
        compat.import_training_modules()
    assert str(err.value).startswith("megatron-offload cannot import Megatron's training loop (megatron-core ")
    assert ("No module named 'yaml' (megatron.training of megatron-core 0.17 and 0.18 needs PyYAML: "
            "pip install pyyaml)") in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_launcher_help_lists_every_flag_with_its_default():
    out = subprocess.run([sys.executable, "-m", "megatron_offload", "--help"], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr
    parser = argparse.ArgumentParser()
    megatron_wiring.add_arguments(parser)
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--offload")]
    assert len(flags) >= 9
    for flag in flags:
        assert flag in out.stdout, flag
    assert "usage: torchrun" in out.stdout and "-m megatron_offload SCRIPT.py" in out.stdout
    assert "(default: 256)" in out.stdout  # --offload-chunk-size-mb
    # Flags whose default is resolved from the others say so in their help, not "(default: None)".
    assert "(default: None)" not in out.stdout and "1024 with the streamed step" in " ".join(out.stdout.split())


def test_turning_on_expandable_segments_warns_nothing_of_ours(monkeypatch):
    """torch.cuda's allocator setter warns that it is deprecated on every launch; the plugin uses
    the accelerator-generic one where torch has it."""
    import warnings

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # (registers the variable, so that what the call sets is undone)
        monkeypatch.delenv(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        note = allocator.configure_allocator()
    assert "turned on PyTorch's expandable segments" in note


def test_a_megatron_script_help_works(tmp_path):
    """`megatron-offload SCRIPT --help` used to crash in argparse on megatron-core 0.19.2, on an upstream
    help string with a bare '%' (upstream_fixes.mend_help_strings)."""
    import megatron.training.arguments as arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)  # (wrapped by install(): mended)
    text = parser.format_help()
    assert "--offload-optimizer-states" in text
    if "--moe-paged-stash-buffer-size-factor-cuda" in parser._option_string_actions:  # (0.19: the bare '%')
        assert "--moe-paged-stash-buffer-size-factor-cuda" in text
    script = tmp_path / "train.py"
    script.write_text(PARSE_AND_VALIDATE + "parse_and_validate_args()\n")
    out = subprocess.run([sys.executable, "-m", "megatron_offload", str(script), "--help"], capture_output=True,
                         text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--offload-chunk-size-mb" in out.stdout


def test_flags_become_a_frozen_config_and_the_product_reads_no_diagnostic_variable(monkeypatch):
    import argparse
    import dataclasses

    from megatron_offload import OffloadConfig, megatron_args

    args = megatron_args.add_flags(argparse.ArgumentParser()).parse_args(
        ["--offload-optimizer-states", "--offload-state-fraction", "auto", "--offload-chunk-size-mb", "32"])
    for var in ("MEGATRON_OFFLOAD_HOST_WAIT", "MEGATRON_OFFLOAD_WORKSPACE", "MEGATRON_OFFLOAD_RELEASE_AT",
                "MEGATRON_OFFLOAD_BACKWARD_RELOADS"):
        monkeypatch.setenv(var, "1" if var.endswith("WAIT") else "0")
    config = megatron_args.config_from_args(args)
    # (With `auto` the flags' default engine is the whole step, OffloadConfig's own default.)
    assert config == OffloadConfig(chunk_bytes=32 * 2**20, auto_fraction_at=megatron_args.AUTO_FRACTION_ITERATION)
    streamed = megatron_args.config_from_args(megatron_args.add_flags(argparse.ArgumentParser()).parse_args(
        ["--offload-optimizer-states", "--offload-chunk-size-mb", "32"]))
    assert streamed == OffloadConfig(chunk_bytes=32 * 2**20, chunked_step=True,
                                     copy_out_in_flight_bytes=megatron_args.DEFAULT_IN_FLIGHT_MB * 2**20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunk_bytes = 1
    monkeypatch.setitem(megatron_args.DIAGNOSTICS, "host_waits_at_free", True)  # what the benchmark sets
    assert megatron_args.config_from_args(args).host_waits_at_free
    with pytest.raises(ValueError, match="release point"):
        OffloadConfig(release_at={"sometime"})


def test_async_save_and_fully_parallel_load_reach_the_config():
    import argparse

    from megatron_offload import megatron_args

    args = megatron_args.add_flags(argparse.ArgumentParser()).parse_args(["--offload-optimizer-states"])
    assert not megatron_args.config_from_args(args).async_saves
    args.async_save, args.ckpt_fully_parallel_load = True, True
    config = megatron_args.config_from_args(args)
    assert config.async_saves and not config.host_loads
    assert config.async_save_snapshots  # (no --async-strategy: a megatron-core with only its own)
    # Snapshots only with megatron-core's own strategy (its queue keeps a save's request until
    # the write is finalized); nvidia-resiliency-ext's reads the views.
    for strategy, snapshots in (("mcore", True), ("nvrx", False)):
        args.async_strategy = strategy
        config = megatron_args.config_from_args(args)
        # (filled in the background where megatron_wiring's wrapper of megatron-core's queue waits)
        assert config.async_save_snapshots == snapshots == config.async_save_background_fill
    args.async_save = False
    assert not megatron_args.config_from_args(args).async_save_snapshots


def test_an_async_request_with_snapshots_still_filling_makes_its_writer_wait():
    """megatron-core's `AsyncCallsQueue.schedule_async_request`, wrapped (megatron_saves): with
    background fills configured, every request gets a first finalize function that checks them
    on every rank (none pending included); with fills pending, the writer's function is
    `snapshot_fill.writer_waits` on their flags around the original and the request is handed
    over under torch's file_system sharing (restored after); a pending fill is handed to every
    request until it is done; a request without a wait for its worker (no preload) is scheduled
    once the fills finished here; `AsyncRequest.execute_sync` (a synchronous save) waits for
    them; without the configuration nothing changes."""
    import functools
    import threading

    import torch.multiprocessing as mp
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    from megatron_offload import megatron_saves, snapshot_fill
    from megatron_offload.config import OffloadConfig
    from megatron_offload.save_snapshot import SaveSnapshots

    snaps = SaveSnapshots(check=lambda n: None)
    snaps.background = True

    class Coord:
        config = OffloadConfig(async_save_snapshots=True, async_save_background_fill=True)

        def pending_snapshot_fills(self):
            return snaps.pending_fills()

        def wait_snapshots_filled(self):
            snaps.wait_filled()

    current = [Coord()]
    scheduled = []

    def original(queue, request):
        # (fills start only once the request is with the writer: none has started yet here)
        scheduled.append((request, mp.get_sharing_strategy(), [f.started for f in snaps._fills]))
        return 7

    def write(*a, **k):
        return ("wrote", a, k)

    def finalize():
        pass

    schedule = megatron_saves._wrap_schedule_async_request(original, lambda: current[0])
    request = AsyncRequest(write, (1, 2), [finalize], async_fn_kwargs={"k": 3}, preload_fn=lambda: None)
    before = mp.get_sharing_strategy()
    assert schedule(None, request) == 7  # nothing filling: the check only
    sent, strategy, _ = scheduled[-1]
    assert strategy == before and sent.async_fn is write and sent.finalize_fns[1:] == [finalize]
    assert sent.finalize_fns[0].func is snapshot_fill.check_written and sent.finalize_fns[0].args == ([],)
    gate = threading.Event()
    snaps.take([torch.ones(8)], before=gate.wait, background=True)
    for n in range(2):  # (a second save before the fill is done waits for it too)
        schedule(None, request)
        sent, strategy, started = scheduled[-1]
        assert started == [n == 1] and snaps._fills[0].started  # (started after the first request)
        assert strategy == "file_system" and mp.get_sharing_strategy() == before
        assert isinstance(sent.async_fn, functools.partial) and sent.async_fn.func is snapshot_fill.writer_waits
        (flag,), inner = sent.async_fn.args
        assert inner is write and int(flag[0]) == 0
        assert sent.finalize_fns[1:] == [finalize] and sent.finalize_fns[0].func is snapshot_fill.check_written
    gate.set()
    assert sent.async_fn(*sent.async_fn_args, **sent.async_fn_kwargs) == ("wrote", (1, 2), {"k": 3})
    sent.finalize_fns[0]()
    assert snaps.pending_fills() == []
    snaps.take([torch.ones(8)], before=lambda: time.sleep(0.2), background=True)
    plain = request._replace(preload_fn=None)
    schedule(None, plain)
    assert scheduled[-1][0].async_fn is write and scheduled[-1][2] == [True]  # (waited for here)
    ran = []
    execute = megatron_saves._wrap_execute_sync(lambda r: ran.append(all(f.done for f in snaps._fills)),
                                                lambda: current[0])
    snaps.take([torch.ones(8)], before=lambda: time.sleep(0.2), background=True)
    execute(request)
    assert ran == [True]
    def refused(queue, request):  # (megatron-core raising after the request may have gone out)
        raise RuntimeError("queue broken")

    snaps.take([torch.ones(8)], before=lambda: time.sleep(0.2), background=True)
    (fill,) = snaps.pending_fills()
    with pytest.raises(RuntimeError, match="queue broken"):
        megatron_saves._wrap_schedule_async_request(refused, lambda: current[0])(None, request)
    assert fill.started and mp.get_sharing_strategy() == before  # (started all the same)
    snaps.wait_filled()
    current[0] = None
    schedule(None, request)
    assert scheduled[-1][:2] == (request, before)


def test_what_dist_checkpointing_reads_before_its_writer_runs():
    """`read_before_the_writer`: a plain ShardedTensor over a whole contiguous storage goes to the
    writer as it is; a view is cloned, a non-contiguous tensor copied, a factory built, an object
    pickled, a plain tensor saved in this process: their tensors are reported."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from megatron_offload.megatron_saves import read_before_the_writer

    whole, base, grid = torch.zeros(8), torch.zeros(16), torch.zeros(4, 4)
    factory = ShardedTensorFactory("f", torch.zeros(8), lambda *a: None, lambda *a: None, replica_id=0)
    state = {"whole": ShardedTensor.from_rank_offsets("w", whole, replica_id=0),
             "nested": [{"view": ShardedTensor.from_rank_offsets("v", base[4:12], replica_id=0)}],
             "strided": ShardedTensor.from_rank_offsets("s", grid.t(), replica_id=0),
             "factory": factory,
             "object": ShardedObject("o", {"t": torch.ones(2)}, (1,), (0,), replica_id=0),
             "plain": torch.ones(3)}
    read = [t.untyped_storage().data_ptr() for t in read_before_the_writer(state)]
    expected = [base, grid, factory.data, state["object"].data["t"], state["plain"]]
    assert read == [t.untyped_storage().data_ptr() for t in expected]


def _smallest_on_rank(rank, world, port, values, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # Data-parallel groups of two inside the job, as in PP2 x DP2: the agreement must still span all.
        for ranks in ([0, 1], [2, 3]):
            dist.new_group(ranks)
        smallest = auto_fraction.smallest_over_job()
        out.put((rank, smallest(values[rank])))
    finally:
        dist.destroy_process_group()


def test_the_automatic_fraction_is_agreed_by_every_rank_of_the_job():
    """Pipeline stages wait for each other: a stage that offloads more than another's free share
    stalls it (see [Note: group agreement] in docs/design.md)."""
    from fakes import run_on_gloo_ranks

    values = [1.0, 0.9, 0.5, 0.6]
    got = run_on_gloo_ranks(_smallest_on_rank, 4, values)
    assert got == {r: 0.5 for r in range(4)}
    assert auto_fraction.smallest_over_job() is None  # (outside torch.distributed)


def test_grad_accumulators_are_recreated_with_one_hook_each():
    from fakes import HookedLikeMegatronDDP
    from megatron_offload import upstream_fixes

    torch.manual_seed(0)
    ddp = HookedLikeMegatronDDP(torch.nn.Linear(4, 3))
    for node in ddp.grad_accs:
        node.metadata["test_old"] = True
    del node
    with torch.no_grad():  # (as a caller under no_grad would: the call enables it itself)
        assert upstream_fixes.grad_accumulators_on_current_stream([ddp, object()]) == 2
    assert not any("test_old" in n.metadata for n in ddp.grad_accs)  # new nodes
    assert [n.variable for n in ddp.grad_accs] == list(ddp.module.parameters())
    ddp.module(torch.ones(2, 4)).sum().backward()
    # Each parameter's hook ran once: the old nodes (and their hooks) are gone.
    assert sorted(map(id, ddp.calls)) == sorted(map(id, ddp.module.parameters()))


def test_a_grad_accumulator_held_elsewhere_is_refused():
    from fakes import HookedLikeMegatronDDP
    from megatron_offload import upstream_fixes

    ddp = HookedLikeMegatronDDP(torch.nn.Linear(4, 3))
    held = ddp.grad_accs[0]  # a reference outside grad_accs keeps the node alive
    with pytest.raises(RuntimeError, match="1 AccumulateGrad node"):
        upstream_fixes.grad_accumulators_on_current_stream([ddp])
    # Left consistent: the survivor is back in grad_accs with its one hook, the other is new.
    assert ddp.grad_accs[0] is held and len(ddp.grad_accs) == 2
    del held
    ddp.module(torch.ones(2, 4)).sum().backward()
    assert sorted(map(id, ddp.calls)) == sorted(map(id, ddp.module.parameters()))


def test_attach_moves_ddp_grad_accumulators_unless_kept(monkeypatch):
    from fakes import HookedLikeMegatronDDP
    from megatron_offload import megatron_args
    from megatron_offload.config import DEFERRED_FREES_HOST_LEAD_LAYERS
    from megatron_offload.streams import HostLeadBound

    def coord():  # (the bound of a coordinator built with the flag's default: none)
        return argparse.Namespace(host_lead=HostLeadBound(None, 0, new_event=object))

    ddp = HookedLikeMegatronDDP(torch.nn.Linear(4, 3))
    for node in ddp.grad_accs:
        node.metadata["test_old"] = True
    del node
    c = coord()
    clause, every_rank = megatron_wiring._grad_accumulators_to_compute_stream(c, [ddp], argparse.Namespace())
    assert clause == ", 2 DDP gradient accumulators on the compute stream" and not every_rank
    assert not any("test_old" in n.metadata for n in ddp.grad_accs) and c.host_lead.depth == 0
    # Under FP8 too (upstream names TE's FP8 gradient setup as its reason for the side stream).
    fp8 = HookedLikeMegatronDDP(torch.nn.Linear(4, 3))
    for node in fp8.grad_accs:
        node.metadata["test_old"] = True
    del node
    clause, _ = megatron_wiring._grad_accumulators_to_compute_stream(coord(), [fp8], argparse.Namespace(fp8="hybrid"))
    assert clause == ", 2 DDP gradient accumulators on the compute stream"
    assert not any("test_old" in n.metadata for n in fp8.grad_accs)

    kept = list(ddp.grad_accs)
    clause, _ = megatron_wiring._grad_accumulators_to_compute_stream(
        coord(), [ddp], argparse.Namespace(offload_keep_ddp_grad_stream=True))
    assert "left on their own stream (--offload-keep-ddp-grad-stream)" in clause
    assert all(a is b for a, b in zip(ddp.grad_accs, kept))

    # A node referenced elsewhere: the run goes on, the attach line says so, and the survivors'
    # deferred frees get the host-lead bound unless the user (or a benchmark's override) chose one.
    chosen = coord()
    clause, _ = megatron_wiring._grad_accumulators_to_compute_stream(
        chosen, [ddp], argparse.Namespace(offload_host_lead_layers=0))
    assert "referenced outside" in clause and chosen.host_lead.depth == 0 and "host-lead bound" not in clause
    overridden = coord()
    monkeypatch.setitem(megatron_args.DIAGNOSTICS, "host_lead_layers", 0)
    megatron_wiring._grad_accumulators_to_compute_stream(overridden, [ddp], argparse.Namespace())
    assert overridden.host_lead.depth == 0
    monkeypatch.delitem(megatron_args.DIAGNOSTICS, "host_lead_layers")
    c = coord()
    clause, every_rank = megatron_wiring._grad_accumulators_to_compute_stream(c, [ddp], argparse.Namespace())
    assert "2 AccumulateGrad node(s)" in clause and "referenced outside" in clause and every_rank
    assert c.host_lead.depth == DEFERRED_FREES_HOST_LEAD_LAYERS > 0
    assert clause.endswith(f"; host-lead bound {DEFERRED_FREES_HOST_LEAD_LAYERS} layer(s)")
    # (A bound that cannot record anything stays off.)
    assert HostLeadBound(None, 0).at_least(3) == 0
    del kept
    ddp.module(torch.ones(2, 4)).sum().backward()
    assert len(ddp.calls) == 2  # one hook each, wherever the nodes are


def test_keep_ddp_grad_stream_flag_parses():
    on = ["--offload-optimizer-states", "--use-distributed-optimizer"]
    assert parse(on).offload_keep_ddp_grad_stream is False
    assert parse(on + ["--offload-keep-ddp-grad-stream"]).offload_keep_ddp_grad_stream is True
