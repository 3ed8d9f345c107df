"""Token log-probs at DeepSeek-V4's vocabulary (V = 129280): ours (one row per program, fixed 8192-column
chunks, online max/sum) vs stock ``torch.log_softmax(logits.float(), -1).gather(...)``.

Rows (ours / stock, medians in the same run on the same inputs), BF16 and FP32 logits, temperature 1.0
and a per-row temperature tensor (stock: ``logits.float() / temps[:, None]`` first).

    python benchmarks/bench_logprobs.py --json out.json [--quick]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, parse, row, write  # noqa: E402

from zerodiff.ops.logprobs import CHUNK, token_logprobs  # noqa: E402

V = 129280


def main():
    args, rep = parse(__doc__)
    Ts = (1, 64, 1024) if args.quick else (1, 16, 64, 256, 1024, 4096)
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float32)
    rows = []
    torch.manual_seed(0)
    for dt in dtypes:
        for T in Ts:
            logits = (torch.randn(T, V, device="cuda") * 4).to(dt)
            ids = torch.randint(0, V, (T,), device="cuda")
            temps = torch.rand(T, device="cuda") + 0.5
            shape = f"T={T} V={V} {str(dt).replace('torch.', '')}"
            # check_ids=False: the host-side id check (one sync) is timed separately below
            t_ours = median_ms(lambda: token_logprobs(logits, ids, check_ids=False), rep=rep)
            t_stock = median_ms(lambda: torch.log_softmax(logits.float(), -1).gather(1, ids[:, None]), rep=rep)
            rows.append(row("token_logprobs", shape, t_ours, t_stock,
                            "torch.log_softmax(logits.float(), -1).gather (eager)", T=T, chunk=CHUNK))
            t_ours_t = median_ms(lambda: token_logprobs(logits, ids, temperature=temps, check_ids=False), rep=rep)
            t_stock_t = median_ms(
                lambda: torch.log_softmax(logits.float() / temps[:, None], -1).gather(1, ids[:, None]), rep=rep)
            rows.append(row("token_logprobs[temp tensor]", shape, t_ours_t, t_stock_t,
                            "torch.log_softmax(logits.float() / t, -1).gather (eager)", T=T, chunk=CHUNK))
            if dt == torch.bfloat16 and T in (1, 1024):
                t_chk = median_ms(lambda: token_logprobs(logits, ids), rep=rep)
                rows.append(row("token_logprobs[check_ids=True]", shape, t_chk, t_stock,
                                "torch.log_softmax(logits.float(), -1).gather (eager)", T=T, chunk=CHUNK))
            del logits
    write(args.json, "logprobs", rows)


if __name__ == "__main__":
    main()
