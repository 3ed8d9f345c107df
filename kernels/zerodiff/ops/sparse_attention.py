"""Sparse MLA attention over a gathered BF16 workspace, and the one read path prefill/decode/training share.

Two entry points:

* ``sparse_attention(q, kv, indices, sm_scale, *, d_v=512, attn_sink=None, backend=None) -> (out, lse)``
  ``q`` bf16 [Q, H, d_qk]; ``kv`` bf16 [S, d_qk] or [S, 1, d_qk]; ``indices`` int32 [Q, K] or [Q, 1, K]
  (rows of ``kv``; < 0 or >= S skipped); ``attn_sink`` fp32 [H] or None. Returns ``out`` bf16 [Q, H, d_v]
  and ``lse`` fp32 [Q, H] (natural log of sum_j exp(sm_scale * q.k_j); +inf and out = 0 for a (query,
  head) without any valid index). The sink scales the output by 1 / (1 + exp(sink - lse)), lse unchanged.
  These are the semantics of FlashMLA's ``flash_mla_sparse_fwd`` (reference: ``zerodiff.reference.
  sparse_attention``).
* ``sparse_mla_attention(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink=None,
  d_nope=512, d_rope=64, seq_lens=None, rows_per_chunk=256, workspace="per_row", check=True, backend=None,
  gather_backend=None, split_variant=None) -> (out, lse)``: THE read path.
  Query row r attends to the request-local ``positions[r]`` (int32 [Q, W], e.g. the DSA Top-K output,
  -1 = empty) of request ``req_ids[r]``. ``backend=None`` runs ``default_read_backend``: "flashmla_fp8"
  (FlashMLA's FP8 decode kernel reading the cache in place under zerodiff's fixed schedule,
  ``zerodiff.ops.flashmla_fp8_decode``) wherever it can take the shape (CUDA, FlashMLA importable, 64/128
  heads, d 512 + 64, W a multiple of 64 x pieces), else the workspace path: ``kv_cache.gather_kv`` dequantises those positions into a
  per-row BF16 workspace [rows, W, d_nope + d_rope] (W from model limits: max top-k plus window), then
  ``sparse_attention`` runs over it with indices ``r * W + j`` in the given order. Prefill, chunked
  prefill, decode and training all call this; query rows are processed in fixed chunks of
  ``rows_per_chunk`` (a memory bound only: no row's result depends on the chunking).
  ``workspace="per_request"`` (prefill/training, needs ``seq_lens``): the same gather kernel dequantises
  each request's positions 0..len-1 once into a dense workspace and rows index it at their positions:
  the same values in the same order, so the same bits as "per_row" (tested), with far less traffic when
  many rows share a request; it synchronises with the host (data-dependent size), so not inside graphs.

* ``sparse_mla_attention_fp8(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink=None, d_nope=512,
  d_rope=64, seq_lens=None, check=True, out=None) -> (out, lse)``: the Triton fallback reading the FP8 cache
  directly (no workspace), bit for bit ``sparse_mla_attention(..., backend="triton")``.
* ``sparse_mla_attention_fp8_split(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink=None,
  d_nope=512, d_rope=64, seq_lens=None, check=True, out=None, variant=None) -> (out, lse)``, also reached as
  ``sparse_mla_attention(..., backend="triton_fp8_split")``: THE FAST consistent read path (split-index fused
  FP8 kernel; contract below). ``backend="triton_fp8"`` routes to ``sparse_mla_attention_fp8`` likewise.
* ``sparse_mla_attention(..., backend="flashmla_fp8")``: FlashMLA's FP8 sparse decode kernel (reads the cache in
  place) under zerodiff's batch-independent schedule, for prefill, decode and training alike
  (``zerodiff.ops.flashmla_fp8_decode``; CUDA only, 64/128 heads, index-list width a multiple of 64).
* ``split_config(d_nope=512, d_rope=64) -> dict``: the split kernel's fixed launch configuration for a model
  shape (BLOCK_H, BLOCK_N, CHUNK, num_warps, num_stages, MERGE_BH, merge_warps).
* ``split_variant_config(variant="default", d_nope=512, d_rope=64) -> dict``: the configuration of a named variant
  (``SPLIT_VARIANTS``; ``SPLIT_VARIANT`` = "default" is the one the backend runs; pass ``variant=`` to
  ``sparse_mla_attention_fp8_split`` or ``split_variant=`` to ``sparse_mla_attention`` to pick another).
  Every variant is batch-invariant on its own (H200, 2026-11-30); none gives the default's bits on the GPU (the
  "pf" pair, written as the default's statements in the default's order, differ after compilation: see
  ``SPLIT_SAME_BITS_AS_DEFAULT``), so switching the variant is a change made for rollout and training together.
* ``default_sm_scale(d_qk=576) -> float``: 1 / sqrt(d_qk).

Split-index fused FP8 kernel (``triton_fp8_split``), numerical contract. Query row r, head h, index list
``positions[r]`` (width K, request-local, -1 = skip, unresolvable = NaN poison as in ``kv_cache.gather_kv``):

* the list is cut into fixed chunks of CHUNK consecutive entries (``split_config``: 256 at the model shape;
  CHUNK depends on the model shape only, never on Q, the batch, the phase or the SM count), so chunk c always
  holds entries [c * CHUNK, (c + 1) * CHUNK) of that row;
* launch 1, program (r, head block of BLOCK_H, c): for sub-blocks of BLOCK_N entries in list order, the tokens
  are dequantised in registers to ``bf16(float(code) * scale)`` (the workspace path's values) with the rope
  bf16 copied; ``s = (k_nope . q_nope + k_rope . q_rope) * (sm_scale * log2 e)`` (fp32 MMA accumulation,
  computed transposed: entries x heads), online softmax in base 2 (running max m, ``p = exp2(s - m)`` rounded
  to bf16 for the P.V MMA, ``l`` sums the fp32 p, ``acc`` fp32, rescaled by ``exp2(m_old - m_new)``);
  writes (m, l, acc) of the chunk in fp32 (an empty chunk writes m = -inf, l = 0, acc = 0);
* launch 2, program (r, head block of MERGE_BH): ``M = max_c m_c``; ``L = sum_c l_c * exp2(m_c - M)`` and
  ``acc = sum_c acc_c * exp2(m_c - M)``, both summed in ascending chunk order; ``out = bf16(acc / L *
  1 / (1 + exp2(sink * log2 e - lse2)))``, ``lse = (M + log2 L) * ln 2``; no valid entry: out 0, lse +inf.
So a row's bits depend only on (q[r], the tokens its positions resolve to, their order, K, sm_scale, sink,
the fixed config): the same whether it is computed in prefill, chunked prefill, decode or training, alone or
in any batch, eager or graph-replayed. Rows are launched ``SPLIT_MAX_ROWS`` (512) at a time to bound the fp32
partial buffers (1 MiB per row at the model shape); rows are independent, so this never changes bits. The
index-list width K is part of the input (chunk count = ceil(K / CHUNK)): callers pass the model-limit width
(max top-k), never a batch-dependent one; an entry's chunk is fixed by its slot in the list. Bits differ from
the FlashMLA and the unsplit Triton paths (other reduction orders): a deployment uses one path for rollout
AND training.

Backends for ``sparse_attention``: ``"flashmla"`` (``flash_mla_sparse_fwd`` via ``zerodiff.backends``,
SM90/SM100), ``"triton"`` (our fallback), ``"reference"`` (float64 torch). ``None`` picks flashmla on a
CUDA device where it imports and the shape is one it supports (d_qk 576 or 512, d_v 512, H in 64/128,
K % 64 == 0), else triton on CUDA, else the reference on CPU. Rollout and training must run the same
backend on the same hardware: the choice depends only on the device, the library and the model shape.
``"flashmla"`` requested on a shape it cannot take raises instead of falling back.

Numerical contract (bitwise, both kernel backends): the result of query row r depends only on q[r], the
kv rows ``indices[r]`` point to and their ORDER (index order is part of the contract: reversing the
same set changes the bits), sm_scale and attn_sink; never on other rows, Q, the row's position in the
batch, where in ``kv`` the rows live, or prefill vs decode. Measured for FlashMLA on the H200
(DESIGN.md); a GPU test re-checks it. Triton fallback: one program per (query row, block of 16 heads);
the index list is consumed in fixed blocks of 32 in the given order with an online softmax in base 2:
``s = (q_nope . k_nope + q_rope . k_rope) * (sm_scale * log2 e)`` (fp32 accumulate), running max m,
``p = exp2(s - m)`` rounded to bf16 for the P.V product, ``l`` accumulates the fp32 p, ``acc`` in fp32;
``out = bf16(acc / l * 1 / (1 + exp2(sink * log2 e - lse2)))``, ``lse = lse2 * ln 2``. Agrees with the
float64 reference to bf16 rounding.
"""

