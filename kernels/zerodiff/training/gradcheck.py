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


def f64_sequence_logprobs(P: dict, cfg, tokens: list, n_prompt: int, sel: list, eids: list, vis=None) -> torch.Tensor:
    """float64 log-probs of tokens[n_prompt:] given tokens[:-1]; P: float64 params; sel/eids per layer [T, .].

    ``vis(name, y, positions)`` (optional) is applied to the output ``y`` of every op named ``name`` (the op names
    of :mod:`zerodiff.rl.locate`); the tight check passes a function that gives ``y`` the kernel forward's visible
    value while keeping ``y``'s float64 gradient, so each op's derivative is taken where the training graph takes
    it. Without ``vis`` the model is the plain unquantised float64 model."""
    inj = vis if vis is not None else (lambda name, y, positions=None: y)
    inp = torch.tensor(tokens[:-1], dtype=torch.int64)
    T = inp.shape[0]
    n, h, dl, dr = cfg.hc_mult, cfg.heads, cfg.d_latent, cfg.d_rope
    pos = torch.arange(T)
    X = inj("embed", P["embed"][inp])[:, None, :].expand(T, n, cfg.hidden)

    def hc(X, p, sub):
        u, post, comb = _hc(X, P[p + sub + "_hc_fn"], P[p + sub + "_hc_scale"], P[p + sub + "_hc_base"], cfg)
        nm = p + sub + "_hc_pre"
        return inj(nm, u), inj(nm + ":post", post), inj(nm + ":comb", comb)

    for l in range(cfg.layers):
        p = f"layers.{l}."
        u, post, comb = hc(X, p, "attn")
        a = inj(p + "attn_norm", _rms(u, cfg.rms_eps) * P[p + "attn_norm"])
        cq = inj(p + "q_norm", _rms(inj(p + "wq_a", a @ P[p + "wq_a"].t()), cfg.rms_eps) * P[p + "q_norm"])
        q = inj(p + "wq_b", cq @ P[p + "wq_b"].t()).reshape(T, h, dl + dr)
        q = torch.cat([q[..., :dl], inj(p + "q_rope", _rot(q[..., dl:], pos, dr, cfg.rope_theta))], -1)
        kv = inj(p + "wkv_a", a @ P[p + "wkv_a"].t())
        key = torch.cat([inj(p + "kv_norm", _rms(kv[:, :dl], cfg.rms_eps) * P[p + "kv_norm"]),
                         inj(p + "k_rope", _rot(kv[:, dl:], pos, dr, cfg.rope_theta))], -1)
        outs = []
        for t in range(T):
            idx = sel[l][t]
            idx = idx[idx >= 0].long()
            kk = key[idx]
            w = torch.softmax((q[t] @ kk.t()) / math.sqrt(dl + dr), -1)
            outs.append(w @ kk[:, :dl])
        o = inj(p + "attention", torch.stack(outs))
        y = inj(p + "wo", o.reshape(T, h * dl) @ P[p + "wo"].t())
        X = inj(p + "attn_hc_post", post[:, :, None] * y[:, None, :] + torch.einsum("tij,tih->tjh", comb, X))
        u, post, comb = hc(X, p, "ffn")
        a = inj(p + "ffn_norm", _rms(u, cfg.rms_eps) * P[p + "ffn_norm"])
        prob = torch.sigmoid(inj(p + "gate", a @ P[p + "gate"].t()))
        ids = eids[l].long()
        wt = prob.gather(1, ids)
        wt = inj(p + "route", wt / wt.sum(-1, keepdim=True) * cfg.routed_scale)
        routed = torch.zeros_like(a)
        for j in range(ids.shape[1]):
            for e in torch.unique(ids[:, j]).tolist():
                rows = (ids[:, j] == e).nonzero(as_tuple=True)[0]
                routed = routed.index_add(0, rows, wt[rows, j:j + 1] * _mlp(a[rows], P[p + "exp_w13"][e], P[p + "exp_w2"][e]))
        y = inj(p + "moe", routed + _mlp(a, P[p + "sh_w13"], P[p + "sh_w2"]))
        X = inj(p + "ffn_hc_post", post[:, :, None] * y[:, None, :] + torch.einsum("tij,tih->tjh", comb, X))
    hid = inj("final_norm", _rms(inj("mhc_final", X.sum(1)), cfg.rms_eps) * P["final_norm"])
    logits = inj("lm_head", hid[n_prompt - 1:] @ P["lm_head"].t(), range(n_prompt - 1, T))
    tgt = torch.tensor(tokens[n_prompt:], dtype=torch.int64)
    return torch.log_softmax(logits, -1).gather(1, tgt[:, None]).squeeze(1)


