"""The thin ops layer the end-to-end model runs on: one object per mode, the same model code for all.

Modes
-----
* :class:`ConsistentOps` (``"consistent"``): every call goes to a zerodiff op (on CPU tensors, for some ops, to
  an exact-structure pure-torch implementation of the same contract in :mod:`zerodiff.model.exact_ops`).
  Rollout and training use the very same object type, so a token's value is computed by the same
  functions on both sides; every op is per token / per row, so it never depends on the batch. On CPU
  tensors the zerodiff ops run their reference backends; CPU reference calls whose float64 internals could
  depend on the tensor shape (mHC, SiLU) are run on fixed 64-row chunks.
* :class:`BaselineRolloutOps` (``"baseline"``): the NEGATIVE CONTROL, the frozen stock per-op choice
  :data:`BASELINE_CHOICE` on BOTH sides (same kernels, same precision: the diff, which must be > 0, comes only
  from the stock kernels' batch and phase dependence). :class:`BaselineTrainOps` holds stock training-style
  paths; paired with the inference ones (``"baseline_mixed"``, see :data:`MODES`) it mixes precision into the
  diff, so it is not the control.

Binding table (the binding of each op is the one marked line per op below)::

    deterministic_topk, quant_act, Fp8Weight, fp8_linear, fp8_gemm,
    silu_mul_quant_fp8, mhc_pre, mhc_post, kv cache write/gather      -> zerodiff.ops.*          (real)
    CUDA: rms_norm, bf16_gemm, router_gemm, token_logprobs, sparse_mla_attention (workspace read path),
          indexer_topk + FP8 index-key cache, moe.route, moe.moe_experts -> zerodiff.ops.*     (real)
    CPU:  the same ops as exact-structure pure torch                   -> zerodiff.model.exact_ops

Training (autograd)
-------------------
Visible values always come from the kernels under ``torch.no_grad()``. When a :class:`Tape` is active
(training forward), each op also builds an FP32 PyTorch graph of the same math with the FP8 quantisation
treated as identity (STE) and the BF16/FP32 masters as leaves, evaluated AT the visible input values:
input ``x`` enters the graph as ``x.float() + (g - g.detach())`` (value = the kernel's bits, gradient to the
producer's graph ``g``). The final log-probs are ``_Attach(visible, graph)``: value bit-identical to the
kernel output, gradient from the graph. Every master enters a graph through :class:`_Guard`, whose backward
first checks the tensor's version counter against the forward's and raises ``WeightVersionError``. The
DSA indexer is not trained (its selection is a discrete input to the attention graph), and MoE expert ids
are discrete too; the router weights get gradients through the routing graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from ..errors import WeightVersionError
from . import exact_ops as _exact
from .detmath import det_exp, tree_sum
from . import baseline_cuda as _stock_cuda

# ---- bindings: consistent mode ------------------------------------------------------------------------
from zerodiff.ops.topk import deterministic_topk  # real
from zerodiff.ops.fp8_quant import Fp8Weight, quant_act  # real
from zerodiff.ops.fp8_gemm import fp8_linear, fp8_gemm  # real
from zerodiff.ops.silu_mul_quant import silu_mul_quant_fp8  # real
from zerodiff.ops.mhc import mhc_pre, mhc_post  # real
from zerodiff.ops.kv_cache import write_kv_cache, gather_kv, new_kv_cache, workspace_indices  # real
from zerodiff.reference.fp8_quant import dequant_weight_block_ref  # real (STE / baseline dequant)

from zerodiff.ops import rmsnorm as _rmsnorm_op, bf16_gemm as _bf16_op, router_gemm as _router_op  # real
from zerodiff.ops import logprobs as _lp_op, attention as _sa_op, indexer as _idx_op, moe as _moe_op  # real


def _cuda(t) -> bool:
    return t.device.type == "cuda"


# Dispatch: CUDA tensors -> the zerodiff op (Triton / verified backends); CPU tensors -> the exact-structure
# implementation in zerodiff.model.exact_ops (the ops' CPU references compute in float64 with
# shape-dependent BLAS / vectorised exp, whose rare last-bit flips would make CPU CI flaky; the exact-structure
# implementations have the same contracts up to rounding and are row-invariant by construction).
def rms_norm(x, w, eps):
    return _rmsnorm_op.rms_norm(x.contiguous(), w, eps) if _cuda(x) else _exact.rms_norm(x, w, eps)


def bf16_gemm(x, w, *, out_dtype=torch.bfloat16):
    return _bf16_op.bf16_gemm(x, w, out_dtype=out_dtype) if _cuda(x) else _exact.bf16_gemm(x, w, out_dtype=out_dtype)


def router_gemm(x, w):
    return _router_op.router_gemm(x, w) if _cuda(x) else _exact.router_gemm(x, w)


def token_logprobs(logits, ids):
    return _lp_op.token_logprobs(logits, ids) if _cuda(logits) else _exact.token_logprobs(logits, ids)


def sparse_attention(q, kv, indices, sm_scale, d_v):
    if _cuda(q):
        return _sa_op.sparse_attention(q, kv, indices, sm_scale, d_v=d_v)[0]
    return _exact.sparse_attention(q, kv, indices, sm_scale, d_v)


indexer_scores = _exact.indexer_scores  # CPU: exact_ops (CUDA: zerodiff.ops.indexer.indexer_topk, see ConsistentOps)


def route(logits, k, *, bias=None, routed_scale=1.0, topk_fn=None):
    if _cuda(logits):
        return _moe_op.route(logits, k, scoring="sigmoid", bias=bias, renormalize=True, routed_scale=routed_scale)
    return _exact.route(logits, k, bias=bias, routed_scale=routed_scale, topk_fn=topk_fn)


#: What runs in place of a zerodiff op on CPU tensors (recorded in every ``check`` / ``bench`` JSON as "interim_ops").
CPU_EXACT_OPS = ("CPU only: rms_norm, bf16_gemm, router_gemm, token_logprobs, sparse_attention, indexer scores "
                 "+ FP8 index-key cache, route (exact-structure pure torch, zerodiff.model.exact_ops)",
                 "CPU only: fp8_gemm via a float64 block fast path bit-identical to zerodiff.reference.fp8_gemm",
                 "CPU only: MoE routed experts through per-slot grouped reference GEMMs (CUDA: "
                 "zerodiff.ops.moe.moe_experts, masked layout in decode graphs, contiguous elsewhere)")

#: The frozen baseline (negative control and throughput reference), per op. CUDA rows are the fast stock paths
#: of the baseline table in docs/results.md (zerodiff.model.baseline_cuda); CPU rows are torch stand-ins for CI
#: only.
BASELINE_CHOICE = {
    "pairing": "the same stock ops on both sides (rollout and training forward, BaselineRolloutOps): equal kernels "
               "and precision, so a difference comes only from the stock kernels' dependence on the batch and the "
               "phase; the training side adds the same STE backward as the consistent mode",
    "fp8 linear": "CUDA: stock per-token-group FP8 act quant (1x128, amax/448; one fused kernel) + DeepGEMM "
                  "fp8_gemm_nt (M-dependent kernel choice allowed); CPU: BF16 F.linear on a cached dequantised copy",
    "moe experts": "CUDA: DeepGEMM m_grouped_fp8_gemm_nt_masked in captured decode graphs (capacity = padded batch), "
                   "_contiguous (128-aligned) in eager steps, stock act quant, stock BF16 SiLU*mul -> group quant, "
                   "FP32 combine as one (y * w).sum(1); CPU: per-expert BF16 F.linear",
    "router": "stock FP32 F.linear",
    "expert / DSA top-k": "CUDA: vLLM's _moe_C.topk_sigmoid / _C.top_k_per_row_decode where vLLM's compiled "
                          "libraries load and pass their probe, else torch.topk (recorded per op in "
                          "baseline_vs_vllm); CPU: torch.topk",
    "silu*mul": "CUDA: one fused SiLU*mul -> FP8 group-quant kernel; CPU: BF16 F.silu(g) * u (two roundings) then "
                "the stock group quant",
    "attention": "CUDA: decode tokens -> FlashMLA flash_mla_with_kvcache (FP8 sparse decode, its split-KV "
                 "scheduler; one metadata per layer and padded batch in captured graphs), prefill tokens -> torch "
                 "dequant of the requests' FP8 cache + FlashMLA flash_mla_sparse_fwd; CPU: FP32 softmax prefill, "
                 "torch split-K decode with a batch-size dependent split (the training forward has no decode "
                 "tokens: its rows take the prefill path)",
    "DSA indexer": "same scores as the consistent path (CUDA: zerodiff.ops.indexer.index_scores; CPU: exact_ops), "
                   "then torch.topk",
    "mHC": "CUDA: zerodiff.baselines.mhc.mhc_pre_split_baseline gemm=auto (DeepGEMM tf32_hc_prenorm_gemm as vLLM) "
           "with the batch-size split heuristic; CPU: same with torch GEMM",
    "rms norm / log-softmax / lm head": "rms norm: CUDA vLLM's _C.rms_norm where it loads, else torch FP32; "
                                        "log-softmax / lm head: stock torch FP32 ops (shape-dependent reductions)",
    "cuda graphs": "same policy as the consistent mode: pure-decode steps replay graphs captured per padded "
                   "batch size, mixed steps eager",
}

_CPU_CHUNK = 16


def _backend_for(t):
    """Backend for a zerodiff op call: the reference on CPU tensors (also under TRITON_INTERPRET, where some ops
    would otherwise pick the slow interpreted kernel), the op's own choice on CUDA."""
    return "reference" if t.device.type == "cpu" else None


