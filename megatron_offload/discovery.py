"""Which tensors of a DistributedOptimizer are optimizer state that may leave the GPU.

Offloaded:
  * Adam moments `optimizer.state[p]["exp_avg" | "exp_avg_sq" | "max_exp_avg_sq"]` of every
    Adam implementation Megatron uses (torch Adam/AdamW, Apex FusedAdam, TE FusedAdam);
  * fp32 master weights of bf16/fp16 params: `shard_fp32_from_float16_groups`, or, with the
    precision-aware optimizer (TE FusedAdam `master_weights=True`), `state[p]["master_param"]`
    (fp32, or int16 remainders with `store_param_remainders`).
Never offloaded:
  * `shard_fp32_groups` (views into the fp32 param buffer: they *are* model weights) and the
    bf16 shard params of the precision-aware optimizer (views into the bf16 param buffer);
  * `step` counters (torch keeps them as CPU scalars; TE/Apex keep them in the param group);
  * any other state tensor we do not know (left resident, and reported).

Nothing here is cached: state tensors are created lazily on the first step and replaced on load,
so the offloader calls `find_state_tensors` again after every such event. Discovery never touches
the tensors; the offloader then packs them into chunk buffers of its own (see offloader.py), so a
state tensor that is a view of a larger storage (one fp8 path makes the master such a view) is
copied out of it rather than freed with it.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

OFFLOADED_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")
NEVER_OFFLOADED_KEYS = ("step",)
# dtypes we copy bit-exactly with a plain memcpy. fp8 moments are TE tensor subclasses with
# separate scales; we refuse them rather than move half of their state.
EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int16)


class UnsupportedOptimizerStateError(RuntimeError):
    """A state tensor we cannot move off the GPU exactly."""


@dataclasses.dataclass
class StateTensor:
    """One offloadable tensor and where it lives in the optimizer."""

    name: str  # e.g. "group0.param3.exp_avg" or "group0.param3.master"
    tensor: torch.Tensor
    # The inner optimizer's parameter this tensor belongs to (the chunked step steps by param).
    param: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    # For a placeholder (a meta tensor standing for zeros not created yet, see
    # `OptimizerStateOffloader.materialize_state`): the state dict that holds it, where packing
    # puts the real tensor.
    owner: Optional[dict] = dataclasses.field(default=None, repr=False, compare=False)
    key: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclasses.dataclass
class Discovery:
    tensors: List[StateTensor]
    # Device tensors in optimizer state that we leave alone (unknown keys), for reporting.
    resident_other: List[str]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def same_device(actual: torch.device, wanted: torch.device) -> bool:
    """`actual` is `wanted`, where `wanted` without an index ("cuda") means any of its type: a
    tensor on "cuda:0" is not `== torch.device("cuda")`, and a coordinator built with
    device="cuda" once found none of the state a load had created."""
    return actual.type == wanted.type and (wanted.index is None or actual.index == wanted.index)


def _on_device(t: object, device: torch.device) -> bool:
    """On the accelerator, or a placeholder for state to be created there (meta)."""
    return isinstance(t, torch.Tensor) and (same_device(t.device, device) or t.is_meta)


def _check_exact(name: str, t: torch.Tensor) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dtype not in EXACT_DTYPES:
        raise UnsupportedOptimizerStateError(
            f"megatron-offload: optimizer state {name} has type {type(t).__name__} and dtype "
            f"{t.dtype}; --offload-optimizer-states moves only plain fp32/bf16/fp16/int16 tensors "
            "(fp8 moments are TE tensor subclasses with separate scales). Use "
            "--exp-avg-dtype/--exp-avg-sq-dtype fp32, bf16 or fp16, or drop "
            "--offload-optimizer-states."
        )


def master_ids(dist_opt) -> set:
    """ids of the fp32 masters of bf16/fp16 params (`shard_fp32_from_float16_groups`)."""
    return {id(t) for group in getattr(dist_opt, "shard_fp32_from_float16_groups", []) for t in group if t is not None}


def find_state_tensors(dist_opt, device: Optional[torch.device] = None) -> Discovery:
    """Offloadable tensors of one DistributedOptimizer (or a duck-typed stand-in).

    `device` selects which tensors count as "on the accelerator" (CUDA normally, CPU in tests).
    Order: parameter order of the inner optimizer, masters before moments of each param, so that
    bytes are contiguous per parameter.
    """
    if getattr(dist_opt, "is_stub_optimizer", False) or getattr(dist_opt, "optimizer", None) is None:
        return Discovery([], [])
    inner = dist_opt.optimizer
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())

    masters = master_ids(dist_opt)
    found: List[StateTensor] = []
    others: List[str] = []
    seen = set()
    for gi, group in enumerate(inner.param_groups):
        for pi, p in enumerate(group["params"]):
            prefix = f"group{gi}.param{pi}"
            candidates = []
            if id(p) in masters and _on_device(p, device):
                candidates.append((f"{prefix}.master", p, None))
            state = inner.state.get(p, {})
            for key, value in state.items():
                if not _on_device(value, device) or key in NEVER_OFFLOADED_KEYS:
                    continue
                if key in OFFLOADED_STATE_KEYS:
                    candidates.append((f"{prefix}.{key}", value, key))
                else:
                    others.append(f"{prefix}.{key}")
            for name, t, key in candidates:
                if t.numel() == 0 or id(t) in seen:
                    continue
                seen.add(id(t))
                _check_exact(name, t)
                owner = state if t.is_meta else None
                found.append(StateTensor(name, t, param=p, owner=owner, key=key if owner is not None else None))
    return Discovery(found, others)
