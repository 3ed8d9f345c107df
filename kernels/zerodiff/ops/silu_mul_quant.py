"""SiLU(gate) * up with ONE rounding to BF16, optionally followed by per-token-group FP8 quantisation.

Public API::

    silu_mul(x, *, clamp_limit=None, backend=None) -> bf16 [M, N]
    silu_mul_quant_fp8(x, *, group=128, clamp_limit=None, ue8m0=False, backend=None)
        -> (q float8_e4m3fn [M, N], scale fp32 [M, N // group])
    silu_mul_quant_fp8_masked(x, counts, *, group=128, clamp_limit=None, ue8m0=False, backend=None)
        -> (q float8_e4m3fn [E, C, N], scale fp32 [E, C, N // group])

Numerical contract (the reference is :mod:`zerodiff.reference.silu_mul_quant`):

* ``x`` is BF16 ``[M, 2N]`` (contiguous layout, training and most of the rollout) or ``[E, C, 2N]`` with
  ``counts`` int32 ``[E]`` (masked layout, DeepEP low-latency rollout); gate = first N columns, up = last N.
  The last dimension must be contiguous (stride 1); row strides are free.
* Per element, in FP32, as separate IEEE operations with FMA contraction pinned off:
  optional clamp ``g = min(g, L)``, ``u = min(max(u, -L), L)`` (``L = fp32(clamp_limit)``, vLLM
  ``SiluAndMulWithClamp`` semantics: the gate is clamped from above before the SiLU);
  ``e = exp(-g)`` (Triton ``tl.exp``: the GPU's approximate exp; numpy's on the interpreter);
  ``d = 1 + e``; ``s = div_rn(g, d)``; ``p = s * u``; then ONE round-to-nearest-even to BF16.
  Gates below about -88.7 give ``e = inf`` and ``s = -0`` (the true value is below 1e-36 in magnitude). inf/NaN inputs are not part of
  the contract (IEEE propagation, unspecified clamp order).
* FP8: per token, groups of ``group`` consecutive output columns (``N % group == 0`` required):
  ``amax`` of the BF16 values in FP32, ``scale = div_rn(max(amax, 1e-10), 448)`` (``ue8m0``: rounded up
  to a power of two on the bits), ``q = e4m3(div_rn(v, scale))`` RNE, saturating at +-448. Bit-identical
  to :func:`zerodiff.reference.fp8_quant.quant_per_token_group_ref` applied to :func:`silu_mul`'s output.
* Invariance: every output row depends only on that row's input (elementwise math + a per-row group max,
  which is exact). Tiling is chosen from N only. Masked and contiguous layouts run the same kernel body
  (only the row -> address mapping and the validity test differ), so a valid masked row is bit-identical
  to the same row in the contiguous layout. Masked rows ``c >= counts[e]`` are never read and come back
  as zero codes and zero scales; negative counts mean no valid rows, counts above C mean all rows.

Bad inputs raise ``InputError`` (a TypeError and a ValueError) naming the argument: non-BF16 ``x``, odd last dim,
non-contiguous last dim, ``N`` not a multiple of ``group``, ``group`` not a power of two in [16, 1024],
non-positive or non-finite ``clamp_limit``, ``counts`` not int32 ``[E]`` on ``x``'s device.
"""

from __future__ import annotations

import math

import torch

from .. import _triton as zt
from ..errors import InputError
from ..reference.silu_mul_quant import (
    silu_mul_quant_fp8_masked_ref,
    silu_mul_quant_fp8_ref,
    silu_mul_ref,
)

