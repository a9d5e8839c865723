"""The inner optimizer step, run piece by piece (the streamed step, `--offload-step streamed`; the coordinator drives it).

Stepping all parameters at once needs the whole optimizer state on the GPU, plus the temporaries
of a foreach/multi-tensor Adam over all of it. Stepping in pieces bounds both: only the pieces in
flight are resident. Two facts make it exact:

* Adam's update is elementwise per tensor. torch's `_foreach_*` kernels and TE/Apex's
  multi-tensor-apply batch tensors for speed, but no element's result depends on which other
  tensors share its batch. So stepping a subset gives each tensor the same bits.
* Every Adam implementation Megatron uses skips a parameter whose gradient is None (no state
  update, no per-parameter `step` increment). A piece is stepped by hiding the other parameters'
  gradients for one `step()` call. The gradient is `.grad`, or `.decoupled_grad` where
  megatron-core's precision-aware optimizer hands TE FusedAdam its gradients
  (`use_decoupled_grad=True`: TE then ignores `.grad`); both are hidden.

Bookkeeping that must advance once per step, not once per piece: torch keeps `step` per parameter
(each parameter is stepped exactly once, so it advances once); TE/Apex FusedAdam keep
`group["step"]` and increment it on every call, even for groups whose parameters are all hidden,
so each piece is run from the same snapshot of the group counters and the groups end exactly one
higher. Learning rate and weight decay are read from the groups, which nothing here changes.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

_MISSING = object()
# Where an optimizer reads a parameter's gradient (TE FusedAdam with use_decoupled_grad reads the
# second, and only that one).
GRAD_ATTRIBUTES = ("grad", "decoupled_grad")


def _all_params(inner: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in inner.param_groups for p in group["params"]]


def step_in_pieces(
    inner: torch.optim.Optimizer,
    pieces: Sequence[Sequence[torch.Tensor]],
    before_piece: Callable[[int], None] = lambda k: None,
    after_piece: Callable[[int], None] = lambda k: None,
) -> None:
    """One optimizer step of `inner`, as one `inner.step()` call per piece.

    pieces: disjoint lists of `inner`'s parameters; every parameter with a gradient must be in
        exactly one (asserted). `before_piece(k)` runs before piece k is stepped (make its state
        resident), `after_piece(k)` after (copy it out, copy masters to model params).
    """
    params = _all_params(inner)
    # Each parameter's gradients, by attribute (only the attributes it has).
    grads: Dict[int, Dict[str, torch.Tensor]] = {
        id(p): {name: getattr(p, name) for name in GRAD_ATTRIBUTES if hasattr(p, name)} for p in params}
    member_of: Dict[int, int] = {}
    for k, piece in enumerate(pieces):
        for p in piece:
            assert id(p) not in member_of, "a parameter in two pieces would be stepped twice"
            member_of[id(p)] = k
    missing = [i for i, p in enumerate(params)
               if any(g is not None for g in grads[id(p)].values()) and id(p) not in member_of]
    assert not missing, f"parameters with gradients in no piece: {missing[:5]}"
    group_steps = [_snapshot(group.get("step", _MISSING)) for group in inner.param_groups]
    try:
        for k in range(len(pieces)):
            before_piece(k)
            for p in params:
                stepped = member_of.get(id(p)) == k
                for name, grad in grads[id(p)].items():
                    setattr(p, name, grad if stepped else None)
            if k:
                for group, step in zip(inner.param_groups, group_steps):
                    if step is _MISSING:
                        group.pop("step", None)
                    else:
                        group["step"] = _snapshot(step)
            inner.step()
            after_piece(k)
    finally:
        for p in params:
            for name, grad in grads[id(p)].items():
                setattr(p, name, grad)


def complete_pieces(inner: torch.optim.Optimizer, pieces: Sequence[Sequence[torch.Tensor]]):
    """`pieces` plus one last piece with every parameter of `inner` in none of them (e.g. those
    whose state stays resident), if there is any."""
    seen = {id(p) for piece in pieces for p in piece}
    rest = [p for p in _all_params(inner) if id(p) not in seen]
    return [list(piece) for piece in pieces] + ([rest] if rest else [])


def _snapshot(value):
    """A copy of a group step counter (an int, or a tensor with capturable/fused optimizers)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def pieces_by_last_chunk(chunks) -> List[List[torch.Tensor]]:
    """Piece k: the parameters whose last state tensor lies in chunk k (so that all of their
    state is resident once chunks up to k are, given the chunks that hold their first tensors).
    (Chunks are filled first-fit, so a parameter's tensors may lie in chunks far apart; the
    piece is still complete once chunks up to k are resident.) Returns one list per chunk
    (possibly empty)."""
    last: Dict[int, int] = {}
    param_of: Dict[int, torch.Tensor] = {}
    for k, chunk in enumerate(chunks):
        for st in chunk.tensors:
            assert st.param is not None, st.name
            last[id(st.param)] = k
            param_of[id(st.param)] = st.param
    pieces: List[List[torch.Tensor]] = [[] for _ in chunks]
    for pid, k in last.items():
        pieces[k].append(param_of[pid])
    return pieces


