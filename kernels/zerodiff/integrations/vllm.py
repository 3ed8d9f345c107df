"""vLLM 0.33.0 glue: the fail-closed config guard and the adapters the ``patches/vllm`` series calls.

Every function here is called only when consistency mode is on (``ZERODIFF_CONSISTENT=1``, see
:mod:`zerodiff.integrations`); the patched call sites keep the upstream code untouched otherwise.

Config guard
------------
``validate_config(**plain_values)`` refuses, with one message naming every bad setting, each configuration
that cannot keep rollout/training log-probs bit-identical (``diff = 0``); ``check_vllm_config(vllm_config)``
reads those values off a ``VllmConfig`` (duck-typed, so CPU tests use fake objects) and is what the patched
``VllmConfig.__post_init__`` calls. Rules and why:

* ``tensor_parallel_size > 1``: TP puts an all-reduce (cross-GPU sum) inside the compared path (DESIGN
  "cross-GPU"; seed 4.5). Refused.
* ``decode_context_parallel_size > 1`` / ``prefill_context_parallel_size > 1``: decode CP merges partial
  attention and top-k results across GPUs; not supported (seed 4.5). Refused.
* expert parallel with an ``all2all_backend`` other than ``deepep_low_latency``: the combine must happen on
  the token's owner in FP32 in top-k slot order (DESIGN "MoE routed experts"); ``allgather_reducescatter``
  sums expert outputs across GPUs. Refused.
* ``enable_prefix_caching``: a cached prefix is never recomputed, so the rollout's values would come from an
  earlier batch's prefill, and the check itself is defined with caching off (reference fork, class 5).
* speculative decoding (any ``speculative_config``): the draft/verify split changes which path computes a
  token and uses ``next_n > 1`` rows. Refused.
* ``cudagraph_mode == PIECEWISE``: refused. ``NONE``, ``FULL``, ``FULL_DECODE_ONLY`` and
  ``FULL_AND_PIECEWISE`` are accepted. Reasoning (DESIGN "CUDA graphs", seed 4.6): whether a step runs in a
  graph or eagerly depends on the other requests of the step, so graph and eager must be bit-identical;
  our kernels make that so (no host sync, static bounds, workspaces sized by model limits). The seed ran
  FULL_AND_PIECEWISE with diff 0 over 100 steps (and it is the fastest mode there). PIECEWISE-only leaves
  attention and the indexer outside the graph for *decode* steps as well, which is the mode in which the
  public reference fork measured a mixed-step leak (29 of 75 soak rounds flipped, not shape-invariant);
  it is also the slowest mode (10.4k vs 16.4k tok/s in seed 4.6), so nothing is lost by refusing it.
  FULL_AND_PIECEWISE stays a measured risk: the soak test must cover it (see docs/patch-catalog.md).
* DeepSeek-V4: ``kv_cache_dtype`` must be explicitly FP8 (``fp8``, ``fp8_e4m3`` or ``fp8_ds_mla``): the
  consistent read path (DESIGN "FP8 KV cache") and the training side's private cache are defined on the
  ``fp8_ds_mla`` layout; ``auto`` resolves per attention backend (BF16 on some), so it is refused too.
* DSA indexer cache: ``indexer_kv_dtype`` ``mxfp4`` (the FP4 indexer cache) refused: the reference fork
  measured a leak with it and no zerodiff kernel reads it. ``auto``/``fp8``/``fp8_e4m3`` accepted.
* MoE models: ``moe_backend`` must be ``deep_gemm`` (the only expert path whose activation quant the
  series routes through ``zerodiff.ops.silu_mul_quant``); ``auto`` may pick Triton/FlashInfer/Cutlass
  experts by shape, so it is refused as well.
* ``quantization`` other than none / ``fp8`` (block FP8): refused (e.g. ``mxfp4`` experts).
* block-FP8 models (``quantization`` ``fp8``): ``linear_backend`` must be ``deep_gemm`` (the FlashInfer
  ``M < 32`` swap-AB branch is a batch-size fork, seed 4.1); ``auto`` picks FlashInfer first on CUDA.

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
* ``dsv4_read_route(environ=None)`` -> "prefill_path" (default: decode through the prefill read path, above) or
  "fixed_schedule" (``ZERODIFF_DSV4_READ=fixed_schedule``: every token through the function below);
  ``dsv4_forward_fixed_schedule(layer, q, positions, output, swa_metadata, attn_metadata)``: the body of
  ``DeepseekV4FlashMLAAttention.forward_mqa`` in that route (all tokens of the step, decode and prefill, one call).
* ``dsv4_fixed_schedule_attention(q, positions, token_to_req, is_valid, *, ...)``: every DeepSeek-V4 attention
  token, prefill or decode, through one row of FlashMLA's FP8 decode kernel under zerodiff's fixed schedule
  (``zerodiff.ops.flashmla_fp8_decode.flashmla_fp8_attention``): the compressed entries the prefill path gives
  the token as the main list, the sliding window as the extra list, both read in place (no BF16 workspace). The
  building block of the faster DeepSeek-V4 route; not yet wired into a patch (needs its GPU run first).
Adapters called inside vLLM's compiled model forward (router, RMSNorm, FP8 linear, SwiGLU) run through torch
custom ops (``zerodiff_vllm::*``) so Dynamo treats them as opaque. The others are called from code vLLM
already runs outside the compiled graph (the indexer and MoE custom ops, the sampler).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from . import ConfigError, _problems_to_error, enabled

__all__ = [
    "ALLOWED_CUDAGRAPH_MODES",
    "validate_config",
    "config_values",
    "check_vllm_config",
    "dsv4_fixed_schedule_attention",
    "dsv32_sparse_fp8_attention",
    "dsv4_forward_fixed_schedule",
    "dsv4_read_route",
    "indexer_topk_decode",
    "indexer_topk_prefill",
    "short_context_uses_fill",
    "fill_short_context_topk",
    "moe_act_quant_contiguous",
    "moe_act_quant_masked",
    "mn_major_scales",
    "pack_ue8m0_scales",
    "router_logits",
    "rms_norm",
    "keep_raw_logits",
    "sampled_token_logprobs",
    "fix_sampled_logprobs",
    "fp8_block_linear",
    "expert_routing",
    "silu_mul",
]

ALLOWED_CUDAGRAPH_MODES = ("NONE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_DSV4_ARCHS = ("DeepseekV4ForCausalLM", "DeepSeekV4MTPModel", "DeepseekV41ForCausalLM")
_FP8_KV = ("fp8", "fp8_e4m3", "fp8_ds_mla")
_INDEXER_KV_OK = ("auto", "fp8", "fp8_e4m3")


# ------------------------------------------------------------------------------------------ config guard
def validate_config(
    *,
    tensor_parallel_size: int = 1,
    decode_context_parallel_size: int = 1,
    prefill_context_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    expert_parallel_world: int = 1,
    all2all_backend: str | None = None,
    enable_prefix_caching: bool = False,
    speculative: bool = False,
    cudagraph_mode: str | None = None,
    architectures: tuple[str, ...] | list[str] = (),
    is_moe: bool = False,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    indexer_kv_dtype: str = "auto",
    moe_backend: str = "auto",
    linear_backend: str = "auto",
) -> None:
    """Raise :class:`ConfigError` naming every setting that breaks diff = 0; return None when all is fine.

    Takes plain values only (see :func:`config_values` for how they are read off a ``VllmConfig``).
    ``cudagraph_mode`` is the ``CUDAGraphMode`` member name (``None``: not resolved yet, accepted).
    """
    p: list[str] = []
    if int(tensor_parallel_size) > 1:
        p.append(f"tensor_parallel_size={tensor_parallel_size}: TP > 1 puts a cross-GPU all-reduce in the "
                 "compared path; use tensor_parallel_size=1 (scale out with data/expert parallelism)")
    if int(decode_context_parallel_size) > 1:
        p.append(f"decode_context_parallel_size={decode_context_parallel_size}: decode context parallelism "
                 "merges partial attention across GPUs; use 1")
    if int(prefill_context_parallel_size) > 1:
        p.append(f"prefill_context_parallel_size={prefill_context_parallel_size}: prefill context parallelism "
                 "merges partial results across GPUs; use 1")
    if enable_expert_parallel and int(expert_parallel_world) > 1 and all2all_backend != "deepep_low_latency":
        p.append(f"all2all_backend={all2all_backend!r} with enable_expert_parallel: the expert combine must run "
                 "on the token's owner in FP32 in top-k slot order; use all2all_backend='deepep_low_latency'")
    if enable_prefix_caching:
        p.append("enable_prefix_caching=True: cached prefixes are never recomputed; pass "
                 "--no-enable-prefix-caching")
    if speculative:
        p.append("speculative_config is set: speculative decoding is not supported in consistency mode; "
                 "remove --speculative-config")
    if cudagraph_mode is not None and cudagraph_mode not in ALLOWED_CUDAGRAPH_MODES:
        p.append(f"cudagraph_mode={cudagraph_mode}: not allowed in consistency mode (PIECEWISE-only leaves "
                 f"decode attention outside the graph; see zerodiff.integrations.vllm); use one of "
                 f"{', '.join(ALLOWED_CUDAGRAPH_MODES)}")
    archs = tuple(architectures or ())
    is_dsv4 = any(a in _DSV4_ARCHS for a in archs)
    if is_dsv4 and str(kv_cache_dtype) not in _FP8_KV:
        p.append(f"kv_cache_dtype={kv_cache_dtype!r}: DeepSeek-V4 needs the FP8 KV cache; pass "
                 "--kv-cache-dtype fp8")
    if str(indexer_kv_dtype) not in _INDEXER_KV_OK:
        p.append(f"indexer_kv_dtype={indexer_kv_dtype!r}: the FP4 (mxfp4) / non-FP8 indexer cache is not "
                 "supported; use indexer_kv_dtype='fp8' (or 'auto' on CUDA)")
    if is_moe and str(moe_backend) != "deep_gemm":
        p.append(f"moe_backend={moe_backend!r}: only the DeepGEMM experts have their activation routed "
                 "through zerodiff; pass --moe-backend deep_gemm")
    if quantization is not None and str(quantization).lower() not in ("fp8",):
        p.append(f"quantization={quantization!r}: only BF16 and block-FP8 ('fp8', 128x128 weight blocks) "
                 "checkpoints are supported in consistency mode (FP4 experts are not)")
    if quantization is not None and str(quantization).lower() == "fp8" and str(linear_backend) != "deep_gemm":
        p.append(f"linear_backend={linear_backend!r}: block-FP8 linears must run one M-independent kernel "
                 "(no FlashInfer M<32 branch); pass --linear-backend deep_gemm")
    _problems_to_error("vLLM", p)


def _get(obj: Any, path: str, default=None):
    for name in path.split("."):
        if obj is None:
            return default
        obj = getattr(obj, name, None)
    return default if obj is None else obj


def config_values(vllm_config: Any) -> dict:
    """The plain values :func:`validate_config` needs, read off a ``VllmConfig`` (or a look-alike)."""
    mode = _get(vllm_config, "compilation_config.cudagraph_mode")
    mode_name = None if mode is None else getattr(mode, "name", str(mode)).split(".")[-1]
    mc = _get(vllm_config, "model_config")
    archs = _get(mc, "architectures") or _get(mc, "hf_config.architectures") or ()
    pc = _get(vllm_config, "parallel_config")
    ep_world = int(_get(pc, "data_parallel_size", 1)) * int(_get(pc, "tensor_parallel_size", 1))
    return dict(
        tensor_parallel_size=int(_get(pc, "tensor_parallel_size", 1)),
        decode_context_parallel_size=int(_get(pc, "decode_context_parallel_size", 1)),
        prefill_context_parallel_size=int(_get(pc, "prefill_context_parallel_size", 1)),
        enable_expert_parallel=bool(_get(pc, "enable_expert_parallel", False)),
        expert_parallel_world=ep_world,
        all2all_backend=_get(pc, "all2all_backend"),
        enable_prefix_caching=bool(_get(vllm_config, "cache_config.enable_prefix_caching", False)),
        speculative=_get(vllm_config, "speculative_config") is not None,
        cudagraph_mode=mode_name,
        architectures=tuple(archs),
        is_moe=bool(_get(mc, "is_moe", False)),
        quantization=_get(mc, "quantization"),
        kv_cache_dtype=str(_get(vllm_config, "cache_config.cache_dtype", "auto")),
        indexer_kv_dtype=str(_get(vllm_config, "attention_config.indexer_kv_dtype", "auto")),
        moe_backend=str(_get(vllm_config, "kernel_config.moe_backend", "auto")),
        linear_backend=str(_get(vllm_config, "kernel_config.linear_backend", "auto")),
    )


def check_vllm_config(vllm_config: Any, environ=None) -> bool:
    """The guard the patched ``VllmConfig.__post_init__`` calls: no-op (False) when consistency mode is off,
    else validate (raising :class:`ConfigError`) and return True."""
    if not enabled(environ):
        return False
    if getattr(_get(vllm_config, "model_config"), "is_submodel_config", False):
        return True  # a with_hf_config() view; its parent was validated
    validate_config(**config_values(vllm_config))
    dsv4_read_route(environ)  # a bad ZERODIFF_DSV4_READ fails at start, not at the first attention call
    return True


# ------------------------------------------------------------------------------------------- DSA top-k
def _decode_row_ends(seq_lens: torch.Tensor, next_n: int, num_rows: int) -> torch.Tensor:
    """Per-row candidate counts: seq_lens is (B, next_n) per row, or (B, 1) -> row j of a request sees
    ``len - next_n + 1 + j`` candidates (clamped at 0)."""
    if seq_lens.numel() == num_rows:
        ends = seq_lens.reshape(-1)
    else:
        off = torch.arange(next_n, dtype=torch.int32, device=seq_lens.device)
        ends = (seq_lens.reshape(-1, 1).to(torch.int32) - next_n + 1 + off).clamp(min=0).reshape(-1)
    return ends[:num_rows].to(torch.int32)


def _as_f32(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype == torch.float32:
        return logits if logits.stride(-1) == 1 else logits.contiguous()
    if logits.dtype in (torch.bfloat16, torch.float16):
        return logits.float()  # exact widening
    raise TypeError(f"zerodiff indexer top-k: logits must be fp32/bf16/fp16, got {logits.dtype}")


def indexer_topk_decode(logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, topk_indices: torch.Tensor,
                        topk_tokens: int, *, backend=None) -> None:
    """Replacement for ``SparseIndexerTopk.forward``: deterministic top-k of each decode row into
    ``topk_indices`` (int32 [rows, topk_tokens], written in place; position descending, -1 last)."""
    from ..ops.topk import deterministic_topk

    rows = logits.shape[0]
    if topk_indices.shape[0] < rows or topk_indices.shape[-1] != topk_tokens:
        raise ValueError(f"zerodiff indexer top-k: topk_indices {tuple(topk_indices.shape)} does not fit "
                         f"{rows} rows x topk_tokens={topk_tokens}")
    lengths = _decode_row_ends(seq_lens, next_n, rows)
    pos = deterministic_topk(_as_f32(logits), topk_tokens, lengths, backend=backend)
    topk_indices[:rows].copy_(pos)


def indexer_topk_prefill(logits: torch.Tensor, row_starts: torch.Tensor | None, row_ends: torch.Tensor,
                         topk_indices: torch.Tensor, topk_tokens: int, *, backend=None) -> None:
    """Replacement for ``ops.top_k_per_row_prefill``: row r's candidates are columns
    ``[row_starts[r], row_ends[r])``; the written positions are relative to ``row_starts[r]`` (request-local),
    position descending, -1 last."""
    from ..ops.topk import deterministic_topk

    rows = logits.shape[0]
    if rows == 0:
        return
    x = _as_f32(logits)
    ends = row_ends[:rows].to(torch.int32)
    if row_starts is None:
        lengths = ends
    else:
        starts = row_starts[:rows].to(torch.int32)
        lengths = (ends - starts).clamp(min=0)
        W = x.shape[1]
        cols = starts.to(torch.int64).unsqueeze(1) + torch.arange(W, device=x.device).unsqueeze(0)
        x = torch.gather(x, 1, cols.clamp(max=W - 1))  # columns past the row's length are never read
    pos = deterministic_topk(x, topk_tokens, lengths, backend=backend)
    topk_indices[:rows, :topk_tokens].copy_(pos)


def short_context_uses_fill(max_model_len: int, compress_ratio: int, topk_tokens: int) -> bool:
    """Static bound for the indexer's short-context shortcut: True when NO request can ever have more
    than ``topk_tokens`` compressed candidates (model limit only, never the batch's max_seq_len), so the
    fill is taken for every step, captured or eager, and the top-k never runs."""
    return int(max_model_len) // int(compress_ratio) <= int(topk_tokens)


def fill_short_context_topk(out: torch.Tensor, positions: torch.Tensor, num_tokens: int, topk_tokens: int,
                            compress_ratio: int) -> None:
    """Every candidate of each token, in the contract order: token at position p has
    ``n = (p + 1) // compress_ratio`` candidates; row = ``[n-1, n-2, ..., 0, -1, ...]`` (position descending,
    -1 last), exactly what ``deterministic_topk`` returns for a row of ``n <= topk_tokens`` finite scores.
    Precondition (guaranteed when :func:`short_context_uses_fill` is True): ``n <= topk_tokens`` per token.
    Integer math only, no host sync (CUDA-graph safe). ``out`` is viewed as ``[*, topk_tokens]``."""
    if num_tokens <= 0:
        return
    o = out.view(-1, topk_tokens)[:num_tokens]
    n = (positions[:num_tokens].to(torch.int64) + 1) // int(compress_ratio)
    j = torch.arange(topk_tokens, device=o.device, dtype=torch.int64)
    vals = n.unsqueeze(1) - 1 - j.unsqueeze(0)
    o.copy_(torch.where(vals >= 0, vals, torch.full_like(vals, -1)).to(o.dtype))


# ---------------------------------------------------------------------------------- MoE SiLU*up -> FP8
def mn_major_scales(scale: torch.Tensor) -> torch.Tensor:
    """FP32 scales [M, G] (or [E, M, G]) in the MN-major layout DeepGEMM's SM90 kernels read: M padded to a
    multiple of 4 (16-byte TMA alignment), the M index contiguous. Values unchanged."""
    if scale.dim() == 2:
        M, G = scale.shape
        m_pad = (M + 3) // 4 * 4
        buf = torch.zeros((G, m_pad), dtype=scale.dtype, device=scale.device)
        buf[:, :M] = scale.t()
        return buf.t()[:M]
    return _mn_major_3d(scale)


def _mn_major_3d(scale: torch.Tensor) -> torch.Tensor:
    E, M, G = scale.shape
    m_pad = (M + 3) // 4 * 4
    buf = torch.zeros((E, G, m_pad), dtype=scale.dtype, device=scale.device)
    buf[:, :, :M] = scale.transpose(1, 2)
    return buf.transpose(1, 2)[:, :M]


def pack_ue8m0_scales(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two FP32 scales [..., G] -> int32 [..., ceil(G/4)] holding 4 exponent bytes each (group 4i
    in the lowest byte), the packed UE8M0 format of DeepGEMM's SM100 kernels. Exact (bit extraction)."""
    G = scale.shape[-1]
    e = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.int64)
    pad = (-G) % 4
    if pad:
        e = torch.nn.functional.pad(e, (0, pad))
    e = e.view(*e.shape[:-1], -1, 4)
    packed = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # same bits, signed


