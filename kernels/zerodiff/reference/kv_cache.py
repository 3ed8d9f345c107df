"""Reference for the paged FP8 MLA KV cache (write = quantise + insert, read = dequantise + gather).

Byte layout of one token (``bytes_per_token(d_nope, d_rope)``; 656 bytes for DeepSeek-V3.2's 512 + 64, the
layout FlashMLA's FP8 sparse decode kernel reads when ``k_cache.shape[-1] == 656``)::

    [0, d_nope)                         d_nope float8_e4m3fn codes of the no-position ("nope") latent
    [d_nope, d_nope + 4 * G)            G = d_nope / 128 float32 scales, one per 128 nope channels
    [d_nope + 4 * G, ... + 2 * d_rope)  d_rope bfloat16 rotary channels, stored unquantised

The cache is ``uint8 [num_blocks, block_size, bytes_per_token]``; token ``p`` of request ``r`` lives in
block ``block_table[r, p // block_size]`` at row ``p % block_size``. A slot is
``block * block_size + row``.

Contract:

* write: each 128-channel group of the nope part is quantised by the rule of ``reference/fp8_quant.py``
  (scale = max(amax, 1e-10) / 448 in FP32, code = e4m3(x / scale) RNE, saturating); the rope part is
  copied bit for bit. ``slot_mapping[t] == -1`` skips token ``t``.
* read: ``bf16(float(code) * scale)`` (one FP32 multiply, one RNE rounding to BF16) for the nope part, the
  stored BF16 bits for the rope part; a workspace slot whose position is -1 is all zeros.
"""

from __future__ import annotations

import torch

from .fp8_quant import quant_per_token_group_ref

GROUP = 128


def bytes_per_token(d_nope: int = 512, d_rope: int = 64) -> int:
    return d_nope + 4 * (d_nope // GROUP) + 2 * d_rope


def quantize_kv_ref(kv_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """bf16 ``[T, d_nope]``, bf16 ``[T, d_rope]`` -> packed ``uint8 [T, bytes_per_token]``."""
    T, d_nope = kv_nope.shape
    q, scale = quant_per_token_group_ref(kv_nope, GROUP)
    rope = k_rope.to(torch.bfloat16).contiguous()
    return torch.cat(
        [q.view(torch.uint8), scale.contiguous().view(torch.uint8).reshape(T, -1), rope.view(torch.uint8).reshape(T, -1)],
        dim=1,
    )


def dequantize_kv_ref(packed: torch.Tensor, d_nope: int = 512, d_rope: int = 64) -> torch.Tensor:
    """packed ``uint8 [..., bytes_per_token]`` -> bf16 ``[..., d_nope + d_rope]``."""
    G = d_nope // GROUP
    shp = packed.shape[:-1]
    p = packed.reshape(-1, packed.shape[-1]).contiguous()
    q = p[:, :d_nope].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = p[:, d_nope : d_nope + 4 * G].contiguous().view(torch.float32)
    nope = (q.reshape(-1, G, GROUP) * scale.unsqueeze(-1)).reshape(-1, d_nope).to(torch.bfloat16)
    rope = p[:, d_nope + 4 * G : d_nope + 4 * G + 2 * d_rope].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1).reshape(*shp, d_nope + d_rope)


def write_kv_cache_ref(kv_nope, k_rope, cache, slot_mapping) -> None:
    """In place: quantise each token and store it at its slot (slot -1 = skip)."""
    nb, bs, bpt = cache.shape
    packed = quantize_kv_ref(kv_nope, k_rope)
    flat = cache.view(nb * bs, bpt)
    sel = slot_mapping >= 0
    flat[slot_mapping[sel].long()] = packed[sel]


def gather_kv_ref(cache, block_table, req_ids, positions, d_nope: int = 512, d_rope: int = 64) -> torch.Tensor:
    """Dequantise + gather: ``positions int [R, W]`` (request-local, -1 = empty) of request ``req_ids[r]``
    -> bf16 ``[R, W, d_nope + d_rope]``; empty slots are zeros. No validation (see the op)."""
    nb, bs, bpt = cache.shape
    R, W = positions.shape
    pos = positions.long()
    valid = pos >= 0
    p = pos.clamp(min=0)
    blocks = block_table.long()[req_ids.long()[:, None].expand(R, W), p // bs]
    slots = blocks.clamp(min=0) * bs + p % bs
    rows = cache.view(nb * bs, bpt)[slots.reshape(-1)]
    out = dequantize_kv_ref(rows, d_nope, d_rope).reshape(R, W, d_nope + d_rope)
    return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype))
