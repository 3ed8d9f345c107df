"""What makes the negative control a control: the probes ``zerodiff check --baseline`` runs before its steps.

The control (mode ``baseline``) runs the same stock ops on the rollout side and on the training side
(:data:`zerodiff.model.ops.MODES`). Its diff > 0 only shows that stock kernels depend on the batch or the phase if
nothing else differs between the two sides; :func:`control_probe` checks that with three small forwards of each
side's own ops, weights and fresh caches (no gradient):

``same_inputs``
    the same requests in the same single prefill step through the rollout side's ops and weights and through the
    training side's ops and weights: the logits must be bitwise equal (equal precision, equal weights, nothing
    random). The deployments' weight bits are compared too. If this fails the control is confounded.
``batch``
    one request prefilled alone vs the same request among the others in one step (two batch sizes), rollout ops;
``phase``
    the request's last token computed in one prefill of the whole sequence vs prefilled up to it and then decoded
    as a one-token step (prefill vs decode), rollout ops.

For the stock ops at least one of ``batch`` / ``phase`` shows a difference (that is where the end-to-end diff
comes from); for the consistent ops all three are equal.
"""

from __future__ import annotations

import random

import torch

from ..model.cache import PagedCache
from ..model.forward import build_step, forward_step
from .locate import bits


def _sequences(run, n_seqs: int, step: int, max_len: int):
    reqs = run.make_requests(step)[:n_seqs]
    rng = random.Random(step * 7919 + run.seed)
    return [(r.rid, (list(r.prompt) + [rng.randrange(run.cfg.vocab) for _ in range(r.max_new)])[:max_len])
            for r in reqs]


def _forward(ops, dep, cfg, block_size, device, parts_list):
    """Run consecutive steps on one fresh cache; ``parts_list``: per step a list of (key, tokens, start, want)
    with ``want`` the local indices whose logits are returned. Returns {(key, position): fp32 logits row}."""
    total = {}
    for parts in parts_list:
        for key, toks, start, _ in parts:
            total[key] = max(total.get(key, 0), start + len(toks))
    per = {k: -(-n // block_size) for k, n in total.items()}
    cache = PagedCache(cfg, sum(per.values()) + 1, block_size, device)
    blocks = {k: cache.allocator.alloc(n) for k, n in per.items()}
    out = {}
    for parts in parts_list:
        seqs = [{"tokens": toks, "start": start, "blocks": blocks[key], "key": key, "logits_set": set(want)}
                for key, toks, start, want in parts]
        step = build_step(seqs, device)
        with torch.no_grad():
            logits = forward_step(dep, step, cache, ops)
        for row, i in zip(logits, step.logits_rows.tolist()):
            out[step.keys[i]] = row.detach().cpu()
    return out


def _equal(a: dict, b: dict, keys) -> tuple:
    differ = [k for k in keys if not torch.equal(bits(a[k]), bits(b[k]))]
    mx = max((float((a[k].double() - b[k].double()).abs().max()) for k in differ), default=0.0)
    return not differ, len(differ), mx


def control_probe(run, n_seqs: int = 3, tail: int = 4, step: int | None = None, max_len: int = 128) -> dict:
    """The three probes above for ``run`` (an :class:`~zerodiff.rl.loop.RLRun`), on ``n_seqs`` requests of
    ``step`` (default: the run's next step) with random response tokens, each cut to ``max_len`` tokens (short:
    the probes need two batch sizes and two phases, not long contexts); logits of the last ``tail`` positions."""
    step = run.step if step is None else step
    cfg, dev = run.cfg, run.device
    bs = run.preset.rollout.block_size
    seqs = _sequences(run, n_seqs, step, max_len)
    wants = {k: list(range(len(t) - 1 - tail, len(t) - 1)) for k, t in seqs}
    batch = [[(k, t[:-1], 0, wants[k]) for k, t in seqs]]
    r_ops, t_ops = run.engine.ops, run.trainer.ops
    r_dep, t_dep = run.rollout_dep, run.train_dep
    t_dep.update_(run.masters)  # as the training forward does before every run
    keys = [(k, p) for k, _ in seqs for p in wants[k]]
    rollout_batch = _forward(r_ops, r_dep, cfg, bs, dev, batch)
    train_batch = _forward(t_ops, t_dep, cfg, bs, dev, batch)
    w_equal = all(_weights_equal(r_dep.tensors[n], t_dep.tensors[n]) for n in r_dep.tensors)
    same_ok, same_n, same_mx = _equal(rollout_batch, train_batch, keys)

    k0, t0 = seqs[0]
    keys0 = [(k0, p) for p in wants[k0]]
    alone = _forward(r_ops, r_dep, cfg, bs, dev, [[(k0, t0[:-1], 0, wants[k0])]])
    b_ok, b_n, b_mx = _equal(alone, rollout_batch, keys0)
    last = len(t0) - 2  # the last input position
    phased = _forward(r_ops, r_dep, cfg, bs, dev, [[(k0, t0[:last], 0, [])], [(k0, t0[last:last + 1], last, [0])]])
    p_ok, p_n, p_mx = _equal(phased, alone, [(k0, last)])
    return {
        "rollout_ops": type(r_ops).__name__, "train_ops": type(t_ops).__name__, "weights_bitwise_equal": w_equal,
        "same_inputs": {"equal": same_ok and w_equal, "rows": len(keys), "rows_differ": same_n, "max_abs": same_mx,
                        "what": f"{n_seqs} requests in one prefill step, rollout ops+weights vs training ops+weights"},
        "batch": {"equal": b_ok, "rows": len(keys0), "rows_differ": b_n, "max_abs": b_mx,
                  "what": f"request {k0} alone ({len(t0) - 1} tokens) vs among {n_seqs} requests "
                          f"({sum(len(t) - 1 for _, t in seqs)} tokens), rollout ops"},
        "phase": {"equal": p_ok, "rows": 1, "rows_differ": p_n, "max_abs": p_mx,
                  "what": f"request {k0}'s position {last}: one prefill vs prefill of {last} tokens + a decode "
                          "step, rollout ops"},
    }


def _weights_equal(a, b) -> bool:
    if hasattr(a, "q"):
        return torch.equal(bits(a.q), bits(b.q)) and torch.equal(bits(a.scale), bits(b.scale))
    return torch.equal(bits(a), bits(b))


def describe(probe: dict) -> list:
    """Human-readable lines for the terminal."""
    s, b, p = probe["same_inputs"], probe["batch"], probe["phase"]

    def word(x):
        return "bitwise equal" if x["equal"] else f"DIFFER ({x['rows_differ']}/{x['rows']} rows, max |d| {x['max_abs']:.3g})"

    return [f"control: sides run {probe['rollout_ops']} / {probe['train_ops']}; weights bitwise equal: "
            f"{probe['weights_bitwise_equal']}",
            f"control: same inputs on both sides ({s['what']}): {word(s)}",
            f"control: batch ({b['what']}): {word(b)}",
            f"control: phase ({p['what']}): {word(p)}"]
