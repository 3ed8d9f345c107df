"""The Megatron autograd wrappers (``zerodiff.integrations.megatron``): forward values equal to the zerodiff ops
bit for bit, gradients close to an independent float64 graph, and the refusals (bias, dtype, in-place weight
changes between forward and backward)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn.functional as F

from zerodiff.integrations import ConfigError
from zerodiff.integrations import megatron as zm


# (score function, pre-softmax)
ROUTING_CASES = [("softmax", False), ("softmax", True), ("sigmoid", False), ("sqrtsoftplus", False)]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_router_logits_value_and_grad(seeded):
    from zerodiff.ops.router_gemm import router_gemm

    g = seeded()
    x = torch.randn(3, 2, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(8, 64, generator=g) * 0.1).to(torch.bfloat16).requires_grad_(True)
    out = zm.router_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (3, 2, 8)
    assert torch.equal(out.detach().reshape(6, 8), router_gemm(x.detach().reshape(6, 64), w.detach()))
    gy = torch.randn(3, 2, 8, generator=g)
    out.backward(gy)
    xd, wd = x.detach().double(), w.detach().double()
    assert _rel(x.grad, (gy.double() @ wd)) < 1e-2
    assert _rel(w.grad, gy.double().reshape(6, 8).t() @ xd.reshape(6, 64)) < 1e-2
    with pytest.raises(ConfigError, match="bfloat16"):
        zm.router_logits(x.detach().float(), w.detach())
    with pytest.raises(ConfigError, match="bias"):
        zm.router_logits(x.detach(), w.detach(), torch.zeros(8))


def test_router_weight_version_check(seeded):
    g = seeded()
    x = torch.randn(4, 32, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = torch.nn.Parameter((torch.randn(8, 32, generator=g) * 0.1).to(torch.bfloat16))
    out = zm.router_logits(x, w)
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step between forward and backward
    with pytest.raises(zm.WeightVersionError, match="changed in place"):
        out.sum().backward()


@pytest.mark.parametrize("score,pre", ROUTING_CASES)
def test_topk_routing_values_and_grad(seeded, score, pre):
    from zerodiff.ops.moe import route

    g = seeded(score)
    T, E, k = 10, 16, 4
    logits = (torch.randint(-8, 8, (T, E), generator=g).float() / 4).requires_grad_(True)  # ties
    bias = torch.randn(E, generator=g) * 0.01 if score != "softmax" else None
    probs, rmap = zm.topk_routing(logits, k, score_function=score, use_pre_softmax=pre, scaling_factor=2.5,
                                  expert_bias=bias)
    renorm = score != "softmax" or not pre
    w, ids = route(logits.detach(), k, scoring=score, bias=bias, renormalize=renorm, routed_scale=2.5)
    dense = torch.zeros(T, E).scatter(1, ids.long(), w)
    assert torch.equal(probs.detach(), dense)
    assert torch.equal(rmap, dense != 0) and int(rmap.sum()) == T * k
    # gradient: the same formula in float64 at the selected ids
    gy = torch.randn(T, E, generator=g)
    probs.backward(gy)
    ld = logits.detach().double().requires_grad_(True)
    sc = {"softmax": lambda z: torch.softmax(z, -1), "sigmoid": torch.sigmoid,
          "sqrtsoftplus": lambda z: F.softplus(z).sqrt()}[score](ld)
    sel = sc.gather(1, ids.long())
    if renorm:
        sel = sel / sel.sum(-1, keepdim=True)
    (gref,) = torch.autograd.grad((sel * 2.5 * gy.double().gather(1, ids.long())).sum(), ld)
    assert _rel(logits.grad, gref) < 1e-5


def test_swiglu_value_and_grad(seeded):
    from zerodiff.reference.silu_mul_quant import silu_mul_ref

    g = seeded()
    x = (torch.randn(2, 3, 64, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    y = zm.swiglu(x, clamp_limit=2.0)
    assert torch.equal(y.detach().reshape(6, 32), silu_mul_ref(x.detach().reshape(6, 64), clamp_limit=2.0))
    gy = torch.randn(2, 3, 32, generator=g)
    y.backward(gy)
    xd = x.detach().double().requires_grad_(True)
    gg, uu = xd.chunk(2, -1)
    ref = F.silu(gg.clamp(max=2.0)) * uu.clamp(-2.0, 2.0)
    (gref,) = torch.autograd.grad(ref, xd, gy.double())
    assert _rel(x.grad, gref) < 1e-2
    # negative control: the stock bf16 graph (two roundings) differs from the one-rounding value
    stock = F.silu(x.detach()[..., :32].clamp(max=2.0)) * x.detach()[..., 32:].clamp(-2.0, 2.0)
    assert not torch.equal(stock, y.detach())


def test_mlp_activation_refusals(seeded):
    x = torch.randn(4, 64, generator=seeded()).to(torch.bfloat16)
    cfg = NS(gated_linear_unit=True, glu_linear_offset=0.0, activation_func_clamp_value=None)
    assert zm.mlp_activation(cfg, F.silu, x, None, None).shape == (4, 32)
    with pytest.raises(ConfigError, match="bias"):
        zm.mlp_activation(cfg, F.silu, x, torch.zeros(64, dtype=torch.bfloat16), None)
    with pytest.raises(ConfigError, match="per_token_scale"):
        zm.mlp_activation(cfg, F.silu, x, None, torch.ones(4))
    with pytest.raises(ConfigError, match="SwiGLU"):
        zm.mlp_activation(cfg, F.gelu, x, None, None)


def test_rmsnorm_module_value_and_grad(seeded):
    from zerodiff.reference.rmsnorm import rms_norm_ref

    g = seeded()
    norm = zm.RMSNorm(64, eps=1e-5, config=NS(params_dtype=torch.bfloat16, layernorm_zero_centered_gamma=False))
    assert list(norm.state_dict()) == ["weight"]
    with torch.no_grad():
        norm.weight.copy_((1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16))
    x = (torch.randn(3, 2, 64, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    y = norm(x)
    assert torch.equal(y.detach().reshape(6, 64), rms_norm_ref(x.detach().reshape(6, 64), norm.weight.detach(), 1e-5))
    gy = torch.randn(3, 2, 64, generator=g)
    y.backward(gy)
    xd = x.detach().double().requires_grad_(True)
    wd = norm.weight.detach().double().requires_grad_(True)
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    gx, gw = torch.autograd.grad(ref, (xd, wd), gy.double())
    assert _rel(x.grad, gx) < 1e-2 and _rel(norm.weight.grad, gw) < 1e-2
    with pytest.raises(ConfigError, match="zero_centered_gamma"):
        zm.RMSNorm(64, config=NS(layernorm_zero_centered_gamma=True))


def test_cross_entropy_is_minus_logprob(seeded):
    from zerodiff.ops.logprobs import token_logprobs

    g = seeded()
    s, b, V = 3, 2, 50
    logits = (torch.randn(s, b, V, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, V, (s, b), generator=g)
    loss = zm.cross_entropy(logits, target)
    lp = token_logprobs(logits.detach().reshape(-1, V), target.reshape(-1))
    assert loss.shape == (s, b) and loss.dtype == torch.float32
    assert torch.equal(-loss.detach().reshape(-1), lp)  # negation is exact
    gy = torch.randn(s, b, generator=g)
    loss.backward(gy)
    ld = logits.detach().double().requires_grad_(True)
    ref = -torch.log_softmax(ld, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    (gref,) = torch.autograd.grad(ref, ld, gy.double())
    assert _rel(logits.grad, gref) < 1e-2
    with pytest.raises(ConfigError, match="label_smoothing"):
        zm.cross_entropy(logits.detach(), target, label_smoothing=0.1)
    # temperature variant
    lpt = zm.token_logprobs(logits.detach(), target, temperature=0.7)
    assert torch.equal(lpt.reshape(-1), token_logprobs(logits.detach().reshape(-1, V), target.reshape(-1),
                                                       temperature=0.7))


def test_fp8_linear_forward_and_ste(seeded):
    from zerodiff.ops.fp8_gemm import fp8_linear
    from zerodiff.ops.fp8_quant import Fp8Weight

    g = seeded()
    lin = zm.Fp8Linear((torch.randn(128, 128, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16).requires_grad_(True)
    y = lin(x)
    assert torch.equal(y.detach(), fp8_linear(x.detach(), Fp8Weight.from_master(lin.weight.detach(), ue8m0=zm.FP8_UE8M0)))
    gy = torch.randn(5, 128, generator=g)
    y.backward(gy)
    assert _rel(x.grad, gy.double() @ lin.weight.detach().double()) < 1e-2
    assert _rel(lin.weight.grad, gy.double().t() @ x.detach().double()) < 1e-2
    q_ptr = lin.fp8.q.data_ptr()
    with torch.no_grad():
        lin.weight.mul_(1.5)
    # the next forward requantises from the master first, in place (CUDA-graph safe)
    assert torch.equal(lin(x.detach()), fp8_linear(x.detach(), Fp8Weight.from_master(lin.weight.detach(), ue8m0=zm.FP8_UE8M0)))
    assert lin.fp8.q.data_ptr() == q_ptr


def test_megatron_parallel_linear_fp8(seeded):
    from zerodiff.ops.fp8_gemm import fp8_linear
    from zerodiff.ops.fp8_quant import Fp8Weight

    g = seeded()
    model = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 128, bias=False))
    model = model.to(torch.bfloat16)
    assert zm.mark_fp8_linears(model, lambda name, m: name == "0") == ["0"]
    lin = model[0]
    assert getattr(lin, zm.FP8_ATTR) and not getattr(model[1], zm.FP8_ATTR, False)
    x = torch.randn(3, 5, 128, generator=g).to(torch.bfloat16).requires_grad_(True)
    y, b = zm.parallel_linear_fp8(lin, x)
    assert b is None and y.shape == (3, 5, 256)
    assert torch.equal(y.detach().reshape(15, 256), fp8_linear(x.detach().reshape(15, 128),
                                                                  Fp8Weight.from_master(lin.weight.detach(), ue8m0=zm.FP8_UE8M0)))
    y.float().sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    q_ptr = lin._zerodiff_fp8_weight.q.data_ptr()
    with torch.no_grad():
        lin.weight.mul_(0.5)  # optimizer step: next forward requantises in place
    y2, _ = zm.parallel_linear_fp8(lin, x.detach())
    assert lin._zerodiff_fp8_weight.q.data_ptr() == q_ptr
    assert torch.equal(y2.reshape(15, 256), fp8_linear(x.detach().reshape(15, 128),
                                                       Fp8Weight.from_master(lin.weight.detach(), ue8m0=zm.FP8_UE8M0)))
    with pytest.raises(ConfigError, match="bfloat16"):
        zm.parallel_linear_fp8(torch.nn.Linear(128, 8, bias=False), x.detach())