def first_chunk_of(chunks) -> Dict[int, int]:
    """id(param) -> index of the first chunk holding one of its state tensors."""
    first: Dict[int, int] = {}
    for k, chunk in enumerate(chunks):
        for st in chunk.tensors:
            first.setdefault(id(st.param), k)
    return first


def copy_main_params_to_model_params_for(dist_opt, main_params: Sequence[torch.Tensor]) -> None:
    """megatron-core's `DistributedOptimizer._copy_main_params_to_model_params()` restricted to
    `main_params` (inner-optimizer params: fp32 masters of bf16/fp16 params, or fp32 shards).

    The method walks `shard_fp32_from_float16_groups` / `model_float16_groups` and
    `shard_fp32_groups` / `model_fp32_groups` pairwise; for the duration of the call those four
    lists are replaced by the pairs whose main param is in `main_params`, so every master is
    read only while its piece is resident. Each main param is in exactly one of the two group
    kinds, so calling this once per piece copies each exactly once.
    """
    keep = {id(p) for p in main_params}
    names = (("shard_fp32_from_float16_groups", "model_float16_groups"), ("shard_fp32_groups", "model_fp32_groups"))
    saved = {name: getattr(dist_opt, name) for pair in names for name in pair}
    try:
        for main_name, model_name in names:
            mains, models = saved[main_name], saved[model_name]
            setattr(dist_opt, main_name, [[m for m in gm if id(m) in keep] for gm in mains])
            setattr(dist_opt, model_name, [[md for m, md in zip(gm, gmd) if id(m) in keep]
                                           for gm, gmd in zip(mains, models)])
        # The class's method: `install_piecewise_step` shadows the instance's.
        type(dist_opt)._copy_main_params_to_model_params(dist_opt)
    finally:
        for name, value in saved.items():
            setattr(dist_opt, name, value)


def install_piecewise_step(dist_opt, make_pieces, before_piece=lambda k: None, after_piece=lambda k: None,
                           enabled=lambda: True, after_step=lambda: None):
    """Make `dist_opt.step_with_ready_grads()` step its inner optimizer piece by piece.

    megatron-core's `step_with_ready_grads` calls `self.optimizer.step()` and then
    `self._copy_main_params_to_model_params()`, which reads every master. Here the inner step
    becomes `step_in_pieces` over `make_pieces()` (called at each step: the chunks may have been
    re-packed), each piece's masters are copied to the model params right after the piece, and
    the whole-model copy that follows is skipped for that step only (other callers keep it).
    While `enabled()` is false (a checkpoint API's dummy step, with the state resident) the inner
    step runs whole, as installed. `after_step()` runs after the last piece.
    Not for fp8/nvfp4 param gather (their copy path quantizes across params). Returns a function
    that undoes the installation.
    """
    inner = dist_opt.optimizer
    whole_step = inner.step
    state = {"copied": False}

    def piecewise_step(*args, **kwargs):
        if not enabled():
            return whole_step(*args, **kwargs)
        assert not args and not kwargs, "closures are not supported by the piecewise step"
        pieces = make_pieces()

        def after(k):
            copy_main_params_to_model_params_for(dist_opt, pieces[k])
            after_piece(k)

        inner.step = whole_step  # step_in_pieces calls the real step once per piece
        try:
            step_in_pieces(inner, pieces, before_piece, after)
        finally:
            inner.step = piecewise_step
        state["copied"] = True
        after_step()

    def copy_unless_done_in_pieces():
        if state["copied"]:
            state["copied"] = False
            return
        type(dist_opt)._copy_main_params_to_model_params(dist_opt)

    inner.step = piecewise_step
    dist_opt._copy_main_params_to_model_params = copy_unless_done_in_pieces

    def uninstall():
        inner.step = whole_step
        del dist_opt._copy_main_params_to_model_params

    return uninstall
