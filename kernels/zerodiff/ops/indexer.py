"""DSA lightning indexer: FP8 index-key cache, fixed-order scoring of each query's history, deterministic
Top-K. One write kernel, one scoring kernel for prefill rows, decode rows and training rows.

Public API:

* ``index_bytes_per_token(d=128) -> int`` (d + 4: d e4m3 codes, one fp32 scale)
* ``new_index_cache(num_blocks, block_size=64, *, d=128, device=None) -> uint8 [nb, bs, d + 4]``
* ``write_index_cache(k, cache, slot_mapping, *, check=True, backend=None)`` in place; ``k`` bf16 [T, d],
  ``slot_mapping`` int64 [T] (-1 = skip). Quantised per token (group = d) by ``reference/fp8_quant.py``.
* ``quant_index_q(q) -> (q_fp8 [T, H, d], q_scale fp32 [T, H])``: the same FP8 rule per (token, head);
  fold ``q_scale`` (and the softmax / head scales) into ``weights`` before scoring.
* ``index_scores(q_fp8, weights, cache, block_table, req_ids, positions, width, *, skip_short_k=None,
  check=True, backend=None) -> fp32 [T, width]``: ``q_fp8`` float8_e4m3fn [T, H, d]; ``weights`` fp32
  [T, H]; ``req_ids`` int32 [T] (row -> request); ``positions`` int32 [T] (the query's own position: it
  sees history 0..positions[t]); ``width`` = the model's max length (static, never the batch max).
* ``indexer_topk(q_fp8, weights, cache, block_table, req_ids, positions, k, width, *, shortcut=True,
  check=True, backend=None) -> int32 [T, k]``: request-local positions, DESCENDING, -1 last
  (``zerodiff.ops.topk.deterministic_topk`` on the scores with lengths = positions + 1).

Numerical contract:

* ``score[t, s] = sum_h w[t, h] * relu(dot(q[t, h], code[s]) * k_scale[s])`` for ``s <= positions[t]``
  (and ``s < width``), ``-inf`` elsewhere (the reference, ``zerodiff.reference.indexer``, states it in
  float64). Kernel: codes upcast exactly to bf16, ``dot`` = ``tl.dot`` with fp32 accumulation over d in
  the kernel's fixed order, then ``* k_scale``, relu, ``* w``, and the sum over heads as one fixed-shape
  ``tl.sum`` over a head block sized from H only. One program per (query row, block of 64 history
  positions aligned to absolute positions), so a (t, s) score depends only on q[t], w[t] and key s:
  never on the batch, the other rows, Q, or prefill vs decode. Agrees with the reference to fp32
  rounding; invariance is bitwise.
* Short context: a row whose history length (positions[t] + 1, capped at width) is <= k is decided by
  that STATIC per-row bound (never the batch max length, never graph-capture state). With
  ``shortcut=True`` such rows are not scored and emit ``length-1, ..., 0, -1, ...`` directly: exactly
  what the scored path emits for them (tested). Their ``index_scores`` columns are -inf when
  ``skip_short_k`` is given.
* Top-K rule: 64-bit key (order-preserving score bits, position), ties to the larger position, NaN never
  selected (see ``zerodiff.ops.topk``).

Bad input (``InputError`` naming the argument): dtypes/shapes, slots outside the cache, positions < 0,
requests longer than the block table, table holes on a needed block, req_ids out of range, width/k
out of range. The value checks sync with the host (``check=False`` inside CUDA graphs); without them the
kernel never reads outside the cache: an unresolvable block scores NaN, which Top-K never selects.
"""

from __future__ import annotations

import torch

from .. import _triton
from .._triton import HAVE_TRITON, LAUNCH_OPTS, pick_backend
from ..reference import indexer as _ref
from ..reference.fp8_quant import quant_per_token_group_ref
from ..errors import InputError

