"""CPU tests for the Megatron side of zerodiff (``zerodiff.integrations.megatron``) beyond the per-op wrappers
in test_megatron_wrappers.py: deployment copies that follow the masters however an optimizer writes them, the RL
log-prob route, the guards, and the FP8 defaults (routing, GEMM backend, UE8M0 scales).

Tests marked with the ``megatron`` fixture import megatron-core from ``build/sources/megatron`` (``make
sources``) and are skipped where it is absent (CI does not fetch it); every other test uses stand-in modules.
"""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn.functional as F

from zerodiff.integrations import ConfigError
from zerodiff.integrations import megatron as zm


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
    updates the BF16 master of a real ``ColumnParallelLinear``; the next zerodiff FP8 forward is the forward of
    the new master.

    The optimizer's ``__init__`` needs CUDA (it allocates its unit loss scale on the GPU and accepts only
    ``torch.cuda.*Tensor`` params), so the object is assembled with the attributes ``__init__`` sets; the
    methods that run are upstream's."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    g = seeded()
    lin = ColumnParallelLinear(256, 256, config=ModelParallelConfig(use_cpu_initialization=True,
                                                                    params_dtype=torch.bfloat16),
                               init_method=lambda w: w.copy_(_bf16(g, 256, 256)), bias=False)
    x = _bf16(g, 8, 256, scale=1.0)
    y, _ = zm.parallel_linear(lin, x)
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
    after, _ = zm.parallel_linear(lin, x)
    fresh, _ = zm.parallel_linear(_linear(lin.weight.detach()), x)
    assert torch.equal(after, fresh), float((after.float() - fresh.float()).abs().max())


# ------------------------------------------------------------------------------ FP8 defaults: routing (D)
def _parallel(w, **attrs):
    mod = _linear(w)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def test_every_parallel_linear_is_routed_by_default(seeded):
    """With the switch on, the hook routes every Column/RowParallelLinear: unmarked -> block FP8 (the deployment
    rule), ``zerodiff_fp8 = False`` -> zerodiff's BF16 GEMM, the LM head -> FP32 logits; each equals the op the
    rollout runs, and gradients reach the master."""
    from zerodiff.ops.bf16_gemm import bf16_gemm
    from zerodiff.ops.fp8_gemm import fp8_linear
    from zerodiff.ops.fp8_quant import Fp8Weight

    g = seeded()
    x = _bf16(g, 3, 2, 256, scale=1.0).requires_grad_(True)
    w = _bf16(g, 384, 256)
    fp8_mod, bf16_mod = _parallel(w), _parallel(w)
    assert zm.mark_bf16_linears(torch.nn.ModuleDict({"a": bf16_mod}), lambda n, m: n == "a") == ["a"]
    y8, b8 = zm.parallel_linear(fp8_mod, x)
    y16, b16 = zm.parallel_linear(bf16_mod, x)
    assert b8 is None and b16 is None and y8.dtype == y16.dtype == torch.bfloat16
    x2 = x.detach().reshape(6, 256)
    assert torch.equal(y8.detach().reshape(6, 384), fp8_linear(x2, Fp8Weight.from_master(w, ue8m0=zm.FP8_UE8M0)))
    assert torch.equal(y16.detach().reshape(6, 384), bf16_gemm(x2, w))
    assert not torch.equal(y8, y16)
    (y8.float().sum() + y16.float().sum()).backward()
    assert fp8_mod.weight.grad is not None and bf16_mod.weight.grad is not None and x.grad is not None
    # marking a layer FP8 again restores the default
    zm.mark_fp8_linears(torch.nn.ModuleDict({"a": bf16_mod}), lambda n, m: n == "a")
    assert torch.equal(zm.parallel_linear(bf16_mod, x.detach())[0], y8.detach())


