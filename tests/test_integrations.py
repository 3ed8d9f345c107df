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
    for bad in ("true", "yes", "2", "on", " 0", "0 ", " 1", "1\n"):
        with pytest.raises(ConfigError, match="ZERODIFF_CONSISTENT"):
            enabled({"ZERODIFF_CONSISTENT": bad})


SWITCH_HOOK = 'os.environ.get("ZERODIFF_CONSISTENT") == "1"'
SWITCH_GUARD = 'os.environ.get("ZERODIFF_CONSISTENT", "0") not in ("", "0")'


@pytest.mark.parametrize("side", ["vllm", "megatron"])
def test_patches_read_the_switch_one_way(side):
    """Every added line that reads the switch uses the hook form, except the config guard (0001), which uses
    the guard form: so a value like ' 0' can never turn hooks on while the guard stays silent."""
    seen_guard = 0
    for patch in sorted((REPO / "patches" / side).glob("*.patch")):
        for line in patch.read_text().splitlines():
            if not line.startswith("+") or "environ" not in line or "ZERODIFF_CONSISTENT" not in line:
                continue
            if "setenv" in line or "delenv" in line:
                continue
            if SWITCH_GUARD in line:
                assert patch.name.startswith("0001-"), f"{patch.name}: guard form outside the guard: {line}"
                seen_guard += 1
            else:
                assert SWITCH_HOOK in line, f"{patch.name}: the switch read another way: {line}"
    assert seen_guard == 1


# ------------------------------------------------------------------------------------- vLLM config guard
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


# ------------------------------------------------------------------------------------ DSA top-k adapters
from zerodiff.reference.topk import deterministic_topk_ref  # noqa: E402


def _tied_rows(g, n, w):
    x = torch.randint(-6, 6, (n, w), generator=g).float() / 4  # many exact ties
    x[0, :5] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0])  # +-0 ties
    x[1, 3] = 1e-40  # denormal
    return x


def test_indexer_topk_decode_and_prefill_layouts(seeded):
    g = seeded()
    k, w = 16, 96
    x = _tied_rows(g, 7, w)
    lens = torch.randint(0, w + 1, (7,), generator=g, dtype=torch.int32)
    lens[2] = 5  # shorter than k
    ref = deterministic_topk_ref(x, k, lens)
    # decode: seq_lens (B, 1), next_n = 1; output written in place into a wider buffer
    buf = torch.full((9, k), 99, dtype=torch.int32)
    zv.indexer_topk_decode(x, lens.view(7, 1), 1, buf, k)
    assert torch.equal(buf[:7], ref) and (buf[7:] == 99).all()
    # decode with next_n = 2: (B, 1) request lengths -> rows len-1, len
    req = torch.tensor([10, 40], dtype=torch.int32)
    out = torch.empty((4, k), dtype=torch.int32)
    zv.indexer_topk_decode(x[:4], req.view(2, 1), 2, out, k)
    assert torch.equal(out, deterministic_topk_ref(x[:4], k, torch.tensor([9, 10, 39, 40], dtype=torch.int32)))
    # prefill, row_starts None: same as decode
    pre = torch.empty((7, k), dtype=torch.int32)
    zv.indexer_topk_prefill(x, None, lens, pre, k)
    assert torch.equal(pre, ref)
    # prefill with per-row starts: request-local positions (relative to the start)
    starts = torch.tensor([0, 3, 1, 7, 0, 2, 5], dtype=torch.int32)
    wide = torch.full((7, w + 8), float("nan"))
    for r in range(7):
        wide[r, starts[r]: starts[r] + w] = x[r]
    pre2 = torch.empty((7, k), dtype=torch.int32)
    zv.indexer_topk_prefill(wide, starts, starts + lens, pre2, k)
    assert torch.equal(pre2, ref)
    # bf16 logits widen exactly
    xb = x.to(torch.bfloat16)
    zv.indexer_topk_decode(xb, lens.view(7, 1), 1, buf, k)
    assert torch.equal(buf[:7], deterministic_topk_ref(xb.float(), k, lens))
    # negative control: torch.topk's order (score-major) is not the contract order
    stock = x[:, :w].topk(k, dim=-1).indices.to(torch.int32)
    full = deterministic_topk_ref(x, k, torch.full((7,), w, dtype=torch.int32))
    assert not torch.equal(stock, full)


def test_indexer_topk_victim_in_batch(seeded):
    g = seeded()
    k, w = 8, 64
    victim = _tied_rows(g, 2, w)[:1]
    vlen = torch.tensor([50], dtype=torch.int32)
    alone = torch.empty((1, k), dtype=torch.int32)
    zv.indexer_topk_decode(victim, vlen.view(1, 1), 1, alone, k)
    for rnd in range(2):
        for batch in (2, 15, 17, 33, 65):
            for where in (0, batch // 2, batch - 1):
                x = _tied_rows(g, batch, w)
                lens = torch.randint(0, w + 1, (batch,), generator=g, dtype=torch.int32)
                x[where], lens[where] = victim[0], vlen[0]
                out = torch.empty((batch, k), dtype=torch.int32)
                zv.indexer_topk_decode(x, lens.view(batch, 1), 1, out, k)
                assert torch.equal(out[where: where + 1], alone), (rnd, batch, where)


def test_short_context_fill_contract_order():
    k, ratio = 8, 4
    positions = torch.tensor([0, 3, 4, 13, 31, 30], dtype=torch.int64)  # (p+1)//4 <= k: the static bound
    out = torch.full((8, k), 77, dtype=torch.int32)
    zv.fill_short_context_topk(out, positions, 6, k, ratio)
    for r, p in enumerate(positions.tolist()):
        n = (p + 1) // ratio
        row = deterministic_topk_ref(torch.randn(1, 64), k, torch.tensor([n], dtype=torch.int32))
        assert torch.equal(out[r: r + 1], row)
    assert (out[6:] == 77).all()
    # negative control: the upstream fill is ascending (0, 1, ..., n-1, -1, ...)
    n = (13 + 1) // ratio
    upstream = torch.tensor([j if j < n else -1 for j in range(k)], dtype=torch.int32)
    assert not torch.equal(out[3], upstream)
    # static bound: model limit only
    assert zv.short_context_uses_fill(8192, 4, 2048) and not zv.short_context_uses_fill(8196, 4, 2048)
    zv.fill_short_context_topk(out, positions, 0, k, ratio)  # no-op


# ------------------------------------------------------------------------ MoE SiLU*up -> FP8 adapters
from zerodiff.reference.silu_mul_quant import silu_mul_quant_fp8_ref  # noqa: E402


def _act(g, *shape):
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-40, -3.0])
    return x


@pytest.mark.parametrize("fmt", ["FLOAT32", "FLOAT32_CEIL_UE8M0"])
def test_moe_act_quant_contiguous_layout(seeded, fmt):
    g = seeded(fmt)
    M, N = 6, 256
    x = _act(g, M, 2 * N)
    out = torch.empty((M, N), dtype=torch.float8_e4m3fn)
    q, s = zv.moe_act_quant_contiguous(x, out, group_size=128, clamp_limit=7.0, scale_fmt=fmt,
                                       alpha=1.0, beta=0.0)
    rq, rs = silu_mul_quant_fp8_ref(x, group=128, clamp_limit=7.0, ue8m0=fmt != "FLOAT32")
    assert q.data_ptr() == out.data_ptr()
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert s.stride(0) == 1 and s.stride(1) == 8  # MN-major, M padded to a multiple of 4
    # the enum member itself is accepted too
    q2, s2 = zv.moe_act_quant_contiguous(x, None, scale_fmt=NS(name=fmt))
    assert torch.equal(s2, silu_mul_quant_fp8_ref(x, group=128, ue8m0=fmt != "FLOAT32")[1])


