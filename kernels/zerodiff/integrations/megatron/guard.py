"""The fail-closed guards for megatron-core 0.19.2; the rules and their reasons are listed in
:mod:`zerodiff.integrations.megatron`.

* :func:`check_transformer_config` (the patched ``TransformerConfig.__post_init__``): the model config, plus the
  parallel sizes ``megatron.core.parallel_state`` was initialised with (a config can say TP = 1 while the layers
  use a TP group of several ranks);
* :func:`check_module_class` (the patched ``spec_utils.build_module``): every module class a layer spec builds,
  so a Transformer Engine, MLA or DSA spec is refused even under a config that does not say so;
* :func:`check_training_args` (the patched ``megatron.training.arguments.validate_args``): the RL loop's
  arguments, which decide how many optimizer updates follow one rollout step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn.functional as F

from .. import _problems_to_error, enabled

__all__ = ["validate_config", "config_values", "check_transformer_config", "check_module_class",
           "validate_training_args", "training_args_values", "check_training_args"]

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
    multi_latent_attention: bool = False,
    experimental_attention_variant: str | None = None,
    transformer_impl: str = "local",
    expert_model_parallel_size: int = 1,
    parallel_state_tensor_parallel_size: int | None = None,
    parallel_state_expert_tensor_parallel_size: int | None = None,
    parallel_state_expert_model_parallel_size: int | None = None,
) -> None:
    """Raise :class:`ConfigError` naming every setting that breaks diff = 0 (see the package docstring)."""
    p: list[str] = []
    if parallel_state_tensor_parallel_size is not None and int(parallel_state_tensor_parallel_size) > 1:
        p.append(f"parallel_state tensor-parallel world size {parallel_state_tensor_parallel_size} "
                 f"(initialize_model_parallel(tensor_model_parallel_size={parallel_state_tensor_parallel_size}); "
                 f"the config says {tensor_model_parallel_size}): the layers reduce across that group; use 1")
    if (parallel_state_expert_tensor_parallel_size is not None
            and int(parallel_state_expert_tensor_parallel_size) > 1):
        p.append(f"parallel_state expert-tensor-parallel world size {parallel_state_expert_tensor_parallel_size}: "
                 "expert TP reduces across GPUs; use 1")
    if num_moe_experts and (int(expert_model_parallel_size or 1) > 1 or (
            parallel_state_expert_model_parallel_size is not None and int(parallel_state_expert_model_parallel_size) > 1)):
        p.append(f"expert_model_parallel_size={expert_model_parallel_size} (parallel_state: "
                 f"{parallel_state_expert_model_parallel_size}): the zerodiff MoE layer runs every expert locally; "
                 "use 1 (the EP dispatcher zerodiff.ops.expert_parallel, whose values do not depend on the EP "
                 "degree, exists but is not wired into the Megatron MoE layer)")
    if transformer_impl != "local":
        p.append(f"transformer_impl={transformer_impl!r}: the Transformer Engine / inference-optimized modules "
                 "(fused norm+linear, TE linears and attention) are not routed through zerodiff; use "
                 "transformer_impl='local' and the local layer spec")
    if multi_latent_attention:
        p.append("multi_latent_attention=True: Megatron's MLA attention is not routed through zerodiff (the "
                 "rollout's sparse MLA reads an FP8 KV cache through its own fixed-schedule kernel); refused")
    if experimental_attention_variant is not None:
        p.append(f"experimental_attention_variant={experimental_attention_variant!r}: "
                 + ("DSA (the lightning indexer, its top-k and the sparse attention) is"
                    if experimental_attention_variant == "dsa" else "this attention variant is")
                 + " not routed through zerodiff; refused")
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
        multi_latent_attention=bool(g("multi_latent_attention", False)),
        experimental_attention_variant=g("experimental_attention_variant"),
        # a look-alike without the field gets Megatron's default (fail closed)
        transformer_impl=g("transformer_impl", "transformer_engine"),
        expert_model_parallel_size=g("expert_model_parallel_size", 1) or 1,
        **_parallel_state_sizes(),
    )


def _parallel_state_sizes() -> dict:
    """The world sizes ``megatron.core.parallel_state`` was initialised with (empty before initialisation, or
    when megatron was never imported)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    out: dict = {}
    if ps is None:
        return out
    try:
        if not ps.model_parallel_is_initialized():
            return out
    except Exception:  # pragma: no cover - a fork without the helper
        return out
    for key, fn in (("parallel_state_tensor_parallel_size", "get_tensor_model_parallel_world_size"),
                    ("parallel_state_expert_tensor_parallel_size", "get_expert_tensor_parallel_world_size"),
                    ("parallel_state_expert_model_parallel_size", "get_expert_model_parallel_world_size")):
        try:
            v = getattr(ps, fn)()
        except Exception:  # an expert group that was never created
            continue
        if v is not None:
            out[key] = int(v)
    return out


