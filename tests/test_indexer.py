"""DSA indexer: FP8 index-key cache, fixed-order scoring, deterministic Top-K, static short-context rule."""

import pytest
import torch

from attention_inputs import paged_layout
from bitwise import assert_batch_dependent, assert_bitwise_equal, assert_victim_in_batch
from zerodiff.ops import indexer as ix
from zerodiff.reference import indexer as ref
from zerodiff.reference.fp8_quant import quant_per_token_group_ref
from zerodiff.reference.topk import deterministic_topk_ref

D = 64  # interpreter-sized key dim (the model's is 128)


def _setup(g, lens, d=D, bs=16, H=4, extra_blocks=2):
    nb = sum((L + bs - 1) // bs for L in lens) + extra_blocks
    bt, slots = paged_layout(g, lens, bs, nb)
    k = (torch.randn(len(slots), d, generator=g) * torch.logspace(-3, 2, len(slots))[:, None]).to(torch.bfloat16)
    k[0] = 0.0
    k[1, ::2] = -0.0
    cache = ix.new_index_cache(nb, bs, d=d)
    ix.write_index_cache(k, cache, torch.tensor(slots, dtype=torch.int64), backend="reference")
    return cache, bt, k, torch.tensor(slots, dtype=torch.int64)


def _queries(g, T, H=4, d=D):
    q = torch.randn(T, H, d, generator=g).to(torch.bfloat16)
    q_fp8, qs = ix.quant_index_q(q)
    w = torch.randn(T, H, generator=g) * qs
    return q_fp8, w.to(torch.float32)


def _rows(req, pos):
    """Query rows: their request ids and positions as int32 tensors."""
    return torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_index_cache_write_matches_fp8_rule(seeded, backend):
    g = seeded()
    cache, bt, k, slots = _setup(g, [20, 9])
    c2 = torch.zeros_like(cache)
    ix.write_index_cache(torch.cat([k, torch.ones(1, D, dtype=torch.bfloat16)]), c2,
                         torch.cat([slots, torch.tensor([-1])]), backend=backend)
    assert_bitwise_equal(c2, cache, f"{backend} write (with a -1 slot) vs the setup's write")
    q, s = quant_per_token_group_ref(k, D)
    flat = cache.view(-1, D + 4)[slots]
    assert_bitwise_equal(flat[:, :D], q.view(torch.uint8), "fp8 codes")
    assert_bitwise_equal(flat[:, D:].contiguous().view(torch.float32)[:, 0], s[:, 0], "scales")


def test_triton_scores_match_reference_and_mask_causally(seeded):
    g = seeded()
    lens = [70, 33]
    cache, bt, _, _ = _setup(g, lens)
    T, W = 6, 96
    req, pos = _rows([0, 1, 0, 1, 0, 0], [69, 32, 0, 5, 40, 64])
    q, w = _queries(g, T)
    a = ix.index_scores(q, w, cache, bt, req, pos, W, backend="triton")
    b = ref.index_scores_ref(q, w, cache, bt, req, pos, W)
    fin = torch.isfinite(b)
    assert_bitwise_equal(torch.isfinite(a), fin, "finite (unmasked) scores")
    for t in range(T):
        assert int(fin[t].sum()) == int(pos[t]) + 1
    assert torch.allclose(a[fin], b[fin], rtol=1e-5, atol=1e-6 * float(b[fin].abs().max()))


def test_prefill_equals_decode_equals_victim_in_batch(seeded):
    g = seeded()
    lens = [80, 50]
    cache, bt, _, _ = _setup(g, lens)
    W, k = 96, 16
    # prefill: every position of request 0 is a query row
    T = lens[0]
    q, w = _queries(g, T)
    req = torch.zeros(T, dtype=torch.int32)
    pos = torch.arange(T, dtype=torch.int32)
    full = ix.index_scores(q, w, cache, bt, req, pos, W, backend="triton")
    full_top = ix.indexer_topk(q, w, cache, bt, req, pos, k, W, backend="triton")
    q1, w1 = _queries(g, 7)
    for t in (0, 15, 16, 17, 63, 79):
        one = ix.index_scores(q[t : t + 1], w[t : t + 1], cache, bt, req[:1], pos[t : t + 1], W, backend="triton")
        assert_victim_in_batch(one[0].view(torch.int32), [(f"scores at {t} of {T}", full[t].view(torch.int32))])
        # victim among request-1 rows, at the front and at the back
        for front in (True, False):
            qs = torch.cat([q[t : t + 1], q1]) if front else torch.cat([q1, q[t : t + 1]])
            ws = torch.cat([w[t : t + 1], w1]) if front else torch.cat([w1, w[t : t + 1]])
            rq = torch.tensor([0] + [1] * 7 if front else [1] * 7 + [0], dtype=torch.int32)
            ps = torch.tensor([t] + list(range(43, 50)) if front else list(range(43, 50)) + [t], dtype=torch.int32)
            top = ix.indexer_topk(qs, ws, cache, bt, rq, ps, k, W, backend="triton")
            assert_victim_in_batch(full_top[t], [(f"top-k of position {t} at {0 if front else 7} of 8 (request-1 rows)",
                                                  top[0 if front else 7])])
    # the kernel's selection == the reference selection on the kernel's own scores
    assert_bitwise_equal(full_top[k:], deterministic_topk_ref(full, k, (pos + 1))[k:], "selection vs reference")


def test_short_context_static_rule_equals_scored_path(seeded):
    g = seeded()
    lens = [60, 40]
    cache, bt, _, _ = _setup(g, lens)
    W, k = 64, 24
    req, pos = _rows([0, 0, 0, 1, 1, 0], [0, 10, 23, 24, 39, 59])  # lengths 1, 11, 24 (= k), 25, 40, 60
    q, w = _queries(g, 6)
    fast = ix.indexer_topk(q, w, cache, bt, req, pos, k, W, shortcut=True, backend="triton")
    scored = ix.indexer_topk(q, w, cache, bt, req, pos, k, W, shortcut=False, backend="triton")
    assert_bitwise_equal(fast, scored, "static short-context rule vs scored path")
    assert fast[0].tolist() == [0] + [-1] * (k - 1)
    assert fast[2].tolist() == list(range(23, -1, -1))
    # the shortcut is decided per row: a long row in the batch does not change a short row's output
    alone = ix.indexer_topk(q[1:2], w[1:2], cache, bt, req[1:2], pos[1:2], k, W, backend="triton")
    assert_victim_in_batch(alone[0], [("short row at 1 of 6", fast[1])])
    # and the reference path agrees
    r = ix.indexer_topk(q, w, cache, bt, req, pos, k, W, backend="reference")
    assert_bitwise_equal(r[:3], fast[:3], "reference backend, short rows")


def test_negative_control_stock_topk_order_differs(seeded):
    """torch.topk (the stock selection) orders by score, not by position: a consumer that feeds its indices to
    the attention in that order gets a different reduction order; ours is position-descending."""
    g = seeded()
    cache, bt, _, _ = _setup(g, [64])
    q, w = _queries(g, 2)
    req = torch.zeros(2, dtype=torch.int32)
    pos = torch.tensor([63, 50], dtype=torch.int32)
    s = ix.index_scores(q, w, cache, bt, req, pos, 64, backend="triton")
    ours = ix.indexer_topk(q, w, cache, bt, req, pos, 16, 64, backend="triton")
    stock = torch.topk(s, 16, dim=-1).indices.to(torch.int32)
    assert_batch_dependent(ours, [("torch.topk indices", stock)], "stock top-k order")
    assert_bitwise_equal(stock.sort(dim=-1, descending=True).values, ours, "same set")  # different order


def test_bad_inputs(seeded):
    g = seeded()
    cache, bt, k, slots = _setup(g, [20, 9])
    q, w = _queries(g, 1)
    r0 = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="slot_mapping"):
        ix.write_index_cache(k[:1], cache, torch.tensor([10**6]))
    with pytest.raises(ValueError, match="longer than the table"):
        ix.index_scores(q, w, cache, bt, r0, torch.tensor([40], dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="hole"):
        ix.index_scores(q, w, cache, bt, torch.ones(1, dtype=torch.int32), torch.tensor([20], dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="< 0"):
        ix.index_scores(q, w, cache, bt, r0, torch.tensor([-1], dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="req_ids"):
        ix.index_scores(q, w, cache, bt, torch.tensor([5], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="q_fp8"):
        ix.index_scores(q.float(), w, cache, bt, r0, r0, 64)
    with pytest.raises(ValueError, match="width"):
        ix.index_scores(q, w, cache, bt, r0, r0, 0)
    with pytest.raises(ValueError, match="k="):
        ix.indexer_topk(q, w, cache, bt, r0, r0, 0, 64)


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_indexer_invariance_graphs_and_reference():
    dev = "cuda"
    g = torch.Generator().manual_seed(11)
    d, H, bs, k, W = 128, 64, 64, 2048, 16384
    lens = [16384, 9000, 1500, 3000]
    cache, bt, _, _ = _setup(g, lens, d=d, bs=bs)
    cache, bt = cache.to(dev), bt.to(dev)
    # writer on the GPU == reference writer
    kk = torch.randn(500, d, generator=g).to(torch.bfloat16)
    c_ref = torch.zeros(10, bs, d + 4, dtype=torch.uint8)
    sl = torch.randperm(10 * bs, generator=g)[:500]
    ref.write_index_cache_ref(kk, c_ref, sl)
    c_gpu = torch.zeros_like(c_ref).to(dev)
    ix.write_index_cache(kk.to(dev), c_gpu, sl.to(dev))
    assert_bitwise_equal(c_gpu.cpu(), c_ref, "written index cache")
    T = 129
    q = torch.randn(T, H, d, generator=g).to(torch.bfloat16)
    q_fp8, qs = ix.quant_index_q(q)
    w = (torch.randn(T, H, generator=g) * qs).to(torch.float32)
    req = torch.randint(0, 4, (T,), generator=g, dtype=torch.int32)
    pos = (torch.rand(T, generator=g) * torch.tensor(lens)[req.long()]).to(torch.int32)
    pos[0], req[0] = 16383, 0
    q_fp8, w, req, pos = q_fp8.to(dev), w.to(dev), req.to(dev), pos.to(dev)
    full = ix.indexer_topk(q_fp8, w, cache, bt, req, pos, k, W)
    sc = ix.index_scores(q_fp8, w, cache, bt, req, pos, W)
    rs = ref.index_scores_ref(q_fp8[:3].cpu(), w[:3].cpu(), cache.cpu(), bt.cpu(), req[:3].cpu(), pos[:3].cpu(), W)
    fin = torch.isfinite(rs)
    assert torch.allclose(sc[:3].cpu()[fin], rs[fin], rtol=1e-4, atol=1e-5 * float(rs[fin].abs().max()))
    for B in (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128):
        for where in sorted({0, B // 2, B - 1}):
            rows = torch.cat([torch.arange(1, B), torch.zeros(1, dtype=torch.long)]).roll(where + 1 - B)
            rows = rows.to(dev)
            assert int(rows[where]) == 0
            out = ix.indexer_topk(q_fp8[rows], w[rows], cache, bt, req[rows], pos[rows], k, W)
            assert_victim_in_batch(full[0], [(f"at {where} of {B}", out[where])])
    # CUDA graph replay == eager, repeated; shortcut == scored path
    kw = dict(check=False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ix.indexer_topk(q_fp8, w, cache, bt, req, pos, k, W, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = ix.indexer_topk(q_fp8, w, cache, bt, req, pos, k, W, **kw)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(gout, full, "graph replay vs eager")
    assert_bitwise_equal(ix.indexer_topk(q_fp8, w, cache, bt, req, pos, k, W, shortcut=False), full, "scored path")
    # negative control: stock torch.topk on the same scores selects in score order, not position order
    L = (pos + 1).clamp(max=W)
    long_rows = L > k
    st = torch.topk(sc[long_rows], k, dim=-1).indices.to(torch.int32)
    assert_batch_dependent(full[long_rows], [("torch.topk indices", st)], "stock top-k order")
