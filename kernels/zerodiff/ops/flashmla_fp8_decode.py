"""FlashMLA's FP8 sparse decode kernel under a schedule that never depends on the batch.

The stock decode path (``flash_mla_with_kvcache(is_fp8_kvcache=True, indices=...)``) reads the 656-byte FP8 cache in
place and is the fastest sparse MLA kernel on SM90/SM100, but its scheduler (``get_mla_metadata``, run on the
first call) spreads the whole batch's KV blocks over the SMs: where a row's index list is cut into partial
reductions depends on the batch, so a row's bits change with its neighbours. The kernel itself takes the schedule
as data (a ``[num_sm_parts, 8]`` int32 table of per-CTA work ranges plus a cumulative split count per row). This
module writes that table itself, as a function of the row count and the model shape only, so that every row is
reduced in the same pieces in the same order whatever else is in the batch:

* ``segments_per_row = 1`` (default, ``SEGMENTS_PER_ROW``): every row is one uncut piece handled by one CTA,
  which writes the final output itself (the combine kernel skips rows with one split). Rows are dealt to the
  CTAs in contiguous runs; which CTA runs a row and what else it runs never enters the arithmetic, because the
  kernel resets its running max / sum / accumulator at every row.
* ``segments_per_row = S > 1``: the index list (width K, a multiple of 64) is cut into S equal pieces at fixed
  offsets, one piece per CTA, merged by FlashMLA's combine kernel in piece order. At most ``num_sm_parts // S``
  rows go into one launch (the kernel's partial buffers hold ``rows + num_sm_parts`` pieces); longer batches run
  as several launches, which does not change any row.

Public API:

* ``sparse_mla_attention_flashmla_fp8(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink=None,
  d_nope=512, d_rope=64, seq_lens=None, check=True, out=None, segments_per_row=None) -> (out, lse)``
  (also reached as ``sparse_mla_attention(..., backend="flashmla_fp8")``): the same arguments and meaning as the
  other read paths of ``zerodiff.ops.sparse_attention``: ``q`` bf16 [Q, H, d_nope + d_rope] with H 64 or 128,
  ``cache`` the 656-byte paged FP8 cache of ``zerodiff.ops.kv_cache`` (d_nope 512, d_rope 64), ``block_table``
  int32 [B, max_blocks], ``req_ids`` int32 [Q], ``positions`` int32 [Q, K] request-local (-1 = empty), K a
  multiple of 64 fixed by the model (max top-k), never by the batch. Returns ``out`` bf16 [Q, H, 512] and ``lse``
  fp32 [Q, H] as the kernel writes them.
* ``fixed_schedule(rows, num_sm_parts, blocks_per_row, segments_per_row, device) -> (metadata, num_splits)``:
  the schedule table (int32 [num_sm_parts, 8]) and cumulative split counts (int32 [rows + 1]).
* ``rows_per_launch(num_sm_parts, segments_per_row) -> int``.
* ``schedule_pieces(metadata, num_splits, rows, blocks_per_row) -> list``: how the kernel consumes a table (the
  pieces each row is reduced in and where each partial goes); the CPU tests check the schedule with it.
* ``translate_positions(block_table, req_ids, positions, num_blocks, block_size) -> (indices, bad_rows)``: the
  request-local positions as the kernel's global token indices (block id * block size + offset; -1 for empty
  and for positions that cannot be resolved), and int32 [Q] flags of rows holding an unresolvable position.
* ``num_sm_parts(h_q, d_qk, device) -> int``: the CTA count FlashMLA's decode kernel is built for on this device
  (read from one stock call on a 1-row dummy; cached).

Numerical contract (bitwise; verified on the H200 only, see docs/kernels-attention.md): query row r's
``out``/``lse`` depend only on q[r], the tokens its positions resolve to and their ORDER, K, sm_scale, the sink,
the head count and ``segments_per_row``: never on Q, the other rows, the row's place in the batch, the launch it
lands in, prefill vs decode, or eager vs CUDA-graph replay. The arithmetic inside a piece is FlashMLA's (64-token
blocks in list order, online softmax in base 2, bf16 P for the P.V product, fp32 accumulation). Bits differ from
the workspace path and the Triton paths: a deployment runs one path for rollout AND training.

Fail closed: CPU tensors, a FlashMLA build without the FP8 sparse decode kernel, H not 64/128, a cache that is
not the 656-byte layout, K not a multiple of 64, a schedule table layout other than 8 int32 per CTA, or a
segment count that does not divide the 64-entry block count raise ``ValueError``/``RuntimeError`` naming the
setting. ``check=True`` validates positions against the block table on the host (one sync); with
``check=False`` (inside CUDA graphs) a row holding an unresolvable position is filled with NaN after the kernel.
"""

