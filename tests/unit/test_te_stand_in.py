"""The TE FusedAdam stand-in (fakes.py) against what Transformer Engine 2.20.2's FusedAdam does, as
megatron-core 0.19.2's precision-aware optimizer builds it. "fused_adam.py:N" is a line of
transformer_engine/pytorch/optimizers/fused_adam.py in the TE 2.20.2 wheel; the remainder layout is
that of its multi_tensor_adam_param_remainder kernel. Each test failed on the stand-in as it was
before (masters at construction, moments only for parameters with a gradient, `.grad` read,
truncated bf16 params, torch's own state_dict/load_state_dict)."""

import pytest
import torch

from fakes import FakePrecisionAwareDistOpt, assert_bitwise_equal, make_grads, snapshot

NUMELS = (300, 1000, 64)
CONFIGS = {
    "fp32-master": dict(),
    "bf16-moments": dict(moment_dtype=torch.bfloat16),
    "int16-remainders-bf16-moments": dict(store_param_remainders=True, moment_dtype=torch.bfloat16),
    "fp16-moments": dict(moment_dtype=torch.float16),
}


def give_grads(opt, step, only=None):
    """Main grads where megatron-core puts them for TE (`.decoupled_grad`), for `only` (indices)."""
    make_grads(opt.all_params(), step)
    opt.hand_over_grads()
    if only is not None:
        for i, p in enumerate(opt.all_params()):
            if i not in only:
                p.decoupled_grad = None


def te_master(param, remainders):
    """The fp32 master from a bf16 param and its int16 remainders, as TE's remainder kernel rebuilds
    it: high half = the param's bits, less one where the remainder is negative (undo rounding)."""
    high = param.view(torch.int16).to(torch.int32) - (remainders < 0).to(torch.int32)
    return ((high << 16) | (remainders.to(torch.int32) & 0xFFFF)).view(torch.float32)


def train(opt, steps, start=0):
    for step in range(start, start + steps):
        give_grads(opt, step)
        opt.optimizer.step()


def test_no_state_until_the_first_step_which_creates_all_of_it_for_every_parameter():
    """fused_adam.py:632-642: state is created in `step()`, for every parameter whose state is
    empty, before the gradient is looked at; nothing at construction."""
    opt = FakePrecisionAwareDistOpt(numels=NUMELS)
    assert len(opt.optimizer.state) == 0
    params = opt.all_params()
    before = [p.detach().clone() for p in params]
    give_grads(opt, 0, only={1})
    opt.optimizer.step()
    assert opt.optimizer.param_groups[0]["step"] == 1
    for i, p in enumerate(params):
        state = opt.optimizer.state[p]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "master_param"], i
        assert all(t.shape == p.shape for t in state.values())
        if i != 1:  # no gradient: zero moments, the master is the param (fused_adam.py:463-480)
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
            assert torch.equal(state["master_param"], before[i].float())
            assert torch.equal(p, before[i])
    assert not torch.equal(params[1], before[1])


def test_gradients_are_read_from_decoupled_grad_only():
    """fused_adam.py:636-639 with `use_decoupled_grad=True` (what megatron-core passes)."""
    opt = FakePrecisionAwareDistOpt(numels=NUMELS)
    before = [p.detach().clone() for p in opt.all_params()]
    make_grads(opt.all_params(), 0)  # in `.grad`: ignored
    opt.optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(opt.all_params(), before))
    assert all(not s["exp_avg"].any() for s in opt.optimizer.state.values())
    opt.hand_over_grads()
    opt.optimizer.step()
    assert all(not torch.equal(p, b) for p, b in zip(opt.all_params(), before))
    assert opt.optimizer.param_groups[0]["step"] == 2  # every call counts (fused_adam.py:571-587)
    opt.optimizer.zero_grad()  # fused_adam.py:259-266
    assert all(p.decoupled_grad is None for p in opt.all_params())


@pytest.mark.parametrize("kw,dtypes,scaled", [
    (dict(), dict(exp_avg=torch.float32, exp_avg_sq=torch.float32, master_param=torch.float32), []),
    (dict(moment_dtype=torch.bfloat16),
     dict(exp_avg=torch.bfloat16, exp_avg_sq=torch.bfloat16, master_param=torch.float32), ["exp_avg", "exp_avg_sq"]),
    (dict(moment_dtype=torch.bfloat16, store_param_remainders=True),
     dict(exp_avg=torch.bfloat16, exp_avg_sq=torch.bfloat16, master_param=torch.int16), ["exp_avg", "exp_avg_sq"]),
    (dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float32),
     dict(exp_avg=torch.float16, exp_avg_sq=torch.float32, master_param=torch.float32), ["exp_avg"]),
    (dict(master_weight_dtype=torch.float16, store_param_remainders=True),  # (TE drops remainders)
     dict(exp_avg=torch.float32, exp_avg_sq=torch.float32, master_param=torch.float16), ["master_param"]),
], ids=["fp32", "bf16-moments", "int16-remainders", "fp16-exp-avg", "fp16-master"])
def test_state_dtypes_and_scales_as_te_creates_them(kw, dtypes, scaled):
    """fused_adam.py:409-454: each state in its configured dtype (int16 remainders for bf16 params
    with fp32 masters: 217-219, 418-419), and an fp32 `[1]` scale in `_scales` (outside `state`)
    for every state whose configured dtype is not fp32, bf16 ones included: one for the zero
    moments, the param's absmax / (fp16 max / 2) for an fp16 master (set_scaled_state, 472-480)."""
    opt = FakePrecisionAwareDistOpt(numels=NUMELS, **kw)
    p = opt.all_params()[0]
    opt.optimizer.initialize_state(p, opt.optimizer.store_param_remainders and p.dtype == torch.bfloat16)
    assert {k: t.dtype for k, t in opt.optimizer.state[p].items()} == dtypes
    scales = opt.optimizer._scales.get(p, {})
    assert sorted(scales) == sorted(scaled)
    assert all(s.dtype == torch.float32 and s.shape == (1,) for s in scales.values())
    assert all(s.item() == 1.0 for name, s in scales.items() if name != "master_param")
    if "master_param" in scales:
        expected = p.float().abs().max().item() / (torch.finfo(torch.float16).max / 2)
        assert scales["master_param"].item() == pytest.approx(expected, rel=1e-6)
    if dtypes["master_param"] == torch.int16:
        assert not opt.optimizer.state[p]["master_param"].any()  # zero remainders


