"""The frozen CUDA baseline: the fast stock paths a tuned vLLM deployment runs (the baseline table in docs/results.md).

Used by :class:`zerodiff.model.ops.BaselineRolloutOps` on CUDA tensors only (the CPU baseline keeps its
torch stand-ins). Same precision as the consistent mode (FP8 weights, FP8 KV cache in the same byte layout)
and the same CUDA-graph policy (pure-decode steps captured, mixed steps eager). Per op:

* dense FP8 linear: stock per-token-group activation quant (1x128 groups, ``amax / 448`` scale: the rule
  vLLM's ``per_token_group_quant_fp8`` implements; run here by ``zerodiff.ops.fp8_quant.quant_act``'s single
  fused kernel), then DeepGEMM ``fp8_gemm_nt`` (M-dependent kernel choice is DeepGEMM's own);
* routed experts: DeepGEMM ``m_grouped_fp8_gemm_nt_masked`` in captured decode graphs (static capacity =
  padded batch) and ``m_grouped_fp8_gemm_nt_contiguous`` in eager steps (segments aligned to DeepGEMM's
  ``get_mk_alignment_for_contiguous_layout()`` with BLOCK_M capped at it, as vLLM does), stock
  activation ``F.silu(g) * u`` in BF16 (two roundings) then the stock group quant, combine as one FP32
  ``(y * w).sum(1)`` (the reduction order torch picks);
* attention: pure-decode tokens through FlashMLA's FP8 sparse decode ``flash_mla_with_kvcache``
  (``is_fp8_kvcache=True``, its own split-KV scheduler: batch dependent); prefill tokens through the
  vLLM-style read: dequantise each request's cached positions ``0..len-1`` with torch ops into one BF16
  buffer, then ``flash_mla_sparse_fwd`` with the selected positions as indices into it.

Every backend is required: a missing DeepGEMM / FlashMLA raises :class:`BaselineUnavailable` naming it
(fail closed; never a silent substitute). The one recorded exception: a (kernel, shape) DeepGEMM rejects at
its first (eager) call runs on the next stock path (dense: cuBLAS BF16 on a cached dequantised copy;
grouped: zerodiff's Triton grouped FP8 GEMM) and the substitution is written into :data:`CHOICES`, which
``zerodiff bench`` prints and stores in its JSON.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerodiff import backends
from zerodiff.ops.fp8_quant import quant_act

#: what actually ran per (op, shape): filled at first use, reported by ``zerodiff bench``
CHOICES: dict = {}
_FALLBACK: dict = {}  # key -> reason DeepGEMM was rejected for that shape
FLASHMLA_HEADS = (64, 128)
FLASHMLA_DQK = 576


class BaselineUnavailable(RuntimeError):
    pass


def _need(which: str):
    mod = backends.deep_gemm() if which == "deepgemm" else backends.flash_mla()
    if mod is None:
        detail = backends.status()[which]["detail"]
        raise BaselineUnavailable(
            f"zerodiff baseline: the frozen CUDA baseline needs {which} ({'DeepGEMM' if which == 'deepgemm' else 'FlashMLA'}) "
            f"but it is not importable here ({detail}); install vLLM 0.33.0 or unpack its kernels "
            f"(make kernels-from-wheel / .carry/wheel-kernels.tar.gz) - the baseline never substitutes silently")
    return mod


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def choices_text() -> dict:
    return {" ".join(str(x) for x in k): v for k, v in sorted(CHOICES.items(), key=lambda kv: str(kv[0]))}


# ---- dense FP8 linear ------------------------------------------------------------------------------------
def fp8_linear(x: torch.Tensor, w, deq_bf16) -> torch.Tensor:
    """x bf16 [M, K], w Fp8Weight [N, K] -> bf16 [M, N]. ``deq_bf16(q, scale)``: cached BF16 dequantisation
    (only for a shape DeepGEMM rejected, recorded in CHOICES)."""
    dg = _need("deepgemm")
    N, K = w.q.shape
    key = ("dense fp8 linear", f"N={N}", f"K={K}")
    if key in _FALLBACK:
        return F.linear(x, deq_bf16(w.q, w.scale))
    M = x.shape[0]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out
    aq, as_ = quant_act(x)
    try:
        dg.fp8_gemm_nt((aq, as_), (w.q, w.scale), out, disable_ue8m0_cast=True)
    except Exception as e:  # noqa: BLE001 - shape rejected: recorded substitution (never inside capture)
        if _capturing():
            raise
        _FALLBACK[key] = f"{type(e).__name__}: {e}"[:300]
        CHOICES[key] = f"cuBLAS BF16 F.linear on a dequantised copy (DeepGEMM fp8_gemm_nt rejected: {_FALLBACK[key]})"
        return F.linear(x, deq_bf16(w.q, w.scale))
    CHOICES.setdefault(key, "stock group quant + DeepGEMM fp8_gemm_nt")
    return out


# ---- routed experts -----------------------------------------------------------------------------------------
def _row_expert_contiguous(counts: torch.Tensor, rows: int, align: int) -> torch.Tensor:
    """Expert id of every row of a contiguous dispatch buffer (-1 on padding rows): DeepGEMM's m_indices."""
    c = counts.to(torch.int64)
    seg = (c + align - 1) // align * align
    end = torch.cumsum(seg, 0)
    r = torch.arange(rows, device=counts.device, dtype=torch.int64)
    e = torch.searchsorted(end, r, right=True)
    ec = e.clamp(max=c.shape[0] - 1)
    inside = (e < c.shape[0]) & (r - (end[ec] - seg[ec]) < c[ec])
    return torch.where(inside, e, torch.full_like(e, -1)).to(torch.int32)


