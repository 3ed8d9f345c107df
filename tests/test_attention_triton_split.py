"""The split-index fused FP8 read path (``zerodiff.ops.attention.triton_split``, ``backend="triton_fp8_split"``):
the fixed configuration, agreement with the float64 reference across chunk boundaries, victim-in-batch and
decode == prefill, the negative controls (a batch-dependent CHUNK, reversed order), bad input, row blocking, and
the GPU checks at the model shape."""

import math

import pytest
import torch
from attention_inputs import GPU_H, SMALL, SPLIT, gpu_setup, prefill_positions, same_bits, split_inputs
from bitwise import bits

from zerodiff.experimental import attention_variants as av
from zerodiff.ops import attention as sa
from zerodiff.ops import kv_cache as kc
from zerodiff.ops.attention import triton_split as ts
from zerodiff.reference.sparse_attention import sparse_attention_ref

#: sink vectors of the reference test
SINKS = [False, True]


def test_split_config_is_fixed_per_model_shape():
    full = ts.split_config(512, 64)
    assert full == ts.split_config(512, 64) and full["CHUNK"] % full["BLOCK_N"] == 0
    assert ts.split_config(128, 16)["CHUNK"] == 32  # small dims (interpreter tests) cross chunks at short K
    import inspect

    params = inspect.signature(sa.split_config).parameters
    assert set(params) == {"d_nope", "d_rope"}, "the split config may depend on the model shape only"


@pytest.mark.parametrize("with_sink", SINKS)
def test_split_matches_reference_chunk_boundaries(seeded, with_sink):
    """vs the float64 reference, with K = 72 (chunks of 32, 32, 8), a fully empty chunk, -1 interleaved,
    a lonely row, duplicated positions (exact score ties) and signed zeros / denormals in q."""
    g = seeded()
    cache, bt, pos, req, q = split_inputs(g)
    rows = torch.tensor([89, 60, 3, 120, 100, 0])
    pos, req, q = pos[rows].clone(), req[rows].clone(), q[rows].contiguous()
    pos[0, 32:64] = -1  # the whole middle chunk empty
    pos[1, 1::3] = -1  # interleaved
    pos[2, :] = -1  # lonely row
    pos[3, 40:44] = pos[3, 0]  # the same position four more times: ties
    pos[4, 64:] = -1  # the short last chunk empty
    sink = torch.linspace(-2, 2, 16) if with_sink else None
    if sink is not None:
        sink[3] = sink[2]  # the tied heads share their sink too (else their outputs differ by the sink factor)
    o, l = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.13, attn_sink=sink, **SPLIT)
    ws = kc.gather_kv(cache, bt, req, pos, **SMALL, backend="reference")
    ro, rl = sparse_attention_ref(q, ws.view(-1, 144), kc.workspace_indices(pos), 0.13, d_v=128,
                                  attn_sink=sink, return_fp64=True)
    assert o.dtype == torch.bfloat16 and l.dtype == torch.float32 and o.shape == (6, 16, 128)
    assert torch.allclose(o.double(), ro, atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(l))
    assert torch.allclose(l.double()[fin], rl[fin], atol=1e-4, rtol=1e-5)
    assert bool((o[2] == 0).all()) and bool((l[2] == float("inf")).all())
    assert torch.equal(bits(o[3, 2]), bits(o[3, 3])) and torch.equal(l[3, 2], l[3, 3])  # tied heads


