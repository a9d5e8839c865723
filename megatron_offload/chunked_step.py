"""The inner optimizer step, run piece by piece (issue 4, work in progress: core only, not wired).

Stepping all parameters at once needs the whole optimizer state on the GPU, plus the temporaries
of a foreach/multi-tensor Adam over all of it. Stepping in pieces bounds both: only the pieces in
flight are resident. Two facts make it exact:

* Adam's update is elementwise per tensor. torch's `_foreach_*` kernels and TE/Apex's
  multi-tensor-apply batch tensors for speed, but no element's result depends on which other
  tensors share its batch. So stepping a subset gives each tensor the same bits.
* Every Adam implementation Megatron uses skips a parameter whose `.grad` is None (no state
  update, no per-parameter `step` increment). A piece is stepped by hiding the other parameters'
  gradients for one `step()` call.

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
    grads: Dict[int, torch.Tensor] = {id(p): p.grad for p in params}
    member_of: Dict[int, int] = {}
    for k, piece in enumerate(pieces):
        for p in piece:
            assert id(p) not in member_of, "a parameter in two pieces would be stepped twice"
            member_of[id(p)] = k
    missing = [i for i, p in enumerate(params) if p.grad is not None and id(p) not in member_of]
    assert not missing, f"parameters with gradients in no piece: {missing[:5]}"
    group_steps = [_snapshot(group.get("step", _MISSING)) for group in inner.param_groups]
    try:
        for k in range(len(pieces)):
            before_piece(k)
            for p in params:
                p.grad = grads[id(p)] if member_of.get(id(p)) == k else None
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
            p.grad = grads[id(p)]


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
    Chunks are packed in parameter order, so a parameter spans at most its chunk and the one
    before. Returns one list per chunk (possibly empty)."""
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
