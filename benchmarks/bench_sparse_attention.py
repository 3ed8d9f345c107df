"""Sparse MLA attention over the FP8 KV cache: our one read path vs the stock kernels.

decode (one query row per request, 64 heads, d_qk 576, d_v 512, top-k 2048, 656-byte FP8 cache):
  stock  = FlashMLA's FP8 sparse decode ``flash_mla_with_kvcache(is_fp8_kvcache=True)`` (batch-dependent)
  ours   = ``sparse_mla_attention(backend="flashmla")``: Triton gather+dequant into the per-row BF16
           workspace, then ``flash_mla_sparse_fwd`` (columns gather_ms / sparse_fwd_ms split it);
  also   = the Triton fallback over the workspace (triton_ms) and reading FP8 directly (triton_fp8_ms).
  Each in eager mode and replayed from a CUDA graph (how the rollout runs decode).
prefill (rows of one request, each attending to its own top-k):
  stock  = vLLM-style: dequantise the request's cache with torch ops, then ``flash_mla_sparse_fwd``
  ours   = ``sparse_mla_attention(workspace="per_request")`` (and "per_row" in per_row_ms).

Usage: python benchmarks/bench_sparse_attention.py --json out.json [--quick]
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, parser, row, write  # noqa: E402

from zerodiff import backends  # noqa: E402
from zerodiff.ops import kv_cache as kc  # noqa: E402
from zerodiff.ops import sparse_attention as sa  # noqa: E402

H, DQK, DV, BS = 64, 576, 512, 64
STOCK = "flash_mla_with_kvcache (FlashMLA FP8 sparse decode)"


def make_cache(B, ctx, gen_seed=0):
    """Random but valid 656-byte tokens (finite codes, positive scales, random rope) for B requests of ctx."""
    torch.manual_seed(gen_seed)
    nblk = (ctx + BS - 1) // BS
    nb = B * nblk
    cache = torch.empty(nb, BS, 656, dtype=torch.uint8, device="cuda")
    flat = cache.view(-1, 656)
    step = 1 << 20
    for t0 in range(0, flat.shape[0], step):
        f = flat[t0 : t0 + step]
        n = f.shape[0]
        codes = torch.randint(0, 0x7E, (n, 512), dtype=torch.uint8, device="cuda")
        codes |= (torch.randint(0, 2, (n, 512), dtype=torch.uint8, device="cuda") << 7)
        f[:, :512] = codes
        f[:, 512:528] = (torch.rand(n, 4, device="cuda") * 0.02 + 1e-3).view(torch.uint8)
        f[:, 528:] = torch.randn(n, 64, device="cuda").to(torch.bfloat16).view(torch.uint8)
    bt = torch.randperm(nb, device="cuda").to(torch.int32).reshape(B, nblk)
    return cache, bt


def make_topk(B, ctx, k):
    pos = torch.rand(B, ctx, device="cuda").topk(min(k, ctx), dim=-1).indices
    pos = pos.sort(dim=-1, descending=True).values.to(torch.int32)
    if pos.shape[1] < k:
        pos = torch.cat([pos, torch.full((B, k - pos.shape[1]), -1, dtype=torch.int32, device="cuda")], 1)
    return pos


def slots_of(bt, pos, req):
    p = pos.long().clamp(min=0)
    s = bt.long()[req.long()[:, None], p // BS] * BS + p % BS
    return torch.where(pos >= 0, s, torch.full_like(s, -1)).to(torch.int32)


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def safe_ms(fn, errors, name, **kw):
    try:
        return median_ms(fn, **kw)
    except Exception as e:  # keep the other measurements
        errors[name] = f"{type(e).__name__}: {e}"[:300]
        return float("nan")


def bench_decode(B, ctx, k, reps, rows):
    fm = backends.flash_mla()
    cache, bt = make_cache(B, ctx)
    pos = make_topk(B, ctx, k)
    req = torch.arange(B, dtype=torch.int32, device="cuda")
    q = (torch.randn(B, H, DQK, device="cuda") * 0.5).to(torch.bfloat16)
    sc = 1.0 / math.sqrt(DQK)
    slots = slots_of(bt, pos, req)[:, None].contiguous()
    qs = q[:, None].contiguous()
    meta, _ = fm.get_mla_metadata()
    kcache = cache.unsqueeze(-2)

    def stock():
        return fm.flash_mla_with_kvcache(qs, kcache, None, None, DV, meta, softmax_scale=sc,
                                         is_fp8_kvcache=True, indices=slots)

    def ours():
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="flashmla")

    ws = torch.empty(B, k, DQK, dtype=torch.bfloat16, device="cuda")
    idx = kc.workspace_indices(pos)

    def gather():
        return kc.gather_kv(cache, bt, req, pos, out=ws, check=False)

    def sparse_fwd():
        return sa.sparse_attention(q, ws.view(-1, DQK), idx, sc, backend="flashmla")

    def triton_ws():
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="triton")

    def triton_fp8():
        return sa.sparse_mla_attention_fp8(q, cache, bt, req, pos, sc, check=False)

    def triton_fp8_h64v4():
        # exploration only (not a shipped config): 64 heads per program, V split over 4 programs
        saved = (sa.BLOCK_H, sa.V_SPLIT)
        sa.BLOCK_H, sa.V_SPLIT = 64, 4
        try:
            return sa.sparse_mla_attention_fp8(q, cache, bt, req, pos, sc, check=False)
        finally:
            sa.BLOCK_H, sa.V_SPLIT = saved

    shape = f"B={B} ctx={ctx} topk={k}"
    for mode in ("eager", "graph"):
        err: dict = {}
        fns = {"stock": stock, "ours": ours, "gather": gather, "sparse_fwd": sparse_fwd,
               "triton": triton_ws, "triton_fp8": triton_fp8, "triton_fp8_h64v4": triton_fp8_h64v4}
        ms = {}
        for name, fn in fns.items():
            f = fn
            if mode == "graph":
                try:
                    f = graphed(fn)
                except Exception as e:
                    err[name] = f"capture failed: {type(e).__name__}: {e}"[:300]
                    ms[name] = float("nan")
                    continue
            ms[name] = safe_ms(f, err, name, rep=reps)
        rows.append(row(f"decode[{mode}]", shape, ms["ours"], ms["stock"], STOCK,
                        gather_ms=round(ms["gather"], 5), sparse_fwd_ms=round(ms["sparse_fwd"], 5),
                        triton_ms=round(ms["triton"], 5), triton_fp8_ms=round(ms["triton_fp8"], 5),
                        triton_fp8_ratio=round(ms["triton_fp8"] / ms["stock"], 4) if ms["stock"] > 0 else None,
                        triton_fp8_h64v4_ms=round(ms["triton_fp8_h64v4"], 5),
                        errors=err or None))
    del cache, ws
    torch.cuda.empty_cache()


def bench_prefill(ctx, T, k, reps, rows):
    fm = backends.flash_mla()
    cache, bt = make_cache(1, ctx, gen_seed=1)
    # rows = the last T tokens of the request; row t sees positions <= ctx - T + t
    base = make_topk(1, ctx, k)[0]  # descending: the positions a row may not see form a prefix
    lim = ctx - T + torch.arange(T, device="cuda")
    skip = (base[None, :] > lim[:, None]).sum(1)
    j = torch.arange(k, device="cuda")[None, :] + skip[:, None]
    pos = torch.where(j < k, base[j.clamp(max=k - 1)], torch.full_like(j, -1)).to(torch.int32)
    req = torch.zeros(T, dtype=torch.int32, device="cuda")
    q = (torch.randn(T, H, DQK, device="cuda") * 0.5).to(torch.bfloat16)
    sc = 1.0 / math.sqrt(DQK)
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    slots = slots_of(bt, torch.arange(ctx, dtype=torch.int32, device="cuda")[None], req[:1])[0].long()
    flat = cache.view(-1, 656)

    def stock():
        rows_ = flat[slots]
        codes = rows_[:, :512].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        scale = rows_[:, 512:528].contiguous().view(torch.float32)
        nope = (codes.view(-1, 4, 128) * scale[..., None]).view(-1, 512).to(torch.bfloat16)
        kv = torch.cat([nope, rows_[:, 528:].contiguous().view(torch.bfloat16)], 1)
        return fm.flash_mla_sparse_fwd(q, kv[:, None], pos[:, None], sc, DV)

    def ours():
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="flashmla",
                                       workspace="per_request", seq_lens=lens)

    def per_row():
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="flashmla")

    err: dict = {}
    s_ms = safe_ms(stock, err, "stock", rep=reps)
    o_ms = safe_ms(ours, err, "ours", rep=reps)
    r_ms = safe_ms(per_row, err, "per_row", rep=reps)
    rows.append(row("prefill", f"T={T} ctx={ctx} topk={k}", o_ms, s_ms,
                    "torch dequant + flash_mla_sparse_fwd (vLLM-style prefill)",
                    per_row_ms=round(r_ms, 5), errors=err or None))


def main():
    args = parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if backends.flash_mla() is None:
        raise SystemExit(f"FlashMLA not importable: {backends.status()['flashmla']['detail']}")
    rows: list[dict] = []
    k = 2048
    if args.quick:
        decode_shapes = [(1, 8192), (64, 8192), (128, 8192)]
        prefill_shapes = [(8192, 512)]
        reps = 20
    else:
        decode_shapes = [(B, c) for c in (4096, 8192, 32768) for B in (1, 16, 64, 128, 256) if B * c <= 128 * 32768]
        prefill_shapes = [(8192, 1024), (32768, 2048)]
        reps = 50
    for B, c in decode_shapes:
        bench_decode(B, c, k, reps, rows)
    for c, T in prefill_shapes:
        bench_prefill(c, T, k, reps, rows)
    write(args.json, "sparse_attention", rows)


if __name__ == "__main__":
    main()
