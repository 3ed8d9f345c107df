"""Exact-structure pure-torch implementations of the model's ops, for CPU tensors.

:mod:`zerodiff.model.ops` dispatches CPU tensors here and CUDA tensors to the zerodiff op of the same contract;
each function has that op's signature. They are exact-structure
implementations (see :mod:`zerodiff.model.detmath`): elementwise IEEE basic ops, float64 transcendental
functions by polynomial, and pairwise-tree reductions whose tree depends only on the reduced length, so
every output row depends only on that row's inputs, on any device, whatever the batch. They are slow
(products are materialised, rows processed in chunks) and meant for the CPU config; the H200 config
needs the real kernels.

Contracts
---------
* ``bf16_gemm(x, w, out_dtype)``: x bf16 [M, K], w bf16 [N, K]; products in FP32 (exact for bf16*bf16),
  summed over K by the fixed pairwise tree in FP32, one rounding to ``out_dtype``.
* ``router_gemm(x, w)``: ``bf16_gemm`` with FP32 output.
* ``rms_norm(x, w, eps)``: ``ss = tree_sum(x*x)`` (FP32), ``r = fp32(1/sqrt(ss/H + eps))`` (float64
  Newton), ``y = bf16((x * r) * w)``.
* ``token_logprobs(logits, ids)``: float64: ``lp = (l[id] - max) - log(tree_sum(exp(l - max)))``, rounded
  once to FP32. Temperature 1; no top-k/top-p processing.
* ``sparse_attention(q [Q,H,D], kv [S,D], indices [Q,K], sm_scale, d_v)``: ``s = fp32(tree_sum(q*k)) *
  sm_scale`` (FP32), ``p = fp32(exp(s - max))``, ``den = tree_sum(p)`` over the K slots IN INDEX ORDER
  (tree over slot index), ``out = bf16(tree_sum(p * v) / den)``. Invalid indices contribute 0; a row with
  no valid index gives 0.
* ``indexer_scores(q [T,h,d] bf16, w [T,h] fp32, kq [T,W,d] e4m3, ks [T,W,1] fp32, lengths [T])``:
  ``k = fp32(code) * scale``; ``dot = tree_sum(q*k)``; ``s = tree_sum_h(w * relu(dot))`` FP32; columns
  ``>= lengths`` are ``-inf``. A column's score never depends on W or other rows.
* ``route(logits [T,E], k, bias, routed_scale)``: ``sc = fp32(sigmoid(logits))`` (float64 exp),
  ``ids = deterministic_topk(sc + bias, k)`` (expert ids descending), ``w = sc[ids]``, ``w = w / seq_sum(w)
  * routed_scale`` (FP32, left-to-right over the k slots).
"""

from __future__ import annotations

import weakref

import torch

from .detmath import det_exp, det_log, det_rsqrt, det_sigmoid, tree_sum
from ..errors import InputError

_MAX_ELEMS = 1 << 22


