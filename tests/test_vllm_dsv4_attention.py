"""The DeepSeek-V4 attention adapters (``zerodiff.integrations.vllm.dsv4_attention``): decode through the
prefill read path (the same cache entries, order and dequantised bits as the prefill path), the fixed-schedule
FlashMLA route (float64 reference, phase and batch invariance under the CPU emulation of the kernel's contract,
the real kernel on the GPU), and the ``ZERODIFF_DSV4_READ`` route switch."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from zerodiff.integrations import ConfigError
from zerodiff.integrations import vllm as zv

from flashmla_emulation import install_emulation, v4_cache


COMPRESS_RATIOS = [1, 4, 128]  # SWA-only, C4A, C128A layers
GPU_COMPRESS_RATIOS = [4, 128, 1]  # the same, C4A first


_DS_REC = zv.DSV4_TOKEN_BYTES + zv.DSV4_SCALE_BYTES


def _ds_cache(g, num_blocks, block_size, pad=24):
    """A random fp8_ds_mla cache (padded block stride), values never NaN, with +-0 / denormal codes."""
    stride = block_size * _DS_REC + pad
    raw = torch.randint(0, 256, (num_blocks * stride,), generator=g, dtype=torch.uint8)
    cache = torch.as_strided(raw, (num_blocks, block_size, _DS_REC), (stride, _DS_REC, 1))
    tok = torch.as_strided(raw, (num_blocks, block_size, zv.DSV4_TOKEN_BYTES), (stride, zv.DSV4_TOKEN_BYTES, 1))
    codes = tok[..., :zv.DSV4_FP8_DIM]
    codes[(codes & 0x7F) == 0x7F] = 0x80  # no NaN codes; 0x80 = -0
    codes[..., :3] = torch.tensor([0x00, 0x80, 0x01], dtype=torch.uint8)  # +0, -0, smallest denormal
    rope = torch.randn(num_blocks, block_size, zv.DSV4_ROPE_DIM, generator=g).to(torch.bfloat16)
    tok[..., zv.DSV4_FP8_DIM:] = rope.view(torch.uint8).view(num_blocks, block_size, 2 * zv.DSV4_ROPE_DIM)
    sc = torch.as_strided(raw, (num_blocks, block_size, zv.DSV4_SCALE_BYTES),
                          (stride, zv.DSV4_SCALE_BYTES, 1), block_size * zv.DSV4_TOKEN_BYTES)
    sc[...] = torch.randint(112, 136, sc.shape, generator=g, dtype=torch.uint8)
    return cache


def _ds_dequant_f64(cache, block_size, blk, off):
    """Independent dequant: float64 product of the e4m3 value and 2**(code-127), then bf16."""
    stride = cache.stride(0)
    flat = torch.as_strided(cache, (cache.shape[0] * stride,), (1,), cache.storage_offset())
    base = blk * stride
    t = flat[base + off * zv.DSV4_TOKEN_BYTES + torch.arange(zv.DSV4_TOKEN_BYTES)]
    s = flat[base + block_size * zv.DSV4_TOKEN_BYTES + off * zv.DSV4_SCALE_BYTES + torch.arange(7)]
    v = t[:zv.DSV4_FP8_DIM].clone().view(torch.float8_e4m3fn).double()
    v = v * torch.pow(2.0, s.double() - 127).repeat_interleave(64)
    return torch.cat([v.float().to(torch.bfloat16), t[zv.DSV4_FP8_DIM:].clone().view(torch.bfloat16)])


def _ds_prefill_rows(req, L, qlen, pos, *, cr, top_k, window, topk_row, ccache, cbs, cbt, scache, sbs, sbt):
    """What vLLM's _forward_prefill shows flash_mla_sparse_fwd for the token at absolute position ``pos`` of a
    request of ``seq_len`` L whose chunk holds ``qlen`` query tokens: its workspace (compressed positions
    0..L//cr-1 at rows 0.., the SWA gather at row N..) read at combine_topk_swa_indices' list."""
    N = L // cr if cr > 1 else 0
    gather = qlen + min(L - qlen, window - 1)
    ws = []
    for c in range(N):
        ws.append(_ds_dequant_f64(ccache, cbs, int(cbt[req, c // cbs]), c % cbs))
    for p in range(L - gather, L):
        ws.append(_ds_dequant_f64(scache, sbs, int(sbt[req, p // sbs]), p % sbs))
    tlen = min((pos + 1) // cr, top_k) if cr > 1 else 0
    lst = [int(topk_row[i]) for i in range(tlen)] if topk_row is not None else list(range(tlen))
    s0 = max(pos - (window - 1), 0)
    lst += [N + p - (L - gather) for p in range(s0, pos + 1)]
    return torch.stack([ws[i] for i in lst])


def _ds_setup(g, cr, T=5, window=8, top_k=16, sbs=16, attn_bs=16):
    nb = 40
    scache = _ds_cache(g, nb, sbs)
    if cr == 128:
        attn_bs = 256
    cbs = attn_bs // cr if cr > 1 else 1
    ccache = _ds_cache(g, nb, cbs) if cr > 1 else None
    lens = [int(x) for x in torch.randint(3, 300 if cr == 128 else 90, (T,), generator=g)]
    lens[0] = 1  # first token of a request
    if cr == 128:
        lens[1] = 300
    sbt = torch.stack([torch.randperm(nb, generator=g)[:24] for _ in range(T)]).int()
    cbt = torch.stack([torch.randperm(nb, generator=g)[:24] for _ in range(T)]).int()
    topk = None
    if cr == 4:
        topk = torch.full((T, top_k), -1, dtype=torch.int32)
        for t, L in enumerate(lens):
            n = L // 4
            sel = torch.randperm(n, generator=g)[:top_k] if n else torch.zeros(0, dtype=torch.long)
            sel = sel.sort(descending=True).values
            topk[t, :len(sel)] = sel.int()
    return dict(scache=scache, ccache=ccache, cbs=cbs, sbs=sbs, sbt=sbt, cbt=cbt, lens=lens, topk=topk,
                window=window, top_k=top_k if cr == 4 else (0 if cr == 1 else 128))


@pytest.mark.parametrize("cr", COMPRESS_RATIOS)
def test_dsv4_decode_rows_equal_prefill_rows(seeded, cr):
    """Each decode token's workspace rows, read in its index order, are the prefill path's rows for the same
    token (same cache entries, same order, same dequantised bits), for SWA-only, C4A and C128A layers,
    whatever the other requests of the decode batch; negative controls: the stock decode order (window,
    then top-k) and a reversed top-k give other sequences."""
    g = seeded()
    d = _ds_setup(g, cr)
    T = len(d["lens"])
    pos = torch.tensor([L - 1 for L in d["lens"]])
    width = zv.dsv4_workspace_width(d["top_k"], d["window"])
    # the decode batch in a shuffled request order: the block-table row is the token's request row
    perm = torch.randperm(T, generator=g)
    ent = zv.dsv4_decode_entries(
        pos[perm], torch.arange(T, dtype=torch.int32), torch.ones(T, dtype=torch.bool), compress_ratio=cr,
        top_k=d["top_k"], window_size=d["window"], width=width,
        topk_local=None if d["topk"] is None else d["topk"][perm], compressed_block_table=d["cbt"][perm],
        compressed_block_size=d["cbs"], swa_block_table=d["sbt"][perm], swa_block_size=d["sbs"])
    kv, idx = zv.dsv4_decode_workspace(ent, d["scache"], d["sbs"], d["ccache"], d["cbs"])
    kv2, idx2 = zv.dsv4_decode_workspace(ent, d["scache"], d["sbs"], d["ccache"], d["cbs"], top_k=d["top_k"],
                                         window_size=d["window"])  # the lean form the adapter uses
    assert torch.equal(idx2, idx) and torch.equal(kv2.view(torch.int16), kv.view(torch.int16))
    assert kv.shape == (T, width, zv.DSV4_HEAD_DIM) and idx.shape == (T, 1, width) and kv.dtype == torch.bfloat16
    flat = kv.view(-1, zv.DSV4_HEAD_DIM)
    for i in range(T):
        r = int(perm[i])
        L = d["lens"][r]
        # as the last token of a one-token "prefill" and inside a longer prefill chunk (qlen up to L)
        for qlen in sorted({1, max(1, L // 2), L}):
            ref = _ds_prefill_rows(r, L, qlen, L - 1, cr=cr, top_k=d["top_k"], window=d["window"],
                                   topk_row=None if d["topk"] is None else d["topk"][r], ccache=d["ccache"],
                                   cbs=d["cbs"], cbt=d["cbt"], scache=d["scache"], sbs=d["sbs"], sbt=d["sbt"])
            n = int(ent[3][i])
            assert n == ref.shape[0]
            row = idx[i, 0]
            assert torch.equal(row[:n], torch.arange(i * width, i * width + n, dtype=torch.int32))
            assert bool((row[n:] == -1).all())
            got = flat[row[:n].long()]
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (cr, r, qlen)
        tlen = min(L // cr, d["top_k"]) if cr > 1 else 0
        if tlen > 1:
            stock = torch.cat([ref[tlen:], ref[:tlen]])  # flash_mla_with_kvcache: window, then extra top-k
            assert not torch.equal(stock, ref)
            rev = torch.cat([ref[:tlen].flip(0), ref[tlen:]])
            assert not torch.equal(rev, ref)


def test_dsv4_dequant_rows_bits(seeded):
    g = seeded()
    cache = _ds_cache(g, 6, 8)
    blk = torch.randint(0, 6, (40,), generator=g)
    off = torch.randint(0, 8, (40,), generator=g)
    got = zv.dsv4_dequant_rows(cache, 8, blk, off)
    ref = torch.stack([_ds_dequant_f64(cache, 8, int(b), int(o)) for b, o in zip(blk, off)])
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert bool((got.view(torch.int16) == -32768).any())  # -0 kept
    with pytest.raises(ConfigError, match="block stride"):
        zv.dsv4_dequant_rows(torch.zeros(4, 100, dtype=torch.uint8), 8, blk[:1] % 4, off[:1])
    with pytest.raises(ConfigError, match="uint8"):
        zv.dsv4_dequant_rows(cache.float(), 8, blk, off)
    with pytest.raises(ConfigError, match="528 bytes per token"):
        zv.dsv4_dequant_rows(torch.zeros(4, 8, 528, dtype=torch.uint8), 8, blk[:1] % 4, off[:1])


def test_dsv4_decode_attention_adapter(seeded):
    """The patched _forward_decode body on fake vLLM objects: the sparse kernel gets q, a [T*W, 1, 512]
    workspace, [T, 1, W] indices and the lengths; a padding token gets length 0; the victim token's output
    is the same alone, in batches of 2..17 at several positions (ref sparse attention stands in for
    FlashMLA); every token's output equals attention over its prefill rows."""
    from zerodiff.ops.attention import sparse_attention

    g = seeded()
    cr = 4
    d = _ds_setup(g, cr, T=17, top_k=16)
    H = 4
    q_all = torch.randn(17, H, zv.DSV4_HEAD_DIM, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    calls = []

    def fwd(*, q, kv, indices, sm_scale, attn_sink, topk_length, out):
        calls.append((q.shape, kv.shape, indices.shape, topk_length.clone()))
        o, _ = sparse_attention(q, kv, indices, sm_scale, d_v=zv.DSV4_HEAD_DIM, attn_sink=attn_sink,
                                backend="reference")
        out.copy_(o)

    def run(order, valid=None):
        T = len(order)
        o = torch.tensor(order)
        layer = NS(compress_ratio=cr, window_size=d["window"], max_image_tokens=0, max_model_len=4096,
                   scale=0.05, attn_sink=sink, topk_indices_buffer=d["topk"][o], swa_cache_layer=NS(kv_cache=d["scache"]))
        sw = NS(num_decode_tokens=T, num_decodes=T, token_to_req_indices=torch.arange(T, dtype=torch.int32),
                is_valid_token=torch.ones(T, dtype=torch.bool) if valid is None else valid,
                block_table=d["sbt"][o], block_size=d["sbs"])
        am = NS(block_size=d["cbs"] * cr, block_table=d["cbt"][o])
        out = torch.zeros(T, H, zv.DSV4_HEAD_DIM, dtype=torch.bfloat16)
        pos = torch.tensor([d["lens"][i] - 1 for i in order])
        zv.dsv4_decode_attention(layer, q_all[o], pos, d["ccache"], sw, am, False, out, fwd)
        return out

    victim = 3
    alone = run([victim])
    assert calls[-1][1] == (zv.dsv4_workspace_width(16, d["window"]), 1, zv.DSV4_HEAD_DIM)
    others = [i for i in range(17) if i != victim]
    for B in (2, 15, 16, 17):
        for at in sorted({0, B // 2, B - 1}):
            order = others[:B - 1]
            order.insert(at, victim)
            assert torch.equal(run(order)[at], alone[0]), (B, at)
    # every token == attention over its prefill rows (qlen = 1)
    full = run(list(range(17)))
    for t in range(17):
        L = d["lens"][t]
        rows = _ds_prefill_rows(t, L, 1, L - 1, cr=cr, top_k=16, window=d["window"], topk_row=d["topk"][t],
                                ccache=d["ccache"], cbs=d["cbs"], cbt=d["cbt"], scache=d["scache"], sbs=d["sbs"],
                                sbt=d["sbt"])
        w = zv.dsv4_workspace_width(16, d["window"])
        idx = torch.full((1, 1, w), -1, dtype=torch.int32)
        idx[0, 0, :rows.shape[0]] = torch.arange(rows.shape[0], dtype=torch.int32)
        o, _ = sparse_attention(q_all[t:t + 1], rows, idx, 0.05, d_v=zv.DSV4_HEAD_DIM, attn_sink=sink,
                                backend="reference")
        assert torch.equal(full[t], o[0]), t
    # a padding token (slot < 0) gets length 0
    run([0, 1], valid=torch.tensor([True, False]))
    assert int(calls[-1][3][1]) == 0 and int(calls[-1][3][0]) > 0


def _ds_prefill_flashmla(fm, q, d, reqs, cr, width, sm_scale, sink, topk_rev=False):
    """vLLM's prefill layout on the GPU: one workspace [B, M, 512] (request b: compressed 0..L//cr-1 at rows
    0.., its SWA gather at row N..), indices M*b + ... in combine_topk_swa_indices' order, padded to ``width``
    with -1, then flash_mla_sparse_fwd; each request is a one-token prefill of its last position."""
    B = len(reqs)
    W_s = d["window"]
    Ns = [d["lens"][r] // cr if cr > 1 else 0 for r in reqs]
    N = max(Ns)
    M = N + W_s
    dev = q.device
    ws = torch.zeros(B, M, zv.DSV4_HEAD_DIM, dtype=torch.bfloat16, device=dev)
    idx = torch.full((B, 1, width), -1, dtype=torch.int32, device=dev)
    lens = torch.zeros(B, dtype=torch.int32, device=dev)
    for b, r in enumerate(reqs):
        L = d["lens"][r]
        if Ns[b]:
            c = torch.arange(Ns[b], device=dev)
            ws[b, :Ns[b]] = zv.dsv4_dequant_rows(d["ccache"], d["cbs"], d["cbt"][r].long()[c // d["cbs"]], c % d["cbs"])
        gl = min(L, W_s)  # qlen 1: gather = 1 + min(prefix, W - 1)
        p = torch.arange(L - gl, L, device=dev)
        ws[b, N:N + gl] = zv.dsv4_dequant_rows(d["scache"], d["sbs"], d["sbt"][r].long()[p // d["sbs"]], p % d["sbs"])
        tl_ = min(L // cr, d["top_k"]) if cr > 1 else 0
        top = (d["topk"][r, :tl_].long() if d["topk"] is not None else torch.arange(tl_, device=dev))
        s0 = max(L - 1 - (W_s - 1), 0)
        lst = torch.cat([top, N + torch.arange(s0, L, device=dev) - (L - gl)]) + M * b
        if topk_rev:  # the whole list (compressed + window) reversed: entries move across the kernel's 64-blocks
            lst = lst.flip(0)
        idx[b, 0, :lst.numel()] = lst.int()
        lens[b] = lst.numel()
    out = torch.empty(B, q.shape[1], zv.DSV4_HEAD_DIM, dtype=torch.bfloat16, device=dev)
    fm.flash_mla_sparse_fwd(q=q, kv=ws.view(-1, 1, zv.DSV4_HEAD_DIM), indices=idx, sm_scale=sm_scale,
                            attn_sink=sink, topk_length=lens, out=out)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("cr", GPU_COMPRESS_RATIOS)
def test_gpu_dsv4_decode_equals_prefill_path_flashmla(cr):
    """On the H200 with the vLLM wheel's FlashMLA: a decode token through dsv4_decode_attention is bit-identical
    to the same token through vLLM's prefill layout (other workspace numbering, other padded widths: the
    batch-dependent C128A width is covered), alone and among 1..64 other requests at 3 positions, 3 rounds.
    Negative control: the same entries in reversed order differ (index order is part of the contract). The whole
    list is reversed: on the H200 reversing only the C128A compressed part (<= 47 entries, inside one
    of flash_mla_sparse_fwd's 64-entry blocks) gave the same bits, so that control could not fail."""
    from zerodiff import backends

    fm = backends.flash_mla()
    if fm is None:
        pytest.skip("FlashMLA not available through zerodiff.backends (vLLM wheel kernels)")
    g = torch.Generator().manual_seed(7 + cr)
    T, H, window, top_k = 65, 64, 128, (512 if cr == 4 else 0)
    nb = 1200
    sbs = 64
    scache = _ds_cache(g, nb, sbs).cuda()
    attn_bs = 256
    cbs = attn_bs // cr if cr > 1 else 1
    ccache = _ds_cache(g, nb, cbs).cuda() if cr > 1 else None
    lens = [int(x) for x in torch.randint(1, 6000, (T,), generator=g)]
    lens[:4] = [1, 129, 2049, 6000]
    if cr == 128:
        top_k = 128 * ((-(-8192 // 128) + 127) // 128)  # model-limit width for max_model_len 8192
    sbt = torch.stack([torch.randperm(nb, generator=g)[:128] for _ in range(T)]).int().cuda()
    cbt = torch.stack([torch.randperm(nb, generator=g)[:1024] for _ in range(T)]).int().cuda()
    topk = None
    if cr == 4:
        topk = torch.full((T, top_k), -1, dtype=torch.int32)
        for t, L in enumerate(lens):
            sel = torch.randperm(L // 4, generator=g)[:top_k].sort(descending=True).values
            topk[t, :len(sel)] = sel.int()
        topk = topk.cuda()
    d = dict(scache=scache, ccache=ccache, cbs=cbs, sbs=sbs, sbt=sbt, cbt=cbt, lens=lens, topk=topk,
             window=window, top_k=top_k)
    q_all = (torch.randn(T, H, zv.DSV4_HEAD_DIM, generator=g) * 2).to(torch.bfloat16).cuda()
    sink = torch.randn(H, generator=g).cuda()
    scale = zv.DSV4_HEAD_DIM ** -0.5

    def decode(order):
        n = len(order)
        o = torch.tensor(order, device="cuda")
        layer = NS(compress_ratio=cr, window_size=window, max_image_tokens=0, max_model_len=8192, scale=scale,
                   attn_sink=sink, topk_indices_buffer=None if topk is None else topk[o],
                   swa_cache_layer=NS(kv_cache=scache))
        sw = NS(num_decode_tokens=n, num_decodes=n, token_to_req_indices=torch.arange(n, dtype=torch.int32, device="cuda"),
                is_valid_token=torch.ones(n, dtype=torch.bool, device="cuda"), block_table=sbt[o], block_size=sbs)
        am = None if cr == 1 else NS(block_size=attn_bs, block_table=cbt[o])
        out = torch.empty(n, H, zv.DSV4_HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        pos = torch.tensor([lens[i] - 1 for i in order], device="cuda")
        zv.dsv4_decode_attention(layer, q_all[o], pos, ccache, sw, am, cr == 1, out, fm.flash_mla_sparse_fwd)
        return out

    full = decode(list(range(T)))
    w0 = zv.dsv4_workspace_width(top_k, window)
    # the prefill layout, batch = all requests, at the model width and at a wider (C128A-style batch) width
    for width in (w0, w0 + 256):
        pre = _ds_prefill_flashmla(fm, q_all, d, list(range(T)), max(cr, 1), width, scale, sink)
        assert torch.equal(pre, full), f"decode != prefill layout (width {width})"
    for rnd in range(3):
        victim = (5 + 17 * rnd) % T
        alone = decode([victim])
        others = [i for i in range(T) if i != victim]
        for B in (2, 15, 16, 17, 33, 64):
            for at in sorted({0, B // 2, B - 1}):
                order = (others[rnd:] + others[:rnd])[:B - 1]  # B - 1 neighbours, a different set per round
                order.insert(at, victim)
                assert len(order) == B
                assert torch.equal(decode(order)[at], alone[0]), (cr, rnd, B, at)
    if cr > 1:
        rev = _ds_prefill_flashmla(fm, q_all, d, list(range(T)), cr, w0, scale, sink, topk_rev=True)
        assert not torch.equal(rev, full), "negative control: a reversed top-k order should change the output"


def _dsv4_case(g, compress_ratio, window=128, top_k=64, bs=8):
    """Three requests with their compressed and SWA caches (V4 layout), block tables, and query tokens at
    assorted positions (one padding token). Returns (kwargs for the adapter minus q, q, positions, reqs, valid,
    and the float64 dequantised caches)."""
    lens = (300, 70, 9)
    nreq = len(lens)
    swa_blocks = -(-max(lens) // bs)
    swa, swa_deq = v4_cache(nreq * swa_blocks + 2, bs, seed=int(torch.randint(0, 1000, (1,), generator=g)))
    swa_bt = torch.randperm(nreq * swa_blocks + 2, generator=g)[: nreq * swa_blocks].view(nreq, swa_blocks).int()
    kw = dict(window_size=window, swa_k_cache=swa, swa_block_table=swa_bt, swa_block_size=bs, sm_scale=0.06)
    comp_deq = None
    if compress_ratio > 1:
        nc = -(-max(lens) // compress_ratio)
        c_blocks = -(-nc // bs)
        comp, comp_deq = v4_cache(nreq * c_blocks + 1, bs, seed=int(torch.randint(0, 1000, (1,), generator=g)))
        c_bt = torch.randperm(nreq * c_blocks + 1, generator=g)[: nreq * c_blocks].view(nreq, c_blocks).int()
        kw.update(compress_ratio=compress_ratio, top_k=top_k, compressed_k_cache=comp, compressed_block_table=c_bt,
                  compressed_block_size=bs)
    else:
        kw.update(compress_ratio=1, top_k=0, compressed_k_cache=None, compressed_block_table=None,
                  compressed_block_size=1)
    toks = [(0, p) for p in (0, 3, 4, 130, 250, 299)] + [(1, p) for p in (10, 69)] + [(2, 8)]
    pos = torch.tensor([p for _, p in toks])
    req = torch.tensor([r for r, _ in toks], dtype=torch.int32)
    valid = torch.ones(len(toks), dtype=torch.bool)
    valid[4] = False  # a padding token
    if compress_ratio == 4:
        tl = torch.full((len(toks), top_k), -1, dtype=torch.int32)
        for t, (_r, p) in enumerate(toks):
            n = min((p + 1) // 4, top_k)
            tl[t, :n] = torch.randperm((p + 1) // 4, generator=g)[:n].int()
        kw["topk_local"] = tl
    else:
        kw["topk_local"] = None
    q = (torch.randn(len(toks), 64, 512, generator=g) * 0.3).to(torch.bfloat16)
    return kw, q, pos, req, valid, swa_deq, comp_deq


def _dsv4_reference(kw, q, pos, req, valid, swa_deq, comp_deq, sink):
    outs = []
    bs, cr = kw["swa_block_size"], kw["compress_ratio"]
    for t in range(q.shape[0]):
        if not bool(valid[t]):
            outs.append(torch.zeros(q.shape[1], 512, dtype=torch.float64))
            continue
        p, r = int(pos[t]), int(req[t])
        ent = []
        if cr > 1:
            n = min((p + 1) // cr, kw["top_k"])
            cpos = kw["topk_local"][t, :n].tolist() if kw["topk_local"] is not None else list(range(n))
            cb = kw["compressed_block_size"]
            ent += [comp_deq[int(kw["compressed_block_table"][r, c // cb]) * cb + c % cb] for c in cpos]
        ent += [swa_deq[int(kw["swa_block_table"][r, s // bs]) * bs + s % bs]
                for s in range(max(p - kw["window_size"] + 1, 0), p + 1)]
        kv = torch.stack(ent)
        sc = (q[t].double() @ kv.T) * kw["sm_scale"]
        lse = torch.logsumexp(sc, -1)
        outs.append((torch.softmax(sc, -1) @ kv) / (1 + torch.exp(sink.double() - lse))[:, None])
    return torch.stack(outs)


@pytest.mark.parametrize("compress_ratio", COMPRESS_RATIOS)
def test_dsv4_fixed_schedule_adapter_reference_phase_and_batch_invariance(seeded, monkeypatch, compress_ratio):
    """The adapter's lists (compressed entries in the prefill order, then the window) reach the kernel as main and
    extra lists with their lengths: equal to a float64 reference over the same entries; a token computed inside
    a prefill chunk, alone as a decode token, or among other requests' tokens gives the same bits (under the CPU
    emulation of the kernel's contract, which raises unless every row is whole at its own block count)."""
    install_emulation(monkeypatch)
    g = seeded()
    kw, q, pos, req, valid, swa_deq, comp_deq = _dsv4_case(g, compress_ratio)
    sink = torch.linspace(-1, 1, 64)
    o, lse = zv.dsv4_fixed_schedule_attention(q, pos, req, valid, attn_sink=sink, **kw)
    ref = _dsv4_reference(kw, q, pos, req, valid, swa_deq, comp_deq, sink)
    assert torch.allclose(o.double(), ref, atol=2e-2, rtol=2e-2)
    assert bool((o[4].float() == 0).all()), "a padding token must give 0"
    for t in (0, 5, 7):  # alone (decode) == inside the batch (prefill chunk + other requests)
        sub = dict(kw)
        if kw["topk_local"] is not None:
            sub["topk_local"] = kw["topk_local"][t:t + 1]
        a = zv.dsv4_fixed_schedule_attention(q[t:t + 1], pos[t:t + 1], req[t:t + 1], valid[t:t + 1], attn_sink=sink,
                                             **sub)
        assert torch.equal(a[0][0], o[t]) and torch.equal(a[1][0], lse[t]), t


def _assert_close_to_reference(o, ref, pos, what):
    """allclose(atol = rtol = 2e-2) against the float64 reference, failing with the elements outside it: how many,
    in which tokens (and positions), the worst one with its value and reference."""
    got = o.cpu().double()
    excess = (got - ref).abs() - (2e-2 + 2e-2 * ref.abs())  # > 0 where allclose(atol=rtol=2e-2) fails
    if bool((excess > 0).any()):
        t, h, d = (int(i) for i in torch.nonzero(excess == excess.max())[0])
        bad_tokens = sorted({int(i) for i in torch.nonzero(excess > 0)[:, 0]})
        pytest.fail(f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements outside atol = rtol = 2e-2, in "
                    f"tokens {bad_tokens} (positions {[int(pos[i]) for i in bad_tokens]}); worst at token {t} head "
                    f"{h} dim {d}: got {got[t, h, d].item():.6g}, reference {ref[t, h, d].item():.6g}; per-token max "
                    f"abs error {[round(v, 4) for v in (got - ref).abs().flatten(1).amax(1).tolist()]}")


def _c128a_lists(kw, pos, req, valid):
    """Per token of a C128A case: the compressed entries' global slots (positions 0 .. n-1) and the window's
    global slots (ascending), as int32 index rows padded with -1 to widths 64 and 128, with their lengths."""
    cb, bs, w = kw["compressed_block_size"], kw["swa_block_size"], kw["window_size"]
    T = pos.shape[0]
    comp = torch.full((T, 64), -1, dtype=torch.int32)
    swa = torch.full((T, 128), -1, dtype=torch.int32)
    nc = torch.zeros(T, dtype=torch.int32)
    ns = torch.zeros(T, dtype=torch.int32)
    for t in range(T):
        if not bool(valid[t]):
            continue
        p, r = int(pos[t]), int(req[t])
        cs = [int(kw["compressed_block_table"][r, c // cb]) * cb + c % cb for c in range(min((p + 1) // 128, 64))]
        ss = [int(kw["swa_block_table"][r, x // bs]) * bs + x % bs for x in range(max(p - w + 1, 0), p + 1)]
        comp[t, :len(cs)] = torch.tensor(cs, dtype=torch.int32) if cs else comp[t, :0]
        swa[t, :len(ss)] = torch.tensor(ss, dtype=torch.int32)
        nc[t], ns[t] = len(cs), len(ss)
    return comp, nc, swa, ns


def _two_list_read_c128a(g, order, with_sink, device):
    from zerodiff.ops.attention import flashmla_fp8 as fd

    kw, q, pos, req, valid, swa_deq, comp_deq = _dsv4_case(g, 128)
    sink = torch.linspace(-1, 1, 64) if with_sink else torch.full((64,), float("-inf"))
    ref = _dsv4_reference(kw, q, pos, req, valid, swa_deq, comp_deq, sink)
    comp, nc, swa, ns = (t.to(device) for t in _c128a_lists(kw, pos, req, valid))
    ccache, scache = kw["compressed_k_cache"].to(device), kw["swa_k_cache"].to(device)
    mc, mi, ml, ec, ei, el = ((ccache, comp, nc, scache, swa, ns) if order == "compressed_main"
                              else (scache, swa, ns, ccache, comp, nc))
    o, _lse = fd.flashmla_fp8_attention(q.to(device), mc, mi, kw["sm_scale"],
                                        attn_sink=sink.to(device) if with_sink else None, pieces_per_row=1,
                                        topk_length=ml, extra_kv_cache=ec, extra_indices=ei, extra_topk_length=el)
    _assert_close_to_reference(o, ref, pos, f"C128A lists, {order}, sink {'on' if with_sink else 'off'}")


@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("order", ["compressed_main", "window_main"])
def test_flashmla_two_list_read_c128a_matches_reference(seeded, monkeypatch, order, with_sink):
    """The lists of the GPU test below under the CPU emulation of the kernel's contract: they are the reference's
    entries, so a GPU failure of that test is the kernel's reading of them."""
    install_emulation(monkeypatch)
    _two_list_read_c128a(seeded(), order, with_sink, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("order", ["compressed_main", "window_main"])
def test_gpu_flashmla_two_list_read_c128a_matches_reference(seeded, order, with_sink):
    """The C128A read without the adapter: FlashMLA's FP8 decode kernel under zerodiff's fixed schedule
    (``flashmla_fp8_attention``) with the lists given directly, the compressed entries as the main list and the
    window as the extra list (the adapter's order) or the reverse (vLLM's own order), with and without the sink;
    each close to the float64 reference within the adapter test's tolerance."""
    from zerodiff import backends

    if backends.flash_mla() is None:
        pytest.skip(f"FlashMLA not importable: {backends.status()['flashmla']['detail']}")
    _two_list_read_c128a(seeded(), order, with_sink, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("compress_ratio", COMPRESS_RATIOS)
def test_gpu_dsv4_fixed_schedule_adapter_reference_and_invariance(seeded, compress_ratio):
    """The same checks with FlashMLA's real FP8 decode kernel: float64 reference, padding token 0, each token
    alone == inside the batch."""
    from zerodiff import backends

    if backends.flash_mla() is None:
        pytest.skip(f"FlashMLA not importable: {backends.status()['flashmla']['detail']}")
    g = seeded()
    kw, q, pos, req, valid, swa_deq, comp_deq = _dsv4_case(g, compress_ratio)
    sink = torch.linspace(-1, 1, 64)
    ref = _dsv4_reference(kw, q, pos, req, valid, swa_deq, comp_deq, sink)
    kc = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    qc, pc, rc, vc, sc = q.cuda(), pos.cuda(), req.cuda(), valid.cuda(), sink.cuda()
    o, lse = zv.dsv4_fixed_schedule_attention(qc, pc, rc, vc, attn_sink=sc, **kc)
    _assert_close_to_reference(o, ref, pos, f"compress ratio {compress_ratio}")
    assert bool((o[4].float() == 0).all())
    for t in (0, 5, 7):
        sub = dict(kc)
        if kc["topk_local"] is not None:
            sub["topk_local"] = kc["topk_local"][t:t + 1]
        a = zv.dsv4_fixed_schedule_attention(qc[t:t + 1], pc[t:t + 1], rc[t:t + 1], vc[t:t + 1], attn_sink=sc, **sub)
        assert torch.equal(a[0][0], o[t]) and torch.equal(a[1][0], lse[t]), t


def test_dsv4_read_route_env():
    with pytest.raises(ConfigError, match="ZERODIFF_DSV4_READ"):  # refused at engine start
        zv.check_vllm_config(NS(), environ={"ZERODIFF_CONSISTENT": "1", "ZERODIFF_DSV4_READ": "fast",
                                           "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    assert zv.dsv4_read_route({}) == "fixed_schedule"
    assert zv.dsv4_read_route({"ZERODIFF_DSV4_READ": "prefill_path"}) == "prefill_path"
    with pytest.raises(ConfigError, match="ZERODIFF_DSV4_READ"):
        zv.dsv4_read_route({"ZERODIFF_DSV4_READ": " fixed_schedule"})
    assert zv.dsv4_read_route({"ZERODIFF_DSV4_READ": "fixed_schedule"}) == "fixed_schedule"
    with pytest.raises(ConfigError, match="ZERODIFF_DSV4_READ"):
        zv.dsv4_read_route({"ZERODIFF_DSV4_READ": "fast"})


def _dsv4_step(g, cr, reqs, pad=2, bs=8, window=128, top_k=64):
    """One vLLM step: ``reqs`` = list of (request length so far, positions of this step's tokens), decode
    requests first; fake layer and metadata objects as vLLM 0.33.0's DeepSeek-V4 backend passes them."""
    nreq = len(reqs)
    maxlen = max(L for L, _ in reqs)
    sb = -(-maxlen // bs)
    swa, _ = v4_cache(nreq * sb + 1, bs, seed=int(torch.randint(0, 999, (1,), generator=g)))
    swa_bt = torch.randperm(nreq * sb + 1, generator=g)[: nreq * sb].view(nreq, sb).int()
    toks = [(r, p) for r, (_L, ps) in enumerate(reqs) for p in ps]
    T = len(toks) + pad
    pos = torch.tensor([p for _, p in toks] + [0] * pad)
    qsl = torch.tensor([0] + list(torch.tensor([len(ps) for _, ps in reqs]).cumsum(0).tolist()), dtype=torch.int32)
    layer = NS(compress_ratio=cr, window_size=window, scale=0.06, attn_sink=torch.linspace(-1, 1, 64),
               max_model_len=4 * maxlen, swa_cache_layer=NS(kv_cache=swa))
    attn = None
    if cr > 1:
        nc = -(-maxlen // cr)
        cb = -(-nc // bs)
        comp, _ = v4_cache(nreq * cb + 1, bs, seed=int(torch.randint(0, 999, (1,), generator=g)))
        layer.kv_cache = comp
        attn = NS(block_size=bs * cr, block_table=torch.randperm(nreq * cb + 1, generator=g)[: nreq * cb]
                  .view(nreq, cb).int())
        if cr == 4:
            buf = torch.full((T, top_k), -1, dtype=torch.int32)
            for t, (_r, p) in enumerate(toks):
                n = min((p + 1) // 4, top_k)
                buf[t, :n] = torch.randperm((p + 1) // 4, generator=g)[:n].int()
            layer.topk_indices_buffer = buf
    nd = sum(1 for _L, ps in reqs if len(ps) == 1)
    swa_md = NS(num_decodes=nd, num_prefills=nreq - nd, query_start_loc=qsl, block_table=swa_bt, block_size=bs,
                is_valid_token=torch.tensor([True] * len(toks) + [False] * pad), prefill_left_visible=None,
                prefill_right_visible=None)
    q = (torch.randn(T, 64, 512, generator=g) * 0.3).to(torch.bfloat16)
    return layer, attn, swa_md, q, pos, toks


@pytest.mark.parametrize("cr", COMPRESS_RATIOS)
def test_dsv4_forward_fixed_schedule_decode_equals_prefill_and_padding(seeded, monkeypatch, cr):
    """The forward_mqa body of the fixed_schedule route: a token decoded in a decode batch and the same token
    computed inside a prefill chunk (other requests, other order) give the same bits; padding tokens give 0;
    in-image windows are refused. (CPU emulation of the kernel's contract.)"""
    install_emulation(monkeypatch)
    g = seeded()
    # step A: request 0 decodes position 200 among other decodes; request 2 prefills a chunk ending at 200
    layer, attn, md, q, pos, toks = _dsv4_step(g, cr, [(201, [200]), (90, [89]), (201, list(range(150, 201)))])
    out = torch.empty_like(q)
    zv.dsv4_forward_fixed_schedule(layer, q, pos, out, md, attn)
    assert bool((out[-2:].float() == 0).all()), "padding tokens must give 0"
    # every token == the adapter on that token alone with its known request row (catches a wrong row mapping)
    for t, (r, _p) in enumerate(toks):
        kw = dict(compress_ratio=1, top_k=0, topk_local=None, compressed_k_cache=None, compressed_block_table=None,
                  compressed_block_size=1)
        if cr > 1:
            top_k = layer.topk_indices_buffer.shape[-1] if cr == 4 else -(-(-(-layer.max_model_len // cr)) // 128) * 128
            kw = dict(compress_ratio=cr, top_k=top_k, compressed_k_cache=layer.kv_cache,
                      topk_local=layer.topk_indices_buffer[t:t + 1] if cr == 4 else None,
                      compressed_block_table=attn.block_table, compressed_block_size=attn.block_size // cr)
        one, _ = zv.dsv4_fixed_schedule_attention(
            q[t:t + 1], pos[t:t + 1], torch.tensor([r]), torch.tensor([True]), window_size=layer.window_size,
            swa_k_cache=layer.swa_cache_layer.kv_cache, swa_block_table=md.block_table, swa_block_size=md.block_size,
            sm_scale=layer.scale, attn_sink=layer.attn_sink, **kw)
        assert torch.equal(one[0], out[t]), (cr, t, r)
    # the same caches and rows: make request 2 hold request 0's data, so token 200 is the same input in both phases
    t_dec = 0
    t_pre = len(toks) - 1  # request 2's last token (position 200)
    layer.swa_cache_layer.kv_cache  # same cache object
    md.block_table[2] = md.block_table[0]
    if attn is not None:
        attn.block_table[2] = attn.block_table[0]
        if cr == 4:
            layer.topk_indices_buffer[t_pre] = layer.topk_indices_buffer[t_dec]
    q[t_pre] = q[t_dec]
    out2 = torch.empty_like(q)
    zv.dsv4_forward_fixed_schedule(layer, q, pos, out2, md, attn)
    assert torch.equal(out2[t_pre], out2[t_dec]), "decode token != the same token inside a prefill chunk"
    md.prefill_left_visible = torch.zeros(len(toks), dtype=torch.int32)
    with pytest.raises(ConfigError, match="in-image"):
        zv.dsv4_forward_fixed_schedule(layer, q, pos, out2, md, attn)
