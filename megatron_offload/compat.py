"""What megatron-offload expects of the Megatron and torch it runs with, checked once at `install()`.

First the versions: megatron-core and torch must lie in the ranges the CPU suite runs on in CI
(SUPPORTED); outside them `install()` raises UnsupportedVersionError, one line naming what it found
and what is supported. Then every function the plugin wraps is listed with the parameters its
wrapper relies on (by position where the wrapper reads positional arguments, by name otherwise). A
Megatron whose functions moved or changed shape gets one error naming each mismatch, instead of a
wrapper that silently passes through (or fails deep inside a training step) on a signature it does
not understand.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

# (oldest, newest) major.minor, both included. Pre-releases and local builds count as their
# release: NGC's torch "2.9.0a0+50eac81" is 2.9. Why these bounds:
#   megatron-core 0.17  the first wheel on PyPI that ships `megatron.training` (0.16.1 has only
#                       megatron.core), which the plugin wires into;
#   megatron-core 0.19  the newest release (0.19.2 is the one run on GPUs);
#   torch 2.8           the oldest CI can test: with 2.7.1 and 2.6.0 (triton 3.3, 3.2)
#                       `megatron.training` does not import where no GPU driver is loaded,
#                       so the CPU suite cannot run (not known to fail on GPUs);
#   torch 2.14          the newest release tested.
SUPPORTED = {"megatron-core": ((0, 17), (0, 19)), "torch": ((2, 8), (2, 14))}
# Set to 1 to try a release outside SUPPORTED anyway (a note instead of the error; the signature
# check below still applies).
ALLOW_UNSUPPORTED_ENV = "MEGATRON_OFFLOAD_ALLOW_UNSUPPORTED"

# Functions that some supported releases also bind by name in another module (`from ... import`
# at import time), where their caller looks them up: install() rebinds those copies too.
#   megatron-core 0.17: `initialize_megatron` calls megatron.training.initialize's own
#   `validate_args` (0.18 and later call it through megatron.training.arguments).
ALIASES: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("megatron.training.arguments", "validate_args"): ("megatron.training.initialize",),
}

# (module, attribute path, leading positional parameters the wrapper indexes, names it reads)
HOOK_POINTS: Tuple[Tuple[str, str, Tuple[str, ...], Tuple[str, ...]], ...] = (
    ("megatron.training.arguments", "add_megatron_arguments", ("parser",), ()),
    ("megatron.training.arguments", "validate_args", ("args",), ()),
    ("megatron.training.training", "setup_model_and_optimizer", (), ()),
    ("megatron.training.training", "get_megatron_optimizer", ("config", "model_chunks"), ()),
    ("megatron.training.training", "finalize_model_grads", (), ()),
    ("megatron.training.training", "training_log", (), ("iteration",)),
    ("megatron.training.training", "calc_params_l2_norm", (), ()),
    ("megatron.training.training", "logical_and_across_model_parallel_group", ("input",), ()),
    ("megatron.training.training", "reduce_max_stat_across_model_parallel_group", ("stat",), ()),
    ("megatron.core.pipeline_parallel.schedules", "forward_step",
     ("forward_step_func", "data_iterator", "model"), ()),
    ("megatron.core.pipeline_parallel.schedules", "backward_step", (), ()),
    ("megatron.core.datasets.utils", "compile_helpers", (), ()),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.state_dict", ("self",), ()),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
     ("self", "state_dict"), ()),
    # megatron_state_methods.wrap_state_access reads is_loading as the second argument after self.
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.sharded_state_dict",
     ("self", "model_sharded_state_dict", "is_loading"), ()),
    # megatron_saves' wrappers take the request as the argument after self, or as self.
    ("megatron.core.dist_checkpointing.strategies.async_utils", "AsyncCallsQueue.schedule_async_request",
     ("self", "async_request"), ()),
    ("megatron.core.dist_checkpointing.strategies.async_utils", "AsyncRequest.execute_sync", ("self",), ()),
)


class IncompatibleMegatronError(RuntimeError):
    """The running Megatron does not offer the functions megatron-offload hooks, as it expects them."""


class UnsupportedVersionError(IncompatibleMegatronError):
    """megatron-core or torch lies outside the ranges megatron-offload supports (SUPPORTED)."""


def _release(version: Optional[str]) -> Optional[Tuple[int, int]]:
    """(major, minor) of a version string; pre-release and local parts are ignored."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def megatron_core_version() -> Optional[str]:
    """The version of the megatron.core that imports (a Megatron-LM checkout on PYTHONPATH
    included), else of the installed distribution; None when there is neither."""
    try:
        from megatron.core import package_info

        # (megatron-core appends `+<commit>` of whatever git checkout holds its files)
        return str(package_info.__version__).split("+")[0]
    except Exception:  # noqa: BLE001 - not installed, or a megatron.core that fails to import
        pass
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("megatron-core")
    except (ImportError, PackageNotFoundError):
        return None


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def _range_text(name: str) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED[name]
    return f"{name} {lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def version_problem(found: Optional[Dict[str, Optional[str]]] = None) -> Optional[str]:
    """One line naming the versions found and the supported ranges when either lies outside
    them; None inside."""
    from . import __version__

    found = found or {"megatron-core": megatron_core_version(), "torch": torch_version()}
    releases = {name: _release(found.get(name)) for name in SUPPORTED}
    if all(releases[name] is not None and lo <= releases[name] <= hi for name, (lo, hi) in SUPPORTED.items()):
        return None
    found_text = " and ".join(f"{name} {found.get(name) or '(none found)'}" for name in SUPPORTED)
    supported = " and ".join(_range_text(name) for name in SUPPORTED)
    return f"megatron-offload {__version__} supports {supported}; found {found_text}"


