"""Reference for SiLU(gate) * up with one rounding, and its FP8 per-token-group quantisation.

Contract (input ``x`` BF16 ``[..., 2N]``, gate = ``x[..., :N]``, up = ``x[..., N:]``):

1. ``g = float(gate)``, ``u = float(up)`` (exact widening).
2. Optional SwiGLU clamp with limit ``L`` (vLLM ``SiluAndMulWithClamp`` semantics, as used by DeepSeek-V4's
   ``swiglu_limit``): ``g = min(g, L)`` (gate clamped from above only, *before* the SiLU) and
   ``u = min(max(u, -L), L)``. ``L`` is a positive finite float, taken as FP32.
3. ``h = silu(g) * u`` with ``silu(g) = g / (1 + exp(-g))``, rounded **once** to BF16 (round to nearest even).
   No intermediate BF16 rounding (stock ``F.silu(g) * u`` on BF16 tensors rounds twice: after the SiLU and
   after the product).
4. FP8 variants: ``h`` (the BF16 values) goes through the deployment rule of
   :mod:`zerodiff.reference.fp8_quant` per token in groups of ``group`` (default 128) columns:
   ``scale = max(amax, 1e-10) / 448`` (FP32, RNE; optionally rounded up to a power of two, ``ue8m0``),
   ``q = e4m3(h / scale)`` RNE, saturating.

Two references for step 3:

* :func:`silu_mul_ref` states the math: float64 arithmetic, then one exact round-to-nearest-even to BF16
  (through :func:`f64_to_bf16_rne`, which avoids the float64 -> float32 -> bf16 double rounding).
  The GPU kernel computes in FP32 with the GPU's approximate ``exp``; it is compared to this reference
  with a tolerance (at most 1 BF16 ulp apart), while its invariance claims are bitwise.
* :func:`silu_mul_fp32_mirror` replays the kernel's FP32 operation sequence exactly
  (``e = exp(-g)``; ``d = 1 + e``; ``s = g / d``; ``p = s * u``; each step one FP32 RNE operation, no FMA)
  with a pluggable FP32 ``exp``. With numpy's float32 ``exp`` (what Triton's CPU interpreter uses for
  ``tl.exp``) it must match the interpreted kernel bit for bit.

Masked layout (``[E, C, 2N]`` with ``counts[E]``): row ``c`` of expert ``e`` is valid when
``c < counts[e]``; valid rows give exactly the contiguous result for the same row; invalid rows are
zeros (codes and scales).
"""

from __future__ import annotations

import numpy as np
import torch

from .fp8_quant import quant_per_token_group_ref
from ..errors import InputError

__all__ = [
    "f64_to_bf16_rne",
    "silu_mul_ref",
    "silu_mul_fp32_mirror",
    "silu_mul_two_roundings",
    "silu_mul_quant_fp8_ref",
    "silu_mul_quant_fp8_masked_ref",
]