def _scale_fmt(scale_fmt) -> str:
    name = getattr(scale_fmt, "name", scale_fmt)
    name = str(name).split(".")[-1]
    if name not in ("FLOAT32", "FLOAT32_CEIL_UE8M0", "UE8M0"):
        raise ConfigError(f"zerodiff MoE activation: unknown DeepGEMM scale format {scale_fmt!r}")
    return name


def _check_gated(alpha, beta) -> None:
    if alpha not in (None, 1.0) or beta not in (None, 0.0):
        raise ConfigError(f"zerodiff MoE activation: gemm1_alpha={alpha!r} / gemm1_beta={beta!r} (swigluoai) "
                          "is not supported in consistency mode; only SiLU (alpha=1, beta=0)")


def moe_act_quant_contiguous(input: torch.Tensor, output: torch.Tensor | None = None, *, group_size: int = 128,
                             clamp_limit: float | None = None, scale_fmt="FLOAT32", alpha=None, beta=None,
                             activation: str = "SILU", backend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Replacement for ``DeepGemmExperts._act_mul_quant``: input bf16 [M, 2N] (gate | up) ->
    (q e4m3 [M, N] written into ``output`` when given, scales in DeepGEMM's layout). Only SiLU (``activation``
    = the ``MoEActivation`` member name) is supported; anything else is refused (fail closed)."""
    from ..ops.silu_mul_quant import silu_mul_quant_fp8

    if str(activation).split(".")[-1] != "SILU":
        raise ConfigError(f"zerodiff MoE activation: activation={activation!r} is not supported in consistency "
                          "mode; only SILU (SiluAndMul, optionally with the swiglu clamp)")
    _check_gated(alpha, beta)
    fmt = _scale_fmt(scale_fmt)
    q, s = silu_mul_quant_fp8(input, group=group_size, clamp_limit=clamp_limit, ue8m0=fmt != "FLOAT32",
                              backend=backend)
    if output is not None:
        if tuple(output.shape) != tuple(q.shape):
            raise ValueError(f"zerodiff MoE activation: output {tuple(output.shape)} != {tuple(q.shape)}")
        output.copy_(q)
        q = output
    if fmt == "UE8M0":
        return q, mn_major_int(pack_ue8m0_scales(s))
    return q, mn_major_scales(s)


def mn_major_int(packed: torch.Tensor) -> torch.Tensor:
    """int32 packed scales [M, G4] in MN-major layout (M contiguous, padded to a multiple of 4)."""
    return mn_major_scales(packed)


def moe_act_quant_masked(y: torch.Tensor, tokens_per_expert: torch.Tensor, *, group_size: int = 128,
                         scale_fmt="FLOAT32", clamp_limit: float | None = None,
                         backend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Replacement for ``persistent_masked_m_silu_mul_quant``: y bf16 [E, T, 2H], counts [E] ->
    (q e4m3 [E, T, H], scales [E, T, G] fp32 (or [E, T, ceil(G/4)] int32 for UE8M0) with strides
    ``(T*G, 1, T)``, zero on rows past each expert's count), bit-identical per valid row to the contiguous
    layout."""
    from ..ops.silu_mul_quant import silu_mul_quant_fp8_masked

    fmt = _scale_fmt(scale_fmt)
    counts = tokens_per_expert.to(device=y.device, dtype=torch.int32)
    q, s = silu_mul_quant_fp8_masked(y, counts, group=group_size, clamp_limit=clamp_limit,
                                     ue8m0=fmt != "FLOAT32", backend=backend)
    if fmt == "UE8M0":
        s = pack_ue8m0_scales(s)
    E, T, G = s.shape
    out = torch.empty_strided((E, T, G), (T * G, 1, T), dtype=s.dtype, device=s.device)
    out.copy_(s)
    return q, out


# ---------------------------------------------------------------- opaque custom ops (torch.compile-safe)
# vLLM compiles the model forward with Dynamo; a Python function that launches Triton kernels with our
# launch options would break the graph there. The adapters called from compiled regions are therefore
# registered as torch custom ops (opaque to Dynamo, with shape-only fake implementations).
_LIB = "zerodiff_vllm"
_OPS: dict = {}


def _ops() -> dict:
    if _OPS:
        return _OPS
    from torch.library import custom_op

    @custom_op(f"{_LIB}::router_logits", mutates_args=())
    def _router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from ..ops.router_gemm import router_gemm

        return router_gemm(x, w)

    @_router_logits.register_fake
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @custom_op(f"{_LIB}::rms_norm", mutates_args=())
    def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        from ..ops.rmsnorm import rms_norm as zd_rms_norm

        return zd_rms_norm(x, w, eps)

    @_rms_norm.register_fake
    def _(x, w, eps):
        return torch.empty_like(x)

    @custom_op(f"{_LIB}::rms_norm_residual", mutates_args=())
    def _rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from ..ops.rmsnorm import rms_norm as zd_rms_norm

        return zd_rms_norm(x, w, eps, residual=residual)

    @_rms_norm_residual.register_fake
    def _(x, residual, w, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @custom_op(f"{_LIB}::fp8_block_linear", mutates_args=())
    def _fp8_block_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, ue8m0: bool) -> torch.Tensor:
        from ..ops.fp8_gemm import fp8_linear as zd_fp8_linear
        from ..ops.fp8_quant import Fp8Weight

        return zd_fp8_linear(x, Fp8Weight(w, s, ue8m0))

    @_fp8_block_linear.register_fake
    def _(x, w, s, ue8m0):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)

    @custom_op(f"{_LIB}::silu_mul", mutates_args=())
    def _silu_mul(x: torch.Tensor, clamp_limit: Optional[float]) -> torch.Tensor:
        from ..ops.silu_mul_quant import silu_mul as zd_silu_mul

        return zd_silu_mul(x, clamp_limit=clamp_limit)

    @_silu_mul.register_fake
    def _(x, clamp_limit):
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @custom_op(f"{_LIB}::mhc_pre", mutates_args=())
    def _mhc_pre(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                 rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult: float,
                 sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from ..ops.mhc import mhc_pre as zd_mhc_pre

        return zd_mhc_pre(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps,
                          hc_sinkhorn_eps=hc_sinkhorn_eps, hc_post_mult=hc_post_mult, sinkhorn_iters=sinkhorn_iters)

    @_mhc_pre.register_fake
    def _(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters):
        T, n, H = residual.shape
        return (residual.new_empty((T, H)), residual.new_empty((T, n), dtype=torch.float32),
                residual.new_empty((T, n, n), dtype=torch.float32))

    @custom_op(f"{_LIB}::mhc_post", mutates_args=())
    def _mhc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        from ..ops.mhc import mhc_post as zd_mhc_post

        return zd_mhc_post(x, residual, post, comb)

    @_mhc_post.register_fake
    def _(x, residual, post, comb):
        return torch.empty_like(residual)

    @custom_op(f"{_LIB}::hc_head", mutates_args=())
    def _hc_head(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                 rms_eps: float, hc_eps: float) -> torch.Tensor:
        from ..ops.mhc import hc_head as zd_hc_head

        return zd_hc_head(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps)

    @_hc_head.register_fake
    def _(residual, fn, hc_scale, hc_base, rms_eps, hc_eps):
        return residual.new_empty((residual.shape[0], residual.shape[2]))

    _OPS.update(mhc_pre=_mhc_pre, mhc_post=_mhc_post, hc_head=_hc_head)
    _OPS.update(router_logits=_router_logits, rms_norm=_rms_norm, rms_norm_residual=_rms_norm_residual,
                fp8_block_linear=_fp8_block_linear, silu_mul=_silu_mul)
    return _OPS


def _op(name: str):
    """The registered op as ``torch.ops.zerodiff_vllm.<name>`` (the form Dynamo traces as one opaque call)."""
    if not _OPS:
        _ops()
    return getattr(getattr(torch.ops, _LIB), name)


# ----------------------------------------------------------------------------------------- router GEMM
def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Replacement for ``GateLinear.forward`` (FP32-output gate): ``zerodiff.ops.router_gemm`` on bf16
    ``x [..., H]`` and the bf16 gate weight ``[E, H]``, the same kernel at every token count."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff router: input ({x.dtype}) and gate weight ({weight.dtype}) must be bfloat16 "
                          "in consistency mode (FP32 gate weights are not supported)")
    lead = x.shape[:-1]
    out = _op("router_logits")(x.reshape(-1, x.shape[-1]), weight)
    return out.view(*lead, weight.shape[0])