def _row_chunk(per_row: int) -> int:
    return max(1, _MAX_ELEMS // max(1, per_row))


def bf16_gemm(x, w, *, out_dtype=torch.bfloat16, backend=None):
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise InputError(f"zerodiff.model.exact_ops.bf16_gemm: need bf16 x [M, K], w [N, K]; got {x.dtype} "
                         f"{tuple(x.shape)}, {w.dtype} {tuple(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    wf = w.float()
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    c = _row_chunk(N * K)
    for s in range(0, M, c):
        xs = x[s: s + c].float()
        out[s: s + c] = tree_sum(xs[:, None, :] * wf[None, :, :]).to(out_dtype)
    return out


def router_gemm(x, w, *, backend=None):
    return bf16_gemm(x, w, out_dtype=torch.float32)


def rms_norm(x, weight, eps=1e-6, *, residual=None, backend=None):
    if residual is not None:
        x = (x.float() + residual.float()).to(torch.bfloat16)
    xf = x.float()
    ss = tree_sum(xf * xf)
    r = det_rsqrt(ss.double() / x.shape[-1] + eps).float()
    y = ((xf * r.unsqueeze(-1)) * weight.float()).to(torch.bfloat16)
    return (y, x) if residual is not None else y


def token_logprobs(logits, token_ids, *, temperature=1.0, backend=None):
    if temperature != 1.0:
        raise InputError("zerodiff.model.exact_ops.token_logprobs: only temperature 1.0 is part of the harness "
                         "contract")
    l64 = logits.double()
    m = l64.amax(-1, keepdim=True)
    s = tree_sum(det_exp(l64 - m))
    picked = l64.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    return ((picked - m.squeeze(1)) - det_log(s)).float()


def sparse_attention(q, kv, indices, sm_scale, d_v):
    Q, H, D = q.shape
    K = indices.shape[1]
    out = torch.empty(Q, H, d_v, dtype=torch.bfloat16, device=q.device)
    valid_all = (indices >= 0) & (indices < kv.shape[0])
    c = _row_chunk(H * K * D)
    for s in range(0, Q, c):
        idx = indices[s: s + c].long()
        valid = valid_all[s: s + c]
        kg = kv[idx.clamp(min=0, max=kv.shape[0] - 1)].float()  # [q, K, D]
        qf = q[s: s + c].float()
        sc = tree_sum(qf[:, :, None, :] * kg[:, None, :, :]) * sm_scale  # [q, H, K]
        sc = sc.masked_fill(~valid[:, None, :], float("-inf"))
        mx = sc.amax(-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        p = det_exp(sc.double() - mx.double()).float()  # [q, H, K]; invalid -> 0
        den = tree_sum(p)
        num = tree_sum((p[..., None] * kg[:, None, :, :d_v]).movedim(2, -1))  # [q, H, d_v]
        o = num / den.unsqueeze(-1)
        o = torch.where(den.unsqueeze(-1) > 0, o, torch.zeros_like(o))
        out[s: s + c] = o.to(torch.bfloat16)
    return out


def indexer_scores(q, w, kq, ks, lengths):
    T, h, d = q.shape
    Wd = kq.shape[1]
    out = torch.empty(T, Wd, dtype=torch.float32, device=q.device)
    c = _row_chunk(h * Wd * d)
    col = torch.arange(Wd, device=q.device)
    for s in range(0, T, c):
        k = kq[s: s + c].float() * ks[s: s + c]  # [t, W, d]
        dot = tree_sum(q[s: s + c].float()[:, :, None, :] * k[:, None, :, :])  # [t, h, W]
        sc = tree_sum((w[s: s + c, :, None] * torch.relu(dot)).movedim(1, -1))  # [t, W]
        sc = sc.masked_fill(col[None, :] >= lengths[s: s + c, None].long(), float("-inf"))
        out[s: s + c] = sc
    return out


def route(logits, k, *, scoring="sigmoid", bias=None, renormalize=True, routed_scale=1.0, topk_fn=None):
    if scoring != "sigmoid":
        raise InputError(f"zerodiff.model.exact_ops.route: only scoring='sigmoid' is implemented here, got {scoring!r}")
    if topk_fn is None:
        from zerodiff.ops.topk import deterministic_topk as topk_fn
    sc = det_sigmoid(logits).float()
    choice = sc + bias if bias is not None else sc
    ids = topk_fn(choice, k)
    w = sc.gather(1, ids.long())
    if renormalize:
        tot = w[:, 0]
        for j in range(1, k):
            tot = tot + w[:, j]
        w = w / tot.unsqueeze(1)
    return w * routed_scale, ids


# ---- CPU fast path of the block-FP8 GEMM (bit-identical to zerodiff.reference.fp8_gemm) --------------------
_W64_CACHE: dict = {}  # id(tensor) -> (weakref to that tensor, version, float64 codes)


def _codes64(wq: torch.Tensor) -> torch.Tensor:
    """float64 copy of an e4m3 code tensor, cached per tensor OBJECT (checked through a weak reference, so a
    new tensor at a recycled address or id never hits a stale entry) and version counter (weights are
    requantised in place, which bumps the version)."""
    hit = _W64_CACHE.get(id(wq))
    if hit is not None and hit[0]() is wq and hit[1] == wq._version:
        return hit[2]
    c = wq.to(torch.float64)
    if len(_W64_CACHE) > 256:
        for k in [k for k, v in _W64_CACHE.items() if v[0]() is None]:
            del _W64_CACHE[k]
    _W64_CACHE[id(wq)] = (weakref.ref(wq), wq._version, c)
    return c


def fp8_gemm_blocks(a_q, a_scale, w_q, w_scale, out_dtype=torch.bfloat16, row_expert=None):
    """The contract of ``reference/fp8_gemm.py`` (exact float64 128-block partials rounded once to FP32,
    ``acc = acc + partial * (a_scale * w_scale)`` in ascending K blocks, one final rounding), computed with
    float64 matmuls per 128-block (exact, so the BLAS order cannot matter). ``w_q`` [N, K] or, with ``row_expert`` int [M], stacked [E, N, K] (row m
    uses expert row_expert[m]; every expert's partial is exact, the row's own expert is selected)."""
    if row_expert is None:
        return _fp8_gemm_2d(a_q, a_scale, _codes64(w_q), w_scale, out_dtype)
    M = a_q.shape[0]
    E, N, _ = w_q.shape
    re = row_expert.long()
    w64_all = _codes64(w_q)
    out = torch.zeros(M, N, dtype=out_dtype, device=a_q.device)
    for e in torch.unique(re).tolist():
        if e < 0:
            continue
        rr = (re == e).nonzero(as_tuple=True)[0]
        out[rr] = _fp8_gemm_2d(a_q[rr], a_scale[rr], w64_all[e], w_scale[e], out_dtype)
    return out


def _fp8_gemm_2d(a_q, a_scale, w64, w_scale, out_dtype):
    M, K = a_q.shape
    N = w64.shape[0]
    Kb = (K + 127) // 128
    a64 = a_q.to(torch.float64)
    ws = w_scale.to(torch.float32).repeat_interleave(128, dim=0)[:N]  # [N, Kb]
    acc = torch.zeros(M, N, dtype=torch.float32, device=a_q.device)
    for kb in range(Kb):
        sl = slice(kb * 128, min(K, (kb + 1) * 128))
        part = (a64[:, sl] @ w64[:, sl].t()).to(torch.float32)  # exact in float64, one rounding
        acc = acc + part * (a_scale[:, kb: kb + 1].to(torch.float32) * ws[:, kb][None, :])
    return acc.to(out_dtype)
