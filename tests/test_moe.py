"""MoE routing, dispatch bookkeeping and routed experts (zerodiff.ops.moe)."""

import pytest
import torch

from bitwise import assert_batch_dependent, assert_bitwise_equal, assert_victim_in_batch
from gpu_inputs import GPU_MS
from zerodiff.ops import moe
from zerodiff.reference.moe import moe_experts_ref, route_ref


def _experts(g, E=4, H=256, I=128, device="cpu"):
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16).to(device)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16).to(device)
    return moe.MoEWeights.from_master(w13, w2)


def _routing(g, T, E, k):
    logits = torch.randn(T, E, generator=g)
    return moe.route(logits, k, backend="reference")


# ------------------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_route_triton_matches_reference(seeded, scoring):
    g = seeded()
    logits = torch.randn(7, 24, generator=g) * 3
    bias = (torch.randn(24, generator=g) * 0.01) if scoring == "sigmoid" else None
    w, ids = moe.route(logits, 4, scoring=scoring, bias=bias, routed_scale=2.5, backend="triton")
    wr, idr = route_ref(logits, 4, scoring=scoring, bias=bias, routed_scale=2.5)
    assert ids.dtype == torch.int32
    assert_bitwise_equal(ids, idr, f"{scoring} expert ids")
    assert torch.allclose(w, wr, rtol=1e-5, atol=1e-6)
    assert bool((ids[:, :-1] > ids[:, 1:]).all()), "slot order must be expert id descending"
    w1, ids1 = moe.route(logits[3:4], 4, scoring=scoring, bias=bias, routed_scale=2.5, backend="triton")
    assert_victim_in_batch(w1, [("weights at 3 of 7", w[3:4])])
    assert_victim_in_batch(ids1, [("ids at 3 of 7", ids[3:4])])


def test_route_ties_go_to_larger_expert_and_weights_normalised():
    logits = torch.zeros(2, 8)
    logits[1, [1, 3, 6]] = 2.0
    w, ids = moe.route(logits, 2, backend="reference")
    assert ids[0].tolist() == [7, 6]
    assert ids[1].tolist() == [6, 3]
    assert torch.allclose(w.sum(1), torch.ones(2))
    wt, idt = moe.route(logits, 2, backend="triton")
    assert_bitwise_equal(idt, ids, "triton ids on ties")


def test_route_errors():
    with pytest.raises(ValueError, match="scoring"):
        moe.route(torch.zeros(2, 8), 2, scoring="relu")
    with pytest.raises(ValueError, match="k="):
        moe.route(torch.zeros(2, 8), 9)
    with pytest.raises(ValueError, match="fp32"):
        moe.route(torch.zeros(2, 8, dtype=torch.bfloat16), 2)


# ------------------------------------------------------------------------------------------- bookkeeping
def test_plan_contiguous_bookkeeping():
    ids = torch.tensor([[3, 0], [3, 1], [2, 0], [3, 2], [1, 0]], dtype=torch.int32)
    E, A = 5, moe.ALIGN
    p = moe.plan_dispatch(ids, E, layout="contiguous")
    assert p.counts.tolist() == [3, 2, 2, 3, 0]
    assert p.rows % A == 0 and p.rows >= 4 * A
    d = p.dest
    assert len(set(d.flatten().tolist())) == d.numel(), "dest rows must be unique"
    # experts packed in ascending order, each segment starting on an ALIGN boundary, (token, slot) order inside
    assert d[:, 1][[0, 2, 4]].tolist() == [0, 1, 2]  # expert 0 rows for tokens 0, 2, 4
    assert d[1, 1].item() == A and d[4, 0].item() == A + 1  # expert 1 rows
    assert sorted(d[[2, 3], [0, 1]].tolist()) == [2 * A, 2 * A + 1]
    assert d[:, 0][[0, 1, 3]].tolist() == [3 * A, 3 * A + 1, 3 * A + 2]
    te = p.tile_expert.tolist()
    assert te[:4] == [0, 1, 2, 3] and all(t == -1 for t in te[4:])  # empty expert 4: no tile


