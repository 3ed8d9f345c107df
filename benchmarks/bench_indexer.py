"""DSA indexer (FP8 index-key cache, scoring of every history position, Top-K 2048): ours vs stock.

ours  = ``zerodiff.ops.indexer.indexer_topk`` (Triton scoring, one program per row x 64 positions, then
        the deterministic radix Top-K; positions descending).
stock = DeepGEMM ``fp8_fp4_paged_mqa_logits`` (its own paged layout: a block's codes then its scales; the
        same data re-laid out) + ``torch.topk``, when DeepGEMM imports and the call works here; otherwise
        the torch fallback (dequant + einsum + relu-weighted head sum + ``torch.topk``), named in the row.
Columns: scores_ms (our scoring alone), topk_ms (our Top-K alone), torch_stock_ms, deepgemm_ms.

Usage: python benchmarks/bench_indexer.py --json out.json [--quick]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, parser, row, write  # noqa: E402

from zerodiff import backends  # noqa: E402
from zerodiff.ops import indexer as ix  # noqa: E402

H, D, BS, K = 64, 128, 64, 2048


def make(B, ctx, seed=0):
    torch.manual_seed(seed)
    nblk = (ctx + BS - 1) // BS
    nb = B * nblk
    cache = torch.empty(nb, BS, D + 4, dtype=torch.uint8, device="cuda")
    codes = torch.randint(0, 0x7E, (nb, BS, D), dtype=torch.uint8, device="cuda")
    codes |= torch.randint(0, 2, (nb, BS, D), dtype=torch.uint8, device="cuda") << 7
    cache[..., :D] = codes
    cache[..., D:] = (torch.rand(nb, BS, 1, device="cuda") * 0.01 + 1e-3).view(torch.uint8)
    bt = torch.randperm(nb, device="cuda").to(torch.int32).reshape(B, nblk)
    q = torch.randn(B, H, D, device="cuda").to(torch.bfloat16)
    q_fp8, qs = ix.quant_index_q(q)
    w = (torch.randn(B, H, device="cuda") * qs).to(torch.float32)
    return cache, bt, q_fp8, w


def torch_stock(cache, bt, q_fp8, w, lens, width):
    """vLLM-fallback-style stock: dequantise each row's history, bf16 einsum, relu-weighted sum, torch.topk."""
    B = q_fp8.shape[0]
    nblk = bt.shape[1]
    rows = cache[bt.long()].reshape(B, nblk * BS, D + 4)[:, :width]
    k = rows[..., :D].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16)
    s = rows[..., D:].contiguous().view(torch.float32)  # [B, W, 1]
    logits = torch.einsum("bhd,bsd->bhs", q_fp8.to(torch.bfloat16), k).float() * s[..., 0][:, None, :]
    score = (logits.relu() * w[..., None]).sum(1)
    ar = torch.arange(width, device="cuda")[None, :]
    score = score.masked_fill(ar >= lens[:, None], float("-inf"))
    return torch.topk(score, K, dim=-1).indices


def deepgemm_stock(cache, bt, q_fp8, w, lens, width):
    dg = backends.deep_gemm()
    if dg is None:
        raise RuntimeError(f"DeepGEMM not importable: {backends.status()['deepgemm']['detail']}")
    nb = cache.shape[0]
    dg_cache = torch.cat([cache[..., :D].reshape(nb, BS * D), cache[..., D:].reshape(nb, BS * 4)], 1)
    dg_cache = dg_cache.view(nb, BS, 1, D + 4)
    ctx = lens.to(torch.int32)[:, None].contiguous()
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sched = dg.get_paged_mqa_logits_metadata(ctx, BS, n_sms)

    def run():
        logits = dg.fp8_fp4_paged_mqa_logits((q_fp8[:, None].contiguous(), None), dg_cache, w, ctx, bt, sched, width)
        return torch.topk(logits.float(), K, dim=-1).indices

    run()
    return run


def bench(B, ctx, reps, rows):
    cache, bt, q_fp8, w = make(B, ctx)
    req = torch.arange(B, dtype=torch.int32, device="cuda")
    pos = torch.full((B,), ctx - 1, dtype=torch.int32, device="cuda")
    lens = pos + 1
    width = ctx

    def ours():
        return ix.indexer_topk(q_fp8, w, cache, bt, req, pos, K, width, check=False)

    def scores():
        return ix.index_scores(q_fp8, w, cache, bt, req, pos, width, check=False)

    sc = scores()
    from zerodiff.ops.topk import deterministic_topk

    def topk():
        return deterministic_topk(sc, K, lens)

    err = {}
    o_ms = median_ms(ours, rep=reps)
    s_ms = median_ms(scores, rep=reps)
    t_ms = median_ms(topk, rep=reps)
    try:
        ts_ms = median_ms(lambda: torch_stock(cache, bt, q_fp8, w, lens, width), rep=reps)
    except Exception as e:
        err["torch_stock"] = f"{type(e).__name__}: {e}"[:300]
        ts_ms = float("nan")
    try:
        dg_ms = median_ms(deepgemm_stock(cache, bt, q_fp8, w, lens, width), rep=reps)
    except Exception as e:
        err["deepgemm"] = f"{type(e).__name__}: {e}"[:300]
        dg_ms = float("nan")
    if dg_ms == dg_ms:
        stock_ms, stock = dg_ms, "DeepGEMM fp8_fp4_paged_mqa_logits + torch.topk"
    else:
        stock_ms, stock = ts_ms, "torch dequant+einsum+relu-sum + torch.topk (DeepGEMM unavailable)"
    rows.append(row("indexer_decode", f"B={B} ctx={ctx} H={H} d={D} k={K}", o_ms, stock_ms, stock,
                    scores_ms=round(s_ms, 5), topk_ms=round(t_ms, 5), torch_stock_ms=round(ts_ms, 5),
                    deepgemm_ms=round(dg_ms, 5), errors=err or None))
    del cache
    torch.cuda.empty_cache()


def main():
    args = parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rows: list[dict] = []
    if args.quick:
        shapes, reps = [(1, 8192), (64, 8192), (128, 16384)], 20
    else:
        shapes = [(B, c) for c in (8192, 32768, 65536) for B in (1, 16, 64, 128) if B * c <= 64 * 65536]
        reps = 50
    for B, c in shapes:
        bench(B, c, reps, rows)
    write(args.json, "indexer", rows)


if __name__ == "__main__":
    main()
