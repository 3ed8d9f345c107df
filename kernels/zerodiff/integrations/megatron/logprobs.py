"""Sampled-token log-probs: the training loss and the log-probs the RL loop reads."""

from __future__ import annotations

import torch

from .. import ConfigError

__all__ = ["token_logprobs", "cross_entropy"]


# ------------------------------------------------------------------------------------------- log-probs
class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2, ids, temperature):
        from ...ops.logprobs import token_logprobs as zd_token_logprobs

        ctx.save_for_backward(logits2, ids)
        ctx.temperature = temperature
        return zd_token_logprobs(logits2, ids, temperature=temperature)

    @staticmethod
    def backward(ctx, g):
        logits2, ids = ctx.saved_tensors
        t = ctx.temperature
        p = torch.softmax(logits2.float() / t, dim=-1)
        onehot = torch.zeros_like(p).scatter_(1, ids.view(-1, 1), 1.0)
        gl = (onehot - p) * (g.float() / t).unsqueeze(1)
        return gl.to(logits2.dtype), None, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """FP32 log-prob of ``target`` under ``logits / temperature`` (``[..., V]`` -> ``[...]``), bit-identical
    to the rollout's ``zerodiff.ops.logprobs.token_logprobs``; differentiable w.r.t. ``logits``."""
    V = logits.shape[-1]
    lead = target.shape
    lg = logits.reshape(-1, V)
    if lg.stride(-1) != 1:
        lg = lg.contiguous()
    out = _TokenLogprobs.apply(lg, target.reshape(-1).long(), float(temperature))
    return out.view(lead)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                  tp_group=None) -> torch.Tensor:
    """Megatron's ``vocab_parallel_cross_entropy`` in consistency mode (TP = 1): ``-token_logprobs``.
    ``tp_group`` must be None or of size 1 (the vocabulary is not split)."""
    if label_smoothing:
        raise ConfigError(f"zerodiff cross entropy: label_smoothing={label_smoothing} is not supported")
    if tp_group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size(tp_group) != 1:
            raise ConfigError("zerodiff cross entropy: the vocabulary is split over a TP group of size "
                              f"{torch.distributed.get_world_size(tp_group)}; consistency mode needs TP = 1")
    return -token_logprobs(logits, target)



# ------------------------------------------------------------------------------------ Megatron-RL log-probs
__all__ += ["selective_log_softmax", "route_rl_logprobs"]

_STOCK_ATTR = "_zerodiff_stock_selective_log_softmax"


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The log-prob of ``index`` under ``logits`` (``[..., V]``, ``[...]`` -> FP32 ``[...]``), the signature of
    Megatron-RL's ``rl_utils.selective_log_softmax`` (what its ``get_logprobs`` calls for the training and the
    old-policy log-probs), computed by :func:`token_logprobs`: bit-identical to the rollout's sampled-token
    log-prob (``zerodiff.ops.logprobs.token_logprobs``) on the same logits, differentiable w.r.t. ``logits``.
    Unlike the stock function it always returns FP32 (never BF16 log-probs for BF16 logits)."""
    if index.shape != logits.shape[:-1]:
        raise ConfigError(f"zerodiff selective_log_softmax: index {tuple(index.shape)} must have the logits' "
                          f"leading shape {tuple(logits.shape[:-1])}")
    return token_logprobs(logits, index, temperature)


def route_rl_logprobs(rl_utils) -> bool:
    """Route Megatron-RL's log-probs through :func:`selective_log_softmax`: ``rl_utils`` is the imported
    ``megatron.rl.rl_utils`` module, whose ``get_logprobs`` looks ``selective_log_softmax`` up in the module at
    call time, so replacing the module attribute routes every caller of ``get_logprobs``. The stock function is
    kept as ``rl_utils._zerodiff_stock_selective_log_softmax``. Idempotent (returns False when already routed).
    A module without ``selective_log_softmax`` is refused: the RL code changed and nothing would be routed."""
    current = getattr(rl_utils, "selective_log_softmax", None)
    if current is None:
        raise ConfigError(f"zerodiff: {getattr(rl_utils, '__name__', rl_utils)!r} has no selective_log_softmax; "
                          "this Megatron-RL version computes its log-probs elsewhere and is not routed")
    if current is selective_log_softmax:
        return False
    setattr(rl_utils, _STOCK_ATTR, current)
    rl_utils.selective_log_softmax = selective_log_softmax
    return True
