"""Seeded, batch-independent sampling at temperature 1 (Gumbel-max with a counter-based hash RNG).

The token sampled for request ``r`` at position ``p`` is a pure function of (its FP32 logits row, seed, r,
p): ``u[v] = (hash32(seed, r, p, v) + 0.5) / 2**32``, ``g[v] = -log(-log(u[v]))`` (float64, basic-op log of
:mod:`zerodiff.model.detmath`), token = first argmax of ``float64(logits) + g``. The hash is a 32-bit
multiply/xor-shift mixer evaluated in int64 without overflow, identical on every device. No top-k/top-p.
"""

from __future__ import annotations

import torch

from .detmath import det_log

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 in int64 without overflow."""
    hi, lo = c >> 16, c & 0xFFFF
    return ((((x * hi) & 0xFFFF) << 16) + x * lo) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def hash32(seed: int, req: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """[L, vocab] int64 hashes in [0, 2**32)."""
    dev = req.device
    s = _mix(torch.tensor(int(seed) & _M32, dtype=torch.int64, device=dev))
    a = _mix(s ^ (req.long() & _M32))
    b = _mix(a ^ _mul32(pos.long() & _M32, 0x9E3779B1))  # [L]
    v = torch.arange(vocab, dtype=torch.int64, device=dev)
    return _mix(b[:, None] ^ _mul32(v, 0x27D4EB2F)[None, :])


def sample_tokens(logits: torch.Tensor, seed: int, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """logits FP32 [L, V]; req/pos int [L] -> sampled token ids int64 [L]."""
    L, Vv = logits.shape
    if L == 0:
        return torch.zeros(0, dtype=torch.int64, device=logits.device)
    u = (hash32(seed, req, pos, Vv).double() + 0.5) * (1.0 / 4294967296.0)
    g = -det_log(-det_log(u))
    return torch.argmax(logits.double() + g, dim=1)
