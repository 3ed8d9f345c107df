"""Configuration of the DeepSeek-V4 actor: a megatron-core ``TransformerConfig`` plus the DeepSeek-V4 fields
megatron-core 0.19.2 has no place for, and the translation to and from the harness's
:class:`zerodiff.model.config.ModelConfig` (the model the zerodiff rollout engine runs).

Translation (``ModelConfig`` field -> where the actor keeps it)::

    layers        -> TransformerConfig.num_layers
    hidden        -> TransformerConfig.hidden_size
    heads         -> TransformerConfig.num_attention_heads
    rms_eps       -> TransformerConfig.layernorm_epsilon (normalization='RMSNorm')
    experts       -> TransformerConfig.num_moe_experts
    top_experts   -> TransformerConfig.moe_router_topk
    moe_inter     -> TransformerConfig.moe_ffn_hidden_size
    shared_inter  -> TransformerConfig.moe_shared_expert_intermediate_size (and ffn_hidden_size)
    routed_scale  -> TransformerConfig.moe_router_topk_scaling_factor
                     (moe_router_score_function='sigmoid', moe_router_enable_expert_bias=True,
                      moe_router_dtype='fp32')
    idx_heads     -> TransformerConfig.dsa_indexer_n_heads
    idx_dim       -> TransformerConfig.dsa_indexer_head_dim
    topk          -> TransformerConfig.dsa_indexer_topk
    vocab, max_pos, hc_mult, sinkhorn_iters, q_lora, d_latent, d_rope, rope_theta
                  -> DSV4Fields (vocab_size, max_position_embeddings, hc_mult, hc_sinkhorn_iters, q_lora_rank,
                     kv_lora_rank, qk_rope_head_dim, rope_theta)

``multi_latent_attention`` and ``experimental_attention_variant`` stay unset: Megatron's MLA / DSA modules are
not used (the zerodiff config guard refuses them); the actor's attention is its own module (see
:mod:`.model`). ``init_std`` is not part of the function the model computes and is not translated.

The DeepSeek-V4 checkpoint ``config.json`` written by ``zerodiff make-checkpoint``
(:func:`model_config_from_checkpoint_config`) is translated only where the zerodiff rollout engine runs the
same function; every feature it has no counterpart for is refused by name (:class:`ConfigError`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ....model.config import ModelConfig


@dataclass(frozen=True)
class DSV4Fields:
    """The DeepSeek-V4 fields a megatron-core 0.19.2 ``TransformerConfig`` has no field for."""

    vocab_size: int
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    rope_theta: float


def transformer_config(cfg: ModelConfig, **overrides):
    """A megatron-core ``TransformerConfig`` for the harness model ``cfg`` (translation table above);
    ``overrides`` are passed to the constructor (the zerodiff guard sees them when consistency mode is on)."""
    from .mcore import import_megatron

    import_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        ffn_hidden_size=cfg.shared_inter, kv_channels=cfg.d_latent,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=cfg.experts, moe_router_topk=cfg.top_experts, moe_ffn_hidden_size=cfg.moe_inter,
        moe_shared_expert_intermediate_size=cfg.shared_inter, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=cfg.routed_scale,
        moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_grouped_gemm=False,
        dsa_indexer_n_heads=cfg.idx_heads, dsa_indexer_head_dim=cfg.idx_dim, dsa_indexer_topk=cfg.topk,
        transformer_impl="local", bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1,
    )
    kw.update(overrides)
    import warnings

    with warnings.catch_warnings():  # megatron-core's own default cuda_graph_scope warns about itself
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        return TransformerConfig(**kw)


def dsv4_fields(cfg: ModelConfig) -> DSV4Fields:
    return DSV4Fields(vocab_size=cfg.vocab, max_position_embeddings=cfg.max_pos, hc_mult=cfg.hc_mult,
                      hc_sinkhorn_iters=cfg.sinkhorn_iters, q_lora_rank=cfg.q_lora, kv_lora_rank=cfg.d_latent,
                      qk_rope_head_dim=cfg.d_rope, rope_theta=cfg.rope_theta)


def model_config(tc, fields: DSV4Fields) -> ModelConfig:
    """The harness ``ModelConfig`` a (``TransformerConfig``, :class:`DSV4Fields`) pair describes (the inverse
    of :func:`transformer_config` / :func:`dsv4_fields`). Refuses (:class:`ConfigError`) a config that does not
    describe the harness's function: non-sigmoid scoring, no expert bias, no shared expert."""
    p = []
    if getattr(tc, "moe_router_score_function", None) != "sigmoid":
        p.append(f"moe_router_score_function={tc.moe_router_score_function!r}: the actor's scored MoE routes "
                 "with sigmoid + expert bias, as the rollout engine does")
    if not getattr(tc, "moe_router_enable_expert_bias", False):
        p.append("moe_router_enable_expert_bias=False: the rollout engine's router adds the expert bias")
    if not getattr(tc, "moe_shared_expert_intermediate_size", None):
        p.append("moe_shared_expert_intermediate_size unset: the rollout engine's MoE has a shared expert")
    if not tc.num_moe_experts:
        p.append("num_moe_experts unset: every DeepSeek-V4 layer is MoE")
    for f in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
        if not getattr(tc, f, None):
            p.append(f"{f} unset: the DSA indexer needs it")
    if p:
        from ... import _problems_to_error

        _problems_to_error("DeepSeek-V4 actor", p)
    return ModelConfig(
        vocab=fields.vocab_size, hidden=tc.hidden_size, layers=tc.num_layers, hc_mult=fields.hc_mult,
        sinkhorn_iters=fields.hc_sinkhorn_iters, heads=tc.num_attention_heads, q_lora=fields.q_lora_rank,
        d_latent=fields.kv_lora_rank, d_rope=fields.qk_rope_head_dim, idx_heads=tc.dsa_indexer_n_heads,
        idx_dim=tc.dsa_indexer_head_dim, topk=tc.dsa_indexer_topk, experts=tc.num_moe_experts,
        top_experts=tc.moe_router_topk, moe_inter=tc.moe_ffn_hidden_size,
        shared_inter=tc.moe_shared_expert_intermediate_size, routed_scale=float(tc.moe_router_topk_scaling_factor),
        rms_eps=tc.layernorm_epsilon, max_pos=fields.max_position_embeddings, rope_theta=fields.rope_theta,
    )