def _ste_gradients(trainer, seqs, coef: dict, pack_seed: int, rec):
    """Run the training forward + backward once with recorder ``rec``: (the masters' STE gradients as float64 CPU
    tensors, fresh float64 CPU copies of the masters, trainable ones requiring grad). The masters' .grad are left
    cleared."""
    masters = trainer.masters
    for p in masters.values():
        p.grad = None
    trainer.run(seqs, pack_seed, grad=True, coef=coef, record=rec)
    g_ste = {k: p.grad.detach().double().cpu() for k, p in masters.items() if p.grad is not None}
    for p in masters.values():
        p.grad = None
    P = {k: v.detach().double().cpu().requires_grad_(is_trainable(k)) for k, v in masters.items()}
    return g_ste, P


def gradient_check(trainer, seqs, coef: dict, pack_seed: int = 0, coef_ref: dict | None = None) -> dict:
    """STE gradients (``trainer``: a TrainingForward) vs the float64 model; returns per-group relative errors.

    ``coef_ref`` (default ``coef``) weights the float64 side's loss: a different value is the negative control
    (the metric must then be large)."""
    cfg = trainer.cfg
    rec = Recorder()
    g_ste, P = _ste_gradients(trainer, seqs, coef, pack_seed, rec)
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm()) / max(float(b.norm()), 1e-300)


def tight_gradient_check(trainer, seqs, coef: dict, pack_seed: int = 0) -> dict:
    """Per-tensor check of the STE backward against a float64 autograd reference taken at the same point.

    The training forward runs with op-level recording (:class:`zerodiff.rl.locate.OpRecorder`); the float64
    model (:func:`f64_sequence_logprobs`, no kernel code) then gives every op's output the recorded visible value
    while keeping its own float64 derivative (``v + (y - y.detach())``), so each op's Jacobian is evaluated at the
    values the training graph sees: quantisation noise is no longer part of the comparison. What is left is the
    training graph's FP32 arithmetic and the rounding of each gradient to its master's dtype (BF16 masters get
    BF16 gradients, summed in BF16 over micro-batches).

    Returns ``{tensor: {"rel_err", "rounding_floor", "dtype", "ref_norm"}}`` for every trainable master, with
    ``rel_err = ||g_ste - g_f64|| / ||g_f64||`` and ``rounding_floor = ||round(g_f64) - g_f64|| / ||g_f64||`` (the
    error of rounding the exact gradient once to the master's dtype: what a perfect BF16 backward would show).
    A master without an STE gradient counts as a zero gradient."""
    from ..rl.locate import OpRecorder

    masters = trainer.masters
    cfg = trainer.cfg
    rec = OpRecorder()
    g_ste, P = _ste_gradients(trainer, seqs, coef, pack_seed, rec)
    loss = torch.zeros((), dtype=torch.float64)
    for key, prompt, resp in seqs:
        toks = list(prompt) + list(resp)
        L = len(toks) - 1

        def vis(name, y, positions=None, _key=key, _L=L):
            v = rec.stacked(name, _key, range(_L) if positions is None else positions).double()
            if v.shape != y.shape:
                raise AssertionError(f"zerodiff gradcheck: op {name!r}: recorded {tuple(v.shape)}, "
                                     f"reference {tuple(y.shape)}")
            return v + (y - y.detach())

        sel = [rec.stacked(f"layers.{l}.dsa_topk", key, range(L)) for l in range(cfg.layers)]
        eids = [rec.stacked(f"layers.{l}.route:ids", key, range(L)) for l in range(cfg.layers)]
        lp = f64_sequence_logprobs(P, cfg, toks, len(prompt), sel, eids, vis=vis)
        loss = loss - coef.get(key, 0.0) * lp.sum()
    loss.backward()
    out = {}
    for k, p in P.items():
        if p.grad is None:
            continue
        ref = p.grad
        ste = g_ste.get(k, torch.zeros_like(ref))
        dt = masters[k].dtype
        out[k] = {"rel_err": _rel(ste, ref), "rounding_floor": _rel(ref.to(dt).double(), ref),
                  "dtype": str(dt).replace("torch.", ""), "ref_norm": float(ref.norm())}
    return out


def recorded_recipe(preset: str = "cpu", seed: int = 0, n_seqs: int = 6, coef_seed: int = 1):
    """The inputs :data:`RECORDED_CPU` was measured on: a fresh ``RLRun(preset, seed)``, the first ``n_seqs``
    sequences (sorted by request id) of its step-0 rollout, loss coefficients drawn N(0, 1) from
    ``torch.Generator().manual_seed(coef_seed)``; at pack seed 0 they fill two training micro-batches (5 + 1
    sequences), so the accumulation of gradients over micro-batches is part of what is checked.
    Returns ``(run, seqs, coef)``."""
    from ..rl.loop import RLRun

    run = RLRun(preset, seed=seed)
    _, out = run.rollout(0)
    seqs = [(k, o.prompt, o.response) for k, o in sorted(out.items())[:n_seqs]]
    g = torch.Generator().manual_seed(coef_seed)
    coef = {k: float(torch.randn(1, generator=g)) for k, _, _ in seqs}
    return run, seqs, coef


