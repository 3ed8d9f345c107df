"""mHC (DeepSeek-V4 manifold-constrained hyper-connections) with a fixed split: batch-invariant pre/post.

Semantics are those of ``zerodiff.reference.mhc`` (the module docstring there spells out the math;
argument names follow vLLM 0.33.0's ``mhc_pre`` / ``mhc_post``). Upstream picks the K-split of the
pre-norm projection GEMM from the token count and the SM count (``compute_num_split``: up to 64 (H 4096)
or 112 (H 7168) splits at small T, 1 at large T) and sums the partial sums afterwards, so a token's mixing weights depend on
how many tokens share its batch. This module removes that dependence.

Shipped configuration (decided on the H200, 2026-11-30): ``DEFAULT_VARIANT = DEFAULT_HEAD_VARIANT =
"bf16x3_s112_e1"``: the projection split into a split count fixed by the model shape (112 requested; a
function of K = n*H only, never of T), bf16x3 tensor-core products with fp32-class accuracy, one-warp
epilogue. Its contract is the one below with the projection / sum of squares replaced as described under
"Variants". The split-1 kernels (``variant="fp32_s1"``) stay selectable and verified.

Numerical contract of :func:`mhc_pre` (Triton backend; ``fp32_s1``, the split-1 base contract)
------------------------------------------------------------------------------------------------
* Split count fixed at ``FIXED_SPLITS = 1``; no small-batch branch; one kernel configuration
  (``_GEMM_BM/_GEMM_BN/_GEMM_BK``, warps) for every T. The grid depends on T, the per-row arithmetic
  never does: rows are tiled ``_GEMM_BM`` at a time and no value crosses rows.
* Projection: ``mix_raw[t, m] = sum_k x[t, k] * fn[m, k]`` over ``k = 0 .. n*H-1`` in fp32, one fixed
  order: blocks of ``_GEMM_BK`` in increasing k, each block through ``tl.dot(..., acc,
  input_precision=_DOT_PRECISION)`` ("ieee": Triton's fp32 FMA lowering, no tensor cores). bf16 inputs
  are exact in fp32. (The per-row order is fixed by the constexpr config; the interpreter uses numpy.)
* Sum of squares: ``sq[t] = sum_k x[t, k]**2`` in fp32 (each square is exact), per block a fixed
  ``tl.sum`` tree, blocks added in increasing k.
* Normalisation: ``rms = 1 / sqrt_rn(sq / (n*H) + rms_eps)`` (correctly rounded divisions and sqrt),
  ``mix = mix_raw * rms``.
* Gates: ``pre = 1/(1+exp(-(mix*s0 + b))) + pre_eps``; ``post = 1/(1+exp(-(mix*s1 + b))) * post_mult``;
  ``exp`` is Triton's ``tl.exp`` (deterministic; hardware approximation on the GPU), divisions RN.
* Sinkhorn in fp32 registers: row max, ``exp``, row sums and column sums added sequentially in
  increasing index, RN divisions; exactly ``sinkhorn_iters`` normalisation rounds (no convergence test).
* Aggregation: ``acc = pre0*x0``, then ``acc = acc + pre_i*x_i`` for i = 1..n-1 (fp32, FP fusion off),
  one RNE rounding to bf16.
* Outputs: ``layer_input`` bf16 ``[T, H]``, ``post`` fp32 ``[T, n]``, ``comb`` fp32 ``[T, n, n]``. Every
  output row depends only on that row's inputs and the weights: never on T, the row's position, or the
  other rows. On the CPU interpreter the same holds; its values differ from the GPU's in the last bits
  (numpy ``exp`` and ``matmul``), so CPU-vs-GPU is not a bitwise claim.

:func:`mhc_post`: ``new[:, j] = post[j]*layer_out + sum_i comb[i, j]*residual[:, i]`` in fp32, post term
first, then i = 0..n-1, one multiply and one add per term (FP fusion off), one RNE rounding to bf16.
Bitwise equal to ``reference.mhc.mhc_post_ref(..., dtype=torch.float32)`` on any device.

:func:`hc_head` (the model's final collapse of the n streams into one, vLLM's ``HCHeadOp``): ``fn``
[n, n*H], one scale, n bases; ``pre = sigmoid(mix*rms*scale + base) + hc_eps``, then the aggregation
above; the projection / sum of squares / normalisation / aggregation contract is :func:`mhc_pre`'s.

:func:`mhc_pre_split_baseline` is the stock-style path (negative control, benchmark baseline): the
split count from the token count as vLLM computes it, partial sums added in split order, then the same
epilogue. Its bits depend on T; ours do not.

Variants (opt-in, ``variant=`` keyword / :data:`DEFAULT_VARIANT`)
-----------------------------------------------------------------
:data:`VARIANTS` holds the batch-invariant configurations of the projection (the shipped default
``bf16x3_s112_e1`` among them; ``fp32_s1`` is the split-1 contract above), selected by name
(``mhc_pre(..., variant="bf16x3_s32")``,
``hc_head(..., variant=...)``); each is ONE fixed configuration per model shape:

* Split count ``S = variant_splits(n*H, variant)[0]``: the requested count rounded so every split holds
  the same whole number ``bps`` of ``block_k``-blocks (H 7168: S = 16/32/64/112 exactly, bps = 28/14/7/4;
  H 4096: 112 -> 64). A function of K only, never of T: any S fixed by the model shape is as
  batch-invariant as S = 1 (the property the DESIGN row "split count fixed at 1" protects).
* Partial ``s``: blocks ``s*bps .. s*bps+bps-1`` in increasing k, each one ``tl.dot`` into an fp32
  accumulator; the sum of squares in fp32 (exact squares, a ``tl.sum`` per block, blocks in order).
  Rows are tiled ``block_m`` at a time (64; 16 for ``ieee``); no value crosses rows.
* Products per block by ``precision``: ``ieee`` fp32 FMA (same class as the default); ``tf32`` tensor
  cores with the fp32 weights rounded to TF32 (x is bf16: exact in TF32) - the precision upstream serves
  with (DeepGEMM ``tf32_hc_prenorm_gemm``); ``bf16x3``: each fp32 weight split EXACTLY into three bf16
  pieces by truncation (w = w1 + w2 + w3, 8+8+8 significant bits, exact for normal weights) and three
  bf16 tensor-core products with exact fp32 products, the w1 term in one accumulator and the w2, w3
  terms in a second one, added once at the end: fp32-class accuracy at tensor-core speed (the pieces are
  derived in the kernel every call, so in-place weight updates under CUDA graphs stay correct);
  ``tf32x3``: Triton's 3-pass TF32 (x's low part is zero, so one pass is wasted; kept for comparison).
* Epilogue: the S partials of a token are loaded at once and summed by one ``tl.sum`` tree per output
  (its order pinned by S, the padded width and the variant's ``epi_warps``, never by T), then the gates,
  Sinkhorn and aggregation exactly as above. With S = 1 it is the verified epilogue bit for bit
  (CPU-tested). The Sinkhorn's row / column sums extract one element at a time (exact), so only the
  split-sum tree depends on ``epi_warps``; ``*_e1`` variants run the epilogue in one warp (intra-warp
  reductions instead of shared-memory ones along the 20 dependent Sinkhorn rounds: decode latency).
* Each variant's values differ from the default's in the last bits (another summation order; TF32
  also in accuracy), so switching :data:`DEFAULT_VARIANT` / :data:`DEFAULT_HEAD_VARIANT` is a contract
  change that rollout and training make at once (both read these constants) and re-verify on the GPU.
* Accuracy cost of TF32 vs fp32: the weights keep 10 explicit mantissa bits (relative error 2^-11 per
  product with round-to-nearest, 2^-10 if truncated), so the projection error is up to ~1e-3 of
  sum|x*w| versus ~1e-6 for fp32 FMA; measured on the H200 (stock TF32 vs our fp32): max |comb| diff
  1.6e-4. ``bf16x3`` and ``tf32x3`` stay at fp32-class error. The sweep reports ``proj_err`` /
  ``comb_err`` / ``li_max_ulp`` per variant.

Performance analysis (H 7168, hc 4: K = n*H = 28672, 24 mixes; H200, 2026-11-30)
---------------------------------------------------------------------------------
* Bytes per call: weight 24 x 28672 x 4 B = 2.75 MB (DRAM once, then L2); x = 57 KB per token, read by
  the projection and again by the aggregation; the bf16 output 14 KB per token; S partials 100 B per
  token and split (written and read back). T=1: ~2.9 MB (<1 us of bandwidth: launch / latency bound).
  T=8192: 470 + 470 + 117 MB = 1.06 GB, ~0.22-0.26 ms at 4-4.8 TB/s - the stock's measured 0.272 ms
  (DeepGEMM, split 1, + our epilogue) sits on that bound.
* FLOPs per call: 2 x T x K x 24 = 1.38 MFLOP per token (11.3 GFLOP at T=8192; 15 with the mix width
  padded to 32). fp32 FMA peak (~67 TFLOPS) would need 0.17 ms at T=8192; TF32 (~495) 0.03 ms; bf16x3
  (3 x bf16 at ~990) 0.045 ms: only tensor cores leave the prefill memory-bound.
* Measured default (fp32_s1): 1.07 ms at T=1 and 64, 1.12 at 2048, 4.30 at 8192 (stock 0.034 / 0.030 /
  0.086 / 0.272), of which the projection 1.06-4.16 ms and the epilogue 0.014-0.15 ms. The projection
  time is (waves of programs) x 448 serial k-blocks x ~2.4 us per block: one program per 16 rows walks
  all of K, each block a CUDA-core fp32 dot (Triton's FMA lowering, operands re-read from shared
  memory) behind the default 3-stage 16-byte cp.async pipeline (AOT PTX: the loads are vectorised, so
  the per-block cost is the FMA dot plus latency, not the loads); T <= 2048 is < 1 wave (same 1.07 ms),
  T = 8192 is 4 waves (4.16 ms). fixed8 / fixed16 (0.147 / 0.083 ms at T=1) scale as 1/S, confirming the
  per-program serial walk; at T=2048+ they did not help because the FMA dot is the limit (3.6 TFLOPS).
* What the variants change: (1) S fixed by K spreads decode over S programs (112 x 4 blocks instead of
  1 x 448): predicted projection ~3-6 us at T <= 64, i.e. mhc_pre ~0.02-0.03 ms with the ~14 us
  epilogue (stock 0.030-0.034; the ``*_e1`` one-warp epilogue targets that 14 us); (2) a constexpr
  trip count (bps) with no k mask when K divides (EVEN_K); (3) tensor cores (TF32 / bf16x3)
  so the prefill projection is bound by reading x (0.1 ms at T=8192) rather than by FMA throughput;
  with the partials (S x 0.82 MB per 8192 tokens, x2) and the 0.15 ms epilogue, predicted mhc_pre at
  T=8192 ~0.27-0.30 ms for S = 16-32 (~0.31 for S = 112) vs stock 0.272, and at T=2048 ~0.08-0.1 ms vs
  0.086. hc_head gets the same projection (4 mixes, tile width 16): predicted ~0.02 ms at T=1 (1.06 ms
  now, torch eager 0.046). AOT with launch-like alignment hints (``benchmarks/bench_mhc.py --aot``;
  Triton 3.6 = the H200's, and 3.8), sm_90a: tf32 / bf16x3 72-76 registers at 8 warps (4 warps:
  96-125), tf32x3 146-167, ieee 56-70, one-warp epilogue 70, no spills anywhere, every load a 16-byte
  cp.async, ``wgmma``; sm_100a: 55-64 registers, ``tcgen05``. Without the hints (pointer / K
  divisibility) the AOT loads degrade to 4-byte copies and the counts reach 255: not what runs.
* Decision (H200, 2026-11-30, ``build/perf-session.sh``; docs/benchmarks.md): ``bf16x3_s112_e1`` for
  both mhc_pre and hc_head. Its worst mhc_pre ratio over T in {1, 64, 2048, 8192} is the best of the
  variants at H 2048 (2.24; bf16x3_s32 2.86) and equal best at H 7168 (2.53); decode 0.033-0.040 ms vs stock
  0.019-0.036 (fp32_s1 was 0.31 / 1.07 ms); end to end (``zerodiff bench --config h200``) rollout
  throughput consistent/baseline 1.012 and model-forward GPU time ratio 1.07 (fp32_s1: 0.832 / 0.759).
  The remaining prefill gap (2.0-2.5x the stock TF32 split-from-T GEMM at T >= 2048) is the three bf16
  passes plus the partials' round trip; hc_head is 0.13-0.31x its torch-eager stock at every T.

Bad input raises ``ValueError`` naming the argument: wrong dtype / rank / shape, ``hc_mult`` not in
(1, 2, 4) for pre / head (not a power of two <= 8 for post), tensors on different devices,
``sinkhorn_iters < 1``, an unknown backend, an unknown variant (or a ``PrenormVariant`` with a bad split
count, precision, block size or warp count), or a Triton backend on a device where Triton cannot run.
Non-finite inputs are not checked; they propagate (the bf16x3 weight split assumes finite weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodiff import _triton as zt
from zerodiff.reference import mhc as ref

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "FIXED_SPLITS",
    "mhc_pre",
    "mhc_post",
    "hc_head",
    "mhc_pre_split_baseline",
    "stock_num_splits",
    "prenorm_gemm",
    "pre_epilogue",
    "PrenormVariant",
    "VARIANTS",
    "DEFAULT_VARIANT",
    "DEFAULT_HEAD_VARIANT",
    "variant_splits",
    "prenorm_gemm_splitk",
    "pre_epilogue_splits",
]

#: the contract: one K split for every token count.
FIXED_SPLITS = 1

# One fixed kernel configuration (never chosen from T).
_GEMM_BM = 16
_GEMM_BN = 32  # >= n_mix = 24 for hc_mult 4; padded lanes are masked
_GEMM_BK = 64
_GEMM_WARPS = 4
_DOT_PRECISION = "ieee"
_EPI_BLOCK_H = 1024
_EPI_WARPS = 4
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

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _mhc_prenorm_gemm_kernel(
        x_ptr, fn_ptr, mix_ptr, sq_ptr, T, K, K_PER_SPLIT,
        NMIX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        PRECISION: tl.constexpr, EXACT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        split = tl.program_id(1)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < T
        cols = tl.arange(0, BN)
        cmask = cols < NMIX
        k_start = split * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        sq = tl.zeros([BM], dtype=tl.float32)
        for kb in range(0, K_PER_SPLIT // BK):  # blocks in increasing k (scalar bounds: interpreter-safe)
            ks = k_start + kb * BK + tl.arange(0, BK)
            kmask = ks < k_end
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)
            x = _bf16_to_f32(x, EXACT)
            w = tl.load(fn_ptr + cols[None, :] * K + ks[:, None],
                        mask=cmask[None, :] & kmask[:, None], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            sq = sq + tl.sum(x * x, axis=1)
        out = mix_ptr + split.to(tl.int64) * T * NMIX + rows[:, None] * NMIX + cols[None, :]
        tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])
        tl.store(sq_ptr + split.to(tl.int64) * T + rows, sq, mask=rmask)

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

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _mhc_pre_epilogue_kernel(
        mix_ptr, sq_ptr, scale_ptr, base_ptr, res_ptr, li_ptr, post_ptr, comb_ptr,
        T, H, K, rms_eps, pre_eps, sk_eps, post_mult, ITERS,
        S, NH: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        NMIX: tl.constexpr = NH * (NH + 2)
        n = tl.arange(0, NH)
        ii = tl.arange(0, NH)[:, None]
        jj = tl.arange(0, NH)[None, :]
        mrow = mix_ptr + row * NMIX
        # partial sums added in split order (S == 1 for our path)
        sq = tl.load(sq_ptr + row)
        pre_r = tl.load(mrow + n)
        post_r = tl.load(mrow + NH + n)
        comb_r = tl.load(mrow + 2 * NH + ii * NH + jj)
        t64 = tl.zeros([], dtype=tl.int64) + T  # int64 split strides
        for s in range(1, S):  # runtime loop: one compiled kernel for every split count
            ms = mrow + s * t64 * NMIX
            sq = sq + tl.load(sq_ptr + s * t64 + row)
            pre_r = pre_r + tl.load(ms + n)
            post_r = post_r + tl.load(ms + NH + n)
            comb_r = comb_r + tl.load(ms + 2 * NH + ii * NH + jj)
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

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _hc_head_epilogue_kernel(
        mix_ptr, sq_ptr, scale_ptr, base_ptr, res_ptr, out_ptr, T, H, K, rms_eps, hc_eps, S,
        NH: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, NH)
        sq = tl.load(sq_ptr + row)
        mix = tl.load(mix_ptr + row * NH + n)
        t64 = tl.zeros([], dtype=tl.int64) + T
        for s in range(1, S):
            sq = sq + tl.load(sq_ptr + s * t64 + row)
            mix = mix + tl.load(mix_ptr + s * t64 * NH + row * NH + n)
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



# ------------------------------------------------------------------- split-K variants (opt-in)

if zt.HAVE_TRITON:

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

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _prenorm_splitk_kernel(
        x_ptr, fn_ptr, mix_ptr, sq_ptr, T, K,
        NMIX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        BPS: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
    ):
        """Partial projection + sum of squares of split ``program_id(1)`` (BPS blocks of BK, increasing
        k) for BM rows. The split count, BPS and every constexpr come from K and the variant, never T."""
        pid_m = tl.program_id(0)
        split = tl.program_id(1)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < T
        cols = tl.arange(0, BN)
        cmask = cols < NMIX
        k0 = split * (BPS * BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc_lo = tl.zeros([BM, BN], dtype=tl.float32)
        sq = tl.zeros([BM], dtype=tl.float32)
        x_base = x_ptr + rows[:, None] * K
        w_base = fn_ptr + cols[None, :] * K
        for kb in range(BPS):
            ks = k0 + kb * BK + tl.arange(0, BK)
            if EVEN_K:
                x = tl.load(x_base + ks[None, :], mask=rmask[:, None], other=0.0)
                w = tl.load(w_base + ks[:, None], mask=cmask[None, :], other=0.0)
            else:
                kmask = ks < K
                x = tl.load(x_base + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_base + ks[:, None], mask=cmask[None, :] & kmask[:, None], other=0.0)
            xf = _bf16_to_f32(x, EXACT)
            sq = sq + tl.sum(xf * xf, axis=1)
            if PREC == "bf16x3":
                w1, w2, w3 = _split_bf16x3(w)
                if EXACT:  # interpreter: bf16 tl.dot is wrong there; the products are exact in fp32 anyway
                    acc = tl.dot(xf, w1, acc, input_precision="ieee")
                    acc_lo = tl.dot(xf, w2, acc_lo, input_precision="ieee")
                    acc_lo = tl.dot(xf, w3, acc_lo, input_precision="ieee")
                else:
                    acc = tl.dot(x, w1.to(tl.bfloat16), acc)
                    acc_lo = tl.dot(x, w2.to(tl.bfloat16), acc_lo)
                    acc_lo = tl.dot(x, w3.to(tl.bfloat16), acc_lo)
            else:
                acc = tl.dot(xf, w, acc, input_precision=PREC)
        if PREC == "bf16x3":
            acc = acc + acc_lo
        out = mix_ptr + split.to(tl.int64) * T * NMIX + rows[:, None] * NMIX + cols[None, :]
        tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])
        tl.store(sq_ptr + split.to(tl.int64) * T + rows, sq, mask=rmask)

    @triton.jit
    def _load_split_sum(ptr, offs, smask):
        """Sum over the split axis (axis 0) of a [SP, ...] tile: one tl.sum tree, fixed by SP and the
        launch config (never by T); padded splits load +0."""
        return tl.sum(tl.load(ptr + offs, mask=smask, other=0.0), axis=0)

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
        kf = K.to(tl.float32)
        rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, kf) + rms_eps))
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        pre = _sigmoid_rn((pre_r * rms) * s0 + tl.load(base_ptr + n)) + pre_eps
        post = _sigmoid_rn((post_r * rms) * s1 + tl.load(base_ptr + NH + n)) * post_mult
        c = (comb_r * rms) * s2 + tl.load(base_ptr + 2 * NH + ii * NH + jj)
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


# ------------------------------------------------------------------------------------- validation


def _err(msg: str) -> ValueError:
    return ValueError(f"zerodiff.mhc: {msg}")


def _check_pre(residual, fn, hc_scale, hc_base, sinkhorn_iters, head=False):
    if not isinstance(residual, torch.Tensor) or residual.dim() != 3 or residual.dtype != torch.bfloat16:
        raise _err(f"residual must be a bf16 tensor [T, hc_mult, H]; got "
                   f"{getattr(residual, 'dtype', type(residual))} {tuple(getattr(residual, 'shape', ()))}")
    T, n, H = residual.shape
    if n not in (1, 2, 4):
        raise _err(f"hc_mult (residual.shape[1]) must be 1, 2 or 4 (n*(n+2) mixes fit the kernel's "
                   f"{_GEMM_BN}-wide tile); got {n}")
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


# ------------------------------------------------------------------------------------ the stages


def prenorm_gemm(residual: torch.Tensor, fn: torch.Tensor, *, splits: int = FIXED_SPLITS,
                 _precision: str = _DOT_PRECISION) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton projection + sum of squares: (mix_raw fp32 [S, T, n_mix], sqrsum fp32 [S, T]).

    ``splits`` partitions K into ``splits`` consecutive ranges of whole ``_GEMM_BK`` blocks. The public
    ops always pass :data:`FIXED_SPLITS`; other values exist for the benchmark only."""
    T, n, H = residual.shape
    K = n * H
    nm = fn.shape[0]
    if nm > _GEMM_BN:
        raise _err(f"fn has {nm} rows, more than the kernel's padded width {_GEMM_BN} (hc_mult {n} unsupported)")
    x = residual.contiguous().view(T, K)
    fn = fn.contiguous()
    mix = torch.empty(splits, T, nm, dtype=torch.float32, device=residual.device)
    sq = torch.empty(splits, T, dtype=torch.float32, device=residual.device)
    if T == 0:
        return mix, sq
    k_per_split = triton.cdiv(triton.cdiv(K, _GEMM_BK), splits) * _GEMM_BK
    grid = (triton.cdiv(T, _GEMM_BM), splits)
    _mhc_prenorm_gemm_kernel[grid](
        x, fn, mix, sq, T, K, k_per_split, NMIX=nm, BM=_GEMM_BM, BN=_GEMM_BN, BK=_GEMM_BK,
        PRECISION=_precision, EXACT=zt.EXACT_CASTS, num_warps=_GEMM_WARPS, **zt.LAUNCH_OPTS,
    )
    return mix, sq


