"""MoE routing and routed experts with one value per token in both dispatch layouts.

Public API::

    route(logits, k, *, scoring="softmax", bias=None, renormalize=True, routed_scale=1.0, backend=None)
        -> (weights fp32 [T, k], ids int32 [T, k])
    route_hashed(logits, ids, *, scoring="sqrtsoftplus", renormalize=True, routed_scale=1.0, backend=None)
        -> weights fp32 [T, k]   (experts given by a table, e.g. DeepSeek-V4's hash-routed layers)
    routing_scores(logits, scoring="softmax", *, backend=None) -> fp32 [T, E]   (the scoring step alone)
    MoEWeights(w13: Fp8Weight [E, 2I, H], w2: Fp8Weight [E, H, I])      (list of per-expert Fp8Weight accepted)
    MoEWeights.from_master(w13_bf16 [E, 2I, H], w2_bf16 [E, H, I], *, ue8m0=False, backend=None)
    MoEWeights.requantize_(w13_bf16, w2_bf16)                              (same storage)
    moe_experts(x, weights, ids, experts, *, layout="contiguous"|"masked", capacity=None, clamp_limit=None,
                backend=None, validate=False, act_backend=None) -> fp32 [T, H]
        # additions: validate=True checks ids (range, uniqueness per token; host sync);
        # act_backend overrides the SiLU*mul->FP8 step's backend (CPU tests: "reference" is fast there)
    shared_expert(x, w13: Fp8Weight [2I, H], w2: Fp8Weight [H, I], *, clamp_limit=None, backend=None) -> bf16 [T, H]
    finish(routed_fp32, shared_bf16=None) -> bf16 [T, H]        (the one rounding at the end)
    expert_rows(x, ids, experts, *, layout, capacity, clamp_limit, backend, validate, act_backend)
        -> (y bf16 [rows + 1, H], DispatchPlan)   (steps 1-4 below; moe_experts = expert_rows + combine)
    plan_dispatch(ids, num_experts, *, layout, capacity=None) -> DispatchPlan   (index maps; also for tests)
    combine(y, dest, weights, *, backend=None) -> fp32 [T, H]
    ALIGN  (= 64: contiguous-layout alignment and GEMM row-tile height; a static constant, never from M)
    DG_ALIGN (= 128), deepgemm_grouped_verdict(N, K, device, ue8m0=False) -> (ok, detail)   (backend="deepgemm")

Routing contract (``route``):

* ``scores`` from ``logits`` (FP32 [T, E]) per row in FP32, one row per program (Triton) with a fixed
  reduction tree: ``softmax`` (``m = max``, ``e = exp(x - m)``, ``s = sum(e)``, ``p = e / s``),
  ``sigmoid`` (``1 / (1 + exp(-x))``), ``sqrtsoftplus`` (``sqrt(softplus(x))``, softplus = ``x`` above 20,
  else ``log1p(exp(x))`` computed as ``log(u) * y / (u - 1)`` with ``y = exp(x)``, ``u = 1 + y``; ``y`` when
  ``u == 1``). ``exp``/``log`` are the GPU's (``tl.exp``); the value is the same on both RL sides because
  both call this function.
* Selection: :func:`zerodiff.ops.topk.deterministic_topk` on ``scores + bias`` (FP32 add; ``bias=None``:
  on ``scores``): the k largest, ties to the larger expert id; slot order = the Top-K output order,
  i.e. **expert id descending**.
* ``weights[t, j] = scores[t, ids[t, j]]`` (unbiased); with ``renormalize``: divided (RNE) by
  ``((w0 + w1) + w2) + ...`` summed in slot order; then multiplied by FP32 ``routed_scale`` (skipped at 1.0).
  Group-limited routing (n_group / topk_group) is not implemented.

Experts contract (``moe_experts``), per token t and slot j (``e = ids[t, j]``):

1. ``xq, xs = quant_act(x)`` once per token (1x128 groups, the experts' scale variant);
2. ``h = grouped FP8 GEMM(xq[t], w13[e])`` -> BF16 [2I] (kernel of :mod:`zerodiff.ops.fp8_gemm`, per-row
   math independent of the layout, of M and of the row's position);
3. ``a = silu_mul_quant_fp8(h)`` (:mod:`zerodiff.ops.silu_mul_quant`; its masked variant in the masked
   layout, per-row identical by its contract);
4. ``y = grouped FP8 GEMM(a, w2[e])`` -> BF16 [H];
5. combine on the token's owner: ``acc = +0; for j in 0..k-1: acc = acc + fp32(weights[t, j]) * fp32(y_j)``
   (one FP32 multiply and one FP32 add per slot, in slot order, FP fusion off), returned in FP32.
   The caller adds the shared expert in FP32 and rounds once (:func:`finish`).

So a token's output never depends on the layout, the other tokens, the expert loads, the capacity or the
padding. Slots with ``ids == -1`` (Top-K padding) contribute nothing (their row is a zero dump row and their
weight is replaced by 0). Expert ids must be unique within a token (a property of the Top-K; checked when
``validate=True``).

Layouts:

* ``"contiguous"`` (training): rows packed by expert in ascending expert order, inside an expert in
  (token, slot) order; each expert's segment padded to a multiple of :data:`ALIGN` with zero rows. The
  buffer has a static size ``roundup(T*k + min(E, T*k) * (ALIGN - 1), ALIGN)`` rows; row tiles past the last
  segment are skipped.
* ``"masked"`` (rollout, DeepEP low-latency style): ``[E, capacity, H]`` with per-expert ``counts``; a
  static ``capacity`` (rounded up internally to a multiple of ALIGN). Overflow (an expert receiving more than
  ``capacity`` rows) raises ``InputError`` naming the capacity; the check needs a host sync and is skipped
  when ``capacity >= T`` (overflow impossible: a token reaches an expert at most once), which is the
  CUDA-graph-safe setting.

Backends: ``None`` (Triton on CUDA, reference GEMMs/activation on CPU), ``"triton"``, ``"reference"``.
``"deepgemm"`` (``moe_experts`` only): DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous`` / ``_masked`` with
contiguous segments aligned to :data:`DG_ALIGN` (128) and ``expected_m`` = the padded capacity (static),
allowed only after :func:`deepgemm_grouped_verdict` verified, for both expert GEMM shapes, that a row's value
is bitwise the same alone, among other tokens, at other expert loads and ranks, and in both layouts;
otherwise it raises ``RuntimeError`` (fail closed). Its values differ from the Triton path's: both RL sides
must use the same backend. Never the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _triton
from .._triton import HAVE_TRITON, LAUNCH_OPTS
from . import fp8_gemm as _g
from .fp8_quant import Fp8Weight, quant_act
from ..errors import InputError

ALIGN = _g.BLOCK_M
_SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _score_kernel(l_ptr, o_ptr, E, stride_l, stride_o, SCORING: tl.constexpr, BLOCK_E: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        mask = cols < E
        x = tl.load(l_ptr + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if SCORING == 0:
            m = tl.max(x, axis=0)
            ex = tl.exp(x - m)
            ex = tl.where(mask, ex, 0.0)
            s = tl.sum(ex, axis=0)
            p = tl.div_rn(ex, tl.full(ex.shape, 1.0, tl.float32) * s)
        elif SCORING == 1:
            one = tl.full(x.shape, 1.0, tl.float32)
            p = tl.div_rn(one, one + tl.exp(-x))
        else:
            y = tl.exp(x)
            u = 1.0 + y
            lp = tl.where(u == 1.0, y, tl.div_rn(tl.log(u) * y, u - 1.0))
            sp = tl.where(x > 20.0, x, lp)
            p = tl.sqrt_rn(sp)
        tl.store(o_ptr + row * stride_o + cols, p, mask=mask)

    @triton.jit
    def _combine_kernel(y_ptr, d_ptr, w_ptr, o_ptr, H, stride_y, stride_d, stride_w, stride_o,
                        K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(K):
            d = tl.load(d_ptr + t * stride_d + j).to(tl.int64)
            w = tl.load(w_ptr + t * stride_w + j)
            y = tl.load(y_ptr + d * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
            acc = acc + w * y
        tl.store(o_ptr + t * stride_o + cols, acc, mask=mask)


def _use_triton(backend, t: torch.Tensor, name: str) -> bool:
    if backend is None:
        return t.is_cuda and _triton.triton_usable_for(t.device)
    if backend == "deepgemm":
        raise InputError(f"zerodiff.moe.{name}: backend='deepgemm' refused: DeepGEMM's grouped FP8 kernels are "
                         "not verified row- and layout-invariant; use 'triton' on both RL sides")
    if backend not in ("triton", "reference"):
        raise InputError(f"zerodiff.moe.{name}: unknown backend={backend!r} (None, 'triton' or 'reference')")
    if backend == "triton":
        _triton.require_triton()
        if not _triton.triton_usable_for(t.device):
            raise RuntimeError(f"zerodiff.moe.{name}: backend='triton' cannot run on {t.device} here")
        return True
    return False


# ------------------------------------------------------------------------------------------------ routing
def _scores_ref(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.to(torch.float32)
    if scoring == "softmax":
        m = x.amax(dim=-1, keepdim=True)
        ex = torch.exp(x - m)
        return ex / ex.sum(dim=-1, keepdim=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-x))
    y = torch.exp(x)
    u = 1.0 + y
    lp = torch.where(u == 1.0, y, (torch.log(u) * y) / (u - 1.0))
    return torch.sqrt(torch.where(x > 20.0, x, lp))


def routing_scores(logits: torch.Tensor, scoring: str = "softmax", *, backend=None) -> torch.Tensor:
    """FP32 scores [T, E] from router logits, one row per program (see module contract)."""
    if scoring not in _SCORING:
        raise InputError(f"zerodiff.moe.route: scoring={scoring!r} unknown (softmax|sigmoid|sqrtsoftplus)")
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise InputError(f"zerodiff.moe.route: logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    if not _use_triton(backend, logits, "route"):
        return _scores_ref(logits, scoring)
    T, E = logits.shape
    out = torch.empty((T, E), dtype=torch.float32, device=logits.device)
    if T:
        BLOCK_E = triton.next_power_of_2(max(E, 16))
        _score_kernel[(T,)](logits, out, E, logits.stride(0), out.stride(0), SCORING=_SCORING[scoring],
                            BLOCK_E=BLOCK_E, num_warps=4 if BLOCK_E >= 512 else 1, **LAUNCH_OPTS)
    return out


def route(logits: torch.Tensor, k: int, *, scoring: str = "softmax", bias=None, renormalize: bool = True,
          routed_scale: float = 1.0, backend=None):
    """(weights fp32 [T, k], ids int32 [T, k]); slot order = expert id descending (see module contract)."""
    from .topk import deterministic_topk

    scores = routing_scores(logits, scoring, backend=backend)
    T, E = scores.shape
    if not isinstance(k, int) or not 1 <= k <= E:
        raise InputError(f"zerodiff.moe.route: k={k!r} must be an int in [1, E={E}]")
    sel = scores
    if bias is not None:
        if bias.shape != (E,) or bias.dtype != torch.float32:
            raise InputError(f"zerodiff.moe.route: bias must be fp32 [{E}], got {bias.dtype} {tuple(bias.shape)}")
        sel = scores + bias[None, :]
    tk_backend = "reference" if backend == "reference" else backend
    ids = deterministic_topk(sel, k, backend=tk_backend)
    return _slot_weights(scores, ids, renormalize, routed_scale), ids.to(torch.int32).contiguous()


def _slot_weights(scores, ids, renormalize, routed_scale):
    """``scores[t, ids[t, j]]`` (0 for ids == -1), renormalised by the slot-order sum, times routed_scale."""
    w = scores.gather(1, ids.long().clamp(min=0))
    w = torch.where(ids >= 0, w, torch.zeros((), dtype=w.dtype, device=w.device))
    if renormalize:
        denom = w[:, 0]
        for j in range(1, ids.shape[1]):
            denom = denom + w[:, j]
        w = w / denom[:, None]
    if routed_scale != 1.0:
        w = w * float(routed_scale)  # fp32 multiply by fp32(routed_scale); no host->device copy (graph-safe)
    return w.contiguous()


def route_hashed(logits: torch.Tensor, ids: torch.Tensor, *, scoring: str = "sqrtsoftplus", renormalize: bool = True,
                 routed_scale: float = 1.0, backend=None) -> torch.Tensor:
    """Weights for experts chosen by a table (DeepSeek-V4 hash-routed layers: ``ids = tid2eid[token_id]``):
    fp32 [T, k] with ``route``'s weighting rule on the given ``ids`` [T, k] (slot order = the table's order):
    ``scores[t, ids[t, j]]``, renormalised by ``((w0 + w1) + w2) + ...`` when ``renormalize``, then times
    fp32 ``routed_scale``. No bias (the table replaces the selection)."""
    scores = routing_scores(logits, scoring, backend=backend)
    if ids.dim() != 2 or ids.shape[0] != scores.shape[0]:
        raise InputError(f"zerodiff.moe.route_hashed: ids must be [T={scores.shape[0]}, k], got {tuple(ids.shape)}")
    return _slot_weights(scores, ids, renormalize, routed_scale)


# ------------------------------------------------------------------------------------------------ weights
@dataclass
class MoEWeights:
    """Routed-expert FP8 weights, stacked: ``w13.q [E, 2I, H]`` (gate rows first, then up), ``w2.q [E, H, I]``."""

    w13: Fp8Weight
    w2: Fp8Weight

    def __post_init__(self):
        if isinstance(self.w13, (list, tuple)):
            self.w13 = _stack(self.w13, "w13")
        if isinstance(self.w2, (list, tuple)):
            self.w2 = _stack(self.w2, "w2")
        if self.w13.q.dim() != 3 or self.w2.q.dim() != 3:
            raise InputError("zerodiff.moe: MoEWeights needs stacked [E, N, K] Fp8Weights (or lists of 2-D ones)")
        E, I2, H = self.w13.q.shape
        if tuple(self.w2.q.shape) != (E, H, I2 // 2) or I2 % 2:
            raise InputError(f"zerodiff.moe: w13 {tuple(self.w13.q.shape)} and w2 {tuple(self.w2.q.shape)} "
                             "do not match ([E, 2I, H] and [E, H, I])")
        if self.w13.ue8m0 != self.w2.ue8m0:
            raise InputError("zerodiff.moe: w13 and w2 use different scale variants (ue8m0)")

    @classmethod
    def from_master(cls, w13: torch.Tensor, w2: torch.Tensor, *, ue8m0: bool = False, backend=None):
        return cls(Fp8Weight.from_master(w13, ue8m0=ue8m0, backend=backend),
                   Fp8Weight.from_master(w2, ue8m0=ue8m0, backend=backend))

    def requantize_(self, w13: torch.Tensor, w2: torch.Tensor, *, backend=None):
        self.w13.requantize_(w13, backend=backend)
        self.w2.requantize_(w2, backend=backend)
        return self

    @property
    def num_experts(self) -> int:
        return self.w13.q.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.q.shape[2]

    @property
    def inter(self) -> int:
        return self.w13.q.shape[1] // 2


def _stack(ws, name):
    if not ws or any(w.q.dim() != 2 for w in ws):
        raise InputError(f"zerodiff.moe: {name} list must hold 2-D Fp8Weights")
    return Fp8Weight(torch.stack([w.q for w in ws]), torch.stack([w.scale for w in ws]), ws[0].ue8m0)


# ------------------------------------------------------------------------------------------------ dispatch
@dataclass
class DispatchPlan:
    """Index maps of one dispatch. ``dest [T, k]`` int64: buffer row of slot (t, j) (``dump`` for id -1);
    ``counts [E]`` int32 rows per expert; ``tile_expert [rows / ALIGN]`` int32 (-1: skipped tile);
    ``rows``: buffer rows used by the GEMMs; ``dump``: index of the extra zero row (== rows);
    ``cap_pad``: masked layout's per-expert rows (capacity rounded up to ALIGN), else 0."""

    layout: str
    dest: torch.Tensor
    counts: torch.Tensor
    tile_expert: torch.Tensor
    rows: int
    dump: int
    cap_pad: int = 0
    align: int = ALIGN


