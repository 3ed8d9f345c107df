"""The frozen CUDA baseline: the fast stock paths a tuned vLLM deployment runs (the baseline table in docs/results.md).

Used by :class:`zerodiff.model.ops.BaselineRolloutOps` on CUDA tensors only (the CPU baseline keeps its
torch stand-ins). Same precision as the consistent mode (FP8 weights, FP8 KV cache in the same byte layout)
and the same CUDA-graph policy (pure-decode steps captured, mixed steps eager). Per op:

* dense FP8 linear: stock per-token-group activation quant (1x128 groups, ``amax / 448`` scale: the rule
  vLLM's ``per_token_group_quant_fp8`` implements; run here by ``zerodiff.ops.fp8_quant.quant_act``'s single
  fused kernel), then DeepGEMM ``fp8_gemm_nt`` (M-dependent kernel choice is DeepGEMM's own);
* routed experts: DeepGEMM ``m_grouped_fp8_gemm_nt_masked`` in captured decode graphs (static capacity =
  padded batch) and ``m_grouped_fp8_gemm_nt_contiguous`` in eager steps (segments aligned to DeepGEMM's
  ``get_mk_alignment_for_contiguous_layout()`` with BLOCK_M capped at it, as vLLM does), SiLU(gate)·up ->
  FP8 in one fused kernel (:func:`silu_mul_quant`), combine as one FP32 ``(y * w).sum(1)`` (the reduction
  order torch picks);
* RMSNorm, DSA Top-K, expert routing: vLLM's own compiled kernels (``torch.ops._C.rms_norm``,
  ``_C.top_k_per_row_decode``, ``_moe_C.topk_sigmoid``) loaded from vLLM's libraries without importing vLLM
  (:mod:`zerodiff.baselines.vllm_ops`); each is probed once against the torch path; where a library is missing
  or a probe fails, the torch path runs and the reason is recorded (``ZERODIFF_BASELINE_VLLM_OPS=require``
  raises instead). :func:`vs_vllm` lists, per op, what ran against what vLLM runs;
* mHC post: vLLM's TileLang fused post kernel where vLLM and ``tilelang`` import (:func:`mhc_post`), otherwise
  a fused one-pass kernel of the same memory traffic (recorded);
* eager mixed steps split decode / prefill rows on the host and copy the indices through pinned memory
  without a host sync (:func:`split_rows`, :func:`h2d`);
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
    hq, hs = silu_mul_quant(h)  # one fused kernel
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
    lens_t = h2d(lens, dev)  # pinned, non-blocking: no host sync
    offs_t = h2d(offs, dev)
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


# ---- vLLM's own compiled ops (zerodiff.baselines.vllm_ops) ---------------------------------------------------
def _vllm_lib(ns: str, op: str):
    """``torch.ops.<ns>`` when vLLM's library is usable; None to run the recorded present path; under
    ``ZERODIFF_BASELINE_VLLM_OPS=require`` a missing library raises."""
    from zerodiff.baselines import vllm_ops as _V

    lib = _V.library(ns)
    if lib is None and _V.policy() == "require":
        raise BaselineUnavailable(f"zerodiff baseline: {op} needs vLLM's torch.ops.{ns} ({_V.STATUS.get(ns)}); "
                                  "ZERODIFF_BASELINE_VLLM_OPS=require never substitutes")
    return lib


def _use_vllm(op: str, ns: str, run, reference, same, present: str) -> bool:
    """Whether to run vLLM's kernel for ``op`` (library usable and its first call matched ``reference``);
    records what runs in CHOICES either way."""
    from zerodiff.baselines import vllm_ops as _V

    lib = _vllm_lib(ns, op)
    if lib is None:
        CHOICES.setdefault((op,), f"{present} (vLLM's kernel not used: torch.ops.{ns} {_V.STATUS.get(ns)})")
        return False
    if not _V.probe_once(op, run, reference, same):
        if _V.policy() == "require":
            raise BaselineUnavailable(f"zerodiff baseline: vLLM's kernel for {op} failed its probe: {_V.STATUS[op]}")
        CHOICES[(op,)] = f"{present} (vLLM's kernel failed its probe: {_V.STATUS[op]})"
        return False
    return True


def _close(rel: float):
    def same(a, b):
        a, b = a.float(), b.float()
        err = (a - b).abs().max().item()
        ref = b.abs().max().item()
        return err <= rel * ref + 1e-3, f"max |diff| {err:.3g} vs max |ref| {ref:.3g}"

    return same


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Stock RMSNorm, BF16 in and out: vLLM's ``torch.ops._C.rms_norm`` (one kernel, FP32 math inside) where
    usable; else torch's FP32 ``F.rms_norm`` on an upcast copy (recorded)."""

    def torch_path():
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(torch.bfloat16)

    def vllm_path():
        xc = x.contiguous()
        out = torch.empty_like(xc)
        torch.ops._C.rms_norm(out, xc, w.to(xc.dtype).contiguous(), float(eps))
        return out

    if x.dtype in (torch.bfloat16, torch.float16) and _use_vllm(
            "rms norm", "_C", vllm_path, torch_path, _close(2e-2), "torch FP32 F.rms_norm on an upcast copy"):
        CHOICES.setdefault(("rms norm",), "vLLM torch.ops._C.rms_norm")
        return vllm_path()
    CHOICES.setdefault(("rms norm",), "torch FP32 F.rms_norm on an upcast copy (input not BF16/FP16)")
    return torch_path()