__all__ = ["silu_mul", "silu_mul_quant_fp8", "silu_mul_quant_fp8_masked"]

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    cast_bf16 = zt.cast_bf16
    cast_e4m3 = zt.cast_e4m3

    bf16_to_f32 = zt.bf16_to_f32

    # one binary for every row count: the row count and the per-expert strides (which scale with it) are not
    # specialised (Triton would otherwise compile C == 1 and C % 16 == 0 separately)
    @triton.jit(do_not_specialize=["C", "sx_e", "so_e", "ss_e"])
    def _silu_mul_kernel(x_ptr, o_ptr, s_ptr, cnt_ptr, C, N, limit,
                         sx_e, sx_c, so_e, so_c, ss_e, ss_c,
                         MASKED: tl.constexpr, QUANT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                         UE8M0: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr,
                         EXACT: tl.constexpr):
        # row addressing: contiguous = one "expert" of C = M rows; masked = E experts of C rows
        row = tl.program_id(0)
        e = row // C
        c = row - e * C
        if MASKED:
            valid = c < tl.load(cnt_ptr + e)
        else:
            valid = c >= 0
        e64 = e.to(tl.int64)
        c64 = c.to(tl.int64)
        gi = tl.program_id(1) * GPP + tl.arange(0, GPP)  # group (column block) indices of this program
        cols = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        cmask = cols < N
        lmask = cmask & valid
        xrow = x_ptr + e64 * sx_e + c64 * sx_c
        g = bf16_to_f32(tl.load(xrow + cols, mask=lmask, other=0.0), EXACT)
        u = bf16_to_f32(tl.load(xrow + N + cols, mask=lmask, other=0.0), EXACT)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        ex = tl.exp(-g)
        s = tl.div_rn(g, 1.0 + ex)
        p = s * u
        h = cast_bf16(p, EXACT)
        orow = o_ptr + e64 * so_e + c64 * so_c
        if QUANT:
            v = bf16_to_f32(h, EXACT)
            amax = tl.max(tl.abs(v), axis=1)
            scale = tl.div_rn(tl.maximum(amax, 1e-10), 448.0)
            if UE8M0:
                bits = scale.to(tl.uint32, bitcast=True)
                ebits = bits & 0x7F800000
                ebits = tl.where((bits & 0x007FFFFF) != 0, ebits + 0x00800000, ebits)
                scale = ebits.to(tl.float32, bitcast=True)
            qv = cast_e4m3(tl.div_rn(v, scale[:, None]), EXACT).to(tl.uint8, bitcast=True)
            qv = tl.where(valid, qv, 0).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            scale = tl.where(valid, scale, 0.0)
            tl.store(orow + cols, qv, mask=cmask)
            srow = s_ptr + e64 * ss_e + c64 * ss_c
            tl.store(srow + gi, scale, mask=gi * GROUP < N)
        else:
            h = tl.where(valid, h, 0.0)
            tl.store(orow + cols, h, mask=cmask)

_NUM_WARPS = 4
_MAX_COLS_PER_PROGRAM = 1024


