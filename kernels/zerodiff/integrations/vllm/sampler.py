"""Sampled-token log-probs: the rollout side of the training loss (``zerodiff.ops.logprobs``)."""

from __future__ import annotations

import torch


# ------------------------------------------------------------------------------------ sampled log-probs
def keep_raw_logits(logits: torch.Tensor) -> torch.Tensor:
    """A copy of the raw logits taken before the sampler mutates them (temperature is applied in place)."""
    return logits.detach().clone()


def sampled_token_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """FP32 ``log_softmax(raw_logits)[t, sampled[t]]`` from ``zerodiff.ops.logprobs.token_logprobs`` (one
    program per row, fixed chunked order): the value the training side's ``-loss`` reproduces bit for bit."""
    from ...ops.logprobs import token_logprobs

    return token_logprobs(raw_logits, sampled.reshape(-1).long())


def fix_sampled_logprobs(logprobs_tensors, raw_logits: torch.Tensor, sampled: torch.Tensor, num_logprobs):
    """Overwrite the sampled token's log-prob in vLLM's ``LogprobsTensors`` with the zerodiff value:
    column 0 of the gathered layout (``num_logprobs >= 0``), or the sampled column of the full
    ``[T, V]`` tensor (``num_logprobs == -1``). Top-k alternatives and ranks keep the stock values (not part
    of the contract). Returns the same object."""
    if logprobs_tensors is None or num_logprobs is None:
        return logprobs_tensors
    lp = sampled_token_logprobs(raw_logits, sampled)
    t = logprobs_tensors.logprobs
    if num_logprobs == -1:
        t.scatter_(1, sampled.reshape(-1, 1).long(), lp.view(-1, 1))
    else:
        t[:, 0] = lp
    return logprobs_tensors




def token_logprobs_columns(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Replacement for Model Runner V2's ``compute_token_logprobs(logits [B, V], token_ids [B, k])`` (used for
    the sampled token, the top-k alternatives and prompt log-probs alike): FP32 ``log_softmax(logits)`` at each
    requested id, column by column through ``zerodiff.ops.logprobs.token_logprobs`` (one program per row,
    fixed reduction order): the value the training side's ``-loss`` reproduces bit for bit."""
    from ...ops.logprobs import token_logprobs

    if token_ids.dim() != 2 or token_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"zerodiff log-probs: token_ids must be [B, k] with B = {logits.shape[0]}, got "
                         f"{tuple(token_ids.shape)}")
    ids = token_ids.long()
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    for j in range(ids.shape[1]):
        out[:, j] = token_logprobs(logits, ids[:, j].contiguous(), check_ids=False)
    return out