def test_moe_act_quant_packed_ue8m0(seeded):
    g = seeded()
    M, N = 5, 640  # G = 5 groups -> 2 int32 words per row (last one padded)
    x = _act(g, M, 2 * N)
    q, s = zv.moe_act_quant_contiguous(x, None, scale_fmt="UE8M0")
    rq, rs = silu_mul_quant_fp8_ref(x, group=128, ue8m0=True)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert s.dtype == torch.int32 and tuple(s.shape) == (M, 2) and s.stride(0) == 1
    exps = ((rs.view(torch.int32) >> 23) & 0xFF).tolist()
    for m in range(M):
        words = [int(v) & 0xFFFFFFFF for v in s[m].tolist()]
        got = [(words[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(5)]
        assert got == exps[m]
        assert (words[1] >> 8) == 0  # padding bytes are zero


def test_moe_act_quant_refuses_swigluoai_and_unknown_format(seeded):
    x = _act(seeded(), 2, 256)
    with pytest.raises(ConfigError, match="gemm1_alpha"):
        zv.moe_act_quant_contiguous(x, None, alpha=1.702, beta=1.0)
    with pytest.raises(ConfigError, match="activation='GELU'"):
        zv.moe_act_quant_contiguous(x, None, activation="GELU")
    with pytest.raises(ConfigError, match="scale format"):
        zv.moe_act_quant_contiguous(x, None, scale_fmt="E4M3_WEIRD")


@pytest.mark.parametrize("fmt", ["FLOAT32", "UE8M0"])
def test_moe_act_quant_masked_matches_contiguous(seeded, fmt):
    g = seeded(fmt)
    E, T, N = 3, 5, 256
    y = _act(g, E, T, 2 * N)
    counts = torch.tensor([5, 0, 2], dtype=torch.int32)
    q, s = zv.moe_act_quant_masked(y, counts, scale_fmt=fmt)
    G = N // 128 if fmt == "FLOAT32" else 1
    assert tuple(s.shape) == (E, T, G) and s.stride() == (T * G, 1, T)
    for e in range(E):
        c = int(counts[e])
        if c:
            cq, cs = zv.moe_act_quant_contiguous(y[e, :c].contiguous(), None, scale_fmt=fmt)
            assert torch.equal(q[e, :c].view(torch.uint8), cq.view(torch.uint8))
            assert torch.equal(s[e, :c], cs)
        assert (q[e, c:].view(torch.uint8) == 0).all() and (s[e, c:] == 0).all()
    # negative control: two BF16 roundings (stock activation) change some FP8 codes on these inputs
    g2, u2 = y[0, :, :N], y[0, :, N:]
    two = (torch.nn.functional.silu(g2) * u2).to(torch.bfloat16)
    one = silu_mul_quant_fp8_ref(y[0], group=128)[0]
    from zerodiff.reference.fp8_quant import quant_per_token_group_ref
    assert not torch.equal(quant_per_token_group_ref(two, 128)[0].view(torch.uint8), one.view(torch.uint8))


# ------------------------------------------------------------------------------------ Megatron guard
import torch.nn.functional as F  # noqa: E402

from zerodiff.integrations import megatron as zm  # noqa: E402

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


# ----------------------------------------------------------------------------- Megatron autograd wrappers
def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_router_logits_value_and_grad(seeded):
    from zerodiff.ops.router_gemm import router_gemm

    g = seeded()
    x = torch.randn(3, 2, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(8, 64, generator=g) * 0.1).to(torch.bfloat16).requires_grad_(True)
    out = zm.router_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (3, 2, 8)
    assert torch.equal(out.detach().reshape(6, 8), router_gemm(x.detach().reshape(6, 64), w.detach()))
    gy = torch.randn(3, 2, 8, generator=g)
    out.backward(gy)
    xd, wd = x.detach().double(), w.detach().double()
    assert _rel(x.grad, (gy.double() @ wd)) < 1e-2
    assert _rel(w.grad, gy.double().reshape(6, 8).t() @ xd.reshape(6, 64)) < 1e-2
    with pytest.raises(ConfigError, match="bfloat16"):
        zm.router_logits(x.detach().float(), w.detach())
    with pytest.raises(ConfigError, match="bias"):
        zm.router_logits(x.detach(), w.detach(), torch.zeros(8))


def test_router_weight_version_check(seeded):
    g = seeded()
    x = torch.randn(4, 32, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = torch.nn.Parameter((torch.randn(8, 32, generator=g) * 0.1).to(torch.bfloat16))
    out = zm.router_logits(x, w)
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step between forward and backward
    with pytest.raises(zm.WeightVersionError, match="changed in place"):
        out.sum().backward()


@pytest.mark.parametrize("score,pre", [("softmax", False), ("softmax", True), ("sigmoid", False),
                                       ("sqrtsoftplus", False)])
def test_topk_routing_values_and_grad(seeded, score, pre):
    from zerodiff.ops.moe import route

    g = seeded(score)
    T, E, k = 10, 16, 4
    logits = (torch.randint(-8, 8, (T, E), generator=g).float() / 4).requires_grad_(True)  # ties
    bias = torch.randn(E, generator=g) * 0.01 if score != "softmax" else None
    probs, rmap = zm.topk_routing(logits, k, score_function=score, use_pre_softmax=pre, scaling_factor=2.5,
                                  expert_bias=bias)
    renorm = score != "softmax" or not pre
    w, ids = route(logits.detach(), k, scoring=score, bias=bias, renormalize=renorm, routed_scale=2.5)
    dense = torch.zeros(T, E).scatter(1, ids.long(), w)
    assert torch.equal(probs.detach(), dense)
    assert torch.equal(rmap, dense != 0) and int(rmap.sum()) == T * k
    # gradient: the same formula in float64 at the selected ids
    gy = torch.randn(T, E, generator=g)
    probs.backward(gy)
    ld = logits.detach().double().requires_grad_(True)
    sc = {"softmax": lambda z: torch.softmax(z, -1), "sigmoid": torch.sigmoid,
          "sqrtsoftplus": lambda z: F.softplus(z).sqrt()}[score](ld)
    sel = sc.gather(1, ids.long())
    if renorm:
        sel = sel / sel.sum(-1, keepdim=True)
    (gref,) = torch.autograd.grad((sel * 2.5 * gy.double().gather(1, ids.long())).sum(), ld)
    assert _rel(logits.grad, gref) < 1e-5


def test_swiglu_value_and_grad(seeded):
    from zerodiff.reference.silu_mul_quant import silu_mul_ref

    g = seeded()
    x = (torch.randn(2, 3, 64, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    y = zm.swiglu(x, clamp_limit=2.0)
    assert torch.equal(y.detach().reshape(6, 32), silu_mul_ref(x.detach().reshape(6, 64), clamp_limit=2.0))
    gy = torch.randn(2, 3, 32, generator=g)
    y.backward(gy)
    xd = x.detach().double().requires_grad_(True)
    gg, uu = xd.chunk(2, -1)
    ref = F.silu(gg.clamp(max=2.0)) * uu.clamp(-2.0, 2.0)
    (gref,) = torch.autograd.grad(ref, xd, gy.double())
    assert _rel(x.grad, gref) < 1e-2
    # negative control: the stock bf16 graph (two roundings) differs from the one-rounding value
    stock = F.silu(x.detach()[..., :32].clamp(max=2.0)) * x.detach()[..., 32:].clamp(-2.0, 2.0)
    assert not torch.equal(stock, y.detach())


def test_mlp_activation_refusals(seeded):
    x = torch.randn(4, 64, generator=seeded()).to(torch.bfloat16)
    cfg = NS(gated_linear_unit=True, glu_linear_offset=0.0, activation_func_clamp_value=None)
    assert zm.mlp_activation(cfg, F.silu, x, None, None).shape == (4, 32)
    with pytest.raises(ConfigError, match="bias"):
        zm.mlp_activation(cfg, F.silu, x, torch.zeros(64, dtype=torch.bfloat16), None)
    with pytest.raises(ConfigError, match="per_token_scale"):
        zm.mlp_activation(cfg, F.silu, x, None, torch.ones(4))
    with pytest.raises(ConfigError, match="SwiGLU"):
        zm.mlp_activation(cfg, F.gelu, x, None, None)


def test_rmsnorm_module_value_and_grad(seeded):
    from zerodiff.reference.rmsnorm import rms_norm_ref

    g = seeded()
    norm = zm.RMSNorm(64, eps=1e-5, config=NS(params_dtype=torch.bfloat16, layernorm_zero_centered_gamma=False))
    assert list(norm.state_dict()) == ["weight"]
    with torch.no_grad():
        norm.weight.copy_((1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16))
    x = (torch.randn(3, 2, 64, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    y = norm(x)
    assert torch.equal(y.detach().reshape(6, 64), rms_norm_ref(x.detach().reshape(6, 64), norm.weight.detach(), 1e-5))
    gy = torch.randn(3, 2, 64, generator=g)
    y.backward(gy)
    xd = x.detach().double().requires_grad_(True)
    wd = norm.weight.detach().double().requires_grad_(True)
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    gx, gw = torch.autograd.grad(ref, (xd, wd), gy.double())
    assert _rel(x.grad, gx) < 1e-2 and _rel(norm.weight.grad, gw) < 1e-2
    with pytest.raises(ConfigError, match="zero_centered_gamma"):
        zm.RMSNorm(64, config=NS(layernorm_zero_centered_gamma=True))


def test_cross_entropy_is_minus_logprob(seeded):
    from zerodiff.ops.logprobs import token_logprobs

    g = seeded()
    s, b, V = 3, 2, 50
    logits = (torch.randn(s, b, V, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, V, (s, b), generator=g)
    loss = zm.cross_entropy(logits, target)
    lp = token_logprobs(logits.detach().reshape(-1, V), target.reshape(-1))
    assert loss.shape == (s, b) and loss.dtype == torch.float32
    assert torch.equal(-loss.detach().reshape(-1), lp)  # negation is exact
    gy = torch.randn(s, b, generator=g)
    loss.backward(gy)
    ld = logits.detach().double().requires_grad_(True)
    ref = -torch.log_softmax(ld, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    (gref,) = torch.autograd.grad(ref, ld, gy.double())
    assert _rel(logits.grad, gref) < 1e-2
    with pytest.raises(ConfigError, match="label_smoothing"):
        zm.cross_entropy(logits.detach(), target, label_smoothing=0.1)
    # temperature variant
    lpt = zm.token_logprobs(logits.detach(), target, temperature=0.7)
    assert torch.equal(lpt.reshape(-1), token_logprobs(logits.detach().reshape(-1, V), target.reshape(-1),
                                                       temperature=0.7))


def test_fp8_linear_forward_and_ste(seeded):
    from zerodiff.ops.fp8_gemm import fp8_linear
    from zerodiff.ops.fp8_quant import Fp8Weight

    g = seeded()
    lin = zm.Fp8Linear((torch.randn(128, 128, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16).requires_grad_(True)
    y = lin(x)
    assert torch.equal(y.detach(), fp8_linear(x.detach(), Fp8Weight.from_master(lin.weight.detach(), ue8m0=zm.FP8_UE8M0)))
    gy = torch.randn(5, 128, generator=g)
    y.backward(gy)
    assert _rel(x.grad, gy.double() @ lin.weight.detach().double()) < 1e-2
    assert _rel(lin.weight.grad, gy.double().t() @ x.detach().double()) < 1e-2
    q_ptr = lin.fp8.q.data_ptr()
    with torch.no_grad():
        lin.weight.mul_(1.5)
    # the next forward requantises from the master first, in place (CUDA-graph safe)
    assert torch.equal(lin(x.detach()), fp8_linear(x.detach(), Fp8Weight.from_master(lin.weight.detach(), ue8m0=zm.FP8_UE8M0)))
    assert lin.fp8.q.data_ptr() == q_ptr


# ------------------------------------------------------------------ vLLM router / RMSNorm / log-probs
def test_vllm_router_logits(seeded):
    from zerodiff.ops.router_gemm import router_gemm

    g = seeded()
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(8, 64, generator=g) * 0.1).to(torch.bfloat16)
    out = zv.router_logits(x, w)
    assert out.shape == (2, 5, 8) and out.dtype == torch.float32
    assert torch.equal(out.reshape(10, 8), router_gemm(x.reshape(10, 64), w))
    # the same row alone and in batches
    for n in (1, 15, 16, 17, 33):
        xb = torch.randn(n, 64, generator=g).to(torch.bfloat16)
        xb[n // 2] = x[0, 0]
        assert torch.equal(zv.router_logits(xb, w)[n // 2], out[0, 0])
    with pytest.raises(ConfigError, match="bfloat16"):
        zv.router_logits(x, w.float())


def test_vllm_rms_norm(seeded):
    from zerodiff.reference.rmsnorm import rms_norm_ref

    g = seeded()
    x = (torch.randn(3, 4, 64, generator=g) * 2).to(torch.bfloat16)
    r = (torch.randn(3, 4, 64, generator=g) * 2).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    y = zv.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and torch.equal(y.reshape(12, 64), rms_norm_ref(x.reshape(12, 64), w, 1e-6))
    y2, r2 = zv.rms_norm(x, w, 1e-6, residual=r)
    ry, rr = rms_norm_ref(x.reshape(12, 64), w, 1e-6, residual=r.reshape(12, 64))
    assert torch.equal(y2.reshape(12, 64), ry) and torch.equal(r2.reshape(12, 64), rr)
    assert torch.equal(zv.rms_norm(x, None, 1e-6).reshape(12, 64),
                       rms_norm_ref(x.reshape(12, 64), torch.ones(64), 1e-6))
    with pytest.raises(ConfigError, match="bfloat16"):
        zv.rms_norm(x.float(), w, 1e-6)


# ------------------------------------------------------------------------------------------ vLLM mHC
def _mhc_case(g, T=6, n=4, H=64):
    from zerodiff.reference import mhc as mref

    res = (torch.randn(T, n, H, generator=g) * 2).to(torch.bfloat16)
    res[0, 1, :3] = torch.tensor([0.0, -0.0, 1e-40])  # signed zeros and a denormal in the streams
    fn = torch.randn(mref.n_mix(n), n * H, generator=g) * 0.05
    scale = torch.tensor([1.5, 0.5, 0.25])
    base = torch.randn(mref.n_mix(n), generator=g) * 0.1
    return res, fn, scale, base


# rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat: distinct values, so a swapped
# argument in an adapter shows
MHC_ARGS = (1e-6, 0.01, 0.002, 2.0, 20)


def test_vllm_mhc_adapters_are_the_zerodiff_ops(seeded):
    """Each of the five DeepSeek-V4 entry points equals the zerodiff op (composition) the training side runs."""
    from zerodiff.ops import mhc as zmhc

    g = seeded()
    res, fn, scale, base = _mhc_case(g)
    T, n, H = res.shape
    kw = dict(rms_eps=1e-6, hc_pre_eps=0.01, hc_sinkhorn_eps=0.002, hc_post_mult=2.0, sinkhorn_iters=20)
    li, post, comb = zmhc.mhc_pre(res, fn, scale, base, **kw)
    p, c, x = zv.mhc_pre(res, fn, scale, base, *MHC_ARGS, n_splits=7)  # upstream's n_splits is ignored
    assert p.shape == (T, n, 1) and c.shape == (T, n, n) and x.shape == (T, H)
    assert torch.equal(p[..., 0], post) and torch.equal(c, comb) and torch.equal(x, li)
    # leading dims [2, 3, n, H] as upstream's (..., hc_mult, hidden) contract
    p4, c4, x4 = zv.mhc_pre(res.reshape(2, 3, n, H), fn, scale, base, *MHC_ARGS)
    assert p4.shape == (2, 3, n, 1) and torch.equal(x4.reshape(T, H), li)
    # fused RMSNorm = zerodiff's rms_norm of the layer input
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)
    _, _, xn = zv.mhc_pre(res, fn, scale, base, *MHC_ARGS, norm_weight=w, norm_eps=1e-5)
    assert torch.equal(xn, zv.rms_norm(li, w, 1e-5)) and not torch.equal(xn, li)
    # post, fused post+pre, broadcast, head
    y = torch.randn(T, H, generator=g).to(torch.bfloat16)
    new = zv.mhc_post(y, res, p, c)
    assert torch.equal(new, zmhc.mhc_post(y, res, post, comb))
    r2, p2, c2, x2 = zv.mhc_fused_post_pre(y, res, p, c, fn, scale, base, *MHC_ARGS, norm_weight=w)
    q = zmhc.mhc_pre(new, fn, scale, base, **kw)
    assert torch.equal(r2, new) and torch.equal(p2[..., 0], q[1]) and torch.equal(c2, q[2])
    assert torch.equal(x2, zv.rms_norm(q[0], w, 1e-6))
    rb, pb, cb, xb = zv.mhc_pre_broadcast(y, fn, scale, base, *MHC_ARGS, norm_weight=w,
                                          fn_broadcast=torch.full((fn.shape[0], H), float("nan")))
    q = zmhc.mhc_pre(y.unsqueeze(1).repeat(1, n, 1), fn, scale, base, **kw)
    assert all(torch.equal(rb[:, i], y) for i in range(n))  # exact copies; upstream's fn_broadcast unused
    assert torch.equal(pb[..., 0], q[1]) and torch.equal(xb, zv.rms_norm(q[0], w, 1e-6))
    hs, hb = torch.tensor([0.7]), base[:n].contiguous()
    assert torch.equal(zv.hc_head(res, fn[:n].contiguous(), hs, hb, 1e-6, 1e-6),
                       zmhc.hc_head(res, fn[:n].contiguous(), hs, hb, rms_eps=1e-6, hc_eps=1e-6))


def test_vllm_mhc_victim_in_batch_and_stock_control(seeded):
    """A token's mHC outputs through the adapter do not depend on the batch; the stock-style split chosen
    from the token count (what vLLM's TileLang path does) gives the same token other bits at T = 5000."""
    from zerodiff.baselines import mhc as stock_mhc

    g = seeded()
    res, fn, scale, base = _mhc_case(g, T=1, H=256)
    alone = zv.mhc_pre(res, fn, scale, base, *MHC_ARGS)
    for rnd in range(2):
        for T in (2, 17, 64, 129):
            batch, _, _, _ = _mhc_case(g, T=T, H=256)
            pos = (T // 3 + rnd) % T
            batch[pos] = res[0]
            got = zv.mhc_pre(batch, fn, scale, base, *MHC_ARGS)
            assert all(torch.equal(a[pos], b[0]) for a, b in zip(got, alone)), f"T={T} pos={pos}"
    big, _, _, _ = _mhc_case(g, T=5000, H=256)
    big[1234] = res[0]
    skw = dict(n_sms=132, gemm="torch", epilogue="torch", rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6,
               hc_post_mult=2.0, sinkhorn_iters=20)
    a = stock_mhc.mhc_pre_split_baseline(res, fn, scale, base, **skw)
    b = stock_mhc.mhc_pre_split_baseline(big, fn, scale, base, **skw)
    assert any(not torch.equal(x[0], y[1234]) for x, y in zip(a, b)), "stock control did not differ"


_VLLM_MHC_TORCH = REPO / "build" / "sources" / "vllm" / "vllm" / "model_executor" / "kernels" / "mhc" / "torch.py"


@pytest.mark.skipif(not _VLLM_MHC_TORCH.exists(), reason="needs the pinned vLLM tree (make sources)")
def test_vllm_mhc_adapters_match_upstream_torch_semantics(seeded):
    """Argument mapping against vLLM's own pure-torch mHC (loaded from the pinned tree, not copied): same
    outputs up to rounding (post / comb within 1e-6, layer input and post block within one bf16 step)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_mhc_torch", _VLLM_MHC_TORCH)
    up = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(up)
    g = seeded()
    res, fn, scale, base = _mhc_case(g, T=7, H=128)
    p, c, li = zv.mhc_pre(res, fn, scale, base, *MHC_ARGS)
    up_p, up_c, up_li = up.mhc_pre_torch(res, fn, scale, base, *MHC_ARGS)
    assert p.shape == up_p.shape and c.shape == up_c.shape and li.shape == up_li.shape
    assert (p - up_p).abs().max() < 1e-6 and (c - up_c).abs().max() < 1e-6
    assert (li.float() - up_li.float()).abs().max() <= 2 ** -7 * up_li.float().abs().max()
    x = torch.randn(7, 128, generator=g).to(torch.bfloat16)
    ours, theirs = zv.mhc_post(x, res, up_p, up_c).float(), up.mhc_post_torch(x, res, up_p, up_c).float()
    assert ((ours - theirs).abs() <= 2 ** -7 * theirs.abs()).all()  # at most one bf16 rounding step apart


def test_vllm_mhc_refuses_non_bf16(seeded):
    g = seeded()
    res, fn, scale, base = _mhc_case(g)
    with pytest.raises(ConfigError, match="mHC .*bfloat16"):
        zv.mhc_pre(res.float(), fn, scale, base, *MHC_ARGS)
    with pytest.raises(ConfigError, match="broadcast"):
        zv.mhc_pre_broadcast(res[:, 0].float(), fn, scale, base, *MHC_ARGS)


def test_vllm_custom_ops_trace_with_fake_tensors(seeded):
    from torch._subclasses.fake_tensor import FakeTensorMode

    zv._ops()
    with FakeTensorMode():
        x = torch.empty(7, 64, dtype=torch.bfloat16)
        w = torch.empty(8, 64, dtype=torch.bfloat16)
        assert torch.ops.zerodiff_vllm.router_logits(x, w).shape == (7, 8)
        y, r = torch.ops.zerodiff_vllm.rms_norm_residual(x, x, torch.empty(64), 1e-6)
        assert y.shape == r.shape == (7, 64)
        res = torch.empty(7, 4, 64, dtype=torch.bfloat16)
        li, post, comb = torch.ops.zerodiff_vllm.mhc_pre(res, torch.empty(24, 256), torch.empty(3), torch.empty(24),
                                                         1e-6, 1e-6, 1e-6, 2.0, 20)
        assert li.shape == (7, 64) and post.shape == (7, 4) and comb.shape == (7, 4, 4)
        assert torch.ops.zerodiff_vllm.mhc_post(x, res, post, comb).shape == (7, 4, 64)
        assert torch.ops.zerodiff_vllm.hc_head(res, torch.empty(4, 256), torch.empty(1), torch.empty(4),
                                               1e-6, 1e-6).shape == (7, 64)


def test_vllm_sampled_logprobs(seeded):
    from zerodiff.ops.logprobs import token_logprobs

    g = seeded()
    T, V, k = 4, 300, 3
    raw = (torch.randn(T, V, generator=g) * 3).to(torch.bfloat16)
    kept = zv.keep_raw_logits(raw)
    raw.div_(0.5)  # the sampler mutates its logits in place (temperature)
    sampled = torch.randint(0, V, (T,), generator=g)
    stock = raw.float().log_softmax(-1)
    lt = NS(logprobs=torch.cat([stock.gather(1, sampled[:, None]), stock.topk(k, -1).values], 1))
    zv.fix_sampled_logprobs(lt, kept, sampled, k)
    want = token_logprobs(kept, sampled)
    assert torch.equal(lt.logprobs[:, 0], want)
    assert torch.equal(lt.logprobs[:, 1:], stock.topk(k, -1).values)  # alternatives untouched
    full = NS(logprobs=stock.clone())
    zv.fix_sampled_logprobs(full, kept, sampled, -1)
    assert torch.equal(full.logprobs.gather(1, sampled[:, None])[:, 0], want)
    assert zv.fix_sampled_logprobs(None, kept, sampled, k) is None


# ------------------------------------------------------------------------------------ the patch series
def _series(side):
    lines = (REPO / "patches" / side / "series").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def test_series_lists_existing_patches_and_catalog_covers_them():
    catalog = (REPO / "docs" / "patch-catalog.md").read_text()
    for side in ("vllm", "megatron"):
        names = _series(side)
        assert names, side
        for n in names:
            p = REPO / "patches" / side / n
            assert p.is_file(), p
            text = p.read_text()
            assert text.startswith("From ") and "Subject: [PATCH]" in text, n  # git format-patch output
            assert "ZERODIFF_CONSISTENT" in text, n  # every hunk is behind the switch
            assert n in catalog, f"docs/patch-catalog.md has no row for {side}/{n}"


@pytest.mark.skipif(not all((REPO / "build" / "sources" / s / ".git").exists() for s in ("vllm", "megatron")),
                    reason="pristine trees absent (run `make sources`); CI does not fetch them")
def test_check_patches_tooling():
    r = subprocess.run([sys.executable, str(REPO / "build" / "patches.py"), "check"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check-patches: OK" in r.stdout


def test_vllm_fp8_block_linear(seeded):
    from zerodiff.ops.fp8_gemm import fp8_linear
    from zerodiff.ops.fp8_quant import Fp8Weight

    g = seeded()
    w = Fp8Weight.from_master((torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(2, 3, 384, generator=g).to(torch.bfloat16)
    y = zv.fp8_block_linear(x, w.q, w.scale)
    assert y.shape == (2, 3, 256) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(6, 256), fp8_linear(x.reshape(6, 384), w))
    for n in (1, 2, 31, 33):  # a row alone and in batches
        xb = torch.randn(n, 384, generator=g).to(torch.bfloat16)
        xb[n - 1] = x[0, 0]
        assert torch.equal(zv.fp8_block_linear(xb, w.q, w.scale)[n - 1], y[0, 0])
    with pytest.raises(ConfigError, match="bias"):
        zv.fp8_block_linear(x, w.q, w.scale, torch.zeros(256))
    with pytest.raises(ConfigError, match="weight scale"):
        zv.fp8_block_linear(x, w.q, w.scale.t().contiguous())
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        zv.fp8_block_linear(x, w.q.t(), w.scale)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_vllm_expert_routing_matches_training_routing(seeded, scoring):
    from zerodiff.ops.moe import route

    g = seeded(scoring)
    T, E, k = 9, 32, 6
    logits = torch.randint(-8, 8, (T, E), generator=g).float() / 4  # ties
    bias = torch.nn.Parameter(torch.randn(E, generator=g) * 0.01)
    w, ids = zv.expert_routing(logits, k, scoring_func=scoring, bias=bias, renormalize=True,
                               routed_scaling_factor=2.5, indices_type=torch.int64)
    rw, rids = route(logits, k, scoring=scoring, bias=bias.detach(), renormalize=True, routed_scale=2.5)
    assert ids.dtype == torch.int64 and torch.equal(ids, rids.long()) and torch.equal(w, rw)
    # the training side (Megatron wrapper) gives the same selection and weights
    probs, rmap = zm.topk_routing(logits, k, score_function=scoring,
                                  use_pre_softmax=False, scaling_factor=2.5, expert_bias=bias.detach())
    assert torch.equal(probs.gather(1, ids), w) and int(rmap.sum()) == T * k
    with pytest.raises(ConfigError, match="fp32"):
        zv.expert_routing(logits.bfloat16(), k, scoring_func=scoring)
    with pytest.raises(ConfigError, match="scoring_func"):
        zv.expert_routing(logits, k, scoring_func="gumbel")


# ------------------------------------------------------------------------------------------- GPU tests
def _cuda_gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.gpu
def test_gpu_rollout_adapters_equal_training_wrappers():
    """The heart of diff = 0 at the glue level: on the GPU, each vLLM adapter and the Megatron wrapper of the
    same op return identical bits on the same inputs (same kernels, same arguments)."""
    g = _cuda_gen(0)
    T, H, E, V = 37, 4096, 256, 32000
    x = (torch.randn(T, H, device="cuda", generator=g) * 2).bfloat16()
    r = (torch.randn(T, H, device="cuda", generator=g) * 2).bfloat16()
    wn = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    wg = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16()
    # router GEMM
    assert torch.equal(zv.router_logits(x, wg), zm.router_logits(x, wg))
    # RMSNorm (Megatron's norm sees the residual-added stream, vLLM fuses the add)
    y, new_r = zv.rms_norm(x, wn, 1e-6, residual=r)
    assert torch.equal(y, zm.rms_norm(new_r, wn, 1e-6))
    # expert routing
    logits = zv.router_logits(x, wg)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    w, ids = zv.expert_routing(logits, 8, scoring_func="sqrtsoftplus", bias=bias, renormalize=True,
                               routed_scaling_factor=1.5)
    probs, _ = zm.topk_routing(logits, 8, score_function="sqrtsoftplus", scaling_factor=1.5, expert_bias=bias)
    assert torch.equal(probs.gather(1, ids.long()), w)
    # SwiGLU (the MoE activation's BF16 value before FP8)
    from zerodiff.ops.silu_mul_quant import silu_mul
    h = (torch.randn(T, 2 * 2048, device="cuda", generator=g) * 3).bfloat16()
    assert torch.equal(zm.swiglu(h, 10.0), silu_mul(h, clamp_limit=10.0))
    # sampled-token log-probs vs training loss
    lg = (torch.randn(T, V, device="cuda", generator=g) * 3).bfloat16()
    tok = torch.randint(0, V, (T,), device="cuda", generator=g)
    assert torch.equal(zv.sampled_token_logprobs(lg, tok), -zm.cross_entropy(lg, tok))
    # block-FP8 linear
    from zerodiff.ops.fp8_quant import Fp8Weight
    lin = zm.Fp8Linear((torch.randn(2048, H, device="cuda", generator=g) * 0.02).bfloat16())
    assert torch.equal(zv.fp8_block_linear(x, lin.fp8.q, lin.fp8.scale), lin(x))
    assert isinstance(lin.fp8, Fp8Weight)


@pytest.mark.gpu
def test_gpu_custom_ops_under_torch_compile_and_victim_rows():
    g = _cuda_gen(1)
    H, E = 4096, 256
    wg = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16()
    wn = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()

    def f(x, r):
        y, nr = zv.rms_norm(x, wn, 1e-6, residual=r)
        return zv.router_logits(y, wg), nr

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    victim_x = torch.randn(1, H, device="cuda", generator=g).bfloat16()
    victim_r = torch.randn(1, H, device="cuda", generator=g).bfloat16()
    alone = f(victim_x, victim_r)
    for n in (1, 2, 15, 16, 17, 31, 33, 64, 65, 128, 1024):
        for pos in (0, n // 2, n - 1):
            x = torch.randn(n, H, device="cuda", generator=g).bfloat16()
            r = torch.randn(n, H, device="cuda", generator=g).bfloat16()
            x[pos], r[pos] = victim_x[0], victim_r[0]
            for out in (f(x, r), cf(x, r)):
                assert torch.equal(out[0][pos:pos + 1], alone[0]), (n, pos)
                assert torch.equal(out[1][pos:pos + 1], alone[1]), (n, pos)
    # negative control: stock FP32 router GEMM changes a row with M (DESIGN: once M >= 16)
    xs = torch.randn(1024, H, device="cuda", generator=g).bfloat16()
    stock_all = torch.mm(xs, wg.T, out_dtype=torch.float32)
    stock_one = torch.mm(xs[:1], wg.T, out_dtype=torch.float32)
    assert not torch.equal(stock_all[:1], stock_one)


@pytest.mark.gpu
def test_gpu_mhc_adapters_under_torch_compile_and_victim_rows():
    """vLLM's DeepSeek-V4 mHC seam through the adapters (fused post+pre with the fused norm, then the head):
    eager == torch.compile(fullgraph) and a token's outputs alone == inside any batch; negative control: the
    stock-style split chosen from T changes the token (DeepGEMM TF32 GEMM where available)."""
    from zerodiff.baselines import mhc as stock_mhc
    from zerodiff.reference import mhc as mref

    g = _cuda_gen(3)
    n, H = 4, 4096
    fn = torch.randn(mref.n_mix(n), n * H, device="cuda", generator=g) * 0.01
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn(mref.n_mix(n), device="cuda", generator=g) * 0.1
    wn = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    hfn, hs, hb = fn[:n].contiguous(), scale[:1].contiguous(), base[:n].contiguous()

    def f(x, res, post, comb):
        r, p, c, li = zv.mhc_fused_post_pre(x, res, post, comb, fn, scale, base, *MHC_ARGS, norm_weight=wn)
        return r, p, c, li, zv.hc_head(r, hfn, hs, hb, 1e-6, 1e-6)

    cf = torch.compile(f, fullgraph=True, dynamic=True)

    def case(T):
        res = torch.randn(T, n, H, device="cuda", generator=g).bfloat16()
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        post = torch.rand(T, n, 1, device="cuda", generator=g) * 2
        comb = torch.softmax(torch.randn(T, n, n, device="cuda", generator=g), -1)
        return x, res, post, comb

    victim = case(1)
    alone = f(*victim)
    for rnd in range(2):
        for T in (2, 15, 16, 17, 64, 65, 128, 1024):
            pos = (T // 3 + rnd) % T
            batch = case(T)
            for b, v in zip(batch, victim):
                b[pos] = v[0]
            for out in (f(*batch), cf(*batch)):
                for name, o, a in zip(("residual", "post", "comb", "layer_input", "head"), out, alone):
                    assert torch.equal(o[pos:pos + 1], a), (name, T, pos, rnd)
    big = torch.randn(5000, n, H, device="cuda", generator=g).bfloat16()
    big[1234] = victim[1][0]
    skw = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult=2.0, sinkhorn_iters=20)
    a = stock_mhc.mhc_pre_split_baseline(victim[1], fn, scale, base, **skw)
    b = stock_mhc.mhc_pre_split_baseline(big, fn, scale, base, **skw)
    assert any(not torch.equal(x[0], y[1234]) for x, y in zip(a, b)), "stock split control did not differ"


@pytest.mark.gpu
def test_gpu_act_scale_layout_matches_deepgemm():
    from zerodiff import backends

    dg = backends.deep_gemm()
    if dg is None:
        pytest.skip(f"DeepGEMM unavailable: {backends.status()['deepgemm']['detail']}")
    g = _cuda_gen(2)
    for M in (1, 3, 64, 257):
        x = (torch.randn(M, 2 * 2048, device="cuda", generator=g) * 3).bfloat16()
        q, s = zv.moe_act_quant_contiguous(x, None, scale_fmt="FLOAT32")
        from zerodiff.ops.silu_mul_quant import silu_mul_quant_fp8
        _, s_rows = silu_mul_quant_fp8(x)
        ref = dg.get_mn_major_tma_aligned_tensor(s_rows)
        assert torch.equal(s, ref) and s.stride() == ref.stride(), M


def test_vllm_silu_mul(seeded):
    from zerodiff.reference.silu_mul_quant import silu_mul_ref

    g = seeded()
    x = (torch.randn(2, 3, 256, generator=g) * 4).to(torch.bfloat16)
    y = zv.silu_mul(x, 7.0)
    assert y.shape == (2, 3, 128) and torch.equal(y.reshape(6, 128), silu_mul_ref(x.reshape(6, 256), clamp_limit=7.0))
    assert torch.equal(zv.silu_mul(x).reshape(6, 128), silu_mul_ref(x.reshape(6, 256)))
    # the training side's SwiGLU gives the same bits
    assert torch.equal(zm.swiglu(x, 7.0), y)
    # negative control: vLLM's native two-rounding path differs on these inputs
    d = 128
    gate, up = x[..., :d].clamp(max=7.0), x[..., d:].clamp(-7.0, 7.0)
    assert not torch.equal(gate * torch.sigmoid(gate) * up, y)
    with pytest.raises(ConfigError, match="alpha"):
        zv.silu_mul(x, 7.0, alpha=1.702)


def test_megatron_parallel_linear_fp8(seeded):
    from zerodiff.ops.fp8_gemm import fp8_linear
    from zerodiff.ops.fp8_quant import Fp8Weight

    g = seeded()
    model = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 128, bias=False))
    model = model.to(torch.bfloat16)
    assert zm.mark_fp8_linears(model, lambda name, m: name == "0") == ["0"]
    lin = model[0]
    assert getattr(lin, zm.FP8_ATTR) and not getattr(model[1], zm.FP8_ATTR, False)
    x = torch.randn(3, 5, 128, generator=g).to(torch.bfloat16).requires_grad_(True)
    y, b = zm.parallel_linear_fp8(lin, x)
    assert b is None and y.shape == (3, 5, 256)
    assert torch.equal(y.detach().reshape(15, 256), fp8_linear(x.detach().reshape(15, 128),
                                                                  Fp8Weight.from_master(lin.weight.detach(), ue8m0=zm.FP8_UE8M0)))
    y.float().sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    q_ptr = lin._zerodiff_fp8_weight.q.data_ptr()
    with torch.no_grad():
        lin.weight.mul_(0.5)  # optimizer step: next forward requantises in place
    y2, _ = zm.parallel_linear_fp8(lin, x.detach())
    assert lin._zerodiff_fp8_weight.q.data_ptr() == q_ptr
    assert torch.equal(y2.reshape(15, 256), fp8_linear(x.detach().reshape(15, 128),
                                                       Fp8Weight.from_master(lin.weight.detach(), ue8m0=zm.FP8_UE8M0)))
    with pytest.raises(ConfigError, match="bfloat16"):
        zm.parallel_linear_fp8(torch.nn.Linear(128, 8, bias=False), x.detach())


# ------------------------------------------------------------ vLLM DeepSeek-V4 decode through the prefill path
_DS_REC = zv.DSV4_TOKEN_BYTES + zv.DSV4_SCALE_BYTES


def _ds_cache(g, num_blocks, block_size, pad=24):
    """A random fp8_ds_mla cache (padded block stride), values never NaN, with +-0 / denormal codes."""
    stride = block_size * _DS_REC + pad
    raw = torch.randint(0, 256, (num_blocks * stride,), generator=g, dtype=torch.uint8)
    cache = torch.as_strided(raw, (num_blocks, block_size, _DS_REC), (stride, _DS_REC, 1))
    tok = torch.as_strided(raw, (num_blocks, block_size, zv.DSV4_TOKEN_BYTES), (stride, zv.DSV4_TOKEN_BYTES, 1))
    codes = tok[..., :zv.DSV4_FP8_DIM]
    codes[(codes & 0x7F) == 0x7F] = 0x80  # no NaN codes; 0x80 = -0
    codes[..., :3] = torch.tensor([0x00, 0x80, 0x01], dtype=torch.uint8)  # +0, -0, smallest denormal
    rope = torch.randn(num_blocks, block_size, zv.DSV4_ROPE_DIM, generator=g).to(torch.bfloat16)
    tok[..., zv.DSV4_FP8_DIM:] = rope.view(torch.uint8).view(num_blocks, block_size, 2 * zv.DSV4_ROPE_DIM)
    sc = torch.as_strided(raw, (num_blocks, block_size, zv.DSV4_SCALE_BYTES),
                          (stride, zv.DSV4_SCALE_BYTES, 1), block_size * zv.DSV4_TOKEN_BYTES)
    sc[...] = torch.randint(112, 136, sc.shape, generator=g, dtype=torch.uint8)
    return cache


def _ds_dequant_f64(cache, block_size, blk, off):
    """Independent dequant: float64 product of the e4m3 value and 2**(code-127), then bf16."""
    stride = cache.stride(0)
    flat = torch.as_strided(cache, (cache.shape[0] * stride,), (1,), cache.storage_offset())
    base = blk * stride
    t = flat[base + off * zv.DSV4_TOKEN_BYTES + torch.arange(zv.DSV4_TOKEN_BYTES)]
    s = flat[base + block_size * zv.DSV4_TOKEN_BYTES + off * zv.DSV4_SCALE_BYTES + torch.arange(7)]
    v = t[:zv.DSV4_FP8_DIM].clone().view(torch.float8_e4m3fn).double()
    v = v * torch.pow(2.0, s.double() - 127).repeat_interleave(64)
    return torch.cat([v.float().to(torch.bfloat16), t[zv.DSV4_FP8_DIM:].clone().view(torch.bfloat16)])


def _ds_prefill_rows(req, L, qlen, pos, *, cr, top_k, window, topk_row, ccache, cbs, cbt, scache, sbs, sbt):
    """What vLLM's _forward_prefill shows flash_mla_sparse_fwd for the token at absolute position ``pos`` of a
    request of ``seq_len`` L whose chunk holds ``qlen`` query tokens: its workspace (compressed positions
    0..L//cr-1 at rows 0.., the SWA gather at row N..) read at combine_topk_swa_indices' list."""
    N = L // cr if cr > 1 else 0
    gather = qlen + min(L - qlen, window - 1)
    ws = []
    for c in range(N):
        ws.append(_ds_dequant_f64(ccache, cbs, int(cbt[req, c // cbs]), c % cbs))
    for p in range(L - gather, L):
        ws.append(_ds_dequant_f64(scache, sbs, int(sbt[req, p // sbs]), p % sbs))
    tlen = min((pos + 1) // cr, top_k) if cr > 1 else 0
    lst = [int(topk_row[i]) for i in range(tlen)] if topk_row is not None else list(range(tlen))
    s0 = max(pos - (window - 1), 0)
    lst += [N + p - (L - gather) for p in range(s0, pos + 1)]
    return torch.stack([ws[i] for i in lst])


def _ds_setup(g, cr, T=5, window=8, top_k=16, sbs=16, attn_bs=16):
    nb = 40
    scache = _ds_cache(g, nb, sbs)
    if cr == 128:
        attn_bs = 256
    cbs = attn_bs // cr if cr > 1 else 1
    ccache = _ds_cache(g, nb, cbs) if cr > 1 else None
    lens = [int(x) for x in torch.randint(3, 300 if cr == 128 else 90, (T,), generator=g)]
    lens[0] = 1  # first token of a request
    if cr == 128:
        lens[1] = 300
    sbt = torch.stack([torch.randperm(nb, generator=g)[:24] for _ in range(T)]).int()
    cbt = torch.stack([torch.randperm(nb, generator=g)[:24] for _ in range(T)]).int()
    topk = None
    if cr == 4:
        topk = torch.full((T, top_k), -1, dtype=torch.int32)
        for t, L in enumerate(lens):
            n = L // 4
            sel = torch.randperm(n, generator=g)[:top_k] if n else torch.zeros(0, dtype=torch.long)
            sel = sel.sort(descending=True).values
            topk[t, :len(sel)] = sel.int()
    return dict(scache=scache, ccache=ccache, cbs=cbs, sbs=sbs, sbt=sbt, cbt=cbt, lens=lens, topk=topk,
                window=window, top_k=top_k if cr == 4 else (0 if cr == 1 else 128))


@pytest.mark.parametrize("cr", [1, 4, 128])
def test_dsv4_decode_rows_equal_prefill_rows(seeded, cr):
    """Each decode token's workspace rows, read in its index order, are the prefill path's rows for the same
    token (same cache entries, same order, same dequantised bits), for SWA-only, C4A and C128A layers,
    whatever the other requests of the decode batch; negative controls: the stock decode order (window,
    then top-k) and a reversed top-k give other sequences."""
    g = seeded()
    d = _ds_setup(g, cr)
    T = len(d["lens"])
    pos = torch.tensor([L - 1 for L in d["lens"]])
    width = zv.dsv4_workspace_width(d["top_k"], d["window"])
    # the decode batch in a shuffled request order: the block-table row is the token's request row
    perm = torch.randperm(T, generator=g)
    ent = zv.dsv4_decode_entries(
        pos[perm], torch.arange(T, dtype=torch.int32), torch.ones(T, dtype=torch.bool), compress_ratio=cr,
        top_k=d["top_k"], window_size=d["window"], width=width,
        topk_local=None if d["topk"] is None else d["topk"][perm], compressed_block_table=d["cbt"][perm],
        compressed_block_size=d["cbs"], swa_block_table=d["sbt"][perm], swa_block_size=d["sbs"])
    kv, idx = zv.dsv4_decode_workspace(ent, d["scache"], d["sbs"], d["ccache"], d["cbs"])
    kv2, idx2 = zv.dsv4_decode_workspace(ent, d["scache"], d["sbs"], d["ccache"], d["cbs"], top_k=d["top_k"],
                                         window_size=d["window"])  # the lean form the adapter uses
    assert torch.equal(idx2, idx) and torch.equal(kv2.view(torch.int16), kv.view(torch.int16))
    assert kv.shape == (T, width, zv.DSV4_HEAD_DIM) and idx.shape == (T, 1, width) and kv.dtype == torch.bfloat16
    flat = kv.view(-1, zv.DSV4_HEAD_DIM)
    for i in range(T):
        r = int(perm[i])
        L = d["lens"][r]
        # as the last token of a one-token "prefill" and inside a longer prefill chunk (qlen up to L)
        for qlen in sorted({1, max(1, L // 2), L}):
            ref = _ds_prefill_rows(r, L, qlen, L - 1, cr=cr, top_k=d["top_k"], window=d["window"],
                                   topk_row=None if d["topk"] is None else d["topk"][r], ccache=d["ccache"],
                                   cbs=d["cbs"], cbt=d["cbt"], scache=d["scache"], sbs=d["sbs"], sbt=d["sbt"])
            n = int(ent[3][i])
            assert n == ref.shape[0]
            row = idx[i, 0]
            assert torch.equal(row[:n], torch.arange(i * width, i * width + n, dtype=torch.int32))
            assert bool((row[n:] == -1).all())
            got = flat[row[:n].long()]
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (cr, r, qlen)
        tlen = min(L // cr, d["top_k"]) if cr > 1 else 0
        if tlen > 1:
            stock = torch.cat([ref[tlen:], ref[:tlen]])  # flash_mla_with_kvcache: window, then extra top-k
            assert not torch.equal(stock, ref)
            rev = torch.cat([ref[:tlen].flip(0), ref[tlen:]])
            assert not torch.equal(rev, ref)


def test_dsv4_dequant_rows_bits(seeded):
    g = seeded()
    cache = _ds_cache(g, 6, 8)
    blk = torch.randint(0, 6, (40,), generator=g)
    off = torch.randint(0, 8, (40,), generator=g)
    got = zv.dsv4_dequant_rows(cache, 8, blk, off)
    ref = torch.stack([_ds_dequant_f64(cache, 8, int(b), int(o)) for b, o in zip(blk, off)])
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert bool((got.view(torch.int16) == -32768).any())  # -0 kept
    with pytest.raises(ConfigError, match="block stride"):
        zv.dsv4_dequant_rows(torch.zeros(4, 100, dtype=torch.uint8), 8, blk[:1] % 4, off[:1])
    with pytest.raises(ConfigError, match="uint8"):
        zv.dsv4_dequant_rows(cache.float(), 8, blk, off)
    with pytest.raises(ConfigError, match="528 bytes per token"):
        zv.dsv4_dequant_rows(torch.zeros(4, 8, 528, dtype=torch.uint8), 8, blk[:1] % 4, off[:1])


def test_dsv4_decode_attention_adapter(seeded):
    """The patched _forward_decode body on fake vLLM objects: the sparse kernel gets q, a [T*W, 1, 512]
    workspace, [T, 1, W] indices and the lengths; a padding token gets length 0; the victim token's output
    is the same alone, in batches of 2..17 at several positions (ref sparse attention stands in for
    FlashMLA); every token's output equals attention over its prefill rows."""
    from zerodiff.ops.attention import sparse_attention

    g = seeded()
    cr = 4
    d = _ds_setup(g, cr, T=17, top_k=16)
    H = 4
    q_all = torch.randn(17, H, zv.DSV4_HEAD_DIM, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    calls = []

    def fwd(*, q, kv, indices, sm_scale, attn_sink, topk_length, out):
        calls.append((q.shape, kv.shape, indices.shape, topk_length.clone()))
        o, _ = sparse_attention(q, kv, indices, sm_scale, d_v=zv.DSV4_HEAD_DIM, attn_sink=attn_sink,
                                backend="reference")
        out.copy_(o)

    def run(order, valid=None):
        T = len(order)
        o = torch.tensor(order)
        layer = NS(compress_ratio=cr, window_size=d["window"], max_image_tokens=0, max_model_len=4096,
                   scale=0.05, attn_sink=sink, topk_indices_buffer=d["topk"][o], swa_cache_layer=NS(kv_cache=d["scache"]))
        sw = NS(num_decode_tokens=T, num_decodes=T, token_to_req_indices=torch.arange(T, dtype=torch.int32),
                is_valid_token=torch.ones(T, dtype=torch.bool) if valid is None else valid,
                block_table=d["sbt"][o], block_size=d["sbs"])
        am = NS(block_size=d["cbs"] * cr, block_table=d["cbt"][o])
        out = torch.zeros(T, H, zv.DSV4_HEAD_DIM, dtype=torch.bfloat16)
        pos = torch.tensor([d["lens"][i] - 1 for i in order])
        zv.dsv4_decode_attention(layer, q_all[o], pos, d["ccache"], sw, am, False, out, fwd)
        return out

    victim = 3
    alone = run([victim])
    assert calls[-1][1] == (zv.dsv4_workspace_width(16, d["window"]), 1, zv.DSV4_HEAD_DIM)
    others = [i for i in range(17) if i != victim]
    for B in (2, 15, 16, 17):
        for at in sorted({0, B // 2, B - 1}):
            order = others[:B - 1]
            order.insert(at, victim)
            assert torch.equal(run(order)[at], alone[0]), (B, at)
    # every token == attention over its prefill rows (qlen = 1)
    full = run(list(range(17)))
    for t in range(17):
        L = d["lens"][t]
        rows = _ds_prefill_rows(t, L, 1, L - 1, cr=cr, top_k=16, window=d["window"], topk_row=d["topk"][t],
                                ccache=d["ccache"], cbs=d["cbs"], cbt=d["cbt"], scache=d["scache"], sbs=d["sbs"],
                                sbt=d["sbt"])
        w = zv.dsv4_workspace_width(16, d["window"])
        idx = torch.full((1, 1, w), -1, dtype=torch.int32)
        idx[0, 0, :rows.shape[0]] = torch.arange(rows.shape[0], dtype=torch.int32)
        o, _ = sparse_attention(q_all[t:t + 1], rows, idx, 0.05, d_v=zv.DSV4_HEAD_DIM, attn_sink=sink,
                                backend="reference")
        assert torch.equal(full[t], o[0]), t
    # a padding token (slot < 0) gets length 0
    run([0, 1], valid=torch.tensor([True, False]))
    assert int(calls[-1][3][1]) == 0 and int(calls[-1][3][0]) > 0


def _ds_prefill_flashmla(fm, q, d, reqs, cr, width, sm_scale, sink, topk_rev=False):
    """vLLM's prefill layout on the GPU: one workspace [B, M, 512] (request b: compressed 0..L//cr-1 at rows
    0.., its SWA gather at row N..), indices M*b + ... in combine_topk_swa_indices' order, padded to ``width``
    with -1, then flash_mla_sparse_fwd; each request is a one-token prefill of its last position."""
    B = len(reqs)
    W_s = d["window"]
    Ns = [d["lens"][r] // cr if cr > 1 else 0 for r in reqs]
    N = max(Ns)
    M = N + W_s
    dev = q.device
    ws = torch.zeros(B, M, zv.DSV4_HEAD_DIM, dtype=torch.bfloat16, device=dev)
    idx = torch.full((B, 1, width), -1, dtype=torch.int32, device=dev)
    lens = torch.zeros(B, dtype=torch.int32, device=dev)
    for b, r in enumerate(reqs):
        L = d["lens"][r]
        if Ns[b]:
            c = torch.arange(Ns[b], device=dev)
            ws[b, :Ns[b]] = zv.dsv4_dequant_rows(d["ccache"], d["cbs"], d["cbt"][r].long()[c // d["cbs"]], c % d["cbs"])
        gl = min(L, W_s)  # qlen 1: gather = 1 + min(prefix, W - 1)
        p = torch.arange(L - gl, L, device=dev)
        ws[b, N:N + gl] = zv.dsv4_dequant_rows(d["scache"], d["sbs"], d["sbt"][r].long()[p // d["sbs"]], p % d["sbs"])
        tl_ = min(L // cr, d["top_k"]) if cr > 1 else 0
        top = (d["topk"][r, :tl_].long() if d["topk"] is not None else torch.arange(tl_, device=dev))
        s0 = max(L - 1 - (W_s - 1), 0)
        lst = torch.cat([top, N + torch.arange(s0, L, device=dev) - (L - gl)]) + M * b
        if topk_rev:  # the whole list (compressed + window) reversed: entries move across the kernel's 64-blocks
            lst = lst.flip(0)
        idx[b, 0, :lst.numel()] = lst.int()
        lens[b] = lst.numel()
    out = torch.empty(B, q.shape[1], zv.DSV4_HEAD_DIM, dtype=torch.bfloat16, device=dev)
    fm.flash_mla_sparse_fwd(q=q, kv=ws.view(-1, 1, zv.DSV4_HEAD_DIM), indices=idx, sm_scale=sm_scale,
                            attn_sink=sink, topk_length=lens, out=out)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("cr", [4, 128, 1])
def test_gpu_dsv4_decode_equals_prefill_path_flashmla(cr):
    """On the H200 with the vLLM wheel's FlashMLA: a decode token through dsv4_decode_attention is bit-identical
    to the same token through vLLM's prefill layout (other workspace numbering, other padded widths: the
    batch-dependent C128A width is covered), alone and among 1..64 other requests at 3 positions, 3 rounds.
    Negative control: the same entries in reversed order differ (index order is part of the contract). The whole
    list is reversed: on the H200 (2026-11-30) reversing only the C128A compressed part (<= 47 entries, inside one
    of flash_mla_sparse_fwd's 64-entry blocks) gave the same bits, so that control could not fail."""
    from zerodiff import backends

    fm = backends.flash_mla()
    if fm is None:
        pytest.skip("FlashMLA not available through zerodiff.backends (vLLM wheel kernels)")
    g = torch.Generator().manual_seed(7 + cr)
    T, H, window, top_k = 65, 64, 128, (512 if cr == 4 else 0)
    nb = 1200
    sbs = 64
    scache = _ds_cache(g, nb, sbs).cuda()
    attn_bs = 256
    cbs = attn_bs // cr if cr > 1 else 1
    ccache = _ds_cache(g, nb, cbs).cuda() if cr > 1 else None
    lens = [int(x) for x in torch.randint(1, 6000, (T,), generator=g)]
    lens[:4] = [1, 129, 2049, 6000]
    if cr == 128:
        top_k = 128 * ((-(-8192 // 128) + 127) // 128)  # model-limit width for max_model_len 8192
    sbt = torch.stack([torch.randperm(nb, generator=g)[:128] for _ in range(T)]).int().cuda()
    cbt = torch.stack([torch.randperm(nb, generator=g)[:1024] for _ in range(T)]).int().cuda()
    topk = None
    if cr == 4:
        topk = torch.full((T, top_k), -1, dtype=torch.int32)
        for t, L in enumerate(lens):
            sel = torch.randperm(L // 4, generator=g)[:top_k].sort(descending=True).values
            topk[t, :len(sel)] = sel.int()
        topk = topk.cuda()
    d = dict(scache=scache, ccache=ccache, cbs=cbs, sbs=sbs, sbt=sbt, cbt=cbt, lens=lens, topk=topk,
             window=window, top_k=top_k)
    q_all = (torch.randn(T, H, zv.DSV4_HEAD_DIM, generator=g) * 2).to(torch.bfloat16).cuda()
    sink = torch.randn(H, generator=g).cuda()
    scale = zv.DSV4_HEAD_DIM ** -0.5

    def decode(order):
        n = len(order)
        o = torch.tensor(order, device="cuda")
        layer = NS(compress_ratio=cr, window_size=window, max_image_tokens=0, max_model_len=8192, scale=scale,
                   attn_sink=sink, topk_indices_buffer=None if topk is None else topk[o],
                   swa_cache_layer=NS(kv_cache=scache))
        sw = NS(num_decode_tokens=n, num_decodes=n, token_to_req_indices=torch.arange(n, dtype=torch.int32, device="cuda"),
                is_valid_token=torch.ones(n, dtype=torch.bool, device="cuda"), block_table=sbt[o], block_size=sbs)
        am = None if cr == 1 else NS(block_size=attn_bs, block_table=cbt[o])
        out = torch.empty(n, H, zv.DSV4_HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        pos = torch.tensor([lens[i] - 1 for i in order], device="cuda")
        zv.dsv4_decode_attention(layer, q_all[o], pos, ccache, sw, am, cr == 1, out, fm.flash_mla_sparse_fwd)
        return out

    full = decode(list(range(T)))
    w0 = zv.dsv4_workspace_width(top_k, window)
    # the prefill layout, batch = all requests, at the model width and at a wider (C128A-style batch) width
    for width in (w0, w0 + 256):
        pre = _ds_prefill_flashmla(fm, q_all, d, list(range(T)), max(cr, 1), width, scale, sink)
        assert torch.equal(pre, full), f"decode != prefill layout (width {width})"
    for rnd in range(3):
        victim = (5 + 17 * rnd) % T
        alone = decode([victim])
        others = [i for i in range(T) if i != victim]
        for B in (2, 15, 16, 17, 33, 64):
            for at in sorted({0, B // 2, B - 1}):
                order = (others[rnd:] + others[:rnd])[:B - 1]  # B - 1 neighbours, a different set per round
                order.insert(at, victim)
                assert len(order) == B
                assert torch.equal(decode(order)[at], alone[0]), (cr, rnd, B, at)
    if cr > 1:
        rev = _ds_prefill_flashmla(fm, q_all, d, list(range(T)), cr, w0, scale, sink, topk_rev=True)
        assert not torch.equal(rev, full), "negative control: a reversed top-k order should change the output"


# ------------------------------------------------------------------------------------ Megatron MoE experts
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


@pytest.mark.parametrize("grouped", [False, True])
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


# ---- DeepSeek-V4 attention through the fixed-schedule FlashMLA kernel (phase-agnostic adapter) ----------------
from flashmla_emulation import install_emulation, request_cache, v4_cache  # noqa: E402


def _dsv4_case(g, compress_ratio, window=128, top_k=64, bs=8):
    """Three requests with their compressed and SWA caches (V4 layout), block tables, and query tokens at
    assorted positions (one padding token). Returns (kwargs for the adapter minus q, q, positions, reqs, valid,
    and the float64 dequantised caches)."""
    lens = (300, 70, 9)
    nreq = len(lens)
    swa_blocks = -(-max(lens) // bs)
    swa, swa_deq = v4_cache(nreq * swa_blocks + 2, bs, seed=int(torch.randint(0, 1000, (1,), generator=g)))
    swa_bt = torch.randperm(nreq * swa_blocks + 2, generator=g)[: nreq * swa_blocks].view(nreq, swa_blocks).int()
    kw = dict(window_size=window, swa_k_cache=swa, swa_block_table=swa_bt, swa_block_size=bs, sm_scale=0.06)
    comp_deq = None
    if compress_ratio > 1:
        nc = -(-max(lens) // compress_ratio)
        c_blocks = -(-nc // bs)
        comp, comp_deq = v4_cache(nreq * c_blocks + 1, bs, seed=int(torch.randint(0, 1000, (1,), generator=g)))
        c_bt = torch.randperm(nreq * c_blocks + 1, generator=g)[: nreq * c_blocks].view(nreq, c_blocks).int()
        kw.update(compress_ratio=compress_ratio, top_k=top_k, compressed_k_cache=comp, compressed_block_table=c_bt,
                  compressed_block_size=bs)
    else:
        kw.update(compress_ratio=1, top_k=0, compressed_k_cache=None, compressed_block_table=None,
                  compressed_block_size=1)
    toks = [(0, p) for p in (0, 3, 4, 130, 250, 299)] + [(1, p) for p in (10, 69)] + [(2, 8)]
    pos = torch.tensor([p for _, p in toks])
    req = torch.tensor([r for r, _ in toks], dtype=torch.int32)
    valid = torch.ones(len(toks), dtype=torch.bool)
    valid[4] = False  # a padding token
    if compress_ratio == 4:
        tl = torch.full((len(toks), top_k), -1, dtype=torch.int32)
        for t, (_r, p) in enumerate(toks):
            n = min((p + 1) // 4, top_k)
            tl[t, :n] = torch.randperm((p + 1) // 4, generator=g)[:n].int()
        kw["topk_local"] = tl
    else:
        kw["topk_local"] = None
    q = (torch.randn(len(toks), 64, 512, generator=g) * 0.3).to(torch.bfloat16)
    return kw, q, pos, req, valid, swa_deq, comp_deq


def _dsv4_reference(kw, q, pos, req, valid, swa_deq, comp_deq, sink):
    outs = []
    bs, cr = kw["swa_block_size"], kw["compress_ratio"]
    for t in range(q.shape[0]):
        if not bool(valid[t]):
            outs.append(torch.zeros(q.shape[1], 512, dtype=torch.float64))
            continue
        p, r = int(pos[t]), int(req[t])
        ent = []
        if cr > 1:
            n = min((p + 1) // cr, kw["top_k"])
            cpos = kw["topk_local"][t, :n].tolist() if kw["topk_local"] is not None else list(range(n))
            cb = kw["compressed_block_size"]
            ent += [comp_deq[int(kw["compressed_block_table"][r, c // cb]) * cb + c % cb] for c in cpos]
        ent += [swa_deq[int(kw["swa_block_table"][r, s // bs]) * bs + s % bs]
                for s in range(max(p - kw["window_size"] + 1, 0), p + 1)]
        kv = torch.stack(ent)
        sc = (q[t].double() @ kv.T) * kw["sm_scale"]
        lse = torch.logsumexp(sc, -1)
        outs.append((torch.softmax(sc, -1) @ kv) / (1 + torch.exp(sink.double() - lse))[:, None])
    return torch.stack(outs)


@pytest.mark.parametrize("compress_ratio", [1, 4, 128])
def test_dsv4_fixed_schedule_adapter_reference_phase_and_batch_invariance(seeded, monkeypatch, compress_ratio):
    """The adapter's lists (compressed entries in the prefill order, then the window) reach the kernel as main and
    extra lists with their lengths: equal to a float64 reference over the same entries; a token computed inside
    a prefill chunk, alone as a decode token, or among other requests' tokens gives the same bits (under the CPU
    emulation of the kernel's contract, which raises unless every row is whole at its own block count)."""
    install_emulation(monkeypatch)
    g = seeded()
    kw, q, pos, req, valid, swa_deq, comp_deq = _dsv4_case(g, compress_ratio)
    sink = torch.linspace(-1, 1, 64)
    o, lse = zv.dsv4_fixed_schedule_attention(q, pos, req, valid, attn_sink=sink, **kw)
    ref = _dsv4_reference(kw, q, pos, req, valid, swa_deq, comp_deq, sink)
    assert torch.allclose(o.double(), ref, atol=2e-2, rtol=2e-2)
    assert bool((o[4].float() == 0).all()), "a padding token must give 0"
    for t in (0, 5, 7):  # alone (decode) == inside the batch (prefill chunk + other requests)
        sub = dict(kw)
        if kw["topk_local"] is not None:
            sub["topk_local"] = kw["topk_local"][t:t + 1]
        a = zv.dsv4_fixed_schedule_attention(q[t:t + 1], pos[t:t + 1], req[t:t + 1], valid[t:t + 1], attn_sink=sink,
                                             **sub)
        assert torch.equal(a[0][0], o[t]) and torch.equal(a[1][0], lse[t]), t


@pytest.mark.gpu
@pytest.mark.parametrize("compress_ratio", [1, 4, 128])
def test_gpu_dsv4_fixed_schedule_adapter_reference_and_invariance(seeded, compress_ratio):
    """The same checks with FlashMLA's real FP8 decode kernel (written 2026-11-30 after the last GPU call; first
    run pending): float64 reference, padding token 0, each token alone == inside the batch."""
    from zerodiff import backends

    if backends.flash_mla() is None:
        pytest.skip(f"FlashMLA not importable: {backends.status()['flashmla']['detail']}")
    g = seeded()
    kw, q, pos, req, valid, swa_deq, comp_deq = _dsv4_case(g, compress_ratio)
    sink = torch.linspace(-1, 1, 64)
    ref = _dsv4_reference(kw, q, pos, req, valid, swa_deq, comp_deq, sink)
    kc = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    qc, pc, rc, vc, sc = q.cuda(), pos.cuda(), req.cuda(), valid.cuda(), sink.cuda()
    o, lse = zv.dsv4_fixed_schedule_attention(qc, pc, rc, vc, attn_sink=sc, **kc)
    assert torch.allclose(o.cpu().double(), ref, atol=2e-2, rtol=2e-2)
    assert bool((o[4].float() == 0).all())
    for t in (0, 5, 7):
        sub = dict(kc)
        if kc["topk_local"] is not None:
            sub["topk_local"] = kc["topk_local"][t:t + 1]
        a = zv.dsv4_fixed_schedule_attention(qc[t:t + 1], pc[t:t + 1], rc[t:t + 1], vc[t:t + 1], attn_sink=sc, **sub)
        assert torch.equal(a[0][0], o[t]) and torch.equal(a[1][0], lse[t]), t


def test_dsv4_read_route_env():
    with pytest.raises(ConfigError, match="ZERODIFF_DSV4_READ"):  # refused at engine start
        zv.check_vllm_config(NS(), environ={"ZERODIFF_CONSISTENT": "1", "ZERODIFF_DSV4_READ": "fast",
                                           "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    assert zv.dsv4_read_route({}) == "fixed_schedule"
    assert zv.dsv4_read_route({"ZERODIFF_DSV4_READ": "prefill_path"}) == "prefill_path"
    with pytest.raises(ConfigError, match="ZERODIFF_DSV4_READ"):
        zv.dsv4_read_route({"ZERODIFF_DSV4_READ": " fixed_schedule"})
    assert zv.dsv4_read_route({"ZERODIFF_DSV4_READ": "fixed_schedule"}) == "fixed_schedule"
    with pytest.raises(ConfigError, match="ZERODIFF_DSV4_READ"):
        zv.dsv4_read_route({"ZERODIFF_DSV4_READ": "fast"})


def _dsv4_step(g, cr, reqs, pad=2, bs=8, window=128, top_k=64):
    """One vLLM step: ``reqs`` = list of (request length so far, positions of this step's tokens), decode
    requests first; fake layer and metadata objects as vLLM 0.33.0's DeepSeek-V4 backend passes them."""
    nreq = len(reqs)
    maxlen = max(L for L, _ in reqs)
    sb = -(-maxlen // bs)
    swa, _ = v4_cache(nreq * sb + 1, bs, seed=int(torch.randint(0, 999, (1,), generator=g)))
    swa_bt = torch.randperm(nreq * sb + 1, generator=g)[: nreq * sb].view(nreq, sb).int()
    toks = [(r, p) for r, (_L, ps) in enumerate(reqs) for p in ps]
    T = len(toks) + pad
    pos = torch.tensor([p for _, p in toks] + [0] * pad)
    qsl = torch.tensor([0] + list(torch.tensor([len(ps) for _, ps in reqs]).cumsum(0).tolist()), dtype=torch.int32)
    layer = NS(compress_ratio=cr, window_size=window, scale=0.06, attn_sink=torch.linspace(-1, 1, 64),
               max_model_len=4 * maxlen, swa_cache_layer=NS(kv_cache=swa))
    attn = None
    if cr > 1:
        nc = -(-maxlen // cr)
        cb = -(-nc // bs)
        comp, _ = v4_cache(nreq * cb + 1, bs, seed=int(torch.randint(0, 999, (1,), generator=g)))
        layer.kv_cache = comp
        attn = NS(block_size=bs * cr, block_table=torch.randperm(nreq * cb + 1, generator=g)[: nreq * cb]
                  .view(nreq, cb).int())
        if cr == 4:
            buf = torch.full((T, top_k), -1, dtype=torch.int32)
            for t, (_r, p) in enumerate(toks):
                n = min((p + 1) // 4, top_k)
                buf[t, :n] = torch.randperm((p + 1) // 4, generator=g)[:n].int()
            layer.topk_indices_buffer = buf
    nd = sum(1 for _L, ps in reqs if len(ps) == 1)
    swa_md = NS(num_decodes=nd, num_prefills=nreq - nd, query_start_loc=qsl, block_table=swa_bt, block_size=bs,
                is_valid_token=torch.tensor([True] * len(toks) + [False] * pad), prefill_left_visible=None,
                prefill_right_visible=None)
    q = (torch.randn(T, 64, 512, generator=g) * 0.3).to(torch.bfloat16)
    return layer, attn, swa_md, q, pos, toks


@pytest.mark.parametrize("cr", [1, 4, 128])
def test_dsv4_forward_fixed_schedule_decode_equals_prefill_and_padding(seeded, monkeypatch, cr):
    """The forward_mqa body of the fixed_schedule route: a token decoded in a decode batch and the same token
    computed inside a prefill chunk (other requests, other order) give the same bits; padding tokens give 0;
    in-image windows are refused. (CPU emulation of the kernel's contract; the GPU run is pending.)"""
    install_emulation(monkeypatch)
    g = seeded()
    # step A: request 0 decodes position 200 among other decodes; request 2 prefills a chunk ending at 200
    layer, attn, md, q, pos, toks = _dsv4_step(g, cr, [(201, [200]), (90, [89]), (201, list(range(150, 201)))])
    out = torch.empty_like(q)
    zv.dsv4_forward_fixed_schedule(layer, q, pos, out, md, attn)
    assert bool((out[-2:].float() == 0).all()), "padding tokens must give 0"
    # every token == the adapter on that token alone with its known request row (catches a wrong row mapping)
    for t, (r, _p) in enumerate(toks):
        kw = dict(compress_ratio=1, top_k=0, topk_local=None, compressed_k_cache=None, compressed_block_table=None,
                  compressed_block_size=1)
        if cr > 1:
            top_k = layer.topk_indices_buffer.shape[-1] if cr == 4 else -(-(-(-layer.max_model_len // cr)) // 128) * 128
            kw = dict(compress_ratio=cr, top_k=top_k, compressed_k_cache=layer.kv_cache,
                      topk_local=layer.topk_indices_buffer[t:t + 1] if cr == 4 else None,
                      compressed_block_table=attn.block_table, compressed_block_size=attn.block_size // cr)
        one, _ = zv.dsv4_fixed_schedule_attention(
            q[t:t + 1], pos[t:t + 1], torch.tensor([r]), torch.tensor([True]), window_size=layer.window_size,
            swa_k_cache=layer.swa_cache_layer.kv_cache, swa_block_table=md.block_table, swa_block_size=md.block_size,
            sm_scale=layer.scale, attn_sink=layer.attn_sink, **kw)
        assert torch.equal(one[0], out[t]), (cr, t, r)
    # the same caches and rows: make request 2 hold request 0's data, so token 200 is the same input in both phases
    t_dec = 0
    t_pre = len(toks) - 1  # request 2's last token (position 200)
    layer.swa_cache_layer.kv_cache  # same cache object
    md.block_table[2] = md.block_table[0]
    if attn is not None:
        attn.block_table[2] = attn.block_table[0]
        if cr == 4:
            layer.topk_indices_buffer[t_pre] = layer.topk_indices_buffer[t_dec]
    q[t_pre] = q[t_dec]
    out2 = torch.empty_like(q)
    zv.dsv4_forward_fixed_schedule(layer, q, pos, out2, md, attn)
    assert torch.equal(out2[t_pre], out2[t_dec]), "decode token != the same token inside a prefill chunk"
    md.prefill_left_visible = torch.zeros(len(toks), dtype=torch.int32)
    with pytest.raises(ConfigError, match="in-image"):
        zv.dsv4_forward_fixed_schedule(layer, q, pos, out2, md, attn)


@pytest.mark.parametrize("heads", [32, 64, 128])
def test_dsv32_sparse_fp8_adapter_reference_heads_and_batch_invariance(seeded, monkeypatch, heads):
    """FlashMLASparseImpl's FP8-cache path in consistency mode: vLLM's converter gives global 64-token-page slots,
    q is padded to 64 / 128 heads and the output sliced back, every token through the fixed-schedule kernel:
    ~= float64 reference, a token alone == inside the batch (CPU emulation of the kernel's contract)."""
    from zerodiff.ops.attention import flashmla_fp8 as fd
    from zerodiff.ops import kv_cache as kvc
    from zerodiff.reference.sparse_attention import sparse_attention_ref

    install_emulation(monkeypatch)
    g = seeded()
    lens, bs = (300, 130, 77), 64
    cache, bt = request_cache(g, lens, bs)
    nb = cache.shape[0]
    T, K = 9, 128
    req = torch.tensor([0, 1, 2, 0, 0, 1, 2, 2, 0], dtype=torch.int32)
    topk = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        L = lens[int(req[t])]
        k = min(L, K - 5 * t)
        topk[t, :k] = torch.randperm(L, generator=g)[:k].int()
    q = (torch.randn(T, heads, 576, generator=g) * 0.3).bfloat16()

    def convert(req_id, block_table, token_indices, BLOCK_SIZE=64, BLOCK_STRIDE_ROWS=None, NUM_TOPK_TOKENS=2048):
        assert BLOCK_STRIDE_ROWS is None and NUM_TOPK_TOKENS == token_indices.shape[1]
        return fd._translate_torch(block_table, req_id, token_indices, nb, BLOCK_SIZE)[0]

    impl = NS(softmax_scale=0.05, dcp_world_size=1)
    md = NS(block_size=bs, block_table=bt, req_id_per_token=req)
    out, lse = zv.dsv32_sparse_fp8_attention(impl, q, cache, topk, md, lambda c, b: (c, None), convert)
    assert lse is None and out.shape == (T, heads, 512)
    ws = kvc.gather_kv(cache, bt, req, topk, backend="reference")
    ro, _ = sparse_attention_ref(q, ws.view(-1, 576), kvc.workspace_indices(topk), 0.05, return_fp64=True)
    assert torch.allclose(out.double(), ro, atol=2e-2, rtol=2e-2)
    for t in (0, 4, 8):
        md1 = NS(block_size=bs, block_table=bt, req_id_per_token=req[t:t + 1])
        one, _ = zv.dsv32_sparse_fp8_attention(impl, q[t:t + 1], cache, topk[t:t + 1], md1, lambda c, b: (c, None),
                                               convert)
        assert torch.equal(one[0], out[t]), t
    with pytest.raises(ConfigError, match="context parallelism"):
        zv.dsv32_sparse_fp8_attention(NS(softmax_scale=0.05, dcp_world_size=2), q, cache, topk, md,
                                      lambda c, b: (c, None), convert)
