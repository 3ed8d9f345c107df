"""mHC adapters: the five DeepSeek-V4 entry points on ``zerodiff.ops.mhc``."""

from __future__ import annotations

import torch

from .. import ConfigError
from .custom_ops import _op
from .layers import rms_norm

# ----------------------------------------------------------------------------------- mHC (DeepSeek-V4)
def _mhc_inputs(residual: torch.Tensor, what: str) -> torch.Tensor:
    if residual.dtype != torch.bfloat16 or residual.dim() < 3:
        raise ConfigError(f"zerodiff mHC ({what}): residual must be bfloat16 [..., hc_mult, hidden], got "
                          f"{residual.dtype} {tuple(residual.shape)}")
    n, H = residual.shape[-2:]
    return residual.reshape(-1, n, H).contiguous()


def mhc_pre(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
            rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
            sinkhorn_repeat: int, n_splits: int = 1, norm_weight: torch.Tensor | None = None,
            norm_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replacement for vLLM's ``mhc_pre_tilelang``: ``zerodiff.ops.mhc.mhc_pre`` (projection split fixed by the
    model shape, never by T; the kernel the training side runs), then, with ``norm_weight``, the layer input
    through :func:`rms_norm` (one more rounding than TileLang's fused norm; the training side composes the same
    two ops). ``n_splits`` is accepted and ignored (the split is zerodiff's). Returns ``(post [..., n, 1],
    comb [..., n, n], layer_input [..., H])`` like upstream."""
    outer = residual.shape[:-2]
    r = _mhc_inputs(residual, "pre")
    n, H = r.shape[1:]
    li, post, comb = _op("mhc_pre")(r, fn, hc_scale, hc_base, float(rms_eps), float(hc_pre_eps),
                                    float(hc_sinkhorn_eps), float(hc_post_mult_value), int(sinkhorn_repeat))
    if norm_weight is not None:
        li = rms_norm(li, norm_weight, norm_eps)
    return post.view(*outer, n, 1), comb.view(*outer, n, n), li.view(*outer, H)


def mhc_pre_broadcast(x: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                      rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
                      sinkhorn_repeat: int, n_splits: int = 1, norm_weight: torch.Tensor | None = None,
                      norm_eps: float = 1e-6, fn_broadcast: torch.Tensor | None = None):
    """Replacement for ``mhc_pre_broadcast_tilelang`` (first layer: the residual is ``x [T, H]`` copied into
    every stream). The copies are made exactly and :func:`mhc_pre` runs on them with the full ``fn``;
    ``fn_broadcast`` (upstream's pre-summed weight, a different sum order) is not used. Returns
    ``(residual [T, n, H], post, comb, layer_input)``."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ConfigError(f"zerodiff mHC (broadcast pre): x must be bfloat16 [T, hidden], got {x.dtype} "
                          f"{tuple(x.shape)}")
    n = fn.shape[1] // x.shape[1]
    residual = x.unsqueeze(1).expand(x.shape[0], n, x.shape[1]).contiguous()
    post, comb, li = mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                             hc_post_mult_value, sinkhorn_repeat, norm_weight=norm_weight, norm_eps=norm_eps)
    return residual, post, comb, li


def mhc_post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
             comb_res_mix: torch.Tensor) -> torch.Tensor:
    """Replacement for ``mhc_post_tilelang``: ``zerodiff.ops.mhc.mhc_post`` (FP32, post term first, streams in
    order, one rounding). ``post_layer_mix`` [..., n, 1] or [..., n]; ``comb_res_mix`` [..., n, n]."""
    r = _mhc_inputs(residual, "post")
    T, n, H = r.shape
    out = _op("mhc_post")(x.reshape(T, H).contiguous(), r, post_layer_mix.reshape(T, n).contiguous(),
                          comb_res_mix.reshape(T, n, n).contiguous())
    return out.view(residual.shape)


def mhc_fused_post_pre(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                       comb_res_mix: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                       rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
                       sinkhorn_repeat: int, n_splits: int = 1, tile_n: int = 1,
                       norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6):
    """Replacement for ``mhc_fused_post_pre_tilelang``: :func:`mhc_post` then :func:`mhc_pre` on its result
    (two kernels, the composition the training side runs; no batch-size-chosen fused kernel). Returns
    ``(residual, post, comb, layer_input)``."""
    new_residual = mhc_post(x, residual, post_layer_mix, comb_res_mix)
    post, comb, li = mhc_pre(new_residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                             hc_post_mult_value, sinkhorn_repeat, norm_weight=norm_weight, norm_eps=norm_eps)
    return new_residual, post, comb, li


def hc_head(hs_flat: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
            rms_eps: float, hc_eps: float) -> torch.Tensor:
    """Replacement for ``hc_head_fused_kernel_tilelang``: ``zerodiff.ops.mhc.hc_head`` on ``[T, n, H]``."""
    r = _mhc_inputs(hs_flat, "hc_head")
    return _op("hc_head")(r, fn, hc_scale.reshape(1), hc_base, float(rms_eps), float(hc_eps))


