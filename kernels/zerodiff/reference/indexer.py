"""Reference for the DSA lightning indexer: FP8 index-key cache, per-query scoring of the history, Top-K.

Index-key cache (its own paged cache, separate from the MLA KV cache): ``uint8 [num_blocks, block_size,
d + 4]``; token = ``d`` float8_e4m3fn codes of the index key, then ONE fp32 scale for the whole key, by
the rule of ``reference/fp8_quant.py`` with group = d (scale = max(amax, 1e-10) / 448; code =
e4m3(k / scale) RNE, saturating). Token ``p`` of request ``r`` is at block ``block_table[r, p // bs]``.

Score of query row ``t`` (request ``req_ids[t]``, own position ``positions[t]``) for history position s::

    score[t, s] = sum_h  weights[t, h] * relu( (q[t, h, :] . code[s, :]) * k_scale[s] )

``q`` is float8_e4m3fn ``[T, H, d]`` (its per-(token, head) scale, the softmax scale and any head scale are
folded into ``weights`` fp32 ``[T, H]`` by the caller, as in DeepSeek-V3.2/V4 and DeepGEMM's
``fp8_mqa_logits``). Causal: only ``s <= positions[t]`` are scored (length = positions[t] + 1, capped at
the static width W = model max length); every other column is ``-inf``.

This reference computes the dot products exactly in float64 (e4m3 x e4m3 products and their sum over
d <= 256 are exact there), applies the scale, relu and the head sum in float64 and rounds once to fp32;
the Triton kernel agrees to fp32 rounding. Selection is ``zerodiff.reference.topk`` with
``lengths = positions + 1``: request-local positions, ties to the larger position, sorted DESCENDING,
-1 padding last. The short-context rule (length <= k: all positions ``length-1 .. 0`` then -1) is exactly
what that selection emits for such a row, whatever the scores.
"""

from __future__ import annotations

import torch

from .fp8_quant import quant_per_token_group_ref


def index_bytes_per_token(d: int = 128) -> int:
    return d + 4


def quantize_index_k_ref(k: torch.Tensor) -> torch.Tensor:
    """bf16 ``[T, d]`` -> packed ``uint8 [T, d + 4]``."""
    T, d = k.shape
    q, s = quant_per_token_group_ref(k, d)
    return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8).reshape(T, 4)], dim=1)


def write_index_cache_ref(k, cache, slot_mapping) -> None:
    nb, bs, bpt = cache.shape
    flat = cache.view(nb * bs, bpt)
    sel = slot_mapping >= 0
    flat[slot_mapping[sel].long()] = quantize_index_k_ref(k)[sel]


def read_index_keys_ref(cache, block_table, req: int, length: int, d: int):
    """(codes fp64 [length, d], scales fp64 [length]) of request ``req``'s first ``length`` tokens."""
    nb, bs, bpt = cache.shape
    p = torch.arange(length)
    slots = block_table[req].long()[p // bs] * bs + p % bs
    rows = cache.view(nb * bs, bpt)[slots]
    codes = rows[:, :d].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
    scales = rows[:, d : d + 4].contiguous().view(torch.float32).reshape(-1).to(torch.float64)
    return codes, scales


def index_scores_ref(q_fp8, weights, cache, block_table, req_ids, positions, width: int) -> torch.Tensor:
    T, H, d = q_fp8.shape
    out = torch.full((T, width), float("-inf"), dtype=torch.float32)
    for t in range(T):
        L = min(int(positions[t]) + 1, width)
        if L <= 0:
            continue
        codes, scales = read_index_keys_ref(cache, block_table, int(req_ids[t]), L, d)
        logits = (q_fp8[t].to(torch.float64) @ codes.T) * scales[None, :]  # [H, L]
        s = (weights[t].to(torch.float64)[:, None] * logits.clamp(min=0)).sum(0)
        out[t, :L] = s.to(torch.float32)
    return out


def short_context_positions_ref(lengths: torch.Tensor, k: int) -> torch.Tensor:
    """What the selection emits for a row of length <= k: ``length-1, ..., 0, -1, ...``."""
    j = torch.arange(k, dtype=torch.int64)[None, :]
    L = lengths.long()[:, None]
    return torch.where(j < L, L - 1 - j, torch.full_like(j, -1)).to(torch.int32)


def indexer_topk_ref(q_fp8, weights, cache, block_table, req_ids, positions, k: int, width: int):
    from .topk import deterministic_topk_ref

    scores = index_scores_ref(q_fp8, weights, cache, block_table, req_ids, positions, width)
    lengths = (positions.long() + 1).clamp(0, width).to(torch.int32)
    return deterministic_topk_ref(scores, k, lengths)
