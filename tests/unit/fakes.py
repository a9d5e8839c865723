"""CPU stand-ins for Megatron's DistributedOptimizer and TE FusedAdam.

FakeDistOpt mirrors the attributes megatron-offload reads from a real DistributedOptimizer
(megatron-core 0.19.2, distrib_optimizer.py `_build_model_and_main_param_groups`):
  * `shard_fp32_groups`: views into one fp32 "param buffer" (model weights: never offloaded);
  * `shard_fp32_from_float16_groups`: fp32 clones of bf16 shards, each its own storage;
  * `optimizer`: the inner torch optimizer whose param groups hold both kinds.

TEFusedAdamStandIn follows Transformer Engine 2.20.2's FusedAdam as megatron-core's precision-aware
optimizer builds it (its docstring lists what, with line references into TE's fused_adam.py):
no state until the first `step()` (or `initialize_state`), which creates `exp_avg`, `exp_avg_sq`
and `master_param` (fp32, or int16 remainders of the fp32 master with `store_param_remainders`)
for every parameter; fp16 states scaled by per-tensor scales kept outside `state`; gradients
from `.decoupled_grad`; the step counter in the param group; `state_dict`/`load_state_dict`
unscaled and rebuilding. FakePrecisionAwareDistOpt is the DistributedOptimizer around it.
"""

