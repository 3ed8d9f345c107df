"""mHC pre/post: our fixed-split kernels vs the stock batch-dependent split (DeepSeek-V4 shapes).

mhc_pre (hc_mult 4, H in 4096 / 7168, T tokens):
  stock = vLLM 0.33.0's CUDA path as far as it exists without TileLang (``zerodiff.baselines.mhc``): DeepGEMM
          ``tf32_hc_prenorm_gemm`` with ``n_splits`` from the token count and SM count (vLLM's
          ``compute_num_split``), then the partials added in split order by the baseline's Triton epilogue
          (stand-in for TileLang's ``mhc_pre_big_fuse``; same memory traffic). Falls back to per-split
          cuBLAS matmuls where DeepGEMM is missing (the row's ``stock`` field says which ran).
  ours  = the shipped ``zerodiff.ops.mhc.mhc_pre`` (row field ``variant`` = its name); columns
          ``ours_gemm_ms`` / ``ours_epi_ms`` split it into projection and epilogue.
  also  = the plain torch fp32 eager path (``torch_eager_ms``), and the configurations of
          :data:`EXTRA_CANDIDATES` (not the contract, informational): ``tf32x3_s1_ms`` (the projection on
          tensor cores, 3 passes, no split) and ``ieee_s8_ms`` / ``ieee_s16_ms`` (fp32 FMA with a fixed split
          count of 8 / 16 for every T: still batch-invariant, same x traffic, more programs at small T).
mhc_post: ours vs the torch fp32 eager formula (vLLM's ``mhc_post_torch``; TileLang's kernel is not
          available without TileLang).
hc_head:  ours vs torch fp32 eager (the final collapse, once per forward).

--sweep:  also one row per split-K variant of ``zerodiff.experimental.mhc_variants.VARIANTS`` and the shipped
          configuration (``op`` = ``mhc_pre[<variant>]`` / ``hc_head[<variant>]``), timed against the SAME stock
          measurement as the
          default row of that shape, with ``gemm_ms`` (projection alone), ``splits``, ``proj_err`` (max
          |sum of partials - float64| / sum|x*w| over the first 256 tokens) and ``comb_err`` /
          ``li_max_ulp`` (vs the float64 reference on those tokens). With --quick the sweep times the
          variants in ``QUICK_SWEEP`` (and two hc_head variants) only: about 30 extra Triton compiles
          (T == 1 is its own specialization) plus the timings; the full sweep takes a few minutes.
--aot:    no GPU needed: AOT-compiles every variant's kernels for sm_90a and sm_100a with this Triton
          and prints registers / stack (spills) / shared memory / which MMA instruction was emitted.

Usage: python benchmarks/bench_mhc.py --json out.json [--quick] [--sweep]
       python benchmarks/bench_mhc.py --aot
(The first run may include DeepGEMM JIT compiles, one per distinct stock split count; they happen before
timing, but count against the wall clock.)
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import cubin_usage, median_ms, parser, row, write  # noqa: E402

from zerodiff.baselines import mhc as stock  # noqa: E402
from zerodiff.experimental import mhc_variants as xm  # noqa: E402
from zerodiff.ops import mhc  # noqa: E402
from zerodiff.reference import mhc as ref  # noqa: E402

N_HC = 4
KW = dict(rms_eps=ref.RMS_EPS, hc_pre_eps=ref.HC_EPS, hc_sinkhorn_eps=ref.HC_EPS,
          hc_post_mult=ref.POST_MULT, sinkhorn_iters=ref.SINKHORN_ITERS)


def inputs(T, H):
    g = torch.Generator(device="cuda").manual_seed(T * 7 + H)
    res = torch.randn(T, N_HC, H, generator=g, device="cuda").to(torch.bfloat16)
    fn = torch.randn(ref.n_mix(N_HC), N_HC * H, generator=g, device="cuda") * 0.02
    scale = torch.tensor([2.0, 0.02, 0.25], device="cuda")
    base = torch.randn(ref.n_mix(N_HC), generator=g, device="cuda") * 0.5
    lo = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
    return res, fn, scale, base, lo


#: informational configurations timed beside the shipped one on every shape (column -> variant)
EXTRA_CANDIDATES = {
    "tf32x3_s1_ms": xm.PrenormVariant("tf32x3_s1", 1, "tf32x3", block_m=16),
    "ieee_s8_ms": xm.PrenormVariant("ieee_s8", 8, "ieee", block_m=16),
    "ieee_s16_ms": xm.PrenormVariant("ieee_s16", 16, "ieee", block_m=16),
}


def _variant(name):
    """A sweep name: the shipped configuration's, else an experimental registry entry."""
    return xm.SHIPPED if name == xm.SHIPPED.name else xm.VARIANTS[name]


