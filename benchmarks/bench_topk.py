"""Micro-benchmark: zerodiff deterministic Top-K vs stock ``torch.topk`` (the baseline for DSA and routing).

    python benchmarks/bench_topk.py --json topk.json [--quick] [--sweep]
    python benchmarks/bench_topk.py --aot        (no GPU: compile every variant for sm_90a / sm_100a, registers)

Every DSA shape is timed for both designs in the same run against the same ``torch.topk``: op
``topk_dsa`` is the public entry point with the default VARIANT, ``topk_dsa[single]`` / ``topk_dsa[split]``
force one design. ``--sweep`` adds ``topk_dsa_sweep`` rows: every split-design candidate of
``zerodiff.experimental.topk_variants.SPLIT_CANDIDATES`` (and with ``--sweep-single`` the single kernel's
CHUNK/DIGIT/num_warps configs, minutes more) at widths 8K and 64K,
rows 1/64/1024, each with ``equal_to_reference`` (bitwise vs the default path on the same inputs).

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
from common import capture, cubin_usage, median_ms, parser, row, write  # noqa: E402

import zerodiff.ops.topk as topk_mod  # noqa: E402
from zerodiff.experimental import topk_variants as xt  # noqa: E402
from zerodiff.ops.topk import _config, _topk_triton, deterministic_topk, topk_routing  # noqa: E402


def graph_ms(fn, rep: int) -> float | None:
    """Median replay time of ``fn`` captured in a CUDA graph (decode runs under full CUDA graphs)."""
    g = capture(fn, warmup=3, report=True)  # report, never hide: the row says why there is no graph time
    return None if g is None else median_ms(g.replay, rep=rep)


def _graph_fields(ours_fn, stock_fn, rep: int) -> dict:
    go, gs = graph_ms(ours_fn, rep), graph_ms(stock_fn, rep)
    out = {"ours_graph_ms": None if go is None else round(go, 5),
           "stock_graph_ms": None if gs is None else round(gs, 5)}
    out["graph_ratio"] = round(go / gs, 4) if go and gs else None
    print(f"  under CUDA graphs: ours {go} ms, stock {gs} ms, ratio {out['graph_ratio']}", flush=True)
    return out


def _time_pair(ours_fn, stock_fn, rep: int, rows: int) -> tuple[float, float, dict]:
    """Median times of ours and stock, and the phase (decode up to 128 rows, else prefill) with its ratio target."""
    phase = "decode" if rows <= 128 else "prefill"
    where = dict(phase=phase, target=1.3 if phase == "decode" else 1.1)
    return median_ms(ours_fn, rep=rep), median_ms(stock_fn, rep=rep), where


def sweep(k: int, rep: int, single: bool = False) -> list[dict]:
    """Every split candidate (and with ``single`` every config of the single design) at widths 8K / 64K,
    rows 1 / 64 / 1024, against one torch.topk time."""
    from zerodiff.reference.topk import deterministic_topk_ref

    rows = []
    for W in (8192, 65536):
        for R in (1, 64, 1024):
            s = torch.randn(R, W, device="cuda")
            s[1::4] = torch.round(s[1::4] * 8) / 8  # some tie-heavy rows (exactness check only)
            lens = torch.full((R,), W, dtype=torch.int32, device="cuda")
            ref = deterministic_topk_ref(s[:4].cpu(), k, lens[:4].cpu()).cuda()  # first rows, exact rule
            t_stock = median_ms(lambda: torch.topk(s, k, dim=1), rep=rep)
            configs = []
            for chunk in ((2048, 4096, 8192) if single else ()):
                for digit in (8, 11):
                    for warps in (8, 16):
                        configs.append((f"single chunk={chunk} digit={digit} warps={warps}",
                                        dict(variant="single", chunk=chunk, digit=digit, num_warps=warps)))
            for cand in xt.SPLIT_CANDIDATES:
                cfg = xt.split_candidate(W, cand)
                configs.append((f"split {cand['name']} {dict(topk_mod._split_config(W), **cfg)}",
                                dict(variant="split", split=cfg)))
            for label, kw in configs:
                def f(kw=kw):
                    return _topk_triton(s, k, lens, False, **kw)

                try:
                    same = bool(torch.equal(f()[:4], ref))
                    t = median_ms(f, rep=max(10, rep // 2))
                except Exception as e:  # a config that does not compile/run is reported, not fatal
                    print(f"  sweep {label}: {type(e).__name__}: {e}", flush=True)
                    rows.append(dict(op="topk_dsa_sweep", shape=f"rows={R} width={W} {label}",
                                     error=f"{type(e).__name__}: {str(e)[:300]}"))
                    continue
                rows.append(row("topk_dsa_sweep", f"rows={R} width={W} {label}", t, t_stock, "torch.topk",
                                equal_to_reference=same))
            del s
    return rows


def aot_report() -> None:
    """Compile both designs for sm_90a / sm_100a without a GPU; print registers, spills, shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def usage(kern):
        return cubin_usage(kern)[:70]

    def comp(fn, sig, cx, warps, cc):
        sig = dict(sig, **{key: "constexpr" for key in cx})
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", cc, 32),
                              options=dict(num_warps=warps, enable_fp_fusion=False))

    single = {"s_ptr": "*fp32", "len_ptr": "*i32", "out_ptr": "*i32", "osc_ptr": "*fp32", "W": "i32", "k": "i32",
              "stride_r": "i64"}
    h_sig = {"s_ptr": "*fp32", "len_ptr": "*i32", "tot_ptr": "*i32", "W": "i32", "k": "i32", "stride_r": "i64"}
    c_sig = {"s_ptr": "*fp32", "len_ptr": "*i32", "tot_ptr": "*i32", "bx_ptr": "*fp32", "bp_ptr": "*i32",
             "cnt_ptr": "*i32", "W": "i32", "k": "i32", "NS": "i32", "stride_r": "i64"}
    f_sig = {"bx_ptr": "*fp32", "bp_ptr": "*i32", "cnt_ptr": "*i32", "tot_ptr": "*i32", "out_ptr": "*i32",
             "osc_ptr": "*fp32", "k": "i32", "NS": "i32"}
    failed = 0
    for cc in (90, 100):
        for W in (8192, 65536):
            chunk, digit, warps = _config(W)
            kern = comp(topk_mod._topk_kernel, single, dict(HAS_LEN=True, RET_SCORES=False, CHUNK=chunk, DIGIT=digit,
                        NPASS=(32 + digit - 1) // digit, NB=1 << digit, HIST_MASK=True), warps, cc)
            print(f"single  sm_{cc} W={W} {(chunk, digit, warps)}: {usage(kern)} smem={kern.metadata.shared}",
                  flush=True)
            seen = set()
            for cand in xt.SPLIT_CANDIDATES:
                cfg = dict(topk_mod._split_config(W), **xt.split_candidate(W, cand))
                ns = -(-W // cfg["SW"])
                sp = 1 << (ns - 1).bit_length()
                lv = cfg["LV"]
                parts = (("hist", topk_mod._split_hist_kernel, h_sig,
                          dict(HAS_LEN=True, SW=cfg["SW"], D0=cfg["D0"], LEVEL=lv - 1, LV=lv, HIST_MASK=True),
                          cfg["W1"]),
                         ("compact", topk_mod._split_compact_kernel, c_sig,
                          dict(HAS_LEN=True, SW=cfg["SW"], D0=cfg["D0"], LV=lv), cfg["W2"]),
                         ("finish", topk_mod._split_finish_kernel, f_sig,
                          dict(RET_SCORES=False, SW=cfg["SW"], SP=sp, D0=cfg["D0"], LV=lv, D=cfg["D"],
                               NP=(32 - cfg["D0"] * lv) // cfg["D"], CH=cfg["CH"], HIST_MASK=True), cfg["W3"]))
                for name, fn, sig, cx, warps in parts:
                    key = (name, tuple(sorted(cx.items())), warps)
                    if key in seen:
                        continue
                    seen.add(key)
                    try:
                        kern = comp(fn, sig, cx, warps, cc)
                        msg = f"{usage(kern)} smem={kern.metadata.shared}"
                    except Exception as e:
                        msg = f"FAILED {type(e).__name__}: {str(e)[:300]}"
                        failed += 1
                    print(f"{name:7s} sm_{cc} W={W} {cand['name']} {cx} warps={warps}: {msg}", flush=True)
    if failed:
        raise SystemExit(f"{failed} kernel compilations failed")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true",
                   help="also time every config of both designs (single: CHUNK/DIGIT/num_warps; split: "
                        "experimental SPLIT_CANDIDATES) at widths 8K/64K; configs stay functions of the width only")
    p.add_argument("--sweep-single", action="store_true",
                   help="with --sweep: also the single design's configs (slow: 12 configs x 6 shapes)")
    p.add_argument("--aot", action="store_true", help="no GPU: compile every variant for sm_90a/sm_100a")
    args = p.parse_args()
    if args.aot:
        aot_report()
        return
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

            t_ours, t_stock, where = _time_pair(f_ours, f_stock, rep, R)
            out.append(row("topk_dsa", f"rows={R} width={W} k={k}", t_ours, t_stock, "torch.topk", **where,
                           same_set_as_stock=same_set, variant=topk_mod.VARIANT,
                           **_graph_fields(f_ours, f_stock, rep)))
            for variant in topk_mod.VARIANTS:  # both designs, same inputs, same stock time
                def f_var(variant=variant):
                    return _topk_triton(s, k, lens, False, variant=variant)

                try:
                    same = bool(torch.equal(f_var(), ours))
                    t_var = median_ms(f_var, rep=rep)
                except Exception as e:  # a variant that fails is reported, never fatal to the run
                    print(f"  variant {variant}: {type(e).__name__}: {e}", flush=True)
                    out.append(dict(op=f"topk_dsa[{variant}]", shape=f"rows={R} width={W} k={k}",
                                    error=f"{type(e).__name__}: {str(e)[:300]}"))
                    continue
                out.append(row(f"topk_dsa[{variant}]", f"rows={R} width={W} k={k}", t_var, t_stock, "torch.topk",
                               **where, equal_to_default=same,
                               config=str(_config(W) if variant == "single" else topk_mod._split_config(W))))
            del s, ours, stock
    E, kr = 256, 8
    for T in tokens:
        lg = torch.randn(T, E, device="cuda")

        def r_ours():
            return topk_routing(lg, kr)

        def r_stock():
            return torch.topk(lg, kr, dim=1)

        t_ours, t_stock, where = _time_pair(r_ours, r_stock, rep, T)
        out.append(row("topk_routing", f"tokens={T} experts={E} k={kr}", t_ours, t_stock, "torch.topk", **where,
                       **_graph_fields(r_ours, r_stock, rep)))
    if args.sweep:
        out += sweep(k, rep, single=args.sweep_single)
    write(args.json, "topk", out)


if __name__ == "__main__":
    main()