def test_plan_masked_bookkeeping_and_overflow():
    ids = torch.tensor([[3, 0], [3, 1], [2, 0], [3, 2], [1, 0]], dtype=torch.int32)
    p = moe.plan_dispatch(ids, 5, layout="masked", capacity=3)
    C = p.cap_pad
    assert C == moe.ALIGN and p.rows == 5 * C
    e = ids.long()
    assert bool(((p.dest // C) == e).all())
    assert bool(((p.dest % C) < p.counts.long()[e]).all())
    assert p.tile_expert.tolist() == [0, 1, 2, 3, -1]
    with pytest.raises(ValueError, match="capacity=2"):
        moe.plan_dispatch(ids, 5, layout="masked", capacity=2)
    with pytest.raises(ValueError, match="capacity"):
        moe.plan_dispatch(ids, 5, layout="masked")
    with pytest.raises(ValueError, match="layout"):
        moe.plan_dispatch(ids, 5, layout="ragged")


def test_plan_validation_and_padding_ids():
    with pytest.raises(ValueError, match="same expert twice"):
        moe.plan_dispatch(torch.tensor([[2, 2]], dtype=torch.int32), 4, validate=True)
    with pytest.raises(ValueError, match="num_experts"):
        moe.plan_dispatch(torch.tensor([[5, 1]], dtype=torch.int32), 4, validate=True)
    p = moe.plan_dispatch(torch.tensor([[2, -1], [1, 0]], dtype=torch.int32), 4, validate=True)
    assert p.dest[0, 1].item() == p.dump and p.counts.tolist() == [1, 1, 1, 0]


def test_combine_triton_equals_torch_and_slot_order(seeded):
    g = seeded()
    y = torch.randn(20, 300, generator=g).to(torch.bfloat16)
    y[19] = 0
    dest = torch.randint(0, 19, (6, 3), generator=g)
    w = torch.rand(6, 3, generator=g)
    a = moe.combine(y, dest, w, backend="triton")
    b = moe.combine(y, dest, w, backend="reference")
    assert_bitwise_equal(a, b, "triton vs reference combine")
    manual = ((0.0 + w[:, 0:1] * y[dest[:, 0]].float()) + w[:, 1:2] * y[dest[:, 1]].float()) \
        + w[:, 2:3] * y[dest[:, 2]].float()
    assert_bitwise_equal(a, manual, "slot-order fp32 combine")


# ------------------------------------------------------------------------------------------- experts
def test_masked_equals_contiguous_and_reference(seeded):
    g = seeded()
    T, E, k = 9, 4, 2
    ex = _experts(g, E)
    x = (torch.randn(T, 256, generator=g) * 2).to(torch.bfloat16)
    x[0, :8] = -0.0
    w, ids = _routing(g, T, E, k)
    oc = moe.moe_experts(x, w, ids, ex, layout="contiguous", backend="triton", act_backend="reference")
    om = moe.moe_experts(x, w, ids, ex, layout="masked", capacity=T, backend="triton", act_backend="reference")
    assert oc.dtype == torch.float32
    assert_bitwise_equal(oc, om, "contiguous vs masked layout")
    r = moe_experts_ref(x, w, ids, ex.w13.q, ex.w13.scale, ex.w2.q, ex.w2.scale)
    assert_bitwise_equal(oc, r, "triton vs reference experts")
    # reference backend, same plumbing
    orf = moe.moe_experts(x, w, ids, ex, layout="masked", capacity=5, backend="reference")
    assert_bitwise_equal(orf, r, "reference backend, masked, capacity 5")


def test_victim_token_independent_of_batch_and_loads(seeded):
    g = seeded()
    E, k = 4, 2
    ex = _experts(g, E)
    v = (torch.randn(1, 256, generator=g) * 2).to(torch.bfloat16)
    vw = torch.tensor([[0.625, 0.375]])
    vid = torch.tensor([[3, 1]], dtype=torch.int32)
    alone = moe.moe_experts(v, vw, vid, ex, backend="triton", act_backend="reference")
    for T, pos, layout in ((1, 0, "masked"), (5, 2, "contiguous"), (17, 16, "masked"), (17, 0, "contiguous"),
                           (33, 20, "contiguous")):
        x = (torch.randn(T, 256, generator=g) * 3).to(torch.bfloat16)
        w, ids = _routing(g, T, E, k)
        if T > 3:  # skew the expert loads: most tokens on the victim's experts
            ids[: T // 2] = vid
        x[pos], w[pos], ids[pos] = v[0], vw[0], vid[0]
        o = moe.moe_experts(x, w, ids, ex, layout=layout, capacity=T, backend="triton", act_backend="reference")
        assert_victim_in_batch(alone, [(f"at {pos} of {T}, {layout}", o[pos : pos + 1])])


def test_full_triton_path_small(seeded):
    """One run with the Triton SiLU*mul->FP8 kernel (slow on the interpreter: kept tiny)."""
    g = seeded()
    T, E, k = 3, 2, 2
    ex = _experts(g, E)
    x = (torch.randn(T, 256, generator=g)).to(torch.bfloat16)
    w, ids = _routing(g, T, E, k)
    oc = moe.moe_experts(x, w, ids, ex, layout="contiguous", backend="triton")
    om = moe.moe_experts(x, w, ids, ex, layout="masked", capacity=T, backend="triton")
    assert_bitwise_equal(oc, om, "contiguous vs masked layout")
    r = moe_experts_ref(x, w, ids, ex.w13.q, ex.w13.scale, ex.w2.q, ex.w2.scale)
    assert torch.allclose(oc, r, rtol=0.05, atol=0.05)


def test_shared_expert_and_finish(seeded):
    g = seeded()
    from zerodiff.ops.fp8_quant import Fp8Weight

    w13 = Fp8Weight.from_master((torch.randn(256, 256, generator=g) * 0.05).to(torch.bfloat16))
    w2 = Fp8Weight.from_master((torch.randn(256, 128, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    s = moe.shared_expert(x, w13, w2, backend="reference")
    assert s.shape == (5, 256) and s.dtype == torch.bfloat16
    routed = torch.randn(5, 256, generator=g)
    out = moe.finish(routed, s)
    assert_bitwise_equal(out, (routed + s.float()).to(torch.bfloat16), "finish = one fp32 add, one rounding")


def test_errors(seeded):
    g = seeded()
    ex = _experts(g, 2)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    w, ids = _routing(g, 3, 2, 2)
    with pytest.raises(RuntimeError, match="deepgemm"):  # fail closed: no CUDA/DeepGEMM here
        moe.moe_experts(x, w, ids, ex, backend="deepgemm")
    ok, why = moe.deepgemm_grouped_verdict(256, 256, "cpu")
    assert not ok and why
    with pytest.raises(ValueError, match="bf16"):
        moe.moe_experts(x.float(), w, ids, ex)
    with pytest.raises(ValueError, match="weights"):
        moe.moe_experts(x, w.double(), ids, ex)
    with pytest.raises(ValueError, match="capacity=1"):
        moe.moe_experts(x, w, ids, ex, layout="masked", capacity=1)


def test_negative_control_layout_dependent_stock_combine(seeded):
    """Stock combines accumulate in BF16 in the buffer's row order (index_add_ over packed rows for the
    contiguous layout, expert-major for the masked one): on the same expert outputs they disagree with
    the slot-order FP32 combine, and the order-dependence is visible."""
    g = seeded()
    T, E, k = 16, 8, 4
    w, ids = _routing(g, T, E, k)
    y_tok = torch.randn(T, k, 64, generator=g).to(torch.bfloat16) * 8
    ours = torch.zeros(T, 64)
    for j in range(k):
        ours = ours + w[:, j : j + 1] * y_tok[:, j].float()
    # contiguous stock: rows sorted by expert ascending, bf16 accumulation
    flat_e = ids.long().flatten()
    order = torch.argsort(flat_e, stable=True)
    tok = torch.arange(T).repeat_interleave(k)[order]
    contrib = (w.flatten()[order, None] * y_tok.reshape(T * k, 64)[order].float()).to(torch.bfloat16)
    stock_c = torch.zeros(T, 64, dtype=torch.bfloat16)
    for r in range(T * k):
        stock_c[tok[r]] += contrib[r]
    # masked stock: slot order, bf16 accumulation
    stock_m = torch.zeros(T, 64, dtype=torch.bfloat16)
    for j in range(k):
        stock_m += (w[:, j : j + 1] * y_tok[:, j].float()).to(torch.bfloat16)
    assert_batch_dependent(stock_c, [("masked stock combine", stock_m)], "stock combine across layouts")
    assert_batch_dependent(ours.to(torch.bfloat16), [("contiguous stock combine", stock_c)], "stock combine")


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("H", [4096, 7168])
def test_gpu_moe_victim_and_layouts(H):
    E, I, k = 64, 2048, 8
    g = torch.Generator(device="cuda")
    g.manual_seed(6)
    ex = moe.MoEWeights.from_master((torch.randn(E, 2 * I, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16),
                                    (torch.randn(E, H, I, generator=g, device="cuda") * 0.02).to(torch.bfloat16))
    rw = (torch.randn(E, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    pool = torch.randn(max(GPU_MS) + 1, H, generator=g, device="cuda").to(torch.bfloat16)
    from zerodiff.ops.router_gemm import router_gemm

    def run(x, layout):
        w, ids = moe.route(router_gemm(x, rw), k, scoring="sigmoid")
        return moe.moe_experts(x, w, ids, ex, layout=layout, capacity=x.shape[0])

    v = pool[-1:]
    alone = run(v, "masked")
    assert_bitwise_equal(alone, run(v, "contiguous"), "masked vs contiguous alone")
    for rnd in range(2):
        for M in GPU_MS:
            b = pool[:M].clone() if rnd == 0 else pool[:M].flip(0).clone()
            for p in sorted({0, M // 2, M - 1}):
                bb = b.clone()
                bb[p] = v[0]
                for layout in ("contiguous", "masked"):
                    o = run(bb, layout)
                    assert_victim_in_batch(alone, [(f"at {p} of {M}, H={H}, {layout}, round {rnd}", o[p : p + 1])])
                if M > 100:
                    break  # large M: one position per round keeps the test short


@pytest.mark.gpu
def test_gpu_negative_control_stock_moe():
    """Stock composition (torch.topk routing, BF16 matmul experts, index_add_ combine in BF16) changes a
    token's output with the batch."""
    E, H, I, k = 16, 4096, 1024, 4
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    rw = (torch.randn(E, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    pool = torch.randn(1001, H, generator=g, device="cuda").to(torch.bfloat16)

    def stock(x):
        sc = torch.softmax(torch.nn.functional.linear(x.float(), rw.float()), -1)
        w, ids = torch.topk(sc, k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            t, j = (ids == e).nonzero(as_tuple=True)
            if t.numel() == 0:
                continue
            h = x[t] @ w13[e].T
            a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            out.index_add_(0, t, (a @ w2[e].T) * w[t, j, None].to(torch.bfloat16))
        return out

    alone = stock(pool[-1:])

    def runs():
        for M in (16, 33, 65, 128, 1000):
            b = pool[:M].clone()
            b[0] = pool[-1]
            yield f"at 0 of {M}", stock(b)[:1]

    assert_batch_dependent(alone, runs(), "stock MoE composition")


@pytest.mark.gpu
def test_gpu_moe_deepgemm_backend_verified_or_refused():
    from zerodiff import backends

    if backends.deep_gemm() is None:
        pytest.skip(f"DeepGEMM unavailable: {backends.status()['deepgemm']['detail']}")
    E, H, I, k = 16, 4096, 2048, 4
    g = torch.Generator(device="cuda")
    g.manual_seed(8)
    ex = moe.MoEWeights.from_master((torch.randn(E, 2 * I, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16),
                                    (torch.randn(E, H, I, generator=g, device="cuda") * 0.02).to(torch.bfloat16))
    pool = torch.randn(1001, H, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(1001, E, generator=g, device="cuda")
    ok1, why1 = moe.deepgemm_grouped_verdict(2 * I, H, "cuda")
    ok2, why2 = moe.deepgemm_grouped_verdict(H, I, "cuda")
    w, ids = moe.route(logits, k)
    if not (ok1 and ok2):
        with pytest.raises(RuntimeError, match="refused"):
            moe.moe_experts(pool[:4], w[:4], ids[:4], ex, backend="deepgemm")
        pytest.skip(f"DeepGEMM grouped kernels not verified: {why1} / {why2} (refusal verified)")
    alone = moe.moe_experts(pool[-1:], w[-1:], ids[-1:], ex, layout="masked", capacity=1, backend="deepgemm")
    for M in (2, 17, 33, 128, 1000):
        idx = torch.cat([torch.arange(M - 1, device="cuda"), torch.tensor([1000], device="cuda")])
        for layout in ("contiguous", "masked"):
            o = moe.moe_experts(pool[idx], w[idx], ids[idx], ex, layout=layout, capacity=M, backend="deepgemm")
            assert_victim_in_batch(alone, [(f"at {M - 1} of {M}, {layout}", o[-1:])])
