"""Sparse MLA attention over the FP8 KV cache: our one read path vs the stock kernels.

decode (one query row per request, 64 heads, d_qk 576, d_v 512, top-k 2048, 656-byte FP8 cache):
  stock     = FlashMLA's FP8 sparse decode ``flash_mla_with_kvcache(is_fp8_kvcache=True)`` with its
              ``get_mla_metadata`` scheduler (batch-dependent split-KV; the frozen baseline)
  ours      = ``sparse_mla_attention(backend="triton_fp8_split")``: the split-index fused FP8 kernel (reads the
              cache in place, fixed chunks of the index list, fixed-order merge); columns split_partial_ms /
              split_merge_ms time its two launches alone
  workspace = ``sparse_mla_attention(backend="flashmla")``: Triton gather+dequant into the per-row BF16
              workspace + ``flash_mla_sparse_fwd`` (columns gather_ms / sparse_fwd_ms split it)
  stock_bi  = the stock decode kernel with ``enable_batch_invariant=True`` (no split-KV), for reference, with
              a probe of its row invariance (stock_bi_diff_alone_vs_batch: differing values of row 0 alone vs
              in the batch; stock_diff_alone_vs_batch the same for the default stock kernel)
  Each in eager mode and replayed from a CUDA graph (how the rollout runs decode). Rows: "decode_split[...]"
  (ours vs stock) and "decode_workspace[...]" (workspace path vs stock).
prefill (T rows of one request, each attending to its own causal top-k):
  stock     = vLLM-style: dequantise the request's cache with torch ops, then ``flash_mla_sparse_fwd``
  ours      = the split kernel; workspace_ms = ``sparse_mla_attention(backend="flashmla", workspace="per_request")``
--sweep: times every named split variant (``attention_variants.SPLIT_VARIANTS``: "default" = shipped, "pf" / "pf_s2" = default's tiles
  with hand-pipelined 16-byte loads and a column-split merge (other bits on the H200), "pf_bn2x" / "pf_chunk2x" / "pf_bh2x" = other tiles)
  against the same stock kernel at B = 1 / 64 / 128 / 256 (graph replay; rows "decode_variant[graph]" with the
  partial / merge launches timed alone and whether the variant's bits equal default's on these inputs) and in
  prefill (T = 1024, rows "prefill_variant"); without --quick also the raw tile configs of SWEEP for both the
  default and the pipelined kernel ("decode_split_sweep[graph]"). --quick --sweep runs the variant sweep alone
  (variants default / pf / pf_bn2x / pf_chunk2x / pf_bhhalf_w4, B = 1 / 64 / 128, prefill T = 1024). Any change of the shipped variant changes
  bits (except the same-bits ones) and is made for rollout and training together.

--aot (no GPU needed): compiles the split kernels for sm_90a and sm_100a with Triton's AOT path and prints
  registers / spill stack / shared memory per config (how the shipped config was chosen: no spills).

--flashmla-fp8: only FlashMLA's FP8 decode kernel under zerodiff's fixed schedule (``backend="flashmla_fp8"``, rows
  "decode_flashmla_fp8[S=pieces per row]" with the kernel alone in kernel_ms, and "prefill_flashmla_fp8[S=...]") against the same
  kernel under its own batch-dependent scheduler.

Usage: python benchmarks/bench_sparse_attention.py --json out.json [--quick] [--sweep] [--flashmla-fp8]
       (the next GPU session: --json sa_sweep.json --quick --sweep, under 90 s; full: --json sa.json --sweep)
       python benchmarks/bench_sparse_attention.py --aot [--sweep | --flashmla-fp8]
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cubin_usage, median_ms, parser, row, write  # noqa: E402

from zerodiff import backends  # noqa: E402
from zerodiff.ops import kv_cache as kc  # noqa: E402
from zerodiff.experimental import attention_variants as av  # noqa: E402
from zerodiff.ops import attention as sa  # noqa: E402
from zerodiff.ops.attention import triton_split as ts  # noqa: E402

H, DQK, DV, BS = 64, 576, 512, 64
QUICK_VARIANTS = ("default", "pf", "pf_bn2x", "pf_chunk2x", "pf_bhhalf_w4")  # "default" first: the prefill rows' reference
STOCK = "flash_mla_with_kvcache (FlashMLA FP8 sparse decode, get_mla_metadata scheduler)"
SWEEP = [  # (BLOCK_H, BLOCK_N, CHUNK, num_warps, num_stages); the first is the shipped config
    (32, 16, 256, 8, 2),
    (32, 16, 128, 8, 2),
    (32, 16, 512, 8, 2),
    (32, 16, 256, 8, 1),
    (16, 32, 256, 8, 1),
    (16, 32, 256, 8, 2),
    (16, 16, 256, 4, 2),
    (64, 16, 256, 8, 1),  # spills in the AOT check (1 KB stack); timed to see what fewer dequant passes buy
    (32, 32, 256, 8, 1),  # spills (296 B stack); half the acc rescales per entry
    (32, 32, 512, 8, 1),
]


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


def _r(x):
    return None if x != x else round(x, 5)


def stock_decode_fn(fm, q, cache, slots, sc, batch_invariant=False):
    """A stock decode call with its own scheduler metadata (the metadata is bound to shapes and options)."""
    meta, _ = fm.get_mla_metadata()
    qs = q[:, None].contiguous()
    kcache = cache.unsqueeze(-2)
    idx = slots[:, None].contiguous()
    kw = dict(enable_batch_invariant=True) if batch_invariant else {}

    def call():
        return fm.flash_mla_with_kvcache(qs, kcache, None, None, DV, meta, softmax_scale=sc, is_fp8_kvcache=True,
                                         indices=idx, **kw)

    return call


def probe_stock_invariance(fm, q, cache, slots, sc, batch_invariant):
    """Values of row 0 that differ alone vs inside the full batch (-1 when the call fails)."""
    try:
        full = stock_decode_fn(fm, q, cache, slots, sc, batch_invariant)()[0][:, 0]
        alone = stock_decode_fn(fm, q[:1], cache, slots[:1], sc, batch_invariant)()[0][:, 0]
        return int((full[0] != alone[0]).sum())
    except Exception:
        return -1


def decode_case(B, ctx, k, heads=H):
    """B decode rows, one per request of ctx tokens, each with its own top-k positions: (cache, block_table,
    positions, req_ids, q, sm_scale, global slots)."""
    cache, bt = make_cache(B, ctx)
    pos = make_topk(B, ctx, k)
    req = torch.arange(B, dtype=torch.int32, device="cuda")
    q = (torch.randn(B, heads, DQK, device="cuda") * 0.5).to(torch.bfloat16)
    return cache, bt, pos, req, q, 1.0 / math.sqrt(DQK), slots_of(bt, pos, req)


def bench_decode(B, ctx, k, reps, rows):
    fm = backends.flash_mla()
    cache, bt, pos, req, q, sc, slots = decode_case(B, ctx, k)
    cfg = ts.split_config(DV, DQK - DV)

    def ours():
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="triton_fp8_split")

    parts = ts._split_partials(q, cache, bt, req, pos, sc, DV, DQK - DV, cfg)
    out = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B, H, dtype=torch.float32, device="cuda")

    def split_partial():
        return ts._split_partials(q, cache, bt, req, pos, sc, DV, DQK - DV, cfg)

    def split_merge():
        return ts._split_merge(parts, None, out, lse, cfg)

    def workspace():
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="flashmla")

    ws = torch.empty(B, k, DQK, dtype=torch.bfloat16, device="cuda")
    idx = kc.workspace_indices(pos)

    def gather():
        return kc.gather_kv(cache, bt, req, pos, out=ws, check=False)

    def sparse_fwd():
        return sa.sparse_attention(q, ws.view(-1, DQK), idx, sc, backend="flashmla")

    fns = {"stock": stock_decode_fn(fm, q, cache, slots, sc), "ours": ours, "split_partial": split_partial,
           "split_merge": split_merge, "workspace": workspace, "gather": gather, "sparse_fwd": sparse_fwd,
           "stock_bi": stock_decode_fn(fm, q, cache, slots, sc, batch_invariant=True)}
    probes = {}
    if B > 1:
        probes = {"stock_diff_alone_vs_batch": probe_stock_invariance(fm, q, cache, slots, sc, False),
                  "stock_bi_diff_alone_vs_batch": probe_stock_invariance(fm, q, cache, slots, sc, True)}
    shape = f"B={B} ctx={ctx} topk={k}"
    for mode in ("eager", "graph"):
        err: dict = {}
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
        common = dict(split_partial_ms=_r(ms["split_partial"]), split_merge_ms=_r(ms["split_merge"]),
                      workspace_ms=_r(ms["workspace"]), gather_ms=_r(ms["gather"]),
                      sparse_fwd_ms=_r(ms["sparse_fwd"]), stock_bi_ms=_r(ms["stock_bi"]),
                      split_config=cfg, **probes, errors=err or None)
        rows.append(row(f"decode_split[{mode}]", shape, ms["ours"], ms["stock"], STOCK, **common))
        rows.append(row(f"decode_workspace[{mode}]", shape, ms["workspace"], ms["stock"], STOCK,
                        note="workspace path: gather_kv + flash_mla_sparse_fwd"))
    del cache, ws, parts
    torch.cuda.empty_cache()


def sweep_decode(B, ctx, k, reps, rows):
    """Exploration: graph-replayed time of alternative split configs (same inputs)."""
    fm = backends.flash_mla()
    cache, bt, pos, req, q, sc, slots = decode_case(B, ctx, k)
    err: dict = {}
    stock_ms = safe_ms(graphed(stock_decode_fn(fm, q, cache, slots, sc)), err, "stock", rep=reps)
    base = ts.split_config(DV, DQK - DV)
    pf = av.split_variant_config("pf", DV, DQK - DV)
    for (bh, bn, chunk, nw, ns), kind in [(c, kd) for c in SWEEP for kd in ("default", "pf")]:
        b0 = base if kind == "default" else pf
        cfg = dict(b0, BLOCK_H=bh, BLOCK_N=bn, CHUNK=chunk, num_warps=nw, num_stages=ns)
        name = f"{kind}_BH{bh}_BN{bn}_C{chunk}_w{nw}_s{ns}"
        e: dict = {}

        def fn(cfg=cfg):
            return av.sparse_mla_attention_fp8_split_variant(q, cache, bt, req, pos, sc, check=False, config=cfg)

        try:
            t = safe_ms(graphed(fn), e, name, rep=reps)
        except Exception as ex:
            e[name] = f"{type(ex).__name__}: {ex}"[:300]
            t = float("nan")
        rows.append(row("decode_split_sweep[graph]", f"B={B} ctx={ctx} topk={k} {name}", t, stock_ms, STOCK,
                        config=cfg, errors=(e or err) or None))
    del cache
    torch.cuda.empty_cache()


def sweep_variants_decode(B, ctx, k, reps, rows, variants):
    """Every named split variant against the same stock decode call on the same inputs (graph replays)."""
    fm = backends.flash_mla()
    cache, bt, pos, req, q, sc, slots = decode_case(B, ctx, k)
    err: dict = {}
    stock_ms = safe_ms(stock_decode_fn(fm, q, cache, slots, sc), err, "stock", rep=reps)
    ref = av.sparse_mla_attention_fp8_split_variant(q, cache, bt, req, pos, sc, check=False, variant="default")
    for v in variants:
        cfg = av.split_variant_config(v, DV, DQK - DV)
        e: dict = {}
        out = torch.empty(B, H, DV, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(B, H, dtype=torch.float32, device="cuda")

        def total(v=v, out=out):
            return av.sparse_mla_attention_fp8_split_variant(q, cache, bt, req, pos, sc, check=False, variant=v, out=out)

        def partial(cfg=cfg):
            return av._variant_partials(q, cache, bt, req, pos, sc, DV, DQK - DV, cfg)

        same = None
        try:
            o, l = total()
            torch.cuda.synchronize()
            same = bool(torch.equal(o.view(torch.int16), ref[0].view(torch.int16)) and torch.equal(l, ref[1]))
            parts = partial()

            def merge(parts=parts, cfg=cfg, out=out, lse=lse):
                return av._variant_merge(parts, None, out, lse, cfg)
        except Exception as ex:
            e[v] = f"{type(ex).__name__}: {ex}"[:300]
            merge = None
        t = safe_ms(total, e, "total", rep=reps) if not e else float("nan")
        tp = safe_ms(partial, e, "partial", rep=reps) if not e else float("nan")
        tm = safe_ms(merge, e, "merge", rep=reps) if merge is not None else float("nan")
        rows.append(row("decode_variant[graph]", f"B={B} ctx={ctx} topk={k} variant={v}", t, stock_ms, STOCK,
                        variant=v, split_partial_ms=_r(tp), split_merge_ms=_r(tm), same_bits_as_default=same,
                        config=cfg, errors=(e or err) or None))
    del cache
    torch.cuda.empty_cache()


def prefill_rows(ctx, T, k):
    """The last T tokens of one ctx-long request as prefill rows: (cache, block_table, positions, req_ids, q, sm_scale).
    Row t sees its causal top-k, positions <= ctx - T + t."""
    cache, bt = make_cache(1, ctx, gen_seed=1)
    base = make_topk(1, ctx, k)[0]  # descending: the positions a row may not see form a prefix
    lim = ctx - T + torch.arange(T, device="cuda")
    skip = (base[None, :] > lim[:, None]).sum(1)
    j = torch.arange(k, device="cuda")[None, :] + skip[:, None]
    pos = torch.where(j < k, base[j.clamp(max=k - 1)], torch.full_like(j, -1)).to(torch.int32)
    req = torch.zeros(T, dtype=torch.int32, device="cuda")
    q = (torch.randn(T, H, DQK, device="cuda") * 0.5).to(torch.bfloat16)
    return cache, bt, pos, req, q, 1.0 / math.sqrt(DQK)


def sweep_variants_prefill(ctx, T, k, reps, rows, variants):
    """Every named split variant on a prefill-shaped call (T rows of one request, causal top-k)."""
    cache, bt, pos, req, q, sc = prefill_rows(ctx, T, k)
    times = {}
    for v in variants:
        e: dict = {}

        def fn(v=v):
            return av.sparse_mla_attention_fp8_split_variant(q, cache, bt, req, pos, sc, check=False, variant=v)

        times[v] = safe_ms(fn, e, v, rep=reps)
        rows.append(row("prefill_variant", f"T={T} ctx={ctx} topk={k} variant={v}", times[v], times["default"],
                        "our default split variant (same call)", variant=v, errors=e or None))
    del cache
    torch.cuda.empty_cache()


def prefill_case(ctx, T, k):
    """T prefill rows of one request (the last T tokens of a ctx-long request, each seeing its causal top-k) and
    the vLLM-style stock prefill on them (torch dequantisation of the request, then ``flash_mla_sparse_fwd``).
    Returns (cache, block_table, positions, req_ids, q, sm_scale, seq_lens, stock_fn)."""
    fm = backends.flash_mla()
    cache, bt, pos, req, q, sc = prefill_rows(ctx, T, k)
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

    return cache, bt, pos, req, q, sc, lens, stock


def bench_prefill(ctx, T, k, reps, rows):
    cache, bt, pos, req, q, sc, lens, stock = prefill_case(ctx, T, k)

    def ours():
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="triton_fp8_split")

    def workspace():  # host-synchronising (data-dependent workspace): timed eagerly
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="flashmla",
                                       workspace="per_request", seq_lens=lens)

    err: dict = {}
    s_ms = safe_ms(stock, err, "stock", rep=reps)
    o_ms = safe_ms(ours, err, "ours", rep=reps)
    w_ms = safe_ms(workspace, err, "workspace", rep=reps, graph=False)
    rows.append(row("prefill_split", f"T={T} ctx={ctx} topk={k}", o_ms, s_ms,
                    "torch dequant + flash_mla_sparse_fwd (vLLM-style prefill)",
                    workspace_ms=_r(w_ms), workspace_ratio=round(w_ms / s_ms, 4) if s_ms > 0 else None,
                    ours_vs_workspace=round(o_ms / w_ms, 4) if w_ms > 0 else None, errors=err or None))


FP8_STOCK = "flash_mla_with_kvcache (FlashMLA FP8 sparse decode, its own batch-dependent schedule)"


def bench_flashmla_fp8(B, ctx, k, reps, rows, heads=H, pieces=(1, 2, 4, 8, 16)):
    """FlashMLA's FP8 decode kernel under zerodiff's fixed schedule (``backend="flashmla_fp8"``) vs the same
    kernel under its own scheduler, same inputs. ours = translate positions + kernel + merge/finish (the whole
    path, check=False as in graphs); kernel_ms = the decode kernel alone on translated indices; S = pieces per
    row (``PIECES_PER_ROW`` is shipped)."""
    from zerodiff.ops.attention import flashmla_fp8 as fd

    fm = backends.flash_mla()
    cache, bt, pos, req, q, sc, slots = decode_case(B, ctx, k, heads)
    err: dict = {}
    stock_ms = safe_ms(stock_decode_fn(fm, q, cache, slots, sc), err, "stock", rep=reps)
    _op = fd.decode_kernel("cuda")[1]
    kc4 = cache.view(cache.shape[0], cache.shape[1], 1, cache.shape[2])
    shape = f"B={B} ctx={ctx} topk={k} H={heads}"
    for S in pieces:
        e2: dict = {}

        def ours(S=S):
            return fd.sparse_mla_attention_flashmla_fp8(q, cache, bt, req, pos, sc, check=False, pieces_per_row=S)

        o_ms = safe_ms(ours, e2, "ours", rep=reps)
        kern = float("nan")
        parts = None
        try:
            parts = fd.num_sm_parts(heads, DQK, S)
            if B <= fd.rows_per_launch(S):
                meta, splits = fd.fixed_schedule(B, parts, k // (fd.TOPK_BLOCK * S), "cuda")
                qp = q[:, None].expand(B, S, heads, DQK)
                ip = slots.view(B, S, k // S)
                outp = torch.empty(B, S, heads, DV, dtype=torch.bfloat16, device="cuda")

                def kernel(meta=meta, splits=splits, qp=qp, ip=ip, outp=outp):
                    return _op(qp, kc4, ip, None, None, meta, splits, None, None, None, DV, sc, outp, False)

                kern = safe_ms(kernel, e2, "kernel", rep=reps)
        except Exception as e:
            e2["kernel"] = f"{type(e).__name__}: {e}"[:300]
        extra = {}
        if S > 1:  # the merge alone, shipped tile vs the smaller one (same bits: elementwise)
            po = torch.randn(B, S, heads, DV, device="cuda").to(torch.bfloat16)
            pl = torch.randn(B, S, heads, device="cuda") + 5
            for tag, bh in (("merge_ms", fd.MERGE_BH), ("merge_small_ms", av.MERGE_BH_SMALL)):
                extra[tag] = _r(safe_ms(lambda bh=bh: fd.merge_pieces(po, pl, None, bh=bh), e2, tag, rep=reps))
        if S == 4:
            def ours_copy():
                return av.sparse_mla_attention_flashmla_fp8_q_copy(q, cache, bt, req, pos, sc, check=False,
                                                                   pieces_per_row=4)
            extra["q_copy_ms"] = _r(safe_ms(ours_copy, e2, "q_copy", rep=reps))
        rows.append(row(f"decode_flashmla_fp8[S={S}]", shape, o_ms, stock_ms, FP8_STOCK, kernel_ms=_r(kern),
                        num_sm_parts=parts, shipped=S == fd.PIECES_PER_ROW, **extra, errors={**err, **e2} or None))
    del cache
    torch.cuda.empty_cache()


def bench_prefill_flashmla_fp8(ctx, T, k, reps, rows):
    """Prefill rows through the same fixed-schedule decode kernel vs vLLM-style prefill (torch dequant +
    flash_mla_sparse_fwd) and our workspace path, same inputs."""
    cache, bt, pos, req, q, sc, lens, stock = prefill_case(ctx, T, k)

    def workspace():  # host-synchronising (data-dependent workspace): timed eagerly
        return sa.sparse_mla_attention(q, cache, bt, req, pos, sc, check=False, backend="flashmla",
                                       workspace="per_request", seq_lens=lens)

    from zerodiff.ops.attention import flashmla_fp8 as fd

    err: dict = {}
    s_ms = safe_ms(stock, err, "stock", rep=reps, graph=False)
    w_ms = safe_ms(workspace, err, "workspace", rep=reps, graph=False)
    for S in sorted({1, fd.PIECES_PER_ROW}):
        def ours(S=S):
            return fd.sparse_mla_attention_flashmla_fp8(q, cache, bt, req, pos, sc, check=False, pieces_per_row=S)

        o_ms = safe_ms(ours, err, "ours", rep=reps, graph=False)
        rows.append(row(f"prefill_flashmla_fp8[S={S}]", f"T={T} ctx={ctx} topk={k}", o_ms, s_ms,
                        "torch dequant + flash_mla_sparse_fwd (vLLM-style prefill), eager",
                        workspace_ms=_r(w_ms), ours_vs_workspace=round(o_ms / w_ms, 4) if w_ms > 0 else None,
                        errors=err or None))


def aot_report(configs):
    """Compile the split kernels ahead of time for SM90 / SM100 (no GPU) and read register and spill use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    part_sig = {"q_ptr": "*bf16", "q_s0": "i64", "q_s1": "i64", "pos_ptr": "*i32", "pos_s0": "i64",
                "req_ptr": "*i32", "cache_ptr": "*u8", "bt_ptr": "*i32", "bt_s0": "i64", "pm_ptr": "*fp32",
                "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "H": "i32", "K": "i32", "NCH": "i32",
                "num_blocks": "i32", "max_blocks": "i32", "scale_log2": "fp32"}
    merge_sig = {"pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "sink_ptr": "*fp32",
                 "out_ptr": "*bf16", "o_s0": "i64", "o_s1": "i64", "lse_ptr": "*fp32", "lse_s0": "i64",
                 "H": "i32", "NCH": "i32"}
    def usage(k):
        return cubin_usage(k)[:60]

    for cfg in configs:
        pf = bool(cfg.get("PREFETCH", False))
        fn = av._split_partial_pf_kernel if pf else ts._split_partial_kernel
        for cc in (90, 100):
            const = dict(D_V=DV, D_R=DQK - DV, BLOCK_SIZE=BS, BPT=656, BLOCK_H=cfg["BLOCK_H"],
                         BLOCK_N=cfg["BLOCK_N"], CHUNK=cfg["CHUNK"], EXACT=False)
            if pf:
                const.update(AL_C=16, AL_S=16, AL_R=16)  # what _pf_alignments gives for 656-byte tokens
            sig = dict(part_sig, **{k: "constexpr" for k in const})
            try:
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                   target=GPUTarget("cuda", cc, 32),
                                   options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                                enable_fp_fusion=False))
                ptx = k.asm["ptx"]
                print(f"partial{' pf' if pf else ''} sm_{cc} {cfg}: {usage(k)} shared={k.metadata.shared} "
                      f"wgmma={ptx.count('wgmma.mma_async')} mma.sync={ptx.count('mma.sync')} "
                      f"ld.v4={ptx.count('ld.global.v4')}", flush=True)
            except Exception as e:
                print(f"partial sm_{cc} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        mdv = int(cfg.get("MERGE_DV", DV))
        const = dict(D_V=DV, HAS_SINK=True, BLOCK_H=cfg["MERGE_BH"], EXACT=False)
        mfn = ts._split_merge_kernel
        if mdv < DV:
            const["MERGE_DV"] = mdv
            mfn = av._split_merge_v_kernel
        sig = dict(merge_sig, **{k: "constexpr" for k in const})
        for cc in (90, 100):
            k = triton.compile(ASTSource(fn=mfn, signature=sig, constexprs=const),
                               target=GPUTarget("cuda", cc, 32),
                               options=dict(num_warps=cfg["merge_warps"], enable_fp_fusion=False))
            print(f"merge   sm_{cc} MERGE_BH={cfg['MERGE_BH']} MERGE_DV={mdv} warps={cfg['merge_warps']}: {usage(k)}",
                  flush=True)


def aot_report_flashmla_fp8():
    """Compile the Triton kernels around the fixed-schedule FlashMLA call ahead of time for SM90 / SM100."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zerodiff.ops.attention import flashmla_fp8 as fd

    cases = [
        ("translate", fd._translate_kernel,
         {"pos_ptr": "*i32", "pos_s0": "i64", "req_ptr": "*i32", "bt_ptr": "*i32", "bt_s0": "i64", "idx_ptr": "*i32",
          "badp_ptr": "*i32", "K": "i32", "NCH": "i32", "max_blocks": "i32", "num_blocks": "i32"},
         dict(BLOCK_SIZE=BS, BLOCK_K=fd.TRANSLATE_BLOCK)),
        ("sanitize", fd._sanitize_kernel,
         {"in_ptr": "*i32", "in_s0": "i64", "idx_ptr": "*i32", "badp_ptr": "*i32", "K": "i32", "NCH": "i32",
          "capacity": "i32"}, dict(BLOCK_K=fd.TRANSLATE_BLOCK)),
        ("finish", fd._finish_rows_kernel,
         {"out_ptr": "*bf16", "lse_src_ptr": "*fp32", "lse_src_s0": "i64", "lse_src_s1": "i64", "lse_ptr": "*fp32",
          "bad_ptr": "*i32", "NCH": "i32", "H": "i32", "N": "i32"}, dict(POISON=True, BLOCK=4096, BLOCK_H=64)),
    ] + [
        (f"merge P={p} BH={bh} w{w}", fd._merge_pieces_kernel,
         {"po_ptr": "*bf16", "pl_ptr": "*fp32", "pl_s0": "i64", "pl_s1": "i64", "pl_s2": "i64", "sink_ptr": "*fp32",
          "bad_ptr": "*i32", "NCH": "i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "H": "i32"},
         dict(P=p, DV=DV, BH=bh, HAS_SINK=True, POISON=True), w)
        for p in (2, 4, 8) for bh, w in ((fd.MERGE_BH, fd.MERGE_WARPS), (av.MERGE_BH_SMALL, fd.MERGE_WARPS))]
    for case in cases:
        name, fn, sig, const = case[:4]
        warps = case[4] if len(case) > 4 else 4
        for cc in (90, 100):
            try:
                k = triton.compile(ASTSource(fn=fn, signature=dict(sig, **{c: "constexpr" for c in const}),
                                             constexprs=const),
                                   target=GPUTarget("cuda", cc, 32), options=dict(num_warps=warps, enable_fp_fusion=False))
                print(f"{name:12s} sm_{cc}: {cubin_usage(k)[:60]}", flush=True)
            except Exception as e:
                print(f"{name:12s} sm_{cc}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


def main():
    p = parser(__doc__)
    p.add_argument("--sweep", action="store_true", help="also time alternative split configs (exploration)")
    p.add_argument("--aot", action="store_true", help="AOT-compile the split kernels (no GPU): registers/spills")
    p.add_argument("--flashmla-fp8", action="store_true",
                   help="only the fixed-schedule FlashMLA FP8 path (backend='flashmla_fp8') vs stock: decode "
                        "B 1-256 at 8K and 32K, 128 heads, pieces per row 1-16, prefill T 1024/4096")
    args = p.parse_args()
    if args.aot and args.flashmla_fp8:
        aot_report_flashmla_fp8()
        return
    if args.aot:
        base = ts.split_config(DV, DQK - DV)
        cfgs = [av.split_variant_config(v, DV, DQK - DV) for v in av.SPLIT_VARIANTS]
        if args.sweep:
            pf = av.split_variant_config("pf", DV, DQK - DV)
            cfgs += [dict(b0, BLOCK_H=bh, BLOCK_N=bn, CHUNK=c, num_warps=w, num_stages=st)
                     for bh, bn, c, w, st in SWEEP[1:] for b0 in (base, pf)]
        aot_report(cfgs)
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if backends.flash_mla() is None:
        raise SystemExit(f"FlashMLA not importable: {backends.status()['flashmla']['detail']}")
    rows: list[dict] = []
    k = 2048
    if args.flashmla_fp8 and args.quick:  # the shipped piece count and the unsplit one, rollout sizes
        from zerodiff.ops.attention import flashmla_fp8 as fd

        for B in (1, 8, 64, 96, 128, 192, 256):
            bench_flashmla_fp8(B, 8192, k, 30, rows, pieces=tuple(sorted({1, fd.PIECES_PER_ROW})))
        bench_prefill_flashmla_fp8(8192, 1024, k, 20, rows)
        write(args.json, "sparse_attention", rows)
        return
    if args.flashmla_fp8:
        reps = 30
        for B in (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256):
            bench_flashmla_fp8(B, 8192, k, reps, rows)
        for B in (1, 64, 128, 256):
            bench_flashmla_fp8(B, 32768, k, reps, rows, pieces=(1, 4, 8))
        for B in (1, 64, 128):
            bench_flashmla_fp8(B, 8192, k, reps, rows, heads=128, pieces=(1, 4, 8))
        for T in (1024, 4096):
            bench_prefill_flashmla_fp8(8192, T, k, reps, rows)
        write(args.json, "sparse_attention", rows)
        return
    if args.quick:
        decode_shapes = [(1, 8192), (64, 8192), (128, 8192)]
        prefill_shapes = [(8192, 1024)]
        reps = 20
    else:
        decode_shapes = [(B, c) for c in (8192, 32768) for B in (1, 16, 64, 128, 256)]
        prefill_shapes = [(8192, 1024), (8192, 2048), (8192, 4096), (32768, 4096)]
        reps = 50
    if not (args.sweep and args.quick):  # --quick --sweep: the variant sweep alone (its "default" rows are the
        for B, c in decode_shapes:       # shipped kernel), so one call stays under ~90 s
            bench_decode(B, c, k, reps, rows)
        for c, T in prefill_shapes:
            bench_prefill(c, T, k, reps, rows)
    if args.sweep:
        # --quick: the likely winners only (pf_s2 and the spilling pf_bh2x cost compile time, see the doc)
        variants = QUICK_VARIANTS if args.quick else av.SPLIT_VARIANTS
        for B in (1, 64, 128) if args.quick else (1, 16, 64, 128, 256):
            sweep_variants_decode(B, 8192, k, reps, rows, variants)
        sweep_variants_prefill(8192, 1024, k, reps, rows, variants)
        if not args.quick:
            for B in (1, 64, 128):
                sweep_decode(B, 8192, k, reps, rows)
    write(args.json, "sparse_attention", rows)


if __name__ == "__main__":
    main()
