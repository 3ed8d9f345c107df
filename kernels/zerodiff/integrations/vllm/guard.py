"""The fail-closed config guard for vLLM 0.33.0 (what the patched ``VllmConfig.__post_init__`` calls).

Config guard
------------
``validate_config(**plain_values)`` refuses, with one message naming every bad setting, each configuration
that cannot keep rollout/training log-probs bit-identical (``diff = 0``); ``check_vllm_config(vllm_config)``
reads those values off a ``VllmConfig`` (duck-typed, so CPU tests use fake objects) and is what the patched
``VllmConfig.__post_init__`` calls. Rules and why:

* ``tensor_parallel_size > 1``: TP puts an all-reduce (cross-GPU sum) inside the compared path Refused.
* ``decode_context_parallel_size > 1`` / ``prefill_context_parallel_size > 1``: decode CP merges partial
  attention and top-k results across GPUs; not supported. Refused.
* expert parallel with an ``all2all_backend`` other than ``deepep_low_latency``: the combine must happen on
  the token's owner in FP32 in top-k slot order; ``allgather_reducescatter``
  sums expert outputs across GPUs. Refused.
* ``enable_prefix_caching``: a cached prefix is never recomputed, so the rollout's values would come from an
  earlier batch's prefill, and the check itself is defined with caching off.
* speculative decoding (any ``speculative_config``): the draft/verify split changes which path computes a
  token and uses ``next_n > 1`` rows. Refused.
* ``cudagraph_mode == PIECEWISE``: refused. ``NONE``, ``FULL``, ``FULL_DECODE_ONLY`` and
  ``FULL_AND_PIECEWISE`` are accepted. Reasoning: whether a step runs in a
  graph or eagerly depends on the other requests of the step, so graph and eager must be bit-identical;
  our kernels make that so (no host sync, static bounds, workspaces sized by model limits). PIECEWISE-only
  leaves attention and the indexer outside the graph for *decode* steps as well, the mode in which a mixed-step
  leak has been measured elsewhere; it is also the slowest mode. FULL_AND_PIECEWISE is covered by the
  engine-level acceptance (``zerodiff vllm-check``).
* DeepSeek-V4: ``kv_cache_dtype`` must be explicitly FP8 (``fp8``, ``fp8_e4m3`` or ``fp8_ds_mla``): the
  consistent read path and the training side's private cache are defined on the
  ``fp8_ds_mla`` layout; ``auto`` resolves per attention backend (BF16 on some), so it is refused too.
* DSA indexer cache: ``indexer_kv_dtype`` ``mxfp4`` (the FP4 indexer cache) refused: no zerodiff kernel reads it. ``auto``/``fp8``/``fp8_e4m3`` accepted.
* DeepSeek-V4 MoE: ``moe_backend`` ``triton`` or ``deep_gemm`` (the whole MoE block runs through
  ``zerodiff.ops.moe`` on vLLM's expert weights, which these backends keep in the checkpoint's block-FP8
  layout; ``auto`` may pick a FlashInfer / Cutlass backend that shuffles them). Other MoE models:
  ``deep_gemm`` (only their experts' activation quant is routed).
* MoE models with ``data_parallel_size > 1`` and no expert parallelism: vLLM shards the experts
  tensor-parallel over the DP ranks and all-reduces their outputs. Refused.
* ``quantization`` other than none / ``fp8`` / ``deepseek_v4_fp8`` (block FP8): refused (e.g. ``mxfp4``).
* block-FP8 models: ``linear_backend`` must be ``deep_gemm`` (the FlashInfer ``M < 32`` swap-AB branch is a
  batch-size fork); ``auto`` picks FlashInfer first on CUDA.
* DeepSeek-V4 attention backend: unset (vLLM's choice on SM90) or the FlashMLA sparse backend; the FlashInfer
  DeepSeek-V4 backends would run unpatched. Refused.
* DeepSeek-V4 with indexed (C4A) layers: ``max_model_len // 4 <= index_topk``. Beyond it the DSA indexer
  scores candidates with DeepGEMM kernels that differ between prefill and decode, which the series does not
  route yet; within it every candidate is selected by a static rule (patch 0002). Refused otherwise.
* ``VLLM_USE_FLASHINFER_SAMPLER`` must be ``0``: otherwise vLLM uses FlashInfer's sampler for a step whenever
  every request in it qualifies, so a request's draw depends on the others.

When the configuration passes, :func:`check_vllm_config` logs one line with every resolved value, the
DeepSeek-V4 read route and the FP8 GEMM backend.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .. import ENV, _problems_to_error, enabled
from .dsv4_attention import dsv4_read_route

_log = logging.getLogger("zerodiff")
if not _log.handlers:  # vLLM configures its own loggers only: make the resolved configuration visible
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("%(levelname)s zerodiff: %(message)s"))
    _log.addHandler(_h)
    _log.setLevel(logging.INFO)

ALLOWED_CUDAGRAPH_MODES = ("NONE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_DSV4_ARCHS = ("DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration", "DeepSeekV4MTPModel",
               "DeepseekV41ForCausalLM")
#: block-FP8 quantisation methods (vLLM resolves ``quant_method: fp8`` of DeepSeek-V4 to ``deepseek_v4_fp8``)
_BLOCK_FP8_QUANT = ("fp8", "deepseek_v4_fp8")
#: DeepSeek-V4 attention backends the series routes (None: vLLM's choice on SM90, the FlashMLA sparse class)
_DSV4_ATTENTION_OK = (None, "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4")
#: MoE backends whose expert weights keep the checkpoint layout the zerodiff MoE route reads
_DSV4_MOE_OK = ("triton", "deep_gemm")
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
    data_parallel_size: int = 1,
    attention_backend: str | None = None,
    flashinfer_sampler: str | None = "0",
    max_model_len: int | None = None,
    index_topk: int | None = None,
    indexer_compress_ratio: int | None = None,
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
                 "on the token's owner in FP32 in top-k slot order; use all2all_backend='deepep_low_latency' "
                 "(zerodiff.ops.expert_parallel's owner-side combine is not wired into vLLM's FusedMoE)")
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
    if is_dsv4 and is_moe and str(moe_backend) not in _DSV4_MOE_OK:
        p.append(f"moe_backend={moe_backend!r}: DeepSeek-V4's MoE runs through zerodiff on vLLM's expert weights, "
                 "which must keep the checkpoint's block-FP8 layout; pass --moe-backend triton")
    elif is_moe and not is_dsv4 and str(moe_backend) != "deep_gemm":
        p.append(f"moe_backend={moe_backend!r}: only the DeepGEMM experts have their activation routed "
                 "through zerodiff; pass --moe-backend deep_gemm")
    if is_moe and int(data_parallel_size) > 1 and not enable_expert_parallel:
        p.append(f"data_parallel_size={data_parallel_size} without enable_expert_parallel: vLLM then shards the "
                 "experts tensor-parallel across the DP ranks and all-reduces their outputs; pass "
                 "--enable-expert-parallel or data_parallel_size=1")
    quant = None if quantization is None else str(quantization).lower()
    if quant is not None and quant not in _BLOCK_FP8_QUANT:
        p.append(f"quantization={quantization!r}: only BF16 and block-FP8 ({', '.join(_BLOCK_FP8_QUANT)}, "
                 "128x128 weight blocks) checkpoints are supported in consistency mode (FP4 experts are not)")
    if quant in _BLOCK_FP8_QUANT and str(linear_backend) != "deep_gemm":
        p.append(f"linear_backend={linear_backend!r}: block-FP8 linears must run one M-independent kernel "
                 "(no FlashInfer M<32 branch); pass --linear-backend deep_gemm")
    if is_dsv4 and attention_backend not in _DSV4_ATTENTION_OK:
        p.append(f"attention_backend={attention_backend!r}: only the FlashMLA sparse DeepSeek-V4 backend is routed "
                 "through zerodiff's read path; pass --attention-backend FLASHMLA_SPARSE_DSV4 (or leave it unset)")
    if is_dsv4 and indexer_compress_ratio and index_topk and max_model_len and \
            int(max_model_len) // int(indexer_compress_ratio) > int(index_topk):
        p.append(f"max_model_len={max_model_len}: with more than index_topk={index_topk} compressed entries "
                 f"(max_model_len // {indexer_compress_ratio}) the DSA indexer scores candidates, and its prefill "
                 "and decode logits kernels are not routed through zerodiff yet; use max_model_len <= "
                 f"{int(index_topk) * int(indexer_compress_ratio)} (every candidate is then selected, statically)")
    if flashinfer_sampler != "0":
        p.append(f"VLLM_USE_FLASHINFER_SAMPLER={flashinfer_sampler!r}: vLLM picks FlashInfer's sampler per batch "
                 "(its draw then depends on the other requests); set VLLM_USE_FLASHINFER_SAMPLER=0")
    _problems_to_error("vLLM", p)


def _get(obj: Any, path: str, default=None):
    for name in path.split("."):
        if obj is None:
            return default
        obj = getattr(obj, name, None)
    return default if obj is None else obj


def config_values(vllm_config: Any, environ=None) -> dict:
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
        data_parallel_size=int(_get(pc, "data_parallel_size", 1)),
        attention_backend=_backend_name(_get(vllm_config, "attention_config.backend")),
        flashinfer_sampler=(os.environ if environ is None else environ).get("VLLM_USE_FLASHINFER_SAMPLER"),
        max_model_len=_get(mc, "max_model_len"),
        index_topk=_get(mc, "hf_config.index_topk"),
        indexer_compress_ratio=_indexer_ratio(_get(mc, "hf_config")),
    )


def _indexer_ratio(hf_config) -> int | None:
    """The compress ratio of DeepSeek-V4's indexed (C4A) layers, if the model has any (else None)."""
    rates = getattr(hf_config, "compress_rates", None)
    types = getattr(hf_config, "layer_types", None)
    if not isinstance(rates, dict) or not types:
        return None
    return 4 if any(rates.get(t, 0) == 4 for t in types) else None


def _backend_name(b) -> str | None:
    return None if b is None else str(getattr(b, "name", b)).split(".")[-1]


def check_vllm_config(vllm_config: Any, environ=None) -> bool:
    """The guard the patched ``VllmConfig.__post_init__`` calls: no-op (False) when consistency mode is off,
    else validate (raising :class:`ConfigError`) and return True."""
    if not enabled(environ):
        return False
    if getattr(_get(vllm_config, "model_config"), "is_submodel_config", False):
        return True  # a with_hf_config() view; its parent was validated
    values = config_values(vllm_config, environ)
    validate_config(**values)
    route = dsv4_read_route(environ)  # a bad ZERODIFF_DSV4_READ fails at start, not at the first attention call
    _log.info("zerodiff consistency mode ON (%s=1): DeepSeek-V4 read route %s, FP8 GEMM backend %s; %s", ENV, route,
              (os.environ if environ is None else environ).get("ZERODIFF_FP8_GEMM_BACKEND", "auto"),
              ", ".join(f"{k}={v}" for k, v in values.items()))
    return True


