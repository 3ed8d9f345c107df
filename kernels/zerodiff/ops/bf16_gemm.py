"""Fixed-order BF16 GEMM for small projections and the LM head: ``x bf16 [M, K] x w bf16 [N, K]^T``.

Numerical contract:

* FP32 accumulation. The configuration (tiles, warps, stages, split count) is a function of (N, K) only
  (:func:`gemm_config`), never of M. Each program owns a BLOCK_M x BLOCK_N output tile and one K range
  ``[s * K_PER_SPLIT, (s+1) * K_PER_SPLIT)``; inside it K is walked in ascending BLOCK_K steps with the MMA
  accumulating into the FP32 tile (``acc = dot(x_blk, w_blk, acc)``).
* With ``SPLIT > 1`` (chosen from (N, K) only, to fill the GPU when N is small) the FP32 partials are
  written to a workspace and summed by a second kernel in split order ``((p0 + p1) + p2) + ...`` starting
  from +0, then rounded once to ``out_dtype``. With ``SPLIT == 1`` the tile is rounded once and stored.
* Rows outside M are masked to zero and never stored; ``M`` is not specialised by the JIT, so a row's
  result is independent of M, its position and the other rows.
* On the Triton interpreter (CPU) each BLOCK_K partial is computed exactly in float64 and rounded to FP32
  before it is added (the interpreter's bf16 dot is broken and numpy's fp32 matmul order is unspecified).

Public API::

    bf16_gemm(x, w, *, out_dtype=torch.bfloat16, backend=None) -> [M, N]
    gemm_config(N, K) -> dict(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, K_PER_SPLIT, num_warps, num_stages)

Backends: ``None`` (Triton on CUDA, reference on CPU), ``"triton"``, ``"reference"``
(:func:`zerodiff.reference.bf16_gemm.bf16_gemm_ref`, float64 accumulation).
"""

from __future__ import annotations

import torch

from .. import _triton
from .._triton import EXACT_CASTS, HAVE_TRITON, LAUNCH_OPTS
from ..reference.bf16_gemm import bf16_gemm_ref
from ..errors import InputError

#: programs per M tile the split targets (a constant, never derived from M or the device)
_TARGET_PROGRAMS = 64
_MAX_SPLIT = 16
_MIN_K_PER_SPLIT = 256

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton import cast_bf16

    @triton.jit(do_not_specialize=["M"])
    def _bf16_gemm_kernel(x_ptr, w_ptr, c_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_cs, stride_cm,
                          OUT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(K, k_start + K_PER_SPLIT)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if EXACT:
                acc = acc + tl.dot(x.to(tl.float32).to(tl.float64), w.to(tl.float32).to(tl.float64)).to(tl.float32)
            else:
                acc = tl.dot(x, w, acc, out_dtype=tl.float32)
        c_ptrs = c_ptr + pid_s.to(tl.int64) * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
        c_mask = m_mask[:, None] & n_mask[None, :]
        if OUT_BF16:
            tl.store(c_ptrs, cast_bf16(acc, EXACT), mask=c_mask)
        else:
            tl.store(c_ptrs, acc, mask=c_mask)

    @triton.jit
    def _split_reduce_kernel(p_ptr, c_ptr, numel, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr,
                             BLOCK: tl.constexpr, EXACT: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc = acc + tl.load(p_ptr + s * numel + offs, mask=mask, other=0.0)
        if OUT_BF16:
            tl.store(c_ptr + offs, cast_bf16(acc, EXACT), mask=mask)
        else:
            tl.store(c_ptr + offs, acc, mask=mask)


def gemm_config(N: int, K: int) -> dict:
    """The one configuration for an (N, K) weight (never depends on M)."""
    BLOCK_M, BLOCK_K = 64, 64
    BLOCK_N = 64 if N <= 512 else 128
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    k_blocks = max(1, (K + BLOCK_K - 1) // BLOCK_K)
    split = max(1, min(_MAX_SPLIT, _TARGET_PROGRAMS // n_tiles, K // _MIN_K_PER_SPLIT))
    k_per_split = ((k_blocks + split - 1) // split) * BLOCK_K
    split = max(1, (K + k_per_split - 1) // k_per_split)
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=split, K_PER_SPLIT=k_per_split,
                num_warps=4, num_stages=3)


def _launch(x, w, out_dtype, cfg=None):
    M, K = x.shape
    N = w.shape[0]
    cfg = cfg or gemm_config(N, K)
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    split = cfg["SPLIT"]
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), split)
    common = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EXACT=EXACT_CASTS,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **LAUNCH_OPTS)
    if split == 1:
        _bf16_gemm_kernel[grid](x, w, out, M, N, K, cfg["K_PER_SPLIT"], x.stride(0), w.stride(0), 0, out.stride(0),
                                OUT_BF16=out_dtype == torch.bfloat16, **common)
        return out
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _bf16_gemm_kernel[grid](x, w, part, M, N, K, cfg["K_PER_SPLIT"], x.stride(0), w.stride(0), part.stride(0),
                            part.stride(1), OUT_BF16=False, **common)
    BLOCK = 1024
    _split_reduce_kernel[(triton.cdiv(M * N, BLOCK),)](part, out, M * N, SPLIT=split,
                                                       OUT_BF16=out_dtype == torch.bfloat16, BLOCK=BLOCK,
                                                       EXACT=EXACT_CASTS, num_warps=4, **LAUNCH_OPTS)
    return out


def _check(x, w, name="bf16_gemm"):
    if x.dim() != 2 or w.dim() != 2:
        raise InputError(f"zerodiff.{name}: x and w must be 2-D, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise InputError(f"zerodiff.{name}: x and w must be bf16, got {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[1]:
        raise InputError(f"zerodiff.{name}: K mismatch: x has K={x.shape[1]}, w has K={w.shape[1]}")
    if x.device != w.device:
        raise InputError(f"zerodiff.{name}: x on {x.device}, w on {w.device}")


def _pick(backend, t, name):
    return _triton.pick_backend(f"zerodiff.{name}", backend, t.device)


def bf16_gemm(x: torch.Tensor, w: torch.Tensor, *, out_dtype=torch.bfloat16, backend=None) -> torch.Tensor:
    """``x bf16 [M, K] x w bf16 [N, K]^T -> out_dtype [M, N]``, fixed order (see module contract)."""
    _check(x, w)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise InputError(f"zerodiff.bf16_gemm: out_dtype must be bf16 or fp32, got {out_dtype}")
    if _pick(backend, x, "bf16_gemm") == "reference":
        return bf16_gemm_ref(x, w, out_dtype)
    return _launch(x, w, out_dtype)