#: ``rel_err`` per trainable master of :func:`tight_gradient_check` on :func:`recorded_recipe` (CPU config, one
#: thread, torch 2.13 CPU), recorded with ``python tests/gradcheck_mutations.py --record``. BF16 masters:
#: 1.1-1.8x the error of rounding the float64 gradient once to BF16 (two micro-batches: two roundings plus a BF16
#: sum); FP32 masters (mHC): FP32 graph arithmetic, 1e-7 .. 6e-6. The bounds are :func:`tight_bounds` of these.
RECORDED_CPU = {
    "embed": 1.759e-03,  # bfloat16, rounding floor 1.65e-03
    "layers.0.attn_hc_fn": 4.368e-07,  # float32, rounding floor 2.58e-08
    "layers.0.attn_hc_scale": 5.718e-06,  # float32, rounding floor 2.30e-08
    "layers.0.attn_hc_base": 1.764e-06,  # float32, rounding floor 2.94e-08
    "layers.0.attn_norm": 2.359e-03,  # bfloat16, rounding floor 1.57e-03
    "layers.0.ffn_hc_fn": 6.433e-07,  # float32, rounding floor 2.50e-08
    "layers.0.ffn_hc_scale": 1.637e-06,  # float32, rounding floor 7.21e-09
    "layers.0.ffn_hc_base": 7.115e-07,  # float32, rounding floor 2.95e-08
    "layers.0.ffn_norm": 2.622e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.0.wq_a": 2.445e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.0.q_norm": 2.214e-03,  # bfloat16, rounding floor 1.55e-03
    "layers.0.wq_b": 2.427e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.0.wkv_a": 2.447e-03,  # bfloat16, rounding floor 1.65e-03
    "layers.0.kv_norm": 2.264e-03,  # bfloat16, rounding floor 1.45e-03
    "layers.0.wo": 2.446e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.0.gate": 2.406e-03,  # bfloat16, rounding floor 1.64e-03
    "layers.0.exp_w13": 2.326e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.0.exp_w2": 2.329e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.0.sh_w13": 2.443e-03,  # bfloat16, rounding floor 1.67e-03
    "layers.0.sh_w2": 2.395e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.1.attn_hc_fn": 3.653e-07,  # float32, rounding floor 2.54e-08
    "layers.1.attn_hc_scale": 1.513e-07,  # float32, rounding floor 4.67e-08
    "layers.1.attn_hc_base": 1.773e-07,  # float32, rounding floor 2.74e-08
    "layers.1.attn_norm": 2.440e-03,  # bfloat16, rounding floor 1.60e-03
    "layers.1.ffn_hc_fn": 6.601e-07,  # float32, rounding floor 2.41e-08
    "layers.1.ffn_hc_scale": 3.180e-06,  # float32, rounding floor 2.64e-08
    "layers.1.ffn_hc_base": 2.143e-07,  # float32, rounding floor 2.10e-08
    "layers.1.ffn_norm": 2.627e-03,  # bfloat16, rounding floor 1.81e-03
    "layers.1.wq_a": 2.437e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.1.q_norm": 2.525e-03,  # bfloat16, rounding floor 1.56e-03
    "layers.1.wq_b": 2.437e-03,  # bfloat16, rounding floor 1.65e-03
    "layers.1.wkv_a": 2.443e-03,  # bfloat16, rounding floor 1.65e-03
    "layers.1.kv_norm": 2.165e-03,  # bfloat16, rounding floor 1.67e-03
    "layers.1.wo": 2.428e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.1.gate": 2.406e-03,  # bfloat16, rounding floor 1.68e-03
    "layers.1.exp_w13": 2.370e-03,  # bfloat16, rounding floor 1.65e-03
    "layers.1.exp_w2": 2.382e-03,  # bfloat16, rounding floor 1.66e-03
    "layers.1.sh_w13": 2.416e-03,  # bfloat16, rounding floor 1.65e-03
    "layers.1.sh_w2": 2.403e-03,  # bfloat16, rounding floor 1.67e-03
    "final_norm": 2.806e-03,  # bfloat16, rounding floor 1.56e-03
    "lm_head": 2.338e-03,  # bfloat16, rounding floor 1.67e-03
}


def tight_bounds(recorded: dict, bf16_factor: float = 2.0, fp32_factor: float = 4.0, fp32_floor: float = 1e-5,
                 cfg=None) -> dict:
    """Per-tensor bounds anchored at recorded errors: ``bf16_factor * recorded`` for BF16 masters,
    ``max(fp32_factor * recorded, fp32_floor)`` for FP32 masters (a 3-element FP32 tensor's error is FP32 rounding
    noise whose size changes with the data by an order of magnitude, hence the floor)."""
    from ..model.config import CPU
    from ..model.weights import param_shapes

    dtypes = {k: v[1] for k, v in param_shapes(cfg or CPU.model).items()}
    return {k: (max(fp32_factor * r, fp32_floor) if dtypes[k] == torch.float32 else bf16_factor * r)
            for k, r in recorded.items()}
