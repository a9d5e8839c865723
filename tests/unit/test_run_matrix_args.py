"""The matrix runner's --extra and --script reach every run of a case (e.g. TE layers on two GPUs,
Megatron-LM's own pretrain_gpt.py on four)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "functional"))

import run_matrix  # noqa: E402


class Launched(Exception):
    pass


class InlineSlots:
    """GpuSlots that runs each launch at once, with no devices."""

    def run(self, fn, n):
        return fn({})


def use_launch(monkeypatch, fake_launch, script):
    """run_matrix with `fake_launch` for its runs, no --extra, and `script` as the training script."""
    monkeypatch.setattr(run_matrix, "launch", fake_launch)
    monkeypatch.setattr(run_matrix, "EXTRA", [])
    monkeypatch.setattr(run_matrix, "SCRIPT", [script])


def test_extra_arguments_reach_every_run(monkeypatch, tmp_path):
    seen = []

    def fake_launch(name, args, nproc, out, script=None, env_extra=None):
        seen.append((name, args))
        assert script == "/some/megatron-lm/pretrain_gpt.py", script
        raise Launched(name)

    use_launch(monkeypatch, fake_launch, "/some/megatron-lm/pretrain_gpt.py")
    run_matrix.EXTRA[:] = " ".join(["--transformer-impl=transformer_engine", "--fp8-format hybrid"]).split()
    with pytest.raises(Launched):
        run_matrix.run_case("dp2", 4, str(tmp_path), InlineSlots())
    assert seen, "nothing launched"
    for name, args in seen:
        # After the model's defaults (which say --transformer-impl local), so that they win.
        i = args.index("--transformer-impl=transformer_engine")
        assert i > args.index("local") and args[i + 1:i + 3] == ["--fp8-format", "hybrid"], (name, args)


def test_offload_extra_reaches_the_offloading_runs_only(monkeypatch, tmp_path):
    seen = {}

    def fake_launch(name, args, nproc, out, script=None, env_extra=None):
        seen[name] = args
        raise Launched(name)

    use_launch(monkeypatch, fake_launch, "scripts/pretrain_gpt_mock.py")
    monkeypatch.setattr(run_matrix, "OFFLOAD_EXTRA",
                        "--offload-memory-margin-mb=1000000 --offload-release-cached-memory".split())
    for case in ("ep2-moe", "pp2-chunked"):
        with pytest.raises(Launched):
            run_matrix.run_case(case, 4, str(tmp_path), InlineSlots())
    for case in ("ep2-moe", "pp2-chunked"):
        offload, plain = seen[f"{case}-offload"], seen[f"{case}-baseline"]
        assert offload[-2:] == ["--offload-memory-margin-mb=1000000", "--offload-release-cached-memory"], offload
        assert "--offload-optimizer-states" in offload
        assert not any(a.startswith("--offload") for a in plain), plain


def test_script_choice(tmp_path, monkeypatch):
    import megatron_runs
    assert megatron_runs.choose_script("mock") == megatron_runs.MOCK_SCRIPT
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    assert megatron_runs.choose_script(str(tmp_path)) == str(script)
    monkeypatch.setattr(megatron_runs, "upstream_script", lambda explicit=None: None)
    assert megatron_runs.choose_script("auto") == megatron_runs.MOCK_SCRIPT
    with pytest.raises(SystemExit):
        megatron_runs.choose_script("upstream")


def test_a_failed_checkpoint_run_fails_its_own_checks_only(monkeypatch, tmp_path):
    """A checkpoint run that failed (or, re-evaluated from records, never finished: a time limit)
    must not hide the checks of the case's other runs."""
    iters, half = 4, 2

    def record(n, loss_offset=0.0):
        its = [{"loss": float(1.0 + i + loss_offset).hex(), "skipped": 0, "max_reserved": 2 << 30,
                "max_allocated": 1 << 30} for i in range(n)]
        rank = {"iterations": its, "params_sha256": "p", "optimizer_state_sha256": "s", "offloaded_bytes": 1 << 20,
                "adam_state_bytes": 1 << 20, "cumulative_d2h_bytes": 10 << 20}
        return {"ranks": [rank, dict(rank)]}

    def fake_launch(name, args, nproc, out, script=None, env_extra=None):
        if name == "dp2-finetune-plain":
            raise FileNotFoundError("dp2-finetune-plain/rank0.json")
        if name.startswith("dp2-no_load_optim"):
            return record(half, loss_offset=half)  # (resumed at `half`: the uninterrupted run's losses from there)
        return record(iters if name in ("dp2-baseline", "dp2-offload") else half)

    use_launch(monkeypatch, fake_launch, "scripts/pretrain_gpt_mock.py")
    checks = {what: ok for what, ok, _ in run_matrix.run_case("dp2", iters, str(tmp_path), InlineSlots())["checks"]}
    assert checks["finetune: ran"] is False
    assert not any(what.startswith("finetune:") for what in checks if what != "finetune: ran")
    assert checks["no_load_optim: losses identical with and without offload"]
    assert checks["no_load_optim: first resumed loss equals the uninterrupted run's"]
    assert checks["losses bit-identical"] and checks["rank 1 params identical"]
