"""The torch custom ops (``zerodiff_vllm::*``) behind the adapters vLLM calls from compiled or captured code."""

from __future__ import annotations

from typing import Optional

import torch


# ---------------------------------------------------------------- opaque custom ops (torch.compile-safe)
# vLLM compiles the model forward with Dynamo; a Python function that launches Triton kernels with our
# launch options would break the graph there. The adapters called from compiled regions are therefore
# registered as torch custom ops (opaque to Dynamo, with shape-only fake implementations).
_LIB = "zerodiff_vllm"
_OPS: dict = {}


def _ops() -> dict:
    if _OPS:
        return _OPS
    from torch.library import custom_op

    @custom_op(f"{_LIB}::router_logits", mutates_args=())
    def _router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from ...ops.router_gemm import router_gemm

        return router_gemm(x, w)

    @_router_logits.register_fake
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @custom_op(f"{_LIB}::rms_norm", mutates_args=())
    def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        from ...ops.rmsnorm import rms_norm as zd_rms_norm

        return zd_rms_norm(x, w, eps)

    @_rms_norm.register_fake
    def _(x, w, eps):
        return torch.empty_like(x)

    @custom_op(f"{_LIB}::rms_norm_residual", mutates_args=())
    def _rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from ...ops.rmsnorm import rms_norm as zd_rms_norm

        return zd_rms_norm(x, w, eps, residual=residual)

    @_rms_norm_residual.register_fake
    def _(x, residual, w, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @custom_op(f"{_LIB}::bf16_linear", mutates_args=())
    def _bf16_linear(x: torch.Tensor, w: torch.Tensor, fp32_out: bool) -> torch.Tensor:
        from ...ops.bf16_gemm import bf16_gemm

        return bf16_gemm(x, w, out_dtype=torch.float32 if fp32_out else torch.bfloat16)

    @_bf16_linear.register_fake
    def _(x, w, fp32_out):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32 if fp32_out else torch.bfloat16)

    @custom_op(f"{_LIB}::fp8_block_linear", mutates_args=())
    def _fp8_block_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, ue8m0: bool) -> torch.Tensor:
        from ...ops.fp8_gemm import fp8_linear as zd_fp8_linear
        from ...ops.fp8_quant import Fp8Weight

        return zd_fp8_linear(x, Fp8Weight(w, s, ue8m0))

    @_fp8_block_linear.register_fake
    def _(x, w, s, ue8m0):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)

    @custom_op(f"{_LIB}::silu_mul", mutates_args=())
    def _silu_mul(x: torch.Tensor, clamp_limit: Optional[float]) -> torch.Tensor:
        from ...ops.silu_mul_quant import silu_mul as zd_silu_mul

        return zd_silu_mul(x, clamp_limit=clamp_limit)

    @_silu_mul.register_fake
    def _(x, clamp_limit):
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @custom_op(f"{_LIB}::mhc_pre", mutates_args=())
    def _mhc_pre(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                 rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult: float,
                 sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from ...ops.mhc import mhc_pre as zd_mhc_pre

        return zd_mhc_pre(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps,
                          hc_sinkhorn_eps=hc_sinkhorn_eps, hc_post_mult=hc_post_mult, sinkhorn_iters=sinkhorn_iters)

    @_mhc_pre.register_fake
    def _(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters):
        T, n, H = residual.shape
        return (residual.new_empty((T, H)), residual.new_empty((T, n), dtype=torch.float32),
                residual.new_empty((T, n, n), dtype=torch.float32))

    @custom_op(f"{_LIB}::mhc_post", mutates_args=())
    def _mhc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        from ...ops.mhc import mhc_post as zd_mhc_post

        return zd_mhc_post(x, residual, post, comb)

    @_mhc_post.register_fake
    def _(x, residual, post, comb):
        return torch.empty_like(residual)

    @custom_op(f"{_LIB}::hc_head", mutates_args=())
    def _hc_head(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                 rms_eps: float, hc_eps: float) -> torch.Tensor:
        from ...ops.mhc import hc_head as zd_hc_head

        return zd_hc_head(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps)

    @_hc_head.register_fake
    def _(residual, fn, hc_scale, hc_base, rms_eps, hc_eps):
        return residual.new_empty((residual.shape[0], residual.shape[2]))

    _OPS.update(mhc_pre=_mhc_pre, mhc_post=_mhc_post, hc_head=_hc_head)
    _OPS.update(router_logits=_router_logits, rms_norm=_rms_norm, rms_norm_residual=_rms_norm_residual,
                fp8_block_linear=_fp8_block_linear, silu_mul=_silu_mul)
    return _OPS


def _op(name: str):
    """The registered op as ``torch.ops.zerodiff_vllm.<name>`` (the form Dynamo traces as one opaque call)."""
    if not _OPS:
        _ops()
    return getattr(getattr(torch.ops, _LIB), name)