def mhc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Stock mHC post ``out[t, j] = post[t, j] * y[t] + sum_i comb[t, i, j] * X[t, i]`` (BF16 out, FP32 math).

    vLLM's CUDA path is its TileLang fused post kernel: it runs here where vLLM and ``tilelang`` import and its
    first call matches the FP32 torch expression (:func:`zerodiff.baselines.vllm_ops.tilelang_mhc_kernels`).
    Otherwise a one-pass fused kernel of the same memory traffic runs instead of an unfused torch einsum
    (``zerodiff.ops.mhc.mhc_post``: the op is per token, so every fused one-pass kernel is batch independent
    and the choice does not change what the negative control shows); the choice is recorded in CHOICES.
    ``ZERODIFF_BASELINE_VLLM_OPS=require`` raises where TileLang's kernel cannot run."""
    from zerodiff.baselines import vllm_ops as _V
    from zerodiff.ops.mhc import mhc_post as fused_post

    T, n, H = X.shape

    def torch_path():
        return (post.reshape(T, n, 1) * y.float().unsqueeze(1)
                + torch.einsum("tij,tih->tjh", comb.float(), X.float())).to(torch.bfloat16)

    def tilelang_path():
        out = torch.empty_like(X)
        kernel = getattr(mod, "_MHC_POST_TILELANG_KERNEL")
        kernel(comb.contiguous(), X.contiguous(), post.reshape(T, n).contiguous(), y.contiguous(), out, n, H)
        return out

    mod = _V.tilelang_mhc_kernels()
    if mod is not None and _V.probe_once("mhc post", tilelang_path, torch_path, _close(2e-2)):
        CHOICES.setdefault(("mhc post",), "vLLM TileLang fused mHC post")
        return tilelang_path()
    reason = _V.STATUS.get("mhc post") or _V.STATUS.get("tilelang mhc")
    if _V.policy() == "require":
        raise BaselineUnavailable(f"zerodiff baseline: mhc post needs vLLM's TileLang kernel ({reason}); "
                                  "ZERODIFF_BASELINE_VLLM_OPS=require never substitutes")
    CHOICES.setdefault(("mhc post",), f"one fused kernel: zerodiff mhc_post (vLLM's TileLang kernel not used: {reason})")
    return fused_post(y, X, post, comb)


def silu_mul_quant(h: torch.Tensor):
    """SiLU(gate)·up -> FP8 (1x128 groups) in ONE fused kernel. vLLM's fused kernel for the block-FP8 DeepGEMM
    MoE on Hopper is a Triton kernel of its Python package (not in its compiled libraries), so the harness runs
    zerodiff's fused kernel of the same one-pass structure (FP32 SiLU·mul, group amax, quant)."""
    from zerodiff.ops.silu_mul_quant import silu_mul_quant_fp8

    CHOICES.setdefault(("silu*mul -> fp8",), "one fused kernel: zerodiff silu_mul_quant_fp8 (vLLM's fused kernel "
                                             "is Triton inside its Python package)")
    return silu_mul_quant_fp8(h)


