"""RMSNorm: ours (one row per program, pinned pairwise-tree reduction) vs stock torch, hidden 4096 / 7168.

Rows (ours / stock, medians in the same run on the same inputs):

* ``rms_norm`` vs ``torch.nn.functional.rms_norm(x, (H,), w, eps)`` eager on BF16.
* ``rms_norm+residual`` (fused add, returns the new residual) vs eager ``r = x + res`` then
  ``F.rms_norm(r, ...)`` (two kernels).

    python benchmarks/bench_rmsnorm.py --json out.json [--quick]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, parse, row, write  # noqa: E402

from zerodiff.ops.rmsnorm import _config, rms_norm  # noqa: E402


def main():
    args, rep = parse(__doc__)
    Hs = (4096, 7168)
    Ts = (1, 64, 1024, 8192) if args.quick else (1, 2, 16, 64, 256, 1024, 4096, 8192)
    eps = 1e-6
    rows = []
    torch.manual_seed(0)
    for H in Hs:
        w = torch.randn(H, device="cuda").to(torch.bfloat16)
        for T in Ts:
            x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            res = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            shape = f"T={T} H={H}"
            t_ours = median_ms(lambda: rms_norm(x, w, eps), rep=rep)
            t_stock = median_ms(lambda: torch.nn.functional.rms_norm(x, (H,), w, eps), rep=rep)
            rows.append(row("rms_norm", shape, t_ours, t_stock, "torch.nn.functional.rms_norm bf16 (eager)",
                            T=T, H=H, config=str(_config(H))))
            t_ours_r = median_ms(lambda: rms_norm(x, w, eps, residual=res), rep=rep)

            def stock_res():
                r = x + res
                return torch.nn.functional.rms_norm(r, (H,), w, eps), r

            t_stock_r = median_ms(stock_res, rep=rep)
            rows.append(row("rms_norm+residual", shape, t_ours_r, t_stock_r,
                            "eager x + res, then F.rms_norm bf16 (2 kernels)", T=T, H=H, config=str(_config(H))))
    write(args.json, "rmsnorm", rows)


if __name__ == "__main__":
    main()
