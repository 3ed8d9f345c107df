"""Per-step diff report between rollout and training log-probs, named as verl names them.

Over the response tokens of one RL step (``lp_r`` rollout, ``lp_t`` training, FP32 log-probs):

* ``training/rollout_probs_diff_max|mean|std``: max / mean / std (population) of ``|exp(lp_r) - exp(lp_t)|``;
* ``rollout_corr/k3_kl``: mean of ``r - 1 - log r`` with ``r = exp(lp_t - lp_r)`` (the k3 estimator);
* ``tokens``, ``tokens_differ`` (bitwise: ``lp_r != lp_t``), ``bitwise_equal``.

Computed in float64 from the FP32 values. Acceptance: every metric exactly 0.0 (and tokens_differ == 0).
"""

from __future__ import annotations

import math

import torch

KEYS = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
        "rollout_corr/k3_kl")


def diff_report(lp_rollout: dict, lp_train: dict) -> dict:
    keys = sorted(lp_rollout)
    missing = [k for k in keys if k not in lp_train]
    if missing:
        raise KeyError(f"zerodiff: training log-probs missing for requests {missing[:5]}")
    r = torch.cat([lp_rollout[k].detach().double().flatten().cpu() for k in keys])
    t = torch.cat([lp_train[k].detach().double().flatten().cpu() for k in keys])
    if r.shape != t.shape:
        raise ValueError(f"zerodiff: rollout has {r.numel()} response tokens, training {t.numel()}")
    d = (torch.exp(r) - torch.exp(t)).abs()
    ratio = torch.exp(t - r)
    k3 = ratio - 1.0 - (t - r)
    n_diff = int((lp_cat_f32(lp_rollout, keys) != lp_cat_f32(lp_train, keys)).sum())
    out = {
        "training/rollout_probs_diff_max": float(d.max()) if d.numel() else 0.0,
        "training/rollout_probs_diff_mean": float(d.mean()) if d.numel() else 0.0,
        "training/rollout_probs_diff_std": float(d.std(unbiased=False)) if d.numel() else 0.0,
        "rollout_corr/k3_kl": float(k3.mean()) if k3.numel() else 0.0,
        "tokens": int(r.numel()),
        "tokens_differ": n_diff,
    }
    out["bitwise_equal"] = n_diff == 0 and all(out[k] == 0.0 for k in KEYS)
    return out


def lp_cat_f32(lps: dict, keys) -> torch.Tensor:
    return torch.cat([lps[k].detach().float().flatten().cpu() for k in keys])


def is_zero(rep: dict) -> bool:
    return bool(rep.get("bitwise_equal")) and not any(math.isnan(rep[k]) for k in KEYS)


def format_table(reports: list) -> str:
    """Plain-text table: one row per step."""
    seeded = len({rep.get("seed") for rep in reports}) > 1
    head = ("seed " if seeded else "") + (
        f"{'step':>5} {'tokens':>7} {'differ':>7} {'probs_diff_max':>15} {'probs_diff_mean':>15} "
        f"{'probs_diff_std':>15} {'k3_kl':>12} {'batches':>8} {'ok':>3}")
    lines = [head, "-" * len(head)]
    for rep in reports:
        lines.append(
            (f"{rep.get('seed')!s:>4} " if seeded else "")
            + f"{rep['step']:>5} {rep['tokens']:>7} {rep['tokens_differ']:>7} "
            f"{rep['training/rollout_probs_diff_max']:>15.6g} {rep['training/rollout_probs_diff_mean']:>15.6g} "
            f"{rep['training/rollout_probs_diff_std']:>15.6g} {rep['rollout_corr/k3_kl']:>12.4g} "
            f"{rep.get('engine_steps', 0):>8} {'yes' if rep['bitwise_equal'] else 'NO':>3}"
        )
    return "\n".join(lines)
