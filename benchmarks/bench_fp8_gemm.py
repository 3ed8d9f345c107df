"""Dense block-FP8 GEMM: ours (Triton; DeepGEMM through the verified backend) vs stock kernels.

Stock rows: DeepGEMM ``fp8_gemm_nt`` called directly on the same FP8 operands (the fastest stock FP8 path on
SM90), and BF16 ``torch.matmul`` (cuBLAS) on the BF16 operands. GEMM only: the activation quant is the same
op on both sides and is timed in its own row (``quant_act``).

    python benchmarks/bench_fp8_gemm.py --json out.json [--quick]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_generator, median_ms, parse, row, write  # noqa: E402

from zerodiff import backends  # noqa: E402
from zerodiff.ops import fp8_gemm as fg  # noqa: E402
from zerodiff.ops.fp8_quant import Fp8Weight, quant_act  # noqa: E402


def main():
    args, rep = parse(__doc__)
    shapes = [(4096, 7168), (7168, 2048)] if args.quick else [(4096, 7168), (7168, 2048), (2048, 7168), (7168, 4096)]
    Ms = (1, 64, 4096) if args.quick else (1, 16, 64, 128, 512, 1024, 4096)
    dg = backends.deep_gemm()
    rows = []
    g = cuda_generator(0)
    for N, K in shapes:
        w = (torch.randn(N, K, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
        fw = Fp8Weight.from_master(w)
        if dg is None:
            verdict = (False, "DeepGEMM not importable")
        elif args.quick:  # the probe JIT-compiles DeepGEMM for ~10 M values: too slow for a smoke run
            verdict = (False, "probe skipped in --quick")
        else:
            verdict = fg.deepgemm_verdict(N, K, "cuda")
        for M in Ms:
            x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
            q, s = quant_act(x)
            shape = f"M={M} N={N} K={K}"
            t_tri = median_ms(lambda: fg.fp8_gemm(q, s, fw.q, fw.scale, backend="triton"), rep=rep)
            t_bf16 = median_ms(lambda: x @ w.T, rep=rep)
            rows.append(row("fp8_gemm[triton]", shape, t_tri, t_bf16, "torch.matmul bf16 (cuBLAS)", M=M))
            if dg is not None:
                out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
                try:
                    t_dg = median_ms(lambda: dg.fp8_gemm_nt((q, s), (fw.q, fw.scale), out, disable_ue8m0_cast=True),
                                     rep=rep)
                except Exception as ex:  # record, keep going
                    print(f"DeepGEMM direct failed at {shape}: {ex}")
                    t_dg = None
                if t_dg:
                    rows.append(row("fp8_gemm[triton]", shape, t_tri, t_dg, "DeepGEMM fp8_gemm_nt (direct)", M=M))
                    if verdict[0]:
                        t_ours_dg = median_ms(lambda: fg.fp8_gemm(q, s, fw.q, fw.scale, backend="deepgemm"), rep=rep)
                        rows.append(row("fp8_gemm[deepgemm,verified]", shape, t_ours_dg, t_dg,
                                        "DeepGEMM fp8_gemm_nt (direct)", M=M))
            t_q = median_ms(lambda: quant_act(x), rep=rep)
            rows.append(row("quant_act[triton]", f"M={M} K={K}", t_q, t_bf16, "(share of) torch.matmul bf16", M=M))
        rows.append({"op": "deepgemm_verdict", "shape": f"N={N} K={K}", "verified": verdict[0], "detail": verdict[1]})
        print(f"DeepGEMM verdict N={N} K={K}: {verdict}")
    write(args.json, "fp8_gemm", rows)


if __name__ == "__main__":
    main()
