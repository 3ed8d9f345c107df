"""Sparse MLA attention, the dispatcher (``zerodiff.ops.attention``) and the workspace path
(``workspace`` + ``triton_fallback``): reference semantics, the Triton fallback, the one read path (prefill ==
chunked prefill == decode), negative controls, backend selection, and GPU checks of every backend through the
dispatcher (victim-in-batch, CUDA graphs, the stock FP8 decode kernel as a negative control). The shipped
``flashmla_fp8`` backend's own tests: tests/test_attention_flashmla_fp8.py."""

import math

import pytest
import torch
from attention_inputs import GPU_H, GPU_TOPK, SMALL, causal_positions, gpu_setup, need_flashmla, same_bits, small_cache
from bitwise import bits

from zerodiff._triton import triton_usable_for
from zerodiff.ops import attention as sa
from zerodiff.ops import kv_cache as kc
from zerodiff.reference.sparse_attention import sparse_attention_ref

#: the backends the GPU tests run through the dispatcher
GPU_BACKENDS = ["flashmla", "triton", "triton_fp8_split"]
#: sink vectors of the fallback's reference test
SINKS = [False, True]


def test_reference_matches_naive_dense_softmax(seeded):
    g = seeded()
    Q, H, D, S, K = 3, 2, 24, 10, 6
    q = torch.randn(Q, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, S, (Q, K), generator=g, dtype=torch.int32)
    idx[0, 2] = -1
    idx[1, :] = -1  # lonely row
    idx[2, 3] = S + 5  # out of range = skipped
    sink = torch.tensor([0.5, -1.0])
    out, lse = sparse_attention_ref(q, kv, idx, 0.3, d_v=16, attn_sink=sink, return_fp64=True)
    for r in (0, 2):
        keep = [int(i) for i in idx[r] if 0 <= int(i) < S]
        k = kv.double()[keep]
        for h in range(H):
            s = (q[r, h].double() @ k.T) * 0.3
            w = torch.softmax(s, 0)
            ls = torch.logsumexp(s, 0)
            want = (w @ k[:, :16]) / (1 + torch.exp(sink[h].double() - ls))
            assert torch.allclose(out[r, h], want, atol=1e-12)
            assert abs(float(lse[r, h] - ls)) < 1e-12
    assert bool((out[1] == 0).all()) and bool(torch.isinf(lse[1]).all()) and bool((lse[1] > 0).all())


@pytest.mark.parametrize("with_sink", SINKS)
def test_triton_matches_reference(seeded, with_sink):
    g = seeded()
    Q, H, S, K = 5, 4, 70, 40
    D = 144
    q = (torch.randn(Q, H, D, generator=g) * 0.5).to(torch.bfloat16)
    kv = torch.randn(S, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, S, (Q, K), generator=g, dtype=torch.int32)
    idx[1, 30:] = -1
    idx[2, :] = -1  # lonely
    idx[3, 5] = S + 1
    kv[3, :8] = -0.0
    sink = torch.tensor([0.1, -2.0, 3.0, float("-inf")]) if with_sink else None
    sc = 1 / math.sqrt(D)
    o, l = sa.sparse_attention(q, kv, idx, sc, d_v=128, attn_sink=sink, backend="triton")
    ro, rl = sparse_attention_ref(q, kv, idx, sc, d_v=128, attn_sink=sink, return_fp64=True)
    assert o.dtype == torch.bfloat16 and l.dtype == torch.float32
    assert torch.allclose(o.double(), ro, atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(l))
    assert torch.allclose(l.double()[fin], rl[fin], atol=1e-4, rtol=1e-5)
    assert bool((o[2] == 0).all()) and bool((l[2] == float("inf")).all())


