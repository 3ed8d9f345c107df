"""The Triton fallback kernel of the workspace path: sparse MLA attention over a BF16 workspace.

``sparse_attention(..., backend="triton")`` runs :func:`triton_attention`; it is what CPU (under
``TRITON_INTERPRET=1``) and CUDA devices without FlashMLA run. The same kernel reads the paged FP8 cache in
registers when ``FROM_CACHE`` is set (positions resolved with ``slots.resolve_slots``); the read path built on
that mode did not ship (``zerodiff.experimental.attention_variants.sparse_mla_attention_fp8``).

* ``triton_attention(q, kv, indices, sm_scale, d_v, attn_sink, out) -> (out, lse)``: ``q`` bf16 [Q, H, d_qk],
  ``kv`` bf16 [S, d_qk], ``indices`` int32 [Q, K] (rows of ``kv``; < 0 or >= S skipped), ``attn_sink`` fp32 [H]
  or None, ``out`` bf16 [Q, H, d_v] or None; arguments already checked by ``checks.check_workspace_args``.
  ``d_qk - d_v`` must be a power of two (``ValueError`` otherwise).

Numerical contract (bitwise): one program per (query row, block of ``BLOCK_H`` heads); the index list is
consumed in fixed blocks of ``BLOCK_N`` in the given order with an online softmax in base 2:
``s = (q_nope . k_nope + q_rope . k_rope) * (sm_scale * log2 e)`` (fp32 accumulate), running max m,
``p = exp2(s - m)`` rounded to bf16 for the P.V product, ``l`` accumulates the fp32 p, ``acc`` in fp32;
``out = bf16(acc / l * 1 / (1 + exp2(sink * log2 e - lse2)))``, ``lse = lse2 * ln 2``; a row without a valid
index: out 0, lse +inf. A row's bits depend only on q[r], the rows its indices point to and their order,
sm_scale and the sink. Agrees with the float64 reference to bf16 rounding.
"""

from __future__ import annotations

import torch

from ... import _triton
from ..._triton import HAVE_TRITON, LAUNCH_OPTS
from .checks import LOG2E, fail, read_outputs

__all__ = ["BLOCK_H", "BLOCK_N", "NUM_WARPS", "V_SPLIT", "triton_attention"]

#: fixed launch configuration (no spills on SM90 for the workspace path; checked with cuobjdump)
BLOCK_H = 16
BLOCK_N = 32
V_SPLIT = 1
NUM_WARPS = 8

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..._triton import cache_row_offset, cast_bf16

    from ..block_slots import resolve_slots

    @triton.jit
    def _resolve_rows(kv_ptr, kv_s0, S, idx, cache_ptr, bt_ptr, bt_s0, req, num_blocks, max_blocks,
                      BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr, FROM_CACHE: tl.constexpr):
        """Row base pointers of one block of the index list, (base, ok, bad): the BF16 workspace row, or
        the FP8 cache token of a request-local position (``slots.resolve_slots``)."""
        if FROM_CACHE:
            slot, ok, valid = resolve_slots(bt_ptr, bt_s0, req, idx, num_blocks, max_blocks, BLOCK_SIZE)
            bad = valid & (~ok)
            base = cache_ptr + cache_row_offset(tl.where(ok, slot, 0), BPT)
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
    def finish_softmax_rows(acc, l, m, sink_ptr, h, hm, HAS_SINK: tl.constexpr):
        """(o fp32 [BLOCK_H, NC], lse fp32 [BLOCK_H]) of finished base-2 online-softmax rows (running max ``m``,
        sum ``l``, accumulator ``acc`` [BLOCK_H, NC]): ``lse2 = m + log2 l``, ``o = acc / l``, times
        ``1 / (1 + exp2(sink[h] * log2 e - lse2))`` when HAS_SINK, ``lse = lse2 * ln 2``; a row with l == 0 (no
        valid entry) gives o = 0, lse = +inf whatever ``m`` holds. Shared by the workspace kernel and the split
        path's merges."""
        lonely = l == 0.0
        l_safe = tl.where(lonely, 1.0, l)
        lse2 = tl.where(lonely, 0.0, m + tl.log2(l_safe))
        o = acc / l_safe[:, None]
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
            o = o * (1.0 / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2)))[:, None]
        o = tl.where(lonely[:, None], 0.0, o)
        lse = tl.where(lonely, float("inf"), lse2 * 0.6931471805599453)
        return o, lse

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
        o, lse = finish_softmax_rows(acc, l, m, sink_ptr, h, hm, HAS_SINK)
        do = vp * DV_OUT + tl.arange(0, DV_OUT)
        tl.store(out_ptr + r * o_s0 + h[:, None] * o_s1 + do[None, :], cast_bf16(o, EXACT), mask=hm[:, None])
        tl.store(lse_ptr + r * lse_s0 + h, lse, mask=hm & (vp == 0))


def triton_attention(q, kv2, idx2, sm_scale: float, d_v: int, attn_sink=None, out=None):
    """The Triton kernel over a BF16 workspace; see the module docstring."""
    Q, H, D = q.shape
    d_r = D - d_v
    if d_r <= 0 or (d_r & (d_r - 1)):
        raise fail(None, f"the Triton fallback needs d_qk - d_v a power of two, got {d_r}")
    out, lse = read_outputs(q, d_v, out)
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
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, V_SPLIT=V_SPLIT, EXACT=_triton.EXACT_CASTS, FROM_CACHE=False,
        BLOCK_SIZE=1, BPT=1, num_warps=NUM_WARPS, **LAUNCH_OPTS,
    )
    return out, lse

