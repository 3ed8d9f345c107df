"""Test helpers shared by the FlashMLA fixed-schedule tests: a CPU emulation of FlashMLA's FP8 sparse decode
kernel contract (``sparse_decode_fwd``), and a valid DeepSeek-V4 FP8 cache with its float64 dequantisation."""

import math

import torch

from zerodiff.ops.attention import flashmla_fp8 as fd
from zerodiff.ops import kv_cache as kvc


class EmulatedDecodeKernel:
    """FlashMLA's ``sparse_decode_fwd`` contract, emulated on the CPU for the V3.2 layout: it reads OUR schedule
    table (``schedule_pieces``), refuses anything but whole rows, covers every (row, piece) exactly once or raises,
    and computes each piece over its blocks in list order (main list, then the extra list) in float64. Lets CI test
    the wrapper's plumbing (translation, launches, pieces, merge, lse copy, NaN rows, lengths, extra cache)."""

    def __init__(self, parts):
        self.parts = parts
        self.launches = []

    def __call__(self, q, kcache, idx, topk_length, sink, meta, splits, extra_kv, extra_idx, extra_tl, d_v, scale,
                 out, batch_invariant):
        from zerodiff.reference.kv_cache import dequantize_kv_ref

        n, S, H, D = q.shape
        if meta is None:  # the probe call
            return out, None, torch.zeros(self.parts, fd.META_FIELDS, dtype=torch.int32), torch.zeros(n + 1)
        assert meta.shape == (self.parts, fd.META_FIELDS) and meta.dtype == torch.int32
        self.launches.append(n)
        def deq(c):
            return dequant_v4(c) if c.shape[-1] == 584 else dequantize_kv_ref(c.view(-1, c.shape[-1])).double()

        kv = deq(kcache)
        ekv = None if extra_kv is None else deq(extra_kv)
        K = idx.shape[2]
        counts = fd.row_block_counts(n, K, topk_length, 0 if extra_idx is None else extra_idx.shape[2], extra_tl)
        seen = set()
        lse = torch.empty(n, S, H, dtype=torch.float32)
        if out is None:
            out = torch.empty(n, S, H, d_v, dtype=torch.bfloat16)
        for _cta, r, start, end, no_split, _slot in fd.schedule_pieces(meta, splits, n, counts.tolist()):
            assert no_split and start == 0 and end == int(counts[r]), (r, start, end, no_split)
            for sp in range(S):
                assert (r, sp) not in seen, "a (row, piece) scheduled twice"
                seen.add((r, sp))
                L = K if topk_length is None else int(topk_length[r])
                ent = [kv[int(i)] for i in idx[r, sp, :min(L, K)].tolist() if i >= 0]
                if extra_idx is not None:
                    EL = extra_idx.shape[2] if extra_tl is None else int(extra_tl[r])
                    ent += [ekv[int(i)] for i in extra_idx[r, sp, :EL].tolist() if i >= 0]
                qd = q[r, sp].double()
                if not ent:
                    out[r, sp] = 0
                    lse[r, sp] = math.inf
                    continue
                kvr = torch.stack(ent)
                sc_ = (qd @ kvr.T) * scale
                l_ = torch.logsumexp(sc_, dim=-1)
                o_ = torch.softmax(sc_, dim=-1) @ kvr[:, :d_v]
                if sink is not None:
                    o_ = o_ / (1 + torch.exp(sink.double() - l_))[:, None]
                out[r, sp] = o_.to(torch.bfloat16)
                lse[r, sp] = l_.float()
        assert len(seen) == n * S, "some (row, piece) was never scheduled"
        return out, lse.transpose(1, 2), meta, splits


def dequant_v4(cache):
    """DeepSeek-V4 cache [nb, bs, 1, 584] -> float64 [nb * bs, 512]: per page block, bs data rows (448 e4m3 + 64
    bf16) then bs scale rows (7 e8m0 + 1 pad); value = e4m3 * 2^(e8m0 - 127) per 64 channels, rope as stored."""
    nb, bs = cache.shape[:2]
    raw = cache.reshape(nb, bs * 584)
    data = raw[:, : bs * 576].reshape(nb * bs, 576)
    e = raw[:, bs * 576:].reshape(nb * bs, 8)[:, :7].long()
    nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).double().view(-1, 7, 64)
    nope = (nope * torch.pow(2.0, (e - 127).double())[..., None]).view(-1, 448)
    return torch.cat([nope, data[:, 448:].contiguous().view(torch.bfloat16).double()], 1)


def install_emulation(monkeypatch, parts=7):
    kern = EmulatedDecodeKernel(parts)
    # the emulated kernel stands in for FlashMLA's on any device (CPU included)
    monkeypatch.setattr(fd, "decode_kernel", lambda device: (None, kern))
    monkeypatch.setattr(fd, "num_sm_parts", lambda h, d=576, pieces=1, device=None: parts)
    monkeypatch.setattr(fd, "MAX_PAIRS_PER_LAUNCH", 12)  # several launches even for small tests
    return kern


def v4_cache(nb, bs, seed):
    """A valid DeepSeek-V4 FP8 cache (per page block: bs data rows of 448 e4m3 + 64 bf16, then bs rows of 7 e8m0
    scales + 1 pad byte) and its float64 dequantisation [nb * bs, 512]."""
    g = torch.Generator().manual_seed(seed)
    n = nb * bs
    nope = (torch.randn(n, 448, generator=g) * 2).to(torch.float8_e4m3fn)
    nope.view(torch.uint8)[::53, ::9] = 0  # zeros
    rope = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    e = torch.randint(122, 131, (n, 7), generator=g, dtype=torch.int32)
    raw = torch.zeros(nb, bs * 584, dtype=torch.uint8)
    data = raw[:, : bs * 576].view(nb, bs, 576)
    data[:, :, :448] = nope.view(torch.uint8).view(nb, bs, 448)
    data[:, :, 448:] = rope.view(torch.uint8).view(nb, bs, 128)
    scales = raw[:, bs * 576:].view(nb, bs, 8)
    scales[:, :, :7] = e.to(torch.uint8).view(nb, bs, 7)
    deq = torch.cat([(nope.double().view(n, 7, 64) * torch.pow(2.0, (e - 127).double())[..., None]).view(n, 448),
                     rope.double()], 1)
    return raw.view(nb, bs, 1, 584), deq


def request_cache(g, lens, bs=8):
    """A paged V3.2-layout FP8 cache holding requests of the given lengths: (cache, block_table)."""
    nb = sum(-(-L // bs) for L in lens) + 3
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    mb = max(-(-L // bs) for L in lens)
    bt = torch.full((len(lens), mb), -1, dtype=torch.int32)
    used, slots = 0, []
    for b, L in enumerate(lens):
        n = -(-L // bs)
        bt[b, :n] = perm[used:used + n]
        used += n
        slots += [int(bt[b, p // bs]) * bs + p % bs for p in range(L)]
    x = (torch.randn(len(slots), 512, generator=g) * 2).to(torch.bfloat16)
    rope = torch.randn(len(slots), 64, generator=g).to(torch.bfloat16)
    cache = kvc.new_kv_cache(nb, bs)
    kvc.write_kv_cache(x, rope, cache, torch.tensor(slots, dtype=torch.int64), backend="reference")
    return cache, bt