def test_fp16_states_are_stored_scaled_by_a_scale_outside_the_state():
    """fused_adam.py:268-308, 334-337: after each step an fp16 state holds value / scale with
    scale = absmax / (fp16 max / 2), and `get_unscaled_state` multiplies back."""
    ref, opt = FakePrecisionAwareDistOpt(numels=NUMELS), FakePrecisionAwareDistOpt(numels=NUMELS, moment_dtype=torch.float16)
    train(ref, 3)
    train(opt, 3)
    half_range = torch.finfo(torch.float16).max / 2
    for p, q in zip(ref.all_params(), opt.all_params()):
        for name in ("exp_avg", "exp_avg_sq"):
            stored, scale = opt.optimizer.state[q][name], opt.optimizer._scales[q][name]
            assert stored.dtype == torch.float16 and scale.item() != 1.0
            assert stored.float().abs().max().item() == pytest.approx(half_range, rel=1e-3)
            exact = ref.optimizer.state[p][name]
            assert scale.item() == pytest.approx(exact.abs().max().item() / half_range, rel=1e-2)
            unscaled = opt.optimizer.get_unscaled_state(q, name)
            assert unscaled.dtype == torch.float32
            torch.testing.assert_close(unscaled, exact, rtol=2e-2, atol=exact.abs().max().item() * 1e-3)


def test_int16_remainders_hold_the_fp32_master_and_the_bf16_param_is_rounded_to_nearest():
    """multi_tensor_adam_param_remainder: the master's low 16 bits are kept, the bf16 param is its
    high 16 bits plus one where the low half's sign bit is set (round to nearest), and the master
    is rebuilt by undoing that. So the master is the fp32 master's bit for bit, and the bf16 param
    is the same as with fp32 masters (the kernel's cast rounds to nearest even; ties differ)."""
    ref = FakePrecisionAwareDistOpt(numels=NUMELS, moment_dtype=torch.bfloat16)
    opt = FakePrecisionAwareDistOpt(numels=NUMELS, moment_dtype=torch.bfloat16, store_param_remainders=True)
    train(ref, 4)
    train(opt, 4)
    for p, q in zip(ref.all_params(), opt.all_params()):
        remainders = opt.optimizer.state[q]["master_param"]
        assert remainders.dtype == torch.int16
        master = te_master(q, remainders)
        assert torch.equal(master.view(torch.int32), ref.optimizer.state[p]["master_param"].view(torch.int32))
        low = (master.view(torch.int32) & 0xFFFF)
        ties = low == 0x8000
        assert torch.equal(q[~ties], p[~ties])
        assert not torch.equal(q, (master.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_dict_is_unscaled_and_load_state_dict_rebuilds_the_state(config):
    """fused_adam.py:482-513: `state_dict()` gives every state unscaled in fp32 (fp32 states and
    int16 remainders: the very tensors). 515-548: `load_state_dict()` gives each loaded parameter
    a new state dict of new tensors in TE's dtypes (torch's own load would cast them all to the
    bf16 param's dtype), with the values it was given: a round trip changes nothing (megatron-core's
    DistributedOptimizer.load_state_dict runs one before every checkpoint load)."""
    ref, opt = FakePrecisionAwareDistOpt(numels=NUMELS, **CONFIGS[config]), FakePrecisionAwareDistOpt(numels=NUMELS, **CONFIGS[config])
    train(ref, 3)
    train(opt, 3)
    inner = opt.optimizer
    remainders = inner.store_param_remainders
    saved = inner.state_dict()
    for i, p in enumerate(opt.all_params()):
        for name, t in saved["state"][i].items():
            expected = torch.int16 if remainders and name == "master_param" else torch.float32
            assert t.dtype == expected, (name, t.dtype)
            if inner.name_to_dtype_map[name] == torch.float32:
                assert t is inner.state[p][name]
    dicts = [inner.state[p] for p in opt.all_params()]
    tensors = [t for s in dicts for t in s.values()]
    before = snapshot(opt)
    inner.load_state_dict(saved)
    assert all(inner.state[p] is not d for p, d in zip(opt.all_params(), dicts))
    assert not {id(t) for s in inner.state.values() for t in s.values()} & {id(t) for t in tensors}
    after = snapshot(opt)
    if config == "fp16-moments":  # re-scaled from the unscaled values: the same up to fp16 rounding
        for k in before:
            torch.testing.assert_close(after[k].float(), before[k].float(), rtol=1e-3, atol=0)
    else:
        assert_bitwise_equal(after, before)
    train(ref, 2, start=3)
    train(opt, 2, start=3)
    if config != "fp16-moments":
        assert_bitwise_equal(snapshot(ref), snapshot(opt))