def _fixed_rows(fn, *xs, chunk=_CPU_CHUNK):
    """Run ``fn`` on fixed ``chunk``-row slices (leading dim zero-padded) and concatenate (CPU only)."""
    T = xs[0].shape[0]
    if not xs[0].device.type == "cpu" or T == 0:
        return fn(*xs)
    outs = []
    for s in range(0, T, chunk):
        parts = []
        for x in xs:
            p = x[s: s + chunk]
            if p.shape[0] < chunk:
                p = torch.cat([p, p.new_zeros((chunk - p.shape[0],) + tuple(p.shape[1:]))])
            parts.append(torch.empty_like(p, memory_format=torch.contiguous_format).copy_(p))  # fresh, aligned
        outs.append(fn(*parts))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat([o[i] for o in outs])[:T] for i in range(len(outs[0])))
    return torch.cat(outs)[:T]




class _Guard(torch.autograd.Function):
    """Identity (to FP32) on a master weight; backward checks the master was not modified since forward."""

    @staticmethod
    def forward(ctx, m, name):
        ctx.m = m
        ctx.ver = m._version
        ctx.name = name
        ctx.dtype = m.dtype
        return m.detach().float()

    @staticmethod
    def backward(ctx, g):
        if ctx.m._version != ctx.ver:
            raise WeightVersionError(
                f"zerodiff: master weight {ctx.name!r} changed between the training forward and its backward "
                f"(version {ctx.ver} at forward, {ctx.m._version} now): an optimizer step or in-place update ran "
                f"in between; re-run the forward before calling backward"
            )
        return g.to(ctx.dtype), None


class _Attach(torch.autograd.Function):
    """Value = the kernel's visible tensor bit for bit; gradient flows to the graph tensor."""

    @staticmethod
    def forward(ctx, visible, graph):
        ctx.gdtype = graph.dtype
        return visible.detach().clone()

    @staticmethod
    def backward(ctx, g):
        return None, g.to(ctx.gdtype)


#: query rows per checkpointed block of the training graph's dense attention (see ``ConsistentOps.attention``)
GRAPH_ATTN_ROWS = 512


