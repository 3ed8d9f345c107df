"""FlashMLA's FP8 sparse decode kernel under a schedule that never depends on the batch.

The stock decode path (``flash_mla_with_kvcache(is_fp8_kvcache=True, indices=...)``) reads the 656-byte FP8 cache in
place and is the fastest sparse MLA kernel on SM90/SM100, but its scheduler (``get_mla_metadata``, run on the
first call) spreads the whole batch's KV blocks over the SMs: where a row's index list is cut into partial
reductions depends on the batch, so a row's bits change with its neighbours. The kernel takes the schedule as
data (a ``[num_sm_parts, 8]`` int32 table of per-CTA work ranges plus a cumulative split count per row). This
module writes that table itself, from the row count and the model shape only:

* every (row, piece) is reduced whole by one CTA, which writes its final output itself (the kernel's combine
  step skips rows with one split). Rows are dealt to the CTAs in contiguous runs; which CTA runs a row and what
  else it runs never enters the arithmetic, because the kernel resets its running max / sum / accumulator at
  every row;
* ``pieces_per_row = P > 1`` (``PIECES_PER_ROW``, a model-shape constant): a row's index list (width K, a
  multiple of 64 * P) is cut into P equal consecutive pieces that enter the kernel as P query positions of the
  row (its ``s_q`` axis: the same q, its own index sub-list each), so a lone decode row still spreads over P CTAs.
  The P normalised piece outputs (bf16) and their lse are merged by ``_merge_pieces_kernel`` in piece order:
  ``M = max_p lse_p``, ``w_p = exp(lse_p - M)`` (empty piece: 0), ``L = sum_p w_p``, ``out = bf16(sum_p (w_p / L)
  * o_p * 1 / (1 + exp(sink - lse)))``, ``lse = M + log L`` (all fp32, p ascending). The sink is applied by the
  merge, never inside a piece.

Public API:

* ``sparse_mla_attention_flashmla_fp8(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink=None,
  d_nope=512, d_rope=64, seq_lens=None, check=True, out=None, pieces_per_row=None) -> (out, lse)``
  (also reached as ``sparse_mla_attention(..., backend="flashmla_fp8")``, and what ``backend=None`` runs wherever
  :func:`supports` accepts the call): the same arguments and meaning as the other read paths of
  ``zerodiff.ops.attention``: ``q`` bf16 [Q, H, d_nope + d_rope] with H 64 or 128,
  ``cache`` the 656-byte paged FP8 cache of ``zerodiff.ops.kv_cache`` (d_nope 512, d_rope 64), ``block_table``
  int32 [B, max_blocks], ``req_ids`` int32 [Q], ``positions`` int32 [Q, K] request-local (-1 = empty), K fixed by
  the model (max top-k), never by the batch. Returns ``out`` bf16 [Q, H, 512] and ``lse`` fp32 [Q, H] (natural
  log; +inf and out 0 for a row without any valid position).
* ``flashmla_fp8_attention(q, kv_cache, indices, sm_scale, *, attn_sink=None, pieces_per_row=None, out=None,
  topk_length=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None) -> (out, lse)``: the same
  call on caller-given GLOBAL token indices (block id * block size + offset, -1 = skip), for the V3.2 layout
  (d_qk 576, 656 bytes) and the DeepSeek-V4 layout (d_qk 512, 584 bytes per token: ``LAYOUT_BYTES``); indices
  outside the cache are not read and make their row NaN (``sanitize_indices``). No host synchronisation.
  DeepSeek-V4's per-row lengths and SWA extra cache: one piece per row.
* ``fixed_schedule(rows, num_sm_parts, blocks_per_row, device, row_blocks=None) -> (metadata, num_splits)``: the
  schedule table (int32 [num_sm_parts, 8]) and cumulative split counts (int32 [rows + 1]); ``row_block_counts``
  gives ``row_blocks`` (the kernel's own per-row block count) when rows have their own lengths.
* ``schedule_pieces(metadata, num_splits, rows, blocks_per_row) -> list``: how the kernel consumes a table (the
  pieces each row is reduced in and where each partial goes); the CPU tests check the schedule with it.
* ``translate_positions(block_table, req_ids, positions, num_blocks, block_size) -> (indices, bad_rows)``: the
  request-local positions as the kernel's global token indices (block id * block size + offset; -1 for empty
  and for positions that cannot be resolved), and int32 [Q] flags of rows holding an unresolvable position.
* ``num_sm_parts(h_q, d_qk, pieces, device) -> int``: the CTA count per piece FlashMLA's decode kernel is built
  for on this device (read from one stock call on a 1-row dummy; cached).
* ``supports(q, positions, d_nope=512, d_rope=64, pieces_per_row=None) -> str | None``: None when this path takes
  the call on this machine, else why not (device, library and model shape only: never the batch).
* ``decode_kernel(device) -> (flash_mla module, sparse_decode_fwd)``: FlashMLA's kernel for tensors on ``device``
  (``ValueError`` off CUDA, ``RuntimeError`` when FlashMLA or its FP8 sparse decode op is missing).
* ``merge_pieces_ref(o, lse, attn_sink) -> (out, lse)``: the merge in float64 torch (reference).

Numerical contract (bitwise; where it was verified: docs/kernels-attention.md): query row r's
``out``/``lse`` depend only on q[r], the tokens its positions resolve to and their ORDER, K, sm_scale, the sink,
the head count and ``pieces_per_row``: never on Q, the other rows, the row's place in the batch, the launch it
lands in, prefill vs decode, or eager vs CUDA-graph replay. Inside a piece the arithmetic is FlashMLA's (64-token
blocks in list order, online softmax in base 2, bf16 P for the P.V product, fp32 accumulation, bf16 output).
Bits differ from the workspace path and the Triton paths: a deployment runs one path for rollout AND training.

Fail closed: CPU tensors, a FlashMLA build without the FP8 sparse decode kernel, H not 64/128, a cache that is
not the 656-byte layout, K not a multiple of 64 * pieces, or a schedule table layout other than 8 int32 per CTA
raise ``ValueError``/``RuntimeError`` naming the setting. ``check=True`` validates positions against the block
table on the host (one sync); with ``check=False`` (inside CUDA graphs) a row holding an unresolvable position
is filled with NaN.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ..._triton import HAVE_TRITON, LAUNCH_OPTS, triton_usable_for
from .. import kv_cache as _kv
from .checks import FLASHMLA_HEADS, FLASHMLA_TOPK_BLOCK, MODEL_D_V, MODEL_DIMS, check_fp8_read_args, check_out
from .checks import fail as _fail
from .checks import read_outputs
from ...errors import InputError
from ..block_slots import resolve_slots_torch

PATH = "flashmla_fp8"
#: the global-index entry's name in messages
_GLOBAL = "zerodiff.flashmla_fp8"


def _pieces_from_env(default: int = 2) -> int:
    raw = os.environ.get("ZD_FLASHMLA_PIECES", str(default))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise InputError(f"{_GLOBAL}: ZD_FLASHMLA_PIECES={raw!r} must be a positive integer "
                         "(pieces per row; it must be the same for rollout and training)")
    return int(raw)


#: pieces each row's index list is cut into (see the module docstring); a model-shape constant, the same for
#: rollout and training (``ZD_FLASHMLA_PIECES`` overrides it for an experiment: set it on both sides or neither).
#: Chosen from the measurements in docs/kernels-attention.md.
PIECES_PER_ROW = _pieces_from_env()
#: FlashMLA's KV block (entries per main-loop step of the sparse decode kernel).
TOPK_BLOCK = FLASHMLA_TOPK_BLOCK
#: int32 fields per CTA in the schedule table: begin row, end row (inclusive), begin block, end block
#: (exclusive, in the end row), begin split, first-row-is-split flag, last-row-is-split flag, padding.
META_FIELDS = 8
#: (row, piece) pairs per launch: bounds the fp32 partial buffers the kernel allocates for rows + CTAs splits
#: (unused here, 128 KiB per pair at 64 heads). Rows are independent, so the launch split never changes bits.
MAX_PAIRS_PER_LAUNCH = 1024
#: the piece merge's launch: heads per program and warps. Its arithmetic is elementwise per (row, head, column)
#: with a fixed piece order, so the tile shape does not enter the bits (``merge_pieces(bh=)`` takes another tile;
#: the tests check the bits do not move).
MERGE_BH = 16
MERGE_WARPS = 4
#: entries per program of the position translation and index sanitising kernels
TRANSLATE_BLOCK = 512
#: elements per program of the NaN fill of unresolvable rows
_FINISH_BLOCK = 4096

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..block_slots import resolve_slots

    @triton.jit
    def _translate_kernel(pos_ptr, pos_s0, req_ptr, bt_ptr, bt_s0, idx_ptr, badp_ptr, K, NCH, max_blocks, num_blocks,
                          BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
        """Row r, entries [c * BLOCK_K, +BLOCK_K): request-local positions -> global token indices of the paged
        cache (-1 when empty or unresolvable); badp[r, c] = 1 when one of them could not be resolved. Integer
        arithmetic only; every program writes its own flag (no atomics, no zero-filled buffer)."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        req = tl.load(req_ptr + r).to(tl.int64)
        offs = c * BLOCK_K + tl.arange(0, BLOCK_K)
        inside = offs < K
        p = tl.load(pos_ptr + r.to(tl.int64) * pos_s0 + offs, mask=inside, other=-1)
        slot, ok, valid = resolve_slots(bt_ptr, bt_s0, req, p, num_blocks, max_blocks, BLOCK_SIZE)
        idx = tl.where(ok, slot, -1)
        tl.store(idx_ptr + r.to(tl.int64) * K + offs, idx, mask=inside)
        nbad = ((valid & (ok == 0)) | (p < -1)).to(tl.int32)
        tl.store(badp_ptr + r * NCH + c, (tl.sum(nbad, axis=0) > 0).to(tl.int32))

    @triton.jit
    def _sanitize_kernel(in_ptr, in_s0, idx_ptr, badp_ptr, K, NCH, capacity, BLOCK_K: tl.constexpr):
        """Row r, entries [c * BLOCK_K, +BLOCK_K) of caller-given global token indices: copied where -1 or inside
        the cache, -1 elsewhere; badp[r, c] = 1 when an entry was < -1 or >= capacity (the row will be NaN)."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * BLOCK_K + tl.arange(0, BLOCK_K)
        inside = offs < K
        v = tl.load(in_ptr + r.to(tl.int64) * in_s0 + offs, mask=inside, other=-1)
        ok = (v >= 0) & (v < capacity)
        tl.store(idx_ptr + r.to(tl.int64) * K + offs, tl.where(ok, v, -1), mask=inside)
        nbad = ((v < -1) | (v >= capacity)).to(tl.int32)
        tl.store(badp_ptr + r * NCH + c, (tl.sum(nbad, axis=0) > 0).to(tl.int32))

    @triton.jit
    def _row_bad(badp_ptr, r, NCH):
        """1 when any chunk flag of row r is set."""
        b = tl.load(badp_ptr + r * NCH)
        for c in range(1, NCH):
            b = tl.maximum(b, tl.load(badp_ptr + r * NCH + c))
        return b

    @triton.jit
    def _finish_rows_kernel(out_ptr, lse_src_ptr, lse_src_s0, lse_src_s1, lse_ptr, bad_ptr, NCH, H, N,
                            POISON: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
        """One piece per row: lse[r, :] = the kernel's lse (copied out of its [rows, H, 1] layout); with POISON,
        out[r, :] and lse[r, :] = NaN where bad[r]."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        h = tl.arange(0, BLOCK_H)
        if c == 0:
            l = tl.load(lse_src_ptr + r.to(tl.int64) * lse_src_s0 + h * lse_src_s1, mask=h < H)
            if POISON:
                bad = _row_bad(bad_ptr, r, NCH)
                l = tl.where(bad != 0, float("nan"), l)
            tl.store(lse_ptr + r.to(tl.int64) * H + h, l, mask=h < H)
        if POISON:
            bad = _row_bad(bad_ptr, r, NCH)
            offs = c * BLOCK + tl.arange(0, BLOCK)
            nan = tl.full([BLOCK], float("nan"), dtype=tl.float32).to(tl.bfloat16)
            tl.store(out_ptr + r.to(tl.int64) * N + offs, nan, mask=(offs < N) & (bad != 0))

    @triton.jit
    def _merge_pieces_kernel(po_ptr, pl_ptr, pl_s0, pl_s1, pl_s2, sink_ptr, bad_ptr, NCH, out_ptr, lse_ptr, H,
                             P: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr, HAS_SINK: tl.constexpr,
                             POISON: tl.constexpr):
        """Row r, heads [hb * BH, +BH): merge the P piece outputs po [rows, P, H, DV] (bf16, each normalised over
        its piece) with their lse pl (natural log, +inf = empty piece) in piece order; see the module docstring."""
        r = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        h = hb * BH + tl.arange(0, BH)
        hm = h < H
        d = tl.arange(0, DV)
        M = tl.full([BH], float("-inf"), dtype=tl.float32)
        for p in tl.static_range(P):
            lp = tl.load(pl_ptr + r * pl_s0 + p * pl_s2 + h * pl_s1, mask=hm, other=float("inf"))
            lp = tl.where(lp == float("inf"), float("-inf"), lp)
            M = tl.maximum(M, lp)
        empty = M == float("-inf")
        Ms = tl.where(empty, 0.0, M)
        L = tl.zeros([BH], dtype=tl.float32)
        for p in tl.static_range(P):
            lp = tl.load(pl_ptr + r * pl_s0 + p * pl_s2 + h * pl_s1, mask=hm, other=float("inf"))
            lp = tl.where(lp == float("inf"), float("-inf"), lp)
            L += tl.exp2((lp - Ms) * 1.4426950408889634)
        lse2 = tl.where(empty, float("inf"), Ms * 1.4426950408889634 + tl.log2(tl.where(empty, 1.0, L)))
        fac = tl.full([BH], 1.0, dtype=tl.float32)
        if HAS_SINK:
            sk = tl.load(sink_ptr + h, mask=hm, other=0.0)
            fac = tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp2(sk * 1.4426950408889634 - lse2)))
        acc = tl.zeros([BH, DV], dtype=tl.float32)
        for p in tl.static_range(P):
            lp = tl.load(pl_ptr + r * pl_s0 + p * pl_s2 + h * pl_s1, mask=hm, other=float("inf"))
            lp = tl.where(lp == float("inf"), float("-inf"), lp)
            w = tl.where(empty, 0.0, tl.exp2((lp - Ms) * 1.4426950408889634) / tl.where(empty, 1.0, L))
            o = tl.load(po_ptr + ((r * P + p) * H + h[:, None]) * DV + d[None, :], mask=hm[:, None], other=0.0)
            acc += w[:, None] * o.to(tl.float32)
        res = acc * fac[:, None]
        lse = lse2 * 0.6931471805599453
        if POISON:
            bad = _row_bad(bad_ptr, r, NCH)
            res = tl.where(bad != 0, float("nan"), res)
            lse = tl.where(bad != 0, float("nan"), lse)
        tl.store(out_ptr + (r * H + h[:, None]) * DV + d[None, :], res.to(tl.bfloat16), mask=hm[:, None])
        tl.store(lse_ptr + r * H + h, lse, mask=hm)


