"""Dense-layer wrappers: FP32 router logits and deterministic top-k routing, SwiGLU, RMSNorm."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import ConfigError
from .common import _check_versions, _linear_ste_backward, _save_linear_ste, _versions
from .guard import _SCORES

__all__ = ["router_logits", "topk_routing", "swiglu", "mlp_activation", "RMSNorm", "rms_norm"]


# ---------------------------------------------------------------------------------------------- router
class _RouterGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        from ...ops.router_gemm import router_gemm

        _save_linear_ste(ctx, x2, w)
        return router_gemm(x2, w)

    @staticmethod
    def backward(ctx, g):
        return _linear_ste_backward(ctx, g)


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 router logits ``[..., E]`` from bf16 ``x [..., H]`` and bf16 ``weight [E, H]`` via
    ``zerodiff.ops.router_gemm`` (same kernel at every token count)."""
    if bias is not None:
        raise ConfigError("zerodiff router: a router bias is not supported in consistency mode")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff router: input ({x.dtype}) and router weight ({weight.dtype}) must be "
                          "bfloat16 (the rollout's gate weight is the BF16 master)")
    lead = x.shape[:-1]
    out = _RouterGemm.apply(x.reshape(-1, x.shape[-1]), weight)
    return out.view(*lead, weight.shape[0])


def _score_graph(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    x = logits.float()
    if score_function == "softmax":
        return torch.softmax(x, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(x)
    return F.softplus(x).sqrt()


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax",
                 use_pre_softmax: bool = False, scaling_factor: float | None = None,
                 expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``(probs [T, E], routing_map bool [T, E])`` computed by ``zerodiff.ops.moe.route``.

    Values are the zerodiff op's (the rollout's); the gradient w.r.t. ``logits`` flows through the same
    formula written in PyTorch at the selected expert ids."""
    from ...ops.moe import route

    if score_function not in _SCORES:
        raise ConfigError(f"zerodiff routing: moe_router_score_function={score_function!r} not supported")
    lg = logits.reshape(-1, logits.shape[-1])
    if lg.dtype != torch.float32:
        raise ConfigError(f"zerodiff routing: router logits must be fp32 (moe_router_dtype='fp32'), got {lg.dtype}")
    softmax_after = score_function == "softmax" and not use_pre_softmax
    renorm = topk > 1 and (score_function != "softmax" or softmax_after)
    # softmax over the selected logits == softmax scores renormalised over the selection (same math)
    bias = None if expert_bias is None else expert_bias.detach().float()
    w, ids = route(lg.detach(), topk, scoring=score_function, bias=bias, renormalize=renorm,
                   routed_scale=float(scaling_factor) if scaling_factor else 1.0)
    idx = ids.long().clamp(min=0)
    if lg.requires_grad:
        sc = _score_graph(lg, score_function)
        gw = sc.gather(1, idx)
        if renorm:
            gw = gw / gw.sum(dim=-1, keepdim=True)
        if scaling_factor:
            gw = gw * scaling_factor
        w = w + (gw - gw.detach())
    probs = torch.zeros_like(lg).scatter(1, idx, w)
    routing_map = torch.zeros_like(lg, dtype=torch.bool).scatter(1, idx, ids >= 0)
    return probs, routing_map


# ---------------------------------------------------------------------------------------------- SwiGLU
def _swiglu_graph(x: torch.Tensor, clamp_limit):
    g, u = x.float().chunk(2, dim=-1)
    if clamp_limit is not None:
        g = g.clamp(max=clamp_limit)
        u = u.clamp(min=-clamp_limit, max=clamp_limit)
    return F.silu(g) * u


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clamp_limit):
        from ...ops.silu_mul_quant import silu_mul

        ctx.save_for_backward(x)
        ctx.clamp_limit = clamp_limit
        lead = x.shape[:-1]
        y = silu_mul(x.reshape(-1, x.shape[-1]), clamp_limit=clamp_limit)
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xf = x.detach().float().requires_grad_(True)
            y = _swiglu_graph(xf, ctx.clamp_limit)
            (gx,) = torch.autograd.grad(y, xf, g.float())
        return gx.to(x.dtype), None


def swiglu(x: torch.Tensor, clamp_limit: float | None = None) -> torch.Tensor:
    """SiLU(gate) * up on bf16 ``[..., 2N]`` with one BF16 rounding (``zerodiff.ops.silu_mul_quant``)."""
    if x.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff SwiGLU: activations must be bfloat16, got {x.dtype}")
    if not x.is_contiguous():
        x = x.contiguous()
    return _SiluMul.apply(x, clamp_limit)


def mlp_activation(config: Any, activation_func, x: torch.Tensor, bias: torch.Tensor | None,
                   per_token_scale: torch.Tensor | None) -> torch.Tensor:
    """The patched ``MLP.forward`` activation: SwiGLU through zerodiff; anything else refused."""
    if bias is not None:
        raise ConfigError("zerodiff MLP: fc1 bias is not supported in consistency mode (add_bias_linear=False)")
    if per_token_scale is not None:
        raise ConfigError("zerodiff MLP: per_token_scale (moe_apply_probs_on_input) is not supported")
    if not getattr(config, "gated_linear_unit", False) or activation_func is not F.silu:
        raise ConfigError("zerodiff MLP: only SwiGLU (gated_linear_unit=True, activation_func=F.silu) is "
                          "supported in consistency mode")
    if getattr(config, "glu_linear_offset", 0.0):
        raise ConfigError("zerodiff MLP: glu_linear_offset must be 0")
    return swiglu(x, getattr(config, "activation_func_clamp_value", None))


# --------------------------------------------------------------------------------------------- RMSNorm
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        from ...ops.rmsnorm import rms_norm as zd_rms_norm

        ctx.save_for_backward(x)
        ctx.zd_weight = weight
        ctx.eps = eps
        ctx.zd_versions = _versions(weight)
        return zd_rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        weight = ctx.zd_weight
        _check_versions(ctx, weight)
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xf = x.detach().float().requires_grad_(True)
            wf = weight.detach().float().requires_grad_(True)
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps) * wf
            gx, gw = torch.autograd.grad(y, (xf, wf), g.float())
        return gx.to(x.dtype), gw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Differentiable ``zerodiff.ops.rmsnorm.rms_norm`` (x bf16 ``[..., H]``)."""
    if x.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff RMSNorm: input must be bfloat16, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _RMSNorm.apply(x, weight, float(eps))


class RMSNorm(torch.nn.Module):
    """Drop-in for Megatron's RMSNorm (``weight`` parameter, same state-dict key) computing the rollout's
    value with ``zerodiff.ops.rmsnorm`` and an FP32 backward."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, config: Any = None, dtype=None, device=None):
        super().__init__()
        if config is not None and getattr(config, "layernorm_zero_centered_gamma", False):
            raise ConfigError("zerodiff RMSNorm: layernorm_zero_centered_gamma is not supported")
        if dtype is None:
            dtype = getattr(config, "params_dtype", None) or torch.float32
        if device is None and config is not None and not getattr(config, "use_cpu_initialization", True):
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(self.hidden_size, dtype=dtype, device=device))
        if config is not None and getattr(config, "sequence_parallel", False):
            setattr(self.weight, "sequence_parallel", True)

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps} (zerodiff)"

