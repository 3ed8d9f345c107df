"""The workspace read path: ``kv_cache.gather_kv`` dequantises the selected positions into a BF16 workspace,
then ``sparse_attention`` runs over it. A shipped fallback: ``sparse_mla_attention`` takes it wherever the
FP8 decode path (``flashmla_fp8``) cannot take the shape (no CUDA, FlashMLA missing, other head counts or
latent dims); the model's CPU path and the DeepSeek-V4 integration call ``sparse_attention`` directly.

* ``sparse_attention(q, kv, indices, sm_scale, *, d_v=512, attn_sink=None, out=None, backend=None) -> (out, lse)``:
  ``q`` bf16 [Q, H, d_qk]; ``kv`` bf16 [S, d_qk] or [S, 1, d_qk]; ``indices`` int32 [Q, K] or [Q, 1, K] (rows of
  ``kv``; < 0 or >= S skipped); ``attn_sink`` fp32 [H] or None. Returns ``out`` bf16 [Q, H, d_v] and ``lse`` fp32
  [Q, H] (natural log of sum_j exp(sm_scale * q.k_j); +inf and out = 0 for a (query, head) without any valid
  index). The sink scales the output by 1 / (1 + exp(sink - lse)), lse unchanged: the semantics of FlashMLA's
  ``flash_mla_sparse_fwd`` (reference: ``zerodiff.reference.sparse_attention``).
  Kernels: ``"flashmla"`` (``flash_mla_sparse_fwd`` via ``zerodiff.backends``, SM90/SM100), ``"triton"``
  (``triton_fallback``), ``"reference"`` (float64 torch). ``None`` picks flashmla on a CUDA device where it
  imports and the shape is one it supports (d_qk 576 or 512, d_v 512, H 64 or 128, K % 64 == 0), else triton
  where Triton can run on the device, else the reference. The choice depends only on the device, the library
  and the model shape. ``"flashmla"`` requested on a shape it cannot take raises instead of falling back.
* ``read_per_row(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink, d_nope, d_rope, seq_lens,
  rows_per_chunk, check, backend, gather_backend) -> (out, lse)``: rows in fixed chunks of ``rows_per_chunk``
  (a memory bound only), each chunk's positions gathered into a per-row workspace [rows, W, d] and read with
  indices ``r * W + j`` in the given order.
* ``read_per_request(...)`` (same arguments, ``seq_lens`` required): each request's positions 0..len-1 gathered
  once into a dense workspace, rows index it at their positions: the same values in the same order, so the
  same bits as ``read_per_row``, with far less traffic when many rows share a request. Synchronises with the
  host (data-dependent size): not inside CUDA graphs.

Numerical contract (bitwise, both kernel backends): the result of query row r depends only on q[r], the kv rows
``indices[r]`` point to and their ORDER (reversing the same set changes the bits), sm_scale and attn_sink; never
on other rows, Q, the row's place in the batch, where in ``kv`` the rows live, or prefill vs decode. FlashMLA
and the Triton kernel differ from each other (other accumulation orders): rollout and training run one.
"""

from __future__ import annotations

import torch

from ..._triton import require_triton, triton_usable_for
from ...reference.sparse_attention import sparse_attention_ref
from .. import kv_cache as _kv
from .checks import FLASHMLA_HEADS, FLASHMLA_TOPK_BLOCK, MODEL_D_V, check_workspace_args, fail
from .triton_fallback import triton_attention

__all__ = ["KERNELS", "read_per_request", "read_per_row", "sparse_attention"]

#: the kernels ``sparse_attention`` runs
KERNELS = ("flashmla", "triton", "reference")
#: query/key widths ``flash_mla_sparse_fwd`` takes
_FLASHMLA_D_QK = (576, 512)


def _flashmla_supports(q, kv2, idx2, d_v) -> str | None:
    """None when flash_mla_sparse_fwd takes this shape, else the reason it does not."""
    Q, H, D = q.shape
    if D not in _FLASHMLA_D_QK:
        return f"d_qk={D} (FlashMLA takes 576 or 512)"
    if d_v != MODEL_D_V:
        return f"d_v={d_v} (FlashMLA takes {MODEL_D_V})"
    if H not in FLASHMLA_HEADS:
        return f"heads={H} (use 64 or 128 so SM90 and SM100 run the same kernel)"
    if idx2.shape[1] % FLASHMLA_TOPK_BLOCK:
        return f"top-k width {idx2.shape[1]} (must be a multiple of {FLASHMLA_TOPK_BLOCK})"
    return None


