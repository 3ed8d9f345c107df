"""CPU tests for the adapters the DeepSeek-V4 patches call (0006 Model Runner V2 log-probs, 0013 input GEMMs,
0014 LM head, 0015 MoE block, 0016 grouped wo_a): each equals the zerodiff op it wraps on vLLM's layouts, a row's
result does not depend on the other rows, and bad layouts are refused by name.

On the CPU the ops run their references (float64 partials), so "victim in batch" here checks the adapters'
row plumbing; the kernels' own batch invariance is tested on the GPU in each op's test file.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from zerodiff.integrations import ConfigError
from zerodiff.integrations import vllm as zv
from zerodiff.ops import moe as zmoe
from zerodiff.ops.bf16_gemm import bf16_gemm
from zerodiff.ops.fp8_gemm import fp8_gemm
from zerodiff.ops.fp8_quant import quant_act, quant_weight
from zerodiff.ops.logprobs import token_logprobs
from zerodiff.ops.router_gemm import router_gemm

BATCHES = [2, 7, 17]


def _bf16(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _victim_rows(fn, victim, filler, batches=BATCHES):
    """fn(batch) on batches holding ``victim`` at first/middle/last; yields (row, alone) pairs."""
    alone = fn(victim)
    for b in batches:
        for pos in (0, b // 2, b - 1):
            x = filler(b)
            x[pos] = victim[0]
            yield fn(x)[pos], alone[0]


# ------------------------------------------------------------------------------------- BF16 GEMMs, LM head
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bf16_linear_is_the_zerodiff_gemm(seeded, out_dtype):
    g = seeded()
    w = _bf16(g, 96, 256, scale=0.1)
    x = _bf16(g, 5, 256)
    got = zv.bf16_linear(x, w, out_dtype=out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, bf16_gemm(x, w, out_dtype=out_dtype))
    x3 = _bf16(g, 2, 3, 256)
    assert torch.equal(zv.bf16_linear(x3, w, out_dtype=out_dtype).reshape(6, 96),
                       bf16_gemm(x3.reshape(6, 256), w, out_dtype=out_dtype))
    for row, alone in _victim_rows(lambda t: zv.bf16_linear(t, w, out_dtype=out_dtype), _bf16(g, 1, 256),
                                   lambda b: _bf16(g, b, 256)):
        assert torch.equal(row, alone)


def test_bf16_linear_refusals():
    w = torch.zeros(8, 128, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="bfloat16"):
        zv.bf16_linear(torch.zeros(2, 128), w)
    with pytest.raises(ConfigError, match="does not match"):
        zv.bf16_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ConfigError, match="out_dtype"):
        zv.bf16_linear(torch.zeros(2, 128, dtype=torch.bfloat16), w, out_dtype=torch.float16)


def test_lm_head_logits_fp32_and_no_bias(seeded):
    g = seeded()
    w = _bf16(g, 300, 128, scale=0.1)
    x = _bf16(g, 4, 128)
    got = zv.lm_head_logits(x, w)
    assert got.dtype == torch.float32 and torch.equal(got, bf16_gemm(x, w, out_dtype=torch.float32))
    with pytest.raises(ConfigError, match="bias"):
        zv.lm_head_logits(x, w, torch.zeros(300))


# ------------------------------------------------------------------------------------------- grouped wo_a
def _wo_a(g, G=2, N=128, K=256):
    wq, ws = quant_weight(_bf16(g, G * N, K, scale=0.05))
    return wq, ws, G, N, K


def _run_wo_a(x, wq, ws, G, N, K, weight_3d=False):
    T = x.shape[0]
    q, s = quant_act(x.reshape(T * G, K))
    z = torch.empty(T, G, N, dtype=torch.bfloat16)
    w = wq.view(G, N, K) if weight_3d else wq
    sc = ws.view(G, N // 128, K // 128) if weight_3d else ws
    return zv.fp8_grouped_linear(q.view(T, G, K), s.view(T, G, K // 128), w, sc, z)


def test_fp8_grouped_linear_is_one_gemm_per_group(seeded):
    g = seeded()
    wq, ws, G, N, K = _wo_a(g)
    x = _bf16(g, 3, G, K)
    z = _run_wo_a(x, wq, ws, G, N, K)
    q, s = quant_act(x.reshape(3 * G, K))
    q, s = q.view(3, G, K), s.view(3, G, K // 128)
    for grp in range(G):
        want = fp8_gemm(q[:, grp], s[:, grp], wq[grp * N:(grp + 1) * N], ws[grp * (N // 128):(grp + 1) * (N // 128)])
        assert torch.equal(z[:, grp], want), grp
    assert torch.equal(_run_wo_a(x, wq, ws, G, N, K, weight_3d=True), z)
    for row, alone in _victim_rows(lambda t: _run_wo_a(t, wq, ws, G, N, K), _bf16(g, 1, G, K),
                                   lambda b: _bf16(g, b, G, K)):
        assert torch.equal(row, alone)


def test_fp8_grouped_linear_refuses_other_scale_layouts(seeded):
    g = seeded()
    wq, ws, G, N, K = _wo_a(g)
    q = torch.zeros(2, G, K, dtype=torch.float8_e4m3fn)
    z = torch.empty(2, G, N, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="activation scales"):
        zv.fp8_grouped_linear(q, torch.zeros(2, G, 1, dtype=torch.int32), wq, ws, z)
    with pytest.raises(ConfigError, match="weight scales"):
        zv.fp8_grouped_linear(q, torch.zeros(2, G, K // 128), wq, ws.to(torch.bfloat16), z)


# ---------------------------------------------------------------------------------- Model Runner V2 log-probs
def test_token_logprobs_columns(seeded):
    g = seeded()
    logits = torch.randn(6, 500, generator=g) * 3
    ids = torch.randint(0, 500, (6, 3), generator=g)
    got = zv.token_logprobs_columns(logits, ids)
    for j in range(3):
        assert torch.equal(got[:, j], token_logprobs(logits, ids[:, j]))
    assert zv.token_logprobs_columns(logits.bfloat16(), ids[:, :1]).dtype == torch.float32
    with pytest.raises(ValueError, match="token_ids"):
        zv.token_logprobs_columns(logits, ids[:3])


# ------------------------------------------------------------------------------------------ MoE block
H, I, E, K_TOP, VOCAB = 256, 128, 8, 3, 50


def _moe_module(g, *, hashed=False, shared=True, n_local=E):
    w13q, w13s = quant_weight(_bf16(g, E * 2 * I, H, scale=0.05))
    w2q, w2s = quant_weight(_bf16(g, E * H, I, scale=0.05))
    experts = NS(w13_weight=w13q.view(E, 2 * I, H), w13_weight_scale_inv=w13s.view(E, 2 * I // 128, H // 128),
                 w2_weight=w2q.view(E, H, I), w2_weight_scale_inv=w2s.view(E, H // 128, I // 128),
                 local_num_experts=n_local)
    tid2eid = None
    if hashed:
        tid2eid = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(VOCAB)]).to(torch.int32)
    gate = NS(weight=_bf16(g, E, H, scale=0.1), e_score_correction_bias=torch.randn(E, generator=g) * 0.01,
              tid2eid=tid2eid, bias_vl=None)
    sw = _bf16(g, H, H, scale=0.05)
    return NS(gate=gate, experts=NS(routed_experts=experts), n_routed_experts=E, n_activated_experts=K_TOP,
              scoring_func="sqrtsoftplus", renormalize=True, routed_scaling_factor=1.5, swiglu_limit=10.0,
              shared_experts=(lambda x: bf16_gemm(x, sw)) if shared else None)


def _expected(moe, x, ids_tok):
    logits = router_gemm(x, moe.gate.weight)
    if moe.gate.tid2eid is not None:
        ids = moe.gate.tid2eid[ids_tok.long()]
        w = zmoe.route_hashed(logits, ids, scoring="sqrtsoftplus", renormalize=True, routed_scale=1.5)
    else:
        w, ids = zmoe.route(logits, K_TOP, scoring="sqrtsoftplus", bias=moe.gate.e_score_correction_bias,
                            renormalize=True, routed_scale=1.5)
    r = moe.experts.routed_experts
    mw = zmoe.MoEWeights(zmoe.Fp8Weight(r.w13_weight, r.w13_weight_scale_inv, True),
                         zmoe.Fp8Weight(r.w2_weight, r.w2_weight_scale_inv, True))
    routed = zmoe.moe_experts(x, w, ids, mw, clamp_limit=10.0)
    return zmoe.finish(routed, moe.shared_experts(x) if moe.shared_experts else None)


@pytest.mark.parametrize("hashed", [False, True])
def test_dsv4_moe_forward_is_the_zerodiff_moe(seeded, hashed):
    g = seeded()
    moe = _moe_module(g, hashed=hashed)
    x = _bf16(g, 5, H)
    tok = torch.randint(0, VOCAB, (5,), generator=g)
    got = zv.dsv4_moe_forward(moe, x, tok, ue8m0=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _expected(moe, x, tok))
    # the weights are views of vLLM's parameters (a refit in place is seen), cached on the module
    mw = moe.experts.routed_experts._zerodiff_moe_weights
    assert mw.w13.q.data_ptr() == moe.experts.routed_experts.w13_weight.data_ptr()
    victim, vtok = _bf16(g, 1, H), torch.randint(0, VOCAB, (1,), generator=g)
    alone = zv.dsv4_moe_forward(moe, victim, vtok, ue8m0=True)
    for b in (2, 9):
        for pos in (0, b - 1):
            xb, tb = _bf16(g, b, H), torch.randint(0, VOCAB, (b,), generator=g)
            xb[pos], tb[pos] = victim[0], vtok[0]
            assert torch.equal(zv.dsv4_moe_forward(moe, xb, tb, ue8m0=True)[pos], alone[0]), (b, pos)


def test_dsv4_moe_hash_layer_follows_the_table(seeded):
    """Negative control for the hash path: another table row (other experts) for the same token changes the
    output, so the adapter routes by the table, not by the gate scores. (Slot order inside the combine is the
    op's contract, tested on the GPU in test_moe.py: the CPU reference combine is not order-sensitive.)"""
    g = seeded()
    moe = _moe_module(g, hashed=True, shared=False)
    x = _bf16(g, 4, H)
    tok = torch.arange(4)
    got = zv.dsv4_moe_forward(moe, x, tok, ue8m0=True)
    moe.gate.tid2eid = (moe.gate.tid2eid + 1) % E
    assert not torch.equal(zv.dsv4_moe_forward(moe, x, tok, ue8m0=True), got)


def test_dsv4_moe_refusals(seeded):
    g = seeded()
    x = _bf16(g, 2, H)
    moe = _moe_module(g)
    moe.gate.bias_vl = torch.zeros(E)
    with pytest.raises(ConfigError, match="bias_vl"):
        zv.dsv4_moe_forward(moe, x, None, ue8m0=True)
    with pytest.raises(ConfigError, match="expert parallelism"):
        zv.dsv4_moe_forward(_moe_module(g, n_local=E // 2), x, None, ue8m0=True)
    with pytest.raises(ConfigError, match="token ids"):
        zv.dsv4_moe_forward(_moe_module(g, hashed=True), x, None, ue8m0=True)
    moe = _moe_module(g)
    r = moe.experts.routed_experts
    r.w13_weight_scale_inv = torch.zeros(E, 2 * I, H // 128 // 4, dtype=torch.int32)  # a packed layout
    with pytest.raises(ConfigError, match="moe_backend 'triton'"):
        zv.dsv4_moe_forward(moe, x, None, ue8m0=True)
    moe = _moe_module(g)
    moe.experts.routed_experts.w13_weight = torch.zeros(E, I, H // 2, dtype=torch.uint8)  # MXFP4-style
    with pytest.raises(ConfigError, match="FP4"):
        zv.dsv4_moe_forward(moe, x, None, ue8m0=True)


def test_route_hashed_rule(seeded):
    g = seeded()
    logits = torch.randn(6, E, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(6)]).to(torch.int32)
    w = zmoe.route_hashed(logits, ids, scoring="sqrtsoftplus", renormalize=True, routed_scale=1.5)
    s = zmoe.routing_scores(logits, "sqrtsoftplus").gather(1, ids.long())
    d = s[:, 0]
    for j in range(1, K_TOP):
        d = d + s[:, j]
    assert torch.equal(w, (s / d[:, None]) * 1.5)
    raw = zmoe.route_hashed(logits, ids, scoring="sqrtsoftplus", renormalize=False)
    assert torch.equal(raw, s)
    with pytest.raises(ValueError, match="ids"):
        zmoe.route_hashed(logits, ids[:2])