def test_one_read_path_prefill_equals_chunked_equals_decode(seeded):
    """The same token's output, bitwise: inside a long prefill, inside a chunked prefill mixed with another
    request's rows (victim-in-batch at several positions), and as a single decode row."""
    g = seeded()
    lens = [37, 21]
    cache, bt = small_cache(g, lens, SMALL)
    W = 32
    H = 4
    pos0 = causal_positions(g, lens[0], W)
    pos1 = causal_positions(g, lens[1], W)
    q0 = (torch.randn(lens[0], H, 144, generator=g)).to(torch.bfloat16)
    q1 = (torch.randn(lens[1], H, 144, generator=g)).to(torch.bfloat16)
    sink = torch.tensor([0.0, 1.0, -1.0, 0.5])
    sc = 0.11
    z = lambda n, v: torch.full((n,), v, dtype=torch.int32)  # noqa: E731
    kw = dict(attn_sink=sink, **SMALL, backend="triton", gather_backend="triton")
    full = sa.sparse_mla_attention(q0, cache, bt, z(lens[0], 0), pos0, sc, **kw)
    # chunked prefill: rows [0, 20) then [20, 37), each chunk mixed with request 1's rows before/after
    c1 = sa.sparse_mla_attention(torch.cat([q1[:5], q0[:20]]), cache, bt, torch.cat([z(5, 1), z(20, 0)]),
                                 torch.cat([pos1[:5], pos0[:20]]), sc, **kw)
    c2 = sa.sparse_mla_attention(torch.cat([q0[20:], q1[5:]]), cache, bt, torch.cat([z(17, 0), z(16, 1)]),
                                 torch.cat([pos0[20:], pos1[5:]]), sc, rows_per_chunk=7, **kw)
    chunked = (torch.cat([c1[0][5:], c2[0][:17]]), torch.cat([c1[1][5:], c2[1][:17]]))
    assert same_bits(full, chunked)
    for t in (0, 8, 19, 20, 36):  # decode: one row
        d = sa.sparse_mla_attention(q0[t : t + 1], cache, bt, z(1, 0), pos0[t : t + 1], sc, **kw)
        assert same_bits((full[0][t : t + 1], full[1][t : t + 1]), d), t
    # and the kernel agrees with the reference read path
    ref = sa.sparse_mla_attention(q0, cache, bt, z(lens[0], 0), pos0, sc, attn_sink=sink, **SMALL,
                                  backend="reference", gather_backend="reference")
    assert torch.allclose(full[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)


def test_per_request_workspace_equals_per_row(seeded):
    """Prefill layout (each request dequantised once, rows index it) == per-row layout, bitwise."""
    g = seeded()
    lens = [30, 12, 25]
    cache, bt = small_cache(g, lens, SMALL)
    W, H = 16, 4
    pos = torch.cat([causal_positions(g, L, W) for L in lens])
    req = torch.cat([torch.full((L,), b, dtype=torch.int32) for b, L in enumerate(lens)])
    perm = torch.randperm(len(req), generator=g)
    pos, req = pos[perm], req[perm]
    q = torch.randn(len(req), H, 144, generator=g).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32)
    kw = dict(**SMALL, seq_lens=sl, backend="triton", gather_backend="triton")
    a = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.2, workspace="per_row", **kw)
    b = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.2, workspace="per_request", **kw)
    assert same_bits(a, b)
    with pytest.raises(ValueError, match="seq_lens"):
        sa.sparse_mla_attention(q, cache, bt, req, pos, 0.2, workspace="per_request", **SMALL)


def test_negative_control_reversed_index_order_changesbits(seeded):
    g = seeded()
    Q, H, S, K = 4, 4, 200, 96
    q = (torch.randn(Q, H, 144, generator=g) * 2).to(torch.bfloat16)
    kv = torch.randn(S, 144, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(Q)]).to(torch.int32)
    a = sa.sparse_attention(q, kv, idx, 0.2, d_v=128, backend="triton")
    b = sa.sparse_attention(q, kv, idx.flip(-1), 0.2, d_v=128, backend="triton")
    assert not torch.equal(bits(a[0]), bits(b[0])), "reversing the index order must change the bits"
    assert torch.allclose(a[0].float(), b[0].float(), atol=2e-2, rtol=2e-2)  # ...but only by rounding


def test_bad_inputs(seeded):
    g = seeded()
    q = torch.randn(2, 4, 144, generator=g).to(torch.bfloat16)
    kv = torch.randn(8, 144, generator=g).to(torch.bfloat16)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices must be int32"):
        sa.sparse_attention(q, kv, idx.long(), 0.1, d_v=128)
    with pytest.raises(ValueError, match="kv must be bf16"):
        sa.sparse_attention(q, kv.float(), idx, 0.1, d_v=128)
    with pytest.raises(ValueError, match="attn_sink"):
        sa.sparse_attention(q, kv, idx, 0.1, d_v=128, attn_sink=torch.zeros(3))
    with pytest.raises(ValueError, match="flashmla"):
        sa.sparse_attention(q, kv, idx, 0.1, d_v=128, backend="flashmla")
    with pytest.raises(ValueError, match="unknown backend"):
        sa.sparse_attention(q, kv, idx, 0.1, d_v=128, backend="cudnn")
    cache, bt = small_cache(g, [5], SMALL)
    with pytest.raises(ValueError, match="seq_lens|longer than the table|hole"):
        sa.sparse_mla_attention(q[:1], cache, bt, torch.zeros(1, dtype=torch.int32),
                                torch.tensor([[40, -1]], dtype=torch.int32), 0.1, **SMALL)



