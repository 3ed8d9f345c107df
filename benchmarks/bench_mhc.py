"""mHC pre/post: our fixed-split kernels vs the stock batch-dependent split (DeepSeek-V4 shapes).

mhc_pre (hc_mult 4, H in 4096 / 7168, T tokens):
  stock = vLLM 0.33.0's CUDA path as far as it exists without TileLang: DeepGEMM
          ``tf32_hc_prenorm_gemm`` with ``n_splits`` from the token count and SM count (vLLM's
          ``compute_num_split``), then the partials added in split order by our Triton epilogue
          (stand-in for TileLang's ``mhc_pre_big_fuse``; same memory traffic). Falls back to per-split
          cuBLAS matmuls where DeepGEMM is missing (the row's ``stock`` field says which ran).
  ours  = ``mhc_pre`` (split count fixed at 1); columns ``ours_gemm_ms`` / ``ours_epi_ms`` split it.
  also  = the plain torch fp32 eager path (``torch_eager_ms``), and variants that are NOT the contract,
          for the lead's decision: ``tf32x3_ms`` (the projection on tensor cores, 3 passes) and
          ``fixed8_ms`` / ``fixed16_ms`` (a fixed split count of 8 / 16 for every T: still batch-invariant,
          same x traffic, more programs at small T, but a change of the "split count 1" contract).
mhc_post: ours vs the torch fp32 eager formula (vLLM's ``mhc_post_torch``; TileLang's kernel is not
          available without TileLang).
hc_head:  ours vs torch fp32 eager (the final collapse, once per forward).

Usage: python benchmarks/bench_mhc.py --json out.json [--quick]
(The first run may include DeepGEMM JIT compiles, one per distinct stock split count; they happen before
timing, but count against the wall clock.)
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, parser, row, write  # noqa: E402

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


def variant(res, fn, scale, base, splits, precision):
    mix, sq = mhc.prenorm_gemm(res, fn, splits=splits, _precision=precision)
    return mhc.pre_epilogue(mix, sq, res, scale, base, **KW)


def post_torch(lo, res, post, comb):
    mixed = torch.einsum("tij,tih->tjh", comb, res.float())
    return (mixed + post.unsqueeze(-1) * lo.float().unsqueeze(1)).to(torch.bfloat16)


def main():
    args = parser(__doc__.splitlines()[0]).parse_args()
    if args.quick:
        # few distinct stock split counts (112, 4, 1): each may cost a DeepGEMM JIT compile on a cold cache
        shapes = [(7168, T) for T in (1, 64, 2048, 8192)]
        reps = dict(warmup=5, rep=20)
    else:
        shapes = [(H, T) for H in (4096, 7168) for T in (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)]
        reps = dict(warmup=10, rep=50)
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for H, T in shapes:
        res, fn, scale, base, lo = inputs(T, H)
        shape = f"T={T} H={H} hc={N_HC}"
        info = {}
        mhc.mhc_pre_split_baseline(res, fn, scale, base, n_sms=n_sms, info=info, **KW)
        stock_name = f"{info['gemm']} (n_splits={info['n_splits']} from T) + {info['epilogue']} epilogue"
        if "deepgemm_error" in info:
            stock_name += f" [DeepGEMM failed: {info['deepgemm_error'][:120]}]"
        gemm_kind = "deepgemm" if info["gemm"].startswith("deepgemm") else "torch"

        # sanity: the stock partials sum to the same projection (tf32 tolerance), ours to fp32 accuracy
        ours = mhc.mhc_pre(res, fn, scale, base, **KW)
        stock = mhc.mhc_pre_split_baseline(res, fn, scale, base, n_sms=n_sms, gemm=gemm_kind, **KW)
        comb_diff = (ours[2] - stock[2]).abs().max().item()

        t_ours = median_ms(lambda: mhc.mhc_pre(res, fn, scale, base, **KW), **reps)
        t_stock = median_ms(lambda: mhc.mhc_pre_split_baseline(res, fn, scale, base, n_sms=n_sms,
                                                               gemm=gemm_kind, **KW), **reps)
        mix, sq = mhc.prenorm_gemm(res, fn)
        t_gemm = median_ms(lambda: mhc.prenorm_gemm(res, fn), **reps)
        t_epi = median_ms(lambda: mhc.pre_epilogue(mix, sq, res, scale, base, **KW), **reps)
        t_eager = median_ms(lambda: mhc.mhc_pre_torch_eager(res, fn, scale, base, **KW), **reps)
        extra = {}
        for name, splits, prec in (("tf32x3_ms", 1, "tf32x3"), ("fixed8_ms", 8, "ieee"),
                                   ("fixed16_ms", 16, "ieee")):
            try:
                variant(res, fn, scale, base, splits, prec)
                extra[name] = round(median_ms(lambda: variant(res, fn, scale, base, splits, prec), **reps), 5)
            except Exception as e:  # noqa: BLE001 - informational variants only
                extra[name] = f"failed: {type(e).__name__}: {str(e)[:100]}"
        rows.append(row("mhc_pre", shape, t_ours, t_stock, stock_name,
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
        del res, fn, lo, mix, sq, ours, stock
        torch.cuda.empty_cache()
    write(args.json, "mhc", rows)


if __name__ == "__main__":
    main()
