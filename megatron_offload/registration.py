"""Registration of what the coordinator drives (a mixin of `OffloadCoordinator`): each
DistributedOptimizer gets an offloader and hooks around its inner step (whole, or piece by piece
with the chunked step); the model's layers get the hooks that pace the frees and reloads.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch

from . import chunked_step, save_snapshot
from .offloader import OptimizerStateOffloader
from .phase import Phase


class _Undo:
    """A removable handle for something that is undone by a function."""

    def __init__(self, undo: Callable[[], None]):
        self.remove = undo


def pacing_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules whose forward pre-hooks pace freeing: every element of a `layers` ModuleList
    (Megatron's TransformerBlock / MambaStack), then the output layer. Falls back to the model's
    direct children when it has no such list."""
    found: List[torch.nn.Module] = []
    output_layers: List[torch.nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers":
            found.extend(module)
        elif name.split(".")[-1] == "output_layer":
            output_layers.append(module)
    if not found:
        found = list(model.children())
    return found + output_layers


def in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. recomputing a checkpointed layer)."""
    return torch._C._current_autograd_node() is not None


def _first_grad_tensor(output) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            t = _first_grad_tensor(item)
            if t is not None:
                return t
    return None


class Registration:
    """Offloaders for the optimizers, hooks on the model (module docstring)."""

    def add_optimizer(self, dist_opt, name: str = "optimizer") -> OptimizerStateOffloader:
        """Offload one DistributedOptimizer (a ChainedOptimizer: add each one inside it)."""
        if hasattr(dist_opt, "chained_optimizers"):
            raise TypeError(
                "megatron-offload: add_optimizer takes one DistributedOptimizer; for a ChainedOptimizer add "
                "each of its DistributedOptimizers (megatron_offload.megatron_wiring.iter_distributed_optimizers)")
        if not (getattr(dist_opt, "is_stub_optimizer", False) or (
                hasattr(dist_opt, "optimizer") and hasattr(dist_opt, "shard_fp32_from_float16_groups"))):
            raise TypeError(
                f"megatron-offload: add_optimizer needs a megatron-core DistributedOptimizer (the sharded "
                f"state it moves: inner optimizer, fp32 master shards), got a {type(dist_opt).__name__}; "
                "build the optimizer with use_distributed_optimizer=True (--use-distributed-optimizer)")
        off = OptimizerStateOffloader(dist_opt, self.streams, self.config.chunk_bytes, name=name,
                                      copy_piece_bytes=self.config.copy_piece_bytes, fraction=self.state_fraction,
                                      by_parameter=self.config.chunked_step, uniform_slots=self.config.per_step)
        off.snapshots.enabled = self.config.async_save_snapshots
        off.snapshots.background = self.config.async_save_snapshots and self.config.async_save_background_fill
        off.snapshots.device_fill = (off.snapshots.background and save_snapshot.DEVICE_FILL
                                     and off.device.type == "cuda")
        off.feeder = self.feeder
        self.offloaders.append(off)
        inner = getattr(dist_opt, "optimizer", None)
        if inner is None or getattr(dist_opt, "is_stub_optimizer", False):
            return off
        if self.config.chunked_step:
            uninstall = chunked_step.install_piecewise_step(
                dist_opt,
                make_pieces=lambda off=off: self._begin_chunked_step(off),
                before_piece=lambda k, off=off: self._before_piece(off, k),
                after_piece=lambda k, off=off: self._after_piece(off, k),
                enabled=lambda: not self._suspended,
                after_step=lambda off=off: self._after_inner_step(off),
            )
            self._hook_handles.append(_Undo(uninstall))
        else:
            self._hook_handles.append(
                inner.register_step_pre_hook(lambda opt, a, k, off=off: self._before_inner_step(off))
            )
            self._hook_handles.append(
                inner.register_step_post_hook(lambda opt, a, k, off=off: self._after_inner_step(off))
            )
        return off

    def watch_model(self, model_chunks: Iterable[torch.nn.Module]) -> int:
        """Hook the layers whose forward/backward pace the freeing and reloading. Returns count."""
        count = 0
        for chunk in model_chunks:
            self.model_chunks += 1
            for module in pacing_modules(chunk):
                self._hook_handles.append(module.register_forward_pre_hook(self._on_layer_forward))
                self._hook_handles.append(module.register_forward_hook(self._on_layer_output))
                count += 1
        return count

    def _on_layer_forward(self, module, args) -> None:
        """Forward pre-hook of a pacing module (`watch_model`)."""
        self.layer_forward_begin()

    def _on_layer_output(self, module, args, output) -> None:
        if self.it.forwards == 0 or not torch.is_grad_enabled() or self.phase is Phase.NO_STATE:
            return
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            # The gradient of module h's output exists when every module after h finished its
            # backward. Unknown position inside a recomputation (see layer_forward_begin).
            position = None if in_backward() else self.it.position - 1
            tensor.register_hook(lambda grad, p=position: self._on_layer_backward(grad, p))

    def _on_layer_backward(self, grad, position: Optional[int] = None):
        """Gradient hook on a pacing module's output (`_on_layer_output`); returns None: the
        gradient passes unchanged."""
        self.layer_backward_begin(position)
        return None