def test_dispatcher_picks_by_device_library_and_shape_only(seeded, monkeypatch):
    """``backend=None`` on this machine: ``default_read_backend`` says "flashmla_fp8" only where its ``supports``
    accepts the call, else the workspace path (the same bits as asking for it); ``READ_BACKEND`` overrides the pick
    for every call; an unknown name (or a read path that did not ship) is refused."""
    g = seeded()
    lens = [20, 11]
    cache, bt = small_cache(g, lens, SMALL)
    pos = torch.cat([causal_positions(g, L, 8) for L in lens])
    req = torch.cat([torch.full((L,), b, dtype=torch.int32) for b, L in enumerate(lens)])
    q = torch.randn(len(req), 4, 144, generator=g).to(torch.bfloat16)
    assert sa.default_read_backend(q, pos, **SMALL) is None  # not the model's dims (and no CUDA here)
    auto = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, **SMALL)
    gather = "triton" if triton_usable_for(q.device) else "reference"
    ws = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, **SMALL, gather_backend=gather)
    assert same_bits(auto, ws)
    monkeypatch.setattr(sa, "READ_BACKEND", "reference")
    ref = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, **SMALL)
    want = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, **SMALL, backend="reference",
                                   gather_backend="reference")
    assert same_bits(ref, want)
    monkeypatch.setattr(sa, "READ_BACKEND", None)
    for bad in ("cudnn", "triton_fp8"):
        with pytest.raises(ValueError, match="unknown backend"):
            sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, **SMALL, backend=bad)
    with pytest.raises(ValueError, match="rows_per_chunk"):
        sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, **SMALL, rows_per_chunk=0)
    with pytest.raises(ValueError, match="workspace="):
        sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, **SMALL, workspace="dense")
    assert sa.default_sm_scale() == 1 / math.sqrt(576)


