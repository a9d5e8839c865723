"""What megatron-offload expects of the Megatron it patches, checked once at `install()`.

Every function the plugin wraps is listed with the parameters its wrapper relies on (by position
where the wrapper reads positional arguments, by name otherwise). A Megatron whose functions moved
or changed shape gets one error naming each mismatch, instead of a wrapper that silently passes
through (or fails deep inside a training step) on a signature it does not understand.
"""

from __future__ import annotations

import importlib
import inspect
from typing import List, Optional, Tuple

# The megatron-core releases these signatures were validated on.
VALIDATED = ("0.19",)

# (module, attribute path, leading positional parameters the wrapper indexes, names it reads)
HOOK_POINTS: Tuple[Tuple[str, str, Tuple[str, ...], Tuple[str, ...]], ...] = (
    ("megatron.training.arguments", "add_megatron_arguments", ("parser",), ()),
    ("megatron.training.arguments", "validate_args", ("args",), ()),
    ("megatron.training.training", "setup_model_and_optimizer", (), ()),
    ("megatron.training.training", "get_megatron_optimizer", ("config", "model_chunks"), ()),
    ("megatron.training.training", "finalize_model_grads", (), ()),
    ("megatron.training.training", "training_log", (), ("iteration",)),
    ("megatron.training.training", "calc_params_l2_norm", (), ()),
    ("megatron.core.pipeline_parallel.schedules", "forward_step",
     ("forward_step_func", "data_iterator", "model"), ()),
    ("megatron.core.pipeline_parallel.schedules", "backward_step", (), ()),
    ("megatron.core.datasets.utils", "compile_helpers", (), ()),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.state_dict", ("self",), ()),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
     ("self", "state_dict"), ()),
    # _wrap_state_access reads is_loading as the second argument after self.
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.sharded_state_dict",
     ("self", "model_sharded_state_dict", "is_loading"), ()),
)


class IncompatibleMegatronError(RuntimeError):
    """The running Megatron does not offer the functions megatron-offload hooks, as it expects them."""


def megatron_core_version() -> Optional[str]:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:  # noqa: BLE001 - a checkout without package_info
        return None


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


def check(points=HOOK_POINTS) -> Optional[str]:
    """Raise IncompatibleMegatronError on any mismatch; return a note for a release the
    signatures match but nobody validated (None on a validated one)."""
    version = megatron_core_version()
    found = mismatches(points)
    if found:
        raise IncompatibleMegatronError(
            f"megatron-offload cannot wire into this Megatron (megatron-core {version or 'unknown'}; validated on "
            f"{', '.join(VALIDATED)}.x): " + "; ".join(found)
            + ". Run without megatron-offload, or with a megatron-core it supports.")
    if version is None or not any(version.startswith(v) for v in VALIDATED):
        return (f"megatron-core {version or 'unknown'} has the functions megatron-offload hooks, but the plugin "
                f"was validated on {', '.join(VALIDATED)}.x only.")
    return None