from __future__ import annotations

import math

import torch

from .. import _triton
from .._triton import HAVE_TRITON, LAUNCH_OPTS, require_triton, triton_usable_for
from ..reference.sparse_attention import sparse_attention_ref
from . import kv_cache as _kv

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_H = 16
BLOCK_N = 32
V_SPLIT = 1
NUM_WARPS = 8  # fixed launch config (no spills on SM90 for the workspace path; checked with cuobjdump)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton import cache_row_offset, cast_bf16

    @triton.jit
    def _resolve_rows(kv_ptr, kv_s0, S, idx, cache_ptr, bt_ptr, bt_s0, req, num_blocks, max_blocks,
                      BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr, FROM_CACHE: tl.constexpr):
        """Row base pointers of one block of the index list, (base, ok, bad): the BF16 workspace row, or
        the FP8 cache token resolved through the request's block table exactly as kv_cache.gather_kv."""
        if FROM_CACHE:
            valid = idx >= 0  # request-local positions
            lb = tl.where(valid, idx // BLOCK_SIZE, 0)
            in_table = lb < max_blocks
            blk = tl.load(bt_ptr + req * bt_s0 + lb, mask=valid & in_table, other=-1).to(tl.int64)
            ok = valid & in_table & (blk >= 0) & (blk < num_blocks)
            bad = valid & (~ok)
            base = cache_ptr + cache_row_offset(tl.where(ok, blk * BLOCK_SIZE + idx % BLOCK_SIZE, 0), BPT)
        else:
            ok = (idx >= 0) & (idx < S)
            bad = idx < -2147483648  # never: the workspace path has no unresolvable rows
            base = kv_ptr + tl.where(ok, idx, 0) * kv_s0
        return base, ok, bad

    @triton.jit
    def _load_nope(base, ok, bad, c0, NC: tl.constexpr, D_V: tl.constexpr, FROM_CACHE: tl.constexpr,
                   EXACT: tl.constexpr):
        """Latent channels [c0, c0 + NC) of each row as bf16 [N, NC] (FP8: bf16(float(code) * scale))."""
        if FROM_CACHE:
            NG: tl.constexpr = NC // 128
            gi = tl.arange(0, NG)
            ci = tl.arange(0, 128)
            off = c0 + gi[None, :, None] * 128 + ci[None, None, :]
            code = tl.load(base[:, None, None] + off, mask=ok[:, None, None] & (off >= 0), other=0)
            sc = tl.load((base[:, None] + D_V).to(tl.pointer_type(tl.float32)) + c0 // 128 + gi[None, :],
                         mask=ok[:, None] & (gi[None, :] >= 0), other=0.0)
            k3 = cast_bf16(code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None], EXACT)
            k = tl.reshape(k3, [k3.shape[0], NC])
            nan = tl.full([1, 1], float("nan"), tl.float32).to(tl.bfloat16)
            k = tl.where(bad[:, None], nan, k)
        else:
            c = c0 + tl.arange(0, NC)
            k = tl.load(base[:, None] + c[None, :], mask=ok[:, None], other=0.0)
        return k

    @triton.jit
    def _load_rope(base, ok, bad, D_V: tl.constexpr, D_R: tl.constexpr, FROM_CACHE: tl.constexpr):
        dr = tl.arange(0, D_R)
        if FROM_CACHE:
            G: tl.constexpr = D_V // 128
            k = tl.load((base[:, None] + D_V + 4 * G).to(tl.pointer_type(tl.bfloat16)) + dr[None, :],
                        mask=ok[:, None], other=0.0)
            nan = tl.full([1, 1], float("nan"), tl.float32).to(tl.bfloat16)
            k = tl.where(bad[:, None], nan, k)
        else:
            k = tl.load(base[:, None] + D_V + dr[None, :], mask=ok[:, None], other=0.0)
        return k

    @triton.jit
    def _sparse_attn_kernel(
        q_ptr, q_s0, q_s1, kv_ptr, kv_s0, idx_ptr, idx_s0, sink_ptr, out_ptr, o_s0, o_s1, lse_ptr, lse_s0,
        H, K, S, scale_log2,
        cache_ptr, bt_ptr, bt_s0, req_ptr, num_blocks, max_blocks,
        D_V: tl.constexpr, D_R: tl.constexpr, HAS_SINK: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, V_SPLIT: tl.constexpr, EXACT: tl.constexpr,
        FROM_CACHE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr,
    ):
        # grid: (query row, head block, V part). Every program of a row recomputes the same scores and
        # softmax statistics; V part vp accumulates output channels [vp * DV_OUT, (vp + 1) * DV_OUT).
        r = tl.program_id(0).to(tl.int64)
        if FROM_CACHE:
            req = tl.load(req_ptr + r).to(tl.int64)
        else:
            req = r
        hb = tl.program_id(1)
        vp = tl.program_id(2)
        DV_OUT: tl.constexpr = D_V // V_SPLIT
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        dv = tl.arange(0, D_V)
        dr = tl.arange(0, D_R)
        qrow = q_ptr + r * q_s0 + h[:, None] * q_s1
        qn = tl.load(qrow + dv[None, :], mask=hm[:, None], other=0.0)
        qr = tl.load(qrow + D_V + dr[None, :], mask=hm[:, None], other=0.0)
        if EXACT:
            qn = qn.to(tl.float32)
            qr = qr.to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, DV_OUT], tl.float32)
        for n0 in range(0, K, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            idx = tl.load(idx_ptr + r * idx_s0 + n, mask=n < K, other=-1).to(tl.int64)
            base, ok, bad = _resolve_rows(kv_ptr, kv_s0, S, idx, cache_ptr, bt_ptr, bt_s0, req, num_blocks,
                                          max_blocks, BLOCK_SIZE, BPT, FROM_CACHE)
            valid = ok | bad
            kn = _load_nope(base, ok, bad, 0, D_V, D_V, FROM_CACHE, EXACT)
            kr = _load_rope(base, ok, bad, D_V, D_R, FROM_CACHE)
            if V_SPLIT == 1:
                kv_out = kn
            else:
                kv_out = _load_nope(base, ok, bad, vp * DV_OUT, DV_OUT, D_V, FROM_CACHE, EXACT)
            if EXACT:
                kn = kn.to(tl.float32)
                kr = kr.to(tl.float32)
                kv_out = kv_out.to(tl.float32)
            s = tl.dot(qn, tl.trans(kn)) + tl.dot(qr, tl.trans(kr))
            s = s * scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            pb = cast_bf16(p, EXACT)
            if EXACT:
                pb = pb.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(pb, kv_out)
            m = m_new
        lonely = l == 0.0
        l_safe = tl.where(lonely, 1.0, l)
        lse2 = tl.where(lonely, 0.0, m + tl.log2(l_safe))
        o = acc / l_safe[:, None]
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
            o = o * (1.0 / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2)))[:, None]
        o = tl.where(lonely[:, None], 0.0, o)
        lse = tl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
        do = vp * DV_OUT + tl.arange(0, DV_OUT)
        tl.store(out_ptr + r * o_s0 + h[:, None] * o_s1 + do[None, :], cast_bf16(o, EXACT), mask=hm[:, None])
        tl.store(lse_ptr + r * lse_s0 + h, lse, mask=hm & (vp == 0))


