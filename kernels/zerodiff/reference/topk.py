"""Reference deterministic Top-K (DSA indexer rows and MoE expert routing): exact integer logic.

Contract (this file defines it; ``zerodiff.ops.topk`` must give the same bits):

* Input: ``scores`` fp32 ``[R, W]``; ``lengths`` int32/int64 ``[R]`` or None (= W for every row). Only
  positions ``p < lengths[r]`` of row ``r`` are candidates; scores at or past the length never influence
  the result (whatever they hold).
  Positions are request-local column indices ``0 .. W-1``, never batch-global.
* Key of a candidate (64 bits): ``(order_preserving(score_bits) << 32) | position`` where
  ``order_preserving`` maps the fp32 bit pattern ``u`` to an unsigned 32-bit value that sorts like the
  float: ``u | 0x80000000`` for a clear sign bit, ``~u`` for a set one. Before mapping, ``-0.0`` becomes
  ``+0.0`` (the two zeros are EQUAL scores, so the position decides between them). Denormals are ordinary
  ordered values (no flush to zero). ``-inf`` is a valid candidate, the lowest score.
* NaN (any sign, any payload) is never selected: a NaN position is treated exactly like a position past
  the row's length.
* Selection: the ``min(k, n_candidates)`` largest keys. Equal scores therefore go to the LARGER position.
* Output order: selected positions sorted by position DESCENDING, then ``-1`` padding up to ``k``
  (``k`` larger than the number of candidates, ``length == 0`` or an all-NaN row all pad with -1).
* ``return_scores=True`` also returns the fp32 scores at the selected positions, bit for bit as stored in
  the input (a selected ``-0.0`` comes back as ``-0.0``), ``-inf`` on padding.
* The result of a row is a pure function of that row's first ``length`` scores, ``k`` and nothing else:
  not of the other rows, the batch size, the row's index in the batch, or W beyond the length.

Bad input (``InputError``, the message names the problem): scores not fp32, not 2-D; k not an int in
``[1, MAX_K]``; lengths not an integer tensor of shape ``[R]``, or any length < 0 or > W.
"""

from __future__ import annotations

import torch

from ..errors import InputError

#: largest k the public API accepts (DSA uses 2048; the kernel itself has no structural limit).
MAX_K = 65536
#: largest row width (positions must fit in the 32 low bits and in int32 outputs).
MAX_W = 2**30


def check_inputs(scores: torch.Tensor, k, lengths: torch.Tensor | None, check_values: bool = True) -> None:
    """Validate the public arguments; raise InputError naming the bad one."""
    if not isinstance(scores, torch.Tensor):
        raise InputError(f"deterministic_topk: scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2:
        raise InputError(f"deterministic_topk: scores must be 2-D [rows, width], got shape {tuple(scores.shape)}")
    if scores.dtype != torch.float32:
        raise InputError(f"deterministic_topk: scores must be float32, got {scores.dtype}")
    if scores.shape[1] > MAX_W:
        raise InputError(f"deterministic_topk: width {scores.shape[1]} exceeds {MAX_W}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise InputError(f"deterministic_topk: k must be a Python int, got {type(k).__name__}")
    if k < 1 or k > MAX_K:
        raise InputError(f"deterministic_topk: k={k} out of range [1, {MAX_K}]")
    if lengths is not None:
        if not isinstance(lengths, torch.Tensor):
            raise InputError("deterministic_topk: lengths must be a tensor of int32 [rows] or None")
        if lengths.dtype not in (torch.int32, torch.int64):
            raise InputError(f"deterministic_topk: lengths must be int32 (or int64), got {lengths.dtype}")
        if lengths.dim() != 1 or lengths.shape[0] != scores.shape[0]:
            raise InputError(
                f"deterministic_topk: lengths must have shape [{scores.shape[0]}], got {tuple(lengths.shape)}"
            )
        if lengths.device != scores.device:
            raise InputError(
                f"deterministic_topk: lengths on {lengths.device} but scores on {scores.device}"
            )
        if check_values and lengths.numel() > 0:
            lo, hi = int(lengths.min()), int(lengths.max())
            if lo < 0:
                raise InputError(f"deterministic_topk: negative length {lo} in lengths")
            if hi > scores.shape[1]:
                raise InputError(f"deterministic_topk: length {hi} exceeds the row width {scores.shape[1]}")


def order_preserving_bits(scores: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 in [0, 2**32): the unsigned order-preserving map of the bits, -0 mapped like +0."""
    u = scores.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    u = torch.where(u == 0x80000000, torch.zeros_like(u), u)  # -0.0 -> +0.0
    neg = (u >> 31) == 1
    return torch.where(neg, u ^ 0xFFFFFFFF, u | 0x80000000)


def deterministic_topk_ref(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None,
                           return_scores: bool = False):
    """Positions int32 [R, k] (descending, -1 padding last) [, scores fp32 [R, k]]: see module docstring."""
    check_inputs(scores, k, lengths)
    R, W = scores.shape
    dev = scores.device
    s = scores.detach().cpu()
    if lengths is None:
        L = torch.full((R,), W, dtype=torch.int64)
    else:
        L = lengths.detach().cpu().to(torch.int64)
    pos = torch.arange(W, dtype=torch.int64)
    m = order_preserving_bits(s)  # [R, W] in [0, 2**32)
    # signed 64-bit key with the same order as the unsigned (m << 32) | pos
    key = ((m - 2**31) << 32) | pos
    bits = s.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    cand = (pos[None, :] < L[:, None]) & (bits <= 0x7F800000)  # not NaN
    lowest = torch.iinfo(torch.int64).min
    key = torch.where(cand, key, torch.full_like(key, lowest))
    kk = min(k, W)
    out = torch.full((R, k), -1, dtype=torch.int64)
    if kk > 0 and R > 0:
        top = torch.sort(key, dim=1, descending=True).values[:, :kk]  # keys are unique: no tie ambiguity
        chosen = top != lowest
        p = torch.where(chosen, top & 0xFFFFFFFF, torch.full_like(top, -1))
        p = torch.sort(p, dim=1, descending=True).values  # positions descending, -1 last
        out[:, :kk] = p
    out = out.to(torch.int32)
    if not return_scores:
        return out.to(dev)
    sc = torch.full((R, k), float("-inf"), dtype=torch.float32)
    valid = out >= 0
    g = torch.gather(s, 1, out.clamp(min=0).to(torch.int64)) if W > 0 else sc
    sc = torch.where(valid, g, sc)
    return out.to(dev), sc.to(dev)