def contiguous_align(dg) -> int:
    """Per-expert row alignment of the contiguous layout: DeepGEMM's own (its BLOCK_M bound), as vLLM sizes its
    workspace; 128 when the library does not say. A segment alignment below the kernel's BLOCK_M would make the
    scheduler read the wrong expert id (an illegal memory access), so the calls also cap BLOCK_M at it."""
    get = getattr(dg, "get_mk_alignment_for_contiguous_layout", None)
    a = get() if get is not None else None
    a = a[0] if isinstance(a, (list, tuple)) else a
    try:
        a = int(a)
    except (TypeError, ValueError):
        a = 128
    return a if a > 0 and a % 64 == 0 else 128


class _BlockMCap:
    """Cap DeepGEMM's BLOCK_M heuristic at the buffer's alignment during the contiguous calls (restored after)."""

    def __init__(self, dg, value):
        self.get = getattr(dg, "get_mk_alignment_for_contiguous_layout", None)
        self.set = getattr(dg, "set_mk_alignment_for_contiguous_layout", None)
        self.value = value

    def __enter__(self):
        self.prev = None
        if self.get is not None and self.set is not None:
            p = self.get()
            self.prev = p[0] if isinstance(p, (list, tuple)) else p
            self.set(self.value)

    def __exit__(self, *exc):
        if self.prev is not None:
            self.set(self.prev)
        return False


def _grouped(dg, a_q, a_s, w, plan, out, key):
    """One grouped GEMM of the dispatch ``plan`` (DeepGEMM, or the recorded Triton substitute)."""
    if key not in _FALLBACK:
        try:
            if plan.layout == "contiguous":
                m_idx = _row_expert_contiguous(plan.counts, plan.rows, plan.align)
                with _BlockMCap(dg, plan.align):
                    dg.m_grouped_fp8_gemm_nt_contiguous((a_q, a_s), (w.q, w.scale), out, m_idx,
                                                        disable_ue8m0_cast=True)
            else:
                E, C = w.q.shape[0], plan.cap_pad
                dg.m_grouped_fp8_gemm_nt_masked((a_q.view(E, C, -1), a_s.view(E, C, -1)), (w.q, w.scale),
                                                out.view(E, C, -1), plan.counts, C, disable_ue8m0_cast=True)
            CHOICES.setdefault(key, f"DeepGEMM m_grouped_fp8_gemm_nt_{plan.layout}")
            return out
        except Exception as e:  # noqa: BLE001
            if _capturing():
                raise
            _FALLBACK[key] = f"{type(e).__name__}: {e}"[:300]
            CHOICES[key] = f"zerodiff Triton grouped FP8 GEMM (DeepGEMM rejected: {_FALLBACK[key]})"
    from zerodiff.ops.fp8_gemm import grouped_fp8_gemm

    return grouped_fp8_gemm(a_q, a_s, w.q, w.scale, plan.tile_expert, out=out)


def moe_routed(x: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor, w13, w2, *, graph: bool) -> torch.Tensor:
    """Stock routed experts -> fp32 [T, H]. ``graph``: masked layout with the static capacity T (the padded
    graph batch), else contiguous."""
    from zerodiff.ops import moe as _moe

    dg = _need("deepgemm")
    T, H = x.shape
    k = ids.shape[1]
    E, I2 = w13.q.shape[0], w13.q.shape[1]
    layout = "masked" if graph else "contiguous"
    align = _moe.DG_ALIGN if graph else contiguous_align(dg)
    plan = _moe.plan_dispatch(ids, E, layout=layout, capacity=T if graph else None, align=align)
    dev = x.device
    xq, xs = quant_act(x)
    tok = torch.arange(T, device=dev).repeat_interleave(k)
    d = plan.dest.reshape(-1)
    a = torch.zeros((plan.rows + 1, H), dtype=torch.uint8, device=dev)
    a_s = torch.zeros((plan.rows + 1, xs.shape[1]), dtype=torch.float32, device=dev)
    a[d] = xq.view(torch.uint8)[tok]
    a_s[d] = xs[tok]
    h = torch.zeros((plan.rows, I2), dtype=torch.bfloat16, device=dev)
    _grouped(dg, a[: plan.rows].view(torch.float8_e4m3fn), a_s[: plan.rows].contiguous(), w13, plan, h,
             ("moe w13", layout, f"N={I2}", f"K={H}"))
    I = I2 // 2
    act = F.silu(h[:, :I]) * h[:, I:]  # stock: two BF16 roundings
    hq, hs = quant_act(act)
    y = torch.zeros((plan.rows + 1, H), dtype=torch.bfloat16, device=dev)
    _grouped(dg, hq, hs.contiguous(), w2, plan, y[: plan.rows], ("moe w2", layout, f"N={H}", f"K={I}"))
    w = torch.where(ids >= 0, wts, torch.zeros((), dtype=wts.dtype, device=dev))
    return (y[plan.dest].float() * w.unsqueeze(-1)).sum(1)


