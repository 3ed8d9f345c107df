"""Micro-benchmark: zerodiff deterministic Top-K vs stock ``torch.topk`` (the baseline for DSA and routing).

    python benchmarks/bench_topk.py --json topk.json [--quick] [--sweep]

(--sweep adds a few minutes: other CHUNK/DIGIT/num_warps configs of our kernel at width 64K, for tuning)

DSA indexer rows: fp32 scores [rows, width], width 8K/16K/32K/64K, k=2048, every row full length.
Expert routing: fp32 logits [tokens, 256], k=8, selected scores returned too.
The stock op is ``torch.topk(scores, k, dim=1)`` (sorted by score, ties by thread schedule): it does not
keep our tie rule or our descending-position order, which is the point of replacing it. Ratios are
ours/stock of medians measured in the same run on the same inputs, eagerly (``ratio``) and with each op
captured in a CUDA graph (``graph_ratio``, how decode runs; it removes Python launch overhead).
Targets: <= 1.3 at decode shapes (rows <= 128), <= 1.1 at prefill shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_ms, parser, row, write  # noqa: E402

from zerodiff.ops.topk import _config, _topk_triton, deterministic_topk, topk_routing  # noqa: E402


def graph_ms(fn, rep: int) -> float | None:
    """Median replay time of ``fn`` captured in a CUDA graph (decode runs under full CUDA graphs)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return median_ms(g.replay, rep=rep)
    except Exception as e:  # report, never hide: the row says why there is no graph time
        print(f"  graph capture failed: {type(e).__name__}: {e}", flush=True)
        return None


def _graph_fields(ours_fn, stock_fn, rep: int) -> dict:
    go, gs = graph_ms(ours_fn, rep), graph_ms(stock_fn, rep)
    out = {"ours_graph_ms": None if go is None else round(go, 5),
           "stock_graph_ms": None if gs is None else round(gs, 5)}
    out["graph_ratio"] = round(go / gs, 4) if go and gs else None
    print(f"  under CUDA graphs: ours {go} ms, stock {gs} ms, ratio {out['graph_ratio']}", flush=True)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true",
                   help="also time other (CHUNK, DIGIT, num_warps) configs of our kernel at width 64K, to tune "
                        "_config (which must stay a function of the width only)")
    args = p.parse_args()
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
            lens = torch.full((R,), W, dtype=torch.int32, device="cuda")  # per-row lengths, as DSA calls it
            # sanity before timing: same selected set as torch.topk on (almost surely) tie-free random rows
            ours = deterministic_topk(s, k, lens)
            stock = torch.topk(s, k, dim=1).indices
            same_set = bool(torch.equal(torch.sort(ours.long(), 1).values, torch.sort(stock, 1).values))

            def f_ours():
                return deterministic_topk(s, k, lens)

            def f_stock():
                return torch.topk(s, k, dim=1)

            t_ours = median_ms(f_ours, rep=rep)
            t_stock = median_ms(f_stock, rep=rep)
            phase = "decode" if R <= 128 else "prefill"
            out.append(row("topk_dsa", f"rows={R} width={W} k={k}", t_ours, t_stock, "torch.topk",
                           phase=phase, target=1.3 if phase == "decode" else 1.1, same_set_as_stock=same_set,
                           **_graph_fields(f_ours, f_stock, rep)))
            del s, ours, stock
    E, kr = 256, 8
    for T in tokens:
        lg = torch.randn(T, E, device="cuda")

        def r_ours():
            return topk_routing(lg, kr)

        def r_stock():
            return torch.topk(lg, kr, dim=1)

        t_ours = median_ms(r_ours, rep=rep)
        t_stock = median_ms(r_stock, rep=rep)
        phase = "decode" if T <= 128 else "prefill"
        out.append(row("topk_routing", f"tokens={T} experts={E} k={kr}", t_ours, t_stock, "torch.topk",
                       phase=phase, target=1.3 if phase == "decode" else 1.1,
                       **_graph_fields(r_ours, r_stock, rep)))
    if args.sweep:
        W = 65536
        for R in (1, 128, 4096):
            s = torch.randn(R, W, device="cuda")
            lens = torch.full((R,), W, dtype=torch.int32, device="cuda")
            ref = deterministic_topk(s, k, lens)
            t_stock = median_ms(lambda: torch.topk(s, k, dim=1), rep=rep)
            for chunk in (1024, 2048, 4096, 8192):
                for digit in (8, 11):
                    for warps in (4, 8, 16):
                        def f():
                            return _topk_triton(s, k, lens, False, chunk=chunk, digit=digit, num_warps=warps)
                        try:
                            same = bool(torch.equal(f(), ref))
                            t = median_ms(f, rep=max(10, rep // 2))
                        except Exception as e:  # a config that does not compile/run is reported, not fatal
                            print(f"  sweep chunk={chunk} digit={digit} warps={warps}: {type(e).__name__}: {e}")
                            continue
                        out.append(row("topk_dsa_sweep", f"rows={R} width={W} chunk={chunk} digit={digit} "
                                       f"warps={warps}", t, t_stock, "torch.topk", equal_to_default=same,
                                       default_config=str(_config(W))))
            del s
    write(args.json, "topk", out)


if __name__ == "__main__":
    main()