from itertools import chain

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
    """Transformer Engine 2.20.2 `FusedAdam` (transformer_engine/pytorch/optimizers/fused_adam.py,
    "fused_adam.py:N" below) as megatron-core 0.19.2's precision-aware optimizer builds it
    (megatron/core/optimizer/__init__.py: `master_weights=True`, `use_decoupled_grad=True`,
    `master_weight_dtype`, `exp_avg_dtype`, `exp_avg_sq_dtype`, `store_param_remainders`), on the
    CPU. TE's Python logic is followed line for line, its CUDA kernels by their element-wise math:

    * No state at construction. `step()` creates the whole state of every parameter whose state is
      empty, whether or not it has a gradient, before it looks at the gradient (fused_adam.py:633-
      642), with `initialize_state` (456-480): zero `exp_avg`/`exp_avg_sq` in their dtypes; the
      master in `master_weight_dtype` holding the param's value, or zero int16 remainders (bf16
      params with `store_param_remainders`, which TE keeps only with fp32 masters: 217-219);
      a `[1]` fp32 scale of one in `_scales[p][name]` (not in `state`) for every state whose
      dtype is not fp32, bf16 included (448-454).
    * Gradients from `p.decoupled_grad` with `use_decoupled_grad`, never `p.grad` (636-639).
    * One step counter per param group, an int incremented by every `step()` call, also for
      groups without gradients (563-587).
    * fp16 states are stored scaled: after each step scale = absmax / (fp16 max / 2) and the
      stored value is value / scale (`_apply_scale`, 268-308); `get_unscaled_state` multiplies
      back (310-356). bf16 states are stored as is (their scale stays one).
    * int16 remainders (the multi_tensor_adam_param_remainder kernel): the fp32 master's low 16
      bits; the bf16 param is its high 16 bits rounded to nearest (plus one where the remainder's
      sign bit is set), so the master is rebuilt as (high - (rem < 0)) << 16 | rem.
    * `state_dict()` returns every state unscaled (fp32; fp32 states and int16 remainders as the
      very tensors), `load_state_dict()` replaces each loaded parameter's state dict and tensors
      with new ones built by `set_scaled_state` (482-548), as megatron-core's checkpointing relies
      on (distrib_optimizer.py `_get_main_param_and_optimizer_states` / `_set_main_...`).
    Not modelled: fp8 (uint8) states (Float8Tensor objects with a quantizer scale, amax and
    scale_inv of their own besides `_scales`: 426-433), fp8 params, capturable mode, DTensors."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 master_weights=True, master_weight_dtype=torch.float32, moment_dtype=torch.float32,
                 exp_avg_dtype=None, exp_avg_sq_dtype=None, use_decoupled_grad=True,
                 store_param_remainders=False):
        exp_avg_dtype = moment_dtype if exp_avg_dtype is None else exp_avg_dtype
        exp_avg_sq_dtype = moment_dtype if exp_avg_sq_dtype is None else exp_avg_sq_dtype
        if master_weight_dtype not in (torch.float32, torch.float16):
            raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
        for dtype in (exp_avg_dtype, exp_avg_sq_dtype):
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise NotImplementedError(f"stand-in: {dtype} moments (TE's fp8 are uint8) not modelled")
        super().__init__(params, dict(lr=lr, bias_correction=True, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self.dtype_to_range_map = {
            torch.float16: torch.full([1], torch.finfo(torch.float16).max / 2.0, dtype=torch.float32)}
        self._scales = {}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32)
        self.fuse_unscale = exp_avg_dtype == exp_avg_sq_dtype == torch.bfloat16

    # -- TE's state API (fused_adam.py:235-548) -----------------------------------------------
    def zero_grad(self, set_to_none=True):
        if not self.use_decoupled_grad and not set_to_none:
            return super().zero_grad(set_to_none=False)
        for group in self.param_groups:
            for p in group["params"]:
                if self.use_decoupled_grad and set_to_none:
                    p.decoupled_grad = None
                elif self.use_decoupled_grad:
                    p.decoupled_grad.zero_()
                else:
                    p.grad = None

    def _apply_scale(self, state_name, unscaled_state, scaled_state, scale):
        assert unscaled_state.dtype == torch.float32
        if scaled_state.dtype == torch.bfloat16:
            scaled_state.copy_(unscaled_state.bfloat16())
            return
        dtype = self.name_to_dtype_map[state_name]
        assert scaled_state.dtype == dtype == torch.float16
        min_val, max_val = torch.aminmax(unscaled_state)
        absmax = torch.maximum(-min_val, max_val).to(torch.float32)
        torch.div(absmax, self.dtype_to_range_map[dtype], out=scale)
        rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
        unscaled_state.mul_(rscale)
        scaled_state.copy_(unscaled_state)

    def get_unscaled_state(self, param, state_name, skip_unscale=False):
        dtype = self.name_to_dtype_map[state_name]
        state = self.state[param][state_name]
        if dtype == torch.float16:
            assert state.dtype == torch.float16
            return state.float().mul_(self._scales[param][state_name])
        if dtype == torch.float32:
            if self.store_param_remainders and state_name == "master_param" and param.dtype == torch.bfloat16:
                assert state.dtype == torch.int16
            else:
                assert state.dtype == torch.float32
            return state
        assert dtype == state.dtype == torch.bfloat16
        return state if skip_unscale else state.float()

    def set_scaled_state(self, param, state_name, unscaled_state):
        remainders = (self.store_param_remainders and state_name == "master_param"
                      and param.dtype == torch.bfloat16)
        assert unscaled_state.dtype == (torch.int16 if remainders else torch.float32)
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False, remainders)
        if self.name_to_dtype_map[state_name] != torch.float32:
            self._apply_scale(state_name, unscaled_state, self.state[param][state_name],
                              self._scales[param][state_name])
        else:
            self.state[param][state_name].copy_(unscaled_state)

    def _initialize_state(self, param, state_name, zero_buffer, store_param_remainders=False):
        dtype = self.name_to_dtype_map[state_name]
        if store_param_remainders:
            data = torch.zeros_like(param, dtype=torch.int16)
        else:
            data = torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones(
                [1], dtype=torch.float32, device=param.device)

    def initialize_state(self, param, store_param_remainders):
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False,
                                   store_param_remainders=store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.clone().detach().float())

    def _id_map(self, saved_groups):
        return dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                        chain.from_iterable(g["params"] for g in self.param_groups)))

    def state_dict(self):
        state_dict = super().state_dict()
        id_map = self._id_map(state_dict["param_groups"])
        for k, v in state_dict["state"].items():
            if k in id_map:
                state_dict["state"][k] = {name: self.get_unscaled_state(id_map[k], name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # (torch casts each state to its param's dtype...)
        id_map = self._id_map(state_dict["param_groups"])
        for k, v in state_dict["state"].items():  # (...which TE discards: rebuilt from the dict)
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name, value in v.items():
                    if value is None:
                        continue
                    if self.store_param_remainders and name == "master_param" and param.dtype == torch.bfloat16:
                        self.set_scaled_state(param, name, value)
                    else:
                        self.set_scaled_state(param, name, value.float())

    # -- The step (fused_adam.py:550-914; the kernels' element-wise math) ----------------------
    @staticmethod
    def _master_from_remainders(param, remainders):
        high = param.detach().reshape(-1).view(torch.int16)
        low = remainders.reshape(-1)
        high = high - (low < 0).to(torch.int16)  # undo the rounding
        return torch.stack([low, high], dim=1).view(torch.float32).reshape(param.shape)

    @staticmethod
    def _split_into_remainders(master, param, remainders):
        halves = master.reshape(-1).view(torch.int16).view(-1, 2)
        low, high = halves[:, 0], halves[:, 1]
        param.detach().reshape(-1).view(torch.int16).copy_(high + (low < 0).to(torch.int16))  # round
        remainders.reshape(-1).copy_(low)

    def _store(self, param, name, value):
        """Write the updated fp32 `value` back (TE: the kernel in place, then `_apply_scale`)."""
        state = self.state[param][name]
        if value is state:
            return
        if self.name_to_dtype_map[name] == torch.float32:
            state.copy_(value)
        else:
            self._apply_scale(name, value, state, self._scales[param][name])

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            if not group["params"]:
                continue
            b1, b2 = group["betas"]
            t, lr, wd, eps = group["step"], group["lr"], group["weight_decay"], group["eps"]
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                state = self.state[p]
                remainders = self.store_param_remainders and p.dtype == torch.bfloat16
                if len(state) == 0:
                    self.initialize_state(p, remainders)
                if self.use_decoupled_grad:
                    grad = p.decoupled_grad if hasattr(p, "decoupled_grad") else None
                else:
                    grad = p.grad
                if grad is None:
                    continue
                g = grad.float()
                m = self.get_unscaled_state(p, "exp_avg").float()
                v = self.get_unscaled_state(p, "exp_avg_sq").float()
                if not self.master_weights:
                    master = p.detach().float()
                elif remainders:
                    master = self._master_from_remainders(p, state["master_param"])
                else:
                    master = self.get_unscaled_state(p, "master_param").float()
                # ADAM_MODE_1 (adam_w_mode, megatron-core's decoupled weight decay).
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v / bc2).sqrt_().add_(eps)
                update = (m / bc1).div_(denom).add_(master, alpha=wd)
                master.add_(update, alpha=-lr)
                self._store(p, "exp_avg", m)
                self._store(p, "exp_avg_sq", v)
                if remainders:
                    self._split_into_remainders(master, p, state["master_param"])
                    continue
                p.detach().copy_(master.to(p.dtype))  # (the kernel's cast of the updated master)
                if self.master_weights:
                    self._store(p, "master_param", master)


class FakePrecisionAwareDistOpt:
    """DistributedOptimizer layout with --use-precision-aware-optimizer: the inner optimizer is TE
    FusedAdam (the stand-in above, `te_kwargs` passed on) over bf16 shard params, views into one
    bf16 buffer; no fp32 masters of megatron's own (TE holds them)."""

    def __init__(self, numels=(300, 1000, 4096), store_param_remainders=False,
                 moment_dtype=torch.float32, seed=0, **te_kwargs):
        shards = self._lay_out(numels, seed, torch.device("cpu"))
        self.optimizer = TEFusedAdamStandIn(
            [{"params": shards}], moment_dtype=moment_dtype,
            store_param_remainders=store_param_remainders, **te_kwargs)
        self.is_stub_optimizer = False

    def _lay_out(self, numels, seed, device):
        """bf16 shard params, views into one buffer on `device` (same values on any device)."""
        g = torch.Generator().manual_seed(seed)
        self.bf16_param_buffer = torch.randn(sum(numels), generator=g).to(torch.bfloat16).to(device)
        shards, off = [], 0
        for n in numels:
            shards.append(self.bf16_param_buffer[off : off + n])
            off += n
        self.shard_float16_groups = [shards]
        self.shard_fp32_from_float16_groups = [[None] * len(shards)]
        self.shard_fp32_groups = [[]]
        return shards

    def all_params(self):
        return self.optimizer.param_groups[0]["params"]

    def hand_over_grads(self):
        """Where megatron-core puts the main grads for a decoupled-grad optimizer: `.decoupled_grad`
        (distrib_optimizer.py `_copy_model_grads_to_main_grads`; `.grad` stays None)."""
        if self.optimizer.use_decoupled_grad:
            for p in self.all_params():
                p.decoupled_grad, p.grad = p.grad, None

    def step(self):
        self.hand_over_grads()
        self.optimizer.step()


