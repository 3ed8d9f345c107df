"""megatron-core 0.19.2 glue: the fail-closed config guard and the training-side autograd wrappers that
the ``patches/megatron`` series calls when consistency mode is on (``ZERODIFF_CONSISTENT=1``).

One module per concern: ``guard`` (config, layer-spec and RL-argument guards), ``common`` (the weight-version
check), ``layers`` (router, routing, SwiGLU, RMSNorm), ``logprobs`` (loss, token log-probs, Megatron-RL's
log-probs), ``linear`` (every parallel linear: block FP8, BF16, the LM head; the FP8 deployment constants),
``moe`` (routed experts). Everything public is re-exported here, which is the name the patches import
(``zerodiff.integrations.megatron``).

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
  compared path (DESIGN "cross-GPU"); ``sequence_parallel`` (only meaningful with TP). The world sizes
  ``megatron.core.parallel_state`` was initialised with are checked too, once it is initialised (the layers use
  those groups whatever the config says); the patched linears refuse a sharded layer at its first forward.
* ``expert_model_parallel_size > 1`` with MoE: the zerodiff MoE layer runs every expert locally.
* ``transformer_impl`` other than ``local`` (Megatron's default is ``transformer_engine``): TE's fused norm +
  linear, TE linears and TE attention are not routed. ``multi_latent_attention`` (MLA) and any
  ``experimental_attention_variant`` (``dsa``: indexer, its top-k and the sparse attention; gated delta net):
  no zerodiff op computes Megatron's attention for them.
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

Layer-spec guard: ``check_module_class(cls)`` (the patched ``spec_utils.build_module``, for every class a spec
builds) refuses Transformer Engine modules other than ``TENorm`` (which the norm patch routes), MLA and DSA /
experimental attention modules, naming the class: a TE or MLA spec handed to the model under a config that
does not say so is refused as well.

RL-argument guard: ``check_training_args(args)`` (the patched ``validate_args``) refuses, for an RL run
(``perform_rl_step``), more than one optimizer update per rollout step (DESIGN "updates"):
``grpo_iterations != 1`` (Megatron's default is 2), ``global_batch_size != grpo_prompts_per_step *
grpo_group_size``, ``rl_partial_rollouts`` and ``rl_generation_lag > 0`` (off-policy rollouts).

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
* ``selective_log_softmax(logits, index)`` / ``route_rl_logprobs(rl_utils)``: Megatron-RL's log-prob function
  (``megatron.rl.rl_utils``, which ``get_logprobs`` calls for the training and old-policy log-probs) replaced
  by :func:`token_logprobs` (FP32, the rollout op's bits); the patched ``megatron.training.training`` calls
  ``route_rl_logprobs`` right after importing ``megatron.rl``.
* ``Fp8Linear`` / ``fp8_linear(x, master_weight, fp8_weight)``: forward ``zerodiff.ops.fp8_gemm.fp8_linear``
  on the deployment bytes (``Fp8Weight`` requantised from the BF16 master by the deployment rule on every
  forward, :func:`deploy_fp8`); backward straight-through: FP32 ``grad @ W_master`` and ``grad^T @ x`` w.r.t.
  the BF16 master.
* ``parallel_linear(module, x, weight=None)``: EVERY ``ColumnParallelLinear`` / ``RowParallelLinear`` (the
  patched forwards): the LM head (weight tagged ``is_embedding_or_output_parameter``) -> FP32 logits from
  ``zerodiff.ops.bf16_gemm`` (vLLM's ``lm_head_logits``); ``zerodiff_fp8 = False``
  (``mark_bf16_linears(model, predicate)``) -> ``bf16_linear``; every other layer -> :func:`fp8_linear` with a
  per-module deployment copy requantised in place from the master on every forward (optimizer writes through
  ``param.data`` or the param buffers do not move ``param._version``, so nothing is cached). Refused: biases,
  tensor-parallel shards, sequence parallelism, non-BF16 masters. Deployment constants (the vLLM side's
  values): ``FP8_UE8M0 = True`` (power-of-two scales, the checkpoint's), ``fp8_gemm_backend(device)`` (pinned:
  ``$ZERODIFF_FP8_GEMM_BACKEND`` or ``triton`` on CUDA, ``reference`` on CPU; never probed),
  ``moe_backend(device)``. ``parallel_linear_fp8`` is the FP8 branch alone; ``mark_fp8_linears`` undoes
  ``mark_bf16_linears``.
* ``moe_layer_forward(layer, hidden_states, probs, routing_map, shared_expert_output, intermediate_tensors=None)``
  (the patched ``MoELayer.forward`` after routing) / ``moe_experts(experts, x, probs, routing_map, topk,
  clamp_limit=None) -> fp32 [T, H]``: ``zerodiff.ops.moe.moe_experts`` in the contiguous layout on a stacked
  per-module deployment copy of the expert masters (requantised in place on every forward), slots
  from ``routing_slots(probs, routing_map, topk)`` (expert id descending = ``route``'s slot order), FP32 combine
  in slot order, ``finish`` with the shared expert (one BF16 rounding); straight-through backward (FP32 graph,
  unquantised masters) to x, probs and every master (``expert_master_weights``: SequentialMLP / TEGroupedMLP).
"""

from __future__ import annotations

from .common import WeightVersionError  # noqa: F401
from .guard import (validate_config, config_values, check_transformer_config, check_module_class,  # noqa: F401
                    validate_training_args, training_args_values, check_training_args)
from .layers import router_logits, topk_routing, swiglu, mlp_activation, RMSNorm, rms_norm  # noqa: F401
from .logprobs import token_logprobs, cross_entropy, selective_log_softmax, route_rl_logprobs  # noqa: F401
from .linear import (FP8_UE8M0, fp8_gemm_backend, moe_backend, deploy_fp8, fp8_linear, Fp8Linear, bf16_linear,  # noqa: F401
                     lm_head_logits, FP8_ATTR, mark_fp8_linears, mark_bf16_linears, parallel_linear,
                     parallel_linear_fp8)
from .moe import expert_master_weights, routing_slots, moe_experts, moe_layer_forward  # noqa: F401

__all__ = [
    "WeightVersionError",
    "validate_config",
    "config_values",
    "check_transformer_config",
    "check_module_class",
    "validate_training_args",
    "training_args_values",
    "check_training_args",
    "selective_log_softmax",
    "route_rl_logprobs",
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
    "deploy_fp8",
    "FP8_UE8M0",
    "fp8_gemm_backend",
    "moe_backend",
    "bf16_linear",
    "lm_head_logits",
    "mark_bf16_linears",
    "parallel_linear",
    "expert_master_weights",
    "routing_slots",
    "moe_experts",
    "moe_layer_forward",
]
