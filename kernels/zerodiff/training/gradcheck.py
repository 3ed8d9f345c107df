"""Gradient check: the STE training gradients against an independent float64 implementation of the same
tiny model that shares NO kernel code (plain torch float64, written separately below).

What the float64 model is: the same architecture with every weight taken from the BF16/FP32 masters (the
STE treats FP8 quantisation as identity, so the ideal gradient is the gradient of the unquantised model),
all arithmetic in float64, and the DISCRETE choices of the kernel forward (DSA Top-K positions and MoE
expert ids per token and layer) taken as inputs: they are non-differentiable selections (the indexer is
not trained), and letting a float64 model re-decide near-ties would compare different functions.

Loss: ``-sum_k coef[k] * sum_t lp_kt`` over the given sequences, the same as the RL loop's.
Reported: ``rel_err[group] = ||g_ste - g_f64|| / ||g_f64||`` per parameter group.

Why the errors are not ~1e-7: the STE backward is evaluated at the kernel forward's values, which carry
FP8 activation/weight quantisation noise (a few % per element) and BF16 roundings, and the gradients are
accumulated into BF16 masters; a correct STE shows a relative error of order 1e-2, a wrong one (missing
term, wrong sign, wrong parameter) shows ~1.
"""

from __future__ import annotations

import math

import torch

from ..model.weights import is_trainable
from ..rl.diverge import Recorder

GROUPS = {
    "embed": lambda n: n == "embed",
    "lm_head": lambda n: n == "lm_head",
    "mhc": lambda n: "_hc_" in n,
    "norms": lambda n: n.endswith("norm"),
    "attention": lambda n: n.rsplit(".", 1)[-1] in ("wq_a", "wq_b", "wkv_a", "wo"),
    "router": lambda n: n.endswith(".gate"),
    "experts": lambda n: ".exp_" in n,
    "shared_expert": lambda n: ".sh_" in n,
}


def _rms(x, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rot(x, pos, d, theta):
    half = d // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float64) * 2.0 / d))
    ang = pos.double()[:, None] * inv[None, :]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [half]
    c, s = torch.cos(ang).reshape(shape), torch.sin(ang).reshape(shape)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, a * s + b * c], -1)


def _hc(X, fn, sc, base, cfg):
    T, n, H = X.shape
    flat = X.reshape(T, n * H)
    mix = (flat @ fn.t()) / torch.sqrt((flat * flat).mean(-1, keepdim=True) + cfg.rms_eps)
    pre = torch.sigmoid(mix[:, :n] * sc[0] + base[:n]) + 1e-6
    post = torch.sigmoid(mix[:, n:2 * n] * sc[1] + base[n:2 * n]) * 2.0
    c = torch.softmax(mix[:, 2 * n:].reshape(T, n, n) * sc[2] + base[2 * n:].reshape(1, n, n), -1) + 1e-6
    c = c / (c.sum(1, keepdim=True) + 1e-6)
    for _ in range(cfg.sinkhorn_iters - 1):
        c = c / (c.sum(2, keepdim=True) + 1e-6)
        c = c / (c.sum(1, keepdim=True) + 1e-6)
    return (pre[:, :, None] * X).sum(1), post, c


def _mlp(x, w13, w2):
    inter = w13.shape[0] // 2
    z = x @ w13.t()
    g, u = z[:, :inter], z[:, inter:]
    return (g / (1.0 + torch.exp(-g)) * u) @ w2.t()


