"""The vLLM MoE adapters (``zerodiff.integrations.vllm.moe``): SiLU*up -> FP8 in the scale layouts DeepGEMM
reads (contiguous and masked, FP32 / UE8M0), refusals of other activations and formats, and expert routing
equal to the training side's routing."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from zerodiff.integrations import ConfigError
from zerodiff.integrations import vllm as zv
from zerodiff.integrations import megatron as zm
from zerodiff.reference.silu_mul_quant import silu_mul_quant_fp8_ref

from integration_helpers import cuda_generator


CONTIGUOUS_SCALE_FORMATS = ["FLOAT32", "FLOAT32_CEIL_UE8M0"]
MASKED_SCALE_FORMATS = ["FLOAT32", "UE8M0"]
SCORING_FUNCS = ["softmax", "sigmoid", "sqrtsoftplus"]


def _act(g, *shape):
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-40, -3.0])
    return x


@pytest.mark.parametrize("fmt", CONTIGUOUS_SCALE_FORMATS)
def test_moe_act_quant_contiguous_layout(seeded, fmt):
    g = seeded(fmt)
    M, N = 6, 256
    x = _act(g, M, 2 * N)
    out = torch.empty((M, N), dtype=torch.float8_e4m3fn)
    q, s = zv.moe_act_quant_contiguous(x, out, group_size=128, clamp_limit=7.0, scale_fmt=fmt,
                                       alpha=1.0, beta=0.0)
    rq, rs = silu_mul_quant_fp8_ref(x, group=128, clamp_limit=7.0, ue8m0=fmt != "FLOAT32")
    assert q.data_ptr() == out.data_ptr()
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert s.stride(0) == 1 and s.stride(1) == 8  # MN-major, M padded to a multiple of 4
    # the enum member itself is accepted too
    q2, s2 = zv.moe_act_quant_contiguous(x, None, scale_fmt=NS(name=fmt))
    assert torch.equal(s2, silu_mul_quant_fp8_ref(x, group=128, ue8m0=fmt != "FLOAT32")[1])


def test_moe_act_quant_packed_ue8m0(seeded):
    g = seeded()
    M, N = 5, 640  # G = 5 groups -> 2 int32 words per row (last one padded)
    x = _act(g, M, 2 * N)
    q, s = zv.moe_act_quant_contiguous(x, None, scale_fmt="UE8M0")
    rq, rs = silu_mul_quant_fp8_ref(x, group=128, ue8m0=True)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert s.dtype == torch.int32 and tuple(s.shape) == (M, 2) and s.stride(0) == 1
    exps = ((rs.view(torch.int32) >> 23) & 0xFF).tolist()
    for m in range(M):
        words = [int(v) & 0xFFFFFFFF for v in s[m].tolist()]
        got = [(words[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(5)]
        assert got == exps[m]
        assert (words[1] >> 8) == 0  # padding bytes are zero


def test_moe_act_quant_refuses_swigluoai_and_unknown_format(seeded):
    x = _act(seeded(), 2, 256)
    with pytest.raises(ConfigError, match="gemm1_alpha"):
        zv.moe_act_quant_contiguous(x, None, alpha=1.702, beta=1.0)
    with pytest.raises(ConfigError, match="activation='GELU'"):
        zv.moe_act_quant_contiguous(x, None, activation="GELU")
    with pytest.raises(ConfigError, match="scale format"):
        zv.moe_act_quant_contiguous(x, None, scale_fmt="E4M3_WEIRD")


@pytest.mark.parametrize("fmt", MASKED_SCALE_FORMATS)
def test_moe_act_quant_masked_matches_contiguous(seeded, fmt):
    g = seeded(fmt)
    E, T, N = 3, 5, 256
    y = _act(g, E, T, 2 * N)
    counts = torch.tensor([5, 0, 2], dtype=torch.int32)
    q, s = zv.moe_act_quant_masked(y, counts, scale_fmt=fmt)
    G = N // 128 if fmt == "FLOAT32" else 1
    assert tuple(s.shape) == (E, T, G) and s.stride() == (T * G, 1, T)
    for e in range(E):
        c = int(counts[e])
        if c:
            cq, cs = zv.moe_act_quant_contiguous(y[e, :c].contiguous(), None, scale_fmt=fmt)
            assert torch.equal(q[e, :c].view(torch.uint8), cq.view(torch.uint8))
            assert torch.equal(s[e, :c], cs)
        assert (q[e, c:].view(torch.uint8) == 0).all() and (s[e, c:] == 0).all()
    # negative control: two BF16 roundings (stock activation) change some FP8 codes on these inputs
    g2, u2 = y[0, :, :N], y[0, :, N:]
    two = (torch.nn.functional.silu(g2) * u2).to(torch.bfloat16)
    one = silu_mul_quant_fp8_ref(y[0], group=128)[0]
    from zerodiff.reference.fp8_quant import quant_per_token_group_ref
    assert not torch.equal(quant_per_token_group_ref(two, 128)[0].view(torch.uint8), one.view(torch.uint8))


@pytest.mark.parametrize("scoring", SCORING_FUNCS)
def test_vllm_expert_routing_matches_training_routing(seeded, scoring):
    from zerodiff.ops.moe import route

    g = seeded(scoring)
    T, E, k = 9, 32, 6
    logits = torch.randint(-8, 8, (T, E), generator=g).float() / 4  # ties
    bias = torch.nn.Parameter(torch.randn(E, generator=g) * 0.01)
    w, ids = zv.expert_routing(logits, k, scoring_func=scoring, bias=bias, renormalize=True,
                               routed_scaling_factor=2.5, indices_type=torch.int64)
    rw, rids = route(logits, k, scoring=scoring, bias=bias.detach(), renormalize=True, routed_scale=2.5)
    assert ids.dtype == torch.int64 and torch.equal(ids, rids.long()) and torch.equal(w, rw)
    # the training side (Megatron wrapper) gives the same selection and weights
    probs, rmap = zm.topk_routing(logits, k, score_function=scoring,
                                  use_pre_softmax=False, scaling_factor=2.5, expert_bias=bias.detach())
    assert torch.equal(probs.gather(1, ids), w) and int(rmap.sum()) == T * k
    with pytest.raises(ConfigError, match="fp32"):
        zv.expert_routing(logits.bfloat16(), k, scoring_func=scoring)
    with pytest.raises(ConfigError, match="scoring_func"):
        zv.expert_routing(logits, k, scoring_func="gumbel")


@pytest.mark.gpu
def test_gpu_act_scale_layout_matches_deepgemm():
    from zerodiff import backends

    dg = backends.deep_gemm()
    if dg is None:
        pytest.skip(f"DeepGEMM unavailable: {backends.status()['deepgemm']['detail']}")
    g = cuda_generator(2)
    for M in (1, 3, 64, 257):
        x = (torch.randn(M, 2 * 2048, device="cuda", generator=g) * 3).bfloat16()
        q, s = zv.moe_act_quant_contiguous(x, None, scale_fmt="FLOAT32")
        from zerodiff.ops.silu_mul_quant import silu_mul_quant_fp8
        _, s_rows = silu_mul_quant_fp8(x)
        ref = dg.get_mn_major_tma_aligned_tensor(s_rows)
        assert torch.equal(s, ref) and s.stride() == ref.stride(), M
