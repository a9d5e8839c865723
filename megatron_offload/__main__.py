"""Launcher: run an unmodified Megatron training script with megatron-offload wired in.

    torchrun --nproc-per-node 8 -m megatron_offload pretrain_gpt.py <megatron args> --offload-optimizer-states

The script runs as `__main__` with its own directory first on sys.path (as `python script.py`
would), after `megatron_offload.install()` has added the flags and hooks.
"""

import os
import runpy
import sys


def usage() -> str:
    """The launcher's usage and every flag the plugin adds, from the definitions it registers."""
    import argparse

    from megatron_offload.megatron_wiring import add_arguments

    class Defaults(argparse.ArgumentDefaultsHelpFormatter):
        # No "(default: None)": such a flag's default is resolved from the others, as its help says.
        def _get_help_string(self, action):
            return action.help if action.default is None else super()._get_help_string(action)

    parser = argparse.ArgumentParser(
        prog="megatron-offload", add_help=False, formatter_class=Defaults,
        usage="torchrun [torchrun args] -m megatron_offload SCRIPT.py [Megatron args] --offload-optimizer-states [options]",
        description=__doc__.strip().splitlines()[0])
    add_arguments(parser)
    return parser.format_help()


def main(argv=None, install: bool = True) -> None:
    """Run `argv[0]` as `__main__` with `argv[1:]`; `install=False` runs it without the plugin."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_offload: no such training script: {script}")
    if install:
        import megatron_offload
        from megatron_offload.compat import IncompatibleMegatronError

        try:
            megatron_offload.install()
        except IncompatibleMegatronError as err:
            raise SystemExit(f"megatron_offload: {err}") from err
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