def _masked_attention_rows(qg, kv, mask, sm_scale: float, d_v: int):
    """FP32 graph of the attention for a block of query rows: softmax over the masked keys of this step
    (rows with no key give 0), values = the first ``d_v`` channels of ``kv``."""
    s = torch.einsum("thd,sd->ths", qg, kv) * sm_scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, -1)
    p = torch.where(mask.any(-1)[:, None, None], p, torch.zeros_like(p))
    return torch.einsum("ths,sd->thd", p, kv[:, :d_v])


class Tape:
    """Maps visible tensors of one training forward to their FP32 graph counterparts."""

    def __init__(self):
        self.map = {}

    def put(self, vis, g):
        self.map[id(vis)] = (vis, g)

    def get(self, vis):
        e = self.map.get(id(vis))
        if e is None or e[0] is not vis:
            return None
        return e[1]


def _silu(x):
    return x * torch.sigmoid(x)


class ConsistentOps:
    """zerodiff ops (see module docstring). One instance per side; ``tape`` set only in training."""

    name = "consistent"
    side = "any"

    def __init__(self, cfg):
        self.cfg = cfg
        self.tape: Tape | None = None
        self.graph_safe = False  # set while capturing CUDA graphs: no host syncs / data-dependent shapes

    # ---- autograd plumbing --------------------------------------------------------------------------
    @property
    def grad(self) -> bool:
        return self.tape is not None and torch.is_grad_enabled()

    def graph_of(self, x):
        """Graph view of a visible tensor: value == x (as fp32), gradient to its producer's graph."""
        gx = self.tape.get(x) if self.tape is not None else None
        xf = x.detach().float()
        if gx is None:
            return xf
        return xf + (gx - gx.detach())

    def master(self, w):
        """Master of a weight as an FP32 graph leaf (version-guarded)."""
        return _Guard.apply(w.master, w.name)

    def tape_graph(self, vis, graph_fn):
        """Training: put ``graph_fn()`` (the FP32 graph of ``vis``) on the tape; returns ``vis`` unchanged."""
        if self.grad:
            graph = graph_fn()
            if graph is not None and graph.requires_grad:
                self.tape.put(vis, graph)
        return vis

    def attach(self, vis):
        """Final output: the visible bits with the graph's gradient."""
        if not self.grad:
            return vis
        g = self.tape.get(vis)
        if g is None:
            return vis
        return _Attach.apply(vis, g)

    # ---- visible kernels (overridden by the baseline) -----------------------------------------------
    def kernel_rms_norm(self, x, w):
        return rms_norm(x, w, self.cfg.rms_eps)

    def kernel_fp8_linear(self, x, w: Fp8Weight):
        if x.device.type == "cpu":  # CPU fast path, bit-identical to zerodiff.ops.fp8_gemm's reference backend
            aq, as_ = quant_act(x, backend="reference")
            return _exact.fp8_gemm_blocks(aq, as_, w.q, w.scale)
        return fp8_linear(x, w)

    def kernel_bf16_linear(self, x, w, out_dtype):
        return bf16_gemm(x, w, out_dtype=out_dtype)

    def kernel_router(self, x, w):
        return router_gemm(x, w)

    def kernel_mhc_pre(self, X, fn, scale, base):
        cfg = self.cfg
        return _fixed_rows(lambda r: mhc_pre(r, fn, scale, base, sinkhorn_iters=cfg.sinkhorn_iters,
                                             rms_eps=cfg.rms_eps, backend=_backend_for(r)), X)

    def kernel_mhc_post(self, y, X, post, comb):
        return mhc_post(y, X, post, comb, backend=_backend_for(y))

    def kernel_swiglu_quant(self, h):
        return _fixed_rows(lambda a: silu_mul_quant_fp8(a, backend=_backend_for(a)), h)

    def kernel_topk(self, scores, k, lengths=None):
        return deterministic_topk(scores, k, lengths, backend=_backend_for(scores))

    def kernel_route(self, logits, bias, k, scale):
        return route(logits, k, bias=bias, routed_scale=scale, topk_fn=self.kernel_topk)

    def kernel_logprobs(self, logits, ids):
        return token_logprobs(logits, ids)

    def kernel_indexer(self, q, w, kq, ks, lengths):
        return indexer_scores(q, w, kq, ks, lengths)

    def kernel_attention_visible(self, q, kv_nope, k_rope, cache, layer, step, sel, sm_scale):
        """The attention value: CUDA -> ``zerodiff.ops.attention.sparse_mla_attention`` (THE read path:
        gather_kv into a per-row BF16 workspace in fixed 256-row chunks, then sparse_attention with its
        verified default backend); CPU -> the same two steps on the whole step."""
        if _cuda(q):
            cfg = self.cfg
            return _sa_op.sparse_mla_attention(q, cache.kv[layer], step.block_table, step.slot, sel, sm_scale,
                                               d_nope=cfg.d_latent, d_rope=cfg.d_rope, check=cache.check)[0]
        ws = cache.gather(layer, step, sel)
        return self.kernel_attention(q, ws, sel, sm_scale, step, (kv_nope, k_rope))

    def kernel_attention(self, q, ws, sel, sm_scale, step, kv_fresh):
        """q [T, h, dqk] bf16; ws [T, K, dqk] workspace gathered from the FP8 cache; sel [T, K]."""
        idx = workspace_indices(sel)
        return sparse_attention(q, ws.reshape(-1, ws.shape[-1]), idx, sm_scale, self.cfg.d_latent)

    # ---- ops the model calls ------------------------------------------------------------------------
    def embed(self, tokens, w):
        with torch.no_grad():
            v = w.dep[tokens]
        return self.tape_graph(v, lambda: self.master(w)[tokens])

    def rms_norm(self, x, w):
        with torch.no_grad():
            v = self.kernel_rms_norm(x, w.dep)
        eps = self.cfg.rms_eps

        def graph_fn():
            xf = self.graph_of(x)
            r = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
            return xf * r * self.master(w)

        return self.tape_graph(v, graph_fn)

    def fp8_linear(self, x, w):
        with torch.no_grad():
            v = self.kernel_fp8_linear(x, w.dep)
        return self.tape_graph(v, lambda: self.graph_of(x) @ self.master(w).t())

    def bf16_linear(self, x, w, out_dtype=torch.bfloat16):
        with torch.no_grad():
            v = self.kernel_bf16_linear(x, w.dep, out_dtype)
        return self.tape_graph(v, lambda: self.graph_of(x) @ self.master(w).t())

    def router(self, x, w):
        with torch.no_grad():
            v = self.kernel_router(x, w.dep)
        return self.tape_graph(v, lambda: self.graph_of(x) @ self.master(w).t())

    def mhc_pre(self, X, wfn, wscale, wbase):
        with torch.no_grad():
            u, post, comb = self.kernel_mhc_pre(X, wfn.dep, wscale.dep, wbase.dep)
        if self.grad:
            cfg = self.cfg
            T, n, H = X.shape
            Xg = self.graph_of(X)
            fn, s, b = self.master(wfn), self.master(wscale), self.master(wbase)
            x = Xg.reshape(T, n * H)
            mix = (x @ fn.t()) * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.rms_eps)
            pre = torch.sigmoid(mix[:, :n] * s[0] + b[:n]) + 1e-6
            pg = torch.sigmoid(mix[:, n: 2 * n] * s[1] + b[n: 2 * n]) * 2.0
            lg = mix[:, 2 * n:].reshape(T, n, n) * s[2] + b[2 * n:].reshape(1, n, n)
            cm = torch.softmax(lg, -1) + 1e-6
            cm = cm / (cm.sum(-2, keepdim=True) + 1e-6)
            for _ in range(cfg.sinkhorn_iters - 1):
                cm = cm / (cm.sum(-1, keepdim=True) + 1e-6)
                cm = cm / (cm.sum(-2, keepdim=True) + 1e-6)
            ug = (pre.unsqueeze(-1) * Xg).sum(1)
            self.tape.put(u, ug)
            self.tape.put(post, pg)
            self.tape.put(comb, cm)
        return u, post, comb

    def mhc_post(self, y, X, post, comb):
        with torch.no_grad():
            v = self.kernel_mhc_post(y, X, post, comb)

        def graph_fn():
            yg, Xg, pg, cg = self.graph_of(y), self.graph_of(X), self.graph_of(post), self.graph_of(comb)
            return pg.unsqueeze(-1) * yg.unsqueeze(1) + torch.einsum("tij,tih->tjh", cg, Xg)

        return self.tape_graph(v, graph_fn)

    def mhc_final(self, X):
        """Sum of the n streams, left to right in FP32, one rounding to BF16."""
        with torch.no_grad():
            acc = X[:, 0].float()
            for i in range(1, X.shape[1]):
                acc = acc + X[:, i].float()
            v = acc.to(torch.bfloat16)
        return self.tape_graph(v, lambda: self.graph_of(X).sum(1))

    def rope(self, x, cos, sin):
        """Half-split rotary on the last dim: x [T, ..., R] bf16, cos/sin fp32 [T, R/2] (per token)."""
        shape = [x.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[-1]]
        c, s = cos.reshape(shape), sin.reshape(shape)

        def f(xf):
            h = xf.shape[-1] // 2
            x1, x2 = xf[..., :h], xf[..., h:]
            return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

        with torch.no_grad():
            v = f(x.float()).to(torch.bfloat16)
        return self.tape_graph(v, lambda: f(self.graph_of(x)))

    def indexer_topk(self, q, w, cache, layer, step):
        """Positions [T, topk] int32 (request-local, descending, -1 last) of the DSA selection."""
        if _cuda(q):
            with torch.no_grad():
                q8, qs = _idx_op.quant_index_q(q)
                wq = (w * qs).contiguous()
                if self.name == "consistent":
                    return _idx_op.indexer_topk(q8, wq, cache.idx_cache[layer], step.block_table, step.slot,
                                                step.pos, self.cfg.topk, self.cfg.max_pos, check=cache.check)
                scores = _idx_op.index_scores(q8, wq, cache.idx_cache[layer], step.block_table, step.slot, step.pos,
                                              self.cfg.max_pos, check=cache.check)
                return self.kernel_topk(scores, self.cfg.topk, (step.pos + 1).to(torch.int32))
        with torch.no_grad():
            Wd = max(int(step.max_pos) + 1, self.cfg.topk) if not _cuda(q) else self.cfg.max_pos
            kq, ks = cache.gather_index_keys(layer, step, Wd)
            lengths = (step.pos + 1).to(torch.int32)
            scores = self.kernel_indexer(q, w, kq, ks, lengths)
            return self.kernel_topk(scores, self.cfg.topk, lengths)

    def attention(self, q, kv_nope, k_rope, cache, layer, step, sel):
        cfg = self.cfg
        sm_scale = 1.0 / math.sqrt(cfg.d_qk)
        with torch.no_grad():
            v = self.kernel_attention_visible(q, kv_nope, k_rope, cache, layer, step, sel, sm_scale)

        def graph_fn():
            # dense masked form of the same attention (the selection is a mask over this step's tokens): no
            # [T, K, d_qk] gather; the index order only matters for the visible bits. Query rows go in
            # checkpointed blocks of GRAPH_ATTN_ROWS (recomputed in backward), so the graph holds
            # [rows, h, T] at a time instead of [T, h, T] (4,096-token micro-batches: 0.5 GB, not 4.3 GB, per tensor)
            flat = step.flat_index(sel)  # [T, K] index into this step's tokens, -1 invalid
            T = q.shape[0]
            mask = torch.zeros(T, T + 1, dtype=torch.bool, device=q.device)
            mask.scatter_(1, torch.where(flat >= 0, flat, torch.full_like(flat, T)), True)
            mask = mask[:, :T]
            kv = torch.cat([self.graph_of(kv_nope), self.graph_of(k_rope)], -1)  # [T, dqk]
            qg = self.graph_of(q)
            rows = GRAPH_ATTN_ROWS
            if T <= rows:
                return _masked_attention_rows(qg, kv, mask, sm_scale, cfg.d_latent)
            return torch.cat([_checkpoint(_masked_attention_rows, qg[a: a + rows], kv, mask[a: a + rows], sm_scale,
                                          cfg.d_latent, use_reentrant=False) for a in range(0, T, rows)])

        return self.tape_graph(v, graph_fn)

    def route(self, logits, bias_w):
        cfg = self.cfg
        with torch.no_grad():
            wts, ids = self.kernel_route(logits, bias_w.dep, cfg.top_experts, cfg.routed_scale)

        def graph_fn():
            sc = torch.sigmoid(self.graph_of(logits)).gather(1, ids.long())
            return sc / sc.sum(-1, keepdim=True) * cfg.routed_scale

        return self.tape_graph(wts, graph_fn), ids

    def _expert_visible(self, x, w13: Fp8Weight, w2: Fp8Weight):
        h = self.kernel_fp8_linear(x, w13)
        q, s = self.kernel_swiglu_quant(h)
        return self.kernel_fp8_down(q, s, h, w2)

    def kernel_fp8_down(self, q, s, h, w2):
        if q.device.type == "cpu":
            return _exact.fp8_gemm_blocks(q, s, w2.q, w2.scale)
        return fp8_gemm(q, s, w2.q, w2.scale)

    def kernel_moe_visible(self, x, wts, ids, w13: Fp8Weight, w2: Fp8Weight, s13: Fp8Weight, s2: Fp8Weight):
        """MoE block value: routed experts combined in FP32 in slot order + shared expert in FP32, one rounding.
        CUDA: ``zerodiff.ops.moe.moe_experts`` - masked layout with the static capacity T (the padded graph
        batch) while capturing / emulating CUDA-graph decode (``graph_safe``), contiguous otherwise (eager
        rollout steps and training); the contract makes a token's value the same in both. CPU: per-slot
        grouped reference GEMMs (:meth:`kernel_experts`)."""
        if _cuda(x):
            layout = "masked" if self.graph_safe else "contiguous"
            routed = _moe_op.moe_experts(x, wts, ids, _moe_op.MoEWeights(w13, w2), layout=layout,
                                         capacity=x.shape[0] if self.graph_safe else None)
        else:
            routed = self._routed_generic(x, wts, ids, w13, w2)
        shared = self._expert_visible(x, s13, s2).float()
        return (routed + shared).to(torch.bfloat16)

    def _routed_generic(self, x, wts, ids, w13, w2):
        """fp32 [T, H]: kernel_experts on the (token, slot) rows, combined in slot order."""
        T, k = ids.shape
        xr = x.unsqueeze(1).expand(T, k, x.shape[1]).reshape(T * k, x.shape[1])
        slot_out = self.kernel_experts(xr, w13, w2, ids.long().reshape(-1)).view(T, k, x.shape[1])
        acc = wts[:, 0:1] * slot_out[:, 0].float()
        for j in range(1, k):
            acc = acc + wts[:, j: j + 1] * slot_out[:, j].float()
        return acc

    def kernel_experts(self, xr, w13: Fp8Weight, w2: Fp8Weight, row_expert):
        """Routed experts on rows [R, H] (row r uses expert row_expert[r]) -> bf16 [R, H] (CPU path; eager)."""
        if xr.device.type == "cpu":  # one grouped call, bit-identical to the per-expert reference
            aq, as_ = quant_act(xr, backend="reference")
            h = _exact.fp8_gemm_blocks(aq, as_, w13.q, w13.scale, row_expert=row_expert)
            q, s = self.kernel_swiglu_quant(h)
            return _exact.fp8_gemm_blocks(q, s, w2.q, w2.scale, row_expert=row_expert)
        out = torch.zeros(xr.shape[0], w2.q.shape[1], dtype=torch.bfloat16, device=xr.device)
        for e in torch.unique(row_expert).tolist():
            rr = (row_expert == e).nonzero(as_tuple=True)[0]
            out[rr] = self._expert_visible(xr[rr], Fp8Weight(w13.q[e], w13.scale[e]), Fp8Weight(w2.q[e], w2.scale[e]))
        return out

    def moe(self, x, wts, ids, e13, e2, s13, s2):
        """Routed experts combined in FP32 in slot order + shared expert in FP32, one rounding to BF16."""
        T, k = ids.shape
        idl = ids.long()
        with torch.no_grad():
            v = self.kernel_moe_visible(x, wts, ids, e13.dep, e2.dep, s13.dep, s2.dep)

        def graph_fn():
            xg = self.graph_of(x)
            wg = self.graph_of(wts)
            W13, W2, S13, S2 = self.master(e13), self.master(e2), self.master(s13), self.master(s2)
            inter = W13.shape[1] // 2
            out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
            for e in torch.unique(idl).tolist():
                tt, jj = (idl == e).nonzero(as_tuple=True)
                hh = xg[tt] @ W13[e].t()
                y = (_silu(hh[:, :inter]) * hh[:, inter:]) @ W2[e].t()
                out = out.index_add(0, tt, wg[tt, jj].unsqueeze(-1) * y)
            shared_inter = S13.shape[0] // 2
            hs = xg @ S13.t()
            return out + (_silu(hs[:, :shared_inter]) * hs[:, shared_inter:]) @ S2.t()

        return self.tape_graph(v, graph_fn)

    def lm_head(self, x, w):
        return self.bf16_linear(x, w, out_dtype=torch.float32)

    def logprobs(self, logits, ids):
        with torch.no_grad():
            v = self.kernel_logprobs(logits, ids)

        def graph_fn():
            return torch.log_softmax(self.graph_of(logits), -1).gather(1, ids.long().unsqueeze(1)).squeeze(1)

        return self.attach(self.tape_graph(v, graph_fn))


