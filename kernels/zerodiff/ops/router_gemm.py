"""Router gate GEMM: ``x bf16 [M, H] x w bf16 [E, H]^T -> fp32 logits [M, E]``, same kernel for every M.

Numerical contract: the fixed-order BF16 GEMM of :mod:`zerodiff.ops.bf16_gemm` with FP32 output: FP32
accumulation, K walked in ascending 64-wide blocks inside each of ``SPLIT`` K ranges, the ranges summed in
split order from +0, no rounding other than the FP32 accumulation. Tiles and split are chosen from (E, H)
only (for E=256, H=4096/7168: 64-row x 64-expert tiles, 16 K ranges, so decode M fills the GPU); the same
kernel runs at M=1 and at M=16384. The stock FP32 ``F.linear`` path switches algorithm with M (a row's
logits change once M >= 16 on the H200) and is the negative control in the tests.

Public API::

    router_gemm(x, w, *, backend=None) -> fp32 [M, E]
    gemm_config(E, H) -> dict   (the configuration used; a function of (E, H) only)

Backends: ``None`` (Triton on CUDA, reference on CPU), ``"triton"``, ``"reference"``
(:func:`zerodiff.reference.router_gemm.router_gemm_ref`, float64 accumulation rounded once to FP32).
"""

from __future__ import annotations

import torch

from . import bf16_gemm as _b
from ..reference.router_gemm import router_gemm_ref


def gemm_config(E: int, H: int) -> dict:
    return _b.gemm_config(E, H)


def router_gemm(x: torch.Tensor, w: torch.Tensor, *, backend=None) -> torch.Tensor:
    """FP32 router logits, one fixed-order kernel for every number of tokens."""
    _b._check(x, w, "router_gemm")
    if _b._pick(backend, x, "router_gemm") == "reference":
        return router_gemm_ref(x, w)
    return _b._launch(x, w, torch.float32, gemm_config(w.shape[0], x.shape[1]))