def topk_rows(scores: torch.Tensor, k: int, lengths=None) -> torch.Tensor:
    """DSA Top-K: int32 ``[T, min(k, W)]`` column indices of the largest scores among columns
    ``0..lengths[t]-1`` (all W when None), -1 where a row has fewer; order unspecified (stock). vLLM's
    ``torch.ops._C.top_k_per_row_decode`` (next_n = 1, per-row lengths) where usable, else ``torch.topk``."""
    T, W = scores.shape
    kk = min(k, W)

    def torch_path():
        s = scores
        if lengths is not None:
            col = torch.arange(W, device=scores.device)[None, :]
            s = scores.masked_fill(col >= lengths[:, None].long(), float("-inf"))
        vals, idx = torch.topk(s, kk, dim=1)
        return idx.to(torch.int32).masked_fill(vals == float("-inf"), -1)

    def vllm_path():
        s = scores.float().contiguous()
        out = torch.empty((T, kk), dtype=torch.int32, device=scores.device)
        if T == 0:
            return out
        lens = (lengths.to(torch.int32).contiguous() if lengths is not None
                else torch.full((T,), W, dtype=torch.int32, device=scores.device))
        torch.ops._C.top_k_per_row_decode(s, 1, lens, out, T, s.stride(0), s.stride(1), kk)
        return out

    def same(a, b):  # the same selected score multiset per row (ties may pick other columns)
        def picked(i):
            v = scores.float().gather(1, i.long().clamp(min=0)).masked_fill(i < 0, float("-inf"))
            return v.sort(1).values

        ok = bool(torch.equal(picked(a), picked(b)))
        return ok, "selected scores equal per row" if ok else "selected scores differ"

    if _use_vllm("dsa top-k", "_C", vllm_path, torch_path, same, "torch.topk"):
        CHOICES.setdefault(("dsa top-k",), "vLLM torch.ops._C.top_k_per_row_decode (next_n=1)")
        return vllm_path()
    return torch_path()


def route_sigmoid(logits: torch.Tensor, bias, k: int, scale: float):
    """Expert routing: sigmoid scores, top-k of score + bias, weights = the selected unbiased scores renormalised
    and times ``scale`` -> (fp32 ``[T, k]``, int32 ``[T, k]``). vLLM's fused ``torch.ops._moe_C.topk_sigmoid``
    where usable, else torch ops."""

    def torch_path():
        sc = torch.sigmoid(logits.float())
        _, ids = torch.topk(sc + (bias.float() if bias is not None else 0.0), k, dim=1)
        w = sc.gather(1, ids)
        return w / w.sum(-1, keepdim=True) * scale, ids.to(torch.int32)

    def vllm_path():
        g = logits.float().contiguous()
        T = g.shape[0]
        w = torch.empty((T, k), dtype=torch.float32, device=g.device)
        ids = torch.empty((T, k), dtype=torch.int32, device=g.device)
        tei = torch.empty((T, k), dtype=torch.int32, device=g.device)
        if T:
            b = bias.float().contiguous().reshape(-1) if bias is not None else None
            torch.ops._moe_C.topk_sigmoid(w, ids, tei, g, True, b, float(scale), None)
        return w, ids

    def same(a, b):
        (wa, ia), (wb, ib) = a, b
        ok_ids = bool(torch.equal(ia.sort(1).values, ib.sort(1).values))
        err = (wa.sort(1).values - wb.sort(1).values).abs().max().item() if wa.numel() else 0.0
        return ok_ids and err <= 1e-4 * max(1.0, float(scale)), f"ids equal {ok_ids}, weights max |diff| {err:.3g}"

    if _use_vllm("expert routing", "_moe_C", vllm_path, torch_path, same, "torch sigmoid + topk + gather"):
        CHOICES.setdefault(("expert routing",), "vLLM torch.ops._moe_C.topk_sigmoid (fused, bias, renormalise)")
        return vllm_path()
    return torch_path()


