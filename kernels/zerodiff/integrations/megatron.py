"""megatron-core 0.19.2 glue: the fail-closed config guard and the training-side autograd wrappers that
the ``patches/megatron`` series calls when consistency mode is on (``ZERODIFF_CONSISTENT=1``).

The rule (DESIGN "The one rule"): the training forward calls the SAME zerodiff ops the rollout calls, with
the same arguments, so every forward value is bit-identical to the rollout's; each op is wrapped in an
``autograd.Function`` whose backward differentiates an equivalent FP32 PyTorch graph (recomputed from
the saved inputs) w.r.t. the BF16 inputs/master weights. Every backward first checks that the weights are
the version the forward saw (:class:`WeightVersionError` otherwise).

Config guard
------------
``validate_config(**plain_values)`` / ``check_transformer_config(config)`` (called at the end of the
patched ``TransformerConfig.__post_init__``) refuse, naming the setting:

* ``tensor_model_parallel_size > 1`` and ``expert_tensor_parallel_size > 1``: TP reductions in the
  compared path (DESIGN "cross-GPU"); ``sequence_parallel`` (only meaningful with TP).
* ``context_parallel_size > 1`` unless ``cp_comm_type == "all_gather"`` (the contract allows a CP
  all-gather only, never a partial-attention merge).
* ``normalization`` other than ``RMSNorm``, ``layernorm_zero_centered_gamma``, ``fused_residual_rmsnorm``
  (the zerodiff norm has neither the shifted gamma nor TE's fused-residual interface).
* MLP: ``gated_linear_unit`` must be on with ``activation_func`` SiLU (SwiGLU), ``glu_linear_offset == 0``,
  ``use_te_activation_func`` off, ``add_bias_linear`` off (the rollout has no biases there).
* MoE (``num_moe_experts`` set): ``moe_router_dtype`` must be ``fp32``; refused:
  ``moe_router_num_groups``/``moe_router_group_topk`` (group-limited routing), ``moe_expert_capacity_factor``
  (token dropping depends on the batch), ``moe_input_jitter_eps`` (random noise), ``moe_enable_routing_replay``
  (consistency mode computes routing itself), ``moe_router_force_load_balancing``,
  ``moe_router_force_biased``, ``moe_apply_probs_on_input`` (scales before FC2 with an extra rounding; the
  contract combines in FP32 after), ``moe_router_score_function`` outside softmax/sigmoid/sqrtsoftplus,
  ``moe_router_load_balancing_type`` ``sinkhorn``/``quantile_balancing`` (they bypass the top-k).
* ``cross_entropy_loss_fusion``: the fused CE bypasses the patched ``vocab_parallel_cross_entropy``, whose
  loss is ``-`` the rollout's sampled-token log-prob. Refused.
* ``hidden_dropout`` / ``attention_dropout`` > 0: the rollout has no dropout. Refused.
* ``fp8``/``fp4`` recipes through Transformer Engine: refused; FP8 linears go through
  :func:`fp8_linear` (``Fp8Linear``) instead (DESIGN "dense block-FP8 GEMM").

Autograd wrappers (public)
--------------------------
* ``router_logits(x, weight, bias=None) -> fp32``: ``zerodiff.ops.router_gemm`` (x bf16 ``[..., H]``,
  weight bf16 ``[E, H]``); backward: FP32 ``grad @ W`` / ``grad^T @ x`` cast to the input dtypes.
* ``topk_routing(logits, topk, *, score_function, use_pre_softmax, scaling_factor, expert_bias)
  -> (probs [T, E], routing_map bool [T, E])``: values from ``zerodiff.ops.moe.route`` (deterministic
  top-k, ties to the larger expert id); gradient through the same formula in PyTorch at the selected ids
  (``visible + (graph - graph.detach())``). Renormalisation: on for sigmoid/sqrtsoftplus (k > 1) and for
  softmax applied after the top-k; off for pre-softmax (Megatron's own semantics).
* ``swiglu(x, clamp_limit=None)``: ``zerodiff.ops.silu_mul_quant.silu_mul`` (one BF16 rounding);
  backward: FP32 graph of the clamped SiLU*up. ``mlp_activation(config, activation_func, x, bias,
  per_token_scale)`` is the MLP hook.
* ``RMSNorm(hidden_size, eps, config=None)``: a ``torch.nn.Module`` with one ``weight`` parameter (same
  state-dict key as the stock norms), forward ``zerodiff.ops.rmsnorm.rms_norm``; backward: FP32 graph.
* ``cross_entropy(logits, target, label_smoothing=0.0) -> fp32``: ``-zerodiff.ops.logprobs.token_logprobs``
  (negation is exact, so ``-loss`` is bit-identical to the rollout's sampled-token log-prob); backward
  ``softmax - onehot`` in FP32. ``token_logprobs(logits, target, temperature=1.0)`` is the same with the
  sign of a log-prob.
* ``Fp8Linear`` / ``fp8_linear(x, master_weight, fp8_weight)``: forward ``zerodiff.ops.fp8_gemm.fp8_linear``
  on the deployment bytes (``Fp8Weight`` requantised from the BF16 master by the deployment rule); backward
  straight-through: FP32 ``grad @ W_master`` and ``grad^T @ x`` w.r.t. the BF16 master.
* ``mark_fp8_linears(model, predicate)`` / ``parallel_linear_fp8(module, x, weight=None)``: Megatron's
  ``ColumnParallelLinear`` / ``RowParallelLinear`` marked ``zerodiff_fp8 = True`` run :func:`fp8_linear`
  with a per-module deployment copy requantised in place whenever the master's version changes.
* ``moe_layer_forward(layer, hidden_states, probs, routing_map, shared_expert_output, intermediate_tensors=None)``
  (the patched ``MoELayer.forward`` after routing) / ``moe_experts(experts, x, probs, routing_map, topk,
  clamp_limit=None) -> fp32 [T, H]``: ``zerodiff.ops.moe.moe_experts`` in the contiguous layout on a stacked
  per-module deployment copy of the expert masters (requantised in place when a master's version changes), slots
  from ``routing_slots(probs, routing_map, topk)`` (expert id descending = ``route``'s slot order), FP32 combine
  in slot order, ``finish`` with the shared expert (one BF16 rounding); straight-through backward (FP32 graph,
  unquantised masters) to x, probs and every master (``expert_master_weights``: SequentialMLP / TEGroupedMLP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import ConfigError, _problems_to_error, enabled

__all__ = [
    "WeightVersionError",
    "validate_config",
    "config_values",
    "check_transformer_config",
    "router_logits",
    "topk_routing",
    "swiglu",
    "mlp_activation",
    "RMSNorm",
    "rms_norm",
    "cross_entropy",
    "token_logprobs",
    "fp8_linear",
    "Fp8Linear",
    "FP8_ATTR",
    "mark_fp8_linears",
    "parallel_linear_fp8",
]

_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")


class WeightVersionError(RuntimeError):
    """A master weight was modified in place between a zerodiff forward and its backward."""


# ------------------------------------------------------------------------------------------ config guard
def validate_config(
    *,
    tensor_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    sequence_parallel: bool = False,
    context_parallel_size: int = 1,
    cp_comm_type: Any = None,
    normalization: str = "RMSNorm",
    layernorm_zero_centered_gamma: bool = False,
    fused_residual_rmsnorm: bool = False,
    gated_linear_unit: bool = True,
    activation_is_silu: bool = True,
    glu_linear_offset: float = 0.0,
    use_te_activation_func: bool = False,
    add_bias_linear: bool = False,
    num_moe_experts: int | None = None,
    moe_router_dtype: str | None = "fp32",
    moe_router_num_groups: int | None = None,
    moe_router_group_topk: int | None = None,
    moe_expert_capacity_factor: float | None = None,
    moe_input_jitter_eps: float | None = None,
    moe_enable_routing_replay: bool = False,
    moe_router_force_load_balancing: bool = False,
    moe_router_force_biased: Any = None,
    moe_apply_probs_on_input: bool = False,
    moe_router_score_function: str = "softmax",
    moe_router_load_balancing_type: Any = "aux_loss",
    fp8: str | None = None,
    fp4: str | None = None,
    hidden_dropout: float = 0.0,
    attention_dropout: float = 0.0,
    cross_entropy_loss_fusion: bool = False,
) -> None:
    """Raise :class:`ConfigError` naming every setting that breaks diff = 0 (see the module docstring)."""
    p: list[str] = []
    if int(tensor_model_parallel_size or 1) > 1:
        p.append(f"tensor_model_parallel_size={tensor_model_parallel_size}: TP > 1 puts a cross-GPU reduction "
                 "in the compared path; use 1")
    if expert_tensor_parallel_size is not None and int(expert_tensor_parallel_size) > 1:
        p.append(f"expert_tensor_parallel_size={expert_tensor_parallel_size}: expert TP reduces across GPUs; "
                 "use 1")
    if sequence_parallel:
        p.append("sequence_parallel=True: needs TP > 1 reductions; turn it off")
    if int(context_parallel_size or 1) > 1:
        kinds = cp_comm_type if isinstance(cp_comm_type, (list, tuple)) else [cp_comm_type]
        if any(k != "all_gather" for k in kinds):
            p.append(f"cp_comm_type={cp_comm_type!r} with context_parallel_size={context_parallel_size}: only "
                     "the all-gather CP (no partial-attention merge) keeps diff = 0; use cp_comm_type='all_gather'")
    if normalization != "RMSNorm":
        p.append(f"normalization={normalization!r}: only RMSNorm is routed through zerodiff")
    if layernorm_zero_centered_gamma:
        p.append("layernorm_zero_centered_gamma=True: not supported by the zerodiff RMSNorm")
    if fused_residual_rmsnorm:
        p.append("fused_residual_rmsnorm=True: the TE fused-residual norm is not routed; turn it off")
    if not gated_linear_unit or not activation_is_silu:
        p.append(f"gated_linear_unit={gated_linear_unit} / activation_func silu={activation_is_silu}: only "
                 "SwiGLU (gated SiLU) is routed through zerodiff")
    if glu_linear_offset:
        p.append(f"glu_linear_offset={glu_linear_offset}: not supported (the rollout has none)")
    if use_te_activation_func:
        p.append("use_te_activation_func=True: the TE activation bypasses zerodiff; turn it off")
    if add_bias_linear:
        p.append("add_bias_linear=True: linear biases are not supported in consistency mode")
    if num_moe_experts:
        if moe_router_dtype != "fp32":
            p.append(f"moe_router_dtype={moe_router_dtype!r}: the router GEMM must produce FP32 logits; "
                     "use moe_router_dtype='fp32'")
        if moe_router_num_groups or moe_router_group_topk:
            p.append(f"moe_router_num_groups={moe_router_num_groups} / moe_router_group_topk="
                     f"{moe_router_group_topk}: group-limited routing is not supported")
        if moe_expert_capacity_factor is not None:
            p.append(f"moe_expert_capacity_factor={moe_expert_capacity_factor}: token dropping depends on the "
                     "batch; use None (dropless)")
        if moe_input_jitter_eps:
            p.append(f"moe_input_jitter_eps={moe_input_jitter_eps}: random router input noise; use None")
        if moe_enable_routing_replay:
            p.append("moe_enable_routing_replay=True: consistency mode recomputes routing bit-identically; "
                     "turn replay off")
        if moe_router_force_load_balancing:
            p.append("moe_router_force_load_balancing=True: random logits; turn it off")
        if moe_router_force_biased is not None:
            p.append(f"moe_router_force_biased={moe_router_force_biased}: random logit bias; use None")
        if moe_apply_probs_on_input:
            p.append("moe_apply_probs_on_input=True: probs must be applied in the FP32 combine, not before FC2")
        lb = moe_router_load_balancing_type
        lb = list(lb) if isinstance(lb, (list, tuple)) else [lb]
        if any(t in ("sinkhorn", "quantile_balancing") for t in lb):
            p.append(f"moe_router_load_balancing_type={moe_router_load_balancing_type!r}: sinkhorn / quantile "
                     "balancing bypass the deterministic top-k; use aux-loss balancing (or 'none')")
        if moe_router_score_function not in _SCORES:
            p.append(f"moe_router_score_function={moe_router_score_function!r}: use one of {_SCORES}")
    if fp8:
        p.append(f"fp8={fp8!r}: Transformer Engine FP8 recipes are not bit-compatible with the rollout; leave "
                 "fp8 unset and use zerodiff's Fp8Linear (block-FP8 by the deployment rule)")
    if fp4:
        p.append(f"fp4={fp4!r}: FP4 training recipes are not supported in consistency mode")
    if cross_entropy_loss_fusion:
        p.append("cross_entropy_loss_fusion=True: the fused CE bypasses the zerodiff log-prob; turn it off")
    if hidden_dropout:
        p.append(f"hidden_dropout={hidden_dropout}: dropout changes the training forward; use 0.0")
    if attention_dropout:
        p.append(f"attention_dropout={attention_dropout}: dropout changes the training forward; use 0.0")
    _problems_to_error("Megatron", p)


def config_values(config: Any) -> dict:
    """Plain values for :func:`validate_config`, read off a ``TransformerConfig`` (or a look-alike)."""
    g = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    act = g("activation_func")
    return dict(
        tensor_model_parallel_size=g("tensor_model_parallel_size", 1),
        expert_tensor_parallel_size=g("expert_tensor_parallel_size"),
        sequence_parallel=bool(g("sequence_parallel", False)),
        context_parallel_size=g("context_parallel_size", 1),
        cp_comm_type=g("cp_comm_type"),
        normalization=g("normalization", "LayerNorm"),
        layernorm_zero_centered_gamma=bool(g("layernorm_zero_centered_gamma", False)),
        fused_residual_rmsnorm=bool(g("fused_residual_rmsnorm", False)),
        gated_linear_unit=bool(g("gated_linear_unit", False)),
        activation_is_silu=act is F.silu,
        glu_linear_offset=g("glu_linear_offset", 0.0) or 0.0,
        use_te_activation_func=bool(g("use_te_activation_func", False)),
        add_bias_linear=bool(g("add_bias_linear", False)),
        num_moe_experts=g("num_moe_experts"),
        moe_router_dtype=g("moe_router_dtype"),
        moe_router_num_groups=g("moe_router_num_groups"),
        moe_router_group_topk=g("moe_router_group_topk"),
        moe_expert_capacity_factor=g("moe_expert_capacity_factor"),
        moe_input_jitter_eps=g("moe_input_jitter_eps"),
        moe_enable_routing_replay=bool(g("moe_enable_routing_replay", False)),
        moe_router_force_load_balancing=bool(g("moe_router_force_load_balancing", False)),
        moe_router_force_biased=g("moe_router_force_biased"),
        moe_apply_probs_on_input=bool(g("moe_apply_probs_on_input", False)),
        moe_router_score_function=g("moe_router_score_function", "softmax"),
        moe_router_load_balancing_type=g("moe_router_load_balancing_type", "aux_loss"),
        fp8=g("fp8"),
        fp4=g("fp4"),
        hidden_dropout=g("hidden_dropout", 0.0) or 0.0,
        attention_dropout=g("attention_dropout", 0.0) or 0.0,
        cross_entropy_loss_fusion=bool(g("cross_entropy_loss_fusion", False)),
    )


def check_transformer_config(config: Any, environ=None) -> bool:
    """The guard the patched ``TransformerConfig.__post_init__`` calls: no-op (False) when consistency mode
    is off; else validate (raising :class:`ConfigError`) and return True."""
    if not enabled(environ):
        return False
    validate_config(**config_values(config))
    return True


# ----------------------------------------------------------------------------------------------- helpers
def _versions(*ts):
    return tuple(None if t is None else t._version for t in ts)


def _check_versions(ctx, *ts):
    now = _versions(*ts)
    if now != ctx.zd_versions:
        raise WeightVersionError(
            f"zerodiff: a master weight changed in place between forward and backward (versions "
            f"{ctx.zd_versions} -> {now}); the backward would differentiate other weights than the forward "
            "used. Run the optimizer step only after backward.")


# ---------------------------------------------------------------------------------------------- router
class _RouterGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        from ..ops.router_gemm import router_gemm

        ctx.save_for_backward(x2)
        ctx.zd_weight = w  # kept off save_for_backward so our version check names the problem
        ctx.zd_versions = _versions(w)
        return router_gemm(x2, w)

    @staticmethod
    def backward(ctx, g):
        w = ctx.zd_weight
        _check_versions(ctx, w)
        (x2,) = ctx.saved_tensors
        g = g.float()
        gx = (g @ w.float()).to(x2.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x2.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 router logits ``[..., E]`` from bf16 ``x [..., H]`` and bf16 ``weight [E, H]`` via
    ``zerodiff.ops.router_gemm`` (same kernel at every token count)."""
    if bias is not None:
        raise ConfigError("zerodiff router: a router bias is not supported in consistency mode")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff router: input ({x.dtype}) and router weight ({weight.dtype}) must be "
                          "bfloat16 (the rollout's gate weight is the BF16 master)")
    lead = x.shape[:-1]
    out = _RouterGemm.apply(x.reshape(-1, x.shape[-1]), weight)
    return out.view(*lead, weight.shape[0])


