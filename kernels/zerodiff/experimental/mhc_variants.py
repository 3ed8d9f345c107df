"""mHC pre-norm projection variants that did not ship: other split counts, product precisions and epilogue widths.

API
---
* :class:`PrenormVariant` (one fixed configuration) and :data:`VARIANTS` (the named ones the GPU tests verify
  and ``zerodiff check|bench|locate --mhc-variant`` offers); any ``PrenormVariant`` object is accepted too;
  :data:`SHIPPED` is the shipped configuration as a variant (for comparisons).
* :func:`variant_splits` ``(K, variant) -> (S, blocks per split)``.
* :func:`prenorm_gemm_splitk` ``(residual, fn, variant) -> (mix fp32 [S, T, n_mix], sq fp32 [S, T])``.
* :func:`mhc_pre` / :func:`hc_head`: ``zerodiff.ops.mhc``'s signatures plus a required ``variant=``.

Contract: that of ``zerodiff.ops.mhc`` with the projection configuration replaced. Each variant is ONE
configuration per model shape:

* Split count ``S = variant_splits(n*H, variant)[0]``: the requested count rounded so every split holds the
  same whole number of ``block_k``-blocks (``zerodiff.ops.mhc.split_count``). A function of K only, never of
  T: any S fixed by the model shape is as batch-invariant as the shipped one.
* Products per block by ``precision``: ``"bf16x3"`` is the shipped kernel (exact three-piece bf16 weight
  split) under another split count / tiling; ``"ieee"`` one fp32 FMA ``tl.dot`` (no tensor cores);
  ``"tf32"`` tensor cores with the fp32 weights rounded to TF32 (x is bf16: exact in TF32), the precision
  upstream serves with; ``"tf32x3"`` Triton's 3-pass TF32 (x's low part is zero, so one pass is wasted).
  Rows are tiled ``block_m`` at a time; no value crosses rows.
* Epilogue: the shipped epilogue kernels at ``epi_warps`` warps. The Sinkhorn's row / column sums extract
  one element at a time (exact), so only the split-sum tree depends on ``epi_warps``.
* Values differ from the shipped ones in the last bits (another summation order; TF32 also in accuracy:
  the weights keep 10 explicit mantissa bits, so the projection error is up to ~1e-3 of sum|x*w| against
  fp32-class ~1e-6 for the others). Running a variant is a contract change that rollout and training must
  make together.

Bad input raises the ``ValueError``s of ``zerodiff.ops.mhc`` plus: an unknown variant name, or a
``PrenormVariant`` with a bad split count, precision, block size or warp count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodiff import _triton as zt
from zerodiff.ops import mhc as _mhc
from zerodiff.reference import mhc as ref

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    from zerodiff.ops.mhc import _bf16_to_f32, _load_prenorm_block, prenorm_program_tile, store_prenorm_partial

__all__ = ["PrenormVariant", "VARIANTS", "SHIPPED", "variant_splits", "prenorm_gemm_splitk", "mhc_pre", "hc_head"]

PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16x3")

# ----------------------------------------------------------------------------------------- kernels

if zt.HAVE_TRITON:

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _prenorm_splitk_dot_kernel(
        x_ptr, fn_ptr, mix_ptr, sq_ptr, T, K,
        NMIX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        BPS: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
    ):
        """Partial projection + sum of squares of split ``program_id(1)`` (BPS blocks of BK, increasing k)
        for BM rows, one ``tl.dot`` per block at ``input_precision=PREC``. The split count, BPS and every
        constexpr come from K and the variant, never from T."""
        split, rows, rmask, cols, cmask, k0 = prenorm_program_tile(T, NMIX, BM, BN, BK, BPS)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        sq = tl.zeros([BM], dtype=tl.float32)
        x_base = x_ptr + rows[:, None] * K
        w_base = fn_ptr + cols[None, :] * K
        for kb in range(BPS):
            ks = k0 + kb * BK + tl.arange(0, BK)
            x, w = _load_prenorm_block(x_base, w_base, ks, rmask, cmask, K, EVEN_K)
            xf = _bf16_to_f32(x, EXACT)
            sq = sq + tl.sum(xf * xf, axis=1)
            acc = tl.dot(xf, w, acc, input_precision=PREC)
        store_prenorm_partial(mix_ptr, sq_ptr, split, T, rows, rmask, cols, cmask, acc, sq, NMIX)


# ---------------------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class PrenormVariant:
    """One fixed configuration of the pre-norm projection.

    ``splits`` is the requested K-split count; the count used is :func:`variant_splits` of (K, variant): a
    function of the model shape only, never of T. ``precision``: one of :data:`PRECISIONS` (module
    docstring). ``epi_warps``: warps of the epilogue launch."""

    name: str
    splits: int
    precision: str
    block_m: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 3
    epi_warps: int = 4


def _v(name, splits, precision, **kw):
    return name, PrenormVariant(name, splits, precision, **kw)


#: the named runners-up (one or two per precision). Other configurations stay expressible as PrenormVariant
#: objects (the ``variant`` argument takes either).
VARIANTS: dict[str, PrenormVariant] = dict([
    _v("ieee_s112", 112, "ieee", block_m=16),
    # tensor-core variants: 8 warps (4 warps use more registers per thread for the same tile)
    _v("tf32_s112", 112, "tf32", warps=8),
    _v("bf16x3_s32", 32, "bf16x3", warps=8),
    _v("bf16x3_s112", 112, "bf16x3", warps=8),
    # one-warp epilogue: the Sinkhorn's row/column sums become intra-warp; only the split-sum tree depends on
    # the warp count, and it is pinned by the variant
    _v("tf32_s112_e1", 112, "tf32", warps=8, epi_warps=1),
])


#: the shipped configuration (``zerodiff.ops.mhc``) expressed as a variant, for comparisons in benchmarks and
#: tests; derived from the shipped module's constants and deliberately not in :data:`VARIANTS`
SHIPPED = PrenormVariant(_mhc.DEFAULT_VARIANT, _mhc.SPLITS, "bf16x3", block_m=_mhc._BLOCK_M,
                         block_k=_mhc._BLOCK_K, warps=_mhc._GEMM_WARPS, stages=_mhc._GEMM_STAGES,
                         epi_warps=_mhc._EPI_WARPS)


def _resolve_variant(variant) -> PrenormVariant:
    if isinstance(variant, PrenormVariant):
        v = variant
    elif isinstance(variant, str) and variant in VARIANTS:
        v = VARIANTS[variant]
    else:
        raise _mhc._err(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
    if v.precision not in PRECISIONS:
        raise _mhc._err(f"variant {v.name!r}: unknown precision {v.precision!r}")
    if not isinstance(v.splits, int) or v.splits < 1:
        raise _mhc._err(f"variant {v.name!r}: splits must be an int >= 1; got {v.splits!r}")
    for f in ("block_m", "block_k"):
        x = getattr(v, f)
        if x < 16 or x & (x - 1):
            raise _mhc._err(f"variant {v.name!r}: {f} must be a power of two >= 16; got {x}")
    for f in ("warps", "epi_warps"):
        x = getattr(v, f)
        if x not in (1, 2, 4, 8, 16):
            raise _mhc._err(f"variant {v.name!r}: {f} must be 1, 2, 4, 8 or 16; got {x}")
    return v


def variant_splits(K: int, variant) -> tuple[int, int]:
    """(split count, blocks per split) a variant uses for reduction length ``K`` (= n*H)."""
    v = _resolve_variant(variant)
    return _mhc.split_count(K, v.splits, v.block_k)


# --------------------------------------------------------------------------------------- launchers


def prenorm_gemm_splitk(residual: torch.Tensor, fn: torch.Tensor, variant) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K projection + sum of squares of a variant: (mix fp32 [S, T, nm], sq fp32 [S, T]) with
    S = ``variant_splits(n*H, variant)[0]``. Partial ``s`` covers blocks ``s*bps .. s*bps+bps-1`` in
    increasing k."""
    v = _resolve_variant(variant)
    if v.precision == "bf16x3":
        return _mhc._prenorm_gemm(residual, fn, splits=v.splits, block_m=v.block_m, block_k=v.block_k,
                                  warps=v.warps, stages=v.stages)
    T, n, H = residual.shape
    K = n * H
    nm = fn.shape[0]
    if nm > _mhc._MAX_MIX:
        raise _mhc._err(f"fn has {nm} rows, more than {_mhc._MAX_MIX} (hc_mult {n} unsupported)")
    S, bps = variant_splits(K, v)
    x = residual.contiguous().view(T, K)
    fn = fn.contiguous()
    mix = torch.empty(S, T, nm, dtype=torch.float32, device=residual.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=residual.device)
    if T == 0:
        return mix, sq
    grid = (triton.cdiv(T, v.block_m), S)
    _prenorm_splitk_dot_kernel[grid](
        x, fn, mix, sq, T, K, NMIX=nm, BM=v.block_m, BN=_mhc._block_n(nm), BK=v.block_k, BPS=bps,
        EVEN_K=(K % v.block_k == 0), PREC=v.precision, EXACT=zt.EXACT_CASTS,
        num_warps=v.warps, num_stages=v.stages, **zt.LAUNCH_OPTS,
    )
    return mix, sq


