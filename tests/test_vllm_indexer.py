"""The DSA indexer top-k adapters (``zerodiff.integrations.vllm.indexer``) on CPU tensors: decode and prefill
layouts give the contract order of ``deterministic_topk``, a row's result does not depend on the batch, and the
short-context fill lists every candidate in the contract order."""

from __future__ import annotations

import torch

from zerodiff.integrations import vllm as zv
from zerodiff.reference.topk import deterministic_topk_ref


def _tied_rows(g, n, w):
    x = torch.randint(-6, 6, (n, w), generator=g).float() / 4  # many exact ties
    x[0, :5] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0])  # +-0 ties
    x[1, 3] = 1e-40  # denormal
    return x


def test_indexer_topk_decode_and_prefill_layouts(seeded):
    g = seeded()
    k, w = 16, 96
    x = _tied_rows(g, 7, w)
    lens = torch.randint(0, w + 1, (7,), generator=g, dtype=torch.int32)
    lens[2] = 5  # shorter than k
    ref = deterministic_topk_ref(x, k, lens)
    # decode: seq_lens (B, 1), next_n = 1; output written in place into a wider buffer
    buf = torch.full((9, k), 99, dtype=torch.int32)
    zv.indexer_topk_decode(x, lens.view(7, 1), 1, buf, k)
    assert torch.equal(buf[:7], ref) and (buf[7:] == 99).all()
    # decode with next_n = 2: (B, 1) request lengths -> rows len-1, len
    req = torch.tensor([10, 40], dtype=torch.int32)
    out = torch.empty((4, k), dtype=torch.int32)
    zv.indexer_topk_decode(x[:4], req.view(2, 1), 2, out, k)
    assert torch.equal(out, deterministic_topk_ref(x[:4], k, torch.tensor([9, 10, 39, 40], dtype=torch.int32)))
    # prefill, row_starts None: same as decode
    pre = torch.empty((7, k), dtype=torch.int32)
    zv.indexer_topk_prefill(x, None, lens, pre, k)
    assert torch.equal(pre, ref)
    # prefill with per-row starts: request-local positions (relative to the start)
    starts = torch.tensor([0, 3, 1, 7, 0, 2, 5], dtype=torch.int32)
    wide = torch.full((7, w + 8), float("nan"))
    for r in range(7):
        wide[r, starts[r]: starts[r] + w] = x[r]
    pre2 = torch.empty((7, k), dtype=torch.int32)
    zv.indexer_topk_prefill(wide, starts, starts + lens, pre2, k)
    assert torch.equal(pre2, ref)
    # bf16 logits widen exactly
    xb = x.to(torch.bfloat16)
    zv.indexer_topk_decode(xb, lens.view(7, 1), 1, buf, k)
    assert torch.equal(buf[:7], deterministic_topk_ref(xb.float(), k, lens))
    # negative control: torch.topk's order (score-major) is not the contract order
    stock = x[:, :w].topk(k, dim=-1).indices.to(torch.int32)
    full = deterministic_topk_ref(x, k, torch.full((7,), w, dtype=torch.int32))
    assert not torch.equal(stock, full)


def test_indexer_topk_victim_in_batch(seeded):
    g = seeded()
    k, w = 8, 64
    victim = _tied_rows(g, 2, w)[:1]
    vlen = torch.tensor([50], dtype=torch.int32)
    alone = torch.empty((1, k), dtype=torch.int32)
    zv.indexer_topk_decode(victim, vlen.view(1, 1), 1, alone, k)
    for rnd in range(2):
        for batch in (2, 15, 17, 33, 65):
            for where in (0, batch // 2, batch - 1):
                x = _tied_rows(g, batch, w)
                lens = torch.randint(0, w + 1, (batch,), generator=g, dtype=torch.int32)
                x[where], lens[where] = victim[0], vlen[0]
                out = torch.empty((batch, k), dtype=torch.int32)
                zv.indexer_topk_decode(x, lens.view(batch, 1), 1, out, k)
                assert torch.equal(out[where: where + 1], alone), (rnd, batch, where)


def test_short_context_fill_contract_order():
    k, ratio = 8, 4
    positions = torch.tensor([0, 3, 4, 13, 31, 30], dtype=torch.int64)  # (p+1)//4 <= k: the static bound
    out = torch.full((8, k), 77, dtype=torch.int32)
    zv.fill_short_context_topk(out, positions, 6, k, ratio)
    for r, p in enumerate(positions.tolist()):
        n = (p + 1) // ratio
        row = deterministic_topk_ref(torch.randn(1, 64), k, torch.tensor([n], dtype=torch.int32))
        assert torch.equal(out[r: r + 1], row)
    assert (out[6:] == 77).all()
    # negative control: the upstream fill is ascending (0, 1, ..., n-1, -1, ...)
    n = (13 + 1) // ratio
    upstream = torch.tensor([j if j < n else -1 for j in range(k)], dtype=torch.int32)
    assert not torch.equal(out[3], upstream)
    # static bound: model limit only
    assert zv.short_context_uses_fill(8192, 4, 2048) and not zv.short_context_uses_fill(8196, 4, 2048)
    zv.fill_short_context_topk(out, positions, 0, k, ratio)  # no-op
