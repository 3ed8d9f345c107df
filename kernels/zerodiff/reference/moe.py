"""Reference MoE (routing and routed experts), token by token, sharing no dispatch code with the op.

Contract (the same as :mod:`zerodiff.ops.moe`):

* routing: FP32 scores (softmax / sigmoid / sqrt(softplus)), selection = the k largest of
  ``scores + bias`` with ties to the larger expert id, slot order = expert id descending; weights =
  unbiased scores at the selected ids, renormalised by their slot-order FP32 sum, times ``routed_scale``.
* experts, for each token t independently: ``xq = quant_act(x[t])``; for each slot j with ``e = ids[t, j]``
  (``-1`` skipped): ``h = fp8_gemm(xq, w13[e])`` (BF16), ``a = silu_mul_quant_fp8(h)``,
  ``y = fp8_gemm(a, w2[e])`` (BF16); ``acc = acc + w[t, j] * fp32(y)`` in slot order from +0 (FP32).

The GEMM is :func:`zerodiff.reference.fp8_gemm.fp8_gemm_ref` (float64 block partials); the activation is
``act`` (default: :func:`zerodiff.reference.silu_mul_quant.silu_mul_quant_fp8_ref`). The routing scores here
use float64 math rounded to FP32, so they match the op within a few ulps, not bitwise.
"""

from __future__ import annotations

import torch

from .fp8_gemm import fp8_gemm_ref
from .fp8_quant import quant_per_token_group_ref
from ..errors import InputError


def route_ref(logits, k, *, scoring="softmax", bias=None, renormalize=True, routed_scale=1.0):
    from .topk import deterministic_topk_ref

    x = logits.to(torch.float64)
    if scoring == "softmax":
        s = torch.softmax(x, dim=-1)
    elif scoring == "sigmoid":
        s = torch.sigmoid(x)
    elif scoring == "sqrtsoftplus":
        s = torch.sqrt(torch.nn.functional.softplus(x))
    else:
        raise InputError(f"scoring={scoring!r}")
    s = s.to(torch.float32)
    sel = s + bias[None, :] if bias is not None else s
    ids = deterministic_topk_ref(sel, k)
    w = s.gather(1, ids.long().clamp(min=0))
    w = torch.where(ids >= 0, w, torch.zeros_like(w))
    if renormalize:
        denom = w[:, 0]
        for j in range(1, k):
            denom = denom + w[:, j]
        w = w / denom[:, None]
    if routed_scale != 1.0:
        w = w * torch.tensor(routed_scale, dtype=torch.float32)
    return w, ids.to(torch.int32)


def moe_experts_ref(x, weights, ids, w13_q, w13_s, w2_q, w2_s, *, clamp_limit=None, ue8m0=False, act=None):
    """Routed experts token by token -> fp32 [T, H] (see module contract)."""
    if act is None:
        from .silu_mul_quant import silu_mul_quant_fp8_ref

        def act(h):
            return silu_mul_quant_fp8_ref(h, 128, clamp_limit, ue8m0)

    T, H = x.shape
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    xq, xs = quant_per_token_group_ref(x, 128, ue8m0)
    for t in range(T):
        acc = torch.zeros((1, H), dtype=torch.float32, device=x.device)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = fp8_gemm_ref(xq[t : t + 1], xs[t : t + 1], w13_q[e], w13_s[e])
            q, s = act(h)
            y = fp8_gemm_ref(q, s, w2_q[e], w2_s[e])
            acc = acc + weights[t, j] * y.to(torch.float32)
        out[t] = acc[0]
    return out
