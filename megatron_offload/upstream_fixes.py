"""Fixes for megatron-core itself (0.17 to 0.19), unrelated to offloading, applied by `install()`.

They make a pip install of megatron-core run Megatron-LM's own scripts at all, with or without
--offload-optimizer-states:

  compile_helpers   the wheel ships the compiled dataset helper but no Makefile, and
                    `initialize_megatron` runs `make` on rank 0, which fails and exits: skip the
                    build when the prebuilt `helpers_cpp` imports.
  help strings      one help text of 0.19.2 has a bare '%': `--help` crashed in argparse
                    (`mend_help_strings`, applied when Megatron builds its parser).
  DistributedOptimizer.state_dict / load_state_dict
                    without Apex or Transformer Engine (the torch AdamW fallback) a torch_dist
                    resume fails (empty state) or restarts Adam's bias correction (every
                    parameter's `step` left at the template's value): see each wrapper.
"""

from __future__ import annotations

import functools

import torch


def _wrap_compile_helpers(original):
    @functools.wraps(original)
    def wrapper(*a, **k):
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401  (the prebuilt helper: imports or not)
        except ImportError:
            return original(*a, **k)
        # The pip wheel ships the compiled helper but no Makefile: `make` would fail and exit.
        return None

    return wrapper


def _wrap_distopt_state_dict(original):
    """Compatibility fix for megatron-core 0.19 without Apex/TE (torch AdamW fallback).

    `DistributedOptimizer.state_dict()` asserts that exactly one per-param `step` exists. Loading a
    torch_dist checkpoint calls it (through `sharded_state_dict(is_loading=True)`) on a fresh
    optimizer whose state is still empty, so every resume fails, with or without offloading.
    With an empty state we build the same common state dict with step 0: on load it is only a
    template, the checkpoint's values replace it.
    """

    @functools.wraps(original)
    def wrapper(self, *a, **k):
        from megatron.core.optimizer import distrib_optimizer

        inner = getattr(self, "optimizer", None)
        if (
            distrib_optimizer.HAVE_APEX_OR_TE
            or inner is None
            or any("step" in s for s in inner.state.values())
            or getattr(self.ddp_config, "use_megatron_fsdp", False)
        ):
            return original(self, *a, **k)
        inner_state_dict = inner.state_dict()
        state_dict = {"optimizer": {k: v for k, v in inner_state_dict.items() if k != "state"}}
        for group in state_dict["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0
        if self.grad_scaler:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    return wrapper


def _wrap_distopt_load_state_dict(original):
    """Compatibility fix for megatron-core 0.19 without Apex/TE (torch AdamW fallback).

    Loading a torch_dist checkpoint first loads a template (`sharded_state_dict(is_loading=True)`
    calls `load_state_dict(self.state_dict())`), which creates per-parameter `step` tensors, and
    the real load then leaves those at the template's value while the correct step only reaches
    the param groups: every parameter resumes with the template's step 0, so Adam's bias
    correction restarts and the resumed run diverges from the uninterrupted one (with or without
    offloading; see [Note: resumed step counters] in docs/design.md). The original code also
    gives all parameters one shared step tensor, which torch Adam would increment once per
    parameter. After every load we set each parameter's step, as its own tensor, from its param
    group.
    """

    @functools.wraps(original)
    def wrapper(self, *a, **k):
        from megatron.core.optimizer import distrib_optimizer

        result = original(self, *a, **k)
        inner = getattr(self, "optimizer", None)
        if not distrib_optimizer.HAVE_APEX_OR_TE and inner is not None:
            for group in inner.param_groups:
                if "step" not in group:
                    continue
                for p in group["params"]:
                    state = inner.state.get(p)
                    if state and isinstance(state.get("step"), torch.Tensor):
                        state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)
        return result

    return wrapper


def mend_help_strings(parser) -> int:
    """Escape '%' in the help strings argparse cannot format. megatron-core 0.19.2's help of
    --moe-paged-stash-buffer-size-factor-cuda has a bare '%', so any `--help` raised ValueError
    ("unsupported format character") from deep inside argparse. Returns how many were mended."""
    mended = 0
    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                action.help % dict(vars(action), prog=parser.prog)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")
                mended += 1
    return mended


def grad_accumulators_on_current_stream(ddp_modules) -> int:
    """Re-create, under the current stream, the AccumulateGrad node of every parameter whose
    gradient hook megatron-core's DDP registered on one (`grad_accs`), with the same hook.
    Returns how many nodes were replaced. Not installed by `install()`: the Megatron wiring calls
    it when it attaches (unless --offload-keep-ddp-grad-stream).

    Why: `get_model` builds DDP under a stream of its own, and an AccumulateGrad node keeps the
    stream it was created on; the autograd engine then marks every weight gradient as used on that
    stream, and the caching allocator defers the gradient's free to an event of that stream (see
    [Note: host lead] in docs/design.md). Nodes created on the compute stream leave those frees
    immediate. A node still referenced elsewhere survives with its hook (each old node is marked
    before it is dropped, so it is recognised): it goes back into `grad_accs` unchanged, never gets
    a second hook, and the call raises once every other node is replaced."""
    replaced = kept = 0
    for ddp in ddp_modules:
        if not getattr(ddp, "grad_accs", None):
            continue
        params = [node.variable for node in ddp.grad_accs]
        for node in ddp.grad_accs:
            node.metadata["megatron_offload_replaced"] = True
        del node
        ddp.grad_accs = []  # (the last references: the nodes go, the parameters' caches expire)
        with torch.enable_grad():  # (no grad_fn otherwise)
            for param in params:
                node = param.expand_as(param).grad_fn.next_functions[0][0]
                if node.metadata.get("megatron_offload_replaced"):
                    kept += 1  # (its own hook is still registered on it)
                else:
                    node.register_hook(ddp._make_backward_post_hook(param))
                    replaced += 1
                ddp.grad_accs.append(node)
    if kept:
        raise RuntimeError(f"{kept} AccumulateGrad node(s) of megatron-core's DDP are referenced outside "
                           "`grad_accs`: left on the stream they were made on, with their hooks")
    return replaced


def install(patch) -> None:
    """Apply every fix; `patch(module, name, make_wrapper)` wraps once (megatron_wiring._patch)."""
    import megatron.core.datasets.utils as dataset_utils
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patch(dataset_utils, "compile_helpers", _wrap_compile_helpers)
    patch(DistributedOptimizer, "state_dict", _wrap_distopt_state_dict)
    patch(DistributedOptimizer, "load_state_dict", _wrap_distopt_load_state_dict)


def install_wheel_fix_only() -> None:
    """Only the Makefile fix (isolating runs: a script with none of the plugin's other code)."""
    import megatron.core.datasets.utils as dataset_utils

    if not getattr(dataset_utils.compile_helpers, "_megatron_offload", False):
        dataset_utils.compile_helpers = _wrap_compile_helpers(dataset_utils.compile_helpers)
        dataset_utils.compile_helpers._megatron_offload = True  # (as install()'s patch marks it)
