"""megatron_reads.py on CPU: a one-rank model-parallel reduction answered on the host gives the bits
Megatron's own reduction gives (run here over a one-rank gloo group), and only where it may."""

import socket

import pytest
import torch

import megatron_offload
from megatron_offload import megatron_reads


@pytest.fixture
def one_rank_group(monkeypatch):
    """A one-rank gloo job whose model-parallel group is the world; Megatron's reductions put their
    tensor on `torch.cuda.current_device()`, here the CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    monkeypatch.setattr(parallel_state, "get_model_parallel_group", lambda *a, **k: dist.group.WORLD)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _megatron_originals():
    import megatron.training.training as training

    megatron_offload.install()
    return {name: getattr(training, name).__wrapped__ for name in
            ("logical_and_across_model_parallel_group", "reduce_max_stat_across_model_parallel_group")}


# (-1.00000001 is -1.0 in float32: Megatron reads None back.)
VALUES = [None, 0.0, 1.0, -1.0, -1.00000001, 3.25, 1e-30, 1e39, 12345.678901234, float("inf"), float("nan"), 7, True]


def _bits(x):
    return None if x is None else (type(x).__name__, float(x).hex())


def test_host_answers_equal_megatrons_own_reduction_over_one_rank(one_rank_group):
    originals = _megatron_originals()
    for value in VALUES:
        assert _bits(megatron_reads.reduce_max_alone(value)) == _bits(
            originals["reduce_max_stat_across_model_parallel_group"](value)), value
    for value in (True, False, None, 1, 0, 1.0):
        assert megatron_reads.logical_and_alone(value) == originals["logical_and_across_model_parallel_group"](value), value


def test_the_host_path_is_taken_only_alone_feeding_and_for_host_values(one_rank_group, monkeypatch):
    calls = []

    def original(stat, group=None):
        calls.append(stat)
        return "device"

    feeding = [True]
    wrapped = megatron_reads._on_host_when_alone(megatron_reads.reduce_max_alone, lambda: feeding[0])(original)
    assert wrapped(2.5) == 2.5 and wrapped(None) is None and wrapped(2.5, one_rank_group) == 2.5 and calls == []
    assert wrapped(torch.tensor(2.5)) == "device"  # (a tensor: Megatron's own)
    feeding[0] = False
    assert wrapped(2.5) == "device"  # (no copy-out in flight to wait behind)
    feeding[0] = True
    # The group passed (by position or, as megatron-core 0.19 does, by keyword) decides, not the default one.
    two = object()
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2 if group is two else 1)
    assert wrapped(2.5, group=two) == "device" and wrapped(2.5, two) == "device"  # (a real reduction)
    assert wrapped(2.5, group=one_rank_group) == 2.5
    assert wrapped(stat=2.5) == "device"  # (by keyword only: Megatron's own)
    monkeypatch.setattr(megatron_reads, "ENABLED", False)
    assert wrapped(2.5) == "device" and len(calls) == 6


def test_install_wraps_the_names_train_step_looks_up():
    import megatron.training.training as training

    megatron_offload.install()
    for name in ("logical_and_across_model_parallel_group", "reduce_max_stat_across_model_parallel_group"):
        assert getattr(getattr(training, name), "_megatron_offload", False), name