def test_split_victim_in_batch_and_decode_equals_prefill(seeded):
    """A row's bits do not depend on the batch around it, its position in the batch, or the phase: alone
    (decode), among other requests' rows at the front / middle / end of batches of several sizes, and inside
    a prefill batch of its own request; two rounds with fresh inputs."""
    for rnd in range(2):
        g = seeded(f"round{rnd}")
        cache, bt, pos, req, q = split_inputs(g, lens=(70, 40), W=72)
        victim = 69  # last token of request 0: a full 72-entry index list (3 chunks)
        alone = sa.sparse_mla_attention(q[victim:victim + 1], cache, bt, req[victim:victim + 1],
                                        pos[victim:victim + 1], 0.2, **SPLIT)
        fillers = torch.randperm(len(req), generator=g)
        fillers = fillers[fillers != victim]
        for B in (2, 5, 9):
            for where in sorted({0, B // 2, B - 1}):
                f = fillers[: B - 1]
                rows = torch.cat([f[:where], torch.tensor([victim]), f[where:]])
                o, l = sa.sparse_mla_attention(q[rows], cache, bt, req[rows], pos[rows], 0.2, **SPLIT)
                assert torch.equal(bits(o[where]), bits(alone[0][0])), (rnd, B, where)
                assert torch.equal(bits(l[where]), bits(alone[1][0])), (rnd, B, where)
        pre = sa.sparse_mla_attention(q[60:70], cache, bt, req[60:70], pos[60:70], 0.2, **SPLIT)  # prefill chunk
        assert same_bits((pre[0][9:10], pre[1][9:10]), alone)


def test_split_negative_control_batch_dependent_split_changesbits(seeded):
    """The invariance above is not vacuous: a split whose chunk size a batch heuristic would pick (e.g. one
    chunk per row at large batches, or 16-entry chunks at small ones) gives different bits on the same rows;
    and so does reversing the index order. Both agree to rounding."""
    g = seeded()
    cache, bt, pos, req, q = split_inputs(g, adversarial=False)
    rows = torch.tensor([89, 80, 70, 130, 120])
    q, req, pos = q[rows].contiguous(), req[rows].contiguous(), pos[rows].contiguous()
    ours = ts.sparse_mla_attention_fp8_split(q, cache, bt, req, pos, 0.3, **SMALL)
    for chunk in (16, 128):
        cfg = dict(ts.split_config(128, 16), CHUNK=chunk)
        other = av.sparse_mla_attention_fp8_split_variant(q, cache, bt, req, pos, 0.3, **SMALL, config=cfg)
        assert not torch.equal(bits(ours[0]), bits(other[0])), f"CHUNK={chunk} gave the same bits: control proves nothing"
        assert torch.allclose(ours[0].float(), other[0].float(), atol=2e-2, rtol=2e-2)
    rev = ts.sparse_mla_attention_fp8_split(q, cache, bt, req, pos.flip(-1).contiguous(), 0.3, **SMALL)
    assert not torch.equal(bits(ours[0]), bits(rev[0]))


def test_split_bad_inputs(seeded):
    g = seeded()
    cache, bt, pos, req, q = split_inputs(g, lens=(20,), W=8, H=4, adversarial=False)
    q2, r2, p2 = q[:2].contiguous(), req[:2].contiguous(), pos[:2].clone()
    p2[0, 0] = 7 * 8 + 1  # past the 3-block table of request 0
    with pytest.raises(ValueError, match="longer than the table"):
        sa.sparse_mla_attention(q2, cache, bt, r2, p2, 0.1, **SPLIT)
    o, _ = sa.sparse_mla_attention(q2, cache, bt, r2, p2, 0.1, check=False, **SPLIT)
    assert bool(o[0].isnan().all()) and not bool(o[1].isnan().any()), "an unchecked bad slot must poison only its row"
    with pytest.raises(ValueError, match="positions must be int32"):
        ts.sparse_mla_attention_fp8_split(q2, cache, bt, r2, pos[:2].long(), 0.1, **SMALL)
    with pytest.raises(ValueError, match="q must be bf16"):
        ts.sparse_mla_attention_fp8_split(q2.float(), cache, bt, r2, pos[:2], 0.1, **SMALL)
    with pytest.raises(ValueError, match="attn_sink"):
        ts.sparse_mla_attention_fp8_split(q2, cache, bt, r2, pos[:2], 0.1, attn_sink=torch.zeros(3), **SMALL)
    with pytest.raises(ValueError, match="CHUNK"):
        av.sparse_mla_attention_fp8_split_variant(q2, cache, bt, r2, pos[:2], 0.1, **SMALL,
                                                  config=dict(ts.split_config(128, 16), CHUNK=24))
    with pytest.raises(ValueError, match="gather_backend"):
        sa.sparse_mla_attention(q2, cache, bt, r2, pos[:2], 0.1, gather_backend="reference", **SPLIT)
    with pytest.raises(ValueError, match="d_nope"):
        ts.sparse_mla_attention_fp8_split(q2, cache, bt, r2, pos[:2], 0.1, d_nope=96, d_rope=16)


def test_split_row_blocking_does_not_changebits(seeded, monkeypatch):
    """Rows are launched SPLIT_MAX_ROWS at a time (memory bound for the partials): the blocking is invisible."""
    g = seeded()
    cache, bt, pos, req, q = split_inputs(g, lens=(40, 30), W=40, H=4, adversarial=False)
    rows = torch.tensor([39, 10, 69, 50, 5])
    q, req, pos = q[rows].contiguous(), req[rows].contiguous(), pos[rows].contiguous()
    whole = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.2, **SPLIT)
    monkeypatch.setattr(ts, "SPLIT_MAX_ROWS", 2)
    blocked = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.2, **SPLIT)
    assert same_bits(whole, blocked)


