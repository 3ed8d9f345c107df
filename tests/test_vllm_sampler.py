"""The vLLM sampler adapter (``zerodiff.integrations.vllm.sampler``): the sampled token's log-prob comes from the
raw logits through ``zerodiff.ops.logprobs``; the alternatives stay untouched."""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from zerodiff.integrations import vllm as zv


def test_vllm_sampled_logprobs(seeded):
    from zerodiff.ops.logprobs import token_logprobs

    g = seeded()
    T, V, k = 4, 300, 3
    raw = (torch.randn(T, V, generator=g) * 3).to(torch.bfloat16)
    kept = zv.keep_raw_logits(raw)
    raw.div_(0.5)  # the sampler mutates its logits in place (temperature)
    sampled = torch.randint(0, V, (T,), generator=g)
    stock = raw.float().log_softmax(-1)
    lt = NS(logprobs=torch.cat([stock.gather(1, sampled[:, None]), stock.topk(k, -1).values], 1))
    zv.fix_sampled_logprobs(lt, kept, sampled, k)
    want = token_logprobs(kept, sampled)
    assert torch.equal(lt.logprobs[:, 0], want)
    assert torch.equal(lt.logprobs[:, 1:], stock.topk(k, -1).values)  # alternatives untouched
    full = NS(logprobs=stock.clone())
    zv.fix_sampled_logprobs(full, kept, sampled, -1)
    assert torch.equal(full.logprobs.gather(1, sampled[:, None])[:, 0], want)
    assert zv.fix_sampled_logprobs(None, kept, sampled, k) is None
