"""ONE model forward for both sides: ``forward_step(params, step, cache, ops, *, record=None)``.

The tiny DeepSeek-V4-shaped model (per layer: mHC-wrapped MLA attention with DSA, mHC-wrapped MoE):

* embedding (BF16) replicated into ``hc_mult`` mHC streams;
* attention sub-layer: ``mhc_pre`` -> RMSNorm -> q path ``wq_a`` (FP8) -> RMSNorm -> ``wq_b`` (FP8) giving per
  head ``[d_latent | d_rope]`` (absorbed MLA: queries live in the latent space); kv path ``wkv_a`` (FP8) ->
  ``[latent | rope]``, RMSNorm on the latent, RoPE on both rope parts; the latent + rope of every token is
  written through the FP8 KV cache; the DSA indexer (FP8 q/k projections, BF16 head weights, FP8 index-key
  cache) scores positions ``0..pos`` of the token's own request and ``deterministic_topk`` keeps ``topk``;
  sparse attention over the selected positions gathered from the FP8 cache (the one read path); ``wo``
  (FP8); ``mhc_post``;
* MoE sub-layer: ``mhc_pre`` -> RMSNorm -> FP32 router GEMM -> sigmoid routing with bias (top-k experts)
  -> routed FP8 experts (FP8 GEMM, SiLU*mul -> FP8, FP8 GEMM) combined in FP32 in slot order + shared
  expert, one rounding -> ``mhc_post``;
* final: streams summed, RMSNorm, LM head (BF16 GEMM with FP32 logits) for the rows that need logits.

Log-prob contract: logits from the LM head in FP32, temperature 1, log-softmax of the raw logits (no
top-k/top-p processing), value at the sampled token (``ops.logprobs``).

``StepInputs`` is a flat token batch: per token its request slot and request-local position; per request
its block table, cached length before/after the step and the step's first token index. Every op is per
token, attention reads only the token's own request history from the cache, so a token's values never
depend on its batch neighbours, on chunking, or on prefill vs decode. Within a step all tokens' K are
written before any is read (a chunk attends to itself through the cache).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from .weights import Deployment


@dataclass
class StepInputs:
    tokens: torch.Tensor  # int64 [T]
    slot: torch.Tensor  # int32 [T]: request index inside this step
    pos: torch.Tensor  # int32 [T]: request-local position
    block_table: torch.Tensor  # int32 [R, max_blocks] (-1 = hole)
    ctx_before: torch.Tensor  # int64 [R]: tokens of the request already cached before this step
    n_tok: torch.Tensor  # int64 [R]: tokens of the request in this step
    q_start: torch.Tensor  # int64 [R]: flat index of the request's first token in this step
    logits_rows: torch.Tensor  # int64 [L]: flat token indices whose logits are wanted
    max_pos: int = 0
    keys: list = field(default_factory=list)
    pure_decode: bool = False  # set for CUDA-graph decode steps (every token is a decode token)
    req_len_host: list | None = None  # host copy of ctx_before + n_tok per request (eager steps; no device sync)
    decode_host: list | None = None  # host copy: flat token indices that are decode tokens (n_tok 1, ctx > 0)

    @property
    def T(self) -> int:
        return int(self.tokens.shape[0])

    def slot_mapping(self, block_size: int) -> torch.Tensor:
        bt = self.block_table.long()
        p = self.pos.long()
        blk = bt[self.slot.long(), p // block_size]
        return blk * block_size + p % block_size

    def flat_index(self, sel: torch.Tensor) -> torch.Tensor:
        """Map request-local positions [T, K] to flat token indices of THIS step (-1 where not in the step)."""
        s = self.slot.long()
        start = self.q_start[s][:, None]
        before = self.ctx_before[s][:, None]
        n = self.n_tok[s][:, None]
        p = sel.long()
        ok = (p >= before) & (p < before + n) & (sel >= 0)
        return torch.where(ok, start + p - before, torch.full_like(p, -1))

    def is_decode_token(self) -> torch.Tensor:
        s = self.slot.long()
        return (self.n_tok[s] == 1) & (self.ctx_before[s] > 0)


def build_step(seqs, device="cpu", logits_for=None) -> StepInputs:
    """Build a StepInputs from a list of per-request dicts:
    ``{"tokens": [ints for this step], "start": ctx_before, "blocks": [block ids], "logits": [local idx],
    "key": request key}``; ``max_blocks`` = longest block list."""
    toks, slot, pos, keys, lrows = [], [], [], [], []
    cb, nt, qs, dec = [], [], [], []
    mb = max(1, max(len(r["blocks"]) for r in seqs)) if seqs else 1
    bt = torch.full((len(seqs), mb), -1, dtype=torch.int32)
    for i, r in enumerate(seqs):
        qs.append(len(toks))
        cb.append(r["start"])
        nt.append(len(r["tokens"]))
        if len(r["tokens"]) == 1 and r["start"] > 0:
            dec.append(len(toks))
        bt[i, : len(r["blocks"])] = torch.tensor(r["blocks"], dtype=torch.int32)
        for j, t in enumerate(r["tokens"]):
            if j in r.get("logits_set", ()):
                lrows.append(len(toks))
            toks.append(int(t))
            slot.append(i)
            pos.append(r["start"] + j)
            keys.append((r.get("key"), r["start"] + j))
    dev = torch.device(device)
    return StepInputs(
        tokens=torch.tensor(toks, dtype=torch.int64, device=dev),
        slot=torch.tensor(slot, dtype=torch.int32, device=dev),
        pos=torch.tensor(pos, dtype=torch.int32, device=dev),
        block_table=bt.to(dev),
        ctx_before=torch.tensor(cb, dtype=torch.int64, device=dev),
        n_tok=torch.tensor(nt, dtype=torch.int64, device=dev),
        q_start=torch.tensor(qs, dtype=torch.int64, device=dev),
        logits_rows=torch.tensor(lrows, dtype=torch.int64, device=dev),
        max_pos=max(pos) if pos else 0,
        keys=keys,
        req_len_host=[c + n for c, n in zip(cb, nt)],
        decode_host=dec,
    )


@functools.lru_cache(maxsize=8)
def _rope_table(d_rope: int, max_pos: int, theta: float, device: str):
    """cos/sin FP32 [max_pos, d_rope/2], computed ONCE in float64 on the CPU (the same table everywhere)."""
    half = d_rope // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float64) * 2.0 / d_rope))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float().to(device), torch.sin(ang).float().to(device)


class _Views:
    """View/slice/cat helpers that keep the training tape connected (graph of a view = view of the graph)."""

    def __init__(self, ops):
        self.ops = ops

    def view(self, x, *shape):
        v = x.view(*shape)
        return self.ops.tape_graph(v, lambda: self.ops.graph_of(x).view(*shape))

    def sl(self, x, a, b):
        v = x[..., a:b]
        return self.ops.tape_graph(v, lambda: self.ops.graph_of(x)[..., a:b])

    def cat(self, xs):
        v = torch.cat(xs, -1)
        return self.ops.tape_graph(v, lambda: torch.cat([self.ops.graph_of(x) for x in xs], -1))

    def rows(self, x, idx):
        v = x[idx]
        return self.ops.tape_graph(v, lambda: self.ops.graph_of(x)[idx])


def forward_step(params, step: StepInputs, cache, ops, *, record=None):
    """Run the model on one flat token batch; returns FP32 logits ``[L, vocab]`` for ``step.logits_rows``.

    ``params`` is ``(deployment, masters_or_None)`` or a :class:`Deployment` (no masters: no training graph).
    ``record``: optional callable ``record(name, tensor)`` receiving per-token layer outputs (first dim T).
    """
    if isinstance(params, Deployment):
        dep, masters = params, None
    else:
        dep, masters = params
    cfg = ops.cfg
    V = _Views(ops)
    w = lambda n: dep.get(n, masters)  # noqa: E731
    T = step.T
    n, H, h = cfg.hc_mult, cfg.hidden, cfg.heads
    dl, dr = cfg.d_latent, cfg.d_rope
    cos_t, sin_t = _rope_table(dr, cfg.max_pos, cfg.rope_theta, str(step.tokens.device))
    if step.max_pos >= cfg.max_pos:
        raise ValueError(f"zerodiff: position {step.max_pos} >= model max_pos {cfg.max_pos}")
    p = step.pos.long()
    cos, sin = cos_t[p], sin_t[p]

    e = ops.embed(step.tokens, w("embed"))
    X = ops.tape_graph(e.unsqueeze(1).expand(T, n, H).contiguous(),
                       lambda: ops.graph_of(e).unsqueeze(1).expand(T, n, H))
    if record:
        record("embed", X)
    for l in range(cfg.layers):
        pre = f"layers.{l}."
        # ---- attention ----
        u, post, comb = ops.mhc_pre(X, w(pre + "attn_hc_fn"), w(pre + "attn_hc_scale"), w(pre + "attn_hc_base"))
        a = ops.rms_norm(u, w(pre + "attn_norm"))
        cq = ops.rms_norm(ops.fp8_linear(a, w(pre + "wq_a")), w(pre + "q_norm"))
        q = V.view(ops.fp8_linear(cq, w(pre + "wq_b")), T, h, dl + dr)
        q = V.cat([V.sl(q, 0, dl), ops.rope(V.sl(q, dl, dl + dr), cos, sin)])
        kv = ops.fp8_linear(a, w(pre + "wkv_a"))
        kv_nope = ops.rms_norm(V.sl(kv, 0, dl), w(pre + "kv_norm"))
        k_pe = ops.rope(V.sl(kv, dl, dl + dr), cos, sin)
        with torch.no_grad():  # the DSA indexer is not trained
            iq = ops.fp8_linear(cq, w(pre + "idx_wq")).view(T, cfg.idx_heads, cfg.idx_dim)
            ik = ops.fp8_linear(a, w(pre + "idx_wk"))
            iw = ops.bf16_linear(a, w(pre + "idx_ww"), out_dtype=torch.float32)
            cache.write(l, step, kv_nope, k_pe, ik)
            sel = ops.indexer_topk(iq, iw, cache, l, step)
        if record:
            record(f"layer{l}.dsa_sel", sel)
        o = ops.attention(q, kv_nope, k_pe, cache, l, step, sel)
        y = ops.fp8_linear(V.view(o, T, h * dl), w(pre + "wo"))
        X = ops.mhc_post(y, X, post, comb)
        if record:
            record(f"layer{l}.attn", X)
        # ---- MoE ----
        u, post, comb = ops.mhc_pre(X, w(pre + "ffn_hc_fn"), w(pre + "ffn_hc_scale"), w(pre + "ffn_hc_base"))
        a = ops.rms_norm(u, w(pre + "ffn_norm"))
        logits_r = ops.router(a, w(pre + "gate"))
        wts, ids = ops.route(logits_r, w(pre + "gate_bias"))
        if record:
            record(f"layer{l}.expert_ids", ids)
        y = ops.moe(a, wts, ids, w(pre + "exp_w13"), w(pre + "exp_w2"), w(pre + "sh_w13"), w(pre + "sh_w2"))
        X = ops.mhc_post(y, X, post, comb)
        if record:
            record(f"layer{l}.ffn", X)
    hfin = ops.rms_norm(ops.mhc_final(X), w("final_norm"))
    if record:
        record("final_norm", hfin)
    rows = V.rows(hfin, step.logits_rows)
    logits = ops.lm_head(rows, w("lm_head"))
    return logits


def softmax_scale(cfg) -> float:
    return 1.0 / math.sqrt(cfg.d_qk)
