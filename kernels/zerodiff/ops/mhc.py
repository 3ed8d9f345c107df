"""mHC (DeepSeek-V4 manifold-constrained hyper-connections): batch-invariant pre, post and head.

API
---
``mhc_pre(residual, fn, hc_scale, hc_base, *, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult,
sinkhorn_iters, backend=None) -> (layer_input, post, comb)``
    ``residual`` bf16 [T, n, H] (n = hc_mult in 1, 2, 4); ``fn`` fp32 [n*(n+2), n*H]; ``hc_scale`` fp32 [3];
    ``hc_base`` fp32 [n*(n+2)]. Returns ``layer_input`` bf16 [T, H], ``post`` fp32 [T, n], ``comb`` fp32
    [T, n, n].
``mhc_post(layer_out, residual, post, comb, *, backend=None) -> new residual bf16 [T, n, H]``
    ``layer_out`` bf16 [T, H]; ``residual`` bf16 [T, n, H] (n a power of two <= 8); ``post`` fp32 [T, n]
    (or [T, n, 1]); ``comb`` fp32 [T, n, n].
``hc_head(residual, fn, hc_scale, hc_base, *, rms_eps, hc_eps, backend=None) -> bf16 [T, H]``
    The final collapse of the n streams into one (vLLM's ``HCHeadOp``): ``fn`` fp32 [n, n*H], ``hc_scale``
    fp32 [1], ``hc_base`` fp32 [n].
Stages (tests and benchmarks): :func:`prenorm_gemm_splitk` (projection partials mix fp32 [S, T, n_mix] and
sums of squares sq fp32 [S, T]), :func:`pre_epilogue_splits` (partials -> the triple of ``mhc_pre``) and
:func:`split_count` (S and the k-blocks per split for a reduction length K = n*H).

Semantics are those of ``zerodiff.reference.mhc`` (its module docstring spells out the math; argument
names follow vLLM 0.33.0's ``mhc_pre`` / ``mhc_post``). ``backend``: None = Triton for CUDA tensors and
the reference for CPU tensors; "triton" (CPU tensors run through Triton's interpreter); "reference".
Upstream sizes the K-split of the pre-norm projection from the token count and sums the partials
afterwards, so a token's mixing weights depend on its batch; here the split is a function of the model
shape only.

Numerical contract of :func:`mhc_pre` (Triton backend)
-----------------------------------------------------
* Split: ``S, bps = split_count(n*H)``: :data:`SPLITS` (112) splits requested, rounded so that every split
  holds the same whole number ``bps`` of 64-wide k-blocks (H 7168: S = 112, bps = 4; H 4096: S = 64,
  bps = 4). A function of K = n*H only, never of T.
* Partial ``s``: blocks ``s*bps .. s*bps+bps-1`` in increasing k; rows tiled 64 at a time, no value
  crosses rows. Per block, each fp32 weight is split exactly into three bf16 pieces by truncation
  (``w = w1 + w2 + w3``, 8+8+8 significant bits, exact for finite normal weights) and multiplied by the
  bf16 ``x`` in three bf16 tensor-core products with exact products and fp32 accumulation: the w1 term
  into one accumulator, the w2 and w3 terms into a second, the two added once after the split's last
  block. The pieces are derived inside the kernel at every call, so weights updated in place (CUDA
  graphs) stay correct. The interpreter computes the same three products as fp32 dots of the same pieces.
* Sum of squares: per partial, each block's ``x*x`` (exact in fp32) reduced by a fixed ``tl.sum`` tree,
  blocks added in increasing k.
* Epilogue, one program per token (one warp): the token's S partials are loaded at once and reduced by
  one ``tl.sum`` tree per output, fixed by S and the launch configuration (never by T).
  ``rms = 1 / sqrt_rn(sq / (n*H) + rms_eps)`` (correctly rounded divisions and square root),
  ``mix = mix_raw * rms``.
* Gates: ``pre = 1/(1+exp(-(mix*s0 + b))) + pre_eps``; ``post = 1/(1+exp(-(mix*s1 + b))) * post_mult``;
  ``exp`` is ``tl.exp`` (deterministic; a hardware approximation on the GPU), divisions RN.
* Sinkhorn in fp32 registers: row max, ``exp``, row sums and column sums added sequentially in
  increasing index (each element extracted exactly), RN divisions; exactly ``sinkhorn_iters``
  normalisation rounds (no convergence test).
* Aggregation: ``acc = pre0*x0``, then ``acc = acc + pre_i*x_i`` for i = 1..n-1 (fp32, FP fusion off),
  one RNE rounding to bf16.
* Every output row depends only on that row's inputs and the weights: never on T, the row's position or
  the other rows. Each kernel compiles once for every T (T is not specialised, T == 1 included).
  Accuracy is fp32-class (the projection is exact products with fp32 sums), not bitwise equal to the
  float64 reference. On the CPU interpreter the invariance holds too; its values differ from the GPU's
  in the last bits (numpy ``exp`` and ``matmul``), so CPU-vs-GPU is not a bitwise claim.

:func:`hc_head`: the same projection (n outputs), sum of squares, normalisation, epilogue reduction and
aggregation as :func:`mhc_pre`, with ``pre = sigmoid(mix*rms*hc_scale + hc_base) + hc_eps`` and no Sinkhorn.

:func:`mhc_post`: ``new[:, j] = post[j]*layer_out + sum_i comb[i, j]*residual[:, i]`` in fp32, post term
first, then i = 0..n-1, one multiply and one add per term (FP fusion off), one RNE rounding to bf16.
Bitwise equal to ``reference.mhc.mhc_post_ref(..., dtype=torch.float32)`` on any device.

Failure modes
-------------
Bad input raises ``InputError`` (a ValueError) naming the argument: wrong dtype / rank / shape, ``hc_mult`` not in
(1, 2, 4) for pre / head (not a power of two <= 8 for post), tensors on different devices,
``sinkhorn_iters < 1``, an unknown backend. ``backend="triton"`` where Triton cannot run (not installed,
or CPU tensors without ``TRITON_INTERPRET=1``) raises ``RuntimeError``. Non-finite inputs are not
checked; they propagate (the bf16x3 weight split assumes finite weights). An empty batch (T = 0) returns
empty outputs without a launch.
"""

