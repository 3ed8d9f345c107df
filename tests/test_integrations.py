"""CPU tests for zerodiff.integrations (the glue the patches/vllm and patches/megatron series call).

* the switch (ZERODIFF_CONSISTENT) and its refusal of unclear values;
* the fail-closed config validators: each bad setting refused with a message naming it, a good config accepted;
* switch off: the guards are no-ops (adapters never called);
* adapters: upstream layouts in, zerodiff op results out, on small CPU tensors (reference/interpreter);
* the real patch tooling on our series (skipped when build/sources is absent, e.g. in CI).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from zerodiff.integrations import ConfigError, enabled
from zerodiff.integrations import vllm as zv

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ switch
def test_switch_values():
    assert enabled({}) is False
    assert enabled({"ZERODIFF_CONSISTENT": "0"}) is False
    assert enabled({"ZERODIFF_CONSISTENT": ""}) is False
    assert enabled({"ZERODIFF_CONSISTENT": "1"}) is True
    for bad in ("true", "yes", "2", "on"):
        with pytest.raises(ConfigError, match="ZERODIFF_CONSISTENT"):
            enabled({"ZERODIFF_CONSISTENT": bad})


# ------------------------------------------------------------------------------------- vLLM config guard
GOOD_VLLM = dict(
    tensor_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
    enable_expert_parallel=True, expert_parallel_world=8, all2all_backend="deepep_low_latency",
    enable_prefix_caching=False, speculative=False, cudagraph_mode="FULL_AND_PIECEWISE",
    architectures=("DeepseekV4ForCausalLM",), is_moe=True, quantization="fp8", kv_cache_dtype="fp8",
    indexer_kv_dtype="auto", moe_backend="deep_gemm", linear_backend="deep_gemm",
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
    ("moe_backend", "triton", "moe_backend='triton'"),
    ("moe_backend", "deep_gemm_mega_moe", "moe_backend='deep_gemm_mega_moe'"),
    ("linear_backend", "auto", "linear_backend='auto'"),
    ("linear_backend", "flashinfer_cutlass", "linear_backend='flashinfer_cutlass'"),
]


def test_vllm_validate_accepts_good():
    zv.validate_config(**GOOD_VLLM)
    for mode in ("NONE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", None):
        zv.validate_config(**{**GOOD_VLLM, "cudagraph_mode": mode})
    for kv in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        zv.validate_config(**{**GOOD_VLLM, "kv_cache_dtype": kv})
    # a dense BF16 non-DSV4 model needs none of the MoE/FP8/KV rules
    zv.validate_config(architectures=("LlamaForCausalLM",), is_moe=False, quantization=None,
                       kv_cache_dtype="auto", moe_backend="auto", linear_backend="auto")
    # EP on a single GPU has no cross-GPU combine
    zv.validate_config(**{**GOOD_VLLM, "expert_parallel_world": 1, "all2all_backend": "allgather_reducescatter"})


@pytest.mark.parametrize("key,value,needle", BAD_VLLM)
def test_vllm_validate_refuses(key, value, needle):
    with pytest.raises(ConfigError) as ei:
        zv.validate_config(**{**GOOD_VLLM, key: value})
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
             mode=_Mode("FULL_AND_PIECEWISE"), archs=["DeepseekV4ForCausalLM"], is_moe=True, quant="fp8",
             kv="fp8", ikv="auto", moe="deep_gemm", lin="deep_gemm")
    d.update(over)
    return NS(
        parallel_config=NS(tensor_parallel_size=d["tp"], prefill_context_parallel_size=d["pcp"],
                           decode_context_parallel_size=d["dcp"], enable_expert_parallel=d["ep"],
                           data_parallel_size=d["dp"], all2all_backend=d["a2a"]),
        cache_config=NS(enable_prefix_caching=d["prefix"], cache_dtype=d["kv"]),
        speculative_config=d["spec"],
        compilation_config=NS(cudagraph_mode=d["mode"]),
        model_config=NS(architectures=d["archs"], is_moe=d["is_moe"], quantization=d["quant"],
                        is_submodel_config=False),
        attention_config=NS(indexer_kv_dtype=d["ikv"]),
        kernel_config=NS(moe_backend=d["moe"], linear_backend=d["lin"]),
    )


def test_vllm_check_config_object():
    on = {"ZERODIFF_CONSISTENT": "1"}
    assert zv.check_vllm_config(fake_vllm_config(), on) is True
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
