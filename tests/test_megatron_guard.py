"""The fail-closed Megatron config guard (``zerodiff.integrations.megatron.guard``): each bad setting refused
with a message naming it, good configs accepted, a no-op with the switch off."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch.nn.functional as F

from zerodiff.integrations import ConfigError
from zerodiff.integrations import megatron as zm


GOOD_MEG = dict(
    tensor_model_parallel_size=1, expert_tensor_parallel_size=1, sequence_parallel=False, context_parallel_size=2,
    cp_comm_type="all_gather", normalization="RMSNorm", layernorm_zero_centered_gamma=False,
    fused_residual_rmsnorm=False, gated_linear_unit=True, activation_is_silu=True, glu_linear_offset=0.0,
    use_te_activation_func=False, add_bias_linear=False, num_moe_experts=256, moe_router_dtype="fp32",
    moe_router_num_groups=None, moe_router_group_topk=None, moe_expert_capacity_factor=None,
    moe_input_jitter_eps=None, moe_enable_routing_replay=False, moe_router_force_load_balancing=False,
    moe_router_force_biased=None, moe_apply_probs_on_input=False, moe_router_score_function="sqrtsoftplus",
    fp8=None, fp4=None,
)


BAD_MEG = [
    ("tensor_model_parallel_size", 2, "tensor_model_parallel_size=2"),
    ("expert_tensor_parallel_size", 4, "expert_tensor_parallel_size=4"),
    ("sequence_parallel", True, "sequence_parallel"),
    ("cp_comm_type", "p2p", "cp_comm_type='p2p'"),
    ("cp_comm_type", ["all_gather", "a2a"], "cp_comm_type=['all_gather', 'a2a']"),
    ("normalization", "LayerNorm", "normalization='LayerNorm'"),
    ("layernorm_zero_centered_gamma", True, "layernorm_zero_centered_gamma"),
    ("fused_residual_rmsnorm", True, "fused_residual_rmsnorm"),
    ("gated_linear_unit", False, "gated_linear_unit=False"),
    ("activation_is_silu", False, "activation_func silu=False"),
    ("glu_linear_offset", 1.0, "glu_linear_offset=1.0"),
    ("use_te_activation_func", True, "use_te_activation_func"),
    ("add_bias_linear", True, "add_bias_linear"),
    ("moe_router_dtype", None, "moe_router_dtype=None"),
    ("moe_router_dtype", "fp64", "moe_router_dtype='fp64'"),
    ("moe_router_group_topk", 4, "moe_router_group_topk=4"),
    ("moe_expert_capacity_factor", 1.25, "moe_expert_capacity_factor=1.25"),
    ("moe_input_jitter_eps", 0.01, "moe_input_jitter_eps=0.01"),
    ("moe_enable_routing_replay", True, "moe_enable_routing_replay"),
    ("moe_router_force_load_balancing", True, "moe_router_force_load_balancing"),
    ("moe_router_force_biased", 0.5, "moe_router_force_biased=0.5"),
    ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input"),
    ("moe_router_score_function", "gumbel", "moe_router_score_function='gumbel'"),
    ("fp8", "e4m3", "fp8='e4m3'"),
    ("fp4", "e2m1", "fp4='e2m1'"),
    ("moe_router_load_balancing_type", "sinkhorn", "moe_router_load_balancing_type='sinkhorn'"),
    ("moe_router_load_balancing_type", ["aux_loss", "quantile_balancing"], "quantile_balancing"),
    ("cross_entropy_loss_fusion", True, "cross_entropy_loss_fusion"),
    ("hidden_dropout", 0.1, "hidden_dropout=0.1"),
    ("attention_dropout", 0.1, "attention_dropout=0.1"),
    ("transformer_impl", "transformer_engine", "transformer_impl='transformer_engine'"),
    ("transformer_impl", "inference_optimized", "transformer_impl='inference_optimized'"),
    ("multi_latent_attention", True, "multi_latent_attention=True"),
    ("experimental_attention_variant", "dsa", "experimental_attention_variant='dsa'"),
    ("experimental_attention_variant", "gated_delta_net", "experimental_attention_variant='gated_delta_net'"),
    ("expert_model_parallel_size", 8, "expert_model_parallel_size=8"),
    ("parallel_state_tensor_parallel_size", 2, "parallel_state tensor-parallel world size 2"),
    ("parallel_state_expert_tensor_parallel_size", 2, "parallel_state expert-tensor-parallel world size 2"),
    ("parallel_state_expert_model_parallel_size", 4, "(parallel_state: 4)"),
]


def test_megatron_validate_accepts_good():
    zm.validate_config(**GOOD_MEG)
    zm.validate_config(**{**GOOD_MEG, "context_parallel_size": 1, "cp_comm_type": "p2p"})  # CP off: ignored
    zm.validate_config(**{**GOOD_MEG, "num_moe_experts": None, "moe_router_dtype": None})  # dense model


@pytest.mark.parametrize("key,value,needle", BAD_MEG)
def test_megatron_validate_refuses(key, value, needle):
    with pytest.raises(ConfigError) as ei:
        zm.validate_config(**{**GOOD_MEG, key: value})
    assert needle in str(ei.value) and "Megatron" in str(ei.value)


def test_megatron_check_config_object():
    cfg = NS(tensor_model_parallel_size=1, expert_tensor_parallel_size=None, sequence_parallel=False,
             context_parallel_size=1, cp_comm_type=None, normalization="RMSNorm", gated_linear_unit=True,
             activation_func=F.silu, add_bias_linear=False, num_moe_experts=8, moe_router_dtype="fp32",
             moe_router_score_function="softmax", transformer_impl="local")
    assert zm.check_transformer_config(cfg, {"ZERODIFF_CONSISTENT": "1"}) is True
    no_impl = NS(**{k: v for k, v in vars(cfg).items() if k != "transformer_impl"})
    with pytest.raises(ConfigError, match="transformer_impl='transformer_engine'"):  # Megatron's default
        zm.check_transformer_config(no_impl, {"ZERODIFF_CONSISTENT": "1"})
    bad = NS(**{**vars(cfg), "activation_func": F.gelu, "tensor_model_parallel_size": 8})
    with pytest.raises(ConfigError) as ei:
        zm.check_transformer_config(bad, {"ZERODIFF_CONSISTENT": "1"})
    assert "tensor_model_parallel_size=8" in str(ei.value) and "silu=False" in str(ei.value)
    assert zm.check_transformer_config(bad, {}) is False  # switch off: no-op
