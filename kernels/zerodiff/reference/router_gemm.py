"""Reference router gate GEMM: ``x bf16 [M, H] x w bf16 [E, H]^T`` -> FP32 logits ``[M, E]``.

The ideal value is the exact dot product rounded once to FP32 (float64 accumulation; bf16 x bf16 products
are exact). ``zerodiff.ops.router_gemm`` accumulates in FP32 in one fixed order for every M and matches
this within FP32 accumulation error; the stock ``F.linear`` on FP32 copies changes a row's bits once
M >= 16 on the H200, which is what the op fixes.
"""

from __future__ import annotations

import torch


def router_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float64) @ w.to(torch.float64).T).to(torch.float32)