def _score_graph(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    x = logits.float()
    if score_function == "softmax":
        return torch.softmax(x, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(x)
    return F.softplus(x).sqrt()


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax",
                 use_pre_softmax: bool = False, scaling_factor: float | None = None,
                 expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``(probs [T, E], routing_map bool [T, E])`` computed by ``zerodiff.ops.moe.route``.

    Values are the zerodiff op's (the rollout's); the gradient w.r.t. ``logits`` flows through the same
    formula written in PyTorch at the selected expert ids."""
    from ..ops.moe import route

    if score_function not in _SCORES:
        raise ConfigError(f"zerodiff routing: moe_router_score_function={score_function!r} not supported")
    lg = logits.reshape(-1, logits.shape[-1])
    if lg.dtype != torch.float32:
        raise ConfigError(f"zerodiff routing: router logits must be fp32 (moe_router_dtype='fp32'), got {lg.dtype}")
    softmax_after = score_function == "softmax" and not use_pre_softmax
    renorm = topk > 1 and (score_function != "softmax" or softmax_after)
    # softmax over the selected logits == softmax scores renormalised over the selection (same math)
    bias = None if expert_bias is None else expert_bias.detach().float()
    w, ids = route(lg.detach(), topk, scoring=score_function, bias=bias, renormalize=renorm,
                   routed_scale=float(scaling_factor) if scaling_factor else 1.0)
    idx = ids.long().clamp(min=0)
    if lg.requires_grad:
        sc = _score_graph(lg, score_function)
        gw = sc.gather(1, idx)
        if renorm:
            gw = gw / gw.sum(dim=-1, keepdim=True)
        if scaling_factor:
            gw = gw * scaling_factor
        w = w + (gw - gw.detach())
    probs = torch.zeros_like(lg).scatter(1, idx, w)
    routing_map = torch.zeros_like(lg, dtype=torch.bool).scatter(1, idx, ids >= 0)
    return probs, routing_map


# ---------------------------------------------------------------------------------------------- SwiGLU
def _swiglu_graph(x: torch.Tensor, clamp_limit):
    g, u = x.float().chunk(2, dim=-1)
    if clamp_limit is not None:
        g = g.clamp(max=clamp_limit)
        u = u.clamp(min=-clamp_limit, max=clamp_limit)
    return F.silu(g) * u


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clamp_limit):
        from ..ops.silu_mul_quant import silu_mul

        ctx.save_for_backward(x)
        ctx.clamp_limit = clamp_limit
        lead = x.shape[:-1]
        y = silu_mul(x.reshape(-1, x.shape[-1]), clamp_limit=clamp_limit)
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xf = x.detach().float().requires_grad_(True)
            y = _swiglu_graph(xf, ctx.clamp_limit)
            (gx,) = torch.autograd.grad(y, xf, g.float())
        return gx.to(x.dtype), None


def swiglu(x: torch.Tensor, clamp_limit: float | None = None) -> torch.Tensor:
    """SiLU(gate) * up on bf16 ``[..., 2N]`` with one BF16 rounding (``zerodiff.ops.silu_mul_quant``)."""
    if x.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff SwiGLU: activations must be bfloat16, got {x.dtype}")
    if not x.is_contiguous():
        x = x.contiguous()
    return _SiluMul.apply(x, clamp_limit)


def mlp_activation(config: Any, activation_func, x: torch.Tensor, bias: torch.Tensor | None,
                   per_token_scale: torch.Tensor | None) -> torch.Tensor:
    """The patched ``MLP.forward`` activation: SwiGLU through zerodiff; anything else refused."""
    if bias is not None:
        raise ConfigError("zerodiff MLP: fc1 bias is not supported in consistency mode (add_bias_linear=False)")
    if per_token_scale is not None:
        raise ConfigError("zerodiff MLP: per_token_scale (moe_apply_probs_on_input) is not supported")
    if not getattr(config, "gated_linear_unit", False) or activation_func is not F.silu:
        raise ConfigError("zerodiff MLP: only SwiGLU (gated_linear_unit=True, activation_func=F.silu) is "
                          "supported in consistency mode")
    if getattr(config, "glu_linear_offset", 0.0):
        raise ConfigError("zerodiff MLP: glu_linear_offset must be 0")
    return swiglu(x, getattr(config, "activation_func_clamp_value", None))


# --------------------------------------------------------------------------------------------- RMSNorm
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        from ..ops.rmsnorm import rms_norm as zd_rms_norm

        ctx.save_for_backward(x)
        ctx.zd_weight = weight
        ctx.eps = eps
        ctx.zd_versions = _versions(weight)
        return zd_rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        weight = ctx.zd_weight
        _check_versions(ctx, weight)
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xf = x.detach().float().requires_grad_(True)
            wf = weight.detach().float().requires_grad_(True)
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps) * wf
            gx, gw = torch.autograd.grad(y, (xf, wf), g.float())
        return gx.to(x.dtype), gw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Differentiable ``zerodiff.ops.rmsnorm.rms_norm`` (x bf16 ``[..., H]``)."""
    if x.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff RMSNorm: input must be bfloat16, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _RMSNorm.apply(x, weight, float(eps))


class RMSNorm(torch.nn.Module):
    """Drop-in for Megatron's RMSNorm (``weight`` parameter, same state-dict key) computing the rollout's
    value with ``zerodiff.ops.rmsnorm`` and an FP32 backward."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, config: Any = None, dtype=None, device=None):
        super().__init__()
        if config is not None and getattr(config, "layernorm_zero_centered_gamma", False):
            raise ConfigError("zerodiff RMSNorm: layernorm_zero_centered_gamma is not supported")
        if dtype is None:
            dtype = getattr(config, "params_dtype", None) or torch.float32
        if device is None and config is not None and not getattr(config, "use_cpu_initialization", True):
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(self.hidden_size, dtype=dtype, device=device))
        if config is not None and getattr(config, "sequence_parallel", False):
            setattr(self.weight, "sequence_parallel", True)

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps} (zerodiff)"


# ------------------------------------------------------------------------------------------- log-probs
class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2, ids, temperature):
        from ..ops.logprobs import token_logprobs as zd_token_logprobs

        ctx.save_for_backward(logits2, ids)
        ctx.temperature = temperature
        return zd_token_logprobs(logits2, ids, temperature=temperature)

    @staticmethod
    def backward(ctx, g):
        logits2, ids = ctx.saved_tensors
        t = ctx.temperature
        p = torch.softmax(logits2.float() / t, dim=-1)
        onehot = torch.zeros_like(p).scatter_(1, ids.view(-1, 1), 1.0)
        gl = (onehot - p) * (g.float() / t).unsqueeze(1)
        return gl.to(logits2.dtype), None, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """FP32 log-prob of ``target`` under ``logits / temperature`` (``[..., V]`` -> ``[...]``), bit-identical
    to the rollout's ``zerodiff.ops.logprobs.token_logprobs``; differentiable w.r.t. ``logits``."""
    V = logits.shape[-1]
    lead = target.shape
    lg = logits.reshape(-1, V)
    if lg.stride(-1) != 1:
        lg = lg.contiguous()
    out = _TokenLogprobs.apply(lg, target.reshape(-1).long(), float(temperature))
    return out.view(lead)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                  tp_group=None) -> torch.Tensor:
    """Megatron's ``vocab_parallel_cross_entropy`` in consistency mode (TP = 1): ``-token_logprobs``.
    ``tp_group`` must be None or of size 1 (the vocabulary is not split)."""
    if label_smoothing:
        raise ConfigError(f"zerodiff cross entropy: label_smoothing={label_smoothing} is not supported")
    if tp_group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size(tp_group) != 1:
            raise ConfigError("zerodiff cross entropy: the vocabulary is split over a TP group of size "
                              f"{torch.distributed.get_world_size(tp_group)}; consistency mode needs TP = 1")
    return -token_logprobs(logits, target)