def f64_to_bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 with a single round-to-nearest-even (exact, including subnormals and overflow).

    torch converts float64 to bf16 through float32, which can round twice. Here float64 is first
    rounded to float32 *to odd* (truncate, then set the last bit when inexact); with 16 spare bits the
    following RNE to bf16 is then the correctly rounded result.
    """
    x = x.to(torch.float64)
    f = x.to(torch.float32)
    back = f.to(torch.float64)
    inexact = (back != x) & ~torch.isnan(x)
    bits = f.view(torch.int32).clone()
    too_big = inexact & (back.abs() > x.abs())  # RNE went away from zero (or to inf): step back
    bits = torch.where(too_big, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32).to(torch.bfloat16)


def _split(x: torch.Tensor):
    if x.dtype != torch.bfloat16:
        raise InputError(f"silu_mul reference: x must be bfloat16, got {x.dtype}")
    if x.shape[-1] % 2:
        raise InputError(f"silu_mul reference: last dim must be even (gate | up), got {x.shape[-1]}")
    n = x.shape[-1] // 2
    return x[..., :n], x[..., n:]


def silu_mul_ref(x: torch.Tensor, clamp_limit: float | None = None) -> torch.Tensor:
    """``bf16(silu(g) * u)`` computed in float64, rounded once (see the module docstring)."""
    gate, up = _split(x)
    g = gate.to(torch.float64)
    u = up.to(torch.float64)
    if clamp_limit is not None:
        lim = float(np.float32(clamp_limit))
        g = torch.clamp(g, max=lim)
        u = torch.clamp(u, min=-lim, max=lim)
    h = g / (1.0 + torch.exp(-g)) * u
    return f64_to_bf16_rne(h)


def silu_mul_fp32_mirror(x: torch.Tensor, clamp_limit: float | None = None, exp=None) -> torch.Tensor:
    """The kernel's exact FP32 operation sequence, with ``exp`` an FP32 -> FP32 numpy function
    (default ``numpy.exp`` on float32, what Triton's interpreter runs for ``tl.exp``)."""
    gate, up = _split(x)
    g = gate.float().cpu().numpy()
    u = up.float().cpu().numpy()
    exp = np.exp if exp is None else exp
    with np.errstate(over="ignore", invalid="ignore"):
        if clamp_limit is not None:
            lim = np.float32(clamp_limit)
            g = np.minimum(g, lim)
            u = np.minimum(np.maximum(u, -lim), lim)
        e = exp(-g).astype(np.float32)
        d = np.float32(1.0) + e
        s = (g / d).astype(np.float32)
        p = (s * u).astype(np.float32)
    return torch.from_numpy(p).to(torch.bfloat16).to(x.device)


def silu_mul_two_roundings(x: torch.Tensor, clamp_limit: float | None = None) -> torch.Tensor:
    """The stock BF16 path (``F.silu(g) * u`` on BF16 tensors: two roundings). Negative control only."""
    gate, up = _split(x)
    if clamp_limit is not None:
        gate = torch.clamp(gate, max=clamp_limit)
        up = torch.clamp(up, min=-clamp_limit, max=clamp_limit)
    return torch.nn.functional.silu(gate) * up


def silu_mul_quant_fp8_ref(x: torch.Tensor, group: int = 128, clamp_limit: float | None = None,
                           ue8m0: bool = False, silu=None):
    """``x [..., 2N]`` -> (``q e4m3 [..., N]``, ``scale f32 [..., N // group]``).

    ``silu`` picks the step-3 reference (default :func:`silu_mul_ref`; pass
    :func:`silu_mul_fp32_mirror` to replay the kernel bit for bit)."""
    h = (silu or silu_mul_ref)(x, clamp_limit)
    if h.shape[-1] % group:
        raise InputError(f"N={h.shape[-1]} is not a multiple of group={group}")
    return quant_per_token_group_ref(h, group=group, ue8m0=ue8m0)


def silu_mul_quant_fp8_masked_ref(x: torch.Tensor, counts: torch.Tensor, group: int = 128,
                                  clamp_limit: float | None = None, ue8m0: bool = False, silu=None):
    """Masked layout ``x [E, C, 2N]``, ``counts [E]``: valid rows as the contiguous reference, others zero."""
    E, C, N2 = x.shape
    N = N2 // 2
    q, s = silu_mul_quant_fp8_ref(x.reshape(E * C, N2), group, clamp_limit, ue8m0, silu)
    q = q.reshape(E, C, N)
    s = s.reshape(E, C, N // group)
    valid = torch.arange(C, device=x.device)[None, :] < counts.to(x.device).long()[:, None]
    q = torch.where(valid[..., None], q.view(torch.uint8), torch.zeros((), dtype=torch.uint8, device=x.device))
    s = torch.where(valid[..., None], s, torch.zeros((), dtype=s.dtype, device=x.device))
    return q.view(torch.float8_e4m3fn), s