# ------------------------------------------------------------------------------ checkpoint config.json
#: ``model_type`` of the actor's own checkpoints (:func:`.weights.save_checkpoint`)
HARNESS_MODEL_TYPE = "zerodiff_dsv4_harness"


def harness_config_json(cfg: ModelConfig) -> dict:
    """The ``config.json`` of an actor checkpoint: the harness fields under DeepSeek-V4's key names where one
    exists, plus ``zerodiff_model_config`` (every ``ModelConfig`` field, so the file alone rebuilds it)."""
    return {
        "architectures": ["ZerodiffDeepseekV4Actor"], "model_type": HARNESS_MODEL_TYPE, "torch_dtype": "bfloat16",
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "q_lora_rank": cfg.q_lora, "kv_lora_rank": cfg.d_latent,
        "qk_rope_head_dim": cfg.d_rope, "index_n_heads": cfg.idx_heads, "index_head_dim": cfg.idx_dim,
        "index_topk": cfg.topk, "n_routed_experts": cfg.experts, "num_experts_per_tok": cfg.top_experts,
        "moe_intermediate_size": cfg.moe_inter, "n_shared_experts": 1, "scoring_func": "sigmoid",
        "routed_scaling_factor": cfg.routed_scale, "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.sinkhorn_iters,
        "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": cfg.max_pos, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                "scale_fmt": "fp32", "weight_block_size": [128, 128]},
        "zerodiff_model_config": asdict(cfg),
    }


def unsupported_checkpoint_features(cj: dict) -> list:
    """What a DeepSeek-V4 ``config.json`` asks for that the zerodiff rollout engine does not compute (each
    entry names the key)."""
    p = []
    lt = list(cj.get("layer_types") or [])
    rates = cj.get("compress_rates") or {}
    comp = sorted({t for t in lt if int(rates.get(t, 0)) > 1})
    if comp:
        p.append(f"layer_types {comp} (compress_rates {dict(rates)}): compressed attention (C4A / C128A compressor "
                 "and its KV pool) has no counterpart in the rollout engine's attention")
    if cj.get("sliding_window"):
        p.append(f"sliding_window={cj['sliding_window']}: the sliding-window branch of DeepSeek-V4 attention has no "
                 "counterpart in the rollout engine (its attention reads the DSA top-k only)")
    mlt = list(cj.get("mlp_layer_types") or [])
    if "hash_moe" in mlt:
        p.append(f"mlp_layer_types hash_moe x{mlt.count('hash_moe')}: hash-routed MoE (gate.tid2eid) has no "
                 "counterpart in the rollout engine's router")
    if cj.get("scoring_func", "sigmoid") != "sigmoid":
        p.append(f"scoring_func={cj.get('scoring_func')!r}: the rollout engine's router scores with sigmoid")
    if cj.get("swiglu_limit"):
        p.append(f"swiglu_limit={cj['swiglu_limit']}: the rollout engine's SwiGLU has no clamp")
    if cj.get("o_groups") or cj.get("o_lora_rank"):
        p.append(f"o_groups={cj.get('o_groups')} / o_lora_rank={cj.get('o_lora_rank')}: the grouped output LoRA "
                 "(wo_a / wo_b) has no counterpart (the rollout engine has one output projection wo)")
    if cj.get("rope_scaling"):
        p.append(f"rope_scaling={cj['rope_scaling']}: YaRN rotary scaling is not applied by the rollout engine")
    if cj.get("num_nextn_predict_layers"):
        p.append(f"num_nextn_predict_layers={cj['num_nextn_predict_layers']}: MTP layers are not supported")
    if cj.get("tie_word_embeddings"):
        p.append("tie_word_embeddings=True: the rollout engine has a separate LM head")
    return p


def model_config_from_checkpoint_config(cj: dict) -> ModelConfig:
    """``ModelConfig`` of a checkpoint ``config.json``: an actor checkpoint (``model_type`` =
    :data:`HARNESS_MODEL_TYPE`) is read back exactly; a DeepSeek-V4 checkpoint (``zerodiff make-checkpoint``)
    is refused with one :class:`ConfigError` naming every feature the rollout engine does not compute
    (:func:`unsupported_checkpoint_features`): loading only the tensors that map would give a model that
    computes a different function than the checkpoint describes."""
    if cj.get("model_type") == HARNESS_MODEL_TYPE:
        return ModelConfig(**cj["zerodiff_model_config"])
    from ... import _problems_to_error

    p = unsupported_checkpoint_features(cj)
    if not p:  # pragma: no cover - every DeepSeek-V4 config names at least its attention kinds
        p.append(f"model_type={cj.get('model_type')!r}: not an actor checkpoint; no translation is defined")
    _problems_to_error("DeepSeek-V4 checkpoint (config.json)", p)
    raise AssertionError  # pragma: no cover
