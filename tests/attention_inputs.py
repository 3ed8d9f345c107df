"""Inputs shared by the sparse attention tests: small-dims paged FP8 caches with per-request block tables, causal
index lists, the split kernel's adversarial rows, and the model-shape GPU setup (with prefill rows' index lists)."""

import pytest
import torch
from bitwise import bits

from zerodiff.ops import kv_cache as kc

#: the small latent dims the CPU interpreter tests run (d_qk 144, d_v 128)
SMALL = dict(d_nope=128, d_rope=16)
#: the read through the split kernel at the small dims
SPLIT = dict(**SMALL, backend="triton_fp8_split")
#: GPU tests: heads and index-list width at the model shape
GPU_H, GPU_TOPK = 64, 2048


def same_bits(a, b):
    return torch.equal(bits(a[0]), bits(b[0])) and torch.equal(bits(a[1]), bits(b[1]))


def causal_positions(g, L, W, *, start=0):
    """Per token t of a request of length L: up to W distinct history positions <= t, descending, -1 last."""
    pos = torch.full((L, W), -1, dtype=torch.int32)
    for t in range(L):
        k = min(t + 1, W)
        sel = torch.randperm(t + 1, generator=g)[:k].sort(descending=True).values
        pos[t, :k] = sel.to(torch.int32)
    return pos


def paged_layout(g, lens, bs, nb):
    """Per-request block tables over ``nb`` shuffled blocks of ``bs`` slots (-1 past a request's last block) and the
    cache slot of every token, requests one after another."""
    B = len(lens)
    max_blocks = max((L + bs - 1) // bs for L in lens)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    bt = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used, slots = 0, []
    for b, L in enumerate(lens):
        n = (L + bs - 1) // bs
        bt[b, :n] = perm[used : used + n]
        used += n
        slots += [int(bt[b, p // bs]) * bs + p % bs for p in range(L)]
    return bt, slots


def small_cache(g, lens, dims, bs=8, nb=None):
    d_nope, d_rope = dims["d_nope"], dims["d_rope"]
    nb = nb or sum((L + bs - 1) // bs for L in lens) + 3
    bt, slots = paged_layout(g, lens, bs, nb)
    T = len(slots)
    x = (torch.randn(T, d_nope, generator=g) * 2).to(torch.bfloat16)
    rope = torch.randn(T, d_rope, generator=g).to(torch.bfloat16)
    cache = kc.new_kv_cache(nb, bs, **dims)
    kc.write_kv_cache(x, rope, cache, torch.tensor(slots, dtype=torch.int64), **dims, backend="reference")
    return cache, bt


def split_inputs(g, lens=(90, 45), W=72, H=16, adversarial=True):
    """Small-dims cache + per-row positions crossing the small config's chunk boundaries (CHUNK=32)."""
    cache, bt = small_cache(g, list(lens), SMALL)
    pos = torch.cat([causal_positions(g, L, W) for L in lens])
    req = torch.cat([torch.full((L,), b, dtype=torch.int32) for b, L in enumerate(lens)])
    q = torch.randn(len(req), H, 144, generator=g).to(torch.bfloat16)
    if adversarial:
        q[:, 0, :8] = -0.0  # signed zeros
        q[:, 1, 8:16] = 1e-40  # denormals (flushed or not, the same kernel decides for every phase)
        q[:, 2] = q[:, 3]  # two heads with identical scores (ties)
    return cache, bt, pos, req, q


def gpu_setup(B, ctx, topk=GPU_TOPK, seed=0, bs=64):
    dev = "cuda"
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = (ctx + bs - 1) // bs
    nb = B * nblk + 2
    perm = torch.randperm(nb, generator=g)[: B * nblk].to(torch.int32)
    bt = perm.reshape(B, nblk).to(dev)
    cache = kc.new_kv_cache(nb, bs, device=dev)
    T = B * ctx
    x = (torch.randn(T, 512, generator=g) * 3).to(torch.bfloat16).to(dev)
    rope = torch.randn(T, 64, generator=g).to(torch.bfloat16).to(dev)
    p = torch.arange(ctx).repeat(B)
    b = torch.arange(B).repeat_interleave(ctx)
    slots = (bt.cpu().long()[b, p // bs] * bs + p % bs).to(dev)
    kc.write_kv_cache(x, rope, cache, slots)
    pos = torch.stack([torch.randperm(ctx, generator=g)[:topk].sort(descending=True).values for _ in range(B)])
    pos = pos.to(torch.int32).to(dev)
    q = (torch.randn(B, GPU_H, 576, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    return cache, bt, pos, q


def prefill_positions(base, ctx, T):
    """The index lists of the last ``T`` tokens of one ``ctx``-token request as prefill rows, from ``base`` (the last
    token's list, width GPU_TOPK, descending): row t drops the positions past its own token and keeps the order."""
    lim = ctx - T + torch.arange(T, device=base.device)
    skip = (base[None, :] > lim[:, None]).sum(1)
    j = torch.arange(GPU_TOPK, device=base.device)[None, :] + skip[:, None]
    return torch.where(j < GPU_TOPK, base[j.clamp(max=GPU_TOPK - 1)], torch.full_like(j, -1)).to(torch.int32)


def need_flashmla():
    from zerodiff import backends

    if backends.flash_mla() is None:
        pytest.skip(f"FlashMLA not importable: {backends.status()['flashmla']['detail']}")
    return backends.flash_mla()