def plan_dispatch(ids: torch.Tensor, num_experts: int, *, layout: str = "contiguous", capacity=None,
                  validate: bool = False, align: int = ALIGN) -> DispatchPlan:
    """Where each (token, slot) row goes in the packed buffer. Device ops only (no host sync) except the
    masked-layout overflow check when ``capacity < T`` and ``validate=True`` checks."""
    if align % ALIGN:
        raise InputError(f"zerodiff.moe: align={align} must be a multiple of ALIGN={ALIGN}")
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise InputError(f"zerodiff.moe: ids must be int32 [T, k], got {ids.dtype} {tuple(ids.shape)}")
    T, k = ids.shape
    E = int(num_experts)
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    valid = flat >= 0
    if validate:
        if bool((flat >= E).any()):
            raise InputError(f"zerodiff.moe: ids contain expert ids >= num_experts={E}")
        if bool((flat < -1).any()):
            raise InputError("zerodiff.moe: ids contain values < -1")
        s = torch.sort(ids.to(torch.int64), dim=1).values
        if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
            raise InputError("zerodiff.moe: a token is routed to the same expert twice (ids not unique per row)")
    key = torch.where(valid, flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    # scatter_add, not bincount: bincount syncs with the host on CUDA (breaks graph capture)
    counts64 = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts64, 0) - counts64
    rank_sorted = torch.arange(T * k, device=dev) - starts[key[order]]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    counts = counts64[:E]
    if layout == "contiguous":
        padded = (counts + align - 1) // align * align
        seg_end = torch.cumsum(padded, 0)
        seg_start = seg_end - padded
        rows = T * k + min(E, T * k) * (align - 1)
        rows = (rows + align - 1) // align * align
        dest = seg_start[key.clamp(max=E - 1)] + rank
        n_tiles = rows // ALIGN
        tile_start = torch.arange(n_tiles, device=dev, dtype=torch.int64) * ALIGN
        te = torch.searchsorted(seg_end, tile_start, right=True)
        tile_expert = torch.where(te < E, te, torch.full_like(te, -1)).to(torch.int32)
        cap_pad = 0
    elif layout == "masked":
        if capacity is None or int(capacity) < 1:
            raise InputError(f"zerodiff.moe: layout='masked' needs a static capacity >= 1, got capacity={capacity!r}")
        capacity = int(capacity)
        if capacity < T:
            cmax = int(counts.max()) if E else 0
            if cmax > capacity:
                e_bad = int(torch.argmax(counts))
                raise InputError(f"zerodiff.moe: masked layout overflow: expert {e_bad} receives {cmax} rows but "
                                 f"capacity={capacity}; raise capacity (capacity >= T={T} can never overflow)")
        cap_pad = (capacity + align - 1) // align * align
        rows = E * cap_pad
        dest = key.clamp(max=E - 1) * cap_pad + rank
        tpe = cap_pad // ALIGN
        ti = torch.arange(E * tpe, device=dev, dtype=torch.int64)
        e_of = ti // tpe
        local = (ti % tpe) * ALIGN
        tile_expert = torch.where(local < counts[e_of], e_of, torch.full_like(e_of, -1)).to(torch.int32)
    else:
        raise InputError(f"zerodiff.moe: layout={layout!r} unknown (use 'contiguous' or 'masked')")
    dest = torch.where(valid, dest, torch.full_like(dest, rows)).reshape(T, k)
    return DispatchPlan(layout, dest, counts.to(torch.int32), tile_expert, rows, rows, cap_pad, align)


