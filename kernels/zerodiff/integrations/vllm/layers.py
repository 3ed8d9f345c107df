"""Dense-layer adapters: FP32 router logits, RMSNorm, block-FP8 linears and the SwiGLU activation."""

from __future__ import annotations

import torch

from .. import ConfigError
from .custom_ops import _op

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


# ------------------------------------------------------------------------------- BF16 GEMMs and LM head
def bf16_linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T`` through ``zerodiff.ops.bf16_gemm`` (FP32 accumulation, tile and split
    configuration from (N, K) only, so a row's value never depends on the token count), rounded once to
    ``out_dtype`` (bf16 or fp32). The replacement for the unquantised GEMMs vLLM sends to cuBLAS, whose
    algorithm (and split-K) is chosen from M: the DeepSeek-V4 compressor ``torch.mm(..., out_dtype=fp32)``
    GEMMs and the indexer ``weights_proj``. Both operands must be bf16."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff bf16_linear: input ({x.dtype}) and weight ({weight.dtype}) must be bfloat16 "
                          "in consistency mode")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"zerodiff bf16_linear: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ConfigError(f"zerodiff bf16_linear: weight {tuple(weight.shape)} does not match input "
                          f"{tuple(x.shape)} ([N, K] with K = the input's last dim)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = _op("bf16_linear")(x2, w, out_dtype == torch.float32)
    return out.view(*lead, weight.shape[0])


def lm_head_logits(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Replacement for ``LogitsProcessor._apply_head`` with an unquantised LM head: FP32 logits
    ``bf16_gemm(hidden, W, out_dtype=fp32)`` (FP32 accumulation, never rounded to BF16; the configuration
    depends on (vocab, hidden) only, so a row's logits are the same whatever the number of requests or
    prompt tokens in the call). A bias is refused (no DeepSeek model has one)."""
    if bias is not None:
        raise ConfigError("zerodiff LM head: an LM-head bias is not supported in consistency mode")
    return bf16_linear(hidden_states, weight, out_dtype=torch.float32)


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


# ------------------------------------------------------------------------------------- block-FP8 linear
def fp8_grouped_linear(a_q: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """Replacement for DeepSeek-V4's grouped output LoRA ``fp8_einsum("bhr,hdr->bhd")`` (``wo_a``): for each
    group ``g``, ``out[:, g] = fp8_gemm(a_q[:, g], a_scale[:, g], w[g], w_scale[g])`` with zerodiff's block-FP8
    kernel (K in ascending 128-blocks, configuration from (N, K) only: a token's value never depends on the
    token count). ``a_q`` e4m3 ``[T, G, K]`` with fp32 1x128 scales ``[T, G, K/128]``; ``weight`` e4m3
    ``[G * N, K]`` or ``[G, N, K]`` with fp32 128x128 block scales (``[G * N/128, K/128]`` or
    ``[G, N/128, K/128]``); ``out`` bf16 ``[T, G, N]`` is written and returned. Other scale layouts (UE8M0
    packed, TMA-aligned) are refused."""
    from ...ops.fp8_gemm import fp8_gemm

    if a_q.dim() != 3 or out.dim() != 3 or out.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff wo_a: expected a_q [T, G, K] and a bf16 out [T, G, N], got {tuple(a_q.shape)} "
                          f"and {out.dtype} {tuple(out.shape)}")
    T, G, K = a_q.shape
    N = out.shape[2]
    if a_scale.dtype != torch.float32 or tuple(a_scale.shape) != (T, G, (K + 127) // 128):
        raise ConfigError(f"zerodiff wo_a: activation scales must be fp32 [T, G, K/128] = [{T}, {G}, {(K + 127) // 128}], "
                          f"got {a_scale.dtype} {tuple(a_scale.shape)} (UE8M0-packed / TMA-aligned layouts are "
                          "not supported)")
    w = weight.reshape(G, N, K)
    ws = weight_scale
    if ws.dtype != torch.float32 or ws.numel() != G * ((N + 127) // 128) * ((K + 127) // 128):
        raise ConfigError(f"zerodiff wo_a: weight scales must be fp32 128x128 blocks ({G} x {(N + 127) // 128} x "
                          f"{(K + 127) // 128}), got {ws.dtype} {tuple(ws.shape)}")
    ws = ws.reshape(G, (N + 127) // 128, (K + 127) // 128)
    for g in range(G):  # a fresh contiguous result per group: DeepGEMM writes only contiguous outputs
        out[:, g].copy_(fp8_gemm(a_q[:, g], a_scale[:, g], w[g], ws[g]))
    return out



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