@pytest.mark.gpu
def test_gpu_split_chunk_boundaries_128_heads_and_batch_dependent_split_negative_control():
    """Real dims: top-k width 2000 (not a multiple of CHUNK), an empty chunk, -1 interleaved, a lonely row;
    128 heads (4 head blocks) row alone == in batch; and the negative control: the split a batch heuristic
    would choose (one chunk per row, or 128-entry chunks) changes the bits of the same rows."""
    B, K = 33, 2000
    cache, bt, pos, q = gpu_setup(B, 8192, seed=11)
    pos = pos[:, :K].contiguous()
    pos[1, 256:512] = -1
    pos[2, 1::5] = -1
    pos[3, :] = -1
    req = torch.arange(B, dtype=torch.int32, device="cuda")
    sc = 1 / math.sqrt(576)
    sink = torch.linspace(-1, 1, GPU_H, device="cuda")
    o, l = sa.sparse_mla_attention(q, cache, bt, req, pos, sc, attn_sink=sink, backend="triton_fp8_split")
    ws = kc.gather_kv(cache, bt, req[:8], pos[:8])
    ro, rl = sparse_attention_ref(q[:8].cpu(), ws.view(-1, 576).cpu(), kc.workspace_indices(pos[:8]).cpu(), sc,
                                  attn_sink=sink.cpu(), return_fp64=True)
    assert torch.allclose(o[:8].cpu().double(), ro, atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(rl)
    assert torch.allclose(l[:8].cpu().double()[fin], rl[fin], atol=1e-3, rtol=1e-4)
    assert bool((o[3] == 0).all()) and bool(torch.isinf(l[3]).all())
    for r in (0, 1, 2, 32):
        one = sa.sparse_mla_attention(q[r : r + 1], cache, bt, req[r : r + 1], pos[r : r + 1], sc, attn_sink=sink,
                                      backend="triton_fp8_split")
        assert torch.equal(one[0][0], o[r]) and torch.equal(one[1][0], l[r]), r
    # 128 heads
    q128 = torch.cat([q, q.flip(1)], 1).contiguous()
    s128 = torch.cat([sink, -sink])
    big = sa.sparse_mla_attention(q128, cache, bt, req, pos, sc, attn_sink=s128, backend="triton_fp8_split")
    for r in (0, 17):
        one = sa.sparse_mla_attention(q128[r : r + 1], cache, bt, req[r : r + 1], pos[r : r + 1], sc,
                                      attn_sink=s128, backend="triton_fp8_split")
        assert torch.equal(one[0][0], big[0][r]) and torch.equal(one[1][0], big[1][r]), r
    # negative control: batch-dependent split sizes
    rows = torch.tensor([0, 4, 9], device="cuda")
    for chunk in (128, 2048):
        cfg = dict(ts.split_config(), CHUNK=chunk)
        other = av.sparse_mla_attention_fp8_split_variant(q[rows], cache, bt, req[rows], pos[rows], sc, attn_sink=sink,
                                                          config=cfg)
        assert not torch.equal(other[0], o[rows]), f"CHUNK={chunk} gave the same bits: the control proves nothing"
        assert torch.allclose(other[0].float(), o[rows].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_split_prefill_rows_equal_decode_rows_repeated():
    """Prefill-shaped call (1024 rows of one request, causal top-k) vs the same rows as single decode rows and
    as a shuffled 64-row batch, 3 rounds (the stock decode kernel's batch dependence, the negative control for
    this claim, is test_gpu_stock_fp8_decode_reads_our_cache_and_is_batch_dependent)."""
    cache, bt, pos, q = gpu_setup(1, 8192, seed=13)
    T = 1024
    pp = prefill_positions(pos[0], 8192, T)
    qq = (torch.randn(T, GPU_H, 576, device="cuda") * 0.5).to(torch.bfloat16)
    req = torch.zeros(T, dtype=torch.int32, device="cuda")
    sc = 1 / math.sqrt(576)
    pre = sa.sparse_mla_attention(qq, cache, bt, req, pp, sc, backend="triton_fp8_split")
    for rnd in range(3):
        for t in (0, 511, 1023):
            d = sa.sparse_mla_attention(qq[t : t + 1], cache, bt, req[:1], pp[t : t + 1], sc, backend="triton_fp8_split")
            assert torch.equal(d[0][0], pre[0][t]) and torch.equal(d[1][0], pre[1][t]), (rnd, t)
        sel = torch.randperm(T, device="cuda")[:64]
        mixed = sa.sparse_mla_attention(qq[sel], cache, bt, req[sel], pp[sel], sc, backend="triton_fp8_split")
        assert torch.equal(mixed[0], pre[0][sel]) and torch.equal(mixed[1], pre[1][sel]), rnd