def _row_expert(plan: DispatchPlan) -> torch.Tensor:
    """Per-row expert id of a contiguous plan (-1 on padding rows): DeepGEMM's ``grouped_layout``."""
    dev = plan.counts.device
    counts = plan.counts.to(torch.int64)
    padded = (counts + plan.align - 1) // plan.align * plan.align
    seg_end = torch.cumsum(padded, 0)
    r = torch.arange(plan.rows, device=dev, dtype=torch.int64)
    e = torch.searchsorted(seg_end, r, right=True)
    ec = e.clamp(max=counts.shape[0] - 1)
    ok = (e < counts.shape[0]) & (r - (seg_end[ec] - padded[ec]) < counts[ec])
    return torch.where(ok, e, torch.full_like(e, -1)).to(torch.int32)


def combine(y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor, *, backend=None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * fp32(y[dest[t, j]])`` in slot order j = 0..k-1 from +0, FP32."""
    T, k = dest.shape
    H = y.shape[1]
    if not _use_triton(backend, y, "combine"):
        out = torch.zeros((T, H), dtype=torch.float32, device=y.device)
        for j in range(k):
            out = out + weights[:, j : j + 1] * y[dest[:, j]].to(torch.float32)
        return out
    out = torch.empty((T, H), dtype=torch.float32, device=y.device)
    if T == 0:
        return out
    w = weights.contiguous()
    d = dest.contiguous()
    BLOCK_H = 1024
    _combine_kernel[(T, triton.cdiv(H, BLOCK_H))](y, d, w, out, H, y.stride(0), d.stride(0), w.stride(0),
                                                  out.stride(0), K=k, BLOCK_H=BLOCK_H, num_warps=4, **LAUNCH_OPTS)
    return out


def _act(h, plan, clamp_limit, ue8m0, be):
    from . import silu_mul_quant as smq

    if plan.layout == "masked":
        E = plan.counts.shape[0]
        h3 = h[: plan.rows].view(E, plan.cap_pad, h.shape[1])
        q, s = smq.silu_mul_quant_fp8_masked(h3, plan.counts, clamp_limit=clamp_limit, ue8m0=ue8m0, backend=be)
        return q.view(plan.rows, -1), s.view(plan.rows, -1)
    return smq.silu_mul_quant_fp8(h[: plan.rows], clamp_limit=clamp_limit, ue8m0=ue8m0, backend=be)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: MoEWeights, *,
                layout: str = "contiguous", capacity=None, clamp_limit=None, backend=None,
                validate: bool = False, act_backend=None) -> torch.Tensor:
    """Routed experts, combined per token in FP32 in slot order -> fp32 [T, H] (see module contract)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise InputError(f"zerodiff.moe: x must be bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
    if not isinstance(experts, MoEWeights):
        raise InputError("zerodiff.moe: experts must be a MoEWeights")
    T, H = x.shape
    if H != experts.hidden:
        raise InputError(f"zerodiff.moe: x has H={H}, experts have H={experts.hidden}")
    if weights.shape != ids.shape or weights.dtype != torch.float32 or ids.shape[0] != T:
        raise InputError(f"zerodiff.moe: weights must be fp32 with the shape of ids [T={T}, k], got "
                         f"{weights.dtype} {tuple(weights.shape)} and ids {tuple(ids.shape)}")
    if backend == "deepgemm":
        return _moe_experts_deepgemm(x, weights, ids, experts, layout, capacity, clamp_limit, validate)
    y, plan, gbe = _expert_rows(x, ids, experts, layout, capacity, clamp_limit, backend, validate, act_backend)
    w = torch.where(ids >= 0, weights, torch.zeros((), dtype=weights.dtype, device=x.device))
    return combine(y, plan.dest, w, backend=gbe)


def expert_rows(x: torch.Tensor, ids: torch.Tensor, experts: MoEWeights, *, layout: str = "contiguous",
                capacity=None, clamp_limit=None, backend=None, validate: bool = False, act_backend=None):
    """Steps 1-4 of the experts contract without the combine: ``(y bf16 [rows + 1, H], plan)`` where
    ``y[plan.dest[t, j]]`` is the expert output of slot (t, j) (the zero dump row for ids == -1). These are the
    rows :func:`moe_experts` combines, bit for bit (the expert-parallel path runs them on the owner of the
    experts). Backends ``None``, ``"triton"``, ``"reference"``."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise InputError(f"zerodiff.moe: x must be bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
    if not isinstance(experts, MoEWeights):
        raise InputError("zerodiff.moe: experts must be a MoEWeights")
    if x.shape[1] != experts.hidden:
        raise InputError(f"zerodiff.moe: x has H={x.shape[1]}, experts have H={experts.hidden}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise InputError(f"zerodiff.moe: ids must be [T={x.shape[0]}, k], got {tuple(ids.shape)}")
    if backend == "deepgemm":
        raise InputError("zerodiff.moe.expert_rows: backend='deepgemm' is not offered here (None, 'triton' or "
                         "'reference')")
    y, plan, _ = _expert_rows(x, ids, experts, layout, capacity, clamp_limit, backend, validate, act_backend)
    return y, plan


def _expert_rows(x, ids, experts, layout, capacity, clamp_limit, backend, validate, act_backend):
    T, H = x.shape
    use_triton = _use_triton(backend, x, "moe_experts")
    gbe = "triton" if use_triton else "reference"
    E = experts.num_experts
    ue8m0 = experts.w13.ue8m0
    plan = plan_dispatch(ids, E, layout=layout, capacity=capacity, validate=validate)
    dev = x.device
    xq, xs = quant_act(x, ue8m0=ue8m0, backend=gbe)
    k = ids.shape[1]
    tok = torch.arange(T, device=dev).repeat_interleave(k)
    a_u8 = torch.zeros((plan.rows + 1, H), dtype=torch.uint8, device=dev)
    a_s = torch.zeros((plan.rows + 1, xs.shape[1]), dtype=torch.float32, device=dev)
    d = plan.dest.reshape(-1)
    a_u8[d] = xq.view(torch.uint8)[tok]
    a_s[d] = xs[tok]
    a_q = a_u8[: plan.rows].view(torch.float8_e4m3fn)
    a_s = a_s[: plan.rows]
    # rows of skipped tiles are never written nor read downstream: no memset needed
    h = torch.empty((plan.rows, 2 * experts.inter), dtype=torch.bfloat16, device=dev)
    _g.grouped_fp8_gemm(a_q, a_s, experts.w13.q, experts.w13.scale, plan.tile_expert, backend=gbe, out=h)
    if act_backend not in (None, "triton", "reference"):
        raise InputError(f"zerodiff.moe: act_backend={act_backend!r} (None, 'triton' or 'reference')")
    hq, hs = _act(h, plan, clamp_limit, ue8m0, act_backend or gbe)
    y = torch.empty((plan.rows + 1, H), dtype=torch.bfloat16, device=dev)
    y[plan.rows].zero_()  # the dump row read by padding slots (ids == -1)
    _g.grouped_fp8_gemm(hq, hs, experts.w2.q, experts.w2.scale, plan.tile_expert, backend=gbe, out=y[: plan.rows])
    return y, plan, gbe


# ------------------------------------------------------------------------------------------------ DeepGEMM
#: contiguous-layout alignment used with DeepGEMM's grouped kernels (SM90 DeepGEMM packs 128-row segments)
DG_ALIGN = 128
_DG_VERDICTS: dict = {}


def _dg_grouped(dg, a_q, a_s, w: Fp8Weight, plan: DispatchPlan, out):
    if plan.layout == "contiguous":
        dg.m_grouped_fp8_gemm_nt_contiguous((a_q, a_s), (w.q, w.scale), out, _row_expert(plan),
                                            disable_ue8m0_cast=not w.ue8m0)
    else:
        E, C = w.q.shape[0], plan.cap_pad
        dg.m_grouped_fp8_gemm_nt_masked((a_q.view(E, C, -1), a_s.view(E, C, -1)), (w.q, w.scale),
                                        out.view(E, C, -1), plan.counts, C, disable_ue8m0_cast=not w.ue8m0)
    return out


def _dg_one_gemm(dg, xq, xs, ids, w: Fp8Weight, layout, capacity):
    """Dispatch FP8 rows by ``ids`` (k=1), run the DeepGEMM grouped kernel, return the rows per token."""
    plan = plan_dispatch(ids, w.q.shape[0], layout=layout, capacity=capacity, align=DG_ALIGN)
    K = xq.shape[1]
    a = torch.zeros((plan.rows + 1, K), dtype=torch.uint8, device=xq.device)
    a_s = torch.zeros((plan.rows + 1, xs.shape[1]), dtype=torch.float32, device=xq.device)
    d = plan.dest.reshape(-1)
    a[d] = xq.view(torch.uint8)
    a_s[d] = xs
    out = torch.empty((plan.rows, w.q.shape[1]), dtype=torch.bfloat16, device=xq.device)
    _dg_grouped(dg, a[: plan.rows].view(torch.float8_e4m3fn), a_s[: plan.rows].contiguous(), w, plan, out)
    return out[plan.dest[:, 0].clamp(max=plan.rows - 1)]


def deepgemm_grouped_verdict(N: int, K: int, device, ue8m0: bool = False) -> tuple[bool, str]:
    """Probe DeepGEMM's grouped FP8 kernels (contiguous and masked) at (N, K); cached per (N, K, device, ue8m0).

    Two victim tokens routed to expert 1 of 4 are computed alone (masked, capacity 128) and then among
    filler tokens with expert-1 loads 1, 2, 17, 33, 65, 128, 300, 1000 (other experts random), at ranks
    0, load//2 and load-1, in both layouts (masked capacities: the load rounded up to 128, and +256).
    Every victim row must be bitwise equal to its alone value."""
    from .. import backends

    device = _g._norm_device(device)
    key = (int(N), int(K), str(device), bool(ue8m0))
    if key in _DG_VERDICTS:
        return _DG_VERDICTS[key]
    dg, why = backends.deep_gemm_on(device)
    if dg is None:
        return False, why
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("zerodiff.moe: the DeepGEMM grouped probe cannot run inside CUDA graph capture; call "
                           "moe.deepgemm_grouped_verdict for the expert shapes at model load")
    verdict = _probe_grouped(dg, N, K, device, ue8m0)
    _DG_VERDICTS[key] = verdict
    return verdict


def _probe_grouped(dg, N, K, device, ue8m0):
    try:
        E = 4
        g = torch.Generator(device=device)
        g.manual_seed(77 + N + 3 * K)
        w = Fp8Weight.from_master((torch.randn((E, N, K), generator=g, device=device) * 0.05).to(torch.bfloat16),
                                  ue8m0=ue8m0, backend="triton")
        v = (torch.randn((2, K), generator=g, device=device) * 2).to(torch.bfloat16)
        vq, vs = quant_act(v, ue8m0=ue8m0, backend="triton")
        one = torch.ones((1, 1), dtype=torch.int32, device=device)
        alone = [_dg_one_gemm(dg, vq[i : i + 1], vs[i : i + 1], one, w, "masked", 128).clone() for i in range(2)]
        for load in (1, 2, 17, 33, 65, 128, 300, 1000):
            others = torch.randint(0, 200, (E,), generator=g, device=device).tolist()
            for p in sorted({0, load // 2, load - 1}):
                vi = (p // 2) % 2  # alternate victims
                ids_l = []
                for e in range(E):
                    ids_l += [e] * (load if e == 1 else others[e])
                T = len(ids_l)
                ids = torch.tensor(ids_l, dtype=torch.int32, device=device).view(T, 1)
                x = (torch.randn((T, K), generator=g, device=device) * 3).to(torch.bfloat16)
                xq, xs = quant_act(x, ue8m0=ue8m0, backend="triton")
                t_v = sum(others[e] for e in range(1)) + p  # token index of expert 1's p-th row
                xq.view(torch.uint8)[t_v] = vq.view(torch.uint8)[vi]
                xs[t_v] = vs[vi]
                mx = max(load, max(others))
                cap = (mx + 127) // 128 * 128
                for layout, capacity in (("contiguous", None), ("masked", cap), ("masked", cap + 256)):
                    o = _dg_one_gemm(dg, xq, xs, ids, w, layout, capacity)
                    if not torch.equal(o[t_v : t_v + 1], alone[vi]):
                        nd = int((o[t_v] != alone[vi][0]).sum())
                        return False, (f"{layout} (capacity={capacity}) expert load {load}, rank {p}: victim row differs "
                                       f"from its value alone in {nd} of {N} outputs")
        torch.cuda.synchronize(device)
    except Exception as ex:
        return False, f"DeepGEMM grouped kernels failed on the probe: {type(ex).__name__}: {ex}"
    return True, "verified: victim rows equal alone, masked and contiguous, loads 1..1000, 3 ranks"


def _moe_experts_deepgemm(x, weights, ids, experts, layout, capacity, clamp_limit, validate):
    from .. import backends
    from . import silu_mul_quant as smq

    I2, H = experts.w13.q.shape[1:]
    ue8m0 = experts.w13.ue8m0
    for (N, K) in ((I2, H), (H, I2 // 2)):
        ok, why = deepgemm_grouped_verdict(N, K, x.device, ue8m0)
        if not ok:
            raise RuntimeError(f"zerodiff.moe: backend='deepgemm' refused for the expert GEMM (N={N}, K={K}) on "
                               f"{x.device}: {why}. Use backend='triton' on both RL sides.")
    dg = backends.deep_gemm()
    T = x.shape[0]
    k = ids.shape[1]
    dev = x.device
    plan = plan_dispatch(ids, experts.num_experts, layout=layout, capacity=capacity, validate=validate,
                         align=DG_ALIGN)
    xq, xs = quant_act(x, ue8m0=ue8m0, backend="triton")
    tok = torch.arange(T, device=dev).repeat_interleave(k)
    a = torch.zeros((plan.rows + 1, H), dtype=torch.uint8, device=dev)
    a_s = torch.zeros((plan.rows + 1, xs.shape[1]), dtype=torch.float32, device=dev)
    d = plan.dest.reshape(-1)
    a[d] = xq.view(torch.uint8)[tok]
    a_s[d] = xs[tok]
    h = torch.empty((plan.rows, I2), dtype=torch.bfloat16, device=dev)
    _dg_grouped(dg, a[: plan.rows].view(torch.float8_e4m3fn), a_s[: plan.rows].contiguous(), experts.w13, plan, h)
    if layout == "masked":
        E = experts.num_experts
        hq, hs = smq.silu_mul_quant_fp8_masked(h.view(E, plan.cap_pad, I2), plan.counts, clamp_limit=clamp_limit,
                                               ue8m0=ue8m0, backend="triton")
        hq, hs = hq.view(plan.rows, -1), hs.view(plan.rows, -1)
    else:
        hq, hs = smq.silu_mul_quant_fp8(h, clamp_limit=clamp_limit, ue8m0=ue8m0, backend="triton")
    y = torch.empty((plan.rows + 1, H), dtype=torch.bfloat16, device=dev)
    y[plan.rows].zero_()
    _dg_grouped(dg, hq, hs.contiguous(), experts.w2, plan, y[: plan.rows])
    w = torch.where(ids >= 0, weights, torch.zeros((), dtype=weights.dtype, device=dev))
    return combine(y, plan.dest, w, backend="triton")


def shared_expert(x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, *, clamp_limit=None, backend=None):
    """Shared expert: ``fp8_linear(x, w13)`` -> SiLU*mul -> FP8 -> ``fp8_gemm(., w2)`` -> bf16 [T, H]."""
    from . import silu_mul_quant as smq

    h = _g.fp8_linear(x, w13, backend=backend)
    if backend == "reference":
        sbe = "reference"
    elif x.is_cuda:
        sbe = "triton"
    else:
        sbe = "triton" if backend == "triton" else "reference"
    q, s = smq.silu_mul_quant_fp8(h, clamp_limit=clamp_limit, ue8m0=w2.ue8m0, backend=sbe)
    return _g.fp8_gemm(q, s, w2.q, w2.scale, backend=backend, ue8m0=w2.ue8m0)


def finish(routed: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """``bf16(routed_fp32 + fp32(shared_bf16))``: the one rounding of the MoE block's output."""
    if shared is None:
        return routed.to(torch.bfloat16)
    return (routed + shared.to(torch.float32)).to(torch.bfloat16)
