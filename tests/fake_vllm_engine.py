"""A stand-in for ``vllm.LLM`` behind ``zerodiff.vllm_check``'s engine interface, for CPU tests.

Its "model" is a fixed function of the request's tokens so far (the sampled token and its log-prob follow
from a hash of the context and the request seed). With ``ZERODIFF_CONSISTENT=1`` the result never depends
on the batch; without it the log-prob picks up a term from the batch size (like a kernel chosen from M),
and with ``FAKE_VLLM_LEAK=prefill`` the consistent side's prefill scores differ from decode.
"""

import hashlib
import os
import struct


def _h(*xs) -> int:
    return int.from_bytes(hashlib.blake2b(repr(xs).encode(), digest_size=8).digest(), "little")


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


class FakeEngine:
    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.consistent = os.environ.get("ZERODIFF_CONSISTENT") == "1"
        self.leak = os.environ.get("FAKE_VLLM_LEAK", "")

    def info(self):
        return {"vllm_version": "fake", "torch": "cpu", "device": "cpu", "consistent": self.consistent,
                "eager": self.kwargs.get("enforce_eager")}

    def _score(self, ctx, token, batch, phase):
        base = -((_h(tuple(ctx[-8:]), token) % 100000) / 10000.0) - 0.01
        if not self.consistent and batch > 1:
            base += 1e-6 * (batch % 7 + 1)
        if self.consistent and self.leak == "prefill" and phase == "prefill":
            base += 1e-6
        if self.consistent and self.leak == "eager" and self.kwargs.get("enforce_eager"):
            base += 1e-6
        return _f32(base)

    def generate(self, requests):
        out = []
        for r in requests:
            ctx = list(r.prompt)
            res = {"tokens": [], "logprobs": []}
            if r.prompt_logprobs:
                res["prompt_logprobs"] = [None] + [self._score(ctx[:i], ctx[i], len(requests), "prefill")
                                                   for i in range(1, len(ctx))]
            for _ in range(r.max_tokens):
                t = _h(tuple(ctx[-8:]), r.seed) % 1000 + 1
                res["tokens"].append(t)
                res["logprobs"].append(self._score(ctx, t, len(requests), "decode"))
                ctx.append(t)
            out.append(res)
        return out