BLOCK_S = 64
index_bytes_per_token = _ref.index_bytes_per_token

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton import cache_row_offset, cast_e4m3

    @triton.jit
    def _index_write_kernel(k_ptr, k_stride, cache_ptr, slot_ptr, BPT: tl.constexpr, D: tl.constexpr,
                            EXACT: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            gi = tl.arange(0, 1)
            di = tl.arange(0, D)
            x = tl.load(k_ptr + t * k_stride + gi[:, None] * D + di[None, :]).to(tl.float32)  # [1, D]
            amax = tl.max(tl.abs(x), axis=1)
            scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
            q = cast_e4m3(tl.div_rn(x, scale[:, None]), EXACT)
            base = cache_ptr + slot.to(tl.int64) * BPT
            tl.store(base + gi[:, None] * D + di[None, :], q.to(tl.uint8, bitcast=True))
            tl.store((base + D).to(tl.pointer_type(tl.float32)) + gi, scale)

    @triton.jit
    def _index_score_kernel(
        q_ptr, q_s0, q_s1, w_ptr, w_s0, cache_ptr, bt_ptr, bt_s0, req_ptr, pos_ptr, out_ptr, out_s0,
        H, width, num_blocks, max_blocks, short_k,
        BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr, D: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, SKIP_SHORT: tl.constexpr, EXACT: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        sb = tl.program_id(1)
        s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
        L = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, width)
        orow = out_ptr + t * out_s0
        skip = sb * BLOCK_S >= L
        if SKIP_SHORT:
            skip = skip | (L <= short_k)
        if skip:
            tl.store(orow + s, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=s < width)
        else:
            req = tl.load(req_ptr + t).to(tl.int64)
            sm = s < L
            lb = s // BLOCK_SIZE
            blk = tl.load(bt_ptr + req * bt_s0 + lb, mask=sm & (lb < max_blocks), other=-1).to(tl.int64)
            ok = sm & (blk >= 0) & (blk < num_blocks)
            # BPT (D + 4 bytes) is only a multiple of 4: see _triton.cache_row_offset
            row = cache_ptr + cache_row_offset(tl.where(ok, blk * BLOCK_SIZE + s % BLOCK_SIZE, 0), BPT)
            di = tl.arange(0, D)
            code = tl.load(row[:, None] + di[None, :], mask=ok[:, None], other=0)
            kf = code.to(tl.float8e4nv, bitcast=True)
            ksc = tl.load((row + D).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
            h = tl.arange(0, BLOCK_H)
            hm = h < H
            qc = tl.load(q_ptr + t * q_s0 + h[:, None] * q_s1 + di[None, :], mask=hm[:, None], other=0)
            qf = qc.to(tl.float8e4nv, bitcast=True)
            if EXACT:
                logits = tl.dot(qf.to(tl.float32), tl.trans(kf.to(tl.float32)))
            else:
                logits = tl.dot(qf.to(tl.bfloat16), tl.trans(kf.to(tl.bfloat16)))
            w = tl.load(w_ptr + t * w_s0 + h, mask=hm, other=0.0)
            logits = tl.maximum(logits * ksc[None, :], 0.0) * w[:, None]
            score = tl.sum(logits, axis=0)
            score = tl.where(sm, score, float("-inf"))
            score = tl.where(sm & (~ok), float("nan"), score)
            tl.store(orow + s, score, mask=s < width)


def _pick(backend, device) -> str:
    return pick_backend("zerodiff.indexer", backend, device, interpreter_default=True)


def _check_d(d: int) -> None:
    if d < 16 or d > 256 or (d & (d - 1)):
        raise InputError(f"zerodiff.indexer: index key dim d={d} must be a power of two in [16, 256]")


def _check_cache(cache, d=None) -> int:
    if cache.dtype != torch.uint8 or cache.dim() != 3 or not cache.is_contiguous():
        raise InputError(f"zerodiff.indexer: cache must be contiguous uint8 [num_blocks, block_size, d + 4], got {cache.dtype} {tuple(cache.shape)}")
    dd = cache.shape[2] - 4
    if d is not None and dd != d:
        raise InputError(f"zerodiff.indexer: cache holds {dd}-dim keys ({cache.shape[2]} bytes per token) but d={d}")
    _check_d(dd)
    return dd


def new_index_cache(num_blocks: int, block_size: int = 64, *, d: int = 128, device=None) -> torch.Tensor:
    _check_d(d)
    return torch.zeros(num_blocks, block_size, d + 4, dtype=torch.uint8, device=device)


def write_index_cache(k, cache, slot_mapping, *, check: bool = True, backend=None) -> None:
    d = _check_cache(cache)
    if k.dtype != torch.bfloat16 or k.dim() != 2 or k.shape[1] != d:
        raise InputError(f"zerodiff.indexer: k must be bf16 [T, {d}], got {k.dtype} {tuple(k.shape)}")
    T = k.shape[0]
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (T,):
        raise InputError(f"zerodiff.indexer: slot_mapping must be int64 [{T}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    nslots = cache.shape[0] * cache.shape[1]
    if check and T:
        bad = (slot_mapping < -1) | (slot_mapping >= nslots)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise InputError(f"zerodiff.indexer: slot_mapping[{i}]={int(slot_mapping[i])} outside the index cache ({nslots} slots; -1 = skip)")
    if T == 0:
        return
    if _pick(backend, cache.device) == "reference":
        _ref.write_index_cache_ref(k, cache, slot_mapping)
        return
    k = k if k.stride(1) == 1 else k.contiguous()
    _index_write_kernel[(T,)](k, k.stride(0), cache, slot_mapping, BPT=cache.shape[2], D=d,
                              EXACT=_triton.EXACT_CASTS, num_warps=1, **LAUNCH_OPTS)


def quant_index_q(q: torch.Tensor):
    """bf16 [T, H, d] -> (float8_e4m3fn [T, H, d], fp32 scale [T, H]) by the deployment FP8 rule."""
    if q.dim() != 3:
        raise InputError(f"zerodiff.indexer: q must be [T, H, d], got {tuple(q.shape)}")
    qq, s = quant_per_token_group_ref(q, q.shape[-1])
    return qq, s[..., 0]


def _check_score_args(q_fp8, weights, cache, block_table, req_ids, positions, width, check):
    d = _check_cache(cache)
    if q_fp8.dtype != torch.float8_e4m3fn or q_fp8.dim() != 3 or q_fp8.shape[2] != d:
        raise InputError(f"zerodiff.indexer: q_fp8 must be float8_e4m3fn [T, H, {d}], got {q_fp8.dtype} {tuple(q_fp8.shape)}")
    T, H, _ = q_fp8.shape
    if weights.dtype != torch.float32 or tuple(weights.shape) != (T, H):
        raise InputError(f"zerodiff.indexer: weights must be fp32 [{T}, {H}], got {weights.dtype} {tuple(weights.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise InputError(f"zerodiff.indexer: block_table must be int32 [B, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    for name, v in (("req_ids", req_ids), ("positions", positions)):
        if v.dtype != torch.int32 or tuple(v.shape) != (T,):
            raise InputError(f"zerodiff.indexer: {name} must be int32 [{T}], got {v.dtype} {tuple(v.shape)}")
    if not isinstance(width, int) or width <= 0:
        raise InputError(f"zerodiff.indexer: width={width!r} must be a positive int (the model's max length)")
    if check and T:
        B, mb = block_table.shape
        nb, bs, _ = cache.shape
        if bool(((req_ids < 0) | (req_ids >= B)).any()):
            i = int(((req_ids < 0) | (req_ids >= B)).nonzero()[0, 0])
            raise InputError(f"zerodiff.indexer: req_ids[{i}]={int(req_ids[i])} outside the block table's {B} requests")
        if bool((positions < 0).any()):
            i = int((positions < 0).nonzero()[0, 0])
            raise InputError(f"zerodiff.indexer: positions[{i}]={int(positions[i])} < 0")
        L = (positions.long() + 1).clamp(max=width)
        over = L > mb * bs
        if bool(over.any()):
            i = int(over.nonzero()[0, 0])
            raise InputError(f"zerodiff.indexer: row {i} (request {int(req_ids[i])}) needs {int(L[i])} positions but the block table holds {mb} x {bs}: request longer than the table")
        nblk = (L + bs - 1) // bs
        need = torch.arange(mb, device=positions.device)[None, :] < nblk[:, None]
        ids = block_table.long()[req_ids.long()]
        hole = need & ((ids < 0) | (ids >= nb))
        if bool(hole.any()):
            i, j = hole.nonzero()[0].tolist()
            raise InputError(f"zerodiff.indexer: block table hole: request {int(req_ids[i])} needs block {j} but the table holds {int(ids[i, j])} (valid 0..{nb - 1})")
    return d, T, H


def index_scores(q_fp8, weights, cache, block_table, req_ids, positions, width: int, *, skip_short_k=None,
                 check: bool = True, backend=None) -> torch.Tensor:
    d, T, H = _check_score_args(q_fp8, weights, cache, block_table, req_ids, positions, width, check)
    if _pick(backend, cache.device) == "reference":
        out = _ref.index_scores_ref(q_fp8.cpu(), weights.cpu(), cache.cpu(), block_table.cpu(), req_ids.cpu(),
                                    positions.cpu(), width).to(cache.device)
        if skip_short_k is not None:
            short = (positions.long() + 1).clamp(max=width) <= skip_short_k
            out[short] = float("-inf")
        return out
    out = torch.empty(T, width, dtype=torch.float32, device=cache.device)
    if T == 0:
        return out
    BLOCK_H = max(16, triton.next_power_of_2(H))
    _index_score_kernel[(T, triton.cdiv(width, BLOCK_S))](
        q_fp8.view(torch.uint8), q_fp8.stride(0), q_fp8.stride(1), weights, weights.stride(0), cache,
        block_table, block_table.stride(0), req_ids, positions, out, out.stride(0),
        H, width, cache.shape[0], block_table.shape[1], skip_short_k if skip_short_k is not None else 0,
        BLOCK_SIZE=cache.shape[1], BPT=cache.shape[2], D=d, BLOCK_H=BLOCK_H, BLOCK_S=BLOCK_S,
        SKIP_SHORT=skip_short_k is not None, EXACT=_triton.EXACT_CASTS, num_warps=4, **LAUNCH_OPTS,
    )
    return out


def _topk():
    try:
        from .topk import deterministic_topk

        return deterministic_topk
    except Exception:  # pragma: no cover - zerodiff.ops.topk not importable: the reference keeps the contract
        from ..reference.topk import deterministic_topk_ref

        return lambda s, k, lengths=None, return_scores=False, backend=None: deterministic_topk_ref(
            s, k, lengths, return_scores=return_scores)


def short_context_positions(lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``length-1, ..., 0, -1, ...`` per row (int32 [R, k]); graph-safe (no host sync)."""
    j = torch.arange(k, dtype=torch.int32, device=lengths.device)[None, :]
    L = lengths.to(torch.int32)[:, None]
    return torch.where(j < L, L - 1 - j, torch.full_like(j, -1))


def indexer_topk(q_fp8, weights, cache, block_table, req_ids, positions, k: int, width: int, *,
                 shortcut: bool = True, check: bool = True, backend=None) -> torch.Tensor:
    if not isinstance(k, int) or k <= 0:
        raise InputError(f"zerodiff.indexer: k={k!r} must be a positive int")
    which = _pick(backend, cache.device)
    scores = index_scores(q_fp8, weights, cache, block_table, req_ids, positions, width,
                          skip_short_k=k if shortcut else None, check=check, backend=which)
    lengths = (positions + 1).clamp(max=width).to(torch.int32)
    out = _topk()(scores, k, lengths, backend=which)
    if shortcut:
        short = (lengths <= k)[:, None]
        out = torch.where(short, short_context_positions(lengths, k), out)
    return out
