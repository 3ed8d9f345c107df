"""Rollout == training at the glue level: on the GPU each vLLM adapter and the Megatron wrapper of the same op
return identical bits on the same inputs."""

from __future__ import annotations

import pytest
import torch

from zerodiff.integrations import vllm as zv
from zerodiff.integrations import megatron as zm

from integration_helpers import cuda_generator


@pytest.mark.gpu
def test_gpu_rollout_adapters_equal_training_wrappers():
    """The heart of diff = 0 at the glue level: on the GPU, each vLLM adapter and the Megatron wrapper of the
    same op return identical bits on the same inputs (same kernels, same arguments)."""
    g = cuda_generator(0)
    T, H, E, V = 37, 4096, 256, 32000
    x = (torch.randn(T, H, device="cuda", generator=g) * 2).bfloat16()
    r = (torch.randn(T, H, device="cuda", generator=g) * 2).bfloat16()
    wn = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    wg = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16()
    # router GEMM
    assert torch.equal(zv.router_logits(x, wg), zm.router_logits(x, wg))
    # RMSNorm (Megatron's norm sees the residual-added stream, vLLM fuses the add)
    y, new_r = zv.rms_norm(x, wn, 1e-6, residual=r)
    assert torch.equal(y, zm.rms_norm(new_r, wn, 1e-6))
    # expert routing
    logits = zv.router_logits(x, wg)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    w, ids = zv.expert_routing(logits, 8, scoring_func="sqrtsoftplus", bias=bias, renormalize=True,
                               routed_scaling_factor=1.5)
    probs, _ = zm.topk_routing(logits, 8, score_function="sqrtsoftplus", scaling_factor=1.5, expert_bias=bias)
    assert torch.equal(probs.gather(1, ids.long()), w)
    # SwiGLU (the MoE activation's BF16 value before FP8)
    from zerodiff.ops.silu_mul_quant import silu_mul
    h = (torch.randn(T, 2 * 2048, device="cuda", generator=g) * 3).bfloat16()
    assert torch.equal(zm.swiglu(h, 10.0), silu_mul(h, clamp_limit=10.0))
    # sampled-token log-probs vs training loss
    lg = (torch.randn(T, V, device="cuda", generator=g) * 3).bfloat16()
    tok = torch.randint(0, V, (T,), device="cuda", generator=g)
    assert torch.equal(zv.sampled_token_logprobs(lg, tok), -zm.cross_entropy(lg, tok))
    # block-FP8 linear
    from zerodiff.ops.fp8_quant import Fp8Weight
    lin = zm.Fp8Linear((torch.randn(2048, H, device="cuda", generator=g) * 0.02).bfloat16())
    assert torch.equal(zv.fp8_block_linear(x, lin.fp8.q, lin.fp8.scale, ue8m0=lin.fp8.ue8m0), lin(x))
    assert isinstance(lin.fp8, Fp8Weight)