from __future__ import annotations

import torch

from zerodiff.errors import InputError
from zerodiff import _triton as zt
from zerodiff.reference import mhc as ref

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "mhc_pre",
    "mhc_post",
    "hc_head",
    "prenorm_gemm_splitk",
    "pre_epilogue_splits",
    "split_count",
    "SPLITS",
    "DEFAULT_VARIANT",
    "DEFAULT_HEAD_VARIANT",
]

#: the K-split count requested for the pre-norm projection (the count used is ``split_count(n*H)[0]``)
SPLITS = 112
#: the name of the configuration mhc_pre and hc_head run (split count 112, bf16x3 products, one-warp
#: epilogue); rollout and training both run it. ``zerodiff doctor`` and the end-to-end JSON record it.
DEFAULT_VARIANT = "bf16x3_s112_e1"
DEFAULT_HEAD_VARIANT = "bf16x3_s112_e1"

# One fixed launch configuration per model shape (never chosen from T).
_BLOCK_M = 64
_BLOCK_K = 64
_GEMM_WARPS = 8
_GEMM_STAGES = 3
_MAX_MIX = 32  # widest projection tile: n*(n+2) = 24 mixes for hc_mult 4
_EPI_WARPS = 1
_EPI_BLOCK_H = 1024
_POST_BLOCK_H = 512
_POST_WARPS = 4

# ----------------------------------------------------------------------------------------- kernels

