"""Router gate GEMM: ours (fixed-order Triton, FP32 logits) vs stock FP32 ``F.linear`` (cuBLAS SGEMM/TF32 off).

    python benchmarks/bench_router_gemm.py --json out.json [--quick]
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_generator, median_ms, parse, row, write  # noqa: E402

from zerodiff.ops.router_gemm import gemm_config, router_gemm  # noqa: E402


def main():
    args, rep = parse(__doc__)
    Hs = (7168,) if args.quick else (4096, 7168)
    Ms = (1, 16, 128, 4096) if args.quick else (1, 4, 16, 64, 128, 512, 1024, 4096, 16384)
    E = 256
    rows = []
    g = cuda_generator(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    for H in Hs:
        w = (torch.randn(E, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        w32 = w.float()
        for M in Ms:
            x = torch.randn(M, H, generator=g, device="cuda").to(torch.bfloat16)
            t_ours = median_ms(lambda: router_gemm(x, w), rep=rep)
            t_stock = median_ms(lambda: F.linear(x.float(), w32), rep=rep)
            rows.append(row("router_gemm", f"M={M} E={E} H={H}", t_ours, t_stock, "F.linear fp32 (x.float(), fp32 weight)",
                            M=M, config=str(gemm_config(E, H))))
    write(args.json, "router_gemm", rows)


if __name__ == "__main__":
    main()
