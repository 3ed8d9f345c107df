"""Reference (float64) for sparse MLA attention over a gathered BF16 workspace.

Semantics (the same as FlashMLA's ``flash_mla_sparse_fwd`` with one KV head):

* ``q`` bf16 ``[Q, H, d_qk]``; ``kv`` bf16 ``[S, d_qk]`` (the workspace); ``indices`` int ``[Q, K]`` rows of
  ``kv``; an index < 0 or >= S is skipped. ``V`` is the first ``d_v`` channels of each kv row (MLA).
* ``P[q, h, j] = sm_scale * (q[q, h] . kv[indices[q, j]])``; ``lse = logsumexp_j P`` (natural log);
  ``out = sum_j softmax_j(P) * V[indices[q, j]]``.
* attention sink (``attn_sink`` fp32 ``[H]``): ``out *= 1 / (1 + exp(attn_sink[h] - lse))``; lse unchanged.
* a (query, head) with no valid index ("lonely"): ``out = 0``, ``lse = +inf``.

The reference computes in float64 and rounds once to bf16 (out) / fp32 (lse). The kernels agree with it
within rounding; their bitwise contract is invariance (see ``zerodiff.ops.sparse_attention``). For the FP8
paged cache, the reference of every read path (workspace, fused, split-index fused) is this function applied to
``kv_cache.gather_kv(..., backend="reference")`` with ``kv_cache.workspace_indices(positions)``: the fused
kernels dequantise to exactly the gathered bf16 values, so only the attention's rounding separates them.
"""

from __future__ import annotations

import torch


def sparse_attention_ref(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, return_fp64: bool = False):
    Q, H, D = q.shape
    kv2 = kv.reshape(kv.shape[0], -1)
    S = kv2.shape[0]
    idx = indices.reshape(Q, -1).long()
    valid = (idx >= 0) & (idx < S)
    g = kv2.to(torch.float64)[idx.clamp(0, max(S - 1, 0)).reshape(-1)].reshape(Q, idx.shape[1], D)
    g = torch.where(valid[..., None], g, torch.zeros((), dtype=torch.float64))
    P = torch.einsum("qhd,qkd->qhk", q.to(torch.float64), g) * float(sm_scale)
    P = P.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(P, dim=-1)  # [Q, H]
    lonely = lse == float("-inf")
    lse_safe = torch.where(lonely, torch.full_like(lse, float("inf")), lse)
    w = torch.exp(P - lse_safe[..., None])
    out = torch.einsum("qhk,qkd->qhd", w, g[..., :d_v])
    if attn_sink is not None:
        s = attn_sink.to(torch.float64)[None, :]
        out = out * (1.0 / (1.0 + torch.exp(s - lse_safe)))[..., None]
    out = torch.where(lonely[..., None], torch.zeros((), dtype=torch.float64), out)
    lse_out = torch.where(lonely, torch.full_like(lse, float("inf")), lse)
    if return_fp64:
        return out, lse_out
    return out.to(torch.bfloat16), lse_out.to(torch.float32)