# ---- baseline (negative control) -----------------------------------------------------------------------
_DEQ_CACHE: dict = {}  # id(q) -> (weakref(q), version, dequantised BF16 weight)


def _dequant_fp32(w: Fp8Weight):
    """FP32 dequantised weight (per call)."""
    return dequant_weight_block_ref(w.q, w.scale)


def _deq_bf16_cached(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """BF16 dequantised weight ([N, K] or stacked [E, N, K]), cached per code tensor object and version: the
    stock inference baseline keeps a BF16 copy so its GEMM is a plain cuBLAS/CPU BF16 GEMM (fast)."""
    import weakref

    hit = _DEQ_CACHE.get(id(q))
    if hit is not None and hit[0]() is q and hit[1] == q._version:
        return hit[2]
    if q.dim() == 2:
        d = dequant_weight_block_ref(q, scale).to(torch.bfloat16)
    else:
        d = torch.stack([dequant_weight_block_ref(q[e], scale[e]) for e in range(q.shape[0])]).to(torch.bfloat16)
    for k in [k for k, v in _DEQ_CACHE.items() if v[0]() is None]:
        del _DEQ_CACHE[k]
    _DEQ_CACHE[id(q)] = (weakref.ref(q), q._version, d)
    return d


class BaselineRolloutOps(ConsistentOps):
    """Stock inference-style paths (fast, shape-dependent): see :data:`BASELINE_CHOICE`."""

    name = "baseline"
    side = "rollout"

    def __init__(self, cfg):
        super().__init__(cfg)
        self._mla_meta: dict = {}  # (layer, padded batch) -> FlashMLA scheduler metadata of a captured decode graph

    def kernel_rms_norm(self, x, w):
        if _cuda(x):  # vLLM's _C.rms_norm where loadable (baseline_cuda.rms_norm)
            return _stock_cuda.rms_norm(x, w, self.cfg.rms_eps)
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), self.cfg.rms_eps).to(torch.bfloat16)

    def kernel_fp8_linear(self, x, w):
        if _cuda(x):  # stock group quant + DeepGEMM fp8_gemm_nt
            return _stock_cuda.fp8_linear(x, w, _deq_bf16_cached)
        return F.linear(x, _deq_bf16_cached(w.q, w.scale))

    def kernel_fp8_down(self, q, s, h, w2):
        if _cuda(q):
            from zerodiff.model.baseline_cuda import _need

            out = torch.empty((q.shape[0], w2.q.shape[0]), dtype=torch.bfloat16, device=q.device)
            if q.shape[0]:
                _need("deepgemm").fp8_gemm_nt((q, s.contiguous()), (w2.q, w2.scale), out, disable_ue8m0_cast=True)
            return out
        return super().kernel_fp8_down(q, s, h, w2)

    def kernel_moe_visible(self, x, wts, ids, w13, w2, s13, s2):
        if not _cuda(x):
            return super().kernel_moe_visible(x, wts, ids, w13, w2, s13, s2)
        routed = _stock_cuda.moe_routed(x, wts, ids, w13, w2, graph=self.graph_safe)
        shared = self._expert_visible(x, s13, s2).float()
        return (routed + shared).to(torch.bfloat16)

    def kernel_attention_visible(self, q, kv_nope, k_rope, cache, layer, step, sel, sm_scale):
        if not _cuda(q):
            return super().kernel_attention_visible(q, kv_nope, k_rope, cache, layer, step, sel, sm_scale)
        cfg = self.cfg
        bs = cache.block_size
        if getattr(step, "pure_decode", False):  # captured decode graph: one scheduler metadata per (layer, S)
            key = (layer, q.shape[0])
            if key not in self._mla_meta:
                self._mla_meta[key] = _stock_cuda._need("flashmla").get_mla_metadata()[0]
            return _stock_cuda.flashmla_decode(q, cache.kv[layer], _stock_cuda.cache_slots(step, sel, bs), sm_scale,
                                               cfg.d_latent, self._mla_meta[key])
        dec = step.decode_host or []
        T = q.shape[0]
        if len(dec) == T:  # eager pure-decode step
            return _stock_cuda.flashmla_decode(q, cache.kv[layer], _stock_cuda.cache_slots(step, sel, bs), sm_scale,
                                               cfg.d_latent)
        if not dec:
            return _stock_cuda.flashmla_prefill(q, cache.kv[layer], step, sel, sm_scale, cfg.d_latent, cfg.d_rope, bs)
        # mixed step: decode tokens through the decode kernel, the others through the prefill path (as vLLM)
        out = torch.empty(T, q.shape[1], cfg.d_latent, dtype=torch.bfloat16, device=q.device)
        di, pi = _stock_cuda.split_rows(dec, T, q.device)  # no host sync, no per-token Python loop
        out[di] = _stock_cuda.flashmla_decode(q[di], cache.kv[layer], _stock_cuda.cache_slots(step, sel[di], bs, rows=di), sm_scale,
                                      cfg.d_latent)
        out[pi] = _stock_cuda.flashmla_prefill(q[pi], cache.kv[layer], step, sel[pi], sm_scale, cfg.d_latent, cfg.d_rope, bs,
                                       rows=pi)
        return out

    def _expert_bf16(self, x, w13, w2):
        h = F.linear(x, w13)
        q, s = self.kernel_swiglu_quant(h)
        a = (q.float() * s.repeat_interleave(128, dim=1)[:, : q.shape[1]]).to(torch.bfloat16)
        return F.linear(a, w2)

    def kernel_bf16_linear(self, x, w, out_dtype):
        return F.linear(x, w).to(out_dtype)

    def kernel_router(self, x, w):
        return F.linear(x.float(), w.float())  # stock FP32 router GEMM (shape-dependent cuBLAS/CPU kernel)

    def kernel_mhc_pre(self, X, fn, scale, base):
        from zerodiff.baselines.mhc import mhc_pre_split_baseline

        if X.is_cuda:  # vLLM's path: DeepGEMM tf32_hc_prenorm_gemm with the batch-size split heuristic
            info: dict = {}
            r = mhc_pre_split_baseline(X, fn, scale, base, sinkhorn_iters=self.cfg.sinkhorn_iters,
                                       rms_eps=self.cfg.rms_eps, gemm="auto", epilogue="auto", info=info)
            _stock_cuda.CHOICES.setdefault(("mhc pre",), f"mhc_pre_split_baseline: gemm {info.get('gemm')}, epilogue "
                                   f"{info.get('epilogue')}" + (f" (DeepGEMM error: {info['deepgemm_error']})"
                                                                if info.get("deepgemm_error") else ""))
            return r
        return mhc_pre_split_baseline(X, fn, scale, base, sinkhorn_iters=self.cfg.sinkhorn_iters,
                                      rms_eps=self.cfg.rms_eps, n_sms=132, gemm="torch", epilogue="torch")

    def kernel_mhc_post(self, y, X, post, comb):
        if _cuda(y):  # vLLM's TileLang fused post where importable, else a fused one-pass kernel (baseline_cuda)
            return _stock_cuda.mhc_post(y, X, post, comb)
        return (post.unsqueeze(-1) * y.float().unsqueeze(1)
                + torch.einsum("tij,tih->tjh", comb, X.float())).to(torch.bfloat16)

    def kernel_swiglu_quant(self, h):
        if _cuda(h):  # one fused kernel (baseline_cuda.silu_mul_quant)
            return _stock_cuda.silu_mul_quant(h)
        half = h.shape[1] // 2
        a = F.silu(h[:, :half]) * h[:, half:]  # two BF16 roundings
        return quant_act(a, backend=_backend_for(a))

    def kernel_topk(self, scores, k, lengths=None):
        if _cuda(scores):  # vLLM's _C.top_k_per_row_decode where loadable (baseline_cuda.topk_rows)
            return _stock_cuda.topk_rows(scores, k, lengths)
        if lengths is not None:
            W = scores.shape[1]
            col = torch.arange(W, device=scores.device)[None, :]
            scores = scores.masked_fill(col >= lengths[:, None].long(), float("-inf"))
        vals, idx = torch.topk(scores, min(k, scores.shape[1]), dim=1)
        idx = idx.to(torch.int32).masked_fill(vals == float("-inf"), -1)
        return idx

    def kernel_route(self, logits, bias, k, scale):
        if _cuda(logits):  # vLLM's _moe_C.topk_sigmoid where loadable (baseline_cuda.route_sigmoid)
            return _stock_cuda.route_sigmoid(logits, bias, k, scale)
        sc = torch.sigmoid(logits)
        _, ids = torch.topk(sc + bias, k, dim=1)
        w = sc.gather(1, ids)
        return w / w.sum(-1, keepdim=True) * scale, ids.to(torch.int32)

    def kernel_experts(self, xr, w13, w2, row_expert):  # CPU baseline (CUDA: kernel_moe_visible -> DeepGEMM grouped)
        out = torch.zeros(xr.shape[0], w2.q.shape[1], dtype=torch.bfloat16, device=xr.device)
        W13 = _deq_bf16_cached(w13.q, w13.scale)
        W2 = _deq_bf16_cached(w2.q, w2.scale)
        for e in torch.unique(row_expert).tolist():
            rr = (row_expert == e).nonzero(as_tuple=True)[0]
            out[rr] = self._expert_bf16(xr[rr], W13[e], W2[e])
        return out

    def kernel_logprobs(self, logits, ids):
        return torch.log_softmax(logits.float(), -1).gather(1, ids.long().unsqueeze(1)).squeeze(1)

    def kernel_indexer(self, q, w, kq, ks, lengths):
        k = kq.float() * ks
        s = torch.relu(torch.einsum("thd,twd->thw", q.float(), k))
        return torch.einsum("th,thw->tw", w, s)

    def kernel_attention(self, q, ws, sel, sm_scale, step, kv_fresh):
        valid = sel >= 0
        qf, kf = q.float(), ws.float()
        s = torch.einsum("thd,tkd->thk", qf, kf) * sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        v = kf[..., : self.cfg.d_latent]
        if getattr(step, "pure_decode", False):  # CUDA-graph decode step: every row decodes, no host sync
            return self._split_decode(s, v, step.T).to(torch.bfloat16)
        decode = step.is_decode_token()  # [T] bool: single-token requests of this step
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
        pre = ~decode
        if bool(pre.any()):
            out[pre] = torch.einsum("thk,tkd->thd", torch.softmax(s[pre], -1), v[pre])
        if bool(decode.any()):
            out[decode] = self._split_decode(s[decode], v[decode], int(decode.sum()))
        return out.to(torch.bfloat16)

    @staticmethod
    def _split_decode(sd, vd, nd):
        """split-K decode: the split count follows the batch size (as stock decode kernels do)."""
        splits = 1 if nd < 4 else 2 if nd < 8 else 4
        K = sd.shape[-1]
        chunks = [(a, min(K, a + (K + splits - 1) // splits)) for a in range(0, K, (K + splits - 1) // splits)]
        ms, ls, os_ = [], [], []
        for a, b in chunks:
            m = sd[..., a:b].amax(-1, keepdim=True).clamp(min=-1e30)
            p = torch.exp(sd[..., a:b] - m).to(torch.bfloat16).float()
            ms.append(m)
            ls.append(p.sum(-1, keepdim=True))
            os_.append(torch.einsum("thk,tkd->thd", p, vd[:, a:b]))
        M = torch.stack(ms).amax(0)
        num = sum(o * torch.exp(m - M) for o, m in zip(os_, ms))
        den = sum(l * torch.exp(m - M) for l, m in zip(ls, ms))
        return num / den


class BaselineTrainOps(BaselineRolloutOps):
    """Stock training-style paths: FP32 swiglu without FP8, dense attention over fresh BF16 K/V, ..."""

    side = "train"

    def kernel_fp8_down(self, q, s, h, w2):
        return ConsistentOps.kernel_fp8_down(self, q, s, h, w2)  # unused: _expert_visible is overridden

    def kernel_moe_visible(self, x, wts, ids, w13, w2, s13, s2):
        return (self._routed_generic(x, wts, ids, w13, w2)
                + self._expert_visible(x, s13, s2).float()).to(torch.bfloat16)

    def kernel_attention_visible(self, q, kv_nope, k_rope, cache, layer, step, sel, sm_scale):
        # training-style: dense attention over the fresh BF16 K/V of this step (never through the FP8 cache)
        return self.kernel_attention(q, None, sel, sm_scale, step, (kv_nope, k_rope))

    def kernel_fp8_linear(self, x, w):
        return (x.float() @ _dequant_fp32(w).t()).to(torch.bfloat16)

    def kernel_router(self, x, w):
        return F.linear(x.float(), w.float())

    def kernel_mhc_pre(self, X, fn, scale, base):
        from zerodiff.baselines.mhc import mhc_pre_torch_eager

        return mhc_pre_torch_eager(X, fn, scale, base, sinkhorn_iters=self.cfg.sinkhorn_iters,
                                   rms_eps=self.cfg.rms_eps)

    def kernel_swiglu_quant(self, h):
        return None, None  # unused: _expert_visible is overridden

    def kernel_experts(self, xr, w13, w2, row_expert):
        out = torch.zeros(xr.shape[0], w2.q.shape[1], dtype=torch.bfloat16, device=xr.device)
        for e in torch.unique(row_expert).tolist():
            rr = (row_expert == e).nonzero(as_tuple=True)[0]
            out[rr] = self._expert_visible(xr[rr], Fp8Weight(w13.q[e], w13.scale[e]), Fp8Weight(w2.q[e], w2.scale[e]))
        return out

    def _expert_visible(self, x, w13, w2):
        h = (x.float() @ _dequant_fp32(w13).t())
        half = h.shape[1] // 2
        a = (F.silu(h[:, :half]) * h[:, half:]).to(torch.bfloat16)
        return (a.float() @ _dequant_fp32(w2).t()).to(torch.bfloat16)

    def kernel_attention(self, q, ws, sel, sm_scale, step, kv_fresh):
        kv_nope, k_rope = kv_fresh
        if q.is_cuda:  # dense masked form in query chunks (a [T, K, d] gather would not fit at the h200 shapes)
            return self._dense_masked(q, kv_nope, k_rope, sel, sm_scale, step)
        flat = step.flat_index(sel)
        valid = flat >= 0
        kv = torch.cat([kv_nope, k_rope], -1).float()[flat.clamp(min=0).long()]
        s = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        return torch.einsum("thk,tkd->thd", torch.softmax(s, -1), kv[..., : self.cfg.d_latent]).to(torch.bfloat16)


    def _dense_masked(self, q, kv_nope, k_rope, sel, sm_scale, step, chunk=1024):
        T = q.shape[0]
        flat = step.flat_index(sel)
        kv = torch.cat([kv_nope, k_rope], -1).float()
        out = torch.empty(T, q.shape[1], self.cfg.d_latent, dtype=torch.bfloat16, device=q.device)
        for a in range(0, T, chunk):
            b = min(T, a + chunk)
            f = flat[a:b]
            mask = torch.zeros(b - a, T + 1, dtype=torch.bool, device=q.device)
            mask.scatter_(1, torch.where(f >= 0, f, torch.full_like(f, T)), True)
            mask = mask[:, :T]
            s = torch.einsum("thd,sd->ths", q[a:b].float(), kv) * sm_scale
            s = s.masked_fill(~mask[:, None, :], float("-inf"))
            p = torch.softmax(s, -1).nan_to_num(0.0)
            out[a:b] = torch.einsum("ths,sd->thd", p, kv[:, : self.cfg.d_latent]).to(torch.bfloat16)
        return out


#: ops class per side of each mode. ``baseline`` (the negative control) runs the SAME stock ops on both sides, so the
#: two sides compute with the same kernels at the same precision and differ only where a stock kernel's result
#: depends on the batch or the phase (prefill vs decode); ``baseline_mixed`` pairs the stock inference ops with
#: training-style ones (FP32 matmuls on dequantised weights, no FP8 SiLU, attention on fresh BF16 K/V): its diff
#: mixes precision with batch dependence, so it is kept for comparison and is not the control.
MODES = {"consistent": (ConsistentOps, ConsistentOps), "baseline": (BaselineRolloutOps, BaselineRolloutOps),
         "baseline_mixed": (BaselineRolloutOps, BaselineTrainOps)}


def make_ops(mode: str, side: str, cfg):
    """``mode`` one of :data:`MODES` ('consistent' | 'baseline' | 'baseline_mixed'); ``side`` 'rollout' | 'train'."""
    if mode not in MODES:
        raise ValueError(f"zerodiff: unknown mode {mode!r} (expected one of {sorted(MODES)})")
    return MODES[mode][0 if side == "rollout" else 1](cfg)


__all__ = [
    "ConsistentOps", "BaselineRolloutOps", "BaselineTrainOps", "make_ops", "Tape", "WeightVersionError",
    "Fp8Weight", "new_kv_cache", "write_kv_cache", "gather_kv", "BASELINE_CHOICE", "CPU_EXACT_OPS",
    "det_exp", "tree_sum",
]
