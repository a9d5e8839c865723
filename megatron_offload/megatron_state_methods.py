"""The DistributedOptimizer methods that read or write the optimizer state, wrapped per instance
(megatron_wiring.attach): while one runs the state is where it needs it, resident on the GPU, or
its host copies for a torch_dist save or load (coordinator.before_state_access).
"""

from __future__ import annotations

import functools

from . import megatron_saves

# DistributedOptimizer methods that read the state: it must be resident while they run.
STATE_READERS = (
    "state_dict",
    "save_parameter_state",
    "get_parameter_state_dp_zero",
    "get_parameter_state_dp_reshardable",
)
# Methods that write or replace it: resident, then re-discovered and sent out again afterwards.
STATE_WRITERS = (
    "load_state_dict",
    "load_parameter_state",
    "reload_model_params",
    "offload_to_cpu",
    "restore_from_cpu",
)
# Those that may run on the host copies of what is off the GPU (coordinator.before_state_access):
# a torch_dist save or load (`sharded_state_dict`, then `load_state_dict`), and the masters'
# refresh from the model after a model-only load (`reload_model_params`: in-place copies from the
# GPU params into the masters' host copies). The legacy per-file load and Megatron's own CPU round
# trip (RL) get the state back first.
HOST_ACCESS_OK = ("sharded_state_dict", "load_state_dict", "reload_model_params")
# Readers that only collect references to the state tensors (a torch_dist save's state dict, the
# optimizer's own `state_dict` inside it, the bucket-space view): an asynchronous save's snapshots
# may still be filling while they run. The gathers of the other formats read values.
REFERENCE_READERS = ("sharded_state_dict", "state_dict", "get_parameter_state_dp_reshardable")


def wrap_state_access(coord, off, dist_opt) -> None:
    """Wrap `dist_opt`'s state methods (the lists above) so that each runs inside
    `coord.state_access` for `off`, the offloader of `dist_opt`: resident state, or the host
    copies where HOST_ACCESS_OK; after a writer the state is re-discovered and sent out again."""

    def wrap(name: str, writes):
        original = getattr(dist_opt, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            modifies = writes(args, kwargs)
            references = name in REFERENCE_READERS and not modifies
            with coord.state_access([off], will_modify=modifies, host_copies_ok=name in HOST_ACCESS_OK,
                                    references_only=references):
                result = original(*args, **kwargs)
            if references and name == "sharded_state_dict":
                megatron_saves.wait_if_the_save_reads_snapshots(coord, result)
            return result

        setattr(dist_opt, name, wrapper)

    for name in STATE_READERS:
        wrap(name, lambda a, k: False)
    for name in STATE_WRITERS:
        wrap(name, lambda a, k: True)
    # sharded_state_dict(model_sharded_state_dict, is_loading=False, ...): a load template is
    # filled in place by dist_checkpointing.load, so loading counts as a write. A save only
    # references the tensors, which dist-checkpointing writes from the host anyway: what is off
    # the GPU is saved from its host copy, and loaded into it.
    wrap("sharded_state_dict", lambda a, k: bool(k.get("is_loading", a[1] if len(a) > 1 else False)))
