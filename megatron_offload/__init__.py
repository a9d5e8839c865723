"""megatron-offload: park Megatron DistributedOptimizer state in pinned CPU memory between steps.

Public API:
  OffloadCoordinator      drives every offloader of a process through a training iteration
  OffloadConfig           its configuration (frozen); AllocatorProbes: its memory readers
  OptimizerStateOffloader moves one DistributedOptimizer's moments and fp32 masters
  phase_switcher          offload_all() / restore_all() of the whole state between training phases (RL)
  find_state_tensors      what would be offloaded (masters, moments) for a DistributedOptimizer
  validate / problems     the argument checks behind --offload-optimizer-states
  install                 wire into an unmodified Megatron-LM training script (needs megatron-core)

Command line: `torchrun ... -m megatron_offload pretrain_gpt.py <megatron args> --offload-optimizer-states`.
"""

from .config import AllocatorProbes, OffloadConfig
from .coordinator import OffloadCoordinator, OffloadNotRunningError, Phase, phase_switcher
from .iteration import IterationState
from .discovery import UnsupportedOptimizerStateError, find_state_tensors
from .offloader import ChunkState, OptimizerStateOffloader
from .phase_switch import PhaseSwitchError, SwitchHandle
from .validation import OffloadArgumentError, problems, validate

__version__ = "0.1.0"


def install() -> None:
    """Wire megatron-offload into Megatron's training loop (imports megatron on first call)."""
    from .megatron_wiring import install as _install

    _install()


__all__ = [
    "AllocatorProbes",
    "ChunkState",
    "IterationState",
    "OffloadArgumentError",
    "OffloadConfig",
    "OffloadCoordinator",
    "OffloadNotRunningError",
    "OptimizerStateOffloader",
    "Phase",
    "PhaseSwitchError",
    "SwitchHandle",
    "UnsupportedOptimizerStateError",
    "find_state_tensors",
    "install",
    "phase_switcher",
    "problems",
    "validate",
]
