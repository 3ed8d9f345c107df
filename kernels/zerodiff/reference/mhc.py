"""Reference for mHC, the manifold-constrained hyper-connections of DeepSeek-V4 (pure torch).

The residual stream is ``n`` streams wide (``n = hc_mult = 4`` in DeepSeek-V4), each of width ``H``.
Every decoder sub-layer (attention, FFN) wraps its body in a *pre* and a *post* step.

pre (inputs: ``residual`` bf16 ``[T, n, H]``, ``fn`` fp32 ``[n*(n+2), n*H]``, ``hc_scale`` fp32 ``[3]``,
``hc_base`` fp32 ``[n*(n+2)]``):

1. ``x = residual`` flattened to ``[T, n*H]`` (bf16 values, exact in any wider type).
2. ``mix = (x @ fn.T) / sqrt(mean(x**2) + rms_eps)``  (the RMS norm is applied to the projection, so
   the projection and the sum of squares are two reductions over the same ``n*H`` values).
3. ``mix`` splits into ``n`` pre logits, ``n`` post logits and an ``n x n`` matrix (row-major):
   ``pre  = sigmoid(mix[:n] * hc_scale[0] + hc_base[:n]) + hc_pre_eps``
   ``post = sigmoid(mix[n:2n] * hc_scale[1] + hc_base[n:2n]) * hc_post_mult``
   ``comb = softmax_rows(mix[2n:] * hc_scale[2] + hc_base[2n:]) + hc_sinkhorn_eps``, then
   ``comb /= colsum(comb) + eps`` once, then ``sinkhorn_iters - 1`` times
   ``comb /= rowsum(comb) + eps; comb /= colsum(comb) + eps`` (a FIXED iteration count, no
   convergence test: the matrix is only approximately doubly stochastic).
4. ``layer_input = sum_i pre[i] * residual[:, i, :]`` (streams added in increasing i, starting from
   the i = 0 term, so an all-(-0) column stays -0) rounded once to bf16.

post (inputs: the sub-layer's output ``layer_out`` bf16 ``[T, H]``, the same ``residual``, ``post``,
``comb``): ``new[:, j, :] = post[j] * layer_out + sum_i comb[i, j] * residual[:, i, :]`` rounded once to
bf16 (``comb[i, j]`` carries stream ``i`` into stream ``j``).

These functions compute in float64 by default (the ideal the kernels are measured against) and round
only the outputs: ``post``/``comb`` to fp32, ``layer_input``/``new`` to bf16. ``mhc_post_ref`` also has an
fp32 mode that performs exactly the kernel's operation sequence (one multiply and one add per term,
each rounded to fp32, terms in the documented order), so the kernel can be checked bit for bit.
"""

from __future__ import annotations

import torch

#: DeepSeek-V4 values (config.json: hc_mult 4, hc_sinkhorn_iters 20, hc_eps 1e-6, rms_norm_eps 1e-6;
#: vLLM hard-codes the post multiplier to 2.0).
HC_MULT = 4
SINKHORN_ITERS = 20
HC_EPS = 1e-6
RMS_EPS = 1e-6
POST_MULT = 2.0


def n_mix(hc_mult: int) -> int:
    """Number of mixing logits per token: n pre + n post + n*n residual matrix."""
    return hc_mult * (hc_mult + 2)


def sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, then alternating column/row normalisation with a fixed count (any dtype)."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def mhc_mix_ref(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float = RMS_EPS,
    hc_pre_eps: float = HC_EPS,
    hc_sinkhorn_eps: float = HC_EPS,
    hc_post_mult: float = POST_MULT,
    sinkhorn_iters: int = SINKHORN_ITERS,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) computed in ``dtype`` (not rounded)."""
    T, n, H = residual.shape
    x = residual.reshape(T, n * H).to(dtype)
    mix = x @ fn.to(dtype).t()
    rms = torch.sqrt((x * x).sum(-1, keepdim=True) / (n * H) + rms_eps)
    mix = mix / rms
    s = hc_scale.to(dtype)
    b = hc_base.to(dtype)
    pre = torch.sigmoid(mix[:, :n] * s[0] + b[:n]) + hc_pre_eps
    post = torch.sigmoid(mix[:, n : 2 * n] * s[1] + b[n : 2 * n]) * hc_post_mult
    logits = mix[:, 2 * n :].reshape(T, n, n) * s[2] + b[2 * n :].reshape(1, n, n)
    comb = sinkhorn_ref(logits, sinkhorn_iters, hc_sinkhorn_eps)
    return pre, post, comb


def mhc_pre_ref(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    **mix_options: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer_input bf16 [T, H], post fp32 [T, n], comb fp32 [T, n, n]); see the module docstring.

    ``mix_options`` are :func:`mhc_mix_ref`'s keywords (epsilons, post multiplier, Sinkhorn count)."""
    pre, post, comb = mhc_mix_ref(residual, fn, hc_scale, hc_base, dtype=dtype, **mix_options)
    layer_input = aggregate_ref(residual, pre, dtype)
    return layer_input, post.to(torch.float32), comb.to(torch.float32)


def aggregate_ref(residual: torch.Tensor, pre: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``sum_i pre[:, i] * residual[:, i, :]`` -> bf16. In fp32 mode: the kernel's exact sequence
    ``acc = pre0*x0; acc = acc + pre_i*x_i`` for i = 1..n-1 (each op rounded to fp32)."""
    r = residual.to(dtype)
    p = pre.to(dtype)
    acc = p[:, 0:1] * r[:, 0]
    for i in range(1, r.shape[1]):
        acc = acc + p[:, i : i + 1] * r[:, i]
    return acc.to(torch.bfloat16)


def mhc_post_ref(
    layer_out: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``new[:, j] = post[:, j] * layer_out + sum_i comb[:, i, j] * residual[:, i]`` -> bf16 [T, n, H].

    The sum runs post term first, then i = 0..n-1, one multiply and one add per term; with
    ``dtype=torch.float32`` that is exactly the kernel's sequence (bitwise comparable)."""
    T, n, H = residual.shape
    post = post.reshape(T, n).to(dtype)
    comb = comb.reshape(T, n, n).to(dtype)
    x = layer_out.to(dtype)
    r = residual.to(dtype)
    acc = post.unsqueeze(-1) * x.unsqueeze(1)  # [T, n(j), H]
    for i in range(n):
        acc = acc + comb[:, i, :].unsqueeze(-1) * r[:, i : i + 1, :]
    return acc.to(torch.bfloat16)


def hc_head_ref(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float = RMS_EPS,
    hc_eps: float = HC_EPS,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The final collapse (vLLM ``HCHeadOp``): ``fn`` [n, n*H], ``hc_scale`` [1], ``hc_base`` [n];
    ``pre = sigmoid(mix * hc_scale + hc_base) + hc_eps`` with ``mix`` normalised as in step 2 above,
    then ``sum_i pre[i] * residual[:, i]`` rounded once to bf16."""
    T, n, H = residual.shape
    x = residual.reshape(T, n * H).to(dtype)
    mix = (x @ fn.to(dtype).t()) / torch.sqrt((x * x).sum(-1, keepdim=True) / (n * H) + rms_eps)
    pre = torch.sigmoid(mix * hc_scale.to(dtype)[0] + hc_base.to(dtype)) + hc_eps
    return aggregate_ref(residual, pre, dtype)
