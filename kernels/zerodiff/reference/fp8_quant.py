"""Reference FP8 quantisation rules (the deployment rule). Every zerodiff kernel that produces FP8
(activation quant, SiLU*mul->FP8, weight requantisation, the FP8 KV cache) must give these exact bits.

Contract (e4m3 = ``torch.float8_e4m3fn``, max finite 448):

* ``amax``  = max |x| over the group, in FP32 (exact: max needs no rounding).
* ``scale`` = ``max(amax, EPS) / 448`` as one FP32 division, round-to-nearest-even (``EPS = 1e-10``).
  Variant ``ue8m0=True`` (SM100 DeepGEMM): the FP32 scale is rounded *up* to a power of two,
  ``2**ceil(log2(scale))``, computed exactly on the bits.
* ``q``     = e4m3(x_f32 / scale): one FP32 division (RNE), then RNE conversion to e4m3, saturating
  (|v| > 448 and +-inf -> +-448; NaN -> NaN code).
* dequantised value = ``float(q) * scale``: one FP32 multiply, RNE (the code has 4 significant bits,
  so the product is exact unless the scale itself is near the FP32 range limits).

Groups: activations per token in groups of 1 x 128 along K; weights in 128 x 128 blocks (N x K).
A trailing partial group/block uses the amax of its valid elements only.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
EPS = 1e-10
GROUP = 128


def round_scale_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive FP32 scales up to the next power of two (exact, on the bits)."""
    assert scale.dtype == torch.float32
    bits = scale.contiguous().view(torch.int32)
    exp = bits & 0x7F800000
    frac = bits & 0x007FFFFF
    exp = torch.where(frac != 0, exp + 0x00800000, exp)
    return exp.view(torch.float32)


def div_rn_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 division ``a / b`` on any device.

    Computed in float64 and rounded once to FP32, which is exact RNE (53 >= 2*24 + 2, so the double
    rounding is innocuous). Plain torch division is not safe for this: on CUDA ``tensor / scalar`` is
    computed as a multiply by the reciprocal (1-ulp off, seen on the H200).
    """
    return (a.to(torch.float32).to(torch.float64) / b.to(torch.float32).to(torch.float64)).to(torch.float32)


def group_scale(amax: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """FP32 scale from an FP32 amax by the deployment rule."""
    amax = torch.clamp(amax.to(torch.float32), min=EPS)
    scale = div_rn_f32(amax, torch.full_like(amax, FP8_MAX))
    return round_scale_ue8m0(scale) if ue8m0 else scale


def e4m3_rne_saturate(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> e4m3, RNE, saturating: |v| >= 464 and +-inf -> +-448, NaN -> NaN.

    The clamp is explicit because torch's own cast is not stable across versions: torch 2.13 saturates,
    torch 2.11 (the H200 image) maps |v| >= 464 to NaN (measured on the H200). Clamping first changes
    nothing below 464 (those values round to at most 448 anyway) and NaN passes through the clamp.
    """
    return v.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quant_per_token_group_ref(x: torch.Tensor, group: int = GROUP, ue8m0: bool = False):
    """Activation quant: ``x [..., K]`` (any float dtype) -> (``q e4m3 [..., K]``, ``scale f32 [..., ceil(K/group)]``)."""
    K = x.shape[-1]
    G = (K + group - 1) // group
    xf = x.to(torch.float32)
    pad = G * group - K
    xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    xg = xp.reshape(*x.shape[:-1], G, group)
    amax = xg.abs().amax(dim=-1)
    scale = group_scale(amax, ue8m0)
    q = e4m3_rne_saturate(div_rn_f32(xg, scale.unsqueeze(-1))).reshape(*x.shape[:-1], G * group)[..., :K]
    return q.contiguous(), scale


def quant_weight_block_ref(w: torch.Tensor, block: int = GROUP, ue8m0: bool = False):
    """Weight quant: ``w [N, K]`` (BF16 master) -> (``q e4m3 [N, K]``, ``scale f32 [ceil(N/b), ceil(K/b)]``)."""
    N, K = w.shape
    Nb, Kb = (N + block - 1) // block, (K + block - 1) // block
    wf = w.to(torch.float32)
    wp = torch.nn.functional.pad(wf, (0, Kb * block - K, 0, Nb * block - N))
    wb = wp.reshape(Nb, block, Kb, block)
    amax = wb.abs().amax(dim=(1, 3))
    scale = group_scale(amax, ue8m0)
    q = e4m3_rne_saturate(div_rn_f32(wb, scale[:, None, :, None])).reshape(Nb * block, Kb * block)[:N, :K]
    return q.contiguous(), scale


def dequant_per_token_group_ref(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Inverse of :func:`quant_per_token_group_ref` in FP32."""
    K = q.shape[-1]
    s = scale.repeat_interleave(group, dim=-1)[..., :K]
    return q.to(torch.float32) * s


def dequant_weight_block_ref(q: torch.Tensor, scale: torch.Tensor, block: int = GROUP) -> torch.Tensor:
    """Inverse of :func:`quant_weight_block_ref` in FP32."""
    N, K = q.shape
    s = scale.repeat_interleave(block, dim=0)[:N].repeat_interleave(block, dim=1)[:, :K]
    return q.to(torch.float32) * s
