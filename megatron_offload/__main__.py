"""Launcher: run an unmodified Megatron training script with megatron-offload wired in.

    torchrun --nproc-per-node 8 -m megatron_offload pretrain_gpt.py <megatron args> --offload-optimizer-states

The script runs as `__main__` with its own directory first on sys.path (as `python script.py`
would), after `megatron_offload.install()` has added the flags and hooks.
"""

import os
import runpy
import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_offload: no such training script: {script}")
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