# --------------------------------------------------------------------------------------------- FP8 linear
class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, master, fp8_weight):
        from ..ops.fp8_gemm import fp8_linear as zd_fp8_linear

        ctx.save_for_backward(x2)
        ctx.zd_weight = master
        ctx.zd_versions = _versions(master)
        return zd_fp8_linear(x2, fp8_weight)

    @staticmethod
    def backward(ctx, g):
        master = ctx.zd_weight
        _check_versions(ctx, master)
        (x2,) = ctx.saved_tensors
        g = g.float()
        gx = (g @ master.float()).to(x2.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x2.float()).to(master.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def fp8_linear(x: torch.Tensor, master_weight: torch.Tensor, fp8_weight) -> torch.Tensor:
    """Block-FP8 linear forward (``zerodiff.ops.fp8_gemm.fp8_linear`` on ``fp8_weight``, the deployment bytes
    of ``master_weight``), straight-through backward w.r.t. the BF16 master."""
    lead = x.shape[:-1]
    out = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), master_weight, fp8_weight)
    return out.view(*lead, out.shape[-1])


class Fp8Linear(torch.nn.Module):
    """BF16 master ``weight [N, K]`` + its block-FP8 deployment copy, requantised IN PLACE (same storage,
    CUDA-graph safe) by :meth:`refresh` after each optimizer step. Forward refuses a stale deployment."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        from ..ops.fp8_quant import Fp8Weight

        self.weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16).clone())
        self.fp8 = Fp8Weight.from_master(self.weight.detach())
        self._deployed_version = self.weight._version

    @torch.no_grad()
    def refresh(self) -> None:
        self.fp8.requantize_(self.weight.detach())
        self._deployed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight._version != self._deployed_version:
            raise WeightVersionError("zerodiff Fp8Linear: the master weight changed since the last refresh(); "
                                     "call refresh() after the optimizer step")
        return fp8_linear(x, self.weight, self.fp8)


# ------------------------------------------------------------------------------- parallel linear layers
#: attribute a model builder sets on a ColumnParallelLinear / RowParallelLinear whose rollout twin is a
#: block-FP8 linear (the checkpoint quantised it); see :func:`mark_fp8_linears`.
FP8_ATTR = "zerodiff_fp8"


def mark_fp8_linears(model: torch.nn.Module, predicate) -> list[str]:
    """Set ``zerodiff_fp8 = True`` on every submodule for which ``predicate(name, module)`` is true (pick the
    layers the rollout runs as block-FP8 linears, e.g. from the checkpoint's quantisation config). Returns
    the names marked."""
    names = []
    for name, mod in model.named_modules():
        if hasattr(mod, "weight") and predicate(name, mod):
            setattr(mod, FP8_ATTR, True)
            names.append(name)
    return names


@torch.no_grad()
def _deployment(module: torch.nn.Module, weight: torch.Tensor):
    """The module's block-FP8 deployment copy of ``weight``, requantised IN PLACE (same storage: CUDA graphs
    keep their addresses) whenever the master's version changed since the last quantisation."""
    from ..ops.fp8_quant import Fp8Weight

    fp8 = getattr(module, "_zerodiff_fp8_weight", None)
    if fp8 is None or tuple(fp8.q.shape) != tuple(weight.shape) or fp8.q.device != weight.device:
        fp8 = Fp8Weight.from_master(weight.detach())
        module._zerodiff_fp8_weight = fp8
    elif getattr(module, "_zerodiff_fp8_version", None) != weight._version:
        fp8.requantize_(weight.detach())
    module._zerodiff_fp8_version = weight._version
    return fp8