def post_torch(lo, res, post, comb):
    mixed = torch.einsum("tij,tih->tjh", comb, res.float())
    return (mixed + post.unsqueeze(-1) * lo.float().unsqueeze(1)).to(torch.bfloat16)


#: variants timed by --quick --sweep (the full sweep times the shipped one and every entry of xm.VARIANTS)
QUICK_SWEEP = ("ieee_s112", "tf32_s112", "bf16x3_s32", "bf16x3_s112", "bf16x3_s112_e1", "tf32_s112_e1")
#: hc_head variants timed by the sweep (its projection has 4 outputs; same kernels); --quick: the first two
HEAD_SWEEP = ("bf16x3_s112_e1", "bf16x3_s112", "tf32_s112", "bf16x3_s32", "ieee_s112")


def _ordered_bf16(t):
    """bf16 bit patterns as integers in value order (+0 and -0 both 0): differences count ulps, also across 0."""
    b = t.view(torch.int16).int()
    return torch.where(b < 0, -(b & 0x7FFF), b)


def _accuracy(res, fn, scale, base, name):
    """Projection error and output error of a variant on the first <= 256 tokens (float64 reference)."""
    r = res[:256].contiguous()
    mix, _ = xm.prenorm_gemm_splitk(r, fn, _variant(name))
    x = r.reshape(r.shape[0], -1).double()
    exact = x @ fn.double().t()
    mag = (x.abs() @ fn.double().abs().t()).clamp_min(1e-300)
    proj_err = ((mix.double().sum(0) - exact).abs() / mag).max().item()
    li, post, comb = xm.mhc_pre(r, fn, scale, base, variant=_variant(name), **KW)
    li_r, post_r, comb_r = ref.mhc_pre_ref(r, fn, scale, base, **KW)
    ulp = (_ordered_bf16(li) - _ordered_bf16(li_r)).abs().max().item()
    return dict(proj_err=float(f"{proj_err:.3g}"), comb_err=float(f"{(comb - comb_r).abs().max().item():.3g}"),
                post_err=float(f"{(post - post_r).abs().max().item():.3g}"), li_max_ulp=ulp)