def f64_sequence_logprobs(P: dict, cfg, tokens: list, n_prompt: int, sel: list, eids: list) -> torch.Tensor:
    """float64 log-probs of tokens[n_prompt:] given tokens[:-1]; P: float64 params; sel/eids per layer [T, .]."""
    inp = torch.tensor(tokens[:-1], dtype=torch.int64)
    T = inp.shape[0]
    n, h, dl, dr = cfg.hc_mult, cfg.heads, cfg.d_latent, cfg.d_rope
    pos = torch.arange(T)
    X = P["embed"][inp][:, None, :].expand(T, n, cfg.hidden)
    for l in range(cfg.layers):
        p = f"layers.{l}."
        u, post, comb = _hc(X, P[p + "attn_hc_fn"], P[p + "attn_hc_scale"], P[p + "attn_hc_base"], cfg)
        a = _rms(u, cfg.rms_eps) * P[p + "attn_norm"]
        cq = _rms(a @ P[p + "wq_a"].t(), cfg.rms_eps) * P[p + "q_norm"]
        q = (cq @ P[p + "wq_b"].t()).reshape(T, h, dl + dr)
        q = torch.cat([q[..., :dl], _rot(q[..., dl:], pos, dr, cfg.rope_theta)], -1)
        kv = a @ P[p + "wkv_a"].t()
        key = torch.cat([_rms(kv[:, :dl], cfg.rms_eps) * P[p + "kv_norm"], _rot(kv[:, dl:], pos, dr, cfg.rope_theta)], -1)
        outs = []
        for t in range(T):
            idx = sel[l][t]
            idx = idx[idx >= 0].long()
            kk = key[idx]
            w = torch.softmax((q[t] @ kk.t()) / math.sqrt(dl + dr), -1)
            outs.append(w @ kk[:, :dl])
        y = torch.stack(outs).reshape(T, h * dl) @ P[p + "wo"].t()
        X = post[:, :, None] * y[:, None, :] + torch.einsum("tij,tih->tjh", comb, X)
        u, post, comb = _hc(X, P[p + "ffn_hc_fn"], P[p + "ffn_hc_scale"], P[p + "ffn_hc_base"], cfg)
        a = _rms(u, cfg.rms_eps) * P[p + "ffn_norm"]
        prob = torch.sigmoid(a @ P[p + "gate"].t())
        ids = eids[l].long()
        wt = prob.gather(1, ids)
        wt = wt / wt.sum(-1, keepdim=True) * cfg.routed_scale
        routed = torch.zeros_like(a)
        for j in range(ids.shape[1]):
            for e in torch.unique(ids[:, j]).tolist():
                rows = (ids[:, j] == e).nonzero(as_tuple=True)[0]
                routed = routed.index_add(0, rows, wt[rows, j:j + 1] * _mlp(a[rows], P[p + "exp_w13"][e], P[p + "exp_w2"][e]))
        y = routed + _mlp(a, P[p + "sh_w13"], P[p + "sh_w2"])
        X = post[:, :, None] * y[:, None, :] + torch.einsum("tij,tih->tjh", comb, X)
    hid = _rms(X.sum(1), cfg.rms_eps) * P["final_norm"]
    logits = hid[n_prompt - 1:] @ P["lm_head"].t()
    tgt = torch.tensor(tokens[n_prompt:], dtype=torch.int64)
    return torch.log_softmax(logits, -1).gather(1, tgt[:, None]).squeeze(1)


def gradient_check(trainer, seqs, coef: dict, pack_seed: int = 0, coef_ref: dict | None = None) -> dict:
    """STE gradients (``trainer``: a TrainingForward) vs the float64 model; returns per-group relative errors.

    ``coef_ref`` (default ``coef``) weights the float64 side's loss: a different value is the negative control
    (the metric must then be large)."""
    masters = trainer.masters
    cfg = trainer.cfg
    for p in masters.values():
        p.grad = None
    rec = Recorder()
    trainer.run(seqs, pack_seed, grad=True, coef=coef, record=rec)
    g_ste = {k: p.grad.detach().double().cpu() for k, p in masters.items() if p.grad is not None}
    for p in masters.values():
        p.grad = None
    P = {k: v.detach().double().cpu().requires_grad_(is_trainable(k)) for k, v in masters.items()}
    loss = 0.0
    for key, prompt, resp in seqs:
        toks = list(prompt) + list(resp)
        L = len(toks) - 1
        sel = [torch.stack([rec.rows[f"layer{l}.dsa_sel"][(key, i)] for i in range(L)]) for l in range(cfg.layers)]
        eids = [torch.stack([rec.rows[f"layer{l}.expert_ids"][(key, i)] for i in range(L)]) for l in range(cfg.layers)]
        lp = f64_sequence_logprobs(P, cfg, toks, len(prompt), sel, eids)
        loss = loss - (coef if coef_ref is None else coef_ref).get(key, 0.0) * lp.sum()
    loss.backward()
    out = {}
    for gname, pred in GROUPS.items():
        names = [k for k in P if pred(k) and P[k].grad is not None]
        if not names:
            continue
        num = sum(float(((g_ste.get(k, torch.zeros_like(P[k].grad)) - P[k].grad) ** 2).sum()) for k in names)
        den = sum(float((P[k].grad ** 2).sum()) for k in names)
        out[gname] = math.sqrt(num) / max(math.sqrt(den), 1e-300)
    return out
