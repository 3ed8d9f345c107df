"""SiLU*mul (+ per-token-group FP8 quant): ours (one FP32 rounding, one fused kernel) vs stock paths.

Rows (ours / stock, medians in the same run on the same inputs):

* ``silu_mul_quant_fp8`` vs "eager bf16 silu*up + Triton group quant": torch ``F.silu(g) * u`` on BF16
  (two eager kernels, two roundings) followed by a straightforward Triton per-token-group quant written in
  this file the way upstream vLLM's group quant works (one program per 1x128 group, ``amax/448`` with a
  plain division, clamp, cast). Three kernels in all.
* ``silu_mul_quant_fp8`` vs "fused Triton stock-style": the same stock arithmetic (BF16 SiLU, BF16
  product, plain-division quant) in ONE Triton kernel, one program per group: the strict baseline a tuned
  deployment would run (upstream fuses activation and quant for its FP8 MoE paths).
* ``silu_mul`` (BF16 output) vs torch eager ``F.silu(g) * u``.
* ``silu_mul_quant_fp8_masked`` (E=8 experts, every row valid) vs our contiguous kernel on the same rows
  (the cost of the masked addressing).

Shapes: intermediate N = 2048, 4096 (input 2N), M = 1 .. 8192.

    python benchmarks/bench_silu_mul_quant.py --json out.json [--quick]
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, parse, row, write  # noqa: E402

from zerodiff.ops.silu_mul_quant import silu_mul, silu_mul_quant_fp8, silu_mul_quant_fp8_masked  # noqa: E402


@triton.jit
def _stock_group_quant(x_ptr, q_ptr, s_ptr, G: tl.constexpr):
    """One program per 1 x G group of a contiguous [M, N] BF16 tensor (groups are flat)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * G + tl.arange(0, G)
    x = tl.load(x_ptr + offs).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10)
    scale = amax / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + offs, q)
    tl.store(s_ptr + pid, scale)


@triton.jit
def _stock_fused(x_ptr, q_ptr, s_ptr, N, G: tl.constexpr):
    """Stock arithmetic fused: BF16 silu, BF16 product, plain-division group quant; one program per group."""
    pid = tl.program_id(0)
    ng = N // G
    r = (pid // ng).to(tl.int64)
    c = (pid % ng) * G + tl.arange(0, G)
    g = tl.load(x_ptr + r * 2 * N + c).to(tl.float32)
    u = tl.load(x_ptr + r * 2 * N + N + c).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
    h = (a * u).to(tl.bfloat16).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(h), axis=0), 1e-10)
    scale = amax / 448.0
    q = tl.clamp(h / scale, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + r * N + c, q)
    tl.store(s_ptr + pid, scale)


def stock_eager_then_quant(x, N):
    h = torch.nn.functional.silu(x[:, :N]) * x[:, N:]
    M = x.shape[0]
    q = torch.empty(M, N, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, N // 128, dtype=torch.float32, device=x.device)
    _stock_group_quant[(M * (N // 128),)](h, q, s, G=128)
    return q, s


def stock_fused(x, N):
    M = x.shape[0]
    q = torch.empty(M, N, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, N // 128, dtype=torch.float32, device=x.device)
    _stock_fused[(M * (N // 128),)](x, q, s, N, G=128)
    return q, s


def main():
    args, rep = parse(__doc__)
    Ns = (2048,) if args.quick else (2048, 4096)
    Ms = (1, 64, 1024, 8192) if args.quick else (1, 16, 64, 256, 1024, 4096, 8192)
    rows = []
    torch.manual_seed(0)
    for N in Ns:
        for M in Ms:
            x = (torch.randn(M, 2 * N, device="cuda") * 2).to(torch.bfloat16)
            shape = f"M={M} N={N} (x [M, {2 * N}])"
            t_ours = median_ms(lambda: silu_mul_quant_fp8(x), rep=rep)
            t_eager = median_ms(lambda: stock_eager_then_quant(x, N), rep=rep)
            t_fused = median_ms(lambda: stock_fused(x, N), rep=rep)
            rows.append(row("silu_mul_quant_fp8", shape, t_ours, t_eager,
                            "eager bf16 F.silu(g)*u + Triton group quant (1 prog/128-group, amax/448, plain div)",
                            M=M, N=N))
            rows.append(row("silu_mul_quant_fp8", shape, t_ours, t_fused,
                            "fused Triton stock-style (bf16 silu, bf16 product, plain-div group quant)", M=M, N=N))
            t_bf = median_ms(lambda: silu_mul(x), rep=rep)
            t_bf_stock = median_ms(lambda: torch.nn.functional.silu(x[:, :N]) * x[:, N:], rep=rep)
            rows.append(row("silu_mul", shape, t_bf, t_bf_stock, "torch eager bf16 F.silu(g)*u (2 kernels)",
                            M=M, N=N))
            E = 8
            if M >= E and M % E == 0:
                x3 = x.reshape(E, M // E, 2 * N)
                counts = torch.full((E,), M // E, dtype=torch.int32, device="cuda")
                t_m = median_ms(lambda: silu_mul_quant_fp8_masked(x3, counts), rep=rep)
                rows.append(row("silu_mul_quant_fp8_masked", f"E={E} C={M // E} N={N}", t_m, t_ours,
                                "ours contiguous on the same rows", M=M, N=N))
    write(args.json, "silu_mul_quant", rows)


if __name__ == "__main__":
    main()
