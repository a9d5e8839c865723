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


class _DeviceTensor(torch.Tensor):
    """A CPU tensor standing for a CUDA one: records the devices it is moved to."""

    moved_to = []

    def to(self, *a, **k):
        _DeviceTensor.moved_to.append(str(a[0] if a else k.get("device")))
        return torch.Tensor.to(self.as_subclass(torch.Tensor), *a, **k)


class _Optimizer:
    """Megatron's MixedPrecisionOptimizer / FP32Optimizer as far as `get_loss_scale` goes."""

    def __init__(self, scale=1.0, grad_scaler=None):
        self.grad_scaler = grad_scaler
        self._scale_one = torch.tensor([scale], dtype=torch.float32).as_subclass(_DeviceTensor)
        self.reads = 0

    def get_loss_scale(self):
        self.reads += 1
        return self._scale_one


def _call_as(module_name, function_name, optimizer):
    """`optimizer.get_loss_scale()` called from a function `function_name` of module `module_name`."""
    namespace = {"__name__": module_name}
    exec(f"def {function_name}(optimizer):\n    return optimizer.get_loss_scale()\n", namespace)
    return namespace[function_name](optimizer)


def test_trains_loss_scale_read_is_answered_on_the_host_only_for_a_constant_scale(monkeypatch):
    feeding = [True]
    for scale in (1.0, 0.5, 3.0e-8):
        opt = _Optimizer(scale)
        device_bits = opt.get_loss_scale().item()
        _DeviceTensor.moved_to.clear()
        assert megatron_reads.answer_loss_scale_on_host(opt, lambda: feeding[0]) and opt.reads == 2  # (read at attach)
        from_train = _call_as("megatron.training.training", "train", opt)
        assert from_train.item() == device_bits and from_train is not opt._scale_one and opt.reads == 2
        assert _DeviceTensor.moved_to == ["cpu"] and type(from_train) is torch.Tensor  # (a host copy)
        # Anyone else (the schedules' loss scaling multiplies it with CUDA tensors) gets Megatron's tensor.
        assert _call_as("megatron.core.pipeline_parallel.schedules", "train", opt) is opt._scale_one
        assert _call_as("megatron.training.training", "training_log", opt) is opt._scale_one
        assert opt.get_loss_scale() is opt._scale_one and opt.reads == 5
        feeding[0] = False  # (no copy-out in flight)
        assert _call_as("megatron.training.training", "train", opt) is opt._scale_one
        feeding[0] = True
        monkeypatch.setattr(megatron_reads, "ENABLED", False)
        assert _call_as("megatron.training.training", "train", opt) is opt._scale_one and opt.reads == 7
        monkeypatch.setattr(megatron_reads, "ENABLED", True)
    # A grad scaler (fp16, --loss-scale) anywhere in a chained optimizer, at any depth: Megatron's own read.
    def chained(*inner):
        opt = _Optimizer()
        opt.chained_optimizers = list(inner)
        return opt

    for opt in (_Optimizer(grad_scaler=object()), chained(_Optimizer(), _Optimizer(grad_scaler=object())),
                chained(chained(_Optimizer(), _Optimizer(grad_scaler=object())))):
        original = opt.get_loss_scale
        assert not megatron_reads.answer_loss_scale_on_host(opt, lambda: True) and opt.get_loss_scale == original


def test_the_read_answered_on_the_host_is_where_megatron_reads_it():
    """The host answer is keyed to `train` in megatron.training.training reading the loss scale; a
    release that moved the read elsewhere would silently lose it."""
    import inspect

    import megatron.training.training as training

    train = inspect.unwrap(training.train)
    assert (train.__module__, train.__name__) == megatron_reads._TRAIN
    assert "optimizer.get_loss_scale().item()" in inspect.getsource(train)


def test_megatrons_timers_wait_for_the_current_stream_only_while_feeding(monkeypatch):
    """Megatron's Timer.start/stop synchronize the device (at every log interval for `interval-time`),
    which would wait for the whole copy-out; while the feeder is on they wait for the current stream."""
    import megatron.core.timers as timers

    megatron_offload.install()
    assert isinstance(timers.torch, megatron_reads.TorchForTimers)  # (what install() leaves there)
    calls = []

    class Stream:
        def synchronize(self):
            calls.append("stream")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("device"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    feeding = [True]
    monkeypatch.setattr(timers, "torch", megatron_reads.TorchForTimers(torch, lambda: feeding[0]))
    timer = timers.Timer("interval-time")
    timer.start()
    timer.stop()
    assert calls == ["stream", "stream"] and timer.elapsed(reset=False) >= 0.0
    feeding[0] = False
    timer.start()
    timer.stop()
    monkeypatch.setattr(megatron_reads, "ENABLED", False)
    feeding[0] = True
    timer.start()
    assert calls == ["stream", "stream", "device", "device", "device"]
    # Everything else of torch passes through unchanged.
    assert timers.torch.float32 is torch.float32 and timers.torch.cuda.is_available is torch.cuda.is_available


def test_megatrons_timers_still_synchronize_through_the_torch_name():
    """The stream-only wait relies on Timer.start/stop calling `torch.cuda.synchronize()` through the
    module's `torch` name; a release that syncs some other way would silently lose it."""
    import inspect

    import megatron.core.timers as timers

    for method in (timers.Timer.start, timers.Timer.stop):
        assert "torch.cuda.synchronize()" in inspect.getsource(method)