# ---- attention ------------------------------------------------------------------------------------------------
def _check_heads(q):
    if q.shape[1] not in FLASHMLA_HEADS or q.shape[2] != FLASHMLA_DQK:
        raise BaselineUnavailable(
            f"zerodiff baseline: FlashMLA's FP8 kernels need heads in {FLASHMLA_HEADS} and d_qk {FLASHMLA_DQK}; the model has "
            f"heads={q.shape[1]}, d_qk={q.shape[2]} (use a preset with 64 heads and a 512 + 64 latent)")


def cache_slots(step, sel: torch.Tensor, block_size: int, rows=None) -> torch.Tensor:
    """Global cache slot (block * block_size + offset) of each selected request-local position; -1 kept."""
    slot = step.slot if rows is None else step.slot[rows]
    p = sel.long().clamp(min=0)
    bt = step.block_table.long()
    blk = bt[slot.long()[:, None], (p // block_size).clamp(max=bt.shape[1] - 1)]
    s = blk * block_size + p % block_size
    return torch.where((sel >= 0) & (blk >= 0), s, torch.full_like(s, -1)).to(torch.int32)


def flashmla_decode(q, kv_cache, slots, sm_scale: float, d_v: int, meta=None):
    """Stock FP8 sparse decode: q bf16 [B, h, 576], kv_cache uint8 [blocks, bs, 656], slots int32 [B, topk]
    (global cache slots, -1 invalid). ``meta``: a scheduler-metadata object to reuse (captured graphs) or
    None (fresh per call, eager)."""
    fm = _need("flashmla")
    _check_heads(q)
    if meta is None:
        meta, _ = fm.get_mla_metadata()
    out, _lse = fm.flash_mla_with_kvcache(q[:, None].contiguous(), kv_cache.unsqueeze(-2), None, None, d_v, meta,
                                          softmax_scale=sm_scale, is_fp8_kvcache=True,
                                          indices=slots[:, None].contiguous())
    CHOICES.setdefault(("attention decode",), "FlashMLA flash_mla_with_kvcache (FP8 sparse decode, split-KV scheduler)")
    return out[:, 0]


def dequant_tokens(kv_cache: torch.Tensor, slots: torch.Tensor, d_nope: int, d_rope: int) -> torch.Tensor:
    """Torch dequantisation of cache tokens (slots int64 [N]) -> bf16 [N, d_nope + d_rope] (vLLM-style)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    rows = flat[slots]
    g = d_nope // 128
    codes = rows[:, :d_nope].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = rows[:, d_nope: d_nope + 4 * g].contiguous().view(torch.float32)
    nope = (codes.view(-1, g, 128) * scale.unsqueeze(-1)).view(-1, d_nope).to(torch.bfloat16)
    rope = rows[:, d_nope + 4 * g: d_nope + 4 * g + 2 * d_rope].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], 1)


def flashmla_prefill(q, kv_cache, step, sel, sm_scale: float, d_nope: int, d_rope: int, block_size: int, rows=None):
    """vLLM-style sparse prefill for the query rows ``rows`` (all when None): dequantise each request's
    positions 0..len-1 (host-known lengths of this eager step) into one BF16 buffer, then
    ``flash_mla_sparse_fwd`` with indices = request offset + selected position."""
    fm = _need("flashmla")
    _check_heads(q)
    dev = q.device
    lens = step.req_len_host
    if lens is None:
        raise ValueError("zerodiff baseline: prefill needs the step's host-side request lengths (build_step sets them)")
    offs, o = [], 0
    for L in lens:
        offs.append(o)
        o += L
    lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    offs_t = torch.tensor(offs, dtype=torch.int64, device=dev)
    req_all = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t, output_size=o)
    pos_all = torch.arange(o, device=dev) - offs_t[req_all]
    bt = step.block_table.long()
    slot_all = bt[req_all, pos_all // block_size] * block_size + pos_all % block_size
    kv = dequant_tokens(kv_cache, slot_all, d_nope, d_rope)
    slot_r = step.slot.long() if rows is None else step.slot.long()[rows]
    idx = torch.where(sel >= 0, offs_t[slot_r][:, None] + sel.long(), torch.full_like(sel, -1, dtype=torch.int64))
    out, _ml, _lse = fm.flash_mla_sparse_fwd(q.contiguous(), kv[:, None].contiguous(),
                                             idx.to(torch.int32)[:, None].contiguous(), float(sm_scale), d_nope)
    CHOICES.setdefault(("attention prefill",), "torch dequant of the requests' cache + FlashMLA flash_mla_sparse_fwd")
    return out
