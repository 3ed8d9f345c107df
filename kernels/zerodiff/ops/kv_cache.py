"""Paged FP8 KV cache for the MLA latent: one write kernel (quantise + insert) and one read kernel
(dequantise + gather into a BF16 workspace), shared by the rollout cache, prefill, decode and training.
The default attention read path (``zerodiff.ops.attention.sparse_mla_attention``, backend "flashmla_fp8") reads this
cache in place with FlashMLA's FP8 decode kernel; ``gather_kv`` is the read of the workspace backends.

Layout (DeepSeek-V3.2 "fp8_ds_mla", the 656-byte token FlashMLA's FP8 decode kernel reads, so the stock
kernel can read the very same cache)::

    cache: uint8 [num_blocks, block_size, bytes_per_token]      (block_size configurable, 64 by default)
    token: d_nope e4m3 codes | d_nope/128 fp32 scales | d_rope bf16      (512 | 4 x 4 B | 64 x 2 B = 656 B)

``d_nope`` must be a multiple of 128 with a power-of-two group count and ``d_rope`` a power of two; the
defaults (512, 64) are the model's, smaller values exist for the CPU interpreter tests.

Numerical contract (bit for bit the reference ``zerodiff.reference.kv_cache``):

* write: per 128-channel group of the nope latent, ``scale = max(amax, 1e-10) / 448`` (one FP32 RNE
  division), ``code = e4m3(x / scale)`` (one FP32 RNE division, RNE, saturating): the rule of
  ``reference/fp8_quant.py``. The rope channels are stored bit for bit. Each token is processed alone,
  so the stored bytes never depend on which other tokens are written in the same call.
* read: workspace value = ``bf16(float(code) * scale)`` (one FP32 multiply, one RNE rounding), rope bits
  copied. Every workspace row depends only on (cache bytes at that request's position): never on the
  query row, the batch, the slot inside the workspace or prefill vs decode. Empty slots (position -1) are
  zeros. A slot whose block cannot be resolved (table hole, position past the table) is filled with NaN
  by the kernel, so a skipped host check still fails loudly downstream instead of reading foreign memory.

Public API:

* ``bytes_per_token(d_nope=512, d_rope=64) -> int``
* ``new_kv_cache(num_blocks, block_size=64, *, d_nope=512, d_rope=64, device=None) -> uint8 tensor``
* ``write_kv_cache(kv_nope, k_rope, cache, slot_mapping, *, d_nope=512, d_rope=64, check=True, backend=None)``
  in place; ``kv_nope`` bf16 [T, d_nope], ``k_rope`` bf16 [T, d_rope], ``slot_mapping`` int64 [T]
  (-1 = skip).
* ``gather_kv(cache, block_table, req_ids, positions, *, seq_lens=None, d_nope=512, d_rope=64, out=None,
  check=True, backend=None) -> bf16 [R, W, d_nope + d_rope]``; ``block_table`` int32 [B, max_blocks]
  (-1 = hole), ``req_ids`` int32 [R] (row -> request), ``positions`` int32 [R, W] request-local, -1 =
  empty. ``W`` is chosen by the caller from model limits (max top-k plus window), never from the batch.
* ``workspace_indices(positions) -> int32 [R, W]``: index of row r's slot j in ``out.view(R * W, d)``
  (``r * W + j``), -1 where the position is -1; the index list ``sparse_attention`` takes.

Bad input (``InputError`` naming the argument): wrong dtypes / shapes / layout sizes, slots outside the
cache, positions < -1, positions past the block table ("request longer than the table"), holes (-1 or
out-of-range block ids) where a needed block is missing, positions >= ``seq_lens[req]`` when given,
request ids out of range. Shape/dtype checks are free; the value checks (``check=True``) cost one
device->host sync each call and must be switched off (``check=False``) inside CUDA-graph capture, where
the kernel's NaN poisoning is the remaining guard.
"""

from __future__ import annotations

import torch

from .. import _triton
from .._triton import HAVE_TRITON, LAUNCH_OPTS, pick_backend
from ..reference import kv_cache as _ref
from ..errors import InputError

