"""Micro-benchmark: zerodiff deterministic Top-K vs stock ``torch.topk`` (the baseline for DSA and routing).

    python benchmarks/bench_topk.py --json topk.json [--quick]

DSA indexer rows: fp32 scores [rows, width], width 8K/16K/32K/64K, k=2048, every row full length.
Expert routing: fp32 logits [tokens, 256], k=8, selected scores returned too.
The stock op is ``torch.topk(scores, k, dim=1)`` (sorted by score, ties by thread schedule): it does not
keep our tie rule or our descending-position order, which is the point of replacing it. Ratios are
ours/stock of medians measured in the same run on the same inputs. Targets: <= 1.3 at decode shapes
(rows <= 128), <= 1.1 at prefill shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_ms, parser, row, write  # noqa: E402

from zerodiff.ops.topk import deterministic_topk, topk_routing  # noqa: E402


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_topk needs a CUDA device")
    torch.manual_seed(0)
    if args.quick:
        widths, rows_list, tokens, rep = (8192, 65536), (1, 64, 1024), (1, 64, 4096), 20
    else:
        widths, rows_list = (8192, 16384, 32768, 65536), (1, 16, 64, 128, 256, 1024, 4096)
        tokens, rep = (1, 16, 64, 256, 1024, 4096, 8192), 50
    out = []
    k = 2048
    for W in widths:
        for R in rows_list:
            s = torch.randn(R, W, device="cuda")
            # sanity before timing: same selected set as torch.topk on tie-free random rows
            ours = deterministic_topk(s, k)
            stock = torch.topk(s, k, dim=1).indices
            same_set = bool(torch.equal(torch.sort(ours.long(), 1).values, torch.sort(stock, 1).values))
            t_ours = median_ms(lambda: deterministic_topk(s, k), rep=rep)
            t_stock = median_ms(lambda: torch.topk(s, k, dim=1), rep=rep)
            phase = "decode" if R <= 128 else "prefill"
            out.append(row("topk_dsa", f"rows={R} width={W} k={k}", t_ours, t_stock, "torch.topk",
                           phase=phase, target=1.3 if phase == "decode" else 1.1, same_set_as_stock=same_set))
            del s
    E, kr = 256, 8
    for T in tokens:
        lg = torch.randn(T, E, device="cuda")
        t_ours = median_ms(lambda: topk_routing(lg, kr), rep=rep)
        t_stock = median_ms(lambda: torch.topk(lg, kr, dim=1), rep=rep)
        phase = "decode" if T <= 128 else "prefill"
        out.append(row("topk_routing", f"tokens={T} experts={E} k={kr}", t_ours, t_stock, "torch.topk",
                       phase=phase, target=1.3 if phase == "decode" else 1.1))
    write(args.json, "topk", out)


if __name__ == "__main__":
    main()