def _flashmla_supports(q, kv2, idx2, d_v) -> str | None:
    """None when flash_mla_sparse_fwd takes this shape, else the reason it does not."""
    Q, H, D = q.shape
    if D not in (576, 512):
        return f"d_qk={D} (FlashMLA takes 576 or 512)"
    if d_v != 512:
        return f"d_v={d_v} (FlashMLA takes 512)"
    if H not in (64, 128):
        return f"heads={H} (use 64 or 128 so SM90 and SM100 run the same kernel)"
    if idx2.shape[1] % 64:
        return f"top-k width {idx2.shape[1]} (must be a multiple of 64)"
    return None


def _pick(backend, q, kv2, idx2, d_v) -> str:
    if backend is None:
        if q.is_cuda:
            from .. import backends

            if backends.flash_mla() is not None and _flashmla_supports(q, kv2, idx2, d_v) is None:
                return "flashmla"
            if triton_usable_for(q.device):
                return "triton"
        return "triton" if triton_usable_for(q.device) else "reference"
    if backend == "flashmla":
        from .. import backends

        if not q.is_cuda:
            raise ValueError("zerodiff.sparse_attention: backend='flashmla' needs CUDA tensors")
        if backends.flash_mla() is None:
            raise ValueError(
                "zerodiff.sparse_attention: backend='flashmla' requested but FlashMLA is not importable "
                f"({backends.status()['flashmla']['detail']})"
            )
        why = _flashmla_supports(q, kv2, idx2, d_v)
        if why:
            raise ValueError(f"zerodiff.sparse_attention: backend='flashmla' cannot take {why}")
        return "flashmla"
    if backend == "triton":
        require_triton()
        if not triton_usable_for(q.device):
            raise ValueError(f"zerodiff.sparse_attention: backend='triton' cannot run on {q.device} here")
        return "triton"
    if backend == "reference":
        return "reference"
    raise ValueError(f"zerodiff.sparse_attention: unknown backend {backend!r}")


