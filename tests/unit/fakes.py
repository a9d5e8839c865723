"""CPU stand-ins for Megatron's DistributedOptimizer and TE FusedAdam (state layout only).

FakeDistOpt mirrors the attributes megatron-offload reads from a real DistributedOptimizer
(megatron-core 0.19.2, distrib_optimizer.py `_build_model_and_main_param_groups`):
  * `shard_fp32_groups`: views into one fp32 "param buffer" (model weights: never offloaded);
  * `shard_fp32_from_float16_groups`: fp32 clones of bf16 shards, each its own storage;
  * `optimizer`: the inner torch optimizer whose param_groups hold both kinds.

TEFusedAdamStandIn mirrors TE FusedAdam with `master_weights=True` (precision-aware optimizer):
param groups hold bf16 shard params (views into a bf16 buffer), `state[p]` holds `exp_avg`,
`exp_avg_sq` (in `moment_dtype`) and `master_param`: fp32, or int16 low-16-bit remainders of the
fp32 master when `store_param_remainders` (the bf16 param holds the high 16 bits). The step
counter lives in the param group, as in TE.
"""

import torch


def make_grads(params, step, seed=1234):
    g = torch.Generator().manual_seed(seed + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)


class FakeDistOpt:
    def __init__(self, fp32_numels=(7, 5), bf16_numels=(300, 1000, 64, 4096), lr=1e-2, seed=0):
        g = torch.Generator().manual_seed(seed)
        total = sum(fp32_numels)
        self.fp32_param_buffer = torch.randn(total, generator=g)
        views, off = [], 0
        for n in fp32_numels:
            views.append(self.fp32_param_buffer[off : off + n])
            off += n
        self.shard_fp32_groups = [views]
        self.model_bf16 = [torch.randn(n, generator=g).to(torch.bfloat16) for n in bf16_numels]
        masters = [torch.nn.Parameter(p.detach().clone().float()) for p in self.model_bf16]
        self.shard_fp32_from_float16_groups = [masters]
        self.optimizer = torch.optim.AdamW(
            [{"params": [*views, *masters]}], lr=lr, weight_decay=0.1, foreach=False
        )
        self.is_stub_optimizer = False

    def all_params(self):
        return self.optimizer.param_groups[0]["params"]

    def step(self):
        self.optimizer.step()
        for model, master in zip(self.model_bf16, self.shard_fp32_from_float16_groups[0]):
            model.copy_(master.detach())


