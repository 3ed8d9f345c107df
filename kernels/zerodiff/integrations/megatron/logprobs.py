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

