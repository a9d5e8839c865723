"""Argument checks for `--offload-optimizer-states`, run before any GPU memory is allocated.

Pure functions over an argparse Namespace: no Megatron import, so they are unit-tested on CPU.
Each rejection names the flag that conflicts and says what to do instead.
"""

from __future__ import annotations

from typing import List, Optional

FLAG = "--offload-optimizer-states"


class OffloadArgumentError(ValueError):
    """An argument combination that --offload-optimizer-states refuses."""


def _get(args, name, default=None):
    return getattr(args, name, default)


def _is_fp8_dtype(value) -> bool:
    if value is None:
        return False
    if isinstance(value, str):
        return value.lower() == "fp8"
    return str(value) in ("torch.uint8",) or "float8" in str(value)


# The optimizer-state dtype flags of the precision-aware optimizer (flag, args attribute).
MOMENT_DTYPE_FLAGS = (("--exp-avg-dtype", "exp_avg_dtype"), ("--exp-avg-sq-dtype", "exp_avg_sq_dtype"))
# Flags under which megatron-core quantizes the parameters from all masters in one operation, so
# the step cannot be taken piece by piece (flag, args attribute).
QUANTIZED_GATHER_FLAGS = (("--fp8-param-gather", "fp8_param_gather"), ("--fp4-param-gather", "fp4_param_gather"))


def chosen_step(args) -> Optional[str]:
    """The step engine the flags name: `--offload-step`, else "streamed" for its older alias
    `--offload-chunked-step`, else None (the two naming different engines is refused in
    megatron_args.check_values)."""
    return _get(args, "offload_step", None) or ("streamed" if _get(args, "offload_chunked_step", False) else None)


def asks_for_streamed_step(args) -> bool:
    """The flags ask for the streamed step: `--offload-step streamed` (or `--offload-chunked-step`),
    or, with no `--offload-step`, a step budget (it bounds that step)."""
    chosen = chosen_step(args)
    return chosen == "streamed" or (chosen is None and (_get(args, "offload_step_budget_mb", 0) or 0) > 0)


def problems(args) -> List[str]:
    """Every reason `args` cannot run with --offload-optimizer-states (empty list: fine)."""
    if not _get(args, "offload_optimizer_states", False):
        return []
    out: List[str] = []
    if _get(args, "optimizer_cpu_offload", False):
        out.append(
            f"{FLAG} cannot be combined with --optimizer-cpu-offload. --optimizer-cpu-offload "
            "(HybridDeviceOptimizer) moves the Adam step itself to the CPU; "
            f"{FLAG} keeps the Adam step on the GPU and only parks its state in pinned host memory "
            "between steps. Pick one: drop --optimizer-cpu-offload (and "
            "--optimizer-offload-fraction/--overlap-cpu-optimizer-d2h-h2d) to use this plugin."
        )
    if _get(args, "use_megatron_fsdp", False) or _get(args, "use_torch_fsdp2", False):
        which = "--use-megatron-fsdp" if _get(args, "use_megatron_fsdp", False) else "--use-torch-fsdp2"
        out.append(
            f"{FLAG} does not support {which}: it offloads the state of Megatron's "
            "DistributedOptimizer, which FSDP replaces. Use --use-distributed-optimizer without "
            f"{which}, or drop {FLAG}."
        )
    elif not _get(args, "use_distributed_optimizer", False):
        out.append(
            f"{FLAG} requires --use-distributed-optimizer: it offloads each data-parallel rank's "
            "shard of the DistributedOptimizer state. Add --use-distributed-optimizer."
        )
    optimizer = _get(args, "optimizer", "adam")
    if optimizer != "adam":
        out.append(
            f"{FLAG} supports only --optimizer adam (Adam/AdamW moments and fp32 masters), "
            f"not --optimizer {optimizer}. Use --optimizer adam or drop {FLAG}."
        )
    if _get(args, "optimizer_cuda_graph", False):
        out.append(
            f"{FLAG} cannot be combined with --optimizer-cuda-graph: a captured optimizer step "
            "would bake in the GPU addresses of state that this plugin frees and re-allocates "
            "every step. Drop one of them."
        )
    impl = _get(args, "cuda_graph_impl", "none") or "none"
    legacy_graphs = _get(args, "enable_cuda_graph", False) or _get(args, "external_cuda_graph", False)
    if impl != "none" or legacy_graphs:
        shown = f"--cuda-graph-impl {impl}" if impl != "none" else (
            "--enable-cuda-graph" if _get(args, "enable_cuda_graph", False) else "--external-cuda-graph"
        )
        out.append(
            f"{FLAG} cannot be combined with CUDA graphs ({shown}): the plugin's stream waits and "
            "memory budget run in layer hooks that a graph replay skips, and a full-iteration "
            "graph would capture the optimizer step. Use --cuda-graph-impl none or drop "
            f"{FLAG}."
        )
    if _get(args, "qk_clip", False):
        out.append(
            f"{FLAG} cannot be combined with --qk-clip: QK-clip rewrites the fp32 master weights "
            "after the optimizer step, after they were copied out. Drop one of them."
        )
    if _get(args, "reuse_grad_buf_for_mxfp8_param_ag", False):
        out.append(
            f"{FLAG} cannot be combined with --reuse-grad-buf-for-mxfp8-param-ag: that path reads "
            "the fp32 master weights before the next forward, while they are off the GPU. Drop "
            "one of them."
        )
    for flag, name in MOMENT_DTYPE_FLAGS:
        if _is_fp8_dtype(_get(args, name)):
            out.append(
                f"{FLAG} cannot offload fp8 moments ({flag} fp8): they are Transformer Engine "
                "tensor subclasses with separate scales that a byte copy would not move exactly. "
                f"Use {flag} fp32, bf16 or fp16, or drop {FLAG}."
            )
    if asks_for_streamed_step(args):
        asked = ("--offload-step streamed (or --offload-chunked-step)" if chosen_step(args)
                 else "--offload-step-budget-mb (it bounds a streamed step)")
        for flag, name in QUANTIZED_GATHER_FLAGS:
            if _get(args, name, False):
                out.append(
                    f"{asked} cannot be combined with {flag}: copying the updated masters into the "
                    "quantized parameters is one operation over all of them, so they cannot be stepped "
                    "piece by piece. Drop it: with this flag the plugin's default is the whole step, which "
                    "brings the whole state back for the step."
                )
    if _get(args, "overlap_moe_expert_parallel_comm", False):
        out.append(
            f"{FLAG} cannot be combined with --overlap-moe-expert-parallel-comm: that schedule runs "
            "forward and backward through megatron-core's combined 1F1B path, which never calls the "
            "schedule functions the plugin paces itself by, so the state would never leave the GPU. "
            f"Drop one of them."
        )
    return out


def validate(args) -> None:
    """Raise OffloadArgumentError listing every problem, if any."""
    found = problems(args)
    if found:
        raise OffloadArgumentError(
            "megatron-offload refuses this configuration:\n  - " + "\n  - ".join(found)
        )