def rows_per_launch(pieces_per_row: int = 1) -> int:
    """Rows one kernel launch takes (a memory bound only)."""
    if pieces_per_row < 1:
        raise InputError(f"{_GLOBAL}: pieces_per_row={pieces_per_row} must be >= 1")
    return max(1, MAX_PAIRS_PER_LAUNCH // pieces_per_row)


def fixed_schedule(rows: int, num_sm_parts: int, blocks_per_row: int, device=None, row_blocks=None):
    """The schedule table and cumulative split counts for ``rows`` rows, each reduced whole by one CTA (per
    piece: the kernel runs the same table for every query position of the ``s_q`` axis).

    ``row_blocks`` (int tensor [rows] on ``device``, optional): each row's own block count when rows differ
    (``topk_length`` / an extra cache); the table then ends each CTA's last row at that row's count (the kernel
    derives the other rows' counts itself). Built with torch ops on ``device`` (no host->device copy, so it can
    be built inside CUDA-graph capture). Unused CTAs get ``begin row = rows``, which makes the kernel return at
    once."""
    P = int(num_sm_parts)
    if rows < 1:
        raise InputError(f"{_GLOBAL}: rows={rows} must be >= 1")
    if blocks_per_row < 1:
        raise InputError(f"{_GLOBAL}: blocks_per_row={blocks_per_row} must be >= 1")
    if P < 1:
        raise InputError(f"{_GLOBAL}: num_sm_parts={P} must be >= 1")
    i = torch.arange(P, device=device, dtype=torch.int64)
    meta = torch.zeros(P, META_FIELDS, device=device, dtype=torch.int64)
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
    if row_blocks is None:
        last = torch.full_like(i, blocks_per_row)
    else:
        if tuple(row_blocks.shape) != (rows,):
            raise InputError(f"{_GLOBAL}: row_blocks must have shape ({rows},), got {tuple(row_blocks.shape)}")
        last = row_blocks.to(device=device, dtype=torch.int64)[end.clamp(min=0, max=rows - 1)]
    meta[:, 3] = torch.where(used, last, torch.zeros_like(i))
    splits = torch.arange(rows + 1, device=device, dtype=torch.int64)
    return meta.to(torch.int32), splits.to(torch.int32)


def row_block_counts(rows: int, topk: int, topk_length=None, extra_topk: int = 0, extra_topk_length=None, device=None):
    """Blocks of 64 entries the decode kernel reduces per row (its own count): ``max(ceil(len / 64), 1)`` of the
    main list (``len`` = ``topk_length[r]`` or the width) plus ``ceil(extra_len / 64)`` of the extra list."""
    if topk_length is None:
        main = torch.full((rows,), max(-(-topk // TOPK_BLOCK), 1), dtype=torch.int64, device=device)
    else:
        main = ((topk_length.to(torch.int64) + TOPK_BLOCK - 1) // TOPK_BLOCK).clamp(min=1)
    if extra_topk_length is not None:
        main = main + (extra_topk_length.to(torch.int64) + TOPK_BLOCK - 1) // TOPK_BLOCK
    elif extra_topk:
        main = main + -(-extra_topk // TOPK_BLOCK)
    return main


def schedule_pieces(metadata: torch.Tensor, num_splits: torch.Tensor, rows: int, blocks_per_row):
    """How the decode kernel consumes a schedule (its contract, modelled on the CPU): for each CTA in order, for
    each row it covers, ``(cta, row, start_block, end_block, no_split, partial_slot)`` with the partial slot
    ``num_splits[row] + split index`` (None when the CTA writes the final output itself). ``blocks_per_row`` is
    one count for every row or a per-row sequence (the kernel's own count of a row it reads whole)."""
    m = metadata.cpu().tolist()
    ns = num_splits.cpu().tolist()
    counts = [int(blocks_per_row)] * rows if isinstance(blocks_per_row, int) else [int(b) for b in blocks_per_row]
    pieces = []
    for cta, (b0, b1, k0, k1, s0, first_split, last_split, _pad) in enumerate(m):
        if b0 >= rows:
            continue
        for r in range(b0, b1 + 1):
            start = k0 if r == b0 else 0
            end = k1 if r == b1 else counts[r]
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
    idx, badp = _translate(block_table, req_ids, positions, num_blocks, block_size)
    return idx, badp.amax(dim=1) if badp.shape[1] else badp.new_zeros(badp.shape[0])


def _translate(block_table, req_ids, positions, num_blocks, block_size):
    """(indices int32 [Q, K], per-chunk bad flags int32 [Q, ceil(K / TRANSLATE_BLOCK)])."""
    Q, K = positions.shape
    if HAVE_TRITON and triton_usable_for(positions.device):
        nch = max(1, triton.cdiv(K, TRANSLATE_BLOCK))
        idx = torch.empty(Q, K, dtype=torch.int32, device=positions.device)
        badp = torch.empty(Q, nch, dtype=torch.int32, device=positions.device)
        if Q == 0:
            return idx, badp
        positions = positions if positions.stride(1) == 1 else positions.contiguous()
        bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        _translate_kernel[(Q, nch)](positions, positions.stride(0), req_ids.contiguous(), bt, bt.stride(0), idx,
                                    badp, K, nch, bt.shape[1], num_blocks, BLOCK_SIZE=block_size,
                                    BLOCK_K=TRANSLATE_BLOCK, num_warps=4, **LAUNCH_OPTS)
        return idx, badp
    idx, bad = _translate_torch(block_table, req_ids, positions, num_blocks, block_size)
    return idx, bad[:, None]


def _translate_torch(block_table, req_ids, positions, num_blocks, block_size):
    """Reference of ``translate_positions`` (torch integer ops, ``slots.resolve_slots_torch``)."""
    slot, ok, valid = resolve_slots_torch(block_table, req_ids, positions, num_blocks, block_size)
    bad = ((valid & ~ok) | (positions < -1)).any(dim=1).to(torch.int32)
    return slot.to(torch.int32), bad


def merge_pieces_ref(o: torch.Tensor, lse: torch.Tensor, attn_sink=None):
    """Reference of the piece merge in float64: ``o`` [Q, P, H, DV] bf16 piece outputs, ``lse`` [Q, P, H]
    (natural log, +inf = empty piece). Returns (out float64 [Q, H, DV], lse float64 [Q, H])."""
    lp = lse.double()
    lp = torch.where(lp == math.inf, torch.full_like(lp, -math.inf), lp)
    M = lp.max(dim=1).values
    empty = M == -math.inf
    Ms = torch.where(empty, torch.zeros_like(M), M)
    w = torch.exp(lp - Ms[:, None])
    L = w.sum(dim=1)
    Ls = torch.where(empty, torch.ones_like(L), L)
    out = (w[..., None] / Ls[:, None, :, None] * o.double()).sum(dim=1)
    lse_out = torch.where(empty, torch.full_like(M, math.inf), Ms + torch.log(Ls))
    if attn_sink is not None:
        fac = 1.0 / (1.0 + torch.exp(attn_sink.double()[None, :] - lse_out))
        out = out * torch.where(empty, torch.zeros_like(fac), fac)[..., None]
    return out, lse_out


def merge_pieces(o: torch.Tensor, lse: torch.Tensor, attn_sink=None, bad=None, out=None, lse_out=None, bh=None):
    """The piece merge (``_merge_pieces_kernel``): ``o`` [Q, P, H, DV] bf16 contiguous, ``lse`` fp32 [Q, P, H]
    (any strides). Rows flagged in ``bad`` (int32 [Q] or per-chunk flags [Q, n]) come out NaN."""
    Q, P, H, DV = o.shape
    if out is None:
        out = torch.empty(Q, H, DV, dtype=torch.bfloat16, device=o.device)
    if lse_out is None:
        lse_out = torch.empty(Q, H, dtype=torch.float32, device=o.device)
    if Q == 0:
        return out, lse_out
    BH = MERGE_BH if bh is None else int(bh)
    if bad is not None and bad.dim() == 1:
        bad = bad[:, None]
    badc = bad.contiguous() if bad is not None else out
    nch = bad.shape[1] if bad is not None else 0
    sink = attn_sink if attn_sink is not None else lse_out
    _merge_pieces_kernel[(Q, triton.cdiv(H, BH))](
        o, lse, lse.stride(0), lse.stride(2), lse.stride(1), sink, badc, nch, out, lse_out,
        H, P=P, DV=DV, BH=BH, HAS_SINK=attn_sink is not None, POISON=bad is not None, num_warps=MERGE_WARPS,
        **LAUNCH_OPTS)
    return out, lse_out


def supports(q, positions, d_nope: int = 512, d_rope: int = 64, pieces_per_row: int | None = None) -> str | None:
    """None when this path can take the call on this machine, else why not (a static property of the device, the
    library and the model shape: never of the batch)."""
    P = PIECES_PER_ROW if pieces_per_row is None else int(pieces_per_row)
    if q.device.type != "cuda":
        return f"needs CUDA tensors, got {q.device}"
    if (d_nope, d_rope) != MODEL_DIMS:
        return f"FlashMLA reads the 656-byte layout only (d_nope 512, d_rope 64), got {d_nope}, {d_rope}"
    if q.dim() != 3 or q.shape[1] not in FLASHMLA_HEADS:
        return f"FlashMLA's decode kernel takes 64 or 128 heads, got q {tuple(q.shape)}"
    K = positions.shape[-1]
    if P < 1 or K == 0 or K % (TOPK_BLOCK * P):
        return f"the index-list width {K} is not a multiple of {TOPK_BLOCK} x {P} pieces"
    try:
        decode_kernel(q.device)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def decode_kernel(device):
    """FlashMLA's FP8 sparse decode kernel for tensors on ``device``: (the flash_mla module, its
    ``sparse_decode_fwd`` op). ``ValueError`` off CUDA (the kernel runs on CUDA only), ``RuntimeError`` when
    FlashMLA is not importable or the build lacks the op."""
    if torch.device(device).type != "cuda":
        raise InputError(f"{_GLOBAL}: needs CUDA tensors, got {device}")
    from ... import backends

    fm = backends.flash_mla()
    if fm is None:
        raise RuntimeError(f"{_GLOBAL}: FlashMLA is not importable here "
                           f"({backends.status()['flashmla']['detail']})")
    op = getattr(getattr(fm, "flash_mla_cuda", None), "sparse_decode_fwd", None)
    if op is None:
        raise RuntimeError(f"{_GLOBAL}: this FlashMLA build has no sparse_decode_fwd op "
                           "(the FP8 sparse decode kernel); use backend='triton_fp8_split'")
    return fm, op


#: FlashMLA's FP8 sparse cache layouts this module schedules, by query/key width d_qk: bytes per token.
#: 576: DeepSeek-V3.2 (512 e4m3 | 4 fp32 scales | 64 bf16 rope), zerodiff.ops.kv_cache's layout.
#: 512: DeepSeek-V4 (per page block: block_size data rows of 448 e4m3 + 64 bf16, then block_size rows of 7 e8m0
#: scales + 1 pad byte), vLLM's DeepSeek-V4 cache.
LAYOUT_BYTES = {576: 656, 512: 584}


@functools.lru_cache(maxsize=None)
def _num_sm_parts_cached(device_index: int, h_q: int, d_qk: int, pieces: int) -> int:
    dev = torch.device("cuda", device_index)
    _fm, op = decode_kernel(dev)
    bpt = LAYOUT_BYTES[d_qk]
    cache = torch.zeros(1, TOPK_BLOCK, 1, bpt, dtype=torch.uint8, device=dev)
    q = torch.zeros(1, pieces, h_q, d_qk, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(1, pieces, TOPK_BLOCK, dtype=torch.int32, device=dev)
    res = op(q, cache, idx, None, None, None, None, None, None, None, MODEL_D_V, 1.0, None, False)
    meta = res[2]
    if meta is None or meta.dim() != 2 or meta.shape[1] != META_FIELDS or meta.dtype != torch.int32:
        raise RuntimeError(f"{_GLOBAL}: FlashMLA's decode schedule table is not int32 [CTAs, "
                           f"{META_FIELDS}] in this build (got {None if meta is None else (meta.dtype, tuple(meta.shape))}); "
                           "the fixed schedule cannot be written for it")
    return int(meta.shape[0])


def num_sm_parts(h_q: int, d_qk: int = 576, pieces: int = 1, device=None) -> int:
    """CTAs per piece of FlashMLA's sparse decode kernel on ``device`` for ``h_q`` heads (probed once, cached)."""
    dev = torch.device(device if device is not None else "cuda")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    key = (index, int(h_q), int(d_qk), int(pieces))
    if torch.cuda.is_current_stream_capturing():
        try:
            return _PROBED[key]
        except KeyError:
            raise RuntimeError(f"{_GLOBAL}: call once eagerly before CUDA-graph capture (the kernel's "
                               "CTA count is probed with one stock call)") from None
    n = _num_sm_parts_cached(*key)
    _PROBED[key] = n
    return n


_PROBED: dict = {}
_SCHEDULES: dict = {}


def _schedule(rows, parts, blocks, device):
    key = (str(device), rows, parts, blocks)
    hit = _SCHEDULES.get(key)
    if hit is not None:
        return hit
    sched = fixed_schedule(rows, parts, blocks, device)
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:  # graph-pool tensors must not outlive their graph
        _SCHEDULES[key] = sched
    return sched


def sparse_mla_attention_flashmla_fp8(q, cache, block_table, req_ids, positions, sm_scale: float, *, attn_sink=None,
                                      d_nope: int = 512, d_rope: int = 64, seq_lens=None, check: bool = True,
                                      out=None, pieces_per_row: int | None = None):
    """FlashMLA's FP8 sparse decode kernel with a batch-independent schedule; see the module docstring."""
    return read_request_local(q, cache, block_table, req_ids, positions, sm_scale, attn_sink=attn_sink,
                              d_nope=d_nope, d_rope=d_rope, seq_lens=seq_lens, check=check, out=out,
                              pieces_per_row=pieces_per_row, q_copy=False)


def read_request_local(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink, d_nope, d_rope, seq_lens,
                       check, out, pieces_per_row, q_copy):
    """:func:`sparse_mla_attention_flashmla_fp8` with the choice of how q reaches the kernel: ``q_copy=False``
    (shipped) a stride-0 broadcast over the pieces, ``True`` a materialised copy per piece (the same values)."""
    check_fp8_read_args(q, cache, block_table, req_ids, positions, attn_sink, d_nope, d_rope, PATH)
    if q.device.type != "cuda":
        decode_kernel(q.device)  # refuses off CUDA before the shape checks below
    if (d_nope, d_rope) != MODEL_DIMS:
        raise _fail(PATH, f"FlashMLA reads the 656-byte layout only (d_nope 512, d_rope 64), got d_nope={d_nope}, "
                          f"d_rope={d_rope}")
    Q, H, D = q.shape
    K = positions.shape[1]
    if H not in FLASHMLA_HEADS:
        raise _fail(PATH, f"FlashMLA's decode kernel takes 64 or 128 heads, got {H}")
    P = PIECES_PER_ROW if pieces_per_row is None else int(pieces_per_row)
    if P < 1 or K == 0 or K % (TOPK_BLOCK * P):
        raise _fail(PATH, f"the index-list width K={K} must be a positive multiple of {TOPK_BLOCK} x "
                          f"pieces_per_row={P} (a model constant: pad the top-k width with -1)")
    check_out(out, (Q, H, d_nope), PATH, contiguous=True)
    if check:
        _kv._check_gather_values(cache, block_table, req_ids, positions, seq_lens)
    out, lse = read_outputs(q, d_nope, out)
    if Q == 0:
        return out, lse
    nb, bs, _ = cache.shape
    idx, bad = _translate(block_table, req_ids, positions, nb, bs)
    _run_fixed(q, cache.view(nb, bs, 1, cache.shape[2]), idx, sm_scale, attn_sink, P, out, lse,
               None if check else bad, q_copy)
    return out, lse


def flashmla_fp8_attention(q, kv_cache, indices, sm_scale: float, *, attn_sink=None, pieces_per_row: int | None = None,
                           out=None, topk_length=None, extra_kv_cache=None, extra_indices=None,
                           extra_topk_length=None):
    """The same fixed-schedule kernel call on caller-given GLOBAL token indices (what vLLM's sparse backends hold).

    ``q`` bf16 [Q, H, d_qk] (H 64 or 128; d_qk 576 for the V3.2 layout, 512 for the V4 layout, ``LAYOUT_BYTES``);
    ``kv_cache`` uint8 [num_blocks, block_size, bytes] or [num_blocks, block_size, 1, bytes] in that layout (the
    whole cache one allocation); ``indices`` int32 [Q, K] = block id * block_size + offset, -1 = skip, K a multiple
    of 64 x pieces. Returns ``out`` bf16 [Q, H, 512] and ``lse`` fp32 [Q, H]; the same numerical contract as the
    module's other entry point. No host synchronisation: an index < -1 or past the cache is not read and makes
    its row NaN (out and lse).

    DeepSeek-V4 attention (d_qk 512 only, one piece per row): ``topk_length`` int32 [Q] (only the first
    ``topk_length[r]`` indices of row r are read), ``extra_kv_cache`` (the SWA cache, same layout) with
    ``extra_indices`` int32 [Q, K2] and optionally ``extra_topk_length`` int32 [Q]: FlashMLA reads the row's
    main list, then its extra list, and the table ends each CTA's last row at that row's own block count
    (``row_block_counts``)."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3:
        raise InputError(f"{_GLOBAL}: q must be bf16 [Q, H, d_qk], got {getattr(q, 'dtype', type(q))} "
                         f"{tuple(getattr(q, 'shape', ()))}")
    Q, H, D = q.shape
    if D not in LAYOUT_BYTES:
        raise InputError(f"{_GLOBAL}: d_qk={D} is not a FlashMLA FP8 sparse layout this module schedules "
                         f"(one of {sorted(LAYOUT_BYTES)})")
    if H not in FLASHMLA_HEADS:
        raise InputError(f"{_GLOBAL}: FlashMLA's decode kernel takes 64 or 128 heads, got {H}")
    bpt = LAYOUT_BYTES[D]
    kv_cache = _as_flashmla_cache(kv_cache, bpt, "kv_cache", D)
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != Q:
        raise InputError(f"{_GLOBAL}: indices must be int32 [{Q}, K], got {indices.dtype} {tuple(indices.shape)}")
    if attn_sink is not None and (attn_sink.dtype != torch.float32 or tuple(attn_sink.shape) != (H,)):
        raise InputError(f"{_GLOBAL}: attn_sink must be fp32 [{H}], got {attn_sink.dtype} {tuple(attn_sink.shape)}")
    for name, t in (("kv_cache", kv_cache), ("indices", indices)):
        if t.device != q.device:
            raise InputError(f"{_GLOBAL}: {name} is on {t.device}, q on {q.device}")
    K = indices.shape[1]
    varlen = topk_length is not None or extra_kv_cache is not None or extra_indices is not None \
        or extra_topk_length is not None
    P = PIECES_PER_ROW if pieces_per_row is None else int(pieces_per_row)
    if varlen:
        if D != 512:
            raise InputError(f"{_GLOBAL}: topk_length / an extra cache are scheduled for the DeepSeek-V4 "
                             f"layout (d_qk 512) only, got d_qk={D}")
        if pieces_per_row is not None and int(pieces_per_row) != 1:
            raise InputError(f"{_GLOBAL}: topk_length / an extra cache need pieces_per_row=1 (FlashMLA's "
                             f"lengths are per row, not per piece), got {pieces_per_row}")
        P = 1
        if (extra_kv_cache is None) != (extra_indices is None):
            raise InputError(f"{_GLOBAL}: extra_kv_cache and extra_indices come together")
        if extra_topk_length is not None and extra_kv_cache is None:
            raise InputError(f"{_GLOBAL}: extra_topk_length without an extra cache")
        for name, t in (("topk_length", topk_length), ("extra_topk_length", extra_topk_length)):
            if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (Q,)):
                raise InputError(f"{_GLOBAL}: {name} must be int32 [{Q}], got {t.dtype} {tuple(t.shape)}")
        if extra_kv_cache is not None:
            extra_kv_cache = _as_flashmla_cache(extra_kv_cache, bpt, "extra_kv_cache", D)
            if extra_indices.dtype != torch.int32 or extra_indices.dim() != 2 or extra_indices.shape[0] != Q \
                    or extra_indices.shape[1] == 0:
                raise InputError(f"{_GLOBAL}: extra_indices must be int32 [{Q}, K2 > 0], got "
                                 f"{extra_indices.dtype} {tuple(extra_indices.shape)}")
    if P < 1 or K == 0 or K % (TOPK_BLOCK * P):
        raise InputError(f"{_GLOBAL}: the index-list width K={K} must be a positive multiple of "
                         f"{TOPK_BLOCK} x pieces_per_row={P}")
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (Q, H, MODEL_D_V)
                            or not out.is_contiguous()):
        raise InputError(f"{_GLOBAL}: out must be contiguous bf16 [{Q}, {H}, {MODEL_D_V}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if q.device.type != "cuda":
        decode_kernel(q.device)  # refuses off CUDA
    if out is None:
        out = torch.empty(Q, H, MODEL_D_V, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(Q, H, dtype=torch.float32, device=q.device)
    if Q == 0:
        return out, lse
    idx, bad = sanitize_indices(indices, kv_cache.shape[0] * kv_cache.shape[1])
    extra = None
    if varlen:
        extra_idx = None
        if extra_kv_cache is not None:
            extra_idx, extra_bad = sanitize_indices(extra_indices, extra_kv_cache.shape[0] * extra_kv_cache.shape[1])
            bad = torch.cat([bad, extra_bad], dim=1)
        extra = dict(topk_length=topk_length, extra_kv_cache=extra_kv_cache, extra_indices=extra_idx,
                     extra_topk_length=extra_topk_length)
    _run_fixed(q, kv_cache, idx, sm_scale, attn_sink, P, out, lse, bad, False, extra)
    return out, lse


def _as_flashmla_cache(c, bpt: int, name: str, d_qk: int):
    """A paged FP8 cache as FlashMLA takes it: uint8 [num_blocks, block_size, 1, bpt] whose tokens are contiguous
    inside a block (a block stride larger than block_size * bpt, vLLM's padded blocks, is allowed)."""
    if not isinstance(c, torch.Tensor) or c.dtype != torch.uint8 or c.dim() not in (3, 4):
        raise InputError(f"{_GLOBAL}: {name} must be uint8 [num_blocks, block_size, (1,) {bpt}] for "
                         f"d_qk={d_qk}, got {getattr(c, 'dtype', type(c))} {tuple(getattr(c, 'shape', ()))}")
    if c.dim() == 3:
        c = c.unsqueeze(2)
    nb, bs, one, b = c.shape
    if one != 1 or b != bpt or c.stride(3) != 1 or c.stride(1) != bpt or c.stride(0) < bs * bpt:
        raise InputError(f"{_GLOBAL}: {name} must be uint8 [num_blocks, block_size, (1,) {bpt}] with the "
                         f"tokens of a block contiguous (d_qk={d_qk}), got shape {tuple(c.shape)} strides "
                         f"{tuple(c.stride())}")
    return c


def sanitize_indices(indices, capacity: int):
    """Caller-given global token indices -> (indices the kernel may read: -1 where the input was < -1 or >=
    ``capacity``, per-chunk flags int32 [Q, ceil(K / TRANSLATE_BLOCK)] of rows holding such an entry)."""
    Q, K = indices.shape
    nch = max(1, -(-K // TRANSLATE_BLOCK))
    idx = torch.empty(Q, K, dtype=torch.int32, device=indices.device)
    bad = torch.empty(Q, nch, dtype=torch.int32, device=indices.device)
    if Q == 0:
        return idx, bad
    if HAVE_TRITON and triton_usable_for(indices.device):
        src = indices if indices.stride(1) == 1 else indices.contiguous()
        _sanitize_kernel[(Q, nch)](src, src.stride(0), idx, bad, K, nch, capacity, BLOCK_K=TRANSLATE_BLOCK,
                                   num_warps=4, **LAUNCH_OPTS)
        return idx, bad
    v = indices.long()
    ok = (v >= 0) & (v < capacity)
    idx.copy_(torch.where(ok, v, torch.full_like(v, -1)))
    flag = ((v < -1) | (v >= capacity)).int()
    pad = nch * TRANSLATE_BLOCK - K
    bad.copy_(torch.nn.functional.pad(flag, (0, pad)).view(Q, nch, TRANSLATE_BLOCK).amax(dim=2))
    return idx, bad


def _run_fixed(q, kcache, idx, sm_scale, attn_sink, P, out, lse, bad, q_copy, extra=None):
    """The kernel launches under the fixed schedule (rows in launches of ``rows_per_launch(P)``), then the merge
    (P > 1) or the lse copy (P = 1); rows flagged in ``bad`` (per-chunk flags, or None) come out NaN. ``extra``
    (P = 1 only): per-row lengths and the extra cache of ``flashmla_fp8_attention``."""
    _fm, op = decode_kernel(q.device)
    Q, H, D = q.shape
    K = idx.shape[1]
    d_v = MODEL_D_V
    parts = num_sm_parts(H, D, P, q.device)
    blocks = K // (TOPK_BLOCK * P)
    step = rows_per_launch(P)
    q = q if q.stride(2) == 1 else q.contiguous()
    pieces_out = None if P == 1 else torch.empty(Q, P, H, d_v, dtype=torch.bfloat16, device=q.device)
    for r0 in range(0, Q, step):
        r1 = min(Q, r0 + step)
        n = r1 - r0
        if extra is None:
            meta, splits = _schedule(n, parts, blocks, q.device)
        else:  # rows of their own lengths: the table ends each CTA's last row at that row's count (not cached)
            tl_, etl = extra["topk_length"], extra["extra_topk_length"]
            eidx = extra["extra_indices"]
            counts = row_block_counts(n, K, None if tl_ is None else tl_[r0:r1], 0 if eidx is None else eidx.shape[1],
                                      None if etl is None else etl[r0:r1], q.device)
            meta, splits = fixed_schedule(n, parts, blocks, q.device, row_blocks=counts)
        # the P pieces of a row are P query positions sharing the row's q (a stride-0 axis, no copy)
        qp = q[r0:r1].unsqueeze(1).expand(n, P, H, D)
        if q_copy:
            qp = qp.contiguous()
        ip = idx[r0:r1].view(n, P, K // P)
        rb = None if bad is None else bad[r0:r1]
        if P == 1:
            e = extra or {}

            def sl(t, r0=r0, r1=r1):
                return None if t is None else t[r0:r1]

            ekv = e.get("extra_kv_cache")
            eip = None if e.get("extra_indices") is None else e["extra_indices"][r0:r1].unsqueeze(1)
            res = op(qp, kcache, ip, sl(e.get("topk_length")), attn_sink, meta, splits, ekv, eip,
                     sl(e.get("extra_topk_length")), d_v, float(sm_scale), out[r0:r1].unsqueeze(1), False)
            _finish(res[1], out[r0:r1], lse[r0:r1], rb, H, d_v)
        else:
            res = op(qp, kcache, ip, None, None, meta, splits, None, None, None, d_v, float(sm_scale),
                     pieces_out[r0:r1], False)
            kl = res[1]
            if tuple(kl.shape) == (n, H, P):
                kl = kl.transpose(1, 2)
            elif tuple(kl.shape) != (n, P, H):
                raise RuntimeError(f"{_GLOBAL}: unexpected lse shape {tuple(kl.shape)} from FlashMLA")
            merge_pieces(pieces_out[r0:r1], kl, attn_sink, rb, out[r0:r1], lse[r0:r1])


def _finish(kernel_lse, out, lse, bad, H, d_nope):
    """One piece per row: copy the kernel's lse ([rows, H, 1] or [rows, 1, H]) and NaN-fill bad rows."""
    n = out.shape[0]
    if tuple(kernel_lse.shape) == (n, H, 1):
        s0, s1 = kernel_lse.stride(0), kernel_lse.stride(1)
    elif tuple(kernel_lse.shape) == (n, 1, H):
        s0, s1 = kernel_lse.stride(0), kernel_lse.stride(2)
    else:
        raise RuntimeError(f"{_GLOBAL}: unexpected lse shape {tuple(kernel_lse.shape)} from FlashMLA")
    N = H * d_nope
    poison = bad is not None
    grid = (n, triton.cdiv(N, _FINISH_BLOCK) if poison else 1)
    _finish_rows_kernel[grid](out, kernel_lse, s0, s1, lse, bad if poison else lse, bad.shape[1] if poison else 0,
                              H, N, POISON=poison,
                              BLOCK=_FINISH_BLOCK, BLOCK_H=triton.next_power_of_2(H), num_warps=4, **LAUNCH_OPTS)
