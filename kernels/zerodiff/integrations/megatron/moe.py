"""MoE experts: Megatron's routed experts and their combine through ``zerodiff.ops.moe``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import ConfigError
from .common import _check_versions, _versions
from . import linear
from .layers import _swiglu_graph
from .linear import moe_backend

__all__ = ["expert_master_weights", "routing_slots", "moe_experts", "moe_layer_forward"]


def expert_master_weights(experts: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The BF16 master weights of a Megatron expert module, per local expert: ``fc1 [2I, H]`` (gate rows,
    then up rows: Megatron's GLU chunk order) and ``fc2 [H, I]``. ``SequentialMLP``
    (``local_experts[i].linear_fc1/linear_fc2.weight``) and ``TEGroupedMLP`` with per-expert weights
    (``linear_fc1.weight{i}``); a single grouped weight, the legacy ``GroupedMLP`` and biases are refused."""
    if hasattr(experts, "local_experts"):
        mods = list(experts.local_experts)
        fc1 = [m.linear_fc1.weight for m in mods]
        fc2 = [m.linear_fc2.weight for m in mods]
        bias = any(getattr(m.linear_fc1, "bias", None) is not None or getattr(m.linear_fc2, "bias", None) is not None
                   for m in mods)
    elif hasattr(experts, "linear_fc1") and hasattr(experts, "num_local_experts"):
        n = int(experts.num_local_experts)
        if getattr(experts.linear_fc1, "single_grouped_weight", False) or getattr(experts.linear_fc2,
                                                                                  "single_grouped_weight", False):
            raise ConfigError("zerodiff MoE: moe_single_grouped_weight is not supported in consistency mode "
                              "(use per-expert weights)")
        fc1 = [getattr(experts.linear_fc1, f"weight{i}", None) for i in range(n)]
        fc2 = [getattr(experts.linear_fc2, f"weight{i}", None) for i in range(n)]
        if any(w is None for w in fc1 + fc2):
            raise ConfigError(f"zerodiff MoE: {type(experts).__name__} has no per-expert weight0..weight{n - 1}")
        bias = bool(getattr(experts.linear_fc1, "use_bias", False) or getattr(experts.linear_fc2, "use_bias", False))
    else:
        raise ConfigError(f"zerodiff MoE: expert module {type(experts).__name__} is not supported in consistency "
                          "mode (use SequentialMLP or TEGroupedMLP)")
    if bias:
        raise ConfigError("zerodiff MoE: expert biases are not supported in consistency mode (add_bias_linear=False)")
    for w in fc1 + fc2:
        if w.dtype != torch.bfloat16:
            raise ConfigError(f"zerodiff MoE: expert master weights must be bfloat16, got {w.dtype}")
    return fc1, fc2


def routing_slots(probs: torch.Tensor, routing_map: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's dense ``(probs [T, E], routing_map bool [T, E])`` -> the rollout's slots ``(weights fp32
    [T, k], ids int32 [T, k])``: a token's selected experts in **expert id descending** order (the slot
    order of ``zerodiff.ops.moe.route``, hence of the rollout's combine), ``-1`` / weight 0 where a token has
    fewer than k (padding tokens). Differentiable w.r.t. ``probs``."""
    E = routing_map.shape[-1]
    rm = routing_map.reshape(-1, E)
    p = probs.reshape(-1, E)
    cand = torch.where(rm, torch.arange(E, device=rm.device).expand_as(rm), torch.full_like(rm, -1, dtype=torch.long))
    ids = torch.sort(cand, dim=-1, descending=True).values[:, :topk]
    w = p.float().gather(1, ids.clamp(min=0))
    w = torch.where(ids >= 0, w, torch.zeros((), dtype=w.dtype, device=w.device))
    return w, ids.to(torch.int32)


def _experts_graph(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, fc1, fc2, clamp_limit):
    """FP32 PyTorch graph of the routed experts (STE: unquantised masters), combined in slot order."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(len(fc1)):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        h = x[t] @ fc1[e].t()
        y = _swiglu_graph(h, clamp_limit) @ fc2[e].t()
        out = out.index_add(0, t, w[t, j].unsqueeze(-1) * y)
    return out


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, ids, deployed, clamp_limit, n_experts, *masters):
        from ...ops.moe import moe_experts as zd_moe_experts

        ctx.save_for_backward(x2, w, ids)
        ctx.zd_weights = masters
        ctx.zd_versions = _versions(*masters)
        ctx.clamp_limit = clamp_limit
        ctx.n = n_experts
        return zd_moe_experts(x2, w.detach(), ids, deployed, layout="contiguous", clamp_limit=clamp_limit,
                              backend=moe_backend(x2.device))

    @staticmethod
    def backward(ctx, g):
        masters = ctx.zd_weights
        _check_versions(ctx, *masters)
        x2, w, ids = ctx.saved_tensors
        n = ctx.n
        with torch.enable_grad():
            xf = x2.detach().float().requires_grad_(ctx.needs_input_grad[0])
            wf = w.detach().float().requires_grad_(ctx.needs_input_grad[1])
            mf = [m.detach().float().requires_grad_(True) for m in masters]
            y = _experts_graph(xf, wf, ids.long(), mf[:n], mf[n:], ctx.clamp_limit)
            leaves = [xf, wf] + mf
            want = [t.requires_grad for t in leaves]
            grads = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], g.float(), allow_unused=True)
        it = iter(grads)
        full = [next(it) if wnt else None for wnt in want]
        gx = None if full[0] is None else full[0].to(x2.dtype)
        gw = None if full[1] is None else full[1].to(w.dtype)
        gm = [None if gm_ is None else gm_.to(m.dtype) for gm_, m in zip(full[2:], masters)]
        return (gx, gw, None, None, None, None, *gm)