def _gpu_case(backend, B, ctx, **kw):
    """``gpu_setup(B, ctx, **kw)`` for ``backend`` (skipped when FlashMLA is wanted and absent) and one request per
    row: ``cache, bt, pos, q, req``."""
    if backend == "flashmla":
        need_flashmla()
    cache, bt, pos, q = gpu_setup(B, ctx, **kw)
    return cache, bt, pos, q, torch.arange(B, dtype=torch.int32, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_kernel_matches_reference(backend):
    cache, bt, pos, q, req = _gpu_case(backend, 4, 4096, topk=512)
    pos[1, 300:] = -1
    sink = torch.linspace(-2, 2, GPU_H, device="cuda")
    sc = 1 / math.sqrt(576)
    o, l = sa.sparse_mla_attention(q, cache, bt, req, pos, sc, attn_sink=sink, backend=backend)
    ws = kc.gather_kv(cache, bt, req, pos)
    ro, rl = sparse_attention_ref(q.cpu(), ws.view(-1, 576).cpu(), kc.workspace_indices(pos).cpu(), sc,
                                  attn_sink=sink.cpu(), return_fp64=True)
    assert torch.allclose(o.cpu().double(), ro, atol=2e-2, rtol=2e-2)
    assert torch.allclose(l.cpu().double(), rl, atol=1e-3, rtol=1e-4), "lse convention differs (natural log expected)"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_victim_in_batch_and_decode_equals_prefill(backend):
    cache, bt, pos, q, req_all = _gpu_case(backend, 129, 4096)
    sc = 1 / math.sqrt(576)
    sink = torch.linspace(-1, 1, GPU_H, device="cuda")
    victim = 0
    alone = sa.sparse_mla_attention(q[:1], cache, bt, req_all[:1], pos[:1], sc, attn_sink=sink, backend=backend)
    for B in (2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 129):
        for where in sorted({0, B // 2, B - 1}):
            rows = torch.arange(1, B, device="cuda")
            rows = torch.cat([rows[:where], torch.zeros(1, dtype=rows.dtype, device="cuda"), rows[where:]])
            o, l = sa.sparse_mla_attention(q[rows], cache, bt, req_all[rows], pos[rows], sc, attn_sink=sink,
                                           backend=backend)
            assert torch.equal(o[where].view(torch.int16), alone[0][victim].view(torch.int16)), (B, where)
            assert torch.equal(l[where], alone[1][victim]), (B, where)
    # prefill (several query rows of one request, chunked in two ways) == decode (one row)
    p1 = torch.stack([pos[0]] * 40)
    for t in range(40):  # distinct histories per row: drop t entries from the tail
        p1[t, GPU_TOPK - t :] = -1
    qq = (q[0:1] + torch.randn(40, GPU_H, 576, device="cuda").to(torch.bfloat16)).contiguous()
    req0 = torch.zeros(40, dtype=torch.int32, device="cuda")
    pre = sa.sparse_mla_attention(qq, cache, bt, req0, p1, sc, backend=backend)
    chk = sa.sparse_mla_attention(qq, cache, bt, req0, p1, sc, backend=backend, rows_per_chunk=7)
    assert torch.equal(pre[0], chk[0]) and torch.equal(pre[1], chk[1])
    lens = torch.full((129,), 4096, dtype=torch.int32, device="cuda")
    dense = sa.sparse_mla_attention(qq, cache, bt, req0, p1, sc, backend=backend, workspace="per_request",
                                    seq_lens=lens)
    assert torch.equal(pre[0], dense[0]) and torch.equal(pre[1], dense[1]), "per-request workspace changed bits"
    for t in (0, 13, 39):
        d = sa.sparse_mla_attention(qq[t : t + 1], cache, bt, req0[:1], p1[t : t + 1], sc, backend=backend)
        assert torch.equal(d[0][0], pre[0][t]) and torch.equal(d[1][0], pre[1][t])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_cuda_graph_replay_equals_eager_repeated(backend):
    cache, bt, pos, q, req = _gpu_case(backend, 64, 8192, seed=3)
    sc = 1 / math.sqrt(576)
    kw = dict(check=False, backend=backend)
    eager = sa.sparse_mla_attention(q, cache, bt, req, pos, sc, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            sa.sparse_mla_attention(q, cache, bt, req, pos, sc, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, gl = sa.sparse_mla_attention(q, cache, bt, req, pos, sc, **kw)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(go, eager[0]) and torch.equal(gl, eager[1])
        again = sa.sparse_mla_attention(q, cache, bt, req, pos, sc, **kw)
        assert torch.equal(again[0], eager[0]) and torch.equal(again[1], eager[1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_negative_control_reversed_order(backend):
    cache, bt, pos, q, req = _gpu_case(backend, 8, 8192, seed=5)
    sc = 1 / math.sqrt(576)
    a = sa.sparse_mla_attention(q, cache, bt, req, pos, sc, backend=backend)
    b = sa.sparse_mla_attention(q, cache, bt, req, pos.flip(-1).contiguous(), sc, backend=backend)
    assert not torch.equal(a[0], b[0]), "reversed index order must change the output (else order is not tested)"


@pytest.mark.gpu
def test_gpu_stock_fp8_decode_reads_our_cache_and_is_batch_dependent():
    """Negative control: FlashMLA's FP8 decode kernel reads the very same 656-byte cache (its values agree with
    ours to rounding, proving the layout), but a request's output changes with the batch around it."""
    fm = need_flashmla()
    B = 128
    cache, bt, pos, q = gpu_setup(B, 8192, seed=7)
    sc = 1 / math.sqrt(576)
    bs = cache.shape[1]
    slot_idx = (bt.long().gather(1, (pos.long().clamp(min=0) // bs)) * bs + pos.long() % bs).to(torch.int32)
    slot_idx = torch.where(pos >= 0, slot_idx, torch.full_like(slot_idx, -1))

    def stock(rows):
        meta, _ = fm.get_mla_metadata()
        o, l = fm.flash_mla_with_kvcache(q[rows][:, None], cache.unsqueeze(-2), None, None, 512, meta,
                                         softmax_scale=sc, is_fp8_kvcache=True,
                                         indices=slot_idx[rows][:, None].contiguous())
        return o[:, 0]

    ours = sa.sparse_mla_attention(q, cache, bt, torch.arange(B, dtype=torch.int32, device="cuda"), pos, sc)
    full = stock(torch.arange(B, device="cuda"))
    assert torch.allclose(full.float(), ours[0].float(), atol=2e-2, rtol=2e-2), "stock kernel misreads our cache layout"
    diffs = []
    for n in (16, 64, 128):
        batch = stock(torch.arange(n, device="cuda"))
        alone = stock(torch.zeros(1, dtype=torch.long, device="cuda"))
        diffs.append(int((batch[0] != alone[0]).sum()))
    assert max(diffs) > 0, f"stock FP8 decode did not differ alone vs in batch ({diffs}); the control proves nothing"