def parallel_linear_fp8(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None):
    """The patched ``ColumnParallelLinear.forward`` / ``RowParallelLinear.forward`` for layers marked
    ``zerodiff_fp8`` (TP = 1): ``(fp8_linear(x, master, deployment), None)`` with the straight-through
    backward of :func:`fp8_linear`. Biases are refused (the guard refuses ``add_bias_linear``)."""
    w = module.weight if weight is None else weight
    if getattr(module, "bias", None) is not None:
        raise ConfigError("zerodiff FP8 linear: a bias is not supported in consistency mode")
    if w.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff FP8 linear: the master weight must be bfloat16 (Float16Module), got {w.dtype}")
    return fp8_linear(x, w, _deployment(module, w)), None


# ------------------------------------------------------------------------------------------- MoE experts
__all__ += ["expert_master_weights", "routing_slots", "moe_experts", "moe_layer_forward"]


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
        from ..ops.moe import moe_experts as zd_moe_experts

        ctx.save_for_backward(x2, w, ids)
        ctx.zd_weights = masters
        ctx.zd_versions = _versions(*masters)
        ctx.clamp_limit = clamp_limit
        ctx.n = n_experts
        return zd_moe_experts(x2, w.detach(), ids, deployed, layout="contiguous", clamp_limit=clamp_limit)

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
    (same storage) whenever a master's version changed since the last quantisation."""
    from ..ops.moe import MoEWeights

    vers = _versions(*fc1, *fc2)
    dep = getattr(experts, "_zerodiff_moe_weights", None)
    w13 = lambda: torch.stack([w.detach() for w in fc1])  # noqa: E731
    w2 = lambda: torch.stack([w.detach() for w in fc2])  # noqa: E731
    if dep is None or dep.num_experts != len(fc1) or dep.w13.q.device != fc1[0].device:
        dep = MoEWeights.from_master(w13(), w2())
        experts._zerodiff_moe_weights = dep
    elif getattr(experts, "_zerodiff_moe_versions", None) != vers:
        dep.requantize_(w13(), w2())
    experts._zerodiff_moe_versions = vers
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
    from ..ops.moe import finish  # plain torch: differentiable as written

    shared = None if shared_expert_output is None else shared_expert_output.reshape(routed.shape)
    return finish(routed, shared).view(hidden_states.shape)