# --------------------------------------------------------------------------------------------- RMSNorm
_ONES: dict = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None):
    """Replacement for ``RMSNorm.forward_cuda``: ``zerodiff.ops.rmsnorm.rms_norm`` (fixed reduction order).
    With ``residual``: returns ``(y, new_residual)``, ``new_residual = bf16(x + residual)`` in FP32, as vLLM's
    fused add. ``weight`` None (weightless norm) multiplies by exact ones."""
    if x.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff RMSNorm: input must be bfloat16 in consistency mode, got {x.dtype}")
    H = x.shape[-1]
    if weight is None:
        key = (H, x.device)
        if key not in _ONES:
            _ONES[key] = torch.ones(H, dtype=torch.float32, device=x.device)
        weight = _ONES[key]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if residual is None:
        return _op("rms_norm")(x2, weight, float(eps)).view(x.shape)
    r2 = residual.reshape(-1, H)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    y, r = _op("rms_norm_residual")(x2, r2, weight, float(eps))
    return y.view(x.shape), r.view(x.shape)


# ----------------------------------------------------------------------------------- mHC (DeepSeek-V4)
def _mhc_inputs(residual: torch.Tensor, what: str) -> torch.Tensor:
    if residual.dtype != torch.bfloat16 or residual.dim() < 3:
        raise ConfigError(f"zerodiff mHC ({what}): residual must be bfloat16 [..., hc_mult, hidden], got "
                          f"{residual.dtype} {tuple(residual.shape)}")
    n, H = residual.shape[-2:]
    return residual.reshape(-1, n, H).contiguous()