class HookedLikeMegatronDDP:
    """megatron-core DDP's hook registration in miniature: an AccumulateGrad node per parameter of
    `module`, kept in `grad_accs`, with a hook that records each call (the parameter, and the
    current CUDA stream where there is one)."""

    def __init__(self, module):
        self.module, self.calls, self.streams, self.grad_accs = module, [], [], []
        for param in module.parameters():
            node = param.expand_as(param).grad_fn.next_functions[0][0]
            node.register_hook(self._make_backward_post_hook(param))
            self.grad_accs.append(node)

    def _make_backward_post_hook(self, param):
        def hook(*unused):
            self.calls.append(param)
            if param.is_cuda:
                self.streams.append(torch.cuda.current_stream(param.device).cuda_stream)
        return hook


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
        # TE's per-state scales (fp16 states) are state too, kept outside `state`.
        for k, v in getattr(dist_opt.optimizer, "_scales", {}).get(p, {}).items():
            out[f"p{i}.{k}.scale"] = v.detach().clone()
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


def step_beside(ref, opt, coord, step):
    """One step of the reference and of the offloaded optimizer on the same gradients, the
    coordinator told that the step is done; their state must then be identical."""
    make_grads(ref.all_params(), step)
    ref.step()
    make_grads(opt.all_params(), step)
    opt.step()
    coord.optimizer_step_done()
    assert_bitwise_equal(snapshot(ref), resident_snapshot(opt, coord))


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
    # A real gc.collect() in every test coordinator costs the suite seconds per file: only the
    # tests of that collection turn it on.
    kw.setdefault("collect_after_setup", False)
    config_fields = {f.name for f in dataclasses.fields(OffloadConfig)}
    probe_fields = {f.name for f in dataclasses.fields(AllocatorProbes)}
    config = OffloadConfig(**{k: kw.pop(k) for k in list(kw) if k in config_fields})
    probes = AllocatorProbes(**{k: kw.pop(k) for k in list(kw) if k in probe_fields})
    return OffloadCoordinator(config, device=device, probes=probes, **kw)


def run_on_gloo_ranks(target, world, *args):
    """`target(rank, world, port, *args, out)` in `world` spawned processes (each joins a gloo
    group on `port` and puts (rank, result) on `out`); {rank: result}."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out), daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        return dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