class TEFusedAdamStandIn(torch.optim.Optimizer):
    """TE FusedAdam with master weights, as megatron-core's precision-aware optimizer builds it.

    `lazy_state=True` is TE's own behaviour (transformer_engine/pytorch/optimizers/fused_adam.py):
    `step()` creates every state tensor (moments and master) of every parameter whose state is
    empty, whether or not it has a gradient, and with `use_decoupled_grad=True` (what megatron-core
    passes) it reads `p.decoupled_grad`, never `p.grad`. The default (`lazy_state=False`) creates
    the masters up front and only the moments lazily."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 moment_dtype=torch.float32, store_param_remainders=False, lazy_state=False,
                 use_decoupled_grad=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.moment_dtype = moment_dtype
        self.store_param_remainders = store_param_remainders
        self.lazy_state = lazy_state
        self.use_decoupled_grad = use_decoupled_grad
        # TE's state API, as megatron-offload uses it (`materialize_state`).
        self.master_weights = True
        self.name_to_dtype_map = {"exp_avg": moment_dtype, "exp_avg_sq": moment_dtype,
                                  "master_param": torch.float32}
        self._scales = {}
        if not lazy_state:
            for group in self.param_groups:
                for p in group["params"]:
                    self._init_master(p)

    def initialize_state(self, param, store_param_remainders):
        """TE's: zero moments, the master as the param in fp32 (or zero int16 remainders), and
        a scale of one for every state that is not fp32."""
        state = self.state[param]
        state["exp_avg"] = torch.zeros(param.shape, dtype=self.moment_dtype)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=self.moment_dtype)
        if store_param_remainders:
            state["master_param"] = torch.zeros(param.shape, dtype=torch.int16)
        else:
            state["master_param"] = param.detach().float().clone()
        for name, value in state.items():
            if value.dtype != torch.float32 and not (name == "master_param" and store_param_remainders):
                self._scales.setdefault(param, {})[name] = torch.ones([1])

    def _init_master(self, p):
        state = self.state[p]
        if self.store_param_remainders:
            state["master_param"] = torch.zeros(p.shape, dtype=torch.int16)
        else:
            state["master_param"] = p.detach().float().clone()

    def _get_master(self, p):
        m = self.state[p]["master_param"]
        if not self.store_param_remainders:
            return m.clone()
        high = p.detach().view(torch.int16).to(torch.int32) << 16
        low = m.to(torch.int32) & 0xFFFF
        return (high | low).view(torch.float32).clone()

    def _set_master(self, p, master):
        if not self.store_param_remainders:
            self.state[p]["master_param"].copy_(master)
            p.detach().copy_(master.to(p.dtype))
            return
        bits = master.view(torch.int32)
        # bf16 keeps the high half (truncation, so that high|low reconstructs exactly).
        p.detach().view(torch.int16).copy_((bits >> 16).to(torch.int16))
        self.state[p]["master_param"].copy_((bits & 0xFFFF).to(torch.int16))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            t = group["step"]
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if self.lazy_state and len(state) == 0:  # TE: before looking at the gradient
                    self.initialize_state(p, self.store_param_remainders and p.dtype == torch.bfloat16)
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros(p.shape, dtype=self.moment_dtype)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=self.moment_dtype)
                g = grad.float()
                m = state["exp_avg"].float().mul_(b1).add_(g, alpha=1 - b1)
                v = state["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                master = self._get_master(p)
                master.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                master.addcdiv_(m / (1 - b1**t), denom, value=-group["lr"])
                self._set_master(p, master)


class FakePrecisionAwareDistOpt:
    """DistributedOptimizer layout with --use-precision-aware-optimizer (TE FusedAdam masters)."""

    def __init__(self, numels=(300, 1000, 4096), store_param_remainders=False,
                 moment_dtype=torch.float32, seed=0, te_lazy_decoupled=False):
        g = torch.Generator().manual_seed(seed)
        self.bf16_param_buffer = torch.randn(sum(numels), generator=g).to(torch.bfloat16)
        shards, off = [], 0
        for n in numels:
            shards.append(self.bf16_param_buffer[off : off + n])
            off += n
        self.shard_float16_groups = [shards]
        self.shard_fp32_from_float16_groups = [[None] * len(shards)]
        self.shard_fp32_groups = [[]]
        self.optimizer = TEFusedAdamStandIn(
            [{"params": shards}], moment_dtype=moment_dtype,
            store_param_remainders=store_param_remainders,
            lazy_state=te_lazy_decoupled, use_decoupled_grad=te_lazy_decoupled,
        )
        self.is_stub_optimizer = False

    def all_params(self):
        return self.optimizer.param_groups[0]["params"]

    def hand_over_grads(self):
        """Where megatron-core puts the main grads for a decoupled-grad optimizer: `.decoupled_grad`
        (and `.grad` stays None)."""
        if self.optimizer.use_decoupled_grad:
            for p in self.all_params():
                p.decoupled_grad, p.grad = p.grad, None

    def step(self):
        self.hand_over_grads()
        self.optimizer.step()


def snapshot(dist_opt):
    """Bitwise copy of every tensor that defines training state."""
    out = {}
    for i, p in enumerate(dist_opt.optimizer.param_groups[0]["params"]):
        out[f"p{i}"] = p.detach().clone()
        for k, v in dist_opt.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"p{i}.{k}"] = v.detach().clone()
            else:
                out[f"p{i}.{k}"] = v
    for i, m in enumerate(getattr(dist_opt, "model_bf16", [])):
        out[f"model{i}"] = m.clone()
    return out


def resident_snapshot(opt, coord):
    """snapshot() read as a checkpoint reader would (part of the state may be off the GPU)."""
    for off in coord.offloaders:
        coord.before_state_access(off, will_modify=False)
    try:
        return snapshot(opt)
    finally:
        for off in coord.offloaders:
            coord.after_state_access(off, modified=False)


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k
        else:
            assert x == y, k


def storage_bytes(t):
    return t.untyped_storage().nbytes()



def make_coordinator(device=None, **kw):
    """An OffloadCoordinator from flat keywords: OffloadConfig's fields, AllocatorProbes' fields
    (`memory_allocated` etc. by the coordinator's older names too), and the constructor's own."""
    import dataclasses

    from megatron_offload import OffloadCoordinator
    from megatron_offload.config import AllocatorProbes, OffloadConfig

    renamed = {"memory_allocated": "allocated", "max_memory_allocated": "max_allocated"}
    kw = {renamed.get(k, k): v for k, v in kw.items()}
    config_fields = {f.name for f in dataclasses.fields(OffloadConfig)}
    probe_fields = {f.name for f in dataclasses.fields(AllocatorProbes)}
    config = OffloadConfig(**{k: kw.pop(k) for k in list(kw) if k in config_fields})
    probes = AllocatorProbes(**{k: kw.pop(k) for k in list(kw) if k in probe_fields})
    return OffloadCoordinator(config, device=device, probes=probes, **kw)