def pre_epilogue(mix: torch.Tensor, sq: torch.Tensor, residual: torch.Tensor, hc_scale: torch.Tensor,
                 hc_base: torch.Tensor, *, rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
                 hc_post_mult: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton epilogue: partials (added in split order) -> gates, Sinkhorn, aggregation."""
    S, T, nm = mix.shape
    _, n, H = residual.shape
    dev = residual.device
    li = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if T == 0:
        return li, post, comb
    _mhc_pre_epilogue_kernel[(T,)](
        mix.contiguous(), sq.contiguous(), hc_scale.contiguous(), hc_base.contiguous(),
        residual.contiguous(), li, post, comb, T, H, n * H,
        float(rms_eps), float(hc_pre_eps), float(hc_sinkhorn_eps), float(hc_post_mult), int(sinkhorn_iters),
        S, NH=n, BLOCK_H=_EPI_BLOCK_H, EXACT=zt.EXACT_CASTS, num_warps=_EPI_WARPS, **zt.LAUNCH_OPTS,
    )
    return li, post, comb



# ------------------------------------------------------------------- split-K variants (opt-in)


@dataclass(frozen=True)
class PrenormVariant:
    """One fixed configuration of the pre-norm projection (see the module docstring, "Variants").

    ``splits`` is the requested K-split count; the count used is :func:`variant_splits` of (K, variant):
    a function of the model shape only, never of T. ``precision`` is the per-block product:
    ``"fp32_legacy"`` (the verified default kernels, split count 1), ``"ieee"`` (fp32 FMA), ``"tf32"``,
    ``"tf32x3"`` (tensor cores) or ``"bf16x3"`` (the fp32 weight split exactly into three bf16 pieces,
    three bf16 tensor-core products per block; x is bf16 and exact)."""

    name: str
    splits: int
    precision: str
    block_m: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 3
    epi_warps: int = _EPI_WARPS


def _v(name, splits, precision, **kw):
    return name, PrenormVariant(name, splits, precision, **kw)


#: every selectable configuration of the projection: the shipped default, the split-1 contract, and the
#: runners-up of the H200 sweep of 2026-11-30 (one per precision). Other configurations stay expressible as
#: PrenormVariant(...) objects (the ``variant=`` argument takes either); the names here are the ones the
#: GPU suite verifies and ``--mhc-variant`` offers.
VARIANTS: dict[str, PrenormVariant] = dict([
    _v("fp32_s1", 1, "fp32_legacy", block_m=_GEMM_BM, block_k=_GEMM_BK, warps=_GEMM_WARPS),
    _v("ieee_s112", 112, "ieee", block_m=16),
    # tensor-core variants: 8 warps (AOT sm_90a: 72-76 registers, no spill; 4 warps reached 96-125)
    _v("tf32_s112", 112, "tf32", warps=8),
    _v("bf16x3_s32", 32, "bf16x3", warps=8),
    _v("bf16x3_s112", 112, "bf16x3", warps=8),
    # one-warp epilogue: the Sinkhorn's row/column sums become intra-warp (decode latency); only the
    # split-sum tree depends on the warp count, and it is pinned by the variant
    _v("bf16x3_s112_e1", 112, "bf16x3", warps=8, epi_warps=1),
    _v("tf32_s112_e1", 112, "tf32", warps=8, epi_warps=1),
])

#: the variant mhc_pre / hc_head use when ``variant=None``. Changing it changes values (not invariance)
#: and must be done for rollout and training at once (both import this constant). Chosen from the H200
#: sweep and end-to-end bench of 2026-11-30 (module docstring, "Decision").
DEFAULT_VARIANT = "bf16x3_s112_e1"
DEFAULT_HEAD_VARIANT = "bf16x3_s112_e1"


def _resolve_variant(variant) -> PrenormVariant:
    if variant is None:
        variant = DEFAULT_VARIANT
    if isinstance(variant, PrenormVariant):
        v = variant
    elif isinstance(variant, str) and variant in VARIANTS:
        v = VARIANTS[variant]
    else:
        raise _err(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
    if v.precision not in ("fp32_legacy", "ieee", "tf32", "tf32x3", "bf16x3"):
        raise _err(f"variant {v.name!r}: unknown precision {v.precision!r}")
    if not isinstance(v.splits, int) or v.splits < 1:
        raise _err(f"variant {v.name!r}: splits must be an int >= 1; got {v.splits!r}")
    for f in ("block_m", "block_k"):
        x = getattr(v, f)
        if x < 16 or x & (x - 1):
            raise _err(f"variant {v.name!r}: {f} must be a power of two >= 16; got {x}")
    for f in ("warps", "epi_warps"):
        x = getattr(v, f)
        if x not in (1, 2, 4, 8, 16):
            raise _err(f"variant {v.name!r}: {f} must be 1, 2, 4, 8 or 16; got {x}")
    return v


def variant_splits(K: int, variant) -> tuple[int, int]:
    """(split count, blocks per split) a variant uses for reduction length ``K`` (= n*H).

    Blocks per split = the smallest divisor of ceil(K / block_k) that is >= ceil(blocks / splits), so every
    split holds the same whole number of blocks (no ragged split). Depends on K and the variant only."""
    v = _resolve_variant(variant)
    nblocks = max(1, -(-K // v.block_k))
    bps = -(-nblocks // v.splits)
    while nblocks % bps:
        bps += 1
    return nblocks // bps, bps


def _block_n(nm: int) -> int:
    bn = 16
    while bn < nm:
        bn *= 2
    return bn


def prenorm_gemm_splitk(residual: torch.Tensor, fn: torch.Tensor, variant) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K projection + sum of squares of a variant: (mix fp32 [S, T, nm], sq fp32 [S, T]) with
    S = ``variant_splits(n*H, variant)[0]``. Partial ``s`` covers blocks ``s*bps .. s*bps+bps-1`` in
    increasing k; each block is one ``tl.dot`` (``bf16x3``: three, see the module docstring)."""
    v = _resolve_variant(variant)
    if v.precision == "fp32_legacy":
        return prenorm_gemm(residual, fn, splits=v.splits)
    T, n, H = residual.shape
    K = n * H
    nm = fn.shape[0]
    if nm > 32:
        raise _err(f"fn has {nm} rows, more than 32 (hc_mult {n} unsupported)")
    S, bps = variant_splits(K, v)
    x = residual.contiguous().view(T, K)
    fn = fn.contiguous()
    mix = torch.empty(S, T, nm, dtype=torch.float32, device=residual.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=residual.device)
    if T == 0:
        return mix, sq
    grid = (triton.cdiv(T, v.block_m), S)
    _prenorm_splitk_kernel[grid](
        x, fn, mix, sq, T, K, NMIX=nm, BM=v.block_m, BN=_block_n(nm), BK=v.block_k, BPS=bps,
        EVEN_K=(K % v.block_k == 0), PREC=v.precision, EXACT=zt.EXACT_CASTS,
        num_warps=v.warps, num_stages=v.stages, **zt.LAUNCH_OPTS,
    )
    return mix, sq


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def pre_epilogue_splits(mix: torch.Tensor, sq: torch.Tensor, residual: torch.Tensor, hc_scale: torch.Tensor,
                        hc_base: torch.Tensor, *, rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
                        hc_post_mult: float, sinkhorn_iters: int,
                        epi_warps: int = _EPI_WARPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Epilogue for S partials: all S loaded at once and summed by one fixed ``tl.sum`` tree (pinned by
    S, i.e. by K, and ``epi_warps``), then the gates / Sinkhorn / aggregation of :func:`pre_epilogue`."""
    S, T, nm = mix.shape
    _, n, H = residual.shape
    dev = residual.device
    li = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if T == 0:
        return li, post, comb
    _mhc_pre_epilogue_splits_kernel[(T,)](
        mix.contiguous(), sq.contiguous(), hc_scale.contiguous(), hc_base.contiguous(),
        residual.contiguous(), li, post, comb, T, H, n * H,
        float(rms_eps), float(hc_pre_eps), float(hc_sinkhorn_eps), float(hc_post_mult), int(sinkhorn_iters),
        S=S, SP=_pow2_at_least(S), NH=n, BLOCK_H=_EPI_BLOCK_H, EXACT=zt.EXACT_CASTS, num_warps=epi_warps,
        **zt.LAUNCH_OPTS,
    )
    return li, post, comb


def _hc_head_splits(residual, fn, hc_scale, hc_base, rms_eps, hc_eps, v):
    T, n, H = residual.shape
    mix, sq = prenorm_gemm_splitk(residual, fn, v)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=residual.device)
    if T == 0:
        return out
    S = mix.shape[0]
    _hc_head_epilogue_splits_kernel[(T,)](
        mix, sq, hc_scale.contiguous(), hc_base.contiguous(), residual.contiguous(), out, T, H, n * H,
        float(rms_eps), float(hc_eps), S=S, SP=_pow2_at_least(S), NH=n, BLOCK_H=_EPI_BLOCK_H,
        EXACT=zt.EXACT_CASTS, num_warps=v.epi_warps, **zt.LAUNCH_OPTS,
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
    variant: str | PrenormVariant | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre: (layer_input bf16 [T, H], post fp32 [T, n], comb fp32 [T, n, n]).

    ``residual`` bf16 [T, n, H]; ``fn`` fp32 [n*(n+2), n*H]; ``hc_scale`` fp32 [3]; ``hc_base`` fp32
    [n*(n+2)]. Contract in the module docstring (split count fixed by the model shape, never by T).
    ``variant`` (Triton backend only; None = :data:`DEFAULT_VARIANT`) picks a fixed projection configuration
    from :data:`VARIANTS`."""
    _check_pre(residual, fn, hc_scale, hc_base, sinkhorn_iters)
    be = _pick_backend(backend, residual.device)
    v = _resolve_variant(variant)
    kw = dict(rms_eps=rms_eps, hc_pre_eps=hc_pre_eps, hc_sinkhorn_eps=hc_sinkhorn_eps,
              hc_post_mult=hc_post_mult, sinkhorn_iters=sinkhorn_iters)
    if be == "reference":
        return ref.mhc_pre_ref(residual, fn, hc_scale, hc_base, **kw)
    if v.precision != "fp32_legacy":
        mix, sq = prenorm_gemm_splitk(residual, fn, v)
        return pre_epilogue_splits(mix, sq, residual, hc_scale, hc_base, epi_warps=v.epi_warps, **kw)
    mix, sq = prenorm_gemm(residual, fn, splits=FIXED_SPLITS)
    return pre_epilogue(mix, sq, residual, hc_scale, hc_base, **kw)


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
    variant: str | PrenormVariant | None = None,
) -> torch.Tensor:
    """DeepSeek-V4's final stream collapse (vLLM ``HCHeadOp``): bf16 [T, H].

    ``residual`` bf16 [T, n, H]; ``fn`` fp32 [n, n*H]; ``hc_scale`` fp32 [1]; ``hc_base`` fp32 [n].
    ``pre = sigmoid(mix * rms * hc_scale + hc_base) + hc_eps`` with the same projection, sum of squares,
    normalisation and aggregation contract as :func:`mhc_pre` (split count 1, no Sinkhorn).
    ``variant``: as for :func:`mhc_pre`, None = :data:`DEFAULT_HEAD_VARIANT`."""
    _check_pre(residual, fn, hc_scale, hc_base, 1, head=True)
    be = _pick_backend(backend, residual.device)
    v = _resolve_variant(DEFAULT_HEAD_VARIANT if variant is None else variant)
    if be == "reference":
        return ref.hc_head_ref(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps)
    if v.precision != "fp32_legacy":
        return _hc_head_splits(residual, fn, hc_scale, hc_base, rms_eps, hc_eps, v)
    T, n, H = residual.shape
    mix, sq = prenorm_gemm(residual, fn, splits=FIXED_SPLITS)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=residual.device)
    if T == 0:
        return out
    _hc_head_epilogue_kernel[(T,)](
        mix, sq, hc_scale.contiguous(), hc_base.contiguous(), residual.contiguous(), out, T, H, n * H,
        float(rms_eps), float(hc_eps), FIXED_SPLITS, NH=n, BLOCK_H=_EPI_BLOCK_H, EXACT=zt.EXACT_CASTS,
        num_warps=_EPI_WARPS, **zt.LAUNCH_OPTS,
    )
    return out