def h2d(values, device) -> torch.Tensor:
    """int64 host list -> device tensor through pinned memory, non-blocking (no host sync)."""
    t = torch.tensor(values, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def split_rows(dec, T: int, device):
    """(decode rows, other rows) of an eager mixed step as device int64 tensors, from the host-side decode list:
    computed on the host with torch ops (no per-token Python loop) and copied without a host sync."""
    d = torch.tensor(dec, dtype=torch.int64)
    keep = torch.ones(T, dtype=torch.bool)
    keep[d] = False
    p = torch.arange(T, dtype=torch.int64)[keep]
    if torch.device(device).type == "cuda":
        return d.pin_memory().to(device, non_blocking=True), p.pin_memory().to(device, non_blocking=True)
    return d.to(device), p.to(device)


def vs_vllm() -> list:
    """Per op: the kernel the harness baseline runs (what ran, where recorded), the one stock vLLM 0.33.0 runs,
    and why they differ where they do. Written into ``zerodiff bench``'s JSON."""
    from zerodiff.baselines import vllm_ops as _V

    ran = choices_text()

    def got(op, default):
        return ran.get(op, default)

    rows = [
        ("rms norm", got("rms norm", "not called yet"), "torch.ops._C.rms_norm / fused_add_rms_norm",
         "same kernel when vLLM's _C loads (the model adds the residual in mHC, so there is no fused add)"),
        ("silu*mul -> fp8", got("silu*mul -> fp8", "not called yet"),
         "silu_mul_per_token_group_quant_fp8_colmajor (Triton, vLLM's Python package)",
         "vLLM's kernel is Triton code inside vLLM's Python package, not a compiled op; the harness runs a "
         "fused kernel of the same one-pass structure"),
        ("dsa top-k", got("dsa top-k", "not called yet"),
         "torch.ops._C.top_k_per_row_decode (decode rows) / top_k_per_row_prefill (prefill rows)",
         "the harness calls the decode kernel for every row (next_n = 1, per-row lengths); the prefill kernel "
         "runs the same per-row selection job"),
        ("expert routing", got("expert routing", "not called yet"), "torch.ops._moe_C.topk_sigmoid (fused router)",
         "same kernel when vLLM's _moe_C loads"),
        ("mhc pre", got("mhc pre", "not called yet"), "TileLang mHC kernels (fused pre), split from its heuristic",
         "TileLang is not loadable in the harness; DeepGEMM tf32_hc_prenorm_gemm with the batch-size split "
         "heuristic (zerodiff.baselines.mhc)"),
        ("mhc post", got("mhc post", "not called yet"), "TileLang fused mHC post",
         "the same kernel where vLLM and tilelang import; otherwise a fused one-pass kernel of the same traffic"),
        ("dense fp8 linear", "stock 1x128 act quant + DeepGEMM fp8_gemm_nt (per shape: baseline_kernels_ran)",
         "per-token-group quant + DeepGEMM / CUTLASS / FlashInfer chosen per M",
         "DeepGEMM for every M (vLLM's own choice for block FP8 on SM90 where DeepGEMM is enabled)"),
        ("moe experts", "DeepGEMM grouped FP8 GEMMs (masked in decode graphs, contiguous in eager steps)",
         "DeepGEMM grouped FP8 GEMMs with vLLM's activation quant and combine", "same GEMMs"),
        ("attention", "decode: FlashMLA flash_mla_with_kvcache FP8; prefill: torch dequant + flash_mla_sparse_fwd",
         "the same FlashMLA kernels; prefill dequant by vLLM's gather kernel",
         "the prefill dequant is torch ops (vLLM's cp_gather cache kernel is in _C_cache_ops, not called)"),
        ("router gemm", "FP32 F.linear (cuBLAS)", "vLLM's gate GEMM with small-batch kernel tiers",
         "cuBLAS FP32; the small-batch tiers are not called"),
    ]
    out = [{"op": op, "harness": h, "vllm": v, "note": n} for op, h, v, n in rows]
    out.append({"op": "(vLLM compiled libraries)", "harness": dict(_V.STATUS), "vllm": "", "note":
                "ZERODIFF_BASELINE_VLLM_OPS=" + _V.policy()})
    return out
