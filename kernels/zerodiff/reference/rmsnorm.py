"""Reference for RMSNorm (optionally with a fused residual add): the exact FP32 operation sequence.

Contract (``x`` BF16 ``[..., H]``, ``weight`` BF16 or FP32 ``[H]``, ``eps`` a Python float):

1. Optional residual (BF16, same shape): ``r = bf16(float(x) + float(residual))`` (one FP32 add, one RNE
   rounding); ``r`` is returned as the new residual and normalised in place of ``x``.
2. ``v = float(x)`` (or ``float(r)``); ``sq = v * v`` (FP32, RNE).
3. ``ss`` = sum of ``sq`` by a **pairwise tree over the row zero-padded to P = next_pow2(H)**:
   level by level ``a'[i] = a[2i] + a[2i+1]`` until one value is left. The order depends on H only
   (padding adds +0 to non-negative values: exact), never on the batch, the block size or warps.
4. ``ms = ss / fp32(H)`` (FP32 division, RNE); ``den = sqrt(ms + fp32(eps))`` (FP32 add, correctly
   rounded FP32 sqrt); ``rstd = 1 / den`` (FP32 division, RNE).
5. ``y = bf16((v * rstd) * float(weight))``: two FP32 multiplies in this order, one RNE rounding.

Every step is a correctly rounded IEEE operation. The Triton kernel does the same steps except that it
sums ``sq`` with Triton's own reduction tree (fixed by H and the launch configuration), so it agrees with
this reference to within 1 bf16 ulp of ``y`` (the new residual is exact in both). torch's CPU ``sqrt`` is not correctly rounded on
these machines, so the square root is taken in float64 with numpy and rounded to FP32 (a float64 sqrt
rounded to FP32 is the correctly rounded FP32 sqrt). :func:`rms_norm_f64` gives the float64 math for
tolerance checks and gradient references.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["pairwise_sum_fp32", "rms_norm_ref", "rms_norm_f64"]


def pairwise_sum_fp32(a: torch.Tensor) -> torch.Tensor:
    """Row sums of FP32 ``a [R, H]`` by the pairwise tree over the row zero-padded to next_pow2(H)."""
    a = a.to(torch.float32)
    H = a.shape[-1]
    P = 1 << max(0, (H - 1).bit_length())
    if P != H:
        a = torch.nn.functional.pad(a, (0, P - H))
    while a.shape[-1] > 1:
        a = a[..., 0::2] + a[..., 1::2]
    return a[..., 0]


def _sqrt_rn_fp32(x: torch.Tensor) -> torch.Tensor:
    r = np.sqrt(x.detach().cpu().numpy().astype(np.float64)).astype(np.float32)
    return torch.from_numpy(r).to(x.device)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """Bit-exact reference of the contract above. Returns ``y`` or ``(y, new_residual)``."""
    H = x.shape[-1]
    v = x.reshape(-1, H).to(torch.float32)
    new_res = None
    if residual is not None:
        new_res = (v + residual.reshape(-1, H).to(torch.float32)).to(torch.bfloat16)
        v = new_res.to(torch.float32)
    ss = pairwise_sum_fp32(v * v)
    ms = ss / torch.tensor(float(H), dtype=torch.float32)
    den = _sqrt_rn_fp32(ms + torch.tensor(eps, dtype=torch.float32))
    rstd = torch.tensor(1.0, dtype=torch.float32) / den
    y = ((v * rstd[:, None]) * weight.to(torch.float32)).to(torch.bfloat16).reshape(x.shape)
    if residual is None:
        return y
    return y, new_res.reshape(x.shape)


def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """The math in float64 (no rounding): ``v * weight / sqrt(mean(v^2) + eps)`` with ``v`` the BF16
    input (or the BF16-rounded residual sum)."""
    v = x.to(torch.float64)
    if residual is not None:
        v = (x.to(torch.float32) + residual.to(torch.float32)).to(torch.bfloat16).to(torch.float64)
    return v * weight.to(torch.float64) / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
