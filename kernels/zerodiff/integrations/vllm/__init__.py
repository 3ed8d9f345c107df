"""vLLM 0.33.0 glue: the fail-closed config guard and the adapters the ``patches/vllm`` series calls.

One module per concern: ``guard`` (config guard), ``custom_ops`` (the ``zerodiff_vllm::*`` torch ops),
``layers`` (router, RMSNorm, block-FP8 linear, SwiGLU), ``mhc``, ``moe``, ``indexer``, ``sampler``,
``dsv4_attention``, ``dsv32_attention``. Everything public is re-exported here, which is the name the
patches import (``zerodiff.integrations.vllm``).

Every function here is called only when consistency mode is on (``ZERODIFF_CONSISTENT=1``, see
:mod:`zerodiff.integrations`); the patched call sites keep the upstream code untouched otherwise.

The config guard's rules and their reasons are in :mod:`zerodiff.integrations.vllm.guard`.

Adapters (upstream tensors/layouts -> zerodiff ops)
---------------------------------------------------
* ``indexer_topk_decode(logits, seq_lens, next_n, topk_indices, topk_tokens)``: writes
  ``zerodiff.ops.topk.deterministic_topk`` positions into ``topk_indices`` in place.
* ``indexer_topk_prefill(logits, row_starts, row_ends, topk_indices, topk_tokens)``: same for the prefill
  rows; positions are relative to each row's start (``row_starts`` None = all zero), as upstream.
* ``short_context_uses_fill(max_model_len, compress_ratio, topk_tokens)``: the static bound replacing the
  batch-dependent ``max_seq_len`` test; ``fill_short_context_topk(out, positions, num_tokens, topk_tokens,
  compress_ratio)``: every candidate, in the contract order (position descending, -1 last).
* ``moe_act_quant_contiguous(input, output, *, group_size, clamp_limit, scale_fmt, alpha, beta)`` and
  ``moe_act_quant_masked(y, tokens_per_expert, *, group_size, scale_fmt, clamp_limit=None)``: SiLU*up with
  one BF16 rounding, then per-token-group FP8 (``zerodiff.ops.silu_mul_quant``), returned in the scale
  layouts DeepGEMM reads (MN-major TMA-aligned FP32; UE8M0 packed int32 for ``scale_fmt="UE8M0"``).
``scale_fmt`` is the *name* of vLLM's ``DeepGemmQuantScaleFMT`` member (``FLOAT32``,
``FLOAT32_CEIL_UE8M0``, ``UE8M0``) so this module never imports vLLM.
* ``router_logits(x, weight) -> fp32``: ``zerodiff.ops.router_gemm`` for ``GateLinear`` (FP32 output).
* ``mhc_pre``, ``mhc_pre_broadcast``, ``mhc_post``, ``mhc_fused_post_pre``, ``hc_head``: the five mHC entry
  points DeepSeek-V4 calls (``vllm/model_executor/kernels/mhc/tilelang.py``, same signatures) on
  ``zerodiff.ops.mhc`` (shipped projection variant, split fixed by the model shape) + :func:`rms_norm` for the
  fused norm; fused kernels become their two-op composition, the one the training side runs.
* ``rms_norm(x, weight, eps, residual=None)``: ``zerodiff.ops.rmsnorm`` for vLLM's ``RMSNorm``
  (``(y, new_residual)`` with a residual, vLLM's fused-add semantics).
* ``keep_raw_logits(logits)``, ``sampled_token_logprobs(raw_logits, sampled)`` and
  ``fix_sampled_logprobs(logprobs_tensors, raw_logits, sampled, num_logprobs)``: the sampled token's
  log-prob from ``zerodiff.ops.logprobs`` (raw logits, temperature 1), the rollout side of the
  training loss ``-token_logprobs``.
* ``fp8_block_linear(x, weight, weight_scale, bias=None, *, ue8m0=False)``: ``zerodiff.ops.fp8_gemm.fp8_linear``
  for block-FP8 linears (one M-independent kernel choice per (N, K)).
* ``silu_mul(x, clamp_limit=None, *, alpha=1.0, beta=0.0)``: ``zerodiff.ops.silu_mul_quant.silu_mul`` for
  ``SiluAndMul`` / ``SiluAndMulWithClamp`` (one BF16 rounding).
* ``expert_routing(router_logits, top_k, *, scoring_func, bias, renormalize, routed_scaling_factor,
  indices_type)``: ``zerodiff.ops.moe.route`` for ``FusedTopKBiasRouter`` (deterministic expert top-k).
* ``dsv4_decode_attention(layer, q, positions, kv_cache, swa_metadata, attn_metadata, swa_only, output,
  sparse_fwd)``: DeepSeek-V4 decode through the prefill read path (``DeepseekV4FlashMLAAttention.
  _forward_decode``): the entries the prefill path gives the token (``dsv4_decode_entries``: compressed top-k in
  the indexer's order, then the SWA window ascending), dequantised bit-exactly (``dsv4_dequant_rows``) into a BF16
  workspace (``dsv4_decode_workspace``) padded to the prefill width (``dsv4_workspace_width``), then
  ``flash_mla_sparse_fwd``; never the FP8 decode kernel.
* ``dsv32_sparse_fp8_attention(impl, q, kv_cache, topk_indices, attn_metadata, kv_pages_fn, convert_fn)``: the
  FP8-cache (``fp8_ds_mla``) body of ``FlashMLASparseImpl.forward_mqa`` (DeepSeek-V3.2-style sparse MLA): every
  token, prefill and decode, through FlashMLA's FP8 decode kernel under zerodiff's fixed schedule on the global
  slots vLLM's own converter gives (``flashmla_fp8_attention``), instead of the batch-shaped stock schedule.
* ``dsv4_read_route(environ=None)`` -> "fixed_schedule" (default, below) or "prefill_path" (decode through the
  prefill read path, above); the rest of this entry describes the two:
  "fixed_schedule" (``ZERODIFF_DSV4_READ=fixed_schedule``: every token through the function below);
  ``dsv4_forward_fixed_schedule(layer, q, positions, output, swa_metadata, attn_metadata)``: the body of
  ``DeepseekV4FlashMLAAttention.forward_mqa`` in that route (all tokens of the step, decode and prefill, one call).
* ``dsv4_fixed_schedule_attention(q, positions, token_to_req, is_valid, *, ...)``: every DeepSeek-V4 attention
  token, prefill or decode, through one row of FlashMLA's FP8 decode kernel under zerodiff's fixed schedule
  (``zerodiff.ops.attention.flashmla_fp8.flashmla_fp8_attention``): the compressed entries the prefill path gives
  the token as the main list, the sliding window as the extra list, both read in place (no BF16 workspace). The
  building block of the faster DeepSeek-V4 route; not yet wired into a patch (needs its GPU run first).
Adapters called inside vLLM's compiled model forward (router, RMSNorm, FP8 linear, SwiGLU) run through torch
custom ops (``zerodiff_vllm::*``) so Dynamo treats them as opaque. The others are called from code vLLM
already runs outside the compiled graph (the indexer and MoE custom ops, the sampler).
"""


