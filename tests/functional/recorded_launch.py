"""Launch any GPT training script (Megatron-LM's own `pretrain_gpt.py` included) through
megatron-offload's launcher with the functional tests' run recorder installed.

    torchrun ... tests/functional/recorded_launch.py <script.py> <megatron args>

The recorder (scripts/pretrain_gpt_mock.py's `Recorder`, enabled by MEGATRON_OFFLOAD_RECORD) wraps
megatron.training's module functions, so it works with a script it knows nothing about.
MEGATRON_OFFLOAD_NO_PLUGIN=1: the script runs without megatron-offload, only with the fix that lets
    the pip wheel run it at all (upstream_fixes.install_wheel_fix_only; isolating runs).
MEGATRON_OFFLOAD_KILL_AT=<iteration>: every rank SIGKILLs itself (by its own process id) right
after the second forward of that iteration, i.e. mid-iteration with the state offloaded.
"""

import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))


def _install_kill(iteration: int) -> None:
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.training.training as training

    state = {"iteration": None, "forwards": 0}
    train_step, forward_step = training.train_step, schedules.forward_step

    def counting_train_step(*a, **k):
        state["iteration"], state["forwards"] = k.get("iteration"), 0
        return train_step(*a, **k)

    def killing_forward_step(*a, **k):
        out = forward_step(*a, **k)
        state["forwards"] += 1
        if state["iteration"] == iteration and state["forwards"] == 2:
            print(f"[recorded_launch] killing rank pid {os.getpid()} at iteration {iteration}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    training.train_step = counting_train_step
    schedules.forward_step = killing_forward_step


def main() -> None:
    no_plugin = os.environ.get("MEGATRON_OFFLOAD_NO_PLUGIN") == "1"
    if not no_plugin:
        import megatron_offload

        # The plugin first, the recorder around it: the order `-m megatron_offload` gives the mock.
        megatron_offload.install()
    if os.environ.get("MEGATRON_OFFLOAD_RECORD"):
        from pretrain_gpt_mock import Recorder

        recorder = Recorder(os.environ["MEGATRON_OFFLOAD_RECORD"])
        recorder.install()
        if os.environ.get("MEGATRON_OFFLOAD_MEMHIST"):  # the allocator history, as the mock records it
            recorder.start_memhist()
        os.environ["MEGATRON_OFFLOAD_RECORDER_INSTALLED"] = "1"  # (the mock then skips its own)
    if os.environ.get("MEGATRON_OFFLOAD_KILL_AT"):
        _install_kill(int(os.environ["MEGATRON_OFFLOAD_KILL_AT"]))
    if no_plugin:  # none of the plugin's code but the pip wheel's missing-Makefile fix
        from megatron_offload import upstream_fixes

        upstream_fixes.install_wheel_fix_only()
    from megatron_offload.__main__ import main as launch

    launch(sys.argv[1:], install=not no_plugin)


if __name__ == "__main__":
    main()
