"""The fail-closed vLLM config guard (``zerodiff.integrations.vllm.guard``): each bad setting refused with a
message naming it, every problem listed at once, good configs accepted, the guard a no-op with the switch off."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from zerodiff.integrations import ConfigError
from zerodiff.integrations import vllm as zv


GOOD_VLLM = dict(
    tensor_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
    enable_expert_parallel=True, expert_parallel_world=8, all2all_backend="deepep_low_latency",
    enable_prefix_caching=False, speculative=False, cudagraph_mode="FULL_AND_PIECEWISE",
    architectures=("DeepseekV4ForCausalLM",), is_moe=True, quantization="deepseek_v4_fp8", kv_cache_dtype="fp8",
    indexer_kv_dtype="auto", moe_backend="triton", linear_backend="deep_gemm", data_parallel_size=8,
    attention_backend=None, flashinfer_sampler="0", max_model_len=2048, index_topk=512, indexer_compress_ratio=4,
)


BAD_VLLM = [
    ("tensor_parallel_size", 2, "tensor_parallel_size=2"),
    ("decode_context_parallel_size", 2, "decode_context_parallel_size=2"),
    ("prefill_context_parallel_size", 4, "prefill_context_parallel_size=4"),
    ("all2all_backend", "allgather_reducescatter", "all2all_backend='allgather_reducescatter'"),
    ("enable_prefix_caching", True, "enable_prefix_caching"),
    ("speculative", True, "speculative_config"),
    ("cudagraph_mode", "PIECEWISE", "cudagraph_mode=PIECEWISE"),
    ("kv_cache_dtype", "auto", "kv_cache_dtype='auto'"),
    ("kv_cache_dtype", "bfloat16", "kv_cache_dtype='bfloat16'"),
    ("indexer_kv_dtype", "mxfp4", "indexer_kv_dtype='mxfp4'"),
    ("moe_backend", "auto", "moe_backend='auto'"),
    ("moe_backend", "flashinfer_cutlass", "moe_backend='flashinfer_cutlass'"),
    ("moe_backend", "deep_gemm_mega_moe", "moe_backend='deep_gemm_mega_moe'"),
    ("enable_expert_parallel", False, "data_parallel_size=8 without enable_expert_parallel"),
    ("attention_backend", "FLASHINFER_DSV4", "attention_backend='FLASHINFER_DSV4'"),
    ("flashinfer_sampler", None, "VLLM_USE_FLASHINFER_SAMPLER=None"),
    ("flashinfer_sampler", "1", "VLLM_USE_FLASHINFER_SAMPLER='1'"),
    ("max_model_len", 2052, "max_model_len=2052"),
    ("linear_backend", "auto", "linear_backend='auto'"),
    ("linear_backend", "flashinfer_cutlass", "linear_backend='flashinfer_cutlass'"),
    ("quantization", "mxfp4", "quantization='mxfp4'"),
    ("quantization", "fp8", "linear_backend='auto'"),  # needs an extra override: see below
]


def test_vllm_validate_accepts_good():
    zv.validate_config(**GOOD_VLLM)
    for mode in ("NONE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", None):
        zv.validate_config(**{**GOOD_VLLM, "cudagraph_mode": mode})
    for kv in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        zv.validate_config(**{**GOOD_VLLM, "kv_cache_dtype": kv})
    for moe in ("triton", "deep_gemm"):
        zv.validate_config(**{**GOOD_VLLM, "moe_backend": moe})
    for be in (None, "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4"):
        zv.validate_config(**{**GOOD_VLLM, "attention_backend": be})
    for arch in ("DeepseekV4ForConditionalGeneration", "DeepseekV41ForCausalLM"):
        zv.validate_config(**{**GOOD_VLLM, "architectures": (arch,)})
    zv.validate_config(**{**GOOD_VLLM, "quantization": "fp8"})
    zv.validate_config(**{**GOOD_VLLM, "max_model_len": 65536, "indexer_compress_ratio": None})  # no C4A layer
    # a DeepSeek-V3-style MoE model keeps the DeepGEMM-experts rule
    with pytest.raises(ConfigError, match="moe_backend='triton'"):
        zv.validate_config(**{**GOOD_VLLM, "architectures": ("DeepseekV3ForCausalLM",)})
    # a dense BF16 non-DSV4 model needs none of the MoE/FP8/KV rules
    zv.validate_config(architectures=("LlamaForCausalLM",), is_moe=False, quantization=None,
                       kv_cache_dtype="auto", moe_backend="auto", linear_backend="auto", data_parallel_size=4)
    # EP on a single GPU has no cross-GPU combine
    zv.validate_config(**{**GOOD_VLLM, "expert_parallel_world": 1, "all2all_backend": "allgather_reducescatter"})


@pytest.mark.parametrize("key,value,needle", BAD_VLLM)
def test_vllm_validate_refuses(key, value, needle):
    over = {key: value}
    if key == "quantization" and value == "fp8":  # the linear-backend rule holds for plain block FP8 too
        over["linear_backend"] = "auto"
    with pytest.raises(ConfigError) as ei:
        zv.validate_config(**{**GOOD_VLLM, **over})
    assert needle in str(ei.value)
    assert "ZERODIFF_CONSISTENT" in str(ei.value)


def test_vllm_validate_lists_every_problem():
    with pytest.raises(ConfigError) as ei:
        zv.validate_config(**{**GOOD_VLLM, "tensor_parallel_size": 4, "enable_prefix_caching": True,
                              "speculative": True})
    msg = str(ei.value)
    assert "tensor_parallel_size=4" in msg and "enable_prefix_caching" in msg and "speculative_config" in msg


class _Mode:  # stands in for vllm.config.compilation.CUDAGraphMode members
    def __init__(self, name):
        self.name = name


def fake_vllm_config(**over):
    d = dict(tp=1, pcp=1, dcp=1, ep=True, dp=8, a2a="deepep_low_latency", prefix=False, spec=None,
             mode=_Mode("FULL_AND_PIECEWISE"), archs=["DeepseekV4ForCausalLM"], is_moe=True,
             quant="deepseek_v4_fp8", kv="fp8", ikv="auto", moe="triton", lin="deep_gemm", attn=None)
    d.update(over)
    return NS(
        parallel_config=NS(tensor_parallel_size=d["tp"], prefill_context_parallel_size=d["pcp"],
                           decode_context_parallel_size=d["dcp"], enable_expert_parallel=d["ep"],
                           data_parallel_size=d["dp"], all2all_backend=d["a2a"]),
        cache_config=NS(enable_prefix_caching=d["prefix"], cache_dtype=d["kv"]),
        speculative_config=d["spec"],
        compilation_config=NS(cudagraph_mode=d["mode"]),
        model_config=NS(architectures=d["archs"], is_moe=d["is_moe"], quantization=d["quant"],
                        is_submodel_config=False, max_model_len=d.get("mml", 2048),
                        hf_config=NS(index_topk=512, compress_rates={"csa": 4, "hca": 128},
                                     layer_types=["hca", "csa", "swa"])),
        attention_config=NS(indexer_kv_dtype=d["ikv"], backend=d["attn"]),
        kernel_config=NS(moe_backend=d["moe"], linear_backend=d["lin"]),
    )


def test_vllm_check_config_object(caplog):
    on = {"ZERODIFF_CONSISTENT": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    with caplog.at_level("INFO", logger="zerodiff"):
        assert zv.check_vllm_config(fake_vllm_config(), on) is True
    assert "consistency mode ON" in caplog.text and "quantization=deepseek_v4_fp8" in caplog.text
    with pytest.raises(ConfigError, match="VLLM_USE_FLASHINFER_SAMPLER"):
        zv.check_vllm_config(fake_vllm_config(), {"ZERODIFF_CONSISTENT": "1"})
    with pytest.raises(ConfigError, match="max_model_len=4096"):
        zv.check_vllm_config(fake_vllm_config(mml=4096), on)
    with pytest.raises(ConfigError, match="attention_backend='FLASHINFER_DSV4'"):
        zv.check_vllm_config(fake_vllm_config(attn=_Mode("FLASHINFER_DSV4")), on)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        zv.check_vllm_config(fake_vllm_config(tp=2), on)
    with pytest.raises(ConfigError, match="cudagraph_mode=PIECEWISE"):
        zv.check_vllm_config(fake_vllm_config(mode=_Mode("PIECEWISE")), on)
    with pytest.raises(ConfigError, match="speculative_config"):
        zv.check_vllm_config(fake_vllm_config(spec=NS(num_speculative_tokens=1)), on)
    with pytest.raises(ConfigError, match="indexer_kv_dtype='mxfp4'"):
        zv.check_vllm_config(fake_vllm_config(ikv="mxfp4"), on)


def test_vllm_check_config_off_is_noop():
    bad = fake_vllm_config(tp=8, prefix=True, spec=NS(), mode=_Mode("PIECEWISE"), moe="triton")
    assert zv.check_vllm_config(bad, {}) is False
    assert zv.check_vllm_config(bad, {"ZERODIFF_CONSISTENT": "0"}) is False