GROUP = 128
FP8_MAX = 448.0
EPS = 1e-10
bytes_per_token = _ref.bytes_per_token

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .block_slots import resolve_slots

    from .._triton import cache_row_offset, cast_bf16, cast_e4m3

    @triton.jit
    def _kv_write_kernel(
        x_ptr, x_stride, r_ptr, r_stride, cache_ptr, slot_ptr,
        BPT: tl.constexpr, D_NOPE: tl.constexpr, G: tl.constexpr, D_ROPE: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            gi = tl.arange(0, G)
            ci = tl.arange(0, 128)
            x = tl.load(x_ptr + t * x_stride + gi[:, None] * 128 + ci[None, :]).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
            q = cast_e4m3(tl.div_rn(x, scale[:, None]), EXACT)
            base = cache_ptr + slot.to(tl.int64) * BPT
            tl.store(base + gi[:, None] * 128 + ci[None, :], q.to(tl.uint8, bitcast=True))
            tl.store((base + D_NOPE).to(tl.pointer_type(tl.float32)) + gi, scale)
            ri = tl.arange(0, D_ROPE)
            rope = tl.load(r_ptr + t * r_stride + ri)
            tl.store((base + D_NOPE + 4 * G).to(tl.pointer_type(tl.bfloat16)) + ri, rope)

    @triton.jit
    def _kv_gather_kernel(
        cache_ptr, bt_ptr, bt_stride, req_ptr, pos_ptr, pos_stride, out_ptr,
        W, num_blocks, max_blocks,
        BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr, D_NOPE: tl.constexpr, G: tl.constexpr,
        D_ROPE: tl.constexpr, BLOCK_W: tl.constexpr, EXACT: tl.constexpr,
    ):
        r = tl.program_id(0)
        wb = tl.program_id(1)
        j = wb * BLOCK_W + tl.arange(0, BLOCK_W)
        jm = j < W
        req = tl.load(req_ptr + r).to(tl.int64)
        pos = tl.load(pos_ptr + r * pos_stride + j, mask=jm, other=-1).to(tl.int64)
        slot, ok, valid = resolve_slots(bt_ptr, bt_stride, req, pos, num_blocks, max_blocks, BLOCK_SIZE)
        bad = valid & (~ok)
        row = tl.where(ok, slot, 0)
        base = cache_ptr + cache_row_offset(row, BPT)  # [BLOCK_W]
        D: tl.constexpr = D_NOPE + D_ROPE
        obase = out_ptr + (r.to(tl.int64) * W + j.to(tl.int64)) * D  # [BLOCK_W]
        gi = tl.arange(0, G)
        ci = tl.arange(0, 128)
        off = gi[None, :, None] * 128 + ci[None, None, :]  # [1, G, 128]
        ok3 = ok[:, None, None]
        code = tl.load(base[:, None, None] + off, mask=ok3 & (off >= 0), other=0)
        qf = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = tl.load((base[:, None] + D_NOPE).to(tl.pointer_type(tl.float32)) + gi[None, :], mask=ok[:, None] & (gi[None, :] >= 0), other=0.0)
        v = cast_bf16(qf * sc[:, :, None], EXACT)
        nanb = tl.full([1, 1, 1], float("nan"), tl.float32).to(tl.bfloat16)
        v = tl.where(bad[:, None, None], nanb, v)
        tl.store(obase[:, None, None] + off, v, mask=jm[:, None, None] & (off >= 0))
        ri = tl.arange(0, D_ROPE)
        rm = ok[:, None] & (ri[None, :] >= 0)
        rope = tl.load((base[:, None] + D_NOPE + 4 * G).to(tl.pointer_type(tl.bfloat16)) + ri[None, :], mask=rm, other=0.0)
        nanr = tl.full(rope.shape, float("nan"), tl.float32).to(tl.bfloat16)
        rope = tl.where(bad[:, None], nanr, rope)
        tl.store(obase[:, None] + D_NOPE + ri[None, :], rope, mask=jm[:, None] & (ri[None, :] >= 0))


def _check_dims(d_nope: int, d_rope: int) -> int:
    G = d_nope // GROUP
    if d_nope <= 0 or d_nope % GROUP or (G & (G - 1)):
        raise InputError(f"zerodiff.kv_cache: d_nope={d_nope} must be 128 x a power of two")
    if d_rope <= 0 or (d_rope & (d_rope - 1)):
        raise InputError(f"zerodiff.kv_cache: d_rope={d_rope} must be a power of two")
    return G


def _check_cache(cache: torch.Tensor, d_nope: int, d_rope: int) -> None:
    bpt = bytes_per_token(d_nope, d_rope)
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != bpt:
        raise InputError(
            f"zerodiff.kv_cache: cache must be uint8 [num_blocks, block_size, {bpt}] for d_nope={d_nope}, "
            f"d_rope={d_rope}; got {cache.dtype} {tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise InputError("zerodiff.kv_cache: cache must be contiguous")


def _pick(backend, device) -> str:
    return pick_backend("zerodiff.kv_cache", backend, device, interpreter_default=True)


def new_kv_cache(num_blocks: int, block_size: int = 64, *, d_nope: int = 512, d_rope: int = 64, device=None):
    _check_dims(d_nope, d_rope)
    if block_size <= 0:
        raise InputError(f"zerodiff.kv_cache: block_size={block_size} must be positive")
    return torch.zeros(num_blocks, block_size, bytes_per_token(d_nope, d_rope), dtype=torch.uint8, device=device)


def write_kv_cache(kv_nope, k_rope, cache, slot_mapping, *, d_nope: int = 512, d_rope: int = 64,
                   check: bool = True, backend=None) -> None:
    G = _check_dims(d_nope, d_rope)
    _check_cache(cache, d_nope, d_rope)
    T = kv_nope.shape[0] if kv_nope.dim() == 2 else -1
    if kv_nope.dtype != torch.bfloat16 or kv_nope.dim() != 2 or kv_nope.shape[1] != d_nope:
        raise InputError(f"zerodiff.kv_cache: kv_nope must be bf16 [T, {d_nope}], got {kv_nope.dtype} {tuple(kv_nope.shape)}")
    if k_rope.dtype != torch.bfloat16 or tuple(k_rope.shape) != (T, d_rope):
        raise InputError(f"zerodiff.kv_cache: k_rope must be bf16 [{T}, {d_rope}], got {k_rope.dtype} {tuple(k_rope.shape)}")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (T,):
        raise InputError(f"zerodiff.kv_cache: slot_mapping must be int64 [{T}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    nslots = cache.shape[0] * cache.shape[1]
    if check and T > 0:
        bad = (slot_mapping < -1) | (slot_mapping >= nslots)
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            raise InputError(
                f"zerodiff.kv_cache: slot_mapping[{t}]={int(slot_mapping[t])} outside the cache "
                f"({nslots} slots = {cache.shape[0]} blocks x {cache.shape[1]}; -1 = skip)"
            )
    if T == 0:
        return
    if _pick(backend, cache.device) == "reference":
        _ref.write_kv_cache_ref(kv_nope, k_rope, cache, slot_mapping)
        return
    kv_nope = kv_nope if kv_nope.stride(1) == 1 else kv_nope.contiguous()
    k_rope = k_rope if k_rope.stride(1) == 1 else k_rope.contiguous()
    _kv_write_kernel[(T,)](
        kv_nope, kv_nope.stride(0), k_rope, k_rope.stride(0), cache, slot_mapping,
        BPT=cache.shape[2], D_NOPE=d_nope, G=G, D_ROPE=d_rope, EXACT=_triton.EXACT_CASTS,
        num_warps=4, **LAUNCH_OPTS,
    )


def _check_gather_values(cache, block_table, req_ids, positions, seq_lens) -> None:
    nb, bs, _ = cache.shape
    B, max_blocks = block_table.shape
    if req_ids.numel() and bool(((req_ids < 0) | (req_ids >= B)).any()):
        r = int(((req_ids < 0) | (req_ids >= B)).nonzero()[0, 0])
        raise InputError(f"zerodiff.kv_cache: req_ids[{r}]={int(req_ids[r])} outside the block table's {B} requests")
    if positions.numel() == 0:
        return
    pos = positions.long()
    if bool((pos < -1).any()):
        r, j = (pos < -1).nonzero()[0].tolist()
        raise InputError(f"zerodiff.kv_cache: positions[{r}, {j}]={int(pos[r, j])} < -1 (-1 is the only empty marker)")
    valid = pos >= 0
    over = valid & (pos >= max_blocks * bs)
    if bool(over.any()):
        r, j = over.nonzero()[0].tolist()
        raise InputError(
            f"zerodiff.kv_cache: positions[{r}, {j}]={int(pos[r, j])} is past the block table of request "
            f"{int(req_ids[r])} ({max_blocks} blocks x {bs} = {max_blocks * bs} positions): request longer than the table"
        )
    if seq_lens is not None:
        lens = seq_lens.long()[req_ids.long()][:, None]
        beyond = valid & (pos >= lens)
        if bool(beyond.any()):
            r, j = beyond.nonzero()[0].tolist()
            raise InputError(
                f"zerodiff.kv_cache: positions[{r}, {j}]={int(pos[r, j])} >= seq_lens[{int(req_ids[r])}]="
                f"{int(seq_lens[req_ids[r]])}: out-of-range position"
            )
    blk = block_table.long()[req_ids.long()[:, None].expand_as(pos), (pos.clamp(min=0) // bs)]
    hole = valid & ((blk < 0) | (blk >= nb))
    if bool(hole.any()):
        r, j = hole.nonzero()[0].tolist()
        raise InputError(
            f"zerodiff.kv_cache: block table hole: request {int(req_ids[r])} needs block "
            f"{int(pos[r, j]) // bs} (position {int(pos[r, j])}, positions[{r}, {j}]) but the table holds "
            f"{int(blk[r, j])} (valid ids 0..{nb - 1})"
        )


def gather_kv(cache, block_table, req_ids, positions, *, seq_lens=None, d_nope: int = 512, d_rope: int = 64,
              out=None, check: bool = True, backend=None) -> torch.Tensor:
    G = _check_dims(d_nope, d_rope)
    _check_cache(cache, d_nope, d_rope)
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise InputError(f"zerodiff.kv_cache: block_table must be int32 [B, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    if positions.dtype != torch.int32 or positions.dim() != 2:
        raise InputError(f"zerodiff.kv_cache: positions must be int32 [R, W], got {positions.dtype} {tuple(positions.shape)}")
    R, W = positions.shape
    if req_ids.dtype != torch.int32 or tuple(req_ids.shape) != (R,):
        raise InputError(f"zerodiff.kv_cache: req_ids must be int32 [{R}], got {req_ids.dtype} {tuple(req_ids.shape)}")
    if seq_lens is not None and (seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]):
        raise InputError(f"zerodiff.kv_cache: seq_lens must be [{block_table.shape[0]}], got {tuple(seq_lens.shape)}")
    D = d_nope + d_rope
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (R, W, D) or not out.is_contiguous()):
        raise InputError(f"zerodiff.kv_cache: out must be contiguous bf16 [{R}, {W}, {D}], got {out.dtype} {tuple(out.shape)}")
    if check:
        _check_gather_values(cache, block_table, req_ids, positions, seq_lens)
    if _pick(backend, cache.device) == "reference":
        res = _ref.gather_kv_ref(cache, block_table, req_ids, positions, d_nope, d_rope)
        if out is not None:
            out.copy_(res)
            return out
        return res
    if out is None:
        out = torch.empty(R, W, D, dtype=torch.bfloat16, device=cache.device)
    if R == 0 or W == 0:
        return out
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    positions = positions if positions.stride(1) == 1 else positions.contiguous()
    BLOCK_W = 16
    _kv_gather_kernel[(R, triton.cdiv(W, BLOCK_W))](
        cache, block_table, block_table.stride(0), req_ids, positions, positions.stride(0), out,
        W, cache.shape[0], block_table.shape[1],
        BLOCK_SIZE=cache.shape[1], BPT=cache.shape[2], D_NOPE=d_nope, G=G, D_ROPE=d_rope,
        BLOCK_W=BLOCK_W, EXACT=_triton.EXACT_CASTS, num_warps=8, **LAUNCH_OPTS,
    )
    return out


def workspace_indices(positions: torch.Tensor) -> torch.Tensor:
    """Row r's slot j of a gathered workspace ``[R, W, d]`` is row ``r * W + j`` of its ``[R * W, d]`` view."""
    R, W = positions.shape
    base = torch.arange(R, device=positions.device, dtype=torch.int32)[:, None] * W
    idx = base + torch.arange(W, device=positions.device, dtype=torch.int32)[None, :]
    return torch.where(positions >= 0, idx, torch.full_like(idx, -1))