def check_versions() -> Optional[str]:
    """Raise UnsupportedVersionError outside SUPPORTED. With MEGATRON_OFFLOAD_ALLOW_UNSUPPORTED=1,
    return the same line as a note instead. None inside."""
    problem = version_problem()
    if problem is None:
        return None
    if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1":
        return f"{problem} (trying anyway: {ALLOW_UNSUPPORTED_ENV}=1)"
    raise UnsupportedVersionError(
        f"{problem}. Run without megatron-offload, install supported releases (on a fresh machine: "
        f"pip install 'megatron-offload[megatron]'), or set {ALLOW_UNSUPPORTED_ENV}=1 to try anyway.")


def import_training_modules():
    """(arguments, training, schedules): Megatron's modules that install() patches, or one
    IncompatibleMegatronError line saying why they do not import."""
    try:
        import megatron.core.pipeline_parallel.schedules as schedules
        import megatron.training.arguments as arguments
        import megatron.training.training as training
    except ImportError as err:
        hint = ""
        if getattr(err, "name", None) == "yaml":  # megatron-core 0.17 and 0.18 need it and do not declare it
            hint = " (megatron.training of megatron-core 0.17 and 0.18 needs PyYAML: pip install pyyaml)"
        raise IncompatibleMegatronError(
            f"megatron-offload cannot import Megatron's training loop (megatron-core "
            f"{megatron_core_version() or '(none found)'}): {err}{hint}") from None
    return arguments, training, schedules


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)  # (our own wrappers, when install() runs twice)


def mismatches(points=HOOK_POINTS) -> List[str]:
    """One line per hook point that is missing or whose parameters are not what its wrapper reads."""
    found = []
    for module, path, leading, named in points:
        where = f"{module}.{path}"
        try:
            fn = _resolve(module, path)
        except (ImportError, AttributeError) as err:
            found.append(f"{where} is missing ({err})")
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            found.append(f"{where} has no inspectable signature")
            continue
        if params[: len(leading)] != list(leading):
            found.append(f"{where}{tuple(params)} does not start with {leading}")
        missing = [n for n in named if n not in params]
        if missing:
            found.append(f"{where}{tuple(params)} has no parameter {', '.join(missing)}")
    return found


def check(points=HOOK_POINTS) -> None:
    """Raise IncompatibleMegatronError naming every hook point that is missing or changed shape."""
    found = mismatches(points)
    if found:
        raise IncompatibleMegatronError(
            f"megatron-offload cannot wire into this Megatron (megatron-core {megatron_core_version() or 'unknown'}; "
            f"supported: {_range_text('megatron-core')}): " + "; ".join(found)
            + ". Run without megatron-offload, or with a megatron-core it supports.")


def aliases_of(module: str, name: str) -> List[object]:
    """The imported modules holding their own binding of `module.name` (ALIASES)."""
    return [sys.modules[m] for m in ALIASES.get((module, name), ()) if m in sys.modules]
