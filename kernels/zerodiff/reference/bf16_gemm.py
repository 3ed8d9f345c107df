"""Reference small BF16 GEMM: ``x bf16 [M, K] x w bf16 [N, K]^T`` -> ``out_dtype [M, N]``.

The ideal value: the exact dot product (float64 accumulation of exact bf16 x bf16 products), rounded once
to ``out_dtype`` (through FP32 for BF16 output, as the kernel does). ``zerodiff.ops.bf16_gemm`` accumulates
in FP32 in a fixed order, so it matches this within FP32 accumulation error; its batch invariance is
tested against itself, never against this reference.
"""

from __future__ import annotations

import torch


def bf16_gemm_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    y = (x.to(torch.float64) @ w.to(torch.float64).T).to(torch.float32)
    return y.to(out_dtype)