def check_transformer_config(config: Any, environ=None) -> bool:
    """The guard the patched ``TransformerConfig.__post_init__`` calls: no-op (False) when consistency mode
    is off; else validate (raising :class:`ConfigError`) and return True. A bad ``ZERODIFF_FP8_GEMM_BACKEND``
    is refused here too, at start rather than at the first FP8 forward."""
    if not enabled(environ):
        return False
    from .linear import fp8_gemm_backend

    validate_config(**config_values(config))
    fp8_gemm_backend("cuda", environ)
    return True



# ------------------------------------------------------------------------------------------ layer specs
#: module-class prefixes of attention implementations no zerodiff op computes (MLA, DSA and the other
#: experimental attention variants)
_UNROUTED_ATTENTION = {
    "megatron.core.transformer.multi_latent_attention": "multi_latent_attention=True (MLA)",
    "megatron.core.transformer.experimental_attention_variant": "experimental_attention_variant (DSA, gated delta net)",
}
#: Transformer Engine wrappers that ARE routed in consistency mode (the norm builder returns zerodiff's RMSNorm)
_ROUTED_TE = {"TENorm"}


def check_module_class(module: Any, environ=None) -> bool:
    """What the patched ``build_module`` calls for every class a layer spec builds: no-op (False) when
    consistency mode is off; else refuse (:class:`ConfigError`, naming the class and the setting) a Transformer
    Engine module other than ``TENorm`` (the TE spec) and an MLA / DSA attention module, and return True."""
    if not enabled(environ):
        return False
    if not isinstance(module, type):
        return True
    mod, name = getattr(module, "__module__", "") or "", module.__name__
    if mod.startswith("megatron.") and name.startswith("TE") and name not in _ROUTED_TE:
        _problems_to_error("Megatron layer spec", [
            f"{name} ({mod}): a Transformer Engine module (the transformer_engine layer spec); its GEMMs, fused "
            "norms and attention are not routed through zerodiff. Build the model with the local spec "
            "(transformer_impl='local', get_gpt_layer_local_spec / use_transformer_engine=False)"])
    for prefix, setting in _UNROUTED_ATTENTION.items():
        if mod == prefix or mod.startswith(prefix + "."):
            _problems_to_error("Megatron layer spec", [
                f"{name} ({mod}): {setting} is not routed through zerodiff; refused"])
    return True


# ------------------------------------------------------------------------------------------ RL arguments
def validate_training_args(*, perform_rl_step: bool = False, grpo_iterations: int = 1,
                           grpo_prompts_per_step: int | None = None, grpo_group_size: int | None = None,
                           global_batch_size: int | None = None, rl_partial_rollouts: bool = False,
                           rl_generation_lag: int = 0) -> None:
    """Raise :class:`ConfigError` naming every RL argument that makes the training weights differ from the
    weights that sampled the rollout (more than one optimizer update per rollout step, off-policy rollouts).
    The design's rule is one update per step: the step batch is the mini-batch."""
    if not perform_rl_step:
        return
    p: list[str] = []
    if int(grpo_iterations) != 1:
        p.append(f"grpo_iterations={grpo_iterations}: each rollout batch is trained on {grpo_iterations} times, so "
                 "every pass after the first recomputes the log-probs with weights the rollout never ran; use 1")
    if grpo_prompts_per_step and grpo_group_size and global_batch_size:
        per_step = int(grpo_prompts_per_step) * int(grpo_group_size)
        if int(global_batch_size) != per_step:
            p.append(f"global_batch_size={global_batch_size} with grpo_prompts_per_step * grpo_group_size = "
                     f"{per_step}: one rollout step feeds {per_step / int(global_batch_size):g} optimizer updates; "
                     f"set global_batch_size={per_step} (one update per rollout step)")
    if rl_partial_rollouts:
        p.append("rl_partial_rollouts=True: generation continues across weight updates (off-policy rollouts); "
                 "turn it off")
    if int(rl_generation_lag or 0) > 0:
        p.append(f"rl_generation_lag={rl_generation_lag}: rollouts lag the trained weights; use 0")
    _problems_to_error("Megatron RL", p)


def training_args_values(args: Any) -> dict:
    """Plain values for :func:`validate_training_args`, read off Megatron's parsed ``args`` (or a look-alike)."""
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return dict(perform_rl_step=bool(g("perform_rl_step", False)), grpo_iterations=g("grpo_iterations", 1),
                grpo_prompts_per_step=g("grpo_prompts_per_step"), grpo_group_size=g("grpo_group_size"),
                global_batch_size=g("global_batch_size"), rl_partial_rollouts=bool(g("rl_partial_rollouts", False)),
                rl_generation_lag=g("rl_generation_lag", 0) or 0)


def check_training_args(args: Any, environ=None) -> bool:
    """The guard the patched ``validate_args`` calls: no-op (False) when consistency mode is off; else validate
    (raising :class:`ConfigError`) and return True."""
    if not enabled(environ):
        return False
    validate_training_args(**training_args_values(args))
    return True
