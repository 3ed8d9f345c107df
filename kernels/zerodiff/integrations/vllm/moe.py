"""MoE adapters: the experts' SiLU*up -> FP8 step in DeepGEMM's layouts and the deterministic expert routing."""

from __future__ import annotations

from typing import Any

import torch

from .. import ConfigError

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
    from ...ops.silu_mul_quant import silu_mul_quant_fp8

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
    from ...ops.silu_mul_quant import silu_mul_quant_fp8_masked

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


# ------------------------------------------------------------------------------------ expert routing
_VLLM_SCORING = {"softmax": "softmax", "sigmoid": "sigmoid", "sqrtsoftplus": "sqrtsoftplus"}


def expert_routing(router_logits: torch.Tensor, top_k: int, *, scoring_func: str, bias=None,
                   renormalize: bool = True, routed_scaling_factor: float = 1.0,
                   indices_type: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Replacement for ``FusedTopKBiasRouter._compute_routing`` (no hash table, no vision bias):
    ``zerodiff.ops.moe.route`` on the FP32 router logits -> (weights fp32 [T, k], ids [T, k]) in the slot
    order the training side uses (expert id descending). ``bias`` is the e-score correction bias (a
    tensor or parameter, FP32 [E]); ``indices_type`` the dtype vLLM asks for the ids (int32 default)."""
    from ...ops.moe import route

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




# ------------------------------------------------------------------------- DeepSeek-V4 MoE block (whole)
def _expert_fp8(experts: Any, name: str, ue8m0: bool):
    from ...ops.fp8_quant import Fp8Weight

    w = getattr(experts, f"{name}_weight", None)
    s = getattr(experts, f"{name}_weight_scale_inv", None)
    if s is None:
        s = getattr(experts, f"{name}_weight_scale", None)
    if w is None or s is None or w.dtype != torch.float8_e4m3fn or w.dim() != 3:
        raise ConfigError(f"zerodiff MoE: the routed experts' {name} weights must be block-FP8 e4m3 [E, N, K] "
                          f"(expert_dtype 'fp8'); got {getattr(w, 'dtype', None)} "
                          f"{tuple(getattr(w, 'shape', ()))} (FP4 / MXFP4 experts are not supported)")
    E, N, K = w.shape
    want = (E, (N + 127) // 128, (K + 127) // 128)
    if s.dtype != torch.float32 or tuple(s.shape) != want:
        raise ConfigError(f"zerodiff MoE: {name} scales must be fp32 128x128 blocks {want}, got {s.dtype} "
                          f"{tuple(s.shape)}: this MoE backend re-laid the weights out (use moe_backend 'triton')")
    return Fp8Weight(w, s, bool(ue8m0))


def dsv4_moe_weights(experts: Any, ue8m0: bool):
    """The routed experts of a vLLM ``FusedMoE`` as a ``zerodiff.ops.moe.MoEWeights`` *viewing* vLLM's own
    parameters (no copy: a weight refit into those tensors is seen at once). Cached on the module."""
    from ...ops.moe import MoEWeights

    cached = getattr(experts, "_zerodiff_moe_weights", None)
    if cached is not None and cached.w13.q is getattr(experts, "w13_weight") and cached.w13.ue8m0 == bool(ue8m0):
        return cached
    mw = MoEWeights(_expert_fp8(experts, "w13", ue8m0), _expert_fp8(experts, "w2", ue8m0))
    try:
        experts._zerodiff_moe_weights = mw
    except (AttributeError, TypeError):
        pass
    return mw


def dsv4_moe_forward(moe: Any, hidden_states: torch.Tensor, input_ids: torch.Tensor | None, *,
                     ue8m0: bool) -> torch.Tensor:
    """Consistency-mode body of ``DeepseekV4MoE._forward_fused_moe`` (vLLM 0.33.0
    ``vllm/models/deepseek_v4/nvidia/model.py``): the whole MoE block through ``zerodiff.ops.moe``, the op the
    training side runs, so a token's output never depends on the other tokens (nor on CUDA-graph padding):

    1. FP32 gate logits from ``zerodiff.ops.router_gemm`` (:func:`router_logits`, one kernel for every M);
    2. routing: hash-routed layers (``gate.tid2eid``) take their experts from the table row of the token id,
       in table order, weights by :func:`zerodiff.ops.moe.route_hashed`; the other layers
       :func:`zerodiff.ops.moe.route` (score, correction bias for the selection, deterministic top-k with ties
       to the larger expert id, slots expert-id-descending, renormalisation, routed scale);
    3. routed experts :func:`zerodiff.ops.moe.moe_experts` (contiguous layout, per-token FP8 activation
       quant with UE8M0 scales when ``ue8m0``, grouped FP8 GEMMs on vLLM's own expert weights, SiLU*up with
       the SwiGLU clamp and one BF16 rounding, FP32 combine in slot order);
    4. the shared expert as vLLM's own module (its linears and activation are the series' routed ones), added
       in FP32 before the one BF16 rounding (:func:`zerodiff.ops.moe.finish`).

    Refused (``ConfigError``): vision routing (``gate.bias_vl``), non-FP8 experts, expert scales vLLM's MoE
    backend re-laid out, hash routing without ``input_ids``, expert parallelism (local experts != all)."""
    from ...ops import moe as zmoe
    from .layers import router_logits

    gate = moe.gate
    if getattr(gate, "bias_vl", None) is not None:
        raise ConfigError("zerodiff MoE: vision routing (bias_vl) is not supported in consistency mode")
    experts = getattr(moe.experts, "routed_experts", moe.experts)  # MoERunner -> its RoutedExperts (weights)
    n_local = getattr(experts, "local_num_experts", None)
    E = int(moe.n_routed_experts)
    if n_local is not None and int(n_local) != E:
        raise ConfigError(f"zerodiff MoE: {n_local} local of {E} experts (expert parallelism) is not supported "
                          "by the single-GPU MoE route")
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = router_logits(x, gate.weight)
    k = int(moe.n_activated_experts)
    scoring = str(moe.scoring_func)
    tid2eid = getattr(gate, "tid2eid", None)
    if tid2eid is not None:
        if input_ids is None:
            raise ConfigError("zerodiff MoE: hash-routed layers need the token ids")
        ids = tid2eid[input_ids.reshape(-1).long()].to(torch.int32)
        weights = zmoe.route_hashed(logits, ids, scoring=scoring, renormalize=bool(moe.renormalize),
                                    routed_scale=float(moe.routed_scaling_factor))
    else:
        bias = getattr(gate, "e_score_correction_bias", None)
        weights, ids = zmoe.route(logits, k, scoring=scoring, bias=None if bias is None else bias.data,
                                  renormalize=bool(moe.renormalize), routed_scale=float(moe.routed_scaling_factor))
    routed = zmoe.moe_experts(x, weights, ids, dsv4_moe_weights(experts, ue8m0), clamp_limit=moe.swiglu_limit)
    shared = moe.shared_experts(x) if getattr(moe, "shared_experts", None) is not None else None
    return zmoe.finish(routed, shared).view(hidden_states.shape)
