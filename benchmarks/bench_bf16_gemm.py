"""Small BF16 GEMMs (indexer weights projection N=64, LM head): ours (fixed order) vs ``torch.matmul`` bf16.

    python benchmarks/bench_bf16_gemm.py --json out.json [--quick]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_generator, median_ms, parse, row, write  # noqa: E402

from zerodiff.ops.bf16_gemm import bf16_gemm, gemm_config  # noqa: E402


def main():
    args, rep = parse(__doc__)
    shapes = [(64, 7168), (129280, 4096)] if args.quick else [(64, 4096), (64, 7168), (129280, 4096), (129280, 7168)]
    Ms = (1, 64, 1024) if args.quick else (1, 16, 64, 128, 512, 1024, 4096)
    rows = []
    g = cuda_generator(0)
    for N, K in shapes:
        w = (torch.randn(N, K, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        for M in Ms:
            if N > 100000 and M > 1024 and args.quick:
                continue
            x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
            out_dtype = torch.float32 if N > 100000 else torch.bfloat16  # LM head logits in FP32
            t_ours = median_ms(lambda: bf16_gemm(x, w, out_dtype=out_dtype), rep=rep)
            if out_dtype == torch.float32:
                t_stock = median_ms(lambda: (x @ w.T).float(), rep=rep)
                stock = "torch.matmul bf16 (cuBLAS) + .float()"
            else:
                t_stock = median_ms(lambda: x @ w.T, rep=rep)
                stock = "torch.matmul bf16 (cuBLAS)"
            rows.append(row("bf16_gemm", f"M={M} N={N} K={K}", t_ours, t_stock, stock, M=M,
                            config=str(gemm_config(N, K))))
    write(args.json, "bf16_gemm", rows)


if __name__ == "__main__":
    main()