from __future__ import annotations

from .guard import ALLOWED_CUDAGRAPH_MODES, validate_config, config_values, check_vllm_config  # noqa: F401
from .indexer import indexer_topk_decode, indexer_topk_prefill, short_context_uses_fill, fill_short_context_topk  # noqa: F401
from .moe import dsv4_moe_forward, dsv4_moe_weights, mn_major_scales, pack_ue8m0_scales, moe_act_quant_contiguous, mn_major_int, moe_act_quant_masked, expert_routing  # noqa: F401
from .layers import bf16_linear, lm_head_logits, fp8_grouped_linear, router_logits, rms_norm, fp8_block_linear, silu_mul  # noqa: F401
from .mhc import mhc_pre, mhc_pre_broadcast, mhc_post, mhc_fused_post_pre, hc_head  # noqa: F401
from .sampler import token_logprobs_columns, keep_raw_logits, sampled_token_logprobs, fix_sampled_logprobs  # noqa: F401
from .dsv4_attention import DSV4_FP8_DIM, DSV4_ROPE_DIM, DSV4_TOKEN_BYTES, DSV4_SCALE_BYTES, DSV4_QBLOCK, DSV4_HEAD_DIM, DSV4_TOPK_ALIGN, dsv4_workspace_width, dsv4_dequant_rows, dsv4_decode_entries, dsv4_decode_workspace, dsv4_decode_attention, dsv4_fixed_schedule_attention, DSV4_READ_ENV, DSV4_READ_ROUTES, dsv4_read_route, dsv4_forward_fixed_schedule  # noqa: F401
from .dsv32_attention import dsv32_sparse_fp8_attention  # noqa: F401
from .custom_ops import _ops  # noqa: F401  (tests build the op registry directly)

__all__ = [
    "token_logprobs_columns",
    "fp8_grouped_linear",
    "lm_head_logits",
    "bf16_linear",
    "dsv4_moe_weights",
    "dsv4_moe_forward",
    "ALLOWED_CUDAGRAPH_MODES",
    "validate_config",
    "config_values",
    "check_vllm_config",
    "indexer_topk_decode",
    "indexer_topk_prefill",
    "short_context_uses_fill",
    "fill_short_context_topk",
    "mn_major_scales",
    "pack_ue8m0_scales",
    "moe_act_quant_contiguous",
    "mn_major_int",
    "moe_act_quant_masked",
    "expert_routing",
    "router_logits",
    "rms_norm",
    "fp8_block_linear",
    "silu_mul",
    "mhc_pre",
    "mhc_pre_broadcast",
    "mhc_post",
    "mhc_fused_post_pre",
    "hc_head",
    "keep_raw_logits",
    "sampled_token_logprobs",
    "fix_sampled_logprobs",
    "DSV4_FP8_DIM",
    "DSV4_ROPE_DIM",
    "DSV4_TOKEN_BYTES",
    "DSV4_SCALE_BYTES",
    "DSV4_QBLOCK",
    "DSV4_HEAD_DIM",
    "DSV4_TOPK_ALIGN",
    "dsv4_workspace_width",
    "dsv4_dequant_rows",
    "dsv4_decode_entries",
    "dsv4_decode_workspace",
    "dsv4_decode_attention",
    "dsv4_fixed_schedule_attention",
    "DSV4_READ_ENV",
    "DSV4_READ_ROUTES",
    "dsv4_read_route",
    "dsv4_forward_fixed_schedule",
    "dsv32_sparse_fp8_attention",
]
