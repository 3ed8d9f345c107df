"""The fail-closed config guard for megatron-core 0.19.2 (what the patched ``TransformerConfig.__post_init__``
calls); the rules and their reasons are listed in :mod:`zerodiff.integrations.megatron`."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from .. import _problems_to_error, enabled

__all__ = ["validate_config", "config_values", "check_transformer_config"]

_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")


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