@torch.no_grad()
def _moe_deployment(experts: torch.nn.Module, fc1, fc2):
    """Per-module stacked block-FP8 deployment copy of the experts (``MoEWeights``), requantised IN PLACE
    (same storage) from the masters on every call, for the reason given in
    :func:`zerodiff.integrations.megatron.linear.deploy_fp8` (optimizer writes do not move ``_version``)."""
    from ...ops.moe import MoEWeights

    with torch.inference_mode(False):
        w13 = torch.stack([w.detach() for w in fc1])
        w2 = torch.stack([w.detach() for w in fc2])
        dep = getattr(experts, "_zerodiff_moe_weights", None)
        if (dep is None or dep.num_experts != len(fc1) or dep.w13.q.device != fc1[0].device
                or tuple(dep.w13.q.shape) != tuple(w13.shape) or tuple(dep.w2.q.shape) != tuple(w2.shape)
                or dep.w13.ue8m0 != linear.FP8_UE8M0):
            dep = MoEWeights.from_master(w13, w2, ue8m0=linear.FP8_UE8M0)
            experts._zerodiff_moe_weights = dep
        else:
            dep.requantize_(w13, w2)
    return dep


def moe_experts(experts: torch.nn.Module, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                topk: int, clamp_limit: float | None = None) -> torch.Tensor:
    """Routed experts of a Megatron MoE layer through ``zerodiff.ops.moe.moe_experts`` (contiguous layout):
    the same FP8 activation per token, the same per-row grouped FP8 GEMMs and SiLU*mul->FP8 as the rollout,
    combined on the token in FP32 in slot order (expert id descending). ``x`` bf16 ``[..., H]``, ``probs`` /
    ``routing_map`` ``[T, E]`` from the router. Returns FP32 ``[T, H]``. Backward straight-through: an FP32
    graph with the BF16 masters (FP8 quantisation as identity) gives the gradients w.r.t. ``x``, ``probs``
    and every expert's master weights; the masters' versions are checked first."""
    fc1, fc2 = expert_master_weights(experts)
    if routing_map.shape[-1] != len(fc1):
        raise ConfigError(f"zerodiff MoE: the router has {routing_map.shape[-1]} experts but the expert module "
                          f"holds {len(fc1)} (expert_model_parallel_size must be 1 in consistency mode)")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff MoE: expert input must be bfloat16, got {x2.dtype}")
    w, ids = routing_slots(probs, routing_map, topk)
    dep = _moe_deployment(experts, fc1, fc2)
    return _MoEExperts.apply(x2.contiguous(), w, ids, dep, clamp_limit, len(fc1), *fc1, *fc2)


def moe_layer_forward(layer: Any, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                      shared_expert_output: torch.Tensor | None, intermediate_tensors=None) -> torch.Tensor:
    """The patched ``MoELayer.forward`` body after routing: ``finish(moe_experts(...), shared)`` =
    ``bf16(routed_fp32 + fp32(shared_bf16))`` (one rounding, ``zerodiff.ops.moe.finish``), in the shape of
    ``hidden_states``. The token dispatcher (permute / unpermute) is not used: every expert is local
    (EP = 1) and the combine is the op's FP32 slot-order sum. Refused: expert parallelism, latent MoE,
    shared-expert overlap, ``moe_apply_probs_on_input``, non-SwiGLU experts, and a partial forward (MoE CUDA-graph
    partial capture: ``fwd_execution_map`` without ``expert_compute`` / ``postprocess``, or intermediate tensors)."""
    cfg = layer.config
    problems = []
    fmap = getattr(layer, "fwd_execution_map", None)
    if intermediate_tensors is not None or (fmap is not None and not {"route", "expert_compute",
                                                                       "postprocess"} <= set(fmap)):
        problems.append("a partial MoE forward (cuda_graph_modules capturing MoE parts / intermediate tensors)")
    if int(getattr(cfg, "expert_model_parallel_size", 1) or 1) > 1:
        problems.append(f"expert_model_parallel_size={cfg.expert_model_parallel_size} (needs 1)")
    if getattr(cfg, "moe_latent_size", None):
        problems.append("moe_latent_size (latent MoE projections)")
    if getattr(layer, "shared_expert_overlap", False):
        problems.append("moe_shared_expert_overlap")
    if getattr(cfg, "moe_apply_probs_on_input", False):
        problems.append("moe_apply_probs_on_input")
    if not getattr(cfg, "gated_linear_unit", False) or getattr(cfg, "activation_func", F.silu) is not F.silu:
        problems.append("experts must be SwiGLU (gated_linear_unit=True, activation_func=F.silu)")
    if getattr(cfg, "glu_linear_offset", 0.0):
        problems.append(f"glu_linear_offset={cfg.glu_linear_offset}")
    if problems:
        raise ConfigError("zerodiff MoE layer cannot run in consistency mode: " + "; ".join(problems))
    routed = moe_experts(layer.experts, hidden_states, probs, routing_map, int(cfg.moe_router_topk),
                         getattr(cfg, "activation_func_clamp_value", None))
    from ...ops.moe import finish  # plain torch: differentiable as written

    shared = None if shared_expert_output is None else shared_expert_output.reshape(routed.shape)
    return finish(routed, shared).view(hidden_states.shape)