# ------------------------------------------------------------------- stock-style baseline (control)


def stock_num_splits(num_tokens: int, k: int, n_sms: int, block_k: int = 64) -> int:
    """vLLM 0.33.0's split count for the mHC pre-norm GEMM (our restatement of ``compute_num_split``
    with ``grid = ceil(T / 64)``): ``max(1, min(n_sms // grid, ceil(k / block_k) // 4))``."""
    grid = max(1, -(-num_tokens // 64))
    return max(1, min(n_sms // grid, (-(-k // block_k)) // 4))


def _default_sms(device) -> int:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H200


def _split_gemm_torch(x: torch.Tensor, fn: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partials kept apart. On the CPU each partial is computed in float64 and rounded once to
    fp32 (so a partial does not depend on the batch: the split count is the only batch dependence left,
    which is what the negative control isolates); on CUDA it is a plain fp32 cuBLAS matmul per split."""
    T, K = x.shape
    acc_dtype = torch.float32 if x.is_cuda else torch.float64
    chunk = -(-(-(-K // 64)) // splits) * 64
    mix = torch.zeros(splits, T, fn.shape[0], dtype=torch.float32, device=x.device)
    sq = torch.zeros(splits, T, dtype=torch.float32, device=x.device)
    for s in range(splits):
        k0, k1 = s * chunk, min((s + 1) * chunk, K)
        if k0 >= k1:
            continue
        xs = x[:, k0:k1].to(acc_dtype)
        mix[s] = (xs @ fn[:, k0:k1].to(acc_dtype).t()).float()
        sq[s] = (xs * xs).sum(-1).float()
    return mix, sq


def mhc_pre_split_baseline(
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
    n_splits: int | None = None,
    n_sms: int | None = None,
    gemm: str = "auto",
    epilogue: str = "auto",
    info: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stock-style mHC pre whose bits depend on the batch: NOT batch-invariant, by design.

    ``n_splits`` defaults to :func:`stock_num_splits` of (T, n*H, SM count) as vLLM computes it. ``gemm``:
    "deepgemm" (DeepGEMM's ``tf32_hc_prenorm_gemm``, vLLM's CUDA path), "torch" (per-split fp32 matmuls,
    partials kept apart), or "auto" (DeepGEMM when importable on a CUDA tensor, else torch). The partials
    are added in split order by ``epilogue`` "triton" (our epilogue kernel) or "torch" (fp32 eager),
    "auto" = triton where it can run. With "auto", a DeepGEMM call that raises falls back to torch.
    ``info`` (optional dict) receives what ran: ``gemm``, ``n_splits``, ``epilogue``, ``deepgemm_error``.
    Returns the same triple as :func:`mhc_pre`."""
    _check_pre(residual, fn, hc_scale, hc_base, sinkhorn_iters)
    T, n, H = residual.shape
    K = n * H
    if n_splits is None:
        n_splits = stock_num_splits(T, K, n_sms or _default_sms(residual.device))
    x = residual.contiguous().view(T, K)
    use_dg = False
    if gemm in ("auto", "deepgemm") and residual.is_cuda:
        from zerodiff import backends

        dg = backends.deep_gemm()
        use_dg = dg is not None and hasattr(dg, "tf32_hc_prenorm_gemm")
        if gemm == "deepgemm" and not use_dg:
            raise _err("gemm='deepgemm' requested but DeepGEMM's tf32_hc_prenorm_gemm is not importable")
    elif gemm not in ("auto", "torch", "deepgemm"):
        raise _err(f"unknown gemm {gemm!r}")
    info = {} if info is None else info
    info["n_splits"] = n_splits
    if use_dg:
        mix = torch.empty(n_splits, T, ref.n_mix(n), dtype=torch.float32, device=residual.device)
        sq = torch.empty(n_splits, T, dtype=torch.float32, device=residual.device)
        try:
            dg.tf32_hc_prenorm_gemm(x, fn.contiguous(), mix, sq, n_splits)
            info["gemm"] = "deepgemm.tf32_hc_prenorm_gemm"
        except Exception as e:  # noqa: BLE001 - baseline only; recorded for the benchmark
            if gemm == "deepgemm":
                raise
            info["deepgemm_error"] = f"{type(e).__name__}: {e}"
            use_dg = False
    if not use_dg:
        mix, sq = _split_gemm_torch(x, fn, n_splits)
        info["gemm"] = "torch per-split matmul"
    kw = dict(rms_eps=rms_eps, hc_pre_eps=hc_pre_eps, hc_sinkhorn_eps=hc_sinkhorn_eps,
              hc_post_mult=hc_post_mult, sinkhorn_iters=sinkhorn_iters)
    if epilogue == "auto":
        epilogue = "triton" if zt.triton_usable_for(residual.device) else "torch"
    info["epilogue"] = epilogue
    if epilogue == "triton":
        return pre_epilogue(mix, sq, residual, hc_scale, hc_base, **kw)
    if epilogue != "torch":
        raise _err(f"unknown epilogue {epilogue!r}")
    return _epilogue_torch(mix, sq, residual, hc_scale, hc_base, **kw)


def _epilogue_torch(mix, sq, residual, hc_scale, hc_base, *, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                    hc_post_mult, sinkhorn_iters):
    """fp32 eager epilogue (partials added in split order), stock torch-style."""
    T, n, H = residual.shape
    m = mix[0].clone()
    s = sq[0].clone()
    for i in range(1, mix.shape[0]):
        m = m + mix[i]
        s = s + sq[i]
    m = m * torch.rsqrt(s / (n * H) + rms_eps).unsqueeze(-1)
    pre = torch.sigmoid(m[:, :n] * hc_scale[0] + hc_base[:n]) + hc_pre_eps
    post = torch.sigmoid(m[:, n : 2 * n] * hc_scale[1] + hc_base[n : 2 * n]) * hc_post_mult
    logits = m[:, 2 * n :].reshape(T, n, n) * hc_scale[2] + hc_base[2 * n :].reshape(1, n, n)
    comb = ref.sinkhorn_ref(logits, sinkhorn_iters, hc_sinkhorn_eps)
    li = (pre.unsqueeze(-1) * residual.float()).sum(dim=1).to(torch.bfloat16)
    return li, post.contiguous(), comb.contiguous()


def mhc_pre_torch_eager(residual, fn, hc_scale, hc_base, *, rms_eps=ref.RMS_EPS, hc_pre_eps=ref.HC_EPS,
                        hc_sinkhorn_eps=ref.HC_EPS, hc_post_mult=ref.POST_MULT,
                        sinkhorn_iters=ref.SINKHORN_ITERS):
    """Plain fp32 torch eager mHC pre (vLLM's ``forward_native`` style): a benchmark reference point."""
    return ref.mhc_pre_ref(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps,
                           hc_sinkhorn_eps=hc_sinkhorn_eps, hc_post_mult=hc_post_mult,
                           sinkhorn_iters=sinkhorn_iters, dtype=torch.float32)