if zt.HAVE_TRITON:

    @triton.jit
    def _bf16_to_f32(x, EXACT: tl.constexpr):
        """bf16 -> fp32, exact. The interpreter's native conversion garbles bf16 denormals (measured:
        1.3775e-39 -> 1.0286e-38), so EXACT widens the bits with integer ops instead."""
        if EXACT:
            u = x.to(tl.int16, bitcast=True).to(tl.uint16, bitcast=True).to(tl.uint32)
            return (u << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _split_bf16x3(w):
        """fp32 -> three bf16-exact fp32 pieces with w == w1 + w2 + w3 exactly (finite normal w).

        Each piece is a truncation (low 16 encoding bits cleared), so every step is exact: w - w1 and
        r1 - w2 are representable, and the last remainder has at most 8 significant bits."""
        w1 = (w.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        r1 = w - w1
        w2 = (r1.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        r2 = r1 - w2
        w3 = (r2.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        return w1, w2, w3

    @triton.jit
    def _load_prenorm_block(x_base, w_base, ks, rmask, cmask, K, EVEN_K: tl.constexpr):
        # one K block of the pre-norm projection: x [BM, BK] (bf16 residual rows) and w [BK, BN] (fp32 fn rows);
        # rows past T, columns past NMIX and (unless EVEN_K) k past K load +0
        if EVEN_K:
            x = tl.load(x_base + ks[None, :], mask=rmask[:, None], other=0.0)
            w = tl.load(w_base + ks[:, None], mask=cmask[None, :], other=0.0)
        else:
            kmask = ks < K
            x = tl.load(x_base + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_base + ks[:, None], mask=cmask[None, :] & kmask[:, None], other=0.0)
        return x, w

    @triton.jit
    def prenorm_program_tile(T, NMIX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             BPS: tl.constexpr):
        """This split-K program's tile: (split = program_id(1), rows int64 [BM] of block program_id(0), row
        mask, cols [BN], column mask, first k of the split)."""
        pid_m = tl.program_id(0)
        split = tl.program_id(1)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < T
        cols = tl.arange(0, BN)
        cmask = cols < NMIX
        k0 = split * (BPS * BK)
        return split, rows, rmask, cols, cmask, k0

    @triton.jit
    def store_prenorm_partial(mix_ptr, sq_ptr, split, T, rows, rmask, cols, cmask, acc, sq, NMIX: tl.constexpr):
        """Write split ``split``'s partial projection acc [BM, BN] into mix fp32 [S, T, NMIX] and its sum of
        squares sq [BM] into sq fp32 [S, T]."""
        out = mix_ptr + split.to(tl.int64) * T * NMIX + rows[:, None] * NMIX + cols[None, :]
        tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])
        tl.store(sq_ptr + split.to(tl.int64) * T + rows, sq, mask=rmask)

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _prenorm_splitk_kernel(
        x_ptr, fn_ptr, mix_ptr, sq_ptr, T, K,
        NMIX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        BPS: tl.constexpr, EVEN_K: tl.constexpr, EXACT: tl.constexpr,
    ):
        """Partial projection (bf16x3 products) + sum of squares of split ``program_id(1)`` (BPS blocks of
        BK, increasing k) for BM rows. The split count, BPS and every constexpr come from K and the launch
        configuration, never from T."""
        split, rows, rmask, cols, cmask, k0 = prenorm_program_tile(T, NMIX, BM, BN, BK, BPS)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc_lo = tl.zeros([BM, BN], dtype=tl.float32)
        sq = tl.zeros([BM], dtype=tl.float32)
        x_base = x_ptr + rows[:, None] * K
        w_base = fn_ptr + cols[None, :] * K
        for kb in range(BPS):
            ks = k0 + kb * BK + tl.arange(0, BK)
            x, w = _load_prenorm_block(x_base, w_base, ks, rmask, cmask, K, EVEN_K)
            xf = _bf16_to_f32(x, EXACT)
            sq = sq + tl.sum(xf * xf, axis=1)
            w1, w2, w3 = _split_bf16x3(w)
            if EXACT:  # interpreter: bf16 tl.dot is wrong there; the products are exact in fp32 anyway
                acc = tl.dot(xf, w1, acc, input_precision="ieee")
                acc_lo = tl.dot(xf, w2, acc_lo, input_precision="ieee")
                acc_lo = tl.dot(xf, w3, acc_lo, input_precision="ieee")
            else:
                acc = tl.dot(x, w1.to(tl.bfloat16), acc)
                acc_lo = tl.dot(x, w2.to(tl.bfloat16), acc_lo)
                acc_lo = tl.dot(x, w3.to(tl.bfloat16), acc_lo)
        acc = acc + acc_lo
        store_prenorm_partial(mix_ptr, sq_ptr, split, T, rows, rmask, cols, cmask, acc, sq, NMIX)

    @triton.jit
    def _rowsum_seq(m, NH: tl.constexpr):
        """Row sums of an [NH, NH] tile, columns added in increasing index (exact extraction)."""
        c = tl.arange(0, NH)[None, :]
        s = tl.sum(tl.where(c == 0, m, 0.0), axis=1)
        for k in tl.static_range(1, NH):
            s = s + tl.sum(tl.where(c == k, m, 0.0), axis=1)
        return s

    @triton.jit
    def _colsum_seq(m, NH: tl.constexpr):
        """Column sums of an [NH, NH] tile, rows added in increasing index (exact extraction)."""
        r = tl.arange(0, NH)[:, None]
        s = tl.sum(tl.where(r == 0, m, 0.0), axis=0)
        for k in tl.static_range(1, NH):
            s = s + tl.sum(tl.where(r == k, m, 0.0), axis=0)
        return s

    @triton.jit
    def _sigmoid_rn(z):
        return tl.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + tl.exp(-z))

    @triton.jit
    def _aggregate_row(pre, res_ptr, out_ptr, row, H, NH: tl.constexpr, BLOCK_H: tl.constexpr,
                       EXACT: tl.constexpr):
        """out[row] = bf16(pre0*x0 + pre1*x1 + ...) with the adds in increasing stream index.
        pre (> 0) is an [NH] vector; its entries are extracted exactly with where + sum over zeros."""
        n = tl.arange(0, NH)
        p0 = tl.sum(tl.where(n == 0, pre, 0.0), axis=0)
        rbase = res_ptr + row * NH * H
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            hm = offs < H
            acc = p0 * _bf16_to_f32(tl.load(rbase + offs, mask=hm, other=0.0), EXACT)
            for i in tl.static_range(1, NH):
                pi = tl.sum(tl.where(n == i, pre, 0.0), axis=0)
                acc = acc + pi * _bf16_to_f32(tl.load(rbase + i * H + offs, mask=hm, other=0.0), EXACT)
            tl.store(out_ptr + row * H + offs, zt.cast_bf16(acc, EXACT), mask=hm)

    @triton.jit
    def _load_split_sum(ptr, offs, smask):
        """Sum over the split axis (axis 0) of a [SP, ...] tile: one tl.sum tree, fixed by SP and the
        launch config (never by T); padded splits load +0."""
        return tl.sum(tl.load(ptr + offs, mask=smask, other=0.0), axis=0)

    @triton.jit
    def _finish_pre_row(sq, pre_r, post_r, comb_r, row, K, scale_ptr, base_ptr, res_ptr, li_ptr, post_ptr, comb_ptr,
                        H, rms_eps, pre_eps, sk_eps, post_mult, ITERS,
                        NH: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr):
        # one token's mHC pre from its summed mix (pre_r [NH], post_r [NH], comb_r [NH, NH]) and sum of squares:
        # RMS scale, the three gates, Sinkhorn, the stores and the pre-weighted aggregate of the residual streams;
        # shared by every epilogue so that only the order of the split sums differs between them
        n = tl.arange(0, NH)
        ii = tl.arange(0, NH)[:, None]
        jj = tl.arange(0, NH)[None, :]
        kf = K.to(tl.float32)
        rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, kf) + rms_eps))
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        pre = _sigmoid_rn((pre_r * rms) * s0 + tl.load(base_ptr + n)) + pre_eps
        post = _sigmoid_rn((post_r * rms) * s1 + tl.load(base_ptr + NH + n)) * post_mult
        c = (comb_r * rms) * s2 + tl.load(base_ptr + 2 * NH + ii * NH + jj)
        # Sinkhorn: row softmax + eps, column normalisation, then ITERS-1 (row, column) rounds
        mx = tl.max(c, axis=1)
        e = tl.exp(c - mx[:, None])
        c = tl.div_rn(e, _rowsum_seq(e, NH)[:, None]) + sk_eps
        c = tl.div_rn(c, (_colsum_seq(c, NH) + sk_eps)[None, :])
        for _ in range(ITERS - 1):
            c = tl.div_rn(c, (_rowsum_seq(c, NH) + sk_eps)[:, None])
            c = tl.div_rn(c, (_colsum_seq(c, NH) + sk_eps)[None, :])
        tl.store(post_ptr + row * NH + n, post)
        tl.store(comb_ptr + row * NH * NH + ii * NH + jj, c)
        _aggregate_row(pre, res_ptr, li_ptr, row, H, NH, BLOCK_H, EXACT)

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _mhc_pre_epilogue_splits_kernel(
        mix_ptr, sq_ptr, scale_ptr, base_ptr, res_ptr, li_ptr, post_ptr, comb_ptr,
        T, H, K, rms_eps, pre_eps, sk_eps, post_mult, ITERS,
        S: tl.constexpr, SP: tl.constexpr, NH: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        NMIX: tl.constexpr = NH * (NH + 2)
        n = tl.arange(0, NH)
        ii = tl.arange(0, NH)[:, None]
        jj = tl.arange(0, NH)[None, :]
        s = tl.arange(0, SP)
        smask = s < S
        soff = s.to(tl.int64) * T  # split stride of sq; times NMIX for mix
        mrow = soff * NMIX + row * NMIX
        # all S partials are loaded at once and reduced by one fixed tree per output
        sq = _load_split_sum(sq_ptr, soff + row, smask)
        pre_r = _load_split_sum(mix_ptr, mrow[:, None] + n[None, :], smask[:, None])
        post_r = _load_split_sum(mix_ptr, mrow[:, None] + NH + n[None, :], smask[:, None])
        comb_r = _load_split_sum(mix_ptr, mrow[:, None, None] + 2 * NH + ii[None, :, :] * NH + jj[None, :, :],
                                 smask[:, None, None])
        _finish_pre_row(sq, pre_r, post_r, comb_r, row, K, scale_ptr, base_ptr, res_ptr, li_ptr, post_ptr, comb_ptr,
                        H, rms_eps, pre_eps, sk_eps, post_mult, ITERS, NH, BLOCK_H, EXACT)

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _hc_head_epilogue_splits_kernel(
        mix_ptr, sq_ptr, scale_ptr, base_ptr, res_ptr, out_ptr, T, H, K, rms_eps, hc_eps,
        S: tl.constexpr, SP: tl.constexpr, NH: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, NH)
        s = tl.arange(0, SP)
        smask = s < S
        soff = s.to(tl.int64) * T
        sq = _load_split_sum(sq_ptr, soff + row, smask)
        mix = _load_split_sum(mix_ptr, (soff * NH + row * NH)[:, None] + n[None, :], smask[:, None])
        rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, K.to(tl.float32)) + rms_eps))
        pre = _sigmoid_rn((mix * rms) * tl.load(scale_ptr) + tl.load(base_ptr + n)) + hc_eps
        _aggregate_row(pre, res_ptr, out_ptr, row, H, NH, BLOCK_H, EXACT)

    @triton.jit
    def _mhc_post_kernel(
        lo_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, H,
        NH: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = offs < H
        j = tl.arange(0, NH)
        post = tl.load(post_ptr + row * NH + j)
        x = _bf16_to_f32(tl.load(lo_ptr + row * H + offs, mask=hm, other=0.0), EXACT)
        acc = post[:, None] * x[None, :]
        rbase = res_ptr + row * NH * H
        for i in tl.static_range(NH):
            ri = _bf16_to_f32(tl.load(rbase + i * H + offs, mask=hm, other=0.0), EXACT)
            ci = tl.load(comb_ptr + row * NH * NH + i * NH + j)
            acc = acc + ci[:, None] * ri[None, :]
        out = out_ptr + row * NH * H + j[:, None] * H + offs[None, :]
        tl.store(out, zt.cast_bf16(acc, EXACT), mask=(j[:, None] < NH) & hm[None, :])


# ------------------------------------------------------------------------------------- validation


def _err(msg: str) -> InputError:
    return InputError(f"zerodiff.mhc: {msg}")


def _check_pre(residual, fn, hc_scale, hc_base, sinkhorn_iters, head=False):
    if not isinstance(residual, torch.Tensor) or residual.dim() != 3 or residual.dtype != torch.bfloat16:
        raise _err(f"residual must be a bf16 tensor [T, hc_mult, H]; got "
                   f"{getattr(residual, 'dtype', type(residual))} {tuple(getattr(residual, 'shape', ()))}")
    T, n, H = residual.shape
    if n not in (1, 2, 4):
        raise _err(f"hc_mult (residual.shape[1]) must be 1, 2 or 4 (n*(n+2) mixes fit the kernel's "
                   f"{_MAX_MIX}-wide tile); got {n}")
    if H < 1:
        raise _err(f"hidden size (residual.shape[2]) must be >= 1; got {H}")
    nm = n if head else ref.n_mix(n)
    if head:
        if hc_scale.dtype != torch.float32 or tuple(hc_scale.shape) != (1,):
            raise _err(f"hc_scale must be fp32 [1] for hc_head; got {hc_scale.dtype} {tuple(hc_scale.shape)}")
        hc_scale = hc_scale.expand(3)  # shape check below then passes
    if fn.dtype != torch.float32 or tuple(fn.shape) != (nm, n * H):
        raise _err(f"fn must be fp32 [{nm}, {n * H}] for residual {tuple(residual.shape)}; "
                   f"got {fn.dtype} {tuple(fn.shape)}")
    if hc_scale.dtype != torch.float32 or tuple(hc_scale.shape) != (3,):
        raise _err(f"hc_scale must be fp32 [3]; got {hc_scale.dtype} {tuple(hc_scale.shape)}")
    if hc_base.dtype != torch.float32 or tuple(hc_base.shape) != (nm,):
        raise _err(f"hc_base must be fp32 [{nm}]; got {hc_base.dtype} {tuple(hc_base.shape)}")
    for name, t in (("fn", fn), ("hc_scale", hc_scale), ("hc_base", hc_base)):
        if t.device != residual.device:
            raise _err(f"{name} is on {t.device} but residual is on {residual.device}")
    if not head and (not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1):
        raise _err(f"sinkhorn_iters must be an int >= 1; got {sinkhorn_iters!r}")


def _check_post(layer_out, residual, post, comb):
    if not isinstance(residual, torch.Tensor) or residual.dim() != 3 or residual.dtype != torch.bfloat16:
        raise _err(f"residual must be a bf16 tensor [T, hc_mult, H]; got "
                   f"{getattr(residual, 'dtype', type(residual))} {tuple(getattr(residual, 'shape', ()))}")
    T, n, H = residual.shape
    if n < 1 or n > 8 or (n & (n - 1)) != 0:
        raise _err(f"hc_mult (residual.shape[1]) must be a power of two <= 8; got {n}")
    if layer_out.dtype != torch.bfloat16 or tuple(layer_out.shape) != (T, H):
        raise _err(f"layer_out must be bf16 [{T}, {H}]; got {layer_out.dtype} {tuple(layer_out.shape)}")
    if post.dtype != torch.float32 or post.numel() != T * n or post.shape[:1] != (T,) or post.shape[1] != n:
        raise _err(f"post must be fp32 [{T}, {n}] (or [{T}, {n}, 1]); got {post.dtype} {tuple(post.shape)}")
    if comb.dtype != torch.float32 or tuple(comb.shape) != (T, n, n):
        raise _err(f"comb must be fp32 [{T}, {n}, {n}]; got {comb.dtype} {tuple(comb.shape)}")
    for name, t in (("layer_out", layer_out), ("post", post), ("comb", comb)):
        if t.device != residual.device:
            raise _err(f"{name} is on {t.device} but residual is on {residual.device}")


def _pick_backend(backend, device) -> str:
    return zt.pick_backend("zerodiff.mhc", backend, device)


# --------------------------------------------------------------------------------------- launchers


def split_count(K: int, splits: int = SPLITS, block_k: int = _BLOCK_K) -> tuple[int, int]:
    """(split count, blocks per split) for reduction length ``K`` (= n*H) and ``splits`` requested.

    Blocks per split = the smallest divisor of ceil(K / block_k) that is >= ceil(blocks / splits), so every
    split holds the same whole number of blocks (no ragged split). Depends on K and the request only."""
    nblocks = max(1, -(-K // block_k))
    bps = -(-nblocks // splits)
    while nblocks % bps:
        bps += 1
    return nblocks // bps, bps


def _block_n(nm: int) -> int:
    bn = 16
    while bn < nm:
        bn *= 2
    return bn


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def _prenorm_gemm(residual: torch.Tensor, fn: torch.Tensor, *, splits: int, block_m: int, block_k: int,
                  warps: int, stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the bf16x3 split-K projection with an explicit configuration (the shipped one is
    :func:`prenorm_gemm_splitk`'s)."""
    T, n, H = residual.shape
    K = n * H
    nm = fn.shape[0]
    if nm > _MAX_MIX:
        raise _err(f"fn has {nm} rows, more than {_MAX_MIX} (hc_mult {n} unsupported)")
    S, bps = split_count(K, splits, block_k)
    x = residual.contiguous().view(T, K)
    fn = fn.contiguous()
    mix = torch.empty(S, T, nm, dtype=torch.float32, device=residual.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=residual.device)
    if T == 0:
        return mix, sq
    grid = (triton.cdiv(T, block_m), S)
    _prenorm_splitk_kernel[grid](
        x, fn, mix, sq, T, K, NMIX=nm, BM=block_m, BN=_block_n(nm), BK=block_k, BPS=bps,
        EVEN_K=(K % block_k == 0), EXACT=zt.EXACT_CASTS, num_warps=warps, num_stages=stages, **zt.LAUNCH_OPTS,
    )
    return mix, sq


def prenorm_gemm_splitk(residual: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K projection + sum of squares: (mix fp32 [S, T, nm], sq fp32 [S, T]) with
    ``S = split_count(n*H)[0]``. Partial ``s`` covers blocks ``s*bps .. s*bps+bps-1`` in increasing k, each
    block three bf16 products of the exact weight split (module docstring)."""
    return _prenorm_gemm(residual, fn, splits=SPLITS, block_m=_BLOCK_M, block_k=_BLOCK_K, warps=_GEMM_WARPS,
                         stages=_GEMM_STAGES)


def pre_outputs(residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised outputs of an mHC pre for residual [T, n, H]: (layer_input bf16 [T, H], post fp32 [T, n],
    comb fp32 [T, n, n]) on residual's device."""
    T, n, H = residual.shape
    dev = residual.device
    return (torch.empty(T, H, dtype=torch.bfloat16, device=dev), torch.empty(T, n, dtype=torch.float32, device=dev),
            torch.empty(T, n, n, dtype=torch.float32, device=dev))


def _pre_epilogue(mix, sq, residual, hc_scale, hc_base, *, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult,
                  sinkhorn_iters, warps):
    """Launch the pre epilogue over S partials with ``warps`` warps (only the split-sum tree depends on it)."""
    S, T, nm = mix.shape
    _, n, H = residual.shape
    li, post, comb = pre_outputs(residual)
    if T == 0:
        return li, post, comb
    _mhc_pre_epilogue_splits_kernel[(T,)](
        mix.contiguous(), sq.contiguous(), hc_scale.contiguous(), hc_base.contiguous(),
        residual.contiguous(), li, post, comb, T, H, n * H,
        float(rms_eps), float(hc_pre_eps), float(hc_sinkhorn_eps), float(hc_post_mult), int(sinkhorn_iters),
        S=S, SP=_pow2_at_least(S), NH=n, BLOCK_H=_EPI_BLOCK_H, EXACT=zt.EXACT_CASTS, num_warps=warps,
        **zt.LAUNCH_OPTS,
    )
    return li, post, comb


def pre_epilogue_splits(mix: torch.Tensor, sq: torch.Tensor, residual: torch.Tensor, hc_scale: torch.Tensor,
                        hc_base: torch.Tensor, *, rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
                        hc_post_mult: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Epilogue for S partials: all S loaded at once and summed by one fixed ``tl.sum`` tree (pinned by
    S, i.e. by K, and the launch configuration), then the gates, Sinkhorn and aggregation."""
    return _pre_epilogue(mix, sq, residual, hc_scale, hc_base, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps,
                         hc_sinkhorn_eps=hc_sinkhorn_eps, hc_post_mult=hc_post_mult, sinkhorn_iters=sinkhorn_iters,
                         warps=_EPI_WARPS)


def _hc_head_epilogue(mix, sq, residual, hc_scale, hc_base, rms_eps, hc_eps, warps):
    """Launch the head epilogue over S partials with ``warps`` warps."""
    T, n, H = residual.shape
    out = torch.empty(T, H, dtype=torch.bfloat16, device=residual.device)
    if T == 0:
        return out
    S = mix.shape[0]
    _hc_head_epilogue_splits_kernel[(T,)](
        mix, sq, hc_scale.contiguous(), hc_base.contiguous(), residual.contiguous(), out, T, H, n * H,
        float(rms_eps), float(hc_eps), S=S, SP=_pow2_at_least(S), NH=n, BLOCK_H=_EPI_BLOCK_H,
        EXACT=zt.EXACT_CASTS, num_warps=warps, **zt.LAUNCH_OPTS,
    )
    return out


# ------------------------------------------------------------------------------------ public ops


def mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float = ref.RMS_EPS,
    hc_pre_eps: float = ref.HC_EPS,
    hc_sinkhorn_eps: float = ref.HC_EPS,
    hc_post_mult: float = ref.POST_MULT,
    sinkhorn_iters: int = ref.SINKHORN_ITERS,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre: (layer_input bf16 [T, H], post fp32 [T, n], comb fp32 [T, n, n]).

    ``residual`` bf16 [T, n, H]; ``fn`` fp32 [n*(n+2), n*H]; ``hc_scale`` fp32 [3]; ``hc_base`` fp32
    [n*(n+2)]. Contract in the module docstring (split count fixed by the model shape, never by T)."""
    _check_pre(residual, fn, hc_scale, hc_base, sinkhorn_iters)
    be = _pick_backend(backend, residual.device)
    kw = dict(rms_eps=rms_eps, hc_pre_eps=hc_pre_eps, hc_sinkhorn_eps=hc_sinkhorn_eps,
              hc_post_mult=hc_post_mult, sinkhorn_iters=sinkhorn_iters)
    if be == "reference":
        return ref.mhc_pre_ref(residual, fn, hc_scale, hc_base, **kw)
    mix, sq = prenorm_gemm_splitk(residual, fn)
    return pre_epilogue_splits(mix, sq, residual, hc_scale, hc_base, **kw)


def mhc_post(
    layer_out: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """mHC post: new residual streams bf16 [T, n, H]; contract in the module docstring."""
    _check_post(layer_out, residual, post, comb)
    be = _pick_backend(backend, residual.device)
    if be == "reference":
        return ref.mhc_post_ref(layer_out, residual, post, comb)
    T, n, H = residual.shape
    out = torch.empty(T, n, H, dtype=torch.bfloat16, device=residual.device)
    if T == 0:
        return out
    grid = (T, triton.cdiv(H, _POST_BLOCK_H))
    _mhc_post_kernel[grid](
        layer_out.contiguous(), residual.contiguous(), post.reshape(T, n).contiguous(),
        comb.contiguous(), out, H, NH=n, BLOCK_H=_POST_BLOCK_H, EXACT=zt.EXACT_CASTS,
        num_warps=_POST_WARPS, **zt.LAUNCH_OPTS,
    )
    return out


def hc_head(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float = ref.RMS_EPS,
    hc_eps: float = ref.HC_EPS,
    backend: str | None = None,
) -> torch.Tensor:
    """DeepSeek-V4's final stream collapse (vLLM ``HCHeadOp``): bf16 [T, H].

    ``residual`` bf16 [T, n, H]; ``fn`` fp32 [n, n*H]; ``hc_scale`` fp32 [1]; ``hc_base`` fp32 [n].
    ``pre = sigmoid(mix * rms * hc_scale + hc_base) + hc_eps`` with the same projection, sum of squares,
    normalisation and aggregation contract as :func:`mhc_pre` (no Sinkhorn)."""
    _check_pre(residual, fn, hc_scale, hc_base, 1, head=True)
    be = _pick_backend(backend, residual.device)
    if be == "reference":
        return ref.hc_head_ref(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps)
    mix, sq = prenorm_gemm_splitk(residual, fn)
    return _hc_head_epilogue(mix, sq, residual, hc_scale, hc_base, rms_eps, hc_eps, _EPI_WARPS)
