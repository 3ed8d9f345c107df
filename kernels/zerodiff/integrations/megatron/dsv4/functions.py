"""Log-probs of the DeepSeek-V4 actor where Megatron(-RL) reads them.

* :func:`selective_log_softmax` (``logits [..., V]``, ``index [...]`` -> FP32 ``[...]``): the signature of
  Megatron-RL's ``rl_utils.selective_log_softmax``, which the 0008 patch routes to
  :func:`zerodiff.integrations.megatron.selective_log_softmax`.
* :func:`cross_entropy` (``-log p``): the value the 0005-routed ``vocab_parallel_cross_entropy`` returns.

Both compute the rollout engine's sampled-token log-prob op on the same FP32 logits, so the bits equal the
rollout's: on CUDA tensors that op is ``zerodiff.ops.logprobs.token_logprobs``, and these functions ARE the
routed Megatron functions (:func:`zerodiff.integrations.megatron.selective_log_softmax` /
``cross_entropy``); on CPU tensors the rollout engine runs its exact CPU counterpart
(``zerodiff.model.ops.token_logprobs``), and so do these. The backward is the FP32 softmax gradient
(``(onehot - softmax(logits / t)) * g / t``), the same as the routed functions'.
"""

from __future__ import annotations

import torch

from ... import ConfigError
from .. import logprobs as _zl

__all__ = ["token_logprobs", "selective_log_softmax", "cross_entropy"]


class _CpuTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2, ids):
        from ....model.ops import token_logprobs as harness_token_logprobs

        ctx.save_for_backward(logits2, ids)
        return harness_token_logprobs(logits2.float(), ids)

    @staticmethod
    def backward(ctx, g):
        logits2, ids = ctx.saved_tensors
        p = torch.softmax(logits2.float(), dim=-1)
        onehot = torch.zeros_like(p).scatter_(1, ids.view(-1, 1), 1.0)
        return ((onehot - p) * g.float().unsqueeze(1)).to(logits2.dtype), None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """FP32 ``log softmax(logits / temperature)[target]`` (``[..., V]``, ``[...]`` -> ``[...]``), differentiable
    w.r.t. ``logits``; the rollout engine's op (see the module docstring)."""
    if logits.is_cuda:
        return _zl.token_logprobs(logits, target, temperature)
    if temperature != 1.0:
        raise ConfigError(f"zerodiff actor log-probs: temperature={temperature}: the rollout engine samples and "
                          "scores at temperature 1")
    V = logits.shape[-1]
    lead = target.shape
    lg = logits.reshape(-1, V)
    if lg.stride(-1) != 1:
        lg = lg.contiguous()
    return _CpuTokenLogprobs.apply(lg, target.reshape(-1).long()).view(lead)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Megatron-RL's ``selective_log_softmax`` signature (see the module docstring)."""
    if logits.is_cuda:
        return _zl.selective_log_softmax(logits, index, temperature)
    if index.shape != logits.shape[:-1]:
        raise ConfigError(f"zerodiff selective_log_softmax: index {tuple(index.shape)} must have the logits' "
                          f"leading shape {tuple(logits.shape[:-1])}")
    return token_logprobs(logits, index, temperature)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """``vocab_parallel_cross_entropy`` in consistency mode: ``-token_logprobs`` (no label smoothing)."""
    if logits.is_cuda:
        return _zl.cross_entropy(logits, target, label_smoothing)
    if label_smoothing:
        raise ConfigError(f"zerodiff cross entropy: label_smoothing={label_smoothing} is not supported")
    return -token_logprobs(logits, target)
