"""The Megatron MoE hook (``zerodiff.integrations.megatron.moe``): the layer's output is the rollout op's,
batch invariant with a stock-combine negative control, straight-through gradients against a float64 graph,
the weight-version check, in-place requantisation, and the refusals."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn.functional as F

from zerodiff.integrations import ConfigError
from zerodiff.integrations import megatron as zm


EXPERT_LAYOUTS = [False, True]  # grouped: TEGroupedMLP-like, else SequentialMLP-like


def _zd_mod():
    from zerodiff.integrations import megatron as zm

    return zm


def _moe_fixture(g, E=8, H=128, I=128, grouped=False):
    fc1 = [torch.nn.Parameter((torch.randn(2 * I, H, generator=g) * 0.05).to(torch.bfloat16)) for _ in range(E)]
    fc2 = [torch.nn.Parameter((torch.randn(H, I, generator=g) * 0.05).to(torch.bfloat16)) for _ in range(E)]
    if grouped:  # TEGroupedMLP-like: linear_fc1.weight{i}
        l1, l2 = torch.nn.Module(), torch.nn.Module()
        for i in range(E):
            l1.register_parameter(f"weight{i}", fc1[i])
            l2.register_parameter(f"weight{i}", fc2[i])
        experts = torch.nn.Module()
        experts.linear_fc1, experts.linear_fc2, experts.num_local_experts = l1, l2, E
    else:  # SequentialMLP-like
        experts = torch.nn.Module()
        experts.local_experts = torch.nn.ModuleList()
        for i in range(E):
            m = torch.nn.Module()
            m.linear_fc1, m.linear_fc2 = torch.nn.Module(), torch.nn.Module()
            m.linear_fc1.weight, m.linear_fc2.weight = fc1[i], fc2[i]
            m.linear_fc1.bias = m.linear_fc2.bias = None
            experts.local_experts.append(m)
    return experts, fc1, fc2


def _moe_layer(experts, k, clamp=None):
    import torch.nn.functional as F

    cfg = NS(expert_model_parallel_size=1, moe_latent_size=None, moe_apply_probs_on_input=False,
             gated_linear_unit=True, activation_func=F.silu, glu_linear_offset=0.0, moe_router_topk=k,
             activation_func_clamp_value=clamp)
    return NS(config=cfg, experts=experts, shared_expert_overlap=False)


def _moe_inputs(g, T, H=128, E=8):
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    logits[:, 1] = logits[:, E - 1]  # exact ties: the larger expert id wins
    return x, logits


@pytest.mark.parametrize("grouped", EXPERT_LAYOUTS)
def test_megatron_moe_layer_value_is_the_rollout_op(seeded, grouped):
    """The patched MoE layer's output == finish(ops.moe.moe_experts(x, route(...)), shared) on the same
    inputs: the slots recovered from Megatron's dense (probs, routing_map) are route's slots exactly (same
    order, same bits); TEGroupedMLP- and SequentialMLP-style modules alike."""
    from zerodiff.ops.moe import MoEWeights, finish, moe_experts, route

    zm = _zd_mod()
    g = seeded()
    experts, fc1, fc2 = _moe_fixture(g, grouped=grouped)
    k = 3
    x, logits = _moe_inputs(g, 19)
    probs, rmap = zm.topk_routing(logits, k, score_function="sigmoid")
    w_ref, ids_ref = route(logits, k, scoring="sigmoid", renormalize=True)
    w, ids = zm.routing_slots(probs, rmap, k)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
    shared = (torch.randn(19, 128, generator=g)).to(torch.bfloat16)
    out = zm.moe_layer_forward(_moe_layer(experts, k, clamp=7.0), x.view(19, 1, 128), probs, rmap, shared)
    dep = MoEWeights.from_master(torch.stack([w.detach() for w in fc1]), torch.stack([w.detach() for w in fc2]), ue8m0=zm.FP8_UE8M0)
    ref = finish(moe_experts(x, w_ref, ids_ref, dep, clamp_limit=7.0), shared)
    assert out.shape == (19, 1, 128) and out.dtype == torch.bfloat16
    assert torch.equal(out.view(19, 128), ref)


def test_megatron_moe_victim_in_batch_and_negative_control(seeded):
    """A token's MoE output is the same alone and among 1..64 other tokens at 3 positions (the contiguous
    layout's rows move with the batch); negative control: a stock-style combine (per-expert BF16 outputs
    summed in expert-ascending order in BF16) changes the bits of some tokens."""
    from zerodiff.ops.moe import MoEWeights, moe_experts

    zm = _zd_mod()
    g = seeded()
    experts, fc1, fc2 = _moe_fixture(g)
    k = 2
    layer = _moe_layer(experts, k)
    xa, la = _moe_inputs(g, 65)

    def run(x, lg):
        p, m = zm.topk_routing(lg, k, score_function="softmax")
        return zm.moe_layer_forward(layer, x, p, m, None)

    alone = run(xa[:1], la[:1])
    for B in (2, 16, 17, 33, 65):
        for at in sorted({0, B // 2, B - 1}):
            x, lg = xa[1:B].clone(), la[1:B].clone()
            x = torch.cat([x[:at], xa[:1], x[at:]])
            lg = torch.cat([lg[:at], la[:1], lg[at:]])
            assert torch.equal(run(x, lg)[at], alone[0]), (B, at)
    # negative control on the same inputs
    p, m = zm.topk_routing(la, k, score_function="softmax")
    w, ids = zm.routing_slots(p, m, k)
    dep = MoEWeights.from_master(torch.stack([w_.detach() for w_ in fc1]), torch.stack([w_.detach() for w_ in fc2]), ue8m0=zm.FP8_UE8M0)
    ours = run(xa, la)
    stock = torch.zeros(65, 128, dtype=torch.bfloat16)
    for j in reversed(range(k)):  # expert id ascending (slots are id-descending), bf16 products and sums
        one = torch.full_like(ids, -1)
        one[:, j] = ids[:, j]
        yj = moe_experts(xa, torch.ones_like(w), one, dep).to(torch.bfloat16)
        stock = stock + (w[:, j:j + 1].to(torch.bfloat16) * yj)
    assert not torch.equal(stock, ours)


def test_megatron_moe_ste_gradients_and_version_check(seeded):
    """Backward: gradients w.r.t. x, the router logits (through probs) and every expert's BF16 master match an
    independent float64 graph (unquantised masters = straight-through) by relative norm error; an in-place
    master update between forward and backward is refused; after an optimizer-style update the deployment
    copy is requantised in place (same storage) and equals a fresh quantisation."""
    import torch.nn.functional as F
    from zerodiff.ops.moe import MoEWeights

    zm = _zd_mod()
    g = seeded()
    experts, fc1, fc2 = _moe_fixture(g, E=4)
    k = 2
    layer = _moe_layer(experts, k, clamp=5.0)
    x, lg = _moe_inputs(g, 11, E=4)
    x.requires_grad_(True)
    lg.requires_grad_(True)
    p, m = zm.topk_routing(lg, k, score_function="softmax")
    out = zm.moe_layer_forward(layer, x, p, m, None)
    go = torch.randn(out.shape, generator=g)
    out.float().backward(go)

    # float64 reference sharing no code with the wrapper
    x64 = x.detach().double().requires_grad_(True)
    l64 = lg.detach().double().requires_grad_(True)
    m64 = [w.detach().double().requires_grad_(True) for w in fc1 + fc2]
    sel = m.nonzero()
    sc = torch.softmax(l64, dim=-1)
    ref = torch.zeros(11, 128, dtype=torch.float64)
    den = (sc * m.double()).sum(-1)
    for t, e in sel.tolist():
        h = m64[e] @ x64[t]
        gt, up = h.chunk(2)
        a = F.silu(gt.clamp(max=5.0)) * up.clamp(-5.0, 5.0)
        ref = ref.index_add(0, torch.tensor([t]), ((sc[t, e] / den[t]) * (m64[4 + e] @ a)).unsqueeze(0))
    ref.backward(go.double())

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert rel(x.grad, x64.grad) < 1e-2
    assert rel(lg.grad, l64.grad) < 1e-2
    for w, w64 in zip(fc1 + fc2, m64):
        if w64.grad.abs().sum() > 0:
            assert rel(w.grad, w64.grad) < 1e-2
    # version check
    out = zm.moe_layer_forward(layer, x, *zm.topk_routing(lg, k, score_function="softmax"), None)
    with torch.no_grad():
        fc2[1].add_(0.01)
    with pytest.raises(zm.WeightVersionError):
        out.float().sum().backward()
    # in-place requantisation after the update
    dep = experts._zerodiff_moe_weights
    ptr = dep.w13.q.data_ptr()
    with torch.no_grad():
        for w in fc1:
            w.mul_(0.5)
    zm.moe_layer_forward(layer, x.detach(), *zm.topk_routing(lg.detach(), k, score_function="softmax"), None)
    fresh = MoEWeights.from_master(torch.stack([w.detach() for w in fc1]), torch.stack([w.detach() for w in fc2]), ue8m0=zm.FP8_UE8M0)
    assert experts._zerodiff_moe_weights is dep and dep.w13.q.data_ptr() == ptr
    assert torch.equal(dep.w13.q.view(torch.uint8), fresh.w13.q.view(torch.uint8))
    assert torch.equal(dep.w2.scale, fresh.w2.scale)


def test_megatron_moe_refusals(seeded):
    zm = _zd_mod()
    g = seeded()
    experts, fc1, fc2 = _moe_fixture(g, E=4)
    x, lg = _moe_inputs(g, 3, E=4)
    p, m = zm.topk_routing(lg, 2, score_function="softmax")
    layer = _moe_layer(experts, 2)
    layer.config.expert_model_parallel_size = 2
    with pytest.raises(ConfigError, match="expert_model_parallel_size=2"):
        zm.moe_layer_forward(layer, x, p, m, None)
    layer = _moe_layer(experts, 2)
    layer.config.moe_apply_probs_on_input = True
    with pytest.raises(ConfigError, match="moe_apply_probs_on_input"):
        zm.moe_layer_forward(layer, x, p, m, None)
    experts.local_experts[0].linear_fc1.bias = torch.nn.Parameter(torch.zeros(256))
    with pytest.raises(ConfigError, match="bias"):
        zm.moe_layer_forward(_moe_layer(experts, 2), x, p, m, None)
    layer = _moe_layer(_moe_fixture(g, E=4)[0], 2)
    layer.fwd_execution_map = ["route"]
    with pytest.raises(ConfigError, match="partial MoE forward"):
        zm.moe_layer_forward(layer, x, p, m, None)
    experts, _, _ = _moe_fixture(g, E=4)
    with pytest.raises(ConfigError, match="router has 8 experts"):
        zm.moe_experts(experts, x, *zm.topk_routing(torch.randn(3, 8), 2), 2)


@pytest.mark.gpu
def test_gpu_megatron_moe_layer_triton_victim_and_value():
    """On the GPU (Triton kernels): the Megatron MoE hook's output == finish(ops.moe.moe_experts(route(...)),
    shared) bit for bit, a token's output is the same alone and among 1..127 others at 3 positions (2 rounds),
    and the STE backward runs and reaches every used expert master."""
    from zerodiff.ops.moe import MoEWeights, finish, moe_experts, route

    zm = _zd_mod()
    g = torch.Generator().manual_seed(11)
    E, H, I, k = 16, 1024, 512, 4
    experts, fc1, fc2 = _moe_fixture(g, E=E, H=H, I=I, grouped=True)
    experts = experts.cuda()
    fc1 = [experts.linear_fc1.get_parameter(f"weight{i}") for i in range(E)]
    fc2 = [experts.linear_fc2.get_parameter(f"weight{i}") for i in range(E)]
    layer = _moe_layer(experts, k, clamp=7.0)
    wr = (torch.randn(E, H, generator=g) * 0.05).to(torch.bfloat16).cuda()
    xs = (torch.randn(128, H, generator=g) * 2).to(torch.bfloat16).cuda()
    sh = torch.randn(128, H, generator=g).to(torch.bfloat16).cuda()

    def run(x, s):
        p, m = zm.topk_routing(zm.router_logits(x, wr), k, score_function="sigmoid")
        return zm.moe_layer_forward(layer, x, p, m, s)

    out = run(xs, sh)
    w, ids = route(zm.router_logits(xs, wr).detach(), k, scoring="sigmoid", renormalize=True)
    dep = MoEWeights.from_master(torch.stack([t.detach() for t in fc1]), torch.stack([t.detach() for t in fc2]), ue8m0=zm.FP8_UE8M0)
    assert torch.equal(out, finish(moe_experts(xs, w, ids, dep, clamp_limit=7.0), sh))
    for rnd in range(2):
        v = 3 + 40 * rnd
        alone = run(xs[v:v + 1], sh[v:v + 1])
        others = [i for i in range(128) if i != v]
        for B in (2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128):
            for at in sorted({0, B // 2, B - 1}):
                order = others[:B - 1]
                order.insert(at, v)
                o = torch.tensor(order, device="cuda")
                assert torch.equal(run(xs[o], sh[o])[at], alone[0]), (rnd, B, at)
    x = xs[:33].clone().requires_grad_(True)
    run(x, sh[:33]).float().square().sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    assert any(t.grad is not None for t in fc1) and all(
        (a.grad is None) == (b.grad is None) for a, b in zip(fc1, fc2))