from __future__ import annotations

import functools

import torch

from .._triton import HAVE_TRITON, LAUNCH_OPTS, triton_usable_for
from . import kv_cache as _kv

#: pieces each row's index list is reduced in (see the module docstring); a model-shape constant.
SEGMENTS_PER_ROW = 1
#: FlashMLA's KV block (entries per main-loop step of the sparse decode kernel).
TOPK_BLOCK = 64
#: int32 fields per CTA in the schedule table: begin row, end row (inclusive), begin block, end block
#: (exclusive, in the end row), begin split, first-row-is-split flag, last-row-is-split flag, padding.
META_FIELDS = 8
#: rows per launch with one piece per row (bounds the kernel's partial buffers, allocated for rows + CTAs
#: pieces although unused here: 128 KiB per row at 64 heads).
MAX_ROWS_UNSPLIT = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _translate_kernel(pos_ptr, pos_s0, req_ptr, bt_ptr, bt_s0, idx_ptr, bad_ptr, K, max_blocks, num_blocks,
                          BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
        """Row r: request-local positions -> global token indices of the paged cache (-1 when empty or
        unresolvable) and bad[r] = 1 when any position could not be resolved. Integer arithmetic only."""
        r = tl.program_id(0)
        req = tl.load(req_ptr + r).to(tl.int64)
        nbad = tl.zeros([BLOCK_K], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            inside = offs < K
            p = tl.load(pos_ptr + r * pos_s0 + offs, mask=inside, other=-1)
            valid = p >= 0
            lb = tl.where(valid, p // BLOCK_SIZE, 0)
            in_table = lb < max_blocks
            blk = tl.load(bt_ptr + req * bt_s0 + lb, mask=valid & in_table, other=-1)
            ok = valid & in_table & (blk >= 0) & (blk < num_blocks)
            idx = tl.where(ok, blk * BLOCK_SIZE + (p - lb * BLOCK_SIZE), -1)
            tl.store(idx_ptr + r * K + offs, idx, mask=inside)
            nbad += ((valid & (ok == 0)) | (p < -1)).to(tl.int32)
        tl.store(bad_ptr + r, (tl.sum(nbad, axis=0) > 0).to(tl.int32))

    @triton.jit
    def _poison_rows_kernel(out_ptr, bad_ptr, N, BLOCK: tl.constexpr):
        """out[r, :] = NaN where bad[r] (out viewed as [Q, N] bf16); other rows untouched."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        bad = tl.load(bad_ptr + r)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        nan = tl.full([BLOCK], float("nan"), dtype=tl.float32).to(tl.bfloat16)
        tl.store(out_ptr + r.to(tl.int64) * N + offs, nan, mask=(offs < N) & (bad != 0))


def rows_per_launch(num_sm_parts: int, segments_per_row: int) -> int:
    """Rows one kernel launch takes: every row's pieces must each get their own CTA when S > 1."""
    if segments_per_row < 1:
        raise ValueError(f"zerodiff.flashmla_fp8: segments_per_row={segments_per_row} must be >= 1")
    if segments_per_row == 1:
        return MAX_ROWS_UNSPLIT
    n = num_sm_parts // segments_per_row
    if n < 1:
        raise ValueError(f"zerodiff.flashmla_fp8: segments_per_row={segments_per_row} exceeds the kernel's "
                         f"{num_sm_parts} CTAs")
    return n


def fixed_schedule(rows: int, num_sm_parts: int, blocks_per_row: int, segments_per_row: int = 1, device=None):
    """The schedule table and cumulative split counts for ``rows`` rows (see the module docstring).

    Built with torch ops on ``device`` (no host->device copy, so it can be built inside CUDA-graph capture).
    Unused CTAs get ``begin row = rows``, which makes the kernel return at once."""
    S = int(segments_per_row)
    P = int(num_sm_parts)
    if rows < 1:
        raise ValueError(f"zerodiff.flashmla_fp8: rows={rows} must be >= 1")
    if blocks_per_row < 1 or blocks_per_row % S:
        raise ValueError(f"zerodiff.flashmla_fp8: segments_per_row={S} must divide the row's {blocks_per_row} "
                         f"blocks of {TOPK_BLOCK} entries")
    if S > 1 and rows * S > P:
        raise ValueError(f"zerodiff.flashmla_fp8: {rows} rows x {S} pieces exceed the kernel's {P} CTAs "
                         f"(at most {rows_per_launch(P, S)} rows per launch)")
    i = torch.arange(P, device=device, dtype=torch.int64)
    meta = torch.zeros(P, META_FIELDS, device=device, dtype=torch.int64)
    if S == 1:
        if rows <= P:
            used = i < rows
            begin = torch.where(used, i, torch.full_like(i, rows))
            end = torch.where(used, i, torch.full_like(i, rows - 1))
        else:  # contiguous runs of whole rows, sizes differing by at most one
            begin = (i * rows) // P
            end = ((i + 1) * rows) // P - 1
            used = torch.ones_like(i, dtype=torch.bool)
        meta[:, 0] = begin
        meta[:, 1] = end
        meta[:, 3] = torch.where(used, torch.full_like(i, blocks_per_row), torch.zeros_like(i))
        splits = torch.arange(rows + 1, device=device, dtype=torch.int64)
    else:
        G = blocks_per_row // S
        used = i < rows * S
        row = torch.where(used, i // S, torch.full_like(i, rows))
        seg = torch.where(used, i % S, torch.zeros_like(i))
        meta[:, 0] = row
        meta[:, 1] = torch.where(used, row, torch.full_like(i, rows - 1))
        meta[:, 2] = seg * G
        meta[:, 3] = torch.where(used, (seg + 1) * G, torch.zeros_like(i))
        meta[:, 4] = seg
        meta[:, 5] = used.to(torch.int64)
        meta[:, 6] = used.to(torch.int64)
        splits = torch.arange(rows + 1, device=device, dtype=torch.int64) * S
    return meta.to(torch.int32), splits.to(torch.int32)


def schedule_pieces(metadata: torch.Tensor, num_splits: torch.Tensor, rows: int, blocks_per_row: int):
    """How the decode kernel consumes a schedule (its documented contract, modelled on the CPU): for each CTA in
    order, for each row it covers, the piece ``(row, start_block, end_block, no_split, partial_slot)`` with the
    partial slot ``num_splits[row] + split index`` (None when the CTA writes the final output itself)."""
    m = metadata.cpu().tolist()
    ns = num_splits.cpu().tolist()
    pieces = []
    for cta, (b0, b1, k0, k1, s0, first_split, last_split, _pad) in enumerate(m):
        if b0 >= rows:
            continue
        for r in range(b0, b1 + 1):
            start = k0 if r == b0 else 0
            end = k1 if r == b1 else blocks_per_row
            if r == b0:
                no_split = not first_split
            elif r == b1:
                no_split = not last_split
            else:
                no_split = True
            split_idx = s0 if r == b0 else 0
            pieces.append((cta, r, start, end, no_split, None if no_split else ns[r] + split_idx))
    return pieces


def translate_positions(block_table, req_ids, positions, num_blocks: int, block_size: int):
    """Request-local positions -> global token indices (int32 [Q, K], -1 = skip) and bad-row flags (int32 [Q])."""
    Q, K = positions.shape
    idx = torch.empty(Q, K, dtype=torch.int32, device=positions.device)
    bad = torch.zeros(Q, dtype=torch.int32, device=positions.device)
    if Q == 0:
        return idx, bad
    if HAVE_TRITON and triton_usable_for(positions.device):
        positions = positions if positions.stride(1) == 1 else positions.contiguous()
        bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        _translate_kernel[(Q,)](positions, positions.stride(0), req_ids.contiguous(), bt, bt.stride(0), idx, bad,
                                K, bt.shape[1], num_blocks, BLOCK_SIZE=block_size, BLOCK_K=256, num_warps=4,
                                **LAUNCH_OPTS)
        return idx, bad
    return _translate_torch(block_table, req_ids, positions, num_blocks, block_size)


def _translate_torch(block_table, req_ids, positions, num_blocks, block_size):
    """Reference of ``translate_positions`` (torch integer ops)."""
    p = positions.long()
    valid = p >= 0
    lb = torch.where(valid, p // block_size, torch.zeros_like(p))
    mb = block_table.shape[1]
    in_table = lb < mb
    blk = block_table.long()[req_ids.long()[:, None].expand_as(p), lb.clamp(max=max(mb - 1, 0))]
    blk = torch.where(valid & in_table, blk, torch.full_like(blk, -1))
    ok = valid & in_table & (blk >= 0) & (blk < num_blocks)
    idx = torch.where(ok, blk * block_size + (p - lb * block_size), torch.full_like(p, -1)).to(torch.int32)
    bad = ((valid & ~ok) | (p < -1)).any(dim=1).to(torch.int32)
    return idx, bad


def _flashmla():
    from .. import backends

    fm = backends.flash_mla()
    if fm is None:
        raise RuntimeError("zerodiff.flashmla_fp8: FlashMLA is not importable here "
                           f"({backends.status()['flashmla']['detail']})")
    op = getattr(getattr(fm, "flash_mla_cuda", None), "sparse_decode_fwd", None)
    if op is None:
        raise RuntimeError("zerodiff.flashmla_fp8: this FlashMLA build has no sparse_decode_fwd op "
                           "(the FP8 sparse decode kernel); use backend='triton_fp8_split'")
    return fm, op


@functools.lru_cache(maxsize=None)
def _num_sm_parts_cached(device_index: int, h_q: int, d_qk: int) -> int:
    fm, op = _flashmla()
    dev = torch.device("cuda", device_index)
    bpt = _kv.bytes_per_token(512, 64)
    cache = torch.zeros(1, TOPK_BLOCK, 1, bpt, dtype=torch.uint8, device=dev)
    q = torch.zeros(1, 1, h_q, d_qk, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(1, 1, TOPK_BLOCK, dtype=torch.int32, device=dev)
    res = op(q, cache, idx, None, None, None, None, None, None, None, 512, 1.0, None, False)
    meta = res[2]
    if meta is None or meta.dim() != 2 or meta.shape[1] != META_FIELDS or meta.dtype != torch.int32:
        raise RuntimeError("zerodiff.flashmla_fp8: FlashMLA's decode schedule table is not int32 [CTAs, "
                           f"{META_FIELDS}] in this build (got {None if meta is None else (meta.dtype, tuple(meta.shape))}); "
                           "the fixed schedule cannot be written for it")
    return int(meta.shape[0])


def num_sm_parts(h_q: int, d_qk: int = 576, device=None) -> int:
    """CTAs of FlashMLA's sparse decode kernel on ``device`` for ``h_q`` heads (probed once, cached)."""
    dev = torch.device(device if device is not None else "cuda")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing() and _num_sm_parts_cached.cache_info().currsize == 0:
        raise RuntimeError("zerodiff.flashmla_fp8: call once eagerly before CUDA-graph capture (the kernel's CTA "
                           "count is probed with one stock call)")
    return _num_sm_parts_cached(index, int(h_q), int(d_qk))


_SCHEDULES: dict = {}


def _schedule(rows, parts, blocks, S, device):
    key = (str(device), rows, parts, blocks, S)
    hit = _SCHEDULES.get(key)
    if hit is not None:
        return hit
    sched = fixed_schedule(rows, parts, blocks, S, device)
    if not torch.cuda.is_current_stream_capturing():  # graph-pool tensors must not outlive their graph
        _SCHEDULES[key] = sched
    return sched


def sparse_mla_attention_flashmla_fp8(q, cache, block_table, req_ids, positions, sm_scale: float, *, attn_sink=None,
                                      d_nope: int = 512, d_rope: int = 64, seq_lens=None, check: bool = True,
                                      out=None, segments_per_row: int | None = None):
    """FlashMLA's FP8 sparse decode kernel with a batch-independent schedule; see the module docstring."""
    from .sparse_attention import _check_fp8_read_args

    _check_fp8_read_args(q, cache, block_table, req_ids, positions, attn_sink, d_nope, d_rope, "flashmla_fp8")
    if q.device.type != "cuda":
        raise ValueError(f"zerodiff.sparse_attention[flashmla_fp8]: needs CUDA tensors, got {q.device}")
    if (d_nope, d_rope) != (512, 64):
        raise ValueError(f"zerodiff.sparse_attention[flashmla_fp8]: FlashMLA reads the 656-byte layout only "
                         f"(d_nope 512, d_rope 64), got d_nope={d_nope}, d_rope={d_rope}")
    Q, H, D = q.shape
    K = positions.shape[1]
    if H not in (64, 128):
        raise ValueError(f"zerodiff.sparse_attention[flashmla_fp8]: FlashMLA's decode kernel takes 64 or 128 heads, got {H}")
    if K == 0 or K % TOPK_BLOCK:
        raise ValueError(f"zerodiff.sparse_attention[flashmla_fp8]: the index-list width K={K} must be a positive "
                         f"multiple of {TOPK_BLOCK} (a model constant: pad the top-k width with -1)")
    S = SEGMENTS_PER_ROW if segments_per_row is None else int(segments_per_row)
    blocks = K // TOPK_BLOCK
    if S < 1 or blocks % S:
        raise ValueError(f"zerodiff.sparse_attention[flashmla_fp8]: segments_per_row={S} must divide the "
                         f"{blocks} blocks of {TOPK_BLOCK} entries (K={K})")
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (Q, H, d_nope) or not out.is_contiguous()):
        raise ValueError(f"zerodiff.sparse_attention[flashmla_fp8]: out must be contiguous bf16 [{Q}, {H}, {d_nope}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    if check:
        _kv._check_gather_values(cache, block_table, req_ids, positions, seq_lens)
    if out is None:
        out = torch.empty(Q, H, d_nope, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(Q, H, dtype=torch.float32, device=q.device)
    if Q == 0:
        return out, lse
    _fm, op = _flashmla()
    nb, bs, _ = cache.shape
    idx, bad = translate_positions(block_table, req_ids, positions, nb, bs)
    parts = num_sm_parts(H, D, q.device)
    step = rows_per_launch(parts, S)
    kcache = cache.view(nb, bs, 1, cache.shape[2])
    q4 = q if q.stride(2) == 1 else q.contiguous()
    for r0 in range(0, Q, step):
        r1 = min(Q, r0 + step)
        n = r1 - r0
        meta, splits = _schedule(n, parts, blocks, S, q.device)
        res = op(q4[r0:r1].unsqueeze(1), kcache, idx[r0:r1].unsqueeze(1), None, attn_sink, meta, splits,
                 None, None, None, d_nope, float(sm_scale), out[r0:r1].unsqueeze(1), False)
        l = res[1]
        if tuple(l.shape) == (n, H, 1):
            lse[r0:r1] = l[:, :, 0]
        elif tuple(l.shape) == (n, 1, H):
            lse[r0:r1] = l[:, 0, :]
        else:
            raise RuntimeError(f"zerodiff.flashmla_fp8: unexpected lse shape {tuple(l.shape)} from FlashMLA")
    if not check:  # fail closed inside graphs: rows that asked for an unresolvable position become NaN
        N = H * d_nope
        _poison_rows_kernel[(Q, triton.cdiv(N, 4096))](out, bad, N, BLOCK=4096, num_warps=4, **LAUNCH_OPTS)
    return out, lse