def _pick(backend, q, kv2, idx2, d_v) -> str:
    from ... import backends

    if backend is None:
        if q.is_cuda:
            if backends.flash_mla() is not None and _flashmla_supports(q, kv2, idx2, d_v) is None:
                return "flashmla"
            if triton_usable_for(q.device):
                return "triton"
        return "triton" if triton_usable_for(q.device) else "reference"
    if backend == "flashmla":
        if not q.is_cuda:
            raise fail(None, "backend='flashmla' needs CUDA tensors")
        if backends.flash_mla() is None:
            raise fail(None, "backend='flashmla' requested but FlashMLA is not importable "
                             f"({backends.status()['flashmla']['detail']})")
        why = _flashmla_supports(q, kv2, idx2, d_v)
        if why:
            raise fail(None, f"backend='flashmla' cannot take {why}")
        return "flashmla"
    if backend == "triton":
        require_triton()
        if not triton_usable_for(q.device):
            raise fail(None, f"backend='triton' cannot run on {q.device} here")
        return "triton"
    if backend == "reference":
        return "reference"
    raise fail(None, f"unknown backend {backend!r}")


def sparse_attention(q, kv, indices, sm_scale: float, *, d_v: int = 512, attn_sink=None, out=None, backend=None):
    """Sparse MLA attention over a BF16 workspace; see the module docstring."""
    kv2, idx2 = check_workspace_args(q, kv, indices, d_v, attn_sink)
    Q, H, D = q.shape
    which = _pick(backend, q, kv2, idx2, d_v)
    if which == "reference":
        o, lse = sparse_attention_ref(q, kv2, idx2, sm_scale, d_v, attn_sink)
        if out is not None:
            out.copy_(o)
            return out, lse
        return o, lse
    if which == "flashmla":
        from ... import backends

        fm = backends.flash_mla()
        o, _max_logits, lse = fm.flash_mla_sparse_fwd(
            q.contiguous(), kv2.reshape(-1, 1, D).contiguous(), idx2.reshape(Q, 1, -1).contiguous(),
            float(sm_scale), d_v, attn_sink, None, out,
        )
        return o, lse
    return triton_attention(q, kv2, idx2, sm_scale, d_v, attn_sink, out)


def read_per_row(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink, d_nope, d_rope, seq_lens,
                 rows_per_chunk, check, backend, gather_backend):
    """Per-row workspaces in fixed chunks of ``rows_per_chunk`` (> 0) query rows; see the module docstring."""
    Q = q.shape[0]
    D = d_nope + d_rope
    W = positions.shape[1]
    outs, lses = [], []
    for r0 in range(0, Q, rows_per_chunk):
        r1 = min(Q, r0 + rows_per_chunk)
        ws = _kv.gather_kv(cache, block_table, req_ids[r0:r1], positions[r0:r1], seq_lens=seq_lens,
                           d_nope=d_nope, d_rope=d_rope, check=check, backend=gather_backend)
        idx = _kv.workspace_indices(positions[r0:r1])
        o, l = sparse_attention(q[r0:r1], ws.view((r1 - r0) * W, D), idx, sm_scale,
                                d_v=d_nope, attn_sink=attn_sink, backend=backend)
        outs.append(o)
        lses.append(l)
    if len(outs) == 1:
        return outs[0], lses[0]
    if not outs:
        H = q.shape[1]
        return (torch.empty(0, H, d_nope, dtype=torch.bfloat16, device=q.device),
                torch.empty(0, H, dtype=torch.float32, device=q.device))
    return torch.cat(outs), torch.cat(lses)


def read_per_request(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink, d_nope, d_rope, seq_lens,
                     rows_per_chunk, check, backend, gather_backend):
    """Each request dequantised once into a dense workspace (request slot * Lmax + position); see the module
    docstring. ``rows_per_chunk`` is accepted for the same signature and unused (one gather per call)."""
    del rows_per_chunk
    if seq_lens is None:
        raise fail(None, "workspace='per_request' needs seq_lens")
    D = d_nope + d_rope
    if check:
        _kv._check_gather_values(cache, block_table, req_ids, positions, seq_lens)
    reqs = torch.unique(req_ids)
    lens = seq_lens.to(torch.int64)[reqs.long()]
    Lmax = max(int(lens.max()) if reqs.numel() else 1, 1)
    ar = torch.arange(Lmax, device=positions.device, dtype=torch.int64)[None, :]
    dense = torch.where(ar < lens[:, None], ar, torch.full_like(ar, -1)).to(torch.int32)
    ws = _kv.gather_kv(cache, block_table, reqs.to(torch.int32), dense, d_nope=d_nope, d_rope=d_rope,
                       check=False, backend=gather_backend)
    slot = torch.searchsorted(reqs, req_ids).to(torch.int64)[:, None]
    idx = torch.where(positions >= 0, slot * Lmax + positions.long(), torch.full_like(slot, -1)).to(torch.int32)
    return sparse_attention(q, ws.view(-1, D), idx, sm_scale, d_v=d_nope, attn_sink=attn_sink, backend=backend)