def test_lm_head_logits_and_log_probs_are_the_rollouts(seeded):
    """The output layer (weight tagged ``is_embedding_or_output_parameter``, also when the shared embedding is
    passed as ``weight``) gives the rollout's FP32 logits (vLLM ``lm_head_logits``), and the Megatron-RL log-probs
    read from them are the rollout's sampled-token log-probs, bit for bit."""
    from zerodiff.integrations import vllm as zv
    from zerodiff.ops.logprobs import token_logprobs

    g = seeded()
    S, B, H, V = 7, 2, 128, 1000
    w = _bf16(g, V, H, scale=0.2)
    head = _parallel(w)
    head.weight.is_embedding_or_output_parameter = True
    shared = _parallel(w)
    shared.weight = None  # skip_weight_param_allocation: the embedding weight comes with the call
    emb = torch.nn.Parameter(w.clone())
    emb.is_embedding_or_output_parameter = True
    h = _bf16(g, S, B, H, scale=1.0)
    tokens = torch.randint(0, V, (B, S), generator=g)
    rollout_logits = zv.lm_head_logits(h, w)
    for logits, _ in (zm.parallel_linear(head, h), zm.parallel_linear(shared, h, emb)):
        assert logits.dtype == torch.float32 and torch.equal(logits, rollout_logits)
        bsv = logits.transpose(0, 1).contiguous()  # GPTModel's [b, s, V] output
        lp = zm.selective_log_softmax(bsv[:, :-1, :], tokens[:, 1:])  # get_logprobs' call
        want = token_logprobs(rollout_logits.transpose(0, 1)[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
        assert torch.equal(lp.reshape(-1), want)


@pytest.mark.parametrize("bad,needle", [
    (dict(bias=torch.nn.Parameter(torch.zeros(384))), "a bias"),
    (dict(output_size_per_partition=192, output_size=384), "tensor_model_parallel_size must be 1"),
    (dict(input_size_per_partition=128, input_size=256), "input_size_per_partition=128"),
    (dict(sequence_parallel=True), "sequence_parallel"),
])
def test_parallel_linear_refuses_what_it_cannot_route(seeded, bad, needle):
    g = seeded()
    mod = _parallel(_bf16(g, 384, 256))
    for k, v in bad.items():
        setattr(mod, k, v)
    with pytest.raises(ConfigError, match=needle):
        zm.parallel_linear(mod, _bf16(g, 2, 256))
    with pytest.raises(ConfigError, match="bfloat16"):
        zm.parallel_linear(_parallel(torch.zeros(8, 256)), _bf16(g, 2, 256))


# ----------------------------------------------------------------------- FP8 defaults: GEMM backend (D)
def test_fp8_gemm_backend_is_pinned_never_probed(monkeypatch):
    import zerodiff.ops.fp8_gemm as og

    def no_probe(*a, **k):
        raise AssertionError("the Megatron side must not probe the GEMM backend")

    monkeypatch.setattr(og, "deepgemm_verdict", no_probe)
    monkeypatch.delenv("ZERODIFF_FP8_GEMM_BACKEND", raising=False)
    assert zm.fp8_gemm_backend("cpu") == "reference"
    assert zm.fp8_gemm_backend(torch.device("cuda", 0)) == "triton"  # vllm-check's default pin
    for v in ("triton", "deepgemm", "reference"):
        assert zm.fp8_gemm_backend("cuda", {"ZERODIFF_FP8_GEMM_BACKEND": v}) == v
    assert zm.fp8_gemm_backend("cuda", {"ZERODIFF_FP8_GEMM_BACKEND": ""}) == "triton"
    with pytest.raises(ConfigError, match="ZERODIFF_FP8_GEMM_BACKEND='auto'"):
        zm.fp8_gemm_backend("cuda", {"ZERODIFF_FP8_GEMM_BACKEND": "auto"})
    assert zm.moe_backend("cuda") == "triton" and zm.moe_backend("cpu") == "reference"
    cfg = NS(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, transformer_impl="local")
    with pytest.raises(ConfigError, match="ZERODIFF_FP8_GEMM_BACKEND='dg'"):  # refused at start
        zm.check_transformer_config(cfg, {**ON, "ZERODIFF_FP8_GEMM_BACKEND": "dg"})


def test_forward_passes_the_pinned_backend(seeded, monkeypatch):
    """The FP8 linear and the experts call the ops with an explicit backend (the op never resolves None)."""
    import zerodiff.ops.fp8_gemm as og
    import zerodiff.ops.moe as om

    seen = {}
    real_lin, real_moe = og.fp8_linear, om.moe_experts

    def spy_lin(x, w, *, backend=None):
        seen["linear"] = backend
        return real_lin(x, w, backend=backend)

    def spy_moe(*a, backend=None, **k):
        seen["moe"] = backend
        return real_moe(*a, backend=backend, **k)

    monkeypatch.setattr(og, "fp8_linear", spy_lin)
    monkeypatch.setattr(om, "moe_experts", spy_moe)
    g = seeded()
    zm.parallel_linear(_parallel(_bf16(g, 128, 128)), _bf16(g, 3, 128))
    experts = _experts([_bf16(g, 256, 128) for _ in range(2)], [_bf16(g, 128, 128) for _ in range(2)])
    probs, rmap = zm.topk_routing(torch.randn(3, 2, generator=g), 1, score_function="sigmoid")
    zm.moe_experts(experts, _bf16(g, 3, 128), probs, rmap, 1)
    assert seen == {"linear": "reference", "moe": "reference"}  # CPU tensors: fp8_gemm_backend / moe_backend


# ---------------------------------------------------------------------- FP8 defaults: UE8M0 scales (D)
def _is_pow2(t):
    m, _ = torch.frexp(t.float())
    return bool(((m == 0.5) & (t > 0)).all())


def _ue8m0_checkpoint(g, N, K):
    """A block-FP8 checkpoint weight with power-of-two (UE8M0) scales; block (0, 0) has its largest code at
    exactly 224, so requantising its master halves the scale and doubles the codes (same values)."""
    from zerodiff.ops.fp8_quant import quant_weight

    q, s = quant_weight(_bf16(g, N, K, scale=0.3), ue8m0=True, backend="reference")
    blk = q[:128, :128].float().clamp(-224, 224)
    blk[0, 0] = 224.0
    q[:128, :128] = blk.to(q.dtype)
    return q, s


def test_deployment_scales_are_ue8m0_and_reproduce_the_checkpoint(seeded, monkeypatch):
    """Megatron's master loaded from a UE8M0 checkpoint (``bf16(q * s)``, exact) is requantised to the same
    values, so the training FP8 forward equals the rollout's forward on the checkpoint bytes (vLLM's
    ``fp8_block_linear`` with ``ue8m0=True``, its ``is_deep_gemm_e8m0_used()`` default). Negative control: the
    FP32-scale rule (``ue8m0=False``) requantises the same master to other values and the outputs differ."""
    from zerodiff.integrations import vllm as zv
    from zerodiff.integrations.megatron import linear as zl
    from zerodiff.reference.fp8_quant import dequant_weight_block_ref

    g = seeded()
    N, K = 256, 384
    q, s = _ue8m0_checkpoint(g, N, K)
    deq = dequant_weight_block_ref(q, s, 128)
    master = deq.to(torch.bfloat16)
    assert torch.equal(master.float(), deq)  # the checkpoint's values are exact in BF16
    x = _bf16(g, 9, K, scale=1.0)
    rollout = zv.fp8_block_linear(x, q, s, ue8m0=True)
    mod = _parallel(master)
    train, _ = zm.parallel_linear(mod, x)
    dep = mod._zerodiff_fp8_weight
    assert dep.ue8m0 is True and _is_pow2(dep.scale)
    assert torch.equal(dequant_weight_block_ref(dep.q, dep.scale, 128), deq)  # same values ...
    assert float(dep.scale[0, 0]) == float(s[0, 0]) / 2  # ... in other bytes where the top code was 224
    assert torch.equal(train, rollout)
    # the MoE deployment copies use the same scales
    experts = _experts([master[:, :128].contiguous()], [master[:128, :128].contiguous()])
    probs, rmap = zm.topk_routing(torch.randn(9, 1, generator=g), 1, score_function="sigmoid")
    zm.moe_experts(experts, _bf16(g, 9, 128), probs, rmap, 1)
    mw = experts._zerodiff_moe_weights
    assert mw.w13.ue8m0 and mw.w2.ue8m0 and _is_pow2(mw.w13.scale) and _is_pow2(mw.w2.scale)
    # negative control: FP32 scales
    monkeypatch.setattr(zl, "FP8_UE8M0", False)
    fp32_scales, _ = zm.parallel_linear(_parallel(master), x)
    assert not torch.equal(fp32_scales, rollout)


# ----------------------------------------------------------------------------- Megatron-RL log-probs (B)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_is_the_rollout_op(seeded, dtype):
    """``selective_log_softmax(logits[:, :-1], tokens[:, 1:])`` (Megatron-RL's ``get_logprobs`` call) equals
    ``zerodiff.ops.logprobs.token_logprobs`` on the same rows with ``torch.equal``, FP32, whatever the batch; the
    backward is softmax - onehot. Negative control: the stock formula (log_softmax, then gather) gives other
    bits on the same inputs; the reasons are precision only (a BF16 result for BF16 logits, another reduction
    order for FP32), there is no batch-composition control on the CPU."""
    from zerodiff.ops.logprobs import token_logprobs

    g = seeded()
    B, S, V = 4, 9, 3000
    logits = (torch.randn(B, S, V, generator=g) * 4).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, V, (B, S), generator=g)
    lp = zm.selective_log_softmax(logits[:, :-1, :], tokens[:, 1:])
    want = token_logprobs(logits.detach()[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1)).view(B, S - 1)
    assert lp.dtype == torch.float32 and torch.equal(lp.detach(), want)
    for b in range(B):  # a sequence alone == inside the batch
        alone = zm.selective_log_softmax(logits.detach()[b:b + 1, :-1], tokens[b:b + 1, 1:])
        assert torch.equal(alone[0], want[b])
    stock = torch.gather(logits.detach()[:, :-1].log_softmax(-1), -1, tokens[:, 1:, None])[..., 0]
    assert stock.dtype == dtype and not torch.equal(stock.float(), want)
    gy = torch.randn(B, S - 1, generator=g)
    lp.backward(gy)
    p = torch.softmax(logits.detach().double()[:, :-1], -1)
    ref = -p * gy.double()[..., None]
    ref.scatter_add_(-1, tokens[:, 1:, None], gy.double()[..., None])
    got = logits.grad[:, :-1].double()
    assert float((got - ref).norm() / ref.norm()) < 1e-2 and not logits.grad[:, -1].any()
    with pytest.raises(ConfigError, match="leading shape"):
        zm.selective_log_softmax(logits.detach(), tokens[:, 1:])


def _stand_in_rl_utils():
    """A stand-in for ``megatron.rl.rl_utils`` (absent from the megatron-core sdist): a stock log-prob function
    and a caller that, like ``get_logprobs``, looks the function up in its module at call time."""
    import types

    mod = types.ModuleType("megatron.rl.rl_utils")

    def selective_log_softmax(logits, index):
        return torch.gather(logits.log_softmax(-1), -1, index[..., None])[..., 0]

    def get_logprobs_from_logits(logits, tokens):
        return mod.selective_log_softmax(logits[:, :-1, :], tokens[:, 1:])

    mod.selective_log_softmax = selective_log_softmax
    mod.get_logprobs_from_logits = get_logprobs_from_logits
    return mod


def test_route_rl_logprobs_replaces_the_module_function(seeded):
    from zerodiff.ops.logprobs import token_logprobs

    rl = _stand_in_rl_utils()
    stock = rl.selective_log_softmax
    g = seeded()
    logits = (torch.randn(2, 6, 500, generator=g) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 500, (2, 6), generator=g)
    assert zm.route_rl_logprobs(rl) is True
    assert rl.selective_log_softmax is zm.selective_log_softmax and rl._zerodiff_stock_selective_log_softmax is stock
    got = rl.get_logprobs_from_logits(logits, tokens)
    assert torch.equal(got.reshape(-1), token_logprobs(logits[:, :-1].reshape(-1, 500), tokens[:, 1:].reshape(-1)))
    assert zm.route_rl_logprobs(rl) is False and rl._zerodiff_stock_selective_log_softmax is stock  # idempotent
    with pytest.raises(ConfigError, match="no selective_log_softmax"):
        zm.route_rl_logprobs(NS(__name__="megatron.rl.rl_utils"))


# -------------------------------------------------------------------------------------------- guards (C)
ON = {"ZERODIFF_CONSISTENT": "1"}


def _cls(module, name):
    return type(name, (), {"__module__": module})


@pytest.mark.parametrize("module,name,needle", [
    ("megatron.core.extensions.transformer_engine", "TELinear", "transformer_impl='local'"),
    ("megatron.core.extensions.transformer_engine", "TELayerNormColumnParallelLinear", "Transformer Engine"),
    ("megatron.core.extensions.transformer_engine", "TEDotProductAttention", "TEDotProductAttention"),
    ("megatron.core.transformer.moe.experts", "TEGroupedMLP", "TEGroupedMLP"),
    ("megatron.core.transformer.multi_latent_attention", "MLASelfAttention", "multi_latent_attention=True"),
    ("megatron.core.transformer.experimental_attention_variant.dsa", "DSAttention", "DSA"),
    ("megatron.core.transformer.experimental_attention_variant.dsa", "DSAIndexer", "DSAIndexer"),
])
def test_spec_guard_refuses_unrouted_modules(module, name, needle):
    with pytest.raises(ConfigError, match=needle) as ei:
        zm.check_module_class(_cls(module, name), ON)
    assert name in str(ei.value)
    assert zm.check_module_class(_cls(module, name), {}) is False  # switch off: nothing checked


def test_spec_guard_accepts_routed_modules():
    for module, name in (("megatron.core.extensions.transformer_engine", "TENorm"),
                         ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear"),
                         ("megatron.core.transformer.attention", "SelfAttention"),
                         ("megatron.core.transformer.moe.experts", "SequentialMLP")):
        assert zm.check_module_class(_cls(module, name), ON) is True
    assert zm.check_module_class(F.silu, ON) is True  # functions in specs are not modules


def test_spec_guard_on_megatrons_own_classes(megatron):
    """The real classes of megatron-core 0.19.2: the TE spec's modules, MLA (also from the local spec with
    ``multi_latent_attention=True``) and DSA are refused; the local spec's modules and TENorm pass."""
    warnings.simplefilter("ignore")
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    refused = [te.TELinear, te.TELayerNormColumnParallelLinear, te.TEColumnParallelLinear, te.TERowParallelLinear,
               te.TEDotProductAttention, te.TEGroupedLinear, TEGroupedMLP, MLASelfAttention, dsa.DSAttention,
               dsa.DSAIndexer]
    # without Transformer Engine installed megatron defines its TE wrappers as mocks (or None): only real
    # classes can be built, so only those are checked here (the stand-in test above covers the names)
    refused = [c for c in refused if isinstance(c, type)]
    assert {TEGroupedMLP, MLASelfAttention, dsa.DSAttention, dsa.DSAIndexer} <= set(refused)
    for cls in refused:
        with pytest.raises(ConfigError, match=cls.__name__):
            zm.check_module_class(cls, ON)
    for cls in (te.TENorm, ColumnParallelLinear, RowParallelLinear, SequentialMLP):
        assert zm.check_module_class(cls, ON) is True
    mla = get_gpt_layer_local_spec(num_experts=None, multi_latent_attention=True).submodules.self_attention.module
    with pytest.raises(ConfigError, match="multi_latent_attention"):
        zm.check_module_class(mla, ON)


GOOD_RL = dict(perform_rl_step=True, grpo_iterations=1, grpo_prompts_per_step=32, grpo_group_size=8,
               global_batch_size=256, rl_partial_rollouts=False, rl_generation_lag=0)


@pytest.mark.parametrize("key,value,needle", [
    ("grpo_iterations", 2, "grpo_iterations=2"),
    ("global_batch_size", 64, "feeds 4 optimizer updates"),
    ("rl_partial_rollouts", True, "rl_partial_rollouts=True"),
    ("rl_generation_lag", 1, "rl_generation_lag=1"),
])
def test_rl_args_guard_refuses_more_than_one_update_per_rollout(key, value, needle):
    zm.validate_training_args(**GOOD_RL)
    with pytest.raises(ConfigError, match=needle) as ei:
        zm.validate_training_args(**{**GOOD_RL, key: value})
    assert "Megatron RL" in str(ei.value)
    zm.validate_training_args(**{**GOOD_RL, key: value, "perform_rl_step": False})  # not an RL run
    args = NS(**{**GOOD_RL, key: value})
    assert zm.check_training_args(args, {}) is False
    with pytest.raises(ConfigError, match=needle):
        zm.check_training_args(args, ON)


def test_rl_args_guard_uses_megatrons_defaults():
    """Megatron's own default is grpo_iterations=2: an RL run that does not set it is refused."""
    args = NS(perform_rl_step=True, grpo_prompts_per_step=32, grpo_group_size=2, global_batch_size=64,
              grpo_iterations=2)
    with pytest.raises(ConfigError, match="grpo_iterations=2"):
        zm.check_training_args(args, ON)


def test_config_guard_reads_the_initialised_parallel_state(monkeypatch):
    """A config that says TP = 1 while ``parallel_state`` was initialised with a TP group of 2 is refused."""
    import types

    ps = types.ModuleType("megatron.core.parallel_state")
    ps.model_parallel_is_initialized = lambda: True
    ps.get_tensor_model_parallel_world_size = lambda: 2
    ps.get_expert_tensor_parallel_world_size = lambda: 1
    ps.get_expert_model_parallel_world_size = lambda: 1
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    cfg = NS(tensor_model_parallel_size=1, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
             transformer_impl="local")
    with pytest.raises(ConfigError, match="parallel_state tensor-parallel world size 2"):
        zm.check_transformer_config(cfg, ON)
    ps.get_tensor_model_parallel_world_size = lambda: 1
    assert zm.check_transformer_config(cfg, ON) is True
    ps.model_parallel_is_initialized = lambda: False  # before initialisation only the config is checked
    ps.get_tensor_model_parallel_world_size = lambda: 8
    assert zm.check_transformer_config(cfg, ON) is True