def _config(N: int, group: int) -> tuple[int, int]:
    """(GROUP, groups per program): a column tiling chosen from N (and the quant group) only."""
    G = triton.cdiv(N, group)
    gpp = min(triton.next_power_of_2(G), max(1, _MAX_COLS_PER_PROGRAM // group))
    return group, gpp


def _check_x(x: torch.Tensor, ndim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name}: x must be a torch.Tensor")
    if x.dtype != torch.bfloat16:
        raise InputError(f"{name}: x must be bfloat16 (gate | up), got {x.dtype}")
    if x.dim() != ndim:
        raise InputError(f"{name}: x must have {ndim} dims, got shape {tuple(x.shape)}")
    if x.shape[-1] % 2 or x.shape[-1] == 0:
        raise InputError(f"{name}: last dim of x must be even and > 0 (gate | up), got {x.shape[-1]}")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise InputError(f"{name}: the last dim of x must be contiguous (stride 1), got stride {x.stride(-1)}")
    return x.shape[-1] // 2


def _check_group(N: int, group: int, name: str) -> None:
    if not isinstance(group, int) or group < 16 or group > 1024 or group & (group - 1):
        raise InputError(f"{name}: group must be a power of two in [16, 1024], got {group!r}")
    if N % group:
        raise InputError(f"{name}: N={N} (half the last dim of x) must be a multiple of group={group}")


def _check_limit(clamp_limit, name: str) -> None:
    if clamp_limit is None:
        return
    v = float(clamp_limit)
    if not (math.isfinite(v) and v > 0):
        raise InputError(f"{name}: clamp_limit must be a positive finite number or None, got {clamp_limit!r}")


def _backend(x: torch.Tensor, backend: str | None, name: str) -> str:
    return zt.pick_backend(name, backend, x.device)


def _launch(x, counts, out, scale, E, C, sx, so, ss, masked, quant, clamp_limit, ue8m0, group):
    """One launch; ``sx``/``so``/``ss`` are (expert, row) strides (no tensor views: low host overhead)."""
    if E * C == 0:
        return
    N = x.shape[-1] // 2
    GROUP, GPP = _config(N, group)
    grid = (E * C, triton.cdiv(triton.cdiv(N, GROUP), GPP))
    _silu_mul_kernel[grid](
        x, out, scale if quant else out, counts if masked else x, C, N,
        float(clamp_limit) if clamp_limit is not None else 0.0,
        sx[0], sx[1], so[0], so[1], ss[0], ss[1],
        MASKED=masked, QUANT=quant, HAS_LIMIT=clamp_limit is not None, UE8M0=bool(ue8m0),
        GROUP=GROUP, GPP=GPP, EXACT=zt.EXACT_CASTS, num_warps=_NUM_WARPS, **zt.LAUNCH_OPTS)


def silu_mul(x: torch.Tensor, *, clamp_limit: float | None = None, backend: str | None = None) -> torch.Tensor:
    """``bf16(silu(gate) * up)`` with one rounding; ``x`` bf16 ``[M, 2N]`` -> bf16 ``[M, N]``."""
    name = "silu_mul"
    N = _check_x(x, 2, name)
    _check_limit(clamp_limit, name)
    if _backend(x, backend, name) == "reference":
        return silu_mul_ref(x, clamp_limit)
    M = x.shape[0]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    _launch(x, None, out, None, 1, M, (0, x.stride(0)), (0, N), (0, 0), False, False, clamp_limit, False, 128)
    return out


def silu_mul_quant_fp8(x: torch.Tensor, *, group: int = 128, clamp_limit: float | None = None,
                       ue8m0: bool = False, backend: str | None = None):
    """``x`` bf16 ``[M, 2N]`` -> (``q`` e4m3 ``[M, N]``, ``scale`` fp32 ``[M, N // group]``)."""
    name = "silu_mul_quant_fp8"
    N = _check_x(x, 2, name)
    _check_group(N, group, name)
    _check_limit(clamp_limit, name)
    if _backend(x, backend, name) == "reference":
        return silu_mul_quant_fp8_ref(x, group, clamp_limit, ue8m0)
    M = x.shape[0]
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, N // group), dtype=torch.float32, device=x.device)
    G = N // group
    _launch(x, None, q, scale, 1, M, (0, x.stride(0)), (0, N), (0, G), False, True, clamp_limit, ue8m0, group)
    return q, scale


def silu_mul_quant_fp8_masked(x: torch.Tensor, counts: torch.Tensor, *, group: int = 128,
                              clamp_limit: float | None = None, ue8m0: bool = False,
                              backend: str | None = None):
    """Masked layout: ``x`` bf16 ``[E, C, 2N]``, ``counts`` int32 ``[E]`` -> (``q [E, C, N]``,
    ``scale [E, C, N // group]``); rows ``c >= counts[e]`` are not read and are zero."""
    name = "silu_mul_quant_fp8_masked"
    N = _check_x(x, 3, name)
    _check_group(N, group, name)
    _check_limit(clamp_limit, name)
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 or counts.dim() != 1 \
            or counts.shape[0] != x.shape[0]:
        raise InputError(f"{name}: counts must be an int32 tensor of shape [E]={x.shape[0]}, got "
                         f"{getattr(counts, 'dtype', type(counts))} {tuple(getattr(counts, 'shape', ()))}")
    if counts.device != x.device:
        raise InputError(f"{name}: counts is on {counts.device} but x is on {x.device}")
    if _backend(x, backend, name) == "reference":
        return silu_mul_quant_fp8_masked_ref(x, counts, group, clamp_limit, ue8m0)
    E, C, _ = x.shape
    q = torch.empty((E, C, N), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((E, C, N // group), dtype=torch.float32, device=x.device)
    G = N // group
    _launch(x, counts, q, scale, E, C, (x.stride(0), x.stride(1)), (C * N, N), (C * G, G), True, True,
            clamp_limit, ue8m0, group)
    return q, scale
