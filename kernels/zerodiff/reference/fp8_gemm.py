"""Reference block-FP8 GEMM (W8A8 -> BF16/FP32), the accumulation structure of ``zerodiff.ops.fp8_gemm``.

``a_q`` e4m3 [M, K] with per-token-group scales ``a_scale`` fp32 [M, ceil(K/128)];
``w_q`` e4m3 [N, K] with block scales ``w_scale`` fp32 [ceil(N/128), ceil(K/128)].

For each output element (m, n), K blocks ``kb = 0, 1, ...`` in ascending order:

    partial = fp32( sum_{k in block kb} float(a_q[m, k]) * float(w_q[n, k]) )   # exact sum, one rounding
    s       = a_scale[m, kb] * w_scale[n // 128, kb]                            # one FP32 multiply
    acc     = acc + partial * s                                                 # FP32 multiply, FP32 add
    out     = round_RNE(acc, out_dtype)                                         # once, at the end

(acc starts at +0.) The block partial is computed exactly in float64 (products of two e4m3 values are exact
in float64 and a 128-term sum of them fits in 53 bits), so this is the ideal of the GPU kernel; the Triton
kernel on the interpreter reproduces it bit for bit, the tensor-core kernels on the GPU approximate the
block partial (their accumulator is narrower) and are compared to this reference with a tolerance.
Nothing in a row's result depends on any other row.
"""

from __future__ import annotations

import torch

BLOCK = 128


def fp8_gemm_ref(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    M, K = a_q.shape
    N = w_q.shape[0]
    Kb = (K + BLOCK - 1) // BLOCK
    a64 = a_q.to(torch.float64)
    w64 = w_q.to(torch.float64)
    ws_cols = w_scale.to(torch.float32).repeat_interleave(BLOCK, dim=0)[:N]  # [N, Kb]
    acc = torch.zeros((M, N), dtype=torch.float32, device=a_q.device)
    for kb in range(Kb):
        sl = slice(kb * BLOCK, min(K, (kb + 1) * BLOCK))
        partial = (a64[:, sl] @ w64[:, sl].T).to(torch.float32)
        s = a_scale[:, kb : kb + 1].to(torch.float32) * ws_cols[:, kb][None, :]
        acc = acc + partial * s
    return acc.to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *, ue8m0: bool = False,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``quant_act`` (1x128, the deployment rule) followed by :func:`fp8_gemm_ref`."""
    from .fp8_quant import quant_per_token_group_ref

    q, s = quant_per_token_group_ref(x, BLOCK, ue8m0)
    return fp8_gemm_ref(q, s, w_q, w_scale, out_dtype)


def grouped_fp8_gemm_ref(a_q, a_scale, w_q, w_scale, row_expert, out_dtype=torch.bfloat16):
    """Grouped version: row ``m`` uses expert ``row_expert[m]`` (``w_q [E, N, K]``); rows with expert -1 -> 0."""
    M = a_q.shape[0]
    N = w_q.shape[1]
    out = torch.zeros((M, N), dtype=out_dtype, device=a_q.device)
    for e in torch.unique(row_expert).tolist():
        if e < 0:
            continue
        rows = (row_expert == e).nonzero().flatten()
        out[rows] = fp8_gemm_ref(a_q.view(torch.uint8)[rows].view(a_q.dtype), a_scale[rows], w_q[e], w_scale[e], out_dtype)
    return out