def sweep_rows(res, fn, scale, base, hfn, hscale, hbase, shape, t_stock, stock_name, t_head_stock, names, reps,
               head_names=HEAD_SWEEP):
    rows = []
    K = res.shape[1] * res.shape[2]
    for name in names:
        try:
            v = _variant(name)
            xm.mhc_pre(res, fn, scale, base, variant=v, **KW)
            t = median_ms(lambda: xm.mhc_pre(res, fn, scale, base, variant=v, **KW), **reps)
            t_gemm = median_ms(lambda: xm.prenorm_gemm_splitk(res, fn, v), **reps)
            acc = _accuracy(res, fn, scale, base, name)
            rows.append(row(f"mhc_pre[{name}]", shape, t, t_stock, stock_name, gemm_ms=round(t_gemm, 5),
                            splits=xm.variant_splits(K, v)[0], **acc))
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, the sweep goes on
            print(f"mhc_pre[{name}] {shape}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            common._MODES.clear()
            rows.append(dict(op=f"mhc_pre[{name}]", shape=shape, error=f"{type(e).__name__}: {str(e)[:300]}"))
    for name in head_names:
        try:
            v = _variant(name)
            xm.hc_head(res, hfn, hscale, hbase, variant=v)
            t = median_ms(lambda: xm.hc_head(res, hfn, hscale, hbase, variant=v), **reps)
            rows.append(row(f"hc_head[{name}]", shape, t, t_head_stock,
                            "torch fp32 eager (TileLang hc_head not available without TileLang)",
                            splits=xm.variant_splits(K, v)[0]))
        except Exception as e:  # noqa: BLE001
            print(f"hc_head[{name}] {shape}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            common._MODES.clear()
            rows.append(dict(op=f"hc_head[{name}]", shape=shape, error=f"{type(e).__name__}: {str(e)[:300]}"))
    return rows


def aot_report():
    """Compile every variant's kernels ahead of time for SM90 / SM100 (no GPU): registers, spills, MMA."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def usage(k):
        return " ".join(cubin_usage(k).split()[:2]) or "?"

    def mma(ptx):
        for ins in ("wgmma", "tcgen05", "mma.sync"):
            if ins in ptx:
                return ins
        return "fma"

    gsig = {"x_ptr": "*bf16", "fn_ptr": "*fp32", "mix_ptr": "*fp32", "sq_ptr": "*fp32", "T": "i32", "K": "i32"}
    pre_sig = {"mix_ptr": "*fp32", "sq_ptr": "*fp32", "scale_ptr": "*fp32", "base_ptr": "*fp32",
               "res_ptr": "*bf16", "li_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "T": "i32",
               "H": "i32", "K": "i32", "rms_eps": "fp32", "pre_eps": "fp32", "sk_eps": "fp32",
               "post_mult": "fp32", "ITERS": "i32"}
    head_sig = {"mix_ptr": "*fp32", "sq_ptr": "*fp32", "scale_ptr": "*fp32", "base_ptr": "*fp32",
                "res_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "H": "i32", "K": "i32", "rms_eps": "fp32",
                "hc_eps": "fp32"}

    def build(fn, sig, const, cc, **opts):
        # what a real launch specialises: 16-byte aligned pointers and K / H divisible by 16 (without
        # these hints the loads compile to scalar 4-byte copies and the register counts mislead)
        aligned = [i for i, (k, t) in enumerate(sig.items()) if t.startswith("*") or k in ("K", "H")]
        return triton.compile(ASTSource(fn=fn, signature=dict(sig, **{c: "constexpr" for c in const}),
                                        constexprs=const, attrs={(i,): [["tt.divisibility", 16]] for i in aligned}),
                              target=GPUTarget("cuda", cc, 128), options=dict(enable_fp_fusion=False, **opts))

    def loads(ptx):
        import re

        sizes = re.findall(r"cp\.async\.\w+\.shared\.global(?:\.L2::\w+)?\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x\w+|\d+)",
                           ptx)
        return f"cp.async x{len(sizes)} ({','.join(sorted(set(sizes)))} B) ld.global x{ptx.count('ld.global')}"

    epi_done = set()
    candidates = {xm.SHIPPED.name: xm.SHIPPED, **xm.VARIANTS}
    epi_warps = sorted({v.epi_warps for v in candidates.values()})
    for name, v in candidates.items():
        # bf16x3: the shipped kernel under the variant's configuration; otherwise the one-dot kernel
        kern = mhc._prenorm_splitk_kernel if v.precision == "bf16x3" else xm._prenorm_splitk_dot_kernel
        for H in (7168, 4096):
            K = N_HC * H
            S, bps = xm.variant_splits(K, v)
            for nm, what in ((ref.n_mix(N_HC), "pre "), (N_HC, "head")):
                const = dict(NMIX=nm, BM=v.block_m, BN=mhc._block_n(nm), BK=v.block_k, BPS=bps,
                             EVEN_K=(K % v.block_k == 0), EXACT=False)
                if v.precision != "bf16x3":
                    const["PREC"] = v.precision
                for cc in (90, 100):
                    try:
                        k = build(kern, gsig, const, cc, num_warps=v.warps, num_stages=v.stages)
                        print(f"gemm {what} {name:17s} H={H} S={S:3d} bps={bps:2d} sm_{cc}: {usage(k)} "
                              f"shared={k.metadata.shared} {mma(k.asm['ptx'])} {loads(k.asm['ptx'])}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"gemm {what} {name} H={H} sm_{cc}: FAILED {type(e).__name__}: {str(e)[:300]}")
            if S in epi_done:
                continue
            epi_done.add(S)
            for kern, sig, what in ((mhc._mhc_pre_epilogue_splits_kernel, pre_sig, "pre "),
                                    (mhc._hc_head_epilogue_splits_kernel, head_sig, "head")):
                const = dict(S=S, SP=mhc._pow2_at_least(S), NH=N_HC, BLOCK_H=mhc._EPI_BLOCK_H, EXACT=False)
                for cc in (90, 100):
                    try:
                        for w in epi_warps:
                            k = build(kern, sig, const, cc, num_warps=w)
                            print(f"epi  {what} S={S:3d} warps={w} sm_{cc}: {usage(k)}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"epi  {what} S={S} sm_{cc}: FAILED {type(e).__name__}: {str(e)[:300]}")


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="also time every split-K variant")
    p.add_argument("--aot", action="store_true", help="AOT-compile the variant kernels (no GPU): registers/spills")
    p.add_argument("--hidden", type=int, action="append", default=None, metavar="H",
                   help="hidden size(s) to time instead of the DeepSeek-V4 ones (repeatable; e.g. 2048 for the "
                        "end-to-end h200 preset)")
    args = p.parse_args()
    if args.aot:
        aot_report()
        return
    if args.quick:
        # few distinct stock split counts (112, 4, 1): each may cost a DeepGEMM JIT compile on a cold cache
        shapes = [(H, T) for H in (args.hidden or [7168]) for T in (1, 64, 2048, 8192)]
        reps = dict(warmup=5, rep=20)
    else:
        shapes = [(H, T) for H in (args.hidden or [4096, 7168])
                  for T in (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)]
        reps = dict(warmup=10, rep=50)
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    sweep = []
    for H, T in shapes:
        res, fn, scale, base, lo = inputs(T, H)
        shape = f"T={T} H={H} hc={N_HC}"
        info = {}
        stock.mhc_pre_split_baseline(res, fn, scale, base, n_sms=n_sms, info=info, **KW)
        stock_name = f"{info['gemm']} (n_splits={info['n_splits']} from T) + {info['epilogue']} epilogue"
        if "deepgemm_error" in info:
            stock_name += f" [DeepGEMM failed: {info['deepgemm_error'][:120]}]"
        gemm_kind = "deepgemm" if info["gemm"].startswith("deepgemm") else "torch"

        # sanity: the stock partials sum to the same projection (tf32 tolerance), ours to fp32 accuracy
        ours = mhc.mhc_pre(res, fn, scale, base, **KW)
        stock_out = stock.mhc_pre_split_baseline(res, fn, scale, base, n_sms=n_sms, gemm=gemm_kind, **KW)
        comb_diff = (ours[2] - stock_out[2]).abs().max().item()

        t_ours = median_ms(lambda: mhc.mhc_pre(res, fn, scale, base, **KW), **reps)
        t_stock = median_ms(lambda: stock.mhc_pre_split_baseline(res, fn, scale, base, n_sms=n_sms,
                                                                 gemm=gemm_kind, **KW), **reps)
        # the projection / epilogue split of what mhc_pre runs
        mix, sq = mhc.prenorm_gemm_splitk(res, fn)
        t_gemm = median_ms(lambda: mhc.prenorm_gemm_splitk(res, fn), **reps)
        t_epi = median_ms(lambda: mhc.pre_epilogue_splits(mix, sq, res, scale, base, **KW), **reps)
        t_eager = median_ms(lambda: stock.mhc_pre_torch_eager(res, fn, scale, base, **KW), **reps)
        extra = {}
        for col, v in EXTRA_CANDIDATES.items():
            try:
                xm.mhc_pre(res, fn, scale, base, variant=v, **KW)
                extra[col] = round(median_ms(lambda: xm.mhc_pre(res, fn, scale, base, variant=v, **KW), **reps), 5)
            except Exception as e:  # noqa: BLE001 - informational variants only
                extra[col] = f"failed: {type(e).__name__}: {str(e)[:100]}"
        rows.append(row("mhc_pre", shape, t_ours, t_stock, stock_name, variant=mhc.DEFAULT_VARIANT,
                        ours_gemm_ms=round(t_gemm, 5), ours_epi_ms=round(t_epi, 5),
                        torch_eager_ms=round(t_eager, 5), ratio_vs_eager=round(t_ours / t_eager, 4),
                        max_abs_comb_diff_vs_stock=comb_diff, stock_n_splits=info["n_splits"], **extra))

        post, comb = ours[1], ours[2]
        t_post = median_ms(lambda: mhc.mhc_post(lo, res, post, comb), **reps)
        t_post_stock = median_ms(lambda: post_torch(lo, res, post, comb), **reps)
        rows.append(row("mhc_post", shape, t_post, t_post_stock, "torch fp32 eager (vLLM mhc_post_torch)"))

        hfn, hscale, hbase = fn[:N_HC].contiguous(), scale[:1].contiguous(), base[:N_HC].contiguous()
        t_head = median_ms(lambda: mhc.hc_head(res, hfn, hscale, hbase), **reps)
        t_head_eager = median_ms(lambda: ref.hc_head_ref(res, hfn, hscale, hbase, dtype=torch.float32), **reps)
        rows.append(row("hc_head", shape, t_head, t_head_eager,
                        "torch fp32 eager (TileLang hc_head not available without TileLang)"))
        if args.sweep:
            names = QUICK_SWEEP if args.quick else [xm.SHIPPED.name, *xm.VARIANTS]
            sweep += sweep_rows(res, fn, scale, base, hfn, hscale, hbase, shape, t_stock, stock_name,
                                t_head_eager, names, reps, HEAD_SWEEP[:2] if args.quick else HEAD_SWEEP)
        del res, fn, lo, mix, sq, ours, stock_out
        torch.cuda.empty_cache()
    write(args.json, "mhc", rows)
    if args.sweep:
        # own file (own table columns in benchmarks/report.py): <json stem>_sweep.json beside --json
        spath = None
        if args.json:
            root, ext = os.path.splitext(args.json)
            spath = f"{root}_sweep{ext or '.json'}"
        write(spath, "mhc_sweep", sweep)
        print("\nfastest variant per shape (ours/stock ratio):", flush=True)
        for op in ("mhc_pre", "hc_head"):
            for shp in dict.fromkeys(r["shape"] for r in sweep):
                cand = [r for r in sweep if r["shape"] == shp and r["op"].startswith(op + "[") and "ours_ms" in r]
                if cand:
                    best = min(cand, key=lambda r: r["ours_ms"])
                    print(f"  {op:8s} {shp:24s} {best['op']:26s} {best['ours_ms']:.4f} ms ratio {best['ratio']}",
                          flush=True)


if __name__ == "__main__":
    main()
