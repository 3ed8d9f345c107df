"""DeepSeek-V4 sparse attention adapters (decode through the prefill read path; the fixed-schedule route)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import ConfigError

# ------------------------------------------------------------- DeepSeek-V4 decode through the prefill path
# Byte layout of one token of the DeepSeek-V4 FP8 K cache (``fp8_ds_mla``), as vLLM's writer and its
# ``dequantize_and_gather_k_cache`` read it: per paged block, ``block_size`` token records of 576 bytes
# (448 e4m3 codes, then 64 bf16 rope values) followed by ``block_size`` scale records of 8 bytes (7 UE8M0
# exponents, one per 64 codes, plus one pad byte); consecutive blocks are ``k_cache.stride(0)`` bytes apart.
DSV4_FP8_DIM = 448
DSV4_ROPE_DIM = 64
DSV4_TOKEN_BYTES = DSV4_FP8_DIM + 2 * DSV4_ROPE_DIM  # 576
DSV4_SCALE_BYTES = 8
DSV4_QBLOCK = 64
DSV4_HEAD_DIM = DSV4_FP8_DIM + DSV4_ROPE_DIM  # 512 = the workspace row width (q.shape[-1])
#: FlashMLA's sparse prefill kernel wants the index-list width to be a multiple of this (vLLM pads to it)
DSV4_TOPK_ALIGN = 128



def dsv4_workspace_width(top_k: int, window_size: int, max_image_tokens: int = 0) -> int:
    """Index-list width of one query row in vLLM's DeepSeek-V4 prefill path:
    ``round_up(top_k + window_size + max_image_tokens, 128)`` (``combine_topk_swa_indices``)."""
    w = int(top_k) + int(window_size) + int(max_image_tokens)
    return (w + DSV4_TOPK_ALIGN - 1) // DSV4_TOPK_ALIGN * DSV4_TOPK_ALIGN


def _block_bytes(k_cache: torch.Tensor, block_size: int, what: str) -> torch.Tensor:
    """``k_cache`` seen as ``[num_blocks, block_size * 584]`` bytes (same storage, no copy)."""
    if k_cache.dtype != torch.uint8:
        raise ConfigError(f"zerodiff DSV4 decode: {what} must be the uint8 fp8_ds_mla cache, got {k_cache.dtype}")
    if k_cache.dim() < 2 or k_cache.stride(-1) != 1:
        raise ConfigError(f"zerodiff DSV4 decode: {what} must be [num_blocks, ...] with unit last stride, "
                          f"got shape {tuple(k_cache.shape)} strides {k_cache.stride()}")
    used = int(block_size) * (DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES)
    if k_cache.dim() == 3 and k_cache.shape[2] != DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES:
        raise ConfigError(f"zerodiff DSV4 decode: {what} has {k_cache.shape[2]} bytes per token; only the fp8_ds_mla "
                          f"layout ({DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES}: 448 e4m3 + 64 bf16 + 8 scale bytes) is "
                          "supported")
    if k_cache.dim() == 3 and (k_cache.shape[1] != block_size or k_cache.stride(1) != k_cache.shape[2]):
        raise ConfigError(f"zerodiff DSV4 decode: {what} shape {tuple(k_cache.shape)} / strides "
                          f"{k_cache.stride()} do not hold {block_size} tokens of {DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES} "
                          "bytes per block contiguously")
    if k_cache.stride(0) < used:
        raise ConfigError(f"zerodiff DSV4 decode: {what} block stride {k_cache.stride(0)} < {used} bytes "
                          f"({block_size} tokens x {DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES})")
    return torch.as_strided(k_cache, (k_cache.shape[0], used), (k_cache.stride(0), 1), k_cache.storage_offset())


def dsv4_dequant_rows(k_cache: torch.Tensor, block_size: int, block_ids: torch.Tensor,
                      in_block: torch.Tensor) -> torch.Tensor:
    """Dequantise the cache tokens at (``block_ids``, ``in_block``) (int64, any equal shapes ``S``) into bf16
    ``[*S, 512]``: ``bf16(float32(e4m3 code) * 2**(ue8m0 - 127))`` for the 448 quantised dims (one scale
    per 64), the 64 bf16 rope values copied. The product is a power-of-two scaling of an e4m3 value, so it
    is exact in FP32 and the one RNE rounding to bf16 gives the bits ``dequantize_and_gather_k_cache``
    writes (its Triton and CuTe-DSL variants compute the same product). The scale is built from its
    exponent bits (code 0 reads as 0, never a denormal)."""
    flat = _block_bytes(k_cache, block_size, "k_cache")
    shape = tuple(block_ids.shape)
    b = block_ids.reshape(-1, 1).long()
    o = in_block.reshape(-1, 1).long()
    dev = k_cache.device
    tok = flat[b, o * DSV4_TOKEN_BYTES + torch.arange(DSV4_TOKEN_BYTES, device=dev)]
    nq = DSV4_FP8_DIM // DSV4_QBLOCK
    sc = flat[b, block_size * DSV4_TOKEN_BYTES + o * DSV4_SCALE_BYTES + torch.arange(nq, device=dev)]
    scale = (sc.to(torch.int32) << 23).view(torch.float32)  # 2**(code - 127); code 0 -> +0
    codes = tok[:, :DSV4_FP8_DIM].contiguous().view(torch.float8_e4m3fn).float()
    nope = (codes.view(-1, nq, DSV4_QBLOCK) * scale.unsqueeze(-1)).view(-1, DSV4_FP8_DIM).to(torch.bfloat16)
    rope = tok[:, DSV4_FP8_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=-1).view(*shape, DSV4_HEAD_DIM)


def dsv4_decode_entries(positions: torch.Tensor, token_to_req: torch.Tensor, is_valid: torch.Tensor, *,
                        compress_ratio: int, top_k: int, window_size: int, width: int,
                        topk_local: torch.Tensor | None, compressed_block_table: torch.Tensor | None,
                        compressed_block_size: int, swa_block_table: torch.Tensor, swa_block_size: int):
    """Index bookkeeping of :func:`dsv4_decode_attention`: for each decode token ``t`` (absolute position
    ``positions[t]``, request row ``token_to_req[t]`` of the decode block tables) the list of cache
    entries vLLM's PREFILL path would show ``flash_mla_sparse_fwd`` for that token, in that order:

    1. ``topk_len = min((pos + 1) // compress_ratio, top_k)`` compressed entries (0 for SWA-only layers,
       ``compress_ratio <= 1``): C4A (``topk_local`` given, the indexer's request-local positions) its first
       ``topk_len`` entries in the given order; C128A (``topk_local=None``) positions ``0 .. topk_len-1``
       ascending (what vLLM's C128A metadata emits for prefill tokens);
    2. the sliding window ``max(pos - window + 1, 0) .. pos`` ascending (the SWA cache).

    Returns ``(from_swa bool [T, width], block int64 [T, width], in_block int64 [T, width], lens int32 [T])``
    where entries at ``j >= lens[t]`` (and every entry of a padding token, ``is_valid`` false: len 0) point at
    block 0 / slot 0 and are never read. Static shapes, no host sync (CUDA-graph safe)."""
    T = positions.shape[0]
    dev = positions.device
    pos = positions.reshape(T).long().clamp(min=0)
    req = token_to_req.reshape(-1)[:T].long().clamp(min=0, max=swa_block_table.shape[0] - 1)
    j = torch.arange(width, device=dev).view(1, width)
    if compress_ratio > 1:
        topk_len = torch.clamp((pos + 1) // int(compress_ratio), max=int(top_k))
    else:
        topk_len = torch.zeros_like(pos)
    swa_start = torch.clamp(pos - (int(window_size) - 1), min=0)
    swa_len = pos - swa_start + 1
    lens = torch.where(is_valid.reshape(-1)[:T].bool(), topk_len + swa_len, torch.zeros_like(pos))
    in_list = j < lens.view(T, 1)
    from_swa = j >= topk_len.view(T, 1)
    # SWA part: absolute positions, looked up through the SWA block table exactly as the prefill gather does
    spos = (swa_start.view(T, 1) + j - topk_len.view(T, 1)).clamp(min=0)
    s_rows = swa_block_table[req].long()
    s_blk = s_rows.gather(1, (spos // swa_block_size).clamp(max=s_rows.shape[1] - 1))
    s_off = spos % swa_block_size
    if compress_ratio > 1:
        if compressed_block_table is None:
            raise ConfigError("zerodiff DSV4 decode: compress_ratio > 1 needs the compressed block table")
        if topk_local is not None:
            tl_ = topk_local.reshape(T, -1)
            if tl_.shape[1] < top_k:
                raise ConfigError(f"zerodiff DSV4 decode: top-k buffer width {tl_.shape[1]} < top_k={top_k}")
            cpos = torch.zeros(T, width, dtype=torch.long, device=dev)
            kk = min(int(top_k), width)
            cpos[:, :kk] = tl_[:, :kk].long()
        else:
            cpos = j.expand(T, width).long()
        cpos = cpos.clamp(min=0)
        c_rows = compressed_block_table[req].long()
        c_blk = c_rows.gather(1, (cpos // compressed_block_size).clamp(max=c_rows.shape[1] - 1))
        c_off = cpos % compressed_block_size
        blk = torch.where(from_swa, s_blk, c_blk)
        off = torch.where(from_swa, s_off, c_off)
    else:
        blk, off = s_blk, s_off
    blk = torch.where(in_list, blk, torch.zeros_like(blk)).clamp(min=0)
    off = torch.where(in_list, off, torch.zeros_like(off))
    return from_swa, blk, off, lens.to(torch.int32)


def dsv4_decode_workspace(entries, swa_k_cache: torch.Tensor, swa_block_size: int,
                          compressed_k_cache: torch.Tensor | None, compressed_block_size: int, *,
                          top_k: int | None = None, window_size: int | None = None):
    """BF16 workspace ``[T, width, 512]`` and FlashMLA indices ``[T, 1, width]`` (row ``t * width + j`` for
    ``j < lens[t]``, ``-1`` after, as vLLM pads) for the entries of :func:`dsv4_decode_entries`. Rows past
    a token's length are zero. With ``top_k`` / ``window_size`` (the values the entries were built with) each
    cache is dequantised only where its entries can be (compressed: the first ``top_k`` columns; SWA: the
    ``window_size`` entries after the token's top-k), then scattered into place: the same rows, less work."""
    from_swa, blk, off, lens = entries
    T, W = blk.shape
    dev = blk.device
    j = torch.arange(W, device=dev).view(1, W)
    lens_l = lens.view(T, 1).long()
    rows = torch.arange(T, device=dev).view(T, 1) * W + j
    idx = torch.where(j < lens_l, rows, torch.full_like(rows, -1)).to(torch.int32)
    if top_k is None or window_size is None:  # plain form: dequantise every column from both caches
        zero = torch.zeros_like(blk)
        if compressed_k_cache is None:
            kv = dsv4_dequant_rows(swa_k_cache, swa_block_size, blk, off)
        else:  # each cache is read only at its own entries (the others read its slot 0 and are discarded)
            kv = dsv4_dequant_rows(swa_k_cache, swa_block_size, torch.where(from_swa, blk, zero),
                                   torch.where(from_swa, off, zero))
            kc = dsv4_dequant_rows(compressed_k_cache, compressed_block_size, torch.where(from_swa, zero, blk),
                                   torch.where(from_swa, zero, off))
            kv = torch.where(from_swa.unsqueeze(-1), kv, kc)
        live = j < lens_l
        kv = torch.where(live.unsqueeze(-1), kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
        return kv, idx.view(T, 1, W)
    ws = torch.zeros(T * W + 1, DSV4_HEAD_DIM, dtype=torch.bfloat16, device=dev)  # last row: dump
    dump = T * W
    topk_len = (~from_swa).sum(dim=1, keepdim=True)  # from_swa is (column >= topk_len)
    kc_cols = min(int(top_k), W)
    if compressed_k_cache is not None and kc_cols > 0:
        jc = j[:, :kc_cols]
        live_c = (jc < topk_len) & (jc < lens_l)
        vals = dsv4_dequant_rows(compressed_k_cache, compressed_block_size,
                                 torch.where(live_c, blk[:, :kc_cols], 0), torch.where(live_c, off[:, :kc_cols], 0))
        ws[torch.where(live_c, rows[:, :kc_cols], dump).reshape(-1)] = vals.reshape(-1, DSV4_HEAD_DIM)
    ws_cols = min(int(window_size), W)
    col = topk_len + torch.arange(ws_cols, device=dev).view(1, ws_cols)
    live_s = col < lens_l
    colc = col.clamp(max=W - 1)
    vals = dsv4_dequant_rows(swa_k_cache, swa_block_size, torch.where(live_s, blk.gather(1, colc), 0),
                             torch.where(live_s, off.gather(1, colc), 0))
    ws[torch.where(live_s, rows.gather(1, colc), dump).reshape(-1)] = vals.reshape(-1, DSV4_HEAD_DIM)
    return ws[:dump].view(T, W, DSV4_HEAD_DIM), idx.view(T, 1, W)


def dsv4_decode_attention(layer: Any, q: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor | None,
                          swa_metadata: Any, attn_metadata: Any, swa_only: bool, output: torch.Tensor,
                          sparse_fwd) -> None:
    """Consistency-mode body of ``DeepseekV4FlashMLAAttention._forward_decode`` (vLLM 0.33.0): every decode
    token reads its KV through the read path of ``_forward_prefill``: the entries the prefill path would
    give that token (:func:`dsv4_decode_entries`: compressed top-k in the indexer's order, then the SWA
    window ascending), dequantised with the prefill gather's arithmetic into a BF16 workspace
    (:func:`dsv4_decode_workspace`), padded with ``-1`` to the prefill width
    ``round_up(top_k + window + max_image_tokens, 128)``, then ``sparse_fwd`` (FlashMLA's
    ``flash_mla_sparse_fwd``, passed in by the patch) with the layer's scale and sink. The FP8 decode kernel
    ``flash_mla_with_kvcache`` (batch-dependent: its split-KV schedule follows the batch) is never called.

    ``top_k``: C4A the indexer buffer width (``layer.topk_indices_buffer.shape[-1]``, the prefill's
    ``top_k``); C128A the model-limit width ``round_up(ceil(max_model_len / 128), 128)`` (the prefill uses
    the batch's active width; both cover every valid entry, the kernel stops at ``topk_length``; that the
    padded width does not change a row's bits is checked by the GPU test, not assumed silently)."""
    T = int(swa_metadata.num_decode_tokens)
    num_decodes = int(swa_metadata.num_decodes)
    cr = int(layer.compress_ratio)
    # decode tokens are generated text: no in-image widening of their window (left = right = 0); the width
    # still reserves max_image_tokens, as the prefill path's does
    topk_local = None
    ccache = None
    cbt = None
    cbs = 1
    if swa_only or cr <= 1:
        top_k = 0
    else:
        if attn_metadata is None:
            raise ConfigError("zerodiff DSV4 decode: a compressed layer got no FlashMLA metadata")
        cbs = int(attn_metadata.block_size) // cr
        if cbs < 1:
            raise ConfigError(f"zerodiff DSV4 decode: block_size={attn_metadata.block_size} < compress_ratio={cr}")
        cbt = attn_metadata.block_table[:num_decodes]
        ccache = kv_cache
        if cr == 4:
            topk_local = layer.topk_indices_buffer[:T]
            top_k = int(topk_local.shape[-1])
        elif cr == 128:
            n = -(-int(layer.max_model_len) // cr)
            top_k = -(-n // DSV4_TOPK_ALIGN) * DSV4_TOPK_ALIGN
        else:
            raise ConfigError(f"zerodiff DSV4 decode: compress_ratio={cr} (expected 1, 4 or 128)")
    width = dsv4_workspace_width(top_k, layer.window_size, getattr(layer, "max_image_tokens", 0))
    swa_cache = layer.swa_cache_layer.kv_cache
    entries = dsv4_decode_entries(
        positions[:T], swa_metadata.token_to_req_indices, swa_metadata.is_valid_token[:T],
        compress_ratio=cr if not swa_only else 1, top_k=top_k, window_size=int(layer.window_size), width=width,
        topk_local=topk_local, compressed_block_table=cbt, compressed_block_size=cbs,
        swa_block_table=swa_metadata.block_table[:num_decodes], swa_block_size=int(swa_metadata.block_size))
    kv, idx = dsv4_decode_workspace(entries, swa_cache, int(swa_metadata.block_size), ccache, cbs, top_k=top_k,
                                    window_size=int(layer.window_size))
    sparse_fwd(q=q, kv=kv.view(-1, 1, kv.shape[-1]), indices=idx, sm_scale=layer.scale,
               attn_sink=layer.attn_sink, topk_length=entries[3], out=output)


def dsv4_fixed_schedule_attention(q: torch.Tensor, positions: torch.Tensor, token_to_req: torch.Tensor,
                                  is_valid: torch.Tensor, *, compress_ratio: int, top_k: int, window_size: int,
                                  topk_local: torch.Tensor | None, compressed_k_cache: torch.Tensor | None,
                                  compressed_block_table: torch.Tensor | None, compressed_block_size: int,
                                  swa_k_cache: torch.Tensor, swa_block_table: torch.Tensor, swa_block_size: int,
                                  sm_scale: float, attn_sink: torch.Tensor | None = None,
                                  out: torch.Tensor | None = None):
    """DeepSeek-V4 attention for any set of tokens (prefill chunk, decode batch, training micro-batch) through
    ``flashmla_fp8_attention`` (FlashMLA's FP8 decode kernel under zerodiff's batch-independent schedule, one
    piece per row, DeepSeek-V4 cache layout read in place):

    * main list: the compressed entries of the token (C4A: the first ``min((pos + 1) // ratio, top_k)`` entries
      of the indexer's ``topk_local`` in its order; C128A: positions ``0 .. n-1``), as global slots of
      ``compressed_k_cache`` through ``compressed_block_table``, cut by ``topk_length``; width ``round_up(top_k,
      64)``. SWA-only layers (``compress_ratio <= 1``): the window is the main list and there is no extra list;
    * extra list: the sliding window ``max(pos - window + 1, 0) .. pos`` ascending, global slots of
      ``swa_k_cache`` through ``swa_block_table``, cut by ``extra_topk_length``; width ``round_up(window, 64)``.

    The lists are built with :func:`dsv4_decode_entries` (the order the prefill path uses), so a token's
    inputs never depend on which phase or batch it is in, and the kernel's schedule keeps each row whole:
    its output is the same bits in any batch. ``q`` bf16 [T, H (64 or 128), 512]; ``token_to_req`` int [T]
    (rows of the block tables); ``is_valid`` bool [T] (padding tokens: empty row, output 0). Returns
    ``(out bf16 [T, H, 512], lse fp32 [T, H])``. Written for vLLM 0.33.0's DeepSeek-V4 metadata; CPU-tested
    against an emulation of the kernel's contract, **not yet run on a GPU**."""
    from ...ops.attention import flashmla_fp8 as fd

    T = q.shape[0]
    cr = int(compress_ratio) if compressed_k_cache is not None else 1
    tk = int(top_k) if cr > 1 else 0
    win = int(window_size)
    width = max(tk + win, 1)
    from_swa, blk, off, lens = dsv4_decode_entries(
        positions, token_to_req, is_valid, compress_ratio=cr, top_k=tk, window_size=win, width=width,
        topk_local=topk_local, compressed_block_table=compressed_block_table,
        compressed_block_size=int(compressed_block_size), swa_block_table=swa_block_table,
        swa_block_size=int(swa_block_size))
    dev = q.device
    lens = lens.long()
    pos = positions.reshape(T).long().clamp(min=0)
    valid = is_valid.reshape(-1)[:T].bool()
    n_c = torch.clamp((pos + 1) // cr, max=tk) if cr > 1 else torch.zeros_like(pos)
    n_c = torch.where(valid, n_c, torch.zeros_like(n_c))
    n_s = lens - n_c  # window entries actually in the list
    swa_slot = blk * int(swa_block_size) + off
    c_slot = blk * int(compressed_block_size) + off

    def gather_list(slots, start, count, w):
        jj = torch.arange(w, device=dev).view(1, w)
        src = (start.view(T, 1) + jj).clamp(max=width - 1)
        vals = slots.gather(1, src)
        return torch.where(jj < count.view(T, 1), vals, torch.full_like(vals, -1)).to(torch.int32)

    w_win = -(-win // fd.TOPK_BLOCK) * fd.TOPK_BLOCK
    if cr > 1:
        w_main = max(-(-tk // fd.TOPK_BLOCK) * fd.TOPK_BLOCK, fd.TOPK_BLOCK)
        main = gather_list(c_slot, torch.zeros_like(n_c), n_c, w_main)
        extra = gather_list(swa_slot, n_c, n_s, w_win)
        return fd.flashmla_fp8_attention(q, compressed_k_cache, main, sm_scale, attn_sink=attn_sink, out=out,
                                         pieces_per_row=1, topk_length=n_c.to(torch.int32),
                                         extra_kv_cache=swa_k_cache, extra_indices=extra,
                                         extra_topk_length=n_s.to(torch.int32))
    main = gather_list(swa_slot, torch.zeros_like(n_s), n_s, w_win)
    return fd.flashmla_fp8_attention(q, swa_k_cache, main, sm_scale, attn_sink=attn_sink, out=out, pieces_per_row=1,
                                     topk_length=n_s.to(torch.int32))


DSV4_READ_ENV = "ZERODIFF_DSV4_READ"
DSV4_READ_ROUTES = ("prefill_path", "fixed_schedule")


def dsv4_read_route(environ=None) -> str:
    """The DeepSeek-V4 attention read route in consistency mode: ``ZERODIFF_DSV4_READ`` = "fixed_schedule"
    (default, and zerodiff's own default read path ``flashmla_fp8``, the one the training side runs: every token,
    prefill and decode, through :func:`dsv4_forward_fixed_schedule`) or "prefill_path" (decode tokens through the
    prefill path's BF16 workspace + ``flash_mla_sparse_fwd``, prefill tokens stock; the training side must then
    read the same way). The value is compared exactly; anything else is refused with a message naming the
    variable."""
    env = os.environ if environ is None else environ
    v = env.get(DSV4_READ_ENV) or "fixed_schedule"
    if v not in DSV4_READ_ROUTES:
        raise ConfigError(f"zerodiff: {DSV4_READ_ENV}={v!r} is not one of {list(DSV4_READ_ROUTES)}")
    return v


def dsv4_forward_fixed_schedule(layer: Any, q: torch.Tensor, positions: torch.Tensor, output: torch.Tensor,
                                swa_metadata: Any, attn_metadata: Any) -> None:
    """Consistency-mode body of ``DeepseekV4FlashMLAAttention.forward_mqa`` (vLLM 0.33.0) in the "fixed_schedule"
    route: all tokens of the step (decode tokens first, then prefill tokens, as vLLM orders them) in one
    :func:`dsv4_fixed_schedule_attention` call; a token's request row comes from ``query_start_loc``, so the
    decode and prefill rows of the block tables are addressed alike and a token's lists never depend on its
    phase. Padding tokens (``is_valid_token`` false, or past the last request) give 0. Refused: multimodal
    in-image windows (``prefill_left_visible`` / ``prefill_right_visible``), compress ratios other than 1, 4, 128.
    Writes ``output`` [T, heads, 512] in place."""
    if getattr(swa_metadata, "prefill_left_visible", None) is not None or \
            getattr(swa_metadata, "prefill_right_visible", None) is not None:
        raise ConfigError("zerodiff DSV4 fixed_schedule route: in-image (bidirectional) windows are not supported; "
                          f"set {DSV4_READ_ENV}=prefill_path on both sides for multimodal inputs")
    T = q.shape[0]
    dev = q.device
    num_reqs = int(swa_metadata.num_decodes) + int(swa_metadata.num_prefills)
    qsl = swa_metadata.query_start_loc[: num_reqs + 1].to(device=dev, dtype=torch.long)
    tok = torch.arange(T, device=dev, dtype=torch.long)
    token_to_req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True).clamp(max=max(num_reqs - 1, 0))
    in_batch = tok < qsl[num_reqs]
    valid_src = getattr(swa_metadata, "is_valid_token", None)
    if valid_src is not None:
        v = valid_src.reshape(-1)[:T].to(device=dev, dtype=torch.bool)
        if v.shape[0] < T:
            v = torch.cat([v, torch.zeros(T - v.shape[0], dtype=torch.bool, device=dev)])
        in_batch = in_batch & v
    cr = int(layer.compress_ratio)
    kw = dict(compress_ratio=1, top_k=0, topk_local=None, compressed_k_cache=None, compressed_block_table=None,
              compressed_block_size=1)
    if cr > 1:
        if attn_metadata is None:
            raise ConfigError("zerodiff DSV4 fixed_schedule route: a compressed layer got no FlashMLA metadata")
        cbs = int(attn_metadata.block_size) // cr
        if cbs < 1:
            raise ConfigError(f"zerodiff DSV4: block_size={attn_metadata.block_size} < compress_ratio={cr}")
        if cr == 4:
            topk_local = layer.topk_indices_buffer[:T]
            top_k = int(topk_local.shape[-1])
        elif cr == 128:
            topk_local = None
            n = -(-int(layer.max_model_len) // cr)
            top_k = -(-n // DSV4_TOPK_ALIGN) * DSV4_TOPK_ALIGN
        else:
            raise ConfigError(f"zerodiff DSV4: compress_ratio={cr} (expected 1, 4 or 128)")
        kw = dict(compress_ratio=cr, top_k=top_k, topk_local=topk_local, compressed_k_cache=layer.kv_cache,
                  compressed_block_table=attn_metadata.block_table[:num_reqs], compressed_block_size=cbs)
    out = output if output.is_contiguous() else None
    res, _lse = dsv4_fixed_schedule_attention(
        q, positions[:T], token_to_req, in_batch, window_size=int(layer.window_size),
        swa_k_cache=layer.swa_cache_layer.kv_cache, swa_block_table=swa_metadata.block_table[:num_reqs],
        swa_block_size=int(swa_metadata.block_size), sm_scale=float(layer.scale),
        attn_sink=getattr(layer, "attn_sink", None), out=out, **kw)
    if out is None:
        output.copy_(res)


