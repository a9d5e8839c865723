"""Every argument combination --offload-optimizer-states refuses, with the flag named in the message."""

import argparse

import pytest

from megatron_offload import OffloadArgumentError, problems, validate


def args(**overrides):
    base = dict(
        offload_optimizer_states=True,
        use_distributed_optimizer=True,
        optimizer="adam",
        optimizer_cpu_offload=False,
        use_megatron_fsdp=False,
        use_torch_fsdp2=False,
        optimizer_cuda_graph=False,
        cuda_graph_impl="none",
        enable_cuda_graph=False,
        external_cuda_graph=False,
        qk_clip=False,
        reuse_grad_buf_for_mxfp8_param_ag=False,
        exp_avg_dtype="fp32",
        exp_avg_sq_dtype="fp32",
        async_save=False,
        log_params_norm=False,
        use_precision_aware_optimizer=False,
    )
    base.update(overrides)
    return argparse.Namespace(**base)


def test_valid_configuration_passes():
    assert problems(args()) == []
    validate(args())


def test_flag_off_checks_nothing():
    assert problems(args(offload_optimizer_states=False, optimizer_cpu_offload=True,
                         use_distributed_optimizer=False)) == []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(optimizer_cpu_offload=True), ["--optimizer-cpu-offload", "moves the Adam step itself to the CPU"]),
        (dict(use_distributed_optimizer=False), ["requires --use-distributed-optimizer"]),
        (dict(use_megatron_fsdp=True), ["--use-megatron-fsdp"]),
        (dict(use_torch_fsdp2=True), ["--use-torch-fsdp2"]),
        (dict(optimizer="sgd"), ["--optimizer adam", "--optimizer sgd"]),
        (dict(optimizer="muon"), ["--optimizer muon"]),
        (dict(optimizer_cuda_graph=True), ["--optimizer-cuda-graph"]),
        (dict(cuda_graph_impl="full_iteration"), ["--cuda-graph-impl full_iteration"]),
        (dict(cuda_graph_impl="local"), ["--cuda-graph-impl local"]),
        (dict(enable_cuda_graph=True), ["--enable-cuda-graph"]),
        (dict(external_cuda_graph=True), ["--external-cuda-graph"]),
        (dict(qk_clip=True), ["--qk-clip"]),
        (dict(reuse_grad_buf_for_mxfp8_param_ag=True), ["--reuse-grad-buf-for-mxfp8-param-ag"]),
        (dict(exp_avg_dtype="fp8"), ["--exp-avg-dtype fp8"]),
        (dict(exp_avg_sq_dtype="fp8"), ["--exp-avg-sq-dtype fp8"]),
        (dict(overlap_moe_expert_parallel_comm=True), ["--overlap-moe-expert-parallel-comm", "never leave the GPU"]),
    ],
)
def test_each_rejection_names_the_flag(overrides, expected):
    found = problems(args(**overrides))
    assert len(found) == 1, found
    for text in expected:
        assert text in found[0], found[0]
    assert "--offload-optimizer-states" in found[0]
    with pytest.raises(OffloadArgumentError, match="refuses this configuration"):
        validate(args(**overrides))


def test_fp8_given_as_torch_dtype_after_megatron_mapping():
    import torch

    assert problems(args(exp_avg_dtype=torch.uint8))  # Megatron maps 'fp8' to torch.uint8


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_exact_moment_dtypes_and_precision_aware_are_accepted(dtype):
    assert problems(args(exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype,
                         use_precision_aware_optimizer=True)) == []


def test_async_save_is_supported():
    """A save's reader then gets every chunk from the host (config_from_args sets async_saves;
    tests/unit/test_async_save_cpu.py)."""
    assert problems(args(async_save=True)) == []


@pytest.mark.parametrize("name", ["main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"])
def test_async_save_is_supported_with_te_fp16_states(name):
    """A save reads TE's scaled fp16 states on the host too (host_copies._scales_to_host)."""
    asynchronous = dict(async_save=True, use_persistent_ckpt_worker=True, use_precision_aware_optimizer=True)
    assert problems(args(**asynchronous, **{name: "fp16"})) == []


def test_log_params_norm_is_supported():
    assert problems(args(log_params_norm=True)) == []


def test_all_problems_are_reported_together():
    found = problems(args(optimizer_cpu_offload=True, qk_clip=True, optimizer_cuda_graph=True))
    assert len(found) == 3


@pytest.mark.parametrize("flag,name", [("--fp8-param-gather", "fp8_param_gather"),
                                       ("--fp4-param-gather", "fp4_param_gather")])
def test_an_explicit_streamed_step_refuses_quantized_param_gather(flag, name):
    found = problems(args(offload_step="streamed", **{name: True}))
    assert len(found) == 1 and flag in found[0] and "--offload-step streamed" in found[0]
    # Left to the default (the whole step under these flags) or asked whole: fine.
    assert problems(args(**{name: True})) == []
    assert problems(args(offload_step="whole", **{name: True})) == []
    assert problems(args(offload_step="streamed")) == []
    # The older alias asks for the streamed step too.
    found = problems(args(offload_chunked_step=True, **{name: True}))
    assert len(found) == 1 and flag in found[0] and "--offload-chunked-step" in found[0]
