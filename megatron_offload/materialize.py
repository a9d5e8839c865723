"""The Adam state the first step would create lazily, created up front (torch Adam/AdamW's zeros,
Transformer Engine FusedAdam's own `initialize_state`), so that it is packed and sent out before the
first forward. Methods of `OptimizerStateOffloader`; `refresh` fills the placeholders chunk by chunk.
"""

from __future__ import annotations

import inspect

import torch

from .discovery import StateTensor


def _te_like(inner) -> bool:
    """TE FusedAdam (or anything with its state API): `initialize_state` and `name_to_dtype_map`."""
    return callable(getattr(inner, "initialize_state", None)) and isinstance(
        getattr(inner, "name_to_dtype_map", None), dict)


def _te_remainders(inner, param) -> bool:
    """Whether TE keeps `param`'s master as int16 remainders (its own rule in `step`)."""
    return bool(getattr(inner, "store_param_remainders", False)) and param.dtype == torch.bfloat16


def _scalar_dtype() -> torch.dtype:
    """dtype torch Adam uses for a CPU `step` (torch.optim.optimizer._get_scalar_dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class StateMaterialization:
    """Placeholders for state not created yet, and their initial values."""

    def materialize_state(self) -> int:
        """Create the Adam state that the first step would create lazily, exactly as torch
        Adam/AdamW would (zero moments, step 0), so that it is packed and sent out before the
        first forward instead of being allocated among step-1 activations and packed there.
        For torch Adam/AdamW, and for TE FusedAdam (which creates every state tensor of every
        parameter, masters included, in its first `step()`): there the placeholders are filled by
        TE's own `initialize_state`, one parameter at a time as its chunk is packed. Apex keeps
        its lazy initialisation. Returns the number of parameters given state.

        The moments are *placeholders* (meta tensors of the right shape and dtype): `refresh`
        creates their zeros inside the chunk that holds them, one chunk at a time, and puts the
        real tensor into the state dict. Zeros for the whole state at once were the start-up
        peak where the step is the run's peak, well above anything the iterations allocate (see
        [Note: start-up peak] in docs/design.md). Call `refresh` right after: the optimizer cannot
        step on placeholders."""
        inner = getattr(self.dist_opt, "optimizer", None)
        if inner is None or getattr(self.dist_opt, "is_stub_optimizer", False):
            return 0
        if _te_like(inner):
            return self._materialize_te_state(inner)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            return 0
        created = 0
        for group in inner.param_groups:
            on_device = group.get("capturable", False) or group.get("fused", False)
            for p in group["params"]:
                if inner.state.get(p):
                    continue
                state = inner.state[p]
                if on_device:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                else:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad", False) else [])
                for key in keys:
                    state[key] = torch.empty_like(p, device="meta", memory_format=torch.preserve_format)
                created += 1
        return created

    def _materialize_te_state(self, inner) -> int:
        """Placeholders for the state TE FusedAdam's `initialize_state` creates (exp_avg and
        exp_avg_sq in their configured dtypes, the master in fp32 or as int16 remainders), and
        the hook that fills them with TE's own values when packed. fp8 moments (Float8Tensor
        objects, not plain tensors) are left to TE."""
        dtypes = inner.name_to_dtype_map
        if any(dtypes.get(k) not in (torch.float32, torch.bfloat16, torch.float16)
               for k in ("exp_avg", "exp_avg_sq")):
            return 0
        keys = ["exp_avg", "exp_avg_sq"] + (["master_param"] if getattr(inner, "master_weights", False) else [])
        created = 0
        for group in inner.param_groups:
            for p in group["params"]:
                if inner.state.get(p):
                    continue
                state = inner.state[p]
                for key in keys:
                    dtype = torch.int16 if key == "master_param" and _te_remainders(inner, p) else dtypes[key]
                    state[key] = torch.empty(p.shape, dtype=dtype, device="meta")
                created += 1
        if created:
            # TE's signature has changed: (param) in older releases, (param, store_param_remainders)
            # in newer ones (megatron-core's own init_state_fn calls it with one argument).
            takes_remainders = len(inspect.signature(inner.initialize_state).parameters) >= 2
            self._initial_state = (
                (lambda param: inner.initialize_state(param, _te_remainders(inner, param)))
                if takes_remainders else inner.initialize_state)
        return created

    def _initial_value(self, st: StateTensor) -> torch.Tensor:
        """The value a placeholder stands for: TE's own initial state (created for the whole
        parameter on first use: the others of it are then real tensors in the state dict, taken
        when their chunks are packed), else torch Adam's zeros."""
        current = st.owner[st.key]
        if current.is_meta and self._initial_state is not None:
            self._initial_state(st.param)
            current = st.owner[st.key]
        if current.is_meta:
            return torch.zeros(current.shape, dtype=current.dtype, device=self.device)
        return current