# ------------------------------------------------------------------------------------ public ops


def mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    variant: str | PrenormVariant,
    rms_eps: float = ref.RMS_EPS,
    hc_pre_eps: float = ref.HC_EPS,
    hc_sinkhorn_eps: float = ref.HC_EPS,
    hc_post_mult: float = ref.POST_MULT,
    sinkhorn_iters: int = ref.SINKHORN_ITERS,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``zerodiff.ops.mhc.mhc_pre`` with the projection of ``variant`` (a :data:`VARIANTS` name or a
    :class:`PrenormVariant`); the reference backend ignores the variant."""
    _mhc._check_pre(residual, fn, hc_scale, hc_base, sinkhorn_iters)
    be = _mhc._pick_backend(backend, residual.device)
    v = _resolve_variant(variant)
    kw = dict(rms_eps=rms_eps, hc_pre_eps=hc_pre_eps, hc_sinkhorn_eps=hc_sinkhorn_eps,
              hc_post_mult=hc_post_mult, sinkhorn_iters=sinkhorn_iters)
    if be == "reference":
        return ref.mhc_pre_ref(residual, fn, hc_scale, hc_base, **kw)
    mix, sq = prenorm_gemm_splitk(residual, fn, v)
    return _mhc._pre_epilogue(mix, sq, residual, hc_scale, hc_base, warps=v.epi_warps, **kw)


def hc_head(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    variant: str | PrenormVariant,
    rms_eps: float = ref.RMS_EPS,
    hc_eps: float = ref.HC_EPS,
    backend: str | None = None,
) -> torch.Tensor:
    """``zerodiff.ops.mhc.hc_head`` with the projection of ``variant``."""
    _mhc._check_pre(residual, fn, hc_scale, hc_base, 1, head=True)
    be = _mhc._pick_backend(backend, residual.device)
    v = _resolve_variant(variant)
    if be == "reference":
        return ref.hc_head_ref(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps)
    mix, sq = prenorm_gemm_splitk(residual, fn, v)
    return _mhc._hc_head_epilogue(mix, sq, residual, hc_scale, hc_base, rms_eps, hc_eps, v.epi_warps)