def sparse_attention(q, kv, indices, sm_scale: float, *, d_v: int = 512, attn_sink=None, out=None, backend=None):
    if q.dtype != torch.bfloat16 or q.dim() != 3:
        raise ValueError(f"zerodiff.sparse_attention: q must be bf16 [Q, H, d_qk], got {q.dtype} {tuple(q.shape)}")
    Q, H, D = q.shape
    if kv.dtype != torch.bfloat16 or kv.shape[-1] != D or not (kv.dim() == 2 or (kv.dim() == 3 and kv.shape[1] == 1)):
        raise ValueError(f"zerodiff.sparse_attention: kv must be bf16 [S, {D}] or [S, 1, {D}], got {kv.dtype} {tuple(kv.shape)}")
    kv2 = kv.reshape(kv.shape[0], D)
    if indices.dtype != torch.int32 or indices.shape[0] != Q or not (
        indices.dim() == 2 or (indices.dim() == 3 and indices.shape[1] == 1)
    ):
        raise ValueError(f"zerodiff.sparse_attention: indices must be int32 [{Q}, K] or [{Q}, 1, K], got {indices.dtype} {tuple(indices.shape)}")
    idx2 = indices.reshape(Q, indices.shape[-1])
    if not (0 < d_v <= D) or (d_v & (d_v - 1)):
        raise ValueError(f"zerodiff.sparse_attention: d_v={d_v} must be a power of two <= d_qk={D}")
    if attn_sink is not None and (attn_sink.dtype != torch.float32 or tuple(attn_sink.shape) != (H,)):
        raise ValueError(f"zerodiff.sparse_attention: attn_sink must be fp32 [{H}], got {attn_sink.dtype} {tuple(attn_sink.shape)}")
    which = _pick(backend, q, kv2, idx2, d_v)
    if which == "reference":
        o, lse = sparse_attention_ref(q, kv2, idx2, sm_scale, d_v, attn_sink)
        if out is not None:
            out.copy_(o)
            return out, lse
        return o, lse
    if which == "flashmla":
        from .. import backends

        fm = backends.flash_mla()
        o, _max_logits, lse = fm.flash_mla_sparse_fwd(
            q.contiguous(), kv2.reshape(-1, 1, D).contiguous(), idx2.reshape(Q, 1, -1).contiguous(),
            float(sm_scale), d_v, attn_sink, None, out,
        )
        return o, lse
    d_r = D - d_v
    if d_r <= 0 or (d_r & (d_r - 1)):
        raise ValueError(f"zerodiff.sparse_attention: the Triton fallback needs d_qk - d_v a power of two, got {d_r}")
    if out is None:
        out = torch.empty(Q, H, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(Q, H, dtype=torch.float32, device=q.device)
    if Q == 0:
        return out, lse
    q = q if q.stride(2) == 1 else q.contiguous()
    kv2 = kv2 if kv2.stride(1) == 1 else kv2.contiguous()
    idx2 = idx2 if idx2.stride(1) == 1 else idx2.contiguous()
    sink = attn_sink if attn_sink is not None else lse  # dummy pointer when HAS_SINK is false
    _sparse_attn_kernel[(Q, triton.cdiv(H, BLOCK_H), V_SPLIT)](
        q, q.stride(0), q.stride(1), kv2, kv2.stride(0), idx2, idx2.stride(0), sink,
        out, out.stride(0), out.stride(1), lse, lse.stride(0),
        H, idx2.shape[1], kv2.shape[0], float(sm_scale) * LOG2E,
        lse, lse, 0, lse, 0, 0,
        D_V=d_v, D_R=D - d_v, HAS_SINK=attn_sink is not None,
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, V_SPLIT=V_SPLIT, EXACT=_triton.EXACT_CASTS, FROM_CACHE=False, BLOCK_SIZE=1, BPT=1,
        num_warps=NUM_WARPS, **LAUNCH_OPTS,
    )
    return out, lse


def sparse_mla_attention_fp8(q, cache, block_table, req_ids, positions, sm_scale: float, *, attn_sink=None,
                             d_nope: int = 512, d_rope: int = 64, seq_lens=None, check: bool = True, out=None):
    """Triton only: the fallback kernel reading the FP8 paged cache directly (no BF16 workspace round trip).

    Same arguments and result as ``sparse_mla_attention(..., backend="triton")``, bit for bit: each
    index block is dequantised in registers with exactly the gather kernel's arithmetic
    (``bf16(float(code) * scale)``) and fed to the same online-softmax code in the same order.
    A deployment that picks this path must use it for prefill, decode AND training (its bits differ from
    the FlashMLA path's, as the two kernels' accumulation orders differ)."""
    require_triton()
    if not triton_usable_for(q.device):
        raise ValueError(f"zerodiff.sparse_attention: the fused FP8 Triton path cannot run on {q.device} here")
    G = _kv._check_dims(d_nope, d_rope)
    _kv._check_cache(cache, d_nope, d_rope)
    D = d_nope + d_rope
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != D:
        raise ValueError(f"zerodiff.sparse_attention: q must be bf16 [Q, H, {D}], got {q.dtype} {tuple(q.shape)}")
    Q, H, _ = q.shape
    if positions.dtype != torch.int32 or positions.dim() != 2 or positions.shape[0] != Q:
        raise ValueError(f"zerodiff.sparse_attention: positions must be int32 [{Q}, W], got {positions.dtype} {tuple(positions.shape)}")
    if req_ids.dtype != torch.int32 or tuple(req_ids.shape) != (Q,):
        raise ValueError(f"zerodiff.sparse_attention: req_ids must be int32 [{Q}], got {req_ids.dtype} {tuple(req_ids.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"zerodiff.sparse_attention: block_table must be int32 [B, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    if attn_sink is not None and (attn_sink.dtype != torch.float32 or tuple(attn_sink.shape) != (H,)):
        raise ValueError(f"zerodiff.sparse_attention: attn_sink must be fp32 [{H}], got {attn_sink.dtype} {tuple(attn_sink.shape)}")
    if check:
        _kv._check_gather_values(cache, block_table, req_ids, positions, seq_lens)
    del G
    if out is None:
        out = torch.empty(Q, H, d_nope, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(Q, H, dtype=torch.float32, device=q.device)
    if Q == 0:
        return out, lse
    q = q if q.stride(2) == 1 else q.contiguous()
    positions = positions if positions.stride(1) == 1 else positions.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    sink = attn_sink if attn_sink is not None else lse
    _sparse_attn_kernel[(Q, triton.cdiv(H, BLOCK_H), V_SPLIT)](
        q, q.stride(0), q.stride(1), lse, 0, positions, positions.stride(0), sink,
        out, out.stride(0), out.stride(1), lse, lse.stride(0),
        H, positions.shape[1], 0, float(sm_scale) * LOG2E,
        cache, block_table, block_table.stride(0), req_ids, cache.shape[0], block_table.shape[1],
        D_V=d_nope, D_R=d_rope, HAS_SINK=attn_sink is not None,
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, V_SPLIT=V_SPLIT, EXACT=_triton.EXACT_CASTS, FROM_CACHE=True,
        BLOCK_SIZE=cache.shape[1], BPT=cache.shape[2], num_warps=NUM_WARPS, **LAUNCH_OPTS,
    )
    return out, lse


#: the backend ``sparse_mla_attention(backend=None)`` runs. None: ``default_read_backend`` decides from the device,
#: the library and the model shape ("flashmla_fp8" where FlashMLA's FP8 decode kernel can take the shape, else the
#: workspace path with ``sparse_attention``'s default pick). Rollout and training read the same constant;
#: ``zerodiff check/bench --attn-backend`` sets it.
READ_BACKEND = None
READ_BACKENDS = ("flashmla", "triton", "reference", "triton_fp8", "triton_fp8_split", "flashmla_fp8")


def default_read_backend(q, positions, d_nope: int = 512, d_rope: int = 64):
    """What ``sparse_mla_attention(backend=None)`` runs when ``READ_BACKEND`` is None: "flashmla_fp8" (FlashMLA's FP8
    decode kernel under zerodiff's fixed schedule) where it can take the call, else None (the workspace path).
    Depends on the device, the library and the model shape only, so rollout and training pick the same."""
    from .flashmla_fp8_decode import supports

    return "flashmla_fp8" if supports(q, positions, d_nope, d_rope) is None else None


def sparse_mla_attention(q, cache, block_table, req_ids, positions, sm_scale: float, *, attn_sink=None,
                         d_nope: int = 512, d_rope: int = 64, seq_lens=None, rows_per_chunk: int = 256,
                         workspace: str = "per_row", check: bool = True, backend=None, gather_backend=None,
                         split_variant: str | None = None):
    Q = q.shape[0]
    if backend is None:
        if READ_BACKEND is not None:
            backend = READ_BACKEND
        elif gather_backend is None:  # a gather backend asks for the workspace path
            backend = default_read_backend(q, positions, d_nope, d_rope)
    if split_variant is not None and backend != "triton_fp8_split":
        raise ValueError(f"zerodiff.sparse_attention: split_variant={split_variant!r} applies to "
                         f"backend='triton_fp8_split' only, not backend={backend!r}")
    if positions.dim() != 2 or positions.shape[0] != Q:
        raise ValueError(f"zerodiff.sparse_attention: positions must be int32 [{Q}, W], got {tuple(positions.shape)}")
    if backend == "flashmla_fp8":
        if workspace not in ("per_row", "per_request") or gather_backend is not None:
            raise ValueError("zerodiff.sparse_attention: backend='flashmla_fp8' reads the FP8 cache in place; "
                             f"workspace={workspace!r} / gather_backend={gather_backend!r} cannot apply")
        from .flashmla_fp8_decode import sparse_mla_attention_flashmla_fp8

        return sparse_mla_attention_flashmla_fp8(q, cache, block_table, req_ids, positions, sm_scale,
                                                 attn_sink=attn_sink, d_nope=d_nope, d_rope=d_rope,
                                                 seq_lens=seq_lens, check=check)
    if backend in ("triton_fp8_split", "triton_fp8"):
        # fused paths: read the FP8 cache directly, no workspace (rows are independent: no row chunking needed)
        if workspace not in ("per_row", "per_request"):
            raise ValueError(f"zerodiff.sparse_attention: workspace={workspace!r} (use 'per_row' or 'per_request')")
        if gather_backend not in (None, "triton"):
            raise ValueError(f"zerodiff.sparse_attention: backend={backend!r} dequantises inside the attention kernel; "
                             f"gather_backend={gather_backend!r} cannot apply (leave it None)")
        if backend == "triton_fp8_split":
            return sparse_mla_attention_fp8_split(q, cache, block_table, req_ids, positions, sm_scale,
                                                  attn_sink=attn_sink, d_nope=d_nope, d_rope=d_rope,
                                                  seq_lens=seq_lens, check=check, variant=split_variant)
        return sparse_mla_attention_fp8(q, cache, block_table, req_ids, positions, sm_scale, attn_sink=attn_sink,
                                        d_nope=d_nope, d_rope=d_rope, seq_lens=seq_lens, check=check)
    if rows_per_chunk <= 0:
        raise ValueError(f"zerodiff.sparse_attention: rows_per_chunk={rows_per_chunk} must be positive")
    D = d_nope + d_rope
    if workspace == "per_request":
        return _per_request(q, cache, block_table, req_ids, positions, sm_scale, attn_sink, d_nope, d_rope,
                            seq_lens, check, backend, gather_backend)
    if workspace != "per_row":
        raise ValueError(f"zerodiff.sparse_attention: workspace={workspace!r} (use 'per_row' or 'per_request')")
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


def _per_request(q, cache, block_table, req_ids, positions, sm_scale, attn_sink, d_nope, d_rope, seq_lens,
                 check, backend, gather_backend):
    """Prefill layout: each request's first seq_lens[req] positions dequantised once into a dense workspace
    (the same gather kernel, positions 0..len-1), query rows index it at (request slot * Lmax + position).
    Same values, same index order as the per-row layout, so the same bits (tested); far less traffic when
    many query rows share a request. Host-synchronising (data-dependent workspace size): not for graphs."""
    if seq_lens is None:
        raise ValueError("zerodiff.sparse_attention: workspace='per_request' needs seq_lens")
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


# ------------------------------------------------------------------------------------------------------------
# Split-index fused FP8 kernel ("triton_fp8_split"): the fast consistent read path for every phase.
# ------------------------------------------------------------------------------------------------------------
#: fixed launch configurations per model shape (H rounded to the head block, d_nope, d_rope). Never chosen from
#: the batch, the number of rows, the top-k width or the SM count: CHUNK is the number of index-list entries one
#: program reduces, so the chunk boundaries of a row are the same for every batch and phase.
_SPLIT_CONFIGS = {
    # model shape (DeepSeek V3.2 / V4 latent): 64 or 128 heads, 512 nope + 64 rope, 656-byte tokens.
    (512, 64): dict(BLOCK_H=32, BLOCK_N=16, CHUNK=256, num_warps=8, num_stages=2, MERGE_BH=16, merge_warps=4),
}
#: query rows per launch pair (a memory bound for the partials only; rows are independent).
SPLIT_MAX_ROWS = 512
#: small shapes (CPU interpreter tests); small CHUNK so short index lists still cross chunk boundaries.
_SPLIT_SMALL = dict(BLOCK_H=16, BLOCK_N=16, CHUNK=32, num_warps=4, num_stages=1, MERGE_BH=16, merge_warps=4)


def split_config(d_nope: int = 512, d_rope: int = 64) -> dict:
    """The fixed launch configuration of the split kernel for a model shape (a copy; see ``_SPLIT_CONFIGS``)."""
    return dict(_SPLIT_CONFIGS.get((d_nope, d_rope), _SPLIT_SMALL))


#: Named variants of the split kernel (performance work of 2026-11-30, not yet measured on a GPU). Each is a fixed
#: function of the model shape (never of the batch), applied on top of ``split_config``:
#:
#: * ``"default"``: the configuration verified on the H200 (2026-11-30). Shipped.
#: * ``"pf"``: the SAME tiles and the same statements in the same order as "default" (the same bits in the
#:   interpreter, NOT on the H200: 5448 values differ, see ``SPLIT_SAME_BITS_AS_DEFAULT``), with the loads
#:   software-pipelined by hand: the
#:   index list and block table of sub-block i+2 and the raw FP8 bytes of sub-block i+1 are loaded while
#:   sub-block i is computed (removes the idx -> block table -> token dependent-load chain from each step);
#:   Triton's own pipeliner off (num_stages 1); 16-byte-aligned row offsets. Merge split over 4 V column blocks
#:   (MERGE_DV = D_V / 4: 4x the merge programs).
#: * ``"pf_s2"``: "pf" with num_stages 2.
#: * ``"pf_bn2x"``: "pf" with BLOCK_N doubled (half the rescales / steps; OTHER bits than "default").
#: * ``"pf_chunk2x"``: "pf" with CHUNK doubled (half the partials traffic; OTHER bits than "default").
#: * ``"pf_bh2x"``: "pf" with BLOCK_H doubled (64 heads per program: each token dequantised once, not twice).
#:   Same per-head operations, but another MMA N may select another MMA instruction: bits vs "default" not
#:   claimed (the GPU sweep test reports it); invariant on its own like every variant.
#: * ``"pf_bhhalf_w4"``: "pf" with BLOCK_H halved and 4 warps (16 heads at the model shape: 254 registers x 128
#:   threads, so two CTAs fit on an SM and hide each other's load latency; tokens dequantised 4x, from L2).
#:   Bits vs "default" not claimed, as for "pf_bh2x".
#:
#: ``SPLIT_VARIANT`` names the one the ``triton_fp8_split`` backend runs; changing it is a deployment decision made
#: for rollout AND training together (variants marked "OTHER bits" change every output).
SPLIT_VARIANTS = ("default", "pf", "pf_s2", "pf_bn2x", "pf_chunk2x", "pf_bh2x", "pf_bhhalf_w4")
#: the variant ``backend="triton_fp8_split"`` runs when none is named (the verified one).
SPLIT_VARIANT = "default"
#: variants whose bits equal "default" on the GPU. Empty: "pf" / "pf_s2" were written to be (same tiles, same
#: statements in the same order; bitwise equal in the interpreter), but on the H200 (2026-11-30, Triton 3.6) 5448
#: output values of a 65-row batch differ from "default": the compiled reductions and FMA contraction follow the
#: register layout and schedule, not the source order. Only a GPU run can show two Triton kernels give equal bits.
SPLIT_SAME_BITS_AS_DEFAULT: tuple = ()


def split_variant_config(variant: str = "default", d_nope: int = 512, d_rope: int = 64) -> dict:
    """The fixed launch configuration of a named split variant for a model shape (see ``SPLIT_VARIANTS``)."""
    if variant not in SPLIT_VARIANTS:
        raise ValueError(f"zerodiff.sparse_attention: split variant {variant!r} unknown (one of {SPLIT_VARIANTS})")
    cfg = split_config(d_nope, d_rope)
    if variant == "default":
        return cfg
    cfg.update(PREFETCH=True, num_stages=1, MERGE_DV=max(d_nope // 4, 32))
    if variant == "pf_s2":
        cfg["num_stages"] = 2
    elif variant == "pf_bn2x":
        cfg["BLOCK_N"] *= 2
    elif variant == "pf_chunk2x":
        cfg["CHUNK"] *= 2
    elif variant == "pf_bh2x":
        cfg["BLOCK_H"] *= 2
    elif variant == "pf_bhhalf_w4":
        cfg["BLOCK_H"] //= 2
        cfg["num_warps"] = 4
    return cfg


if HAVE_TRITON:

    @triton.jit
    def _split_dequant_tile(cache_ptr, bt_ptr, bt_s0, req, idx, num_blocks, max_blocks,
                            BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
                            EXACT: tl.constexpr):
        """Resolve a block of request-local positions through the block table and dequantise the tokens:
        (nope bf16 [N, D_V] = bf16(float(code) * scale), rope bf16 [N, D_R], valid [N]). Empty entries (-1)
        are invalid; unresolvable ones (hole, past the table) are valid-but-NaN so the output is poisoned."""
        G: tl.constexpr = D_V // 128
        valid = idx >= 0
        lb = tl.where(valid, idx // BLOCK_SIZE, 0)
        in_table = lb < max_blocks
        blk = tl.load(bt_ptr + req * bt_s0 + lb, mask=valid & in_table, other=-1).to(tl.int64)
        ok = valid & in_table & (blk >= 0) & (blk < num_blocks)
        bad = valid & (~ok)
        base = cache_ptr + tl.where(ok, blk * BLOCK_SIZE + idx % BLOCK_SIZE, 0) * BPT  # [N]
        gi = tl.arange(0, G)
        ci = tl.arange(0, 128)
        off = gi[None, :, None] * 128 + ci[None, None, :]  # [1, G, 128]
        code = tl.load(base[:, None, None] + off, mask=ok[:, None, None], other=0)
        sc = tl.load((base[:, None] + D_V).to(tl.pointer_type(tl.float32)) + gi[None, :], mask=ok[:, None], other=0.0)
        k3 = cast_bf16(code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None], EXACT)
        kn = tl.reshape(k3, [k3.shape[0], D_V])
        dr = tl.arange(0, D_R)
        kr = tl.load((base[:, None] + D_V + 4 * G).to(tl.pointer_type(tl.bfloat16)) + dr[None, :],
                     mask=ok[:, None], other=0.0)
        nan = tl.full([1, 1], float("nan"), tl.float32).to(tl.bfloat16)
        kn = tl.where(bad[:, None], nan, kn)
        kr = tl.where(bad[:, None], nan, kr)
        return kn, kr, valid

    @triton.jit
    def _split_partial_kernel(
        q_ptr, q_s0, q_s1, pos_ptr, pos_s0, req_ptr, cache_ptr, bt_ptr, bt_s0,
        pm_ptr, pl_ptr, pacc_ptr, H, K, NCH, num_blocks, max_blocks, scale_log2,
        D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, EXACT: tl.constexpr,
    ):
        # grid: (head block, chunk, query row). Program (r, hb, c) reduces entries [c*CHUNK, (c+1)*CHUNK) of
        # row r's index list, in order, in sub-blocks of BLOCK_N, for heads [hb*BLOCK_H, (hb+1)*BLOCK_H).
        # Computed transposed (KV entries / latent channels as the MMA's M dimension, heads as N): the
        # dequantised tile is the A operand straight from registers, q^T stays in shared memory as the B
        # operand, so no warp holds a replicated copy of q in registers (what made the untransposed form spill).
        hb = tl.program_id(0)  # fastest-varying: the head blocks of one (row, chunk) run side by side and
        c = tl.program_id(1)  # share its FP8 tokens through L2
        r = tl.program_id(2).to(tl.int64)
        req = tl.load(req_ptr + r).to(tl.int64)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        dv = tl.arange(0, D_V)
        dr = tl.arange(0, D_R)
        qrow = q_ptr + r * q_s0 + h[None, :] * q_s1
        qnt = tl.load(qrow + dv[:, None], mask=hm[None, :], other=0.0)  # [D_V, BLOCK_H]
        qrt = tl.load(qrow + D_V + dr[:, None], mask=hm[None, :], other=0.0)  # [D_R, BLOCK_H]
        if EXACT:
            qnt = qnt.to(tl.float32)
            qrt = qrt.to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([D_V, BLOCK_H], tl.float32)  # transposed accumulator
        n_lo = c * CHUNK
        for n0 in range(0, CHUNK, BLOCK_N):
            n = n_lo + n0 + tl.arange(0, BLOCK_N)
            idx = tl.load(pos_ptr + r * pos_s0 + n, mask=n < K, other=-1).to(tl.int64)
            kn, kr, valid = _split_dequant_tile(cache_ptr, bt_ptr, bt_s0, req, idx, num_blocks, max_blocks,
                                                BLOCK_SIZE, BPT, D_V, D_R, EXACT)
            if EXACT:
                kn = kn.to(tl.float32)
                kr = kr.to(tl.float32)
            s = tl.dot(kn, qnt) + tl.dot(kr, qrt)  # [BLOCK_N, BLOCK_H] = scores^T
            s = s * scale_log2
            s = tl.where(valid[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[None, :])
            l = l * alpha + tl.sum(p, axis=0)
            pb = cast_bf16(p, EXACT)
            if EXACT:
                pb = pb.to(tl.float32)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(kn), pb)  # [D_V, BLOCK_H]
            m = m_new
        prow = (r * NCH + c) * H + h  # [BLOCK_H] row of the [Q, NCH, H] partial arrays
        tl.store(pm_ptr + prow, m, mask=hm)
        tl.store(pl_ptr + prow, l, mask=hm)
        # partial accumulators as [Q, NCH, D_V, H]: heads contiguous, the transposed tile stored as it is
        tl.store(pacc_ptr + ((r * NCH + c) * D_V + dv[:, None]) * H + h[None, :], acc, mask=hm[None, :])

    @triton.jit
    def _split_merge_kernel(
        pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, o_s0, o_s1, lse_ptr, lse_s0, H, NCH,
        D_V: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr,
    ):
        # grid: (query row, head block). Combines the row's chunk partials in ascending chunk order.
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        dv = tl.arange(0, D_V)
        mx = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for c in range(0, NCH):
            mx = tl.maximum(mx, tl.load(pm_ptr + (r * NCH + c) * H + h, mask=hm, other=float("-inf")))
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_V], tl.float32)
        for c in range(0, NCH):
            prow = (r * NCH + c) * H + h
            mc = tl.load(pm_ptr + prow, mask=hm, other=float("-inf"))
            w = tl.exp2(mc - mx_safe)  # 0 for an empty chunk (mc = -inf)
            l = l + tl.load(pl_ptr + prow, mask=hm, other=0.0) * w
            at = tl.load(pacc_ptr + ((r * NCH + c) * D_V + dv[:, None]) * H + h[None, :], mask=hm[None, :], other=0.0)
            acc = acc + tl.trans(at) * w[:, None]
        lonely = l == 0.0
        l_safe = tl.where(lonely, 1.0, l)
        lse2 = tl.where(lonely, 0.0, mx_safe + tl.log2(l_safe))
        o = acc / l_safe[:, None]
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
            o = o * (1.0 / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2)))[:, None]
        o = tl.where(lonely[:, None], 0.0, o)
        lse = tl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
        tl.store(out_ptr + r * o_s0 + h[:, None] * o_s1 + dv[None, :], cast_bf16(o, EXACT), mask=hm[:, None])
        tl.store(lse_ptr + r * lse_s0 + h, lse, mask=hm)


if HAVE_TRITON:

    @triton.jit
    def _split_pf_resolve(pos_ptr, pos_s0, r, n, n_end, K, bt_ptr, bt_s0, req, num_blocks, max_blocks,
                          BLOCK_SIZE: tl.constexpr):
        """Entries n (< n_end, < K) of row r's list -> int32 cache slot, -1 for an empty entry, -2 for an
        unresolvable one (hole, past the table): ``_split_dequant_tile``'s resolution, integer logic only, packed
        into one int32 per entry so the pipelined kernel carries one small tensor between steps."""
        idx = tl.load(pos_ptr + r * pos_s0 + n, mask=(n < K) & (n < n_end), other=-1)
        valid = idx >= 0
        lb = tl.where(valid, idx // BLOCK_SIZE, 0)
        in_table = lb < max_blocks
        blk = tl.load(bt_ptr + req * bt_s0 + lb, mask=valid & in_table, other=-1)
        ok = valid & in_table & (blk >= 0) & (blk < num_blocks)
        slot = blk * BLOCK_SIZE + idx % BLOCK_SIZE  # < 2^31: the cache holds fewer tokens than that
        return tl.where(ok, slot, tl.where(valid, -2, -1))

    @triton.jit
    def _split_pf_raw(cache_ptr, slot, D_V: tl.constexpr, D_R: tl.constexpr, BPT: tl.constexpr,
                      AL_C: tl.constexpr, AL_S: tl.constexpr, AL_R: tl.constexpr):
        """The raw bytes of resolved tokens: e4m3 codes uint8 [N, G, 128], fp32 scales [N, G], bf16 rope [N, D_R].
        AL_C / AL_S / AL_R: the byte alignment of each field's start (cache base 16-aligned, checked by the
        caller), stated so the loads vectorise (16-byte code loads at the model shape instead of byte loads)."""
        G: tl.constexpr = D_V // 128
        ok = slot >= 0
        base = cache_ptr + cache_row_offset(tl.where(ok, slot, 0).to(tl.int64), BPT)
        gi = tl.arange(0, G)
        ci = tl.arange(0, 128)
        off = gi[None, :, None] * 128 + ci[None, None, :]
        cptr = base[:, None, None] + off
        cptr = tl.max_contiguous(tl.multiple_of(cptr, [1, 1, AL_C]), [1, 1, AL_C])
        code = tl.load(cptr, mask=ok[:, None, None], other=0)
        sptr = (base[:, None] + D_V).to(tl.pointer_type(tl.float32)) + gi[None, :]
        sptr = tl.max_contiguous(tl.multiple_of(sptr, [1, AL_S]), [1, AL_S // 4])
        sc = tl.load(sptr, mask=ok[:, None], other=0.0)
        dr = tl.arange(0, D_R)
        rptr = (base[:, None] + D_V + 4 * G).to(tl.pointer_type(tl.bfloat16)) + dr[None, :]
        rptr = tl.max_contiguous(tl.multiple_of(rptr, [1, AL_R]), [1, AL_R // 2])
        kr = tl.load(rptr, mask=ok[:, None], other=0.0)
        return code, sc, kr

    @triton.jit
    def _split_partial_pf_kernel(
        q_ptr, q_s0, q_s1, pos_ptr, pos_s0, req_ptr, cache_ptr, bt_ptr, bt_s0,
        pm_ptr, pl_ptr, pacc_ptr, H, K, NCH, num_blocks, max_blocks, scale_log2,
        D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, EXACT: tl.constexpr,
        AL_C: tl.constexpr, AL_S: tl.constexpr, AL_R: tl.constexpr,
    ):
        # The arithmetic of _split_partial_kernel, statement for statement and in the same order (hence the same
        # bits for the same tiles); only the loads are scheduled differently: a two-deep software pipeline in
        # registers. Step i computes sub-block i from raw bytes loaded during step i-1, issues the raw loads of
        # sub-block i+1 (addresses resolved during step i-1) and resolves sub-block i+2 (index + block table).
        hb = tl.program_id(0)
        c = tl.program_id(1)
        r = tl.program_id(2).to(tl.int64)
        req = tl.load(req_ptr + r).to(tl.int64)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        dv = tl.arange(0, D_V)
        dr = tl.arange(0, D_R)
        qrow = q_ptr + r * q_s0 + h[None, :] * q_s1
        qnt = tl.load(qrow + dv[:, None], mask=hm[None, :], other=0.0)  # [D_V, BLOCK_H]
        qrt = tl.load(qrow + D_V + dr[:, None], mask=hm[None, :], other=0.0)  # [D_R, BLOCK_H]
        if EXACT:
            qnt = qnt.to(tl.float32)
            qrt = qrt.to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([D_V, BLOCK_H], tl.float32)
        n_lo = c * CHUNK
        n_end = n_lo + CHUNK
        ar = tl.arange(0, BLOCK_N)
        # prologue: sub-block 0 resolved and loaded, sub-block 1 resolved
        slot0 = _split_pf_resolve(pos_ptr, pos_s0, r, n_lo + ar, n_end, K, bt_ptr, bt_s0, req, num_blocks,
                                  max_blocks, BLOCK_SIZE)
        code, sc, kr_raw = _split_pf_raw(cache_ptr, slot0, D_V, D_R, BPT, AL_C, AL_S, AL_R)
        slot = slot0
        slot1 = _split_pf_resolve(pos_ptr, pos_s0, r, n_lo + BLOCK_N + ar, n_end, K, bt_ptr, bt_s0, req,
                                  num_blocks, max_blocks, BLOCK_SIZE)
        for n0 in range(0, CHUNK, BLOCK_N):
            # issue the next loads first (their results are consumed one / two steps later)
            code_n, sc_n, kr_n = _split_pf_raw(cache_ptr, slot1, D_V, D_R, BPT, AL_C, AL_S, AL_R)
            slot2 = _split_pf_resolve(pos_ptr, pos_s0, r, n_lo + n0 + 2 * BLOCK_N + ar, n_end, K, bt_ptr, bt_s0,
                                      req, num_blocks, max_blocks, BLOCK_SIZE)
            bad = slot == -2
            valid = slot != -1
            # sub-block n0: dequantise exactly as _split_dequant_tile, then the default kernel's step
            k3 = cast_bf16(code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None], EXACT)
            kn = tl.reshape(k3, [k3.shape[0], D_V])
            nan = tl.full([1, 1], float("nan"), tl.float32).to(tl.bfloat16)
            kn = tl.where(bad[:, None], nan, kn)
            kr = tl.where(bad[:, None], nan, kr_raw)
            if EXACT:
                kn = kn.to(tl.float32)
                kr = kr.to(tl.float32)
            s = tl.dot(kn, qnt) + tl.dot(kr, qrt)  # [BLOCK_N, BLOCK_H] = scores^T
            s = s * scale_log2
            s = tl.where(valid[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[None, :])
            l = l * alpha + tl.sum(p, axis=0)
            pb = cast_bf16(p, EXACT)
            if EXACT:
                pb = pb.to(tl.float32)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(kn), pb)  # [D_V, BLOCK_H]
            m = m_new
            # rotate the pipeline
            code = code_n
            sc = sc_n
            kr_raw = kr_n
            slot = slot1
            slot1 = slot2
        prow = (r * NCH + c) * H + h
        tl.store(pm_ptr + prow, m, mask=hm)
        tl.store(pl_ptr + prow, l, mask=hm)
        tl.store(pacc_ptr + ((r * NCH + c) * D_V + dv[:, None]) * H + h[None, :], acc, mask=hm[None, :])

    @triton.jit
    def _split_merge_v_kernel(
        pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, o_s0, o_s1, lse_ptr, lse_s0, H, NCH,
        D_V: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, MERGE_DV: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        # _split_merge_kernel with the output columns split over a third grid axis: program (r, head block, vb)
        # writes columns [vb * MERGE_DV, (vb + 1) * MERGE_DV). Every output element and l see exactly the default
        # merge's operations in the same (ascending chunk) order, so the bits are the default merge's.
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        vb = tl.program_id(2)
        hm = h < H
        dv = vb * MERGE_DV + tl.arange(0, MERGE_DV)
        mx = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for c in range(0, NCH):
            mx = tl.maximum(mx, tl.load(pm_ptr + (r * NCH + c) * H + h, mask=hm, other=float("-inf")))
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, MERGE_DV], tl.float32)
        for c in range(0, NCH):
            prow = (r * NCH + c) * H + h
            mc = tl.load(pm_ptr + prow, mask=hm, other=float("-inf"))
            w = tl.exp2(mc - mx_safe)
            l = l + tl.load(pl_ptr + prow, mask=hm, other=0.0) * w
            at = tl.load(pacc_ptr + ((r * NCH + c) * D_V + dv[:, None]) * H + h[None, :], mask=hm[None, :], other=0.0)
            acc = acc + tl.trans(at) * w[:, None]
        lonely = l == 0.0
        l_safe = tl.where(lonely, 1.0, l)
        lse2 = tl.where(lonely, 0.0, mx_safe + tl.log2(l_safe))
        o = acc / l_safe[:, None]
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
            o = o * (1.0 / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2)))[:, None]
        o = tl.where(lonely[:, None], 0.0, o)
        lse = tl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
        tl.store(out_ptr + r * o_s0 + h[:, None] * o_s1 + dv[None, :], cast_bf16(o, EXACT), mask=hm[:, None])
        tl.store(lse_ptr + r * lse_s0 + h, lse, mask=hm & (vb == 0))


def sparse_mla_attention_fp8_split(q, cache, block_table, req_ids, positions, sm_scale: float, *, attn_sink=None,
                                   d_nope: int = 512, d_rope: int = 64, seq_lens=None, check: bool = True,
                                   out=None, variant: str | None = None, _config=None):
    """The split-index fused FP8 read path (``backend="triton_fp8_split"``); see the module docstring.

    ``variant`` names a fixed configuration from ``SPLIT_VARIANTS`` (None: the module's ``SPLIT_VARIANT``,
    "default"). ``_config`` (private) overrides the launch configuration entirely; only the benchmark's
    exploration and the negative-control tests use it. Any other tile config gives different bits."""
    require_triton()
    if not triton_usable_for(q.device):
        raise ValueError(f"zerodiff.sparse_attention[triton_fp8_split]: cannot run on {q.device} here "
                         "(CPU tensors need TRITON_INTERPRET=1; CUDA tensors need it unset)")
    _kv.check_fp8_read_args(q, cache, block_table, req_ids, positions, attn_sink, d_nope, d_rope, "triton_fp8_split")
    Q, H, _ = q.shape
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (Q, H, d_nope) or out.stride(2) != 1):
        raise ValueError(f"zerodiff.sparse_attention[triton_fp8_split]: out must be bf16 [{Q}, {H}, {d_nope}] "
                         f"with unit last stride, got {out.dtype} {tuple(out.shape)}")
    if check:
        _kv._check_gather_values(cache, block_table, req_ids, positions, seq_lens)
    if _config is not None:
        cfg = dict(_config)
    else:
        cfg = split_variant_config(SPLIT_VARIANT if variant is None else variant, d_nope, d_rope)
    chunk, bn = int(cfg["CHUNK"]), int(cfg["BLOCK_N"])
    if chunk <= 0 or bn <= 0 or chunk % bn:
        raise ValueError(f"zerodiff.sparse_attention[triton_fp8_split]: CHUNK={chunk} must be a positive multiple of BLOCK_N={bn}")
    mdv = int(cfg.get("MERGE_DV", d_nope))
    if mdv <= 0 or d_nope % mdv or (mdv & (mdv - 1)):
        raise ValueError(f"zerodiff.sparse_attention[triton_fp8_split]: MERGE_DV={mdv} must be a power of two dividing d_nope={d_nope}")
    if out is None:
        out = torch.empty(Q, H, d_nope, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(Q, H, dtype=torch.float32, device=q.device)
    if Q == 0:
        return out, lse
    q = q if q.stride(2) == 1 else q.contiguous()
    positions = positions if positions.stride(1) == 1 else positions.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    req_ids = req_ids.contiguous()
    # rows are independent, so launching SPLIT_MAX_ROWS rows at a time only bounds the fp32 partial buffers
    # (Q x chunks x H x d_nope x 4 B: 1 MiB per row at the model shape); it never changes a row's bits.
    for r0 in range(0, Q, SPLIT_MAX_ROWS):
        r1 = min(Q, r0 + SPLIT_MAX_ROWS)
        parts = _split_partials(q[r0:r1], cache, block_table, req_ids[r0:r1], positions[r0:r1], sm_scale,
                                d_nope, d_rope, cfg)
        _split_merge(parts, attn_sink, out[r0:r1], lse[r0:r1], cfg)
    return out, lse


def _split_partials(q, cache, block_table, req_ids, positions, sm_scale, d_nope, d_rope, cfg):
    """Launch 1 of 2: per (row, head block, chunk) partials (m, l, acc) in fp32. Internal (the benchmark times it)."""
    Q, H, _ = q.shape
    K = positions.shape[1]
    chunk = int(cfg["CHUNK"])
    nch = max(triton.cdiv(K, chunk), 1)  # from the index-list width (a model limit), never from the batch
    pm = torch.empty(Q, nch, H, dtype=torch.float32, device=q.device)
    pl = torch.empty(Q, nch, H, dtype=torch.float32, device=q.device)
    pacc = torch.empty(Q, nch, d_nope, H, dtype=torch.float32, device=q.device)
    extra = {}
    kernel = _split_partial_kernel
    if cfg.get("PREFETCH", False):
        kernel = _split_partial_pf_kernel
        extra = _pf_alignments(cache, d_nope)
    kernel[(triton.cdiv(H, cfg["BLOCK_H"]), nch, Q)](
        q, q.stride(0), q.stride(1), positions, positions.stride(0), req_ids, cache, block_table,
        block_table.stride(0), pm, pl, pacc, H, K, nch, cache.shape[0], block_table.shape[1],
        float(sm_scale) * LOG2E,
        D_V=d_nope, D_R=d_rope, BLOCK_SIZE=cache.shape[1], BPT=cache.shape[2],
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], CHUNK=chunk, EXACT=_triton.EXACT_CASTS,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra, **LAUNCH_OPTS,
    )
    return pm, pl, pacc


def _pow2_align(n: int, cap: int = 16) -> int:
    a = 1
    while a < cap and n % (2 * a) == 0:
        a *= 2
    return a


def _pf_alignments(cache, d_nope):
    """Byte alignment of the code / scale / rope fields of every cache token (constexprs of the pipelined kernel).
    Fails closed when the cache base itself is not 16-byte aligned (the alignment hints would then be false)."""
    if cache.data_ptr() % 16:
        raise ValueError("zerodiff.sparse_attention[triton_fp8_split]: the pipelined split variants need a 16-byte "
                         f"aligned cache base (data_ptr % 16 = {cache.data_ptr() % 16}); use variant='default'")
    if cache.shape[0] * cache.shape[1] >= 2**31:
        raise ValueError(f"zerodiff.sparse_attention[triton_fp8_split]: the pipelined split variants address tokens "
                         f"with int32 slots; this cache holds {cache.shape[0] * cache.shape[1]} (>= 2^31)")
    bpt = cache.shape[2]
    a = _pow2_align(bpt)
    if a < 4:
        raise ValueError(f"zerodiff.sparse_attention[triton_fp8_split]: token size {bpt} B is not a multiple of 4")
    return dict(AL_C=a, AL_S=min(a, _pow2_align(d_nope)), AL_R=min(a, _pow2_align(d_nope + 4 * (d_nope // 128))))


def _split_merge(parts, attn_sink, out, lse, cfg):
    """Launch 2 of 2: combine a row's chunk partials in ascending chunk order, sink, bf16 out + lse."""
    pm, pl, pacc = parts
    Q, nch, H = pm.shape
    sink = attn_sink if attn_sink is not None else lse  # dummy pointer when HAS_SINK is false
    d_v = pacc.shape[2]
    mdv = int(cfg.get("MERGE_DV", d_v))
    if mdv < d_v:  # the column-split merge (same bits as the default merge; more programs)
        _split_merge_v_kernel[(Q, triton.cdiv(H, cfg["MERGE_BH"]), d_v // mdv)](
            pm, pl, pacc, sink, out, out.stride(0), out.stride(1), lse, lse.stride(0), H, nch,
            D_V=d_v, HAS_SINK=attn_sink is not None, BLOCK_H=cfg["MERGE_BH"], MERGE_DV=mdv,
            EXACT=_triton.EXACT_CASTS, num_warps=cfg["merge_warps"], **LAUNCH_OPTS,
        )
        return out, lse
    _split_merge_kernel[(Q, triton.cdiv(H, cfg["MERGE_BH"]))](
        pm, pl, pacc, sink, out, out.stride(0), out.stride(1), lse, lse.stride(0), H, nch,
        D_V=pacc.shape[2], HAS_SINK=attn_sink is not None, BLOCK_H=cfg["MERGE_BH"], EXACT=_triton.EXACT_CASTS,
        num_warps=cfg["merge_warps"], **LAUNCH_OPTS,
    )
    return out, lse


def default_sm_scale(d_qk: int = 576) -> float:
    return 1.0 / math.sqrt(d_qk)