def mhc_pre(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
            rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
            sinkhorn_repeat: int, n_splits: int = 1, norm_weight: torch.Tensor | None = None,
            norm_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replacement for vLLM's ``mhc_pre_tilelang``: ``zerodiff.ops.mhc.mhc_pre`` (projection split fixed by the
    model shape, never by T; the kernel the training side runs), then, with ``norm_weight``, the layer input
    through :func:`rms_norm` (one more rounding than TileLang's fused norm; the training side composes the same
    two ops). ``n_splits`` is accepted and ignored (the split is zerodiff's). Returns ``(post [..., n, 1],
    comb [..., n, n], layer_input [..., H])`` like upstream."""
    outer = residual.shape[:-2]
    r = _mhc_inputs(residual, "pre")
    n, H = r.shape[1:]
    li, post, comb = _op("mhc_pre")(r, fn, hc_scale, hc_base, float(rms_eps), float(hc_pre_eps),
                                    float(hc_sinkhorn_eps), float(hc_post_mult_value), int(sinkhorn_repeat))
    if norm_weight is not None:
        li = rms_norm(li, norm_weight, norm_eps)
    return post.view(*outer, n, 1), comb.view(*outer, n, n), li.view(*outer, H)


def mhc_pre_broadcast(x: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                      rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
                      sinkhorn_repeat: int, n_splits: int = 1, norm_weight: torch.Tensor | None = None,
                      norm_eps: float = 1e-6, fn_broadcast: torch.Tensor | None = None):
    """Replacement for ``mhc_pre_broadcast_tilelang`` (first layer: the residual is ``x [T, H]`` copied into
    every stream). The copies are made exactly and :func:`mhc_pre` runs on them with the full ``fn``;
    ``fn_broadcast`` (upstream's pre-summed weight, a different sum order) is not used. Returns
    ``(residual [T, n, H], post, comb, layer_input)``."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ConfigError(f"zerodiff mHC (broadcast pre): x must be bfloat16 [T, hidden], got {x.dtype} "
                          f"{tuple(x.shape)}")
    n = fn.shape[1] // x.shape[1]
    residual = x.unsqueeze(1).expand(x.shape[0], n, x.shape[1]).contiguous()
    post, comb, li = mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                             hc_post_mult_value, sinkhorn_repeat, norm_weight=norm_weight, norm_eps=norm_eps)
    return residual, post, comb, li


def mhc_post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
             comb_res_mix: torch.Tensor) -> torch.Tensor:
    """Replacement for ``mhc_post_tilelang``: ``zerodiff.ops.mhc.mhc_post`` (FP32, post term first, streams in
    order, one rounding). ``post_layer_mix`` [..., n, 1] or [..., n]; ``comb_res_mix`` [..., n, n]."""
    r = _mhc_inputs(residual, "post")
    T, n, H = r.shape
    out = _op("mhc_post")(x.reshape(T, H).contiguous(), r, post_layer_mix.reshape(T, n).contiguous(),
                          comb_res_mix.reshape(T, n, n).contiguous())
    return out.view(residual.shape)


def mhc_fused_post_pre(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                       comb_res_mix: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                       rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
                       sinkhorn_repeat: int, n_splits: int = 1, tile_n: int = 1,
                       norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6):
    """Replacement for ``mhc_fused_post_pre_tilelang``: :func:`mhc_post` then :func:`mhc_pre` on its result
    (two kernels, the composition the training side runs; no batch-size-chosen fused kernel). Returns
    ``(residual, post, comb, layer_input)``."""
    new_residual = mhc_post(x, residual, post_layer_mix, comb_res_mix)
    post, comb, li = mhc_pre(new_residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                             hc_post_mult_value, sinkhorn_repeat, norm_weight=norm_weight, norm_eps=norm_eps)
    return new_residual, post, comb, li


def hc_head(hs_flat: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
            rms_eps: float, hc_eps: float) -> torch.Tensor:
    """Replacement for ``hc_head_fused_kernel_tilelang``: ``zerodiff.ops.mhc.hc_head`` on ``[T, n, H]``."""
    r = _mhc_inputs(hs_flat, "hc_head")
    return _op("hc_head")(r, fn, hc_scale.reshape(1), hc_base, float(rms_eps), float(hc_eps))


# ------------------------------------------------------------------------------------ sampled log-probs
def keep_raw_logits(logits: torch.Tensor) -> torch.Tensor:
    """A copy of the raw logits taken before the sampler mutates them (temperature is applied in place)."""
    return logits.detach().clone()


def sampled_token_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """FP32 ``log_softmax(raw_logits)[t, sampled[t]]`` from ``zerodiff.ops.logprobs.token_logprobs`` (one
    program per row, fixed chunked order): the value the training side's ``-loss`` reproduces bit for bit."""
    from ..ops.logprobs import token_logprobs

    return token_logprobs(raw_logits, sampled.reshape(-1).long())


