"""DSA indexer adapters: the deterministic top-k for decode and prefill rows and the short-context fill."""

from __future__ import annotations

import torch


# ------------------------------------------------------------------------------------------- DSA top-k
def _decode_row_ends(seq_lens: torch.Tensor, next_n: int, num_rows: int) -> torch.Tensor:
    """Per-row candidate counts: seq_lens is (B, next_n) per row, or (B, 1) -> row j of a request sees
    ``len - next_n + 1 + j`` candidates (clamped at 0)."""
    if seq_lens.numel() == num_rows:
        ends = seq_lens.reshape(-1)
    else:
        off = torch.arange(next_n, dtype=torch.int32, device=seq_lens.device)
        ends = (seq_lens.reshape(-1, 1).to(torch.int32) - next_n + 1 + off).clamp(min=0).reshape(-1)
    return ends[:num_rows].to(torch.int32)


def _as_f32(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype == torch.float32:
        return logits if logits.stride(-1) == 1 else logits.contiguous()
    if logits.dtype in (torch.bfloat16, torch.float16):
        return logits.float()  # exact widening
    raise TypeError(f"zerodiff indexer top-k: logits must be fp32/bf16/fp16, got {logits.dtype}")


def indexer_topk_decode(logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, topk_indices: torch.Tensor,
                        topk_tokens: int, *, backend=None) -> None:
    """Replacement for ``SparseIndexerTopk.forward``: deterministic top-k of each decode row into
    ``topk_indices`` (int32 [rows, topk_tokens], written in place; position descending, -1 last)."""
    from ...ops.topk import deterministic_topk

    rows = logits.shape[0]
    if topk_indices.shape[0] < rows or topk_indices.shape[-1] != topk_tokens:
        raise ValueError(f"zerodiff indexer top-k: topk_indices {tuple(topk_indices.shape)} does not fit "
                         f"{rows} rows x topk_tokens={topk_tokens}")
    lengths = _decode_row_ends(seq_lens, next_n, rows)
    pos = deterministic_topk(_as_f32(logits), topk_tokens, lengths, backend=backend)
    topk_indices[:rows].copy_(pos)


def indexer_topk_prefill(logits: torch.Tensor, row_starts: torch.Tensor | None, row_ends: torch.Tensor,
                         topk_indices: torch.Tensor, topk_tokens: int, *, backend=None) -> None:
    """Replacement for ``ops.top_k_per_row_prefill``: row r's candidates are columns
    ``[row_starts[r], row_ends[r])``; the written positions are relative to ``row_starts[r]`` (request-local),
    position descending, -1 last."""
    from ...ops.topk import deterministic_topk

    rows = logits.shape[0]
    if rows == 0:
        return
    x = _as_f32(logits)
    ends = row_ends[:rows].to(torch.int32)
    if row_starts is None:
        lengths = ends
    else:
        starts = row_starts[:rows].to(torch.int32)
        lengths = (ends - starts).clamp(min=0)
        W = x.shape[1]
        cols = starts.to(torch.int64).unsqueeze(1) + torch.arange(W, device=x.device).unsqueeze(0)
        x = torch.gather(x, 1, cols.clamp(max=W - 1))  # columns past the row's length are never read
    pos = deterministic_topk(x, topk_tokens, lengths, backend=backend)
    topk_indices[:rows, :topk_tokens].copy_(pos)


def short_context_uses_fill(max_model_len: int, compress_ratio: int, topk_tokens: int) -> bool:
    """Static bound for the indexer's short-context shortcut: True when NO request can ever have more
    than ``topk_tokens`` compressed candidates (model limit only, never the batch's max_seq_len), so the
    fill is taken for every step, captured or eager, and the top-k never runs."""
    return int(max_model_len) // int(compress_ratio) <= int(topk_tokens)


def fill_short_context_topk(out: torch.Tensor, positions: torch.Tensor, num_tokens: int, topk_tokens: int,
                            compress_ratio: int) -> None:
    """Every candidate of each token, in the contract order: token at position p has
    ``n = (p + 1) // compress_ratio`` candidates; row = ``[n-1, n-2, ..., 0, -1, ...]`` (position descending,
    -1 last), exactly what ``deterministic_topk`` returns for a row of ``n <= topk_tokens`` finite scores.
    Precondition (guaranteed when :func:`short_context_uses_fill` is True): ``n <= topk_tokens`` per token.
    Integer math only, no host sync (CUDA-graph safe). ``out`` is viewed as ``[*, topk_tokens]``."""
    if num_tokens <= 0:
        return
    o = out.view(-1, topk_tokens)[:num_tokens]
    n = (positions[:num_tokens].to(torch.int64) + 1) // int(compress_ratio)
    j = torch.arange(topk_tokens, device=o.device, dtype=torch.int64)
    vals = n.unsqueeze(1) - 1 - j.unsqueeze(0)
    o.copy_(torch.where(vals >= 0, vals, torch.full_like(vals, -1)).to(o.dtype))


