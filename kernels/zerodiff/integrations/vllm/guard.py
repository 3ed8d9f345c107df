"""The fail-closed config guard for vLLM 0.33.0 (what the patched ``VllmConfig.__post_init__`` calls)."""

from __future__ import annotations

from typing import Any

from .. import _problems_to_error, enabled
from .dsv4_attention import dsv4_read_route

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