def fix_sampled_logprobs(logprobs_tensors, raw_logits: torch.Tensor, sampled: torch.Tensor, num_logprobs):
    """Overwrite the sampled token's log-prob in vLLM's ``LogprobsTensors`` with the zerodiff value:
    column 0 of the gathered layout (``num_logprobs >= 0``), or the sampled column of the full
    ``[T, V]`` tensor (``num_logprobs == -1``). Top-k alternatives and ranks keep the stock values (not part
    of the contract). Returns the same object."""
    if logprobs_tensors is None or num_logprobs is None:
        return logprobs_tensors
    lp = sampled_token_logprobs(raw_logits, sampled)
    t = logprobs_tensors.logprobs
    if num_logprobs == -1:
        t.scatter_(1, sampled.reshape(-1, 1).long(), lp.view(-1, 1))
    else:
        t[:, 0] = lp
    return logprobs_tensors


# ------------------------------------------------------------------------------------- block-FP8 linear
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, *, ue8m0: bool = False) -> torch.Tensor:
    """Replacement for ``Fp8LinearMethod.apply`` (block-quantised weights): ``zerodiff.ops.fp8_gemm.fp8_linear``
    (1x128 activation quant by the deployment rule, then one accumulation order for every M; no FlashInfer
    ``M < 32`` branch). ``weight`` e4m3 ``[N, K]``, ``weight_scale`` fp32 ``[ceil(N/128), ceil(K/128)]`` (the
    checkpoint's ``weight_scale_inv``); ``ue8m0`` = whether activation scales are powers of two (vLLM's
    ``is_deep_gemm_e8m0_used()``; the training side must build its ``Fp8Weight`` with the same flag).
    Layouts a kernel's weight post-processing produced (transposed, packed UE8M0, padded) are refused."""
    if bias is not None:
        raise ConfigError("zerodiff FP8 linear: a bias is not supported in consistency mode")
    if x.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff FP8 linear: input must be bfloat16, got {x.dtype}")
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous():
        raise ConfigError(f"zerodiff FP8 linear: weight must be a contiguous float8_e4m3fn [N, K], got "
                          f"{weight.dtype} {tuple(weight.shape)} (post-processed by another kernel?)")
    N, K = weight.shape
    want = ((N + 127) // 128, (K + 127) // 128)
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != want:
        raise ConfigError(f"zerodiff FP8 linear: weight scale must be fp32 {want} (128x128 blocks), got "
                          f"{weight_scale.dtype} {tuple(weight_scale.shape)} (packed/transformed layout?)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _op("fp8_block_linear")(x2, weight, weight_scale.contiguous(), bool(ue8m0))
    return out.view(*lead, N)


# ------------------------------------------------------------------------------------ expert routing
_VLLM_SCORING = {"softmax": "softmax", "sigmoid": "sigmoid", "sqrtsoftplus": "sqrtsoftplus"}


def expert_routing(router_logits: torch.Tensor, top_k: int, *, scoring_func: str, bias=None,
                   renormalize: bool = True, routed_scaling_factor: float = 1.0,
                   indices_type: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Replacement for ``FusedTopKBiasRouter._compute_routing`` (no hash table, no vision bias):
    ``zerodiff.ops.moe.route`` on the FP32 router logits -> (weights fp32 [T, k], ids [T, k]) in the slot
    order the training side uses (expert id descending). ``bias`` is the e-score correction bias (a
    tensor or parameter, FP32 [E]); ``indices_type`` the dtype vLLM asks for the ids (int32 default)."""
    from ..ops.moe import route

    if scoring_func not in _VLLM_SCORING:
        raise ConfigError(f"zerodiff expert routing: scoring_func={scoring_func!r} is not supported "
                          f"(use one of {tuple(_VLLM_SCORING)})")
    if router_logits.dtype != torch.float32:
        raise ConfigError(f"zerodiff expert routing: router logits must be fp32 (GateLinear out_dtype=fp32), "
                          f"got {router_logits.dtype}")
    b = None
    if bias is not None:
        b = getattr(bias, "data", bias)
        if b.dtype != torch.float32:
            raise ConfigError(f"zerodiff expert routing: e_score_correction_bias must be fp32, got {b.dtype}")
    w, ids = route(router_logits.contiguous(), int(top_k), scoring=_VLLM_SCORING[scoring_func], bias=b,
                   renormalize=bool(renormalize) and top_k > 1,
                   routed_scale=float(routed_scaling_factor or 1.0))
    return w, ids.to(indices_type or torch.int32)


# ------------------------------------------------------------------------------------- SwiGLU activation
def silu_mul(x: torch.Tensor, clamp_limit: float | None = None, *, alpha: float = 1.0,
             beta: float = 0.0) -> torch.Tensor:
    """Replacement for ``SiluAndMul`` / ``SiluAndMulWithClamp`` (dense MLPs, shared experts):
    ``zerodiff.ops.silu_mul_quant.silu_mul`` (SiLU and the product in FP32, ONE rounding to BF16; the clamp
    as vLLM applies it), the value the training side's SwiGLU computes. Only ``alpha=1, beta=0``."""
    if float(alpha) != 1.0 or float(beta) != 0.0:
        raise ConfigError(f"zerodiff SwiGLU: alpha={alpha} / beta={beta} is not supported in consistency mode")
    if x.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff SwiGLU: input must be bfloat16 in consistency mode, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _op("silu_mul")(x2, None if clamp_limit is None else float(clamp_limit))
    return out.view(*lead, out.shape[-1])


# ------------------------------------------------------------- DeepSeek-V4 decode through the prefill path
# Byte layout of one token of the DeepSeek-V4 FP8 K cache (``fp8_ds_mla``), as vLLM's writer and its
# ``dequantize_and_gather_k_cache`` read it: per paged block, ``block_size`` token records of 576 bytes
# (448 e4m3 codes, then 64 bf16 rope values) followed by ``block_size`` scale records of 8 bytes (7 UE8M0
# exponents, one per 64 codes, plus one pad byte); consecutive blocks are ``k_cache.stride(0)`` bytes apart.
DSV4_FP8_DIM = 448
DSV4_ROPE_DIM = 64
DSV4_TOKEN_BYTES = DSV4_FP8_DIM + 2 * DSV4_ROPE_DIM  # 576
DSV4_SCALE_BYTES = 8
DSV4_QBLOCK = 64
DSV4_HEAD_DIM = DSV4_FP8_DIM + DSV4_ROPE_DIM  # 512 = the workspace row width (q.shape[-1])
#: FlashMLA's sparse prefill kernel wants the index-list width to be a multiple of this (vLLM pads to it)
DSV4_TOPK_ALIGN = 128

__all__ += ["DSV4_HEAD_DIM", "dsv4_workspace_width", "dsv4_dequant_rows", "dsv4_decode_entries",
            "dsv4_decode_workspace", "dsv4_decode_attention"]


def dsv4_workspace_width(top_k: int, window_size: int, max_image_tokens: int = 0) -> int:
    """Index-list width of one query row in vLLM's DeepSeek-V4 prefill path:
    ``round_up(top_k + window_size + max_image_tokens, 128)`` (``combine_topk_swa_indices``)."""
    w = int(top_k) + int(window_size) + int(max_image_tokens)
    return (w + DSV4_TOPK_ALIGN - 1) // DSV4_TOPK_ALIGN * DSV4_TOPK_ALIGN


def _block_bytes(k_cache: torch.Tensor, block_size: int, what: str) -> torch.Tensor:
    """``k_cache`` seen as ``[num_blocks, block_size * 584]`` bytes (same storage, no copy)."""
    if k_cache.dtype != torch.uint8:
        raise ConfigError(f"zerodiff DSV4 decode: {what} must be the uint8 fp8_ds_mla cache, got {k_cache.dtype}")
    if k_cache.dim() < 2 or k_cache.stride(-1) != 1:
        raise ConfigError(f"zerodiff DSV4 decode: {what} must be [num_blocks, ...] with unit last stride, "
                          f"got shape {tuple(k_cache.shape)} strides {k_cache.stride()}")
    used = int(block_size) * (DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES)
    if k_cache.dim() == 3 and k_cache.shape[2] != DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES:
        raise ConfigError(f"zerodiff DSV4 decode: {what} has {k_cache.shape[2]} bytes per token; only the fp8_ds_mla "
                          f"layout ({DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES}: 448 e4m3 + 64 bf16 + 8 scale bytes) is "
                          "supported")
    if k_cache.dim() == 3 and (k_cache.shape[1] != block_size or k_cache.stride(1) != k_cache.shape[2]):
        raise ConfigError(f"zerodiff DSV4 decode: {what} shape {tuple(k_cache.shape)} / strides "
                          f"{k_cache.stride()} do not hold {block_size} tokens of {DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES} "
                          "bytes per block contiguously")
    if k_cache.stride(0) < used:
        raise ConfigError(f"zerodiff DSV4 decode: {what} block stride {k_cache.stride(0)} < {used} bytes "
                          f"({block_size} tokens x {DSV4_TOKEN_BYTES + DSV4_SCALE_BYTES})")
    return torch.as_strided(k_cache, (k_cache.shape[0], used), (k_cache.stride(0), 1), k_cache.storage_offset())


def dsv4_dequant_rows(k_cache: torch.Tensor, block_size: int, block_ids: torch.Tensor,
                      in_block: torch.Tensor) -> torch.Tensor:
    """Dequantise the cache tokens at (``block_ids``, ``in_block``) (int64, any equal shapes ``S``) into bf16
    ``[*S, 512]``: ``bf16(float32(e4m3 code) * 2**(ue8m0 - 127))`` for the 448 quantised dims (one scale
    per 64), the 64 bf16 rope values copied. The product is a power-of-two scaling of an e4m3 value, so it
    is exact in FP32 and the one RNE rounding to bf16 gives the bits ``dequantize_and_gather_k_cache``
    writes (its Triton and CuTe-DSL variants compute the same product). The scale is built from its
    exponent bits (code 0 reads as 0, never a denormal)."""
    flat = _block_bytes(k_cache, block_size, "k_cache")
    shape = tuple(block_ids.shape)
    b = block_ids.reshape(-1, 1).long()
    o = in_block.reshape(-1, 1).long()
    dev = k_cache.device
    tok = flat[b, o * DSV4_TOKEN_BYTES + torch.arange(DSV4_TOKEN_BYTES, device=dev)]
    nq = DSV4_FP8_DIM // DSV4_QBLOCK
    sc = flat[b, block_size * DSV4_TOKEN_BYTES + o * DSV4_SCALE_BYTES + torch.arange(nq, device=dev)]
    scale = (sc.to(torch.int32) << 23).view(torch.float32)  # 2**(code - 127); code 0 -> +0
    codes = tok[:, :DSV4_FP8_DIM].contiguous().view(torch.float8_e4m3fn).float()
    nope = (codes.view(-1, nq, DSV4_QBLOCK) * scale.unsqueeze(-1)).view(-1, DSV4_FP8_DIM).to(torch.bfloat16)
    rope = tok[:, DSV4_FP8_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=-1).view(*shape, DSV4_HEAD_DIM)


def dsv4_decode_entries(positions: torch.Tensor, token_to_req: torch.Tensor, is_valid: torch.Tensor, *,
                        compress_ratio: int, top_k: int, window_size: int, width: int,
                        topk_local: torch.Tensor | None, compressed_block_table: torch.Tensor | None,
                        compressed_block_size: int, swa_block_table: torch.Tensor, swa_block_size: int):
    """Index bookkeeping of :func:`dsv4_decode_attention`: for each decode token ``t`` (absolute position
    ``positions[t]``, request row ``token_to_req[t]`` of the decode block tables) the list of cache
    entries vLLM's PREFILL path would show ``flash_mla_sparse_fwd`` for that token, in that order:

    1. ``topk_len = min((pos + 1) // compress_ratio, top_k)`` compressed entries (0 for SWA-only layers,
       ``compress_ratio <= 1``): C4A (``topk_local`` given, the indexer's request-local positions) its first
       ``topk_len`` entries in the given order; C128A (``topk_local=None``) positions ``0 .. topk_len-1``
       ascending (what vLLM's C128A metadata emits for prefill tokens);
    2. the sliding window ``max(pos - window + 1, 0) .. pos`` ascending (the SWA cache).

    Returns ``(from_swa bool [T, width], block int64 [T, width], in_block int64 [T, width], lens int32 [T])``
    where entries at ``j >= lens[t]`` (and every entry of a padding token, ``is_valid`` false: len 0) point at
    block 0 / slot 0 and are never read. Static shapes, no host sync (CUDA-graph safe)."""
    T = positions.shape[0]
    dev = positions.device
    pos = positions.reshape(T).long().clamp(min=0)
    req = token_to_req.reshape(-1)[:T].long().clamp(min=0, max=swa_block_table.shape[0] - 1)
    j = torch.arange(width, device=dev).view(1, width)
    if compress_ratio > 1:
        topk_len = torch.clamp((pos + 1) // int(compress_ratio), max=int(top_k))
    else:
        topk_len = torch.zeros_like(pos)
    swa_start = torch.clamp(pos - (int(window_size) - 1), min=0)
    swa_len = pos - swa_start + 1
    lens = torch.where(is_valid.reshape(-1)[:T].bool(), topk_len + swa_len, torch.zeros_like(pos))
    in_list = j < lens.view(T, 1)
    from_swa = j >= topk_len.view(T, 1)
    # SWA part: absolute positions, looked up through the SWA block table exactly as the prefill gather does
    spos = (swa_start.view(T, 1) + j - topk_len.view(T, 1)).clamp(min=0)
    s_rows = swa_block_table[req].long()
    s_blk = s_rows.gather(1, (spos // swa_block_size).clamp(max=s_rows.shape[1] - 1))
    s_off = spos % swa_block_size
    if compress_ratio > 1:
        if compressed_block_table is None:
            raise ConfigError("zerodiff DSV4 decode: compress_ratio > 1 needs the compressed block table")
        if topk_local is not None:
            tl_ = topk_local.reshape(T, -1)
            if tl_.shape[1] < top_k:
                raise ConfigError(f"zerodiff DSV4 decode: top-k buffer width {tl_.shape[1]} < top_k={top_k}")
            cpos = torch.zeros(T, width, dtype=torch.long, device=dev)
            kk = min(int(top_k), width)
            cpos[:, :kk] = tl_[:, :kk].long()
        else:
            cpos = j.expand(T, width).long()
        cpos = cpos.clamp(min=0)
        c_rows = compressed_block_table[req].long()
        c_blk = c_rows.gather(1, (cpos // compressed_block_size).clamp(max=c_rows.shape[1] - 1))
        c_off = cpos % compressed_block_size
        blk = torch.where(from_swa, s_blk, c_blk)
        off = torch.where(from_swa, s_off, c_off)
    else:
        blk, off = s_blk, s_off
    blk = torch.where(in_list, blk, torch.zeros_like(blk)).clamp(min=0)
    off = torch.where(in_list, off, torch.zeros_like(off))
    return from_swa, blk, off, lens.to(torch.int32)


def dsv4_decode_workspace(entries, swa_k_cache: torch.Tensor, swa_block_size: int,
                          compressed_k_cache: torch.Tensor | None, compressed_block_size: int, *,
                          top_k: int | None = None, window_size: int | None = None):
    """BF16 workspace ``[T, width, 512]`` and FlashMLA indices ``[T, 1, width]`` (row ``t * width + j`` for
    ``j < lens[t]``, ``-1`` after, as vLLM pads) for the entries of :func:`dsv4_decode_entries`. Rows past
    a token's length are zero. With ``top_k`` / ``window_size`` (the values the entries were built with) each
    cache is dequantised only where its entries can be (compressed: the first ``top_k`` columns; SWA: the
    ``window_size`` entries after the token's top-k), then scattered into place: the same rows, less work."""
    from_swa, blk, off, lens = entries
    T, W = blk.shape
    dev = blk.device
    j = torch.arange(W, device=dev).view(1, W)
    lens_l = lens.view(T, 1).long()
    rows = torch.arange(T, device=dev).view(T, 1) * W + j
    idx = torch.where(j < lens_l, rows, torch.full_like(rows, -1)).to(torch.int32)
    if top_k is None or window_size is None:  # plain form: dequantise every column from both caches
        zero = torch.zeros_like(blk)
        if compressed_k_cache is None:
            kv = dsv4_dequant_rows(swa_k_cache, swa_block_size, blk, off)
        else:  # each cache is read only at its own entries (the others read its slot 0 and are discarded)
            kv = dsv4_dequant_rows(swa_k_cache, swa_block_size, torch.where(from_swa, blk, zero),
                                   torch.where(from_swa, off, zero))
            kc = dsv4_dequant_rows(compressed_k_cache, compressed_block_size, torch.where(from_swa, zero, blk),
                                   torch.where(from_swa, zero, off))
            kv = torch.where(from_swa.unsqueeze(-1), kv, kc)
        live = j < lens_l
        kv = torch.where(live.unsqueeze(-1), kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
        return kv, idx.view(T, 1, W)
    ws = torch.zeros(T * W + 1, DSV4_HEAD_DIM, dtype=torch.bfloat16, device=dev)  # last row: dump
    dump = T * W
    topk_len = (~from_swa).sum(dim=1, keepdim=True)  # from_swa is (column >= topk_len)
    kc_cols = min(int(top_k), W)
    if compressed_k_cache is not None and kc_cols > 0:
        jc = j[:, :kc_cols]
        live_c = (jc < topk_len) & (jc < lens_l)
        vals = dsv4_dequant_rows(compressed_k_cache, compressed_block_size,
                                 torch.where(live_c, blk[:, :kc_cols], 0), torch.where(live_c, off[:, :kc_cols], 0))
        ws[torch.where(live_c, rows[:, :kc_cols], dump).reshape(-1)] = vals.reshape(-1, DSV4_HEAD_DIM)
    ws_cols = min(int(window_size), W)
    col = topk_len + torch.arange(ws_cols, device=dev).view(1, ws_cols)
    live_s = col < lens_l
    colc = col.clamp(max=W - 1)
    vals = dsv4_dequant_rows(swa_k_cache, swa_block_size, torch.where(live_s, blk.gather(1, colc), 0),
                             torch.where(live_s, off.gather(1, colc), 0))
    ws[torch.where(live_s, rows.gather(1, colc), dump).reshape(-1)] = vals.reshape(-1, DSV4_HEAD_DIM)
    return ws[:dump].view(T, W, DSV4_HEAD_DIM), idx.view(T, 1, W)


def dsv4_decode_attention(layer: Any, q: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor | None,
                          swa_metadata: Any, attn_metadata: Any, swa_only: bool, output: torch.Tensor,
                          sparse_fwd) -> None:
    """Consistency-mode body of ``DeepseekV4FlashMLAAttention._forward_decode`` (vLLM 0.33.0): every decode
    token reads its KV through the read path of ``_forward_prefill``: the entries the prefill path would
    give that token (:func:`dsv4_decode_entries`: compressed top-k in the indexer's order, then the SWA
    window ascending), dequantised with the prefill gather's arithmetic into a BF16 workspace
    (:func:`dsv4_decode_workspace`), padded with ``-1`` to the prefill width
    ``round_up(top_k + window + max_image_tokens, 128)``, then ``sparse_fwd`` (FlashMLA's
    ``flash_mla_sparse_fwd``, passed in by the patch) with the layer's scale and sink. The FP8 decode kernel
    ``flash_mla_with_kvcache`` (batch-dependent, DESIGN "Decode read path") is never called.

    ``top_k``: C4A the indexer buffer width (``layer.topk_indices_buffer.shape[-1]``, the prefill's
    ``top_k``); C128A the model-limit width ``round_up(ceil(max_model_len / 128), 128)`` (the prefill uses
    the batch's active width; both cover every valid entry, the kernel stops at ``topk_length``; that the
    padded width does not change a row's bits is checked by the GPU test, not assumed silently)."""
    T = int(swa_metadata.num_decode_tokens)
    num_decodes = int(swa_metadata.num_decodes)
    cr = int(layer.compress_ratio)
    # decode tokens are generated text: no in-image widening of their window (left = right = 0); the width
    # still reserves max_image_tokens, as the prefill path's does
    topk_local = None
    ccache = None
    cbt = None
    cbs = 1
    if swa_only or cr <= 1:
        top_k = 0
    else:
        if attn_metadata is None:
            raise ConfigError("zerodiff DSV4 decode: a compressed layer got no FlashMLA metadata")
        cbs = int(attn_metadata.block_size) // cr
        if cbs < 1:
            raise ConfigError(f"zerodiff DSV4 decode: block_size={attn_metadata.block_size} < compress_ratio={cr}")
        cbt = attn_metadata.block_table[:num_decodes]
        ccache = kv_cache
        if cr == 4:
            topk_local = layer.topk_indices_buffer[:T]
            top_k = int(topk_local.shape[-1])
        elif cr == 128:
            n = -(-int(layer.max_model_len) // cr)
            top_k = -(-n // DSV4_TOPK_ALIGN) * DSV4_TOPK_ALIGN
        else:
            raise ConfigError(f"zerodiff DSV4 decode: compress_ratio={cr} (expected 1, 4 or 128)")
    width = dsv4_workspace_width(top_k, layer.window_size, getattr(layer, "max_image_tokens", 0))
    swa_cache = layer.swa_cache_layer.kv_cache
    entries = dsv4_decode_entries(
        positions[:T], swa_metadata.token_to_req_indices, swa_metadata.is_valid_token[:T],
        compress_ratio=cr if not swa_only else 1, top_k=top_k, window_size=int(layer.window_size), width=width,
        topk_local=topk_local, compressed_block_table=cbt, compressed_block_size=cbs,
        swa_block_table=swa_metadata.block_table[:num_decodes], swa_block_size=int(swa_metadata.block_size))
    kv, idx = dsv4_decode_workspace(entries, swa_cache, int(swa_metadata.block_size), ccache, cbs, top_k=top_k,
                                    window_size=int(layer.window_size))
    sparse_fwd(q=q, kv=kv.view(-1, 1, kv.shape[-1]), indices=idx, sm_scale=layer.scale,
               attn_sink=layer.attn_sink, topk_length=entries[3], out=output)


def dsv4_fixed_schedule_attention(q: torch.Tensor, positions: torch.Tensor, token_to_req: torch.Tensor,
                                  is_valid: torch.Tensor, *, compress_ratio: int, top_k: int, window_size: int,
                                  topk_local: torch.Tensor | None, compressed_k_cache: torch.Tensor | None,
                                  compressed_block_table: torch.Tensor | None, compressed_block_size: int,
                                  swa_k_cache: torch.Tensor, swa_block_table: torch.Tensor, swa_block_size: int,
                                  sm_scale: float, attn_sink: torch.Tensor | None = None,
                                  out: torch.Tensor | None = None):
    """DeepSeek-V4 attention for any set of tokens (prefill chunk, decode batch, training micro-batch) through
    ``flashmla_fp8_attention`` (FlashMLA's FP8 decode kernel under zerodiff's batch-independent schedule, one
    piece per row, DeepSeek-V4 cache layout read in place):

    * main list: the compressed entries of the token (C4A: the first ``min((pos + 1) // ratio, top_k)`` entries
      of the indexer's ``topk_local`` in its order; C128A: positions ``0 .. n-1``), as global slots of
      ``compressed_k_cache`` through ``compressed_block_table``, cut by ``topk_length``; width ``round_up(top_k,
      64)``. SWA-only layers (``compress_ratio <= 1``): the window is the main list and there is no extra list;
    * extra list: the sliding window ``max(pos - window + 1, 0) .. pos`` ascending, global slots of
      ``swa_k_cache`` through ``swa_block_table``, cut by ``extra_topk_length``; width ``round_up(window, 64)``.

    The lists are built with :func:`dsv4_decode_entries` (the order the prefill path uses), so a token's
    inputs never depend on which phase or batch it is in, and the kernel's schedule keeps each row whole:
    its output is the same bits in any batch. ``q`` bf16 [T, H (64 or 128), 512]; ``token_to_req`` int [T]
    (rows of the block tables); ``is_valid`` bool [T] (padding tokens: empty row, output 0). Returns
    ``(out bf16 [T, H, 512], lse fp32 [T, H])``. Written for vLLM 0.33.0's DeepSeek-V4 metadata; CPU-tested
    against an emulation of the kernel's contract, **not yet run on a GPU**."""
    from ..ops import flashmla_fp8_decode as fd

    T = q.shape[0]
    cr = int(compress_ratio) if compressed_k_cache is not None else 1
    tk = int(top_k) if cr > 1 else 0
    win = int(window_size)
    width = max(tk + win, 1)
    from_swa, blk, off, lens = dsv4_decode_entries(
        positions, token_to_req, is_valid, compress_ratio=cr, top_k=tk, window_size=win, width=width,
        topk_local=topk_local, compressed_block_table=compressed_block_table,
        compressed_block_size=int(compressed_block_size), swa_block_table=swa_block_table,
        swa_block_size=int(swa_block_size))
    dev = q.device
    lens = lens.long()
    pos = positions.reshape(T).long().clamp(min=0)
    valid = is_valid.reshape(-1)[:T].bool()
    n_c = torch.clamp((pos + 1) // cr, max=tk) if cr > 1 else torch.zeros_like(pos)
    n_c = torch.where(valid, n_c, torch.zeros_like(n_c))
    n_s = lens - n_c  # window entries actually in the list
    swa_slot = blk * int(swa_block_size) + off
    c_slot = blk * int(compressed_block_size) + off

    def gather_list(slots, start, count, w):
        jj = torch.arange(w, device=dev).view(1, w)
        src = (start.view(T, 1) + jj).clamp(max=width - 1)
        vals = slots.gather(1, src)
        return torch.where(jj < count.view(T, 1), vals, torch.full_like(vals, -1)).to(torch.int32)

    w_win = -(-win // fd.TOPK_BLOCK) * fd.TOPK_BLOCK
    if cr > 1:
        w_main = max(-(-tk // fd.TOPK_BLOCK) * fd.TOPK_BLOCK, fd.TOPK_BLOCK)
        main = gather_list(c_slot, torch.zeros_like(n_c), n_c, w_main)
        extra = gather_list(swa_slot, n_c, n_s, w_win)
        return fd.flashmla_fp8_attention(q, compressed_k_cache, main, sm_scale, attn_sink=attn_sink, out=out,
                                         pieces_per_row=1, topk_length=n_c.to(torch.int32),
                                         extra_kv_cache=swa_k_cache, extra_indices=extra,
                                         extra_topk_length=n_s.to(torch.int32))
    main = gather_list(swa_slot, torch.zeros_like(n_s), n_s, w_win)
    return fd.flashmla_fp8_attention(q, swa_k_cache, main, sm_scale, attn_sink=attn_sink, out=out, pieces_per_row=1,
                                     topk_length=n_s.to(torch.int32))


DSV4_READ_ENV = "ZERODIFF_DSV4_READ"
DSV4_READ_ROUTES = ("prefill_path", "fixed_schedule")


def dsv4_read_route(environ=None) -> str:
    """The DeepSeek-V4 attention read route in consistency mode: ``ZERODIFF_DSV4_READ`` = "prefill_path"
    (default; decode tokens through the prefill path's workspace + ``flash_mla_sparse_fwd``) or "fixed_schedule"
    (every token, prefill and decode, through :func:`dsv4_forward_fixed_schedule`; faster, its GPU run inside vLLM
    is pending). Anything else is refused with a message naming the variable."""
    env = os.environ if environ is None else environ
    v = env.get(DSV4_READ_ENV, "prefill_path").strip() or "prefill_path"
    if v not in DSV4_READ_ROUTES:
        raise ConfigError(f"zerodiff: {DSV4_READ_ENV}={v!r} is not one of {list(DSV4_READ_ROUTES)}")
    return v


def dsv4_forward_fixed_schedule(layer: Any, q: torch.Tensor, positions: torch.Tensor, output: torch.Tensor,
                                swa_metadata: Any, attn_metadata: Any) -> None:
    """Consistency-mode body of ``DeepseekV4FlashMLAAttention.forward_mqa`` (vLLM 0.33.0) in the "fixed_schedule"
    route: all tokens of the step (decode tokens first, then prefill tokens, as vLLM orders them) in one
    :func:`dsv4_fixed_schedule_attention` call; a token's request row comes from ``query_start_loc``, so the
    decode and prefill rows of the block tables are addressed alike and a token's lists never depend on its
    phase. Padding tokens (``is_valid_token`` false, or past the last request) give 0. Refused: multimodal
    in-image windows (``prefill_left_visible`` / ``prefill_right_visible``), compress ratios other than 1, 4, 128.
    Writes ``output`` [T, heads, 512] in place."""
    if getattr(swa_metadata, "prefill_left_visible", None) is not None or \
            getattr(swa_metadata, "prefill_right_visible", None) is not None:
        raise ConfigError("zerodiff DSV4 fixed_schedule route: in-image (bidirectional) windows are not supported; "
                          f"unset {DSV4_READ_ENV} (the prefill_path route) for multimodal inputs")
    T = q.shape[0]
    dev = q.device
    num_reqs = int(swa_metadata.num_decodes) + int(swa_metadata.num_prefills)
    qsl = swa_metadata.query_start_loc[: num_reqs + 1].to(device=dev, dtype=torch.long)
    tok = torch.arange(T, device=dev, dtype=torch.long)
    token_to_req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True).clamp(max=max(num_reqs - 1, 0))
    in_batch = tok < qsl[num_reqs]
    valid_src = getattr(swa_metadata, "is_valid_token", None)
    if valid_src is not None:
        v = valid_src.reshape(-1)[:T].to(device=dev, dtype=torch.bool)
        if v.shape[0] < T:
            v = torch.cat([v, torch.zeros(T - v.shape[0], dtype=torch.bool, device=dev)])
        in_batch = in_batch & v
    cr = int(layer.compress_ratio)
    kw = dict(compress_ratio=1, top_k=0, topk_local=None, compressed_k_cache=None, compressed_block_table=None,
              compressed_block_size=1)
    if cr > 1:
        if attn_metadata is None:
            raise ConfigError("zerodiff DSV4 fixed_schedule route: a compressed layer got no FlashMLA metadata")
        cbs = int(attn_metadata.block_size) // cr
        if cbs < 1:
            raise ConfigError(f"zerodiff DSV4: block_size={attn_metadata.block_size} < compress_ratio={cr}")
        if cr == 4:
            topk_local = layer.topk_indices_buffer[:T]
            top_k = int(topk_local.shape[-1])
        elif cr == 128:
            topk_local = None
            n = -(-int(layer.max_model_len) // cr)
            top_k = -(-n // DSV4_TOPK_ALIGN) * DSV4_TOPK_ALIGN
        else:
            raise ConfigError(f"zerodiff DSV4: compress_ratio={cr} (expected 1, 4 or 128)")
        kw = dict(compress_ratio=cr, top_k=top_k, topk_local=topk_local, compressed_k_cache=layer.kv_cache,
                  compressed_block_table=attn_metadata.block_table[:num_reqs], compressed_block_size=cbs)
    out = output if output.is_contiguous() else None
    res, _lse = dsv4_fixed_schedule_attention(
        q, positions[:T], token_to_req, in_batch, window_size=int(layer.window_size),
        swa_k_cache=layer.swa_cache_layer.kv_cache, swa_block_table=swa_metadata.block_table[:num_reqs],
        swa_block_size=int(swa_metadata.block_size), sm_scale=float(layer.scale),
        attn_sink=getattr(layer, "attn_sink", None), out=out, **kw)
    if out is None:
        output.copy_(res)


def dsv32_sparse_fp8_attention(impl: Any, q: torch.Tensor, kv_cache: torch.Tensor, topk_indices: torch.Tensor,
                               attn_metadata: Any, kv_pages_fn, convert_fn):
    """Consistency-mode body of ``FlashMLASparseImpl.forward_mqa`` (vLLM 0.33.0,
    ``vllm/v1/attention/backends/mla/flashmla_sparse.py``) for the FP8 ``fp8_ds_mla`` cache: all the step's MQA
    tokens (decode and prefill alike) read the cache in place through
    ``zerodiff.ops.flashmla_fp8_decode.flashmla_fp8_attention`` (FlashMLA's FP8 decode kernel under zerodiff's
    batch-independent schedule). The request-local top-k indices become global 64-token-page slots with vLLM's own
    converter (``convert_fn`` = ``triton_convert_req_index_to_global_index``, integer arithmetic) over the page
    view ``kv_pages_fn`` (= ``_fp8_kv_pages``) gives; q is zero-padded to 64 / 128 heads as vLLM's FP8 kernel
    path does. Returns ``(out [T, H, 512], None)`` (the lse only serves decode context parallelism, which
    consistency mode refuses). Refused: more than 128 heads, DCP. CPU-tested against an emulation of the kernel;
    not yet run inside vLLM on a GPU."""
    from ..ops import flashmla_fp8_decode as fd

    if int(getattr(impl, "dcp_world_size", 1)) > 1:
        raise ConfigError("zerodiff DSV3.2 sparse MLA: decode context parallelism is not supported")
    T = int(topk_indices.shape[0])
    qq = q[:T]
    H = int(qq.shape[1])
    if H > 128:
        raise ConfigError(f"zerodiff DSV3.2 sparse MLA: {H} heads (FlashMLA's FP8 kernel takes up to 128)")
    Hp = 64 if H <= 64 else 128
    if H < Hp:
        qp = qq.new_zeros((T, Hp, qq.shape[2]))
        qp[:, :H] = qq
    else:
        qp = qq if qq.is_contiguous() else qq.contiguous()
    bs = int(attn_metadata.block_size)
    kv_pages, stride_rows = kv_pages_fn(kv_cache, bs)
    idx = convert_fn(attn_metadata.req_id_per_token[:T], attn_metadata.block_table, topk_indices, BLOCK_SIZE=bs,
                     BLOCK_STRIDE_ROWS=stride_rows, NUM_TOPK_TOKENS=int(topk_indices.shape[1]))
    if isinstance(idx, tuple):
        idx = idx[0]
    out, _lse = fd.flashmla_fp8_attention(qp, kv_pages.view(torch.uint8), idx.to(torch.int32),
                                          float(impl.softmax_scale))
    return (out if H == Hp else out[:, :H]), None
