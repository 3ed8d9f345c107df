"""CPU tests for the Megatron side of zerodiff (``zerodiff.integrations.megatron``) beyond the per-op wrappers
in test_integrations.py: deployment copies that follow the masters however an optimizer writes them, the RL
log-prob route, the guards, and the FP8 defaults (routing, GEMM backend, UE8M0 scales).

Tests marked with the ``megatron`` fixture import megatron-core from ``build/sources/megatron`` (``make
sources``) and are skipped where it is absent (CI does not fetch it); every other test uses stand-in modules.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn.functional as F

from zerodiff.integrations import ConfigError
from zerodiff.integrations import megatron as zm

REPO = Path(__file__).resolve().parents[1]
MEGATRON_TREE = REPO / "build" / "sources" / "megatron"


@pytest.fixture
def megatron():
    """megatron-core 0.19.2 from the pinned source tree (skip when it was not fetched)."""
    if not (MEGATRON_TREE / "megatron" / "core" / "package_info.py").exists():
        pytest.skip("build/sources/megatron absent (run `make sources`); CI does not fetch it")
    if str(MEGATRON_TREE) not in sys.path:
        sys.path.insert(0, str(MEGATRON_TREE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401
    return sys.modules["megatron"]


# --------------------------------------------------------------------------- masters written by an optimizer
def _bf16(g, *shape, scale=0.05):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _write_data_copy(param, new):
    """How Megatron's Float16OptimizerWithFloat16Params writes a model param: ``param.data.copy_(main)``."""
    param.data.copy_(new)


def _write_param_buffer(params, news):
    """How the param-and-grad buffers / the distributed optimizer write: params are views of one flat buffer
    (``param.data = buffer[a:b].view(shape)``) and the update is written into the buffer."""
    numel = sum(p.numel() for p in params)
    buf = torch.empty(numel, dtype=params[0].dtype)
    off = 0
    for p in params:
        n = p.numel()
        buf[off:off + n].copy_(p.detach().reshape(-1))
        p.data = buf[off:off + n].view(p.shape)
        off += n
    versions = [p._version for p in params]
    buf.copy_(torch.cat([n.reshape(-1) for n in news]))
    return versions


WRITES = ["data_copy", "param_buffer"]


def _write(style, params, news):
    before = [p._version for p in params]
    if style == "data_copy":
        for p, n in zip(params, news):
            _write_data_copy(p, n)
    else:
        before = _write_param_buffer(params, news)
    # the premise of the defect: neither write moves the parameter's version counter
    assert [p._version for p in params] == before


def _linear(w):
    mod = torch.nn.Module()
    mod.weight = torch.nn.Parameter(w.clone())
    mod.bias = None
    return mod


@pytest.mark.parametrize("style", WRITES)
def test_parallel_linear_follows_masters_written_without_a_version_bump(seeded, style):
    """After an optimizer-style write that does not bump ``weight._version``, the next forward uses the new
    master (== a freshly built module holding the same master), never the previous FP8 copy."""
    g = seeded()
    lin = _linear(_bf16(g, 256, 384))
    x = _bf16(g, 7, 384, scale=1.0)
    before, _ = zm.parallel_linear_fp8(lin, x)
    _write(style, [lin.weight], [_bf16(g, 256, 384)])
    after, _ = zm.parallel_linear_fp8(lin, x)
    fresh, _ = zm.parallel_linear_fp8(_linear(lin.weight.detach()), x)
    assert not torch.equal(before, fresh)  # the update changed the output
    assert torch.equal(after, fresh), float((after.float() - fresh.float()).abs().max())


@pytest.mark.parametrize("style", WRITES)
def test_fp8_linear_module_follows_masters_written_without_a_version_bump(seeded, style):
    g = seeded()
    lin = zm.Fp8Linear(_bf16(g, 128, 256))
    x = _bf16(g, 5, 256, scale=1.0)
    before = lin(x)
    _write(style, [lin.weight], [_bf16(g, 128, 256)])
    fresh = zm.Fp8Linear(lin.weight.detach())(x)
    assert not torch.equal(before, fresh)
    assert torch.equal(lin(x), fresh)


def _experts(fc1, fc2):
    experts = torch.nn.Module()
    experts.local_experts = torch.nn.ModuleList()
    for a, b in zip(fc1, fc2):
        m = torch.nn.Module()
        m.linear_fc1, m.linear_fc2 = _linear(a), _linear(b)
        experts.local_experts.append(m)
    return experts


@pytest.mark.parametrize("style", WRITES)
def test_moe_experts_follow_masters_written_without_a_version_bump(seeded, style):
    g = seeded()
    E, H, I, T, K = 4, 128, 128, 6, 2
    experts = _experts([_bf16(g, 2 * I, H) for _ in range(E)], [_bf16(g, H, I) for _ in range(E)])
    x = _bf16(g, T, H, scale=2.0)
    probs, rmap = zm.topk_routing(torch.randn(T, E, generator=g), K, score_function="sigmoid")
    before = zm.moe_experts(experts, x, probs, rmap, K)
    params = [p for m in experts.local_experts for p in (m.linear_fc1.weight, m.linear_fc2.weight)]
    _write(style, params, [_bf16(g, *p.shape) for p in params])
    fresh = zm.moe_experts(_experts([m.linear_fc1.weight.detach() for m in experts.local_experts],
                                    [m.linear_fc2.weight.detach() for m in experts.local_experts]),
                           x, probs, rmap, K)
    assert not torch.equal(before, fresh)
    assert torch.equal(zm.moe_experts(experts, x, probs, rmap, K), fresh)


def test_float16_optimizer_step_reaches_the_fp8_forward(seeded, megatron):
    """Megatron's own Float16OptimizerWithFloat16Params (its real ``prepare_grads`` and
    ``step_with_ready_grads``: torch Adam on the FP32 main params, then ``_copy_main_params_to_model_params``)
    updates a BF16 master; the next zerodiff FP8 forward is the forward of the new master.

    The optimizer's ``__init__`` needs CUDA (it allocates its unit loss scale on the GPU and accepts only
    ``torch.cuda.*Tensor`` params), so the object is assembled with the attributes ``__init__`` sets; the
    methods that run are upstream's."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    g = seeded()
    lin = _linear(_bf16(g, 256, 256))
    x = _bf16(g, 8, 256, scale=1.0)
    y, _ = zm.parallel_linear_fp8(lin, x)
    y.float().square().sum().backward()
    main = lin.weight.detach().clone().float()
    lin.weight.main_param = main
    opt = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    opt.float16_groups, opt.fp32_from_float16_groups, opt.fp32_from_fp32_groups = [[lin.weight]], [[main]], [[]]
    opt.optimizer = torch.optim.Adam([main], lr=1e-2)
    opt.config = OptimizerConfig(bf16=True, lr=1e-2)
    opt.grad_scaler, opt.is_stub_optimizer, opt._dummy_overflow_buf = None, False, None
    old_master, version = lin.weight.detach().clone(), lin.weight._version
    assert opt.prepare_grads() is False and opt.step_with_ready_grads() is True
    assert not torch.equal(lin.weight.detach(), old_master)  # the step wrote the master ...
    assert lin.weight._version == version  # ... through .data, without a version bump
    after, _ = zm.parallel_linear_fp8(lin, x)
    fresh, _ = zm.parallel_linear_fp8(_linear(lin.weight.detach()), x)
    assert torch.equal(after, fresh), float((after.float() - fresh.float()).abs().max())
