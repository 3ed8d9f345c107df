"""Routed MoE experts end to end: ours (deterministic Top-K routing, grouped FP8 Triton GEMMs, one-rounding
SiLU*mul->FP8, slot-order FP32 combine) vs a stock composition on the same grouped GEMMs: ``torch.topk``
routing, BF16 ``F.silu(g) * u`` then the per-token-group quant, and a BF16 ``index_add_`` combine.
DeepSeek-V4-Flash-like shapes scaled down: hidden 4096/7168, expert intermediate 2048, 64 experts top-8.

    python benchmarks/bench_moe.py --json out.json [--quick]
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_generator, median_ms, parse, row, write  # noqa: E402

from zerodiff.ops import fp8_gemm as fg  # noqa: E402
from zerodiff.ops import moe  # noqa: E402
from zerodiff.ops.fp8_quant import quant_act  # noqa: E402


def stock_moe(x, logits, ex, k):
    T, H = x.shape
    sc = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(sc, k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ids = ids.to(torch.int32)
    plan = moe.plan_dispatch(ids, ex.num_experts, layout="contiguous")
    xq, xs = quant_act(x)
    tok = torch.arange(T, device=x.device).repeat_interleave(k)
    a = torch.zeros((plan.rows + 1, H), dtype=torch.uint8, device=x.device)
    a_s = torch.zeros((plan.rows + 1, xs.shape[1]), dtype=torch.float32, device=x.device)
    d = plan.dest.reshape(-1)
    a[d] = xq.view(torch.uint8)[tok]
    a_s[d] = xs[tok]
    h = fg.grouped_fp8_gemm(a[: plan.rows].view(torch.float8_e4m3fn), a_s[: plan.rows], ex.w13.q, ex.w13.scale,
                            plan.tile_expert)
    I = h.shape[1] // 2
    act = F.silu(h[:, :I]) * h[:, I:]
    hq, hs = quant_act(act)
    y = fg.grouped_fp8_gemm(hq, hs, ex.w2.q, ex.w2.scale, plan.tile_expert)
    out = torch.zeros_like(x)
    out.index_add_(0, tok, y[plan.dest.reshape(-1).clamp(max=plan.rows - 1)] * w.reshape(-1, 1).to(torch.bfloat16))
    return out


def grouped_gemm_rows(ex, H, T, k, rep, dg):
    """GEMM-level rows: our grouped Triton GEMM (w13) vs DeepGEMM's grouped kernels on a balanced layout with
    the same FP8 operands (the MoE row of the baseline table in docs/results.md). Skipped with a message when DeepGEMM
    fails."""
    rows = []
    E = ex.num_experts
    N = ex.w13.q.shape[1]
    per = max(1, (T * k) // E)
    dev = "cuda"
    if T <= 256:  # decode: masked layout
        C = (per + 63) // 64 * 64
        a = torch.randn(E * C, H, device=dev).to(torch.bfloat16)
        q, s = quant_act(a)
        counts = torch.full((E,), per, dtype=torch.int32, device=dev)
        ti = torch.arange(E * C // 64, device=dev)
        te = torch.where((ti % (C // 64)) * 64 < per, ti // (C // 64), -1).to(torch.int32)
        out = torch.empty(E * C, N, dtype=torch.bfloat16, device=dev)
        t_ours = median_ms(lambda: fg.grouped_fp8_gemm(q, s, ex.w13.q, ex.w13.scale, te, out=out), rep=rep)
        try:
            d = torch.empty(E, C, N, dtype=torch.bfloat16, device=dev)
            q3, s3 = q.view(E, C, H), s.view(E, C, -1)
            t_dg = median_ms(lambda: dg.m_grouped_fp8_gemm_nt_masked((q3, s3), (ex.w13.q, ex.w13.scale), d, counts, per,
                                                                     disable_ue8m0_cast=True), rep=rep)
            rows.append(row("grouped_gemm_w13[masked]", f"T={T} per_expert={per} N={N} K={H} E={E}", t_ours, t_dg,
                            "DeepGEMM m_grouped_fp8_gemm_nt_masked", T=T))
        except Exception as ex_:
            print(f"DeepGEMM masked grouped GEMM failed (T={T}): {type(ex_).__name__}: {ex_}")
    else:  # prefill / training: contiguous layout
        al = 128
        R = (per + al - 1) // al * al
        a = torch.randn(E * R, H, device=dev).to(torch.bfloat16)
        q, s = quant_act(a)
        m_idx = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(R)
        m_idx.view(E, R)[:, per:] = -1
        ti = torch.arange(E * R // 64, device=dev)
        te = torch.where((ti % (R // 64)) * 64 < per, ti // (R // 64), -1).to(torch.int32)
        out = torch.empty(E * R, N, dtype=torch.bfloat16, device=dev)
        t_ours = median_ms(lambda: fg.grouped_fp8_gemm(q, s, ex.w13.q, ex.w13.scale, te, out=out), rep=rep)
        try:
            d = torch.empty(E * R, N, dtype=torch.bfloat16, device=dev)
            t_dg = median_ms(lambda: dg.m_grouped_fp8_gemm_nt_contiguous((q, s), (ex.w13.q, ex.w13.scale), d, m_idx,
                                                                         disable_ue8m0_cast=True), rep=rep)
            rows.append(row("grouped_gemm_w13[contiguous]", f"T={T} per_expert={per} N={N} K={H} E={E}", t_ours, t_dg,
                            "DeepGEMM m_grouped_fp8_gemm_nt_contiguous", T=T))
        except Exception as ex_:
            print(f"DeepGEMM contiguous grouped GEMM failed (T={T}): {type(ex_).__name__}: {ex_}")
    return rows


def main():
    args, rep = parse(__doc__, quick_rep=10, rep=30)
    Hs = (4096,) if args.quick else (4096, 7168)
    Ts = (1, 128, 1024) if args.quick else (1, 16, 64, 128, 512, 1024, 4096)
    E, I, k = 64, 2048, 8
    rows = []
    from zerodiff import backends

    dg = backends.deep_gemm()
    g = cuda_generator(0)
    for H in Hs:
        ex = moe.MoEWeights.from_master((torch.randn(E, 2 * I, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16),
                                        (torch.randn(E, H, I, generator=g, device="cuda") * 0.02).to(torch.bfloat16))
        for T in Ts:
            x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
            logits = torch.randn(T, E, generator=g, device="cuda")

            def ours(layout):
                w, ids = moe.route(logits, k)
                return moe.moe_experts(x, w, ids, ex, layout=layout, capacity=T)

            t_stock = median_ms(lambda: stock_moe(x, logits, ex, k), rep=rep)
            # masked layout = rollout decode (DeepEP LL); capacity = T keeps it overflow-free and graph-safe
            for layout in (("contiguous", "masked") if T <= 256 else ("contiguous",)):
                t = median_ms(lambda: ours(layout), rep=rep)
                rows.append(row(f"moe[{layout}]", f"T={T} H={H} I={I} E={E} k={k}", t, t_stock,
                                "torch.topk + same grouped FP8 GEMMs + bf16 silu*up + quant + bf16 index_add_", T=T))
            if dg is not None and not args.quick:  # our DeepGEMM-grouped backend, only where its probe passed
                ok = all(moe.deepgemm_grouped_verdict(N_, K_, "cuda")[0] for N_, K_ in ((2 * I, H), (H, I)))
                if ok:
                    for layout in (("contiguous", "masked") if T <= 256 else ("contiguous",)):
                        t = median_ms(lambda: moe.moe_experts(x, *moe.route(logits, k), ex, layout=layout, capacity=T,
                                                              backend="deepgemm"), rep=rep)
                        rows.append(row(f"moe[{layout},deepgemm]", f"T={T} H={H} I={I} E={E} k={k}", t, t_stock,
                                        "torch.topk + same grouped FP8 GEMMs + bf16 silu*up + quant + bf16 index_add_",
                                        T=T))
                elif T == Ts[0]:
                    print("DeepGEMM grouped backend not verified:",
                          [moe.deepgemm_grouped_verdict(N_, K_, "cuda") for N_, K_ in ((2 * I, H), (H, I))])
            if dg is not None:
                rows += grouped_gemm_rows(ex, H, T, k, rep, dg)
    write(args.json, "moe", rows)


if __name__ == "__main__":
    main()
