"""megatron-core's mixed-precision optimizer over the DeepSeek-V4 actor.

:func:`build_optimizer` returns an :class:`ActorOptimizer` around megatron-core 0.19.2's
``Float16OptimizerWithFloat16Params`` (BF16 model params with FP32 main copies, FP32 params stepped as they
are; Adam inside). Its ``step()`` is upstream's: copy the model grads to the main grads, the inner
``torch.optim.Adam`` step on the FP32 main params, then ``_copy_main_params_to_model_params``, which writes
the BF16 masters through ``param.data`` (no version bump). The actor requantises its deployment before every
forward, so the next forward runs the new weights.

Construction: on CUDA the class's own ``__init__``. On the CPU that ``__init__`` cannot run (it allocates its
unit loss scale with ``device='cuda'`` and accepts only ``torch.cuda.*Tensor`` params), so the object is
assembled with exactly the attributes ``__init__`` sets (the same main-param copies, the same groups); every
method that runs afterwards is upstream's. FP32 params get ``main_grad = grad`` before a step (what
Megatron's DDP grad buffers provide; the optimizer reads FP32 grads from ``main_grad``).
"""

from __future__ import annotations

import torch

from .mcore import import_megatron


class ActorOptimizer:
    def __init__(self, megatron_optimizer, params):
        self.megatron = megatron_optimizer
        self.params = params

    @property
    def cls_name(self) -> str:
        return f"{type(self.megatron).__module__}.{type(self.megatron).__qualname__}"

    def zero_grad(self) -> None:
        self.megatron.zero_grad(set_to_none=True)

    def step(self) -> bool:
        for p in self.params:
            if p.dtype == torch.float32:
                p.main_grad = p.grad if p.grad is not None else torch.zeros_like(p)
        ok, _, _ = self.megatron.step()
        for p in self.params:
            if hasattr(p, "main_grad"):
                del p.main_grad
        return bool(ok)

    def state_dict(self):
        return self.megatron.state_dict()

    def load_state_dict(self, sd) -> None:
        self.megatron.load_state_dict(sd)


def build_optimizer(model, *, lr: float = 3e-3, betas=(0.9, 0.95), weight_decay: float = 0.0) -> ActorOptimizer:
    import_megatron()
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    params = [p for p in model.parameters() if p.requires_grad]
    config = OptimizerConfig(optimizer="adam", lr=lr, adam_beta1=betas[0], adam_beta2=betas[1],
                             weight_decay=weight_decay, bf16=True, clip_grad=0.0)
    inner = torch.optim.Adam(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)

    def init_state_fn(opt, cfg=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    if params and params[0].is_cuda:
        opt = Float16OptimizerWithFloat16Params(inner, config, None, init_state_fn)
        return ActorOptimizer(opt, params)
    opt = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    # MegatronOptimizer.__init__ / MixedPrecisionOptimizer.__init__ (bf16, no grad scaler)
    opt.optimizer, opt.config, opt.init_state_fn = inner, config, init_state_fn
    opt.grad_scaler, opt._dummy_overflow_buf = None, None
    opt._scale_one = torch.tensor([1.0], dtype=torch.float)
    # Float16OptimizerWithFloat16Params.__init__: FP32 main copies of the BF16 params
    opt.float16_groups, opt.fp32_from_float16_groups, opt.fp32_from_fp32_groups = [], [], []
    for group in inner.param_groups:
        f16, f32, main = [], [], []
        for i, p in enumerate(group["params"]):
            if not p.requires_grad:
                continue
            if p.dtype in (torch.float16, torch.bfloat16):
                mp = p.detach().clone().float()
                group["params"][i] = mp
                p.main_param = mp
                f16.append(p)
                main.append(mp)
            elif p.dtype == torch.float32:
                f32.append(p)
            else:  # pragma: no cover - the actor has no other dtypes
                raise TypeError(f"zerodiff actor optimizer: parameter dtype {p.dtype}")
        opt.float16_groups.append(f16)
        opt.fp32_from_float16_groups.append(main)
        opt.fp32_from_fp32_groups.append(f32)
    opt.is_stub_optimizer = False
    return ActorOptimizer(opt, params)
