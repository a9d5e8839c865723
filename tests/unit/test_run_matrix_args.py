"""The matrix runner's --extra and --script reach every run of a case (e.g. TE layers on two GPUs,
Megatron-LM's own pretrain_gpt.py on four)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "functional"))

import run_matrix  # noqa: E402


class Launched(Exception):
    pass


def test_extra_arguments_reach_every_run(monkeypatch, tmp_path):
    seen = []

    def fake_launch(name, args, nproc, out, script=None, env_extra=None):
        seen.append((name, args))
        assert script == "/some/megatron-lm/pretrain_gpt.py", script
        raise Launched(name)

    class Slots:
        def run(self, fn, n):
            return fn({})

    monkeypatch.setattr(run_matrix, "launch", fake_launch)
    monkeypatch.setattr(run_matrix, "EXTRA", [])
    monkeypatch.setattr(run_matrix, "SCRIPT", ["/some/megatron-lm/pretrain_gpt.py"])
    run_matrix.EXTRA[:] = " ".join(["--transformer-impl=transformer_engine", "--fp8-format hybrid"]).split()
    with pytest.raises(Launched):
        run_matrix.run_case("dp2", 4, str(tmp_path), Slots())
    assert seen, "nothing launched"
    for name, args in seen:
        # After the model's defaults (which say --transformer-impl local), so that they win.
        i = args.index("--transformer-impl=transformer_engine")
        assert i > args.index("local") and args[i + 1:i + 3] == ["--fp8-format", "hybrid"], (name, args)


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
