"""The vLLM layer adapters (``zerodiff.integrations.vllm.layers``): router GEMM, RMSNorm, block-FP8 linear and
SwiGLU equal to the zerodiff ops, a row's result independent of the batch, bad layouts refused by name."""

from __future__ import annotations

import pytest
import torch

from zerodiff.integrations import ConfigError
from zerodiff.integrations import vllm as zv
from zerodiff.integrations import megatron as zm


def test_vllm_router_logits(seeded):
    from zerodiff.ops.router_gemm import router_gemm

    g = seeded()
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(8, 64, generator=g) * 0.1).to(torch.bfloat16)
    out = zv.router_logits(x, w)
    assert out.shape == (2, 5, 8) and out.dtype == torch.float32
    assert torch.equal(out.reshape(10, 8), router_gemm(x.reshape(10, 64), w))
    # the same row alone and in batches
    for n in (1, 15, 16, 17, 33):
        xb = torch.randn(n, 64, generator=g).to(torch.bfloat16)
        xb[n // 2] = x[0, 0]
        assert torch.equal(zv.router_logits(xb, w)[n // 2], out[0, 0])
    with pytest.raises(ConfigError, match="bfloat16"):
        zv.router_logits(x, w.float())


def test_vllm_rms_norm(seeded):
    from zerodiff.reference.rmsnorm import rms_norm_ref

    g = seeded()
    x = (torch.randn(3, 4, 64, generator=g) * 2).to(torch.bfloat16)
    r = (torch.randn(3, 4, 64, generator=g) * 2).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    y = zv.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and torch.equal(y.reshape(12, 64), rms_norm_ref(x.reshape(12, 64), w, 1e-6))
    y2, r2 = zv.rms_norm(x, w, 1e-6, residual=r)
    ry, rr = rms_norm_ref(x.reshape(12, 64), w, 1e-6, residual=r.reshape(12, 64))
    assert torch.equal(y2.reshape(12, 64), ry) and torch.equal(r2.reshape(12, 64), rr)
    assert torch.equal(zv.rms_norm(x, None, 1e-6).reshape(12, 64),
                       rms_norm_ref(x.reshape(12, 64), torch.ones(64), 1e-6))
    with pytest.raises(ConfigError, match="bfloat16"):
        zv.rms_norm(x.float(), w, 1e-6)


def test_vllm_fp8_block_linear(seeded):
    from zerodiff.ops.fp8_gemm import fp8_linear
    from zerodiff.ops.fp8_quant import Fp8Weight

    g = seeded()
    w = Fp8Weight.from_master((torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(2, 3, 384, generator=g).to(torch.bfloat16)
    y = zv.fp8_block_linear(x, w.q, w.scale)
    assert y.shape == (2, 3, 256) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(6, 256), fp8_linear(x.reshape(6, 384), w))
    for n in (1, 2, 31, 33):  # a row alone and in batches
        xb = torch.randn(n, 384, generator=g).to(torch.bfloat16)
        xb[n - 1] = x[0, 0]
        assert torch.equal(zv.fp8_block_linear(xb, w.q, w.scale)[n - 1], y[0, 0])
    with pytest.raises(ConfigError, match="bias"):
        zv.fp8_block_linear(x, w.q, w.scale, torch.zeros(256))
    with pytest.raises(ConfigError, match="weight scale"):
        zv.fp8_block_linear(x, w.q, w.scale.t().contiguous())
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        zv.fp8_block_linear(x, w.q.t(), w.scale)


def test_vllm_silu_mul(seeded):
    from zerodiff.reference.silu_mul_quant import silu_mul_ref

    g = seeded()
    x = (torch.randn(2, 3, 256, generator=g) * 4).to(torch.bfloat16)
    y = zv.silu_mul(x, 7.0)
    assert y.shape == (2, 3, 128) and torch.equal(y.reshape(6, 128), silu_mul_ref(x.reshape(6, 256), clamp_limit=7.0))
    assert torch.equal(zv.silu_mul(x).reshape(6, 128), silu_mul_ref(x.reshape(6, 256)))
    # the training side's SwiGLU gives the same bits
    assert torch.equal(zm.swiglu(x, 7.0), y)
    # negative control: vLLM's native two-rounding path differs on these inputs
    d = 128
    gate, up = x[..., :d].clamp(max=7.0), x[..., d:].clamp(-7.0, 7.0)
    assert not torch.equal(gate * torch.sigmoid(gate) * up, y)
    with pytest.raises(ConfigError, match="alpha"):
        zv.silu_mul(x, 7.0, alpha=1.702)
