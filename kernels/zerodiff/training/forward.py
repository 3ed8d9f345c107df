"""Training forward: pack whole (prompt + response) sequences into micro-batches unrelated to the rollout's
batches, run THE SAME ``forward_step`` with the same ops (autograd-wrapped through a :class:`Tape`), and
return per-token log-probs of the response tokens.

* Packing: sequences are shuffled with ``random.Random(pack_seed)`` and packed greedily into micro-batches
  of at most ``train.micro_tokens`` tokens; each sequence is one request with context 0 in a PRIVATE paged
  FP8 cache (its K goes through the same FP8 round trip as the rollout's), so every token is computed with
  the whole sequence in one chunk: a different batch, chunking and position-in-batch than in the rollout.
* The training deployment is requantised from the BF16 masters IN PLACE before every forward (the rule is
  the same as the rollout's, so the FP8 bits are the same).
* Autograd: the visible values are the kernels'; each op adds an FP32 STE graph; the returned log-probs are
  bit-identical to the kernel output while gradients flow to the masters; every backward checks weight
  versions (see :mod:`zerodiff.model.ops`).
"""

from __future__ import annotations

import random

import torch

from ..model.cache import PagedCache
from ..model.forward import build_step, forward_step
from ..model.ops import Tape
from ..rl.diverge import ops_for


def pack(seqs, micro_tokens: int, pack_seed: int):
    """seqs: list of (key, prompt, response). Returns a list of micro-batches (lists of seqs)."""
    order = list(seqs)
    random.Random(pack_seed).shuffle(order)
    micro, cur, n = [], [], 0
    for s in order:
        L = len(s[1]) + len(s[2]) - 1
        if cur and n + L > micro_tokens:
            micro.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += L
    if cur:
        micro.append(cur)
    return micro


class TrainingForward:
    def __init__(self, preset, masters, deployment, ops, device="cpu"):
        self.preset = preset
        self.cfg = preset.model
        self.masters = masters
        self.dep = deployment
        self.ops = ops
        self.device = torch.device(device)
        bs = preset.rollout.block_size
        per = (self.cfg.max_pos + bs - 1) // bs
        nb = max(per * 4, (preset.train.micro_tokens + self.cfg.max_pos) // bs * 2 + per)
        self.cache = PagedCache(self.cfg, nb, bs, device)

    def _step_for(self, mb):
        self.cache.allocator = type(self.cache.allocator)(self.cache.num_blocks)
        seqs = []
        bs = self.cache.block_size
        targets = []
        for key, prompt, resp in mb:
            toks = list(prompt) + list(resp)
            inp = toks[:-1]
            nblk = (len(inp) + bs - 1) // bs
            blocks = self.cache.allocator.alloc(nblk)
            first = len(prompt) - 1
            seqs.append({"tokens": inp, "start": 0, "blocks": blocks, "key": key,
                         "logits_set": set(range(first, len(inp)))})
            targets.extend(resp)
        step = build_step(seqs, self.device)
        return step, torch.tensor(targets, dtype=torch.int64, device=self.device)

    def run(self, seqs, pack_seed: int, *, grad: bool = False, coef=None, record=None, on_micro=None):
        """Log-probs per key (fp32 [len(response)]). With ``grad``: per micro-batch, backward of
        ``-sum_k coef[k] * sum(lp_k)``; ``on_micro(keys, lps)`` is called BEFORE that backward (the diff
        check) and may raise to stop before any gradient is applied."""
        out = {}
        self.dep.update_(self.masters)
        micro = pack(seqs, self.preset.train.micro_tokens, pack_seed)
        #: (sequences, tokens) per micro-batch of the last run: the packing the step really used
        self.last_packing = [(len(mb), sum(len(s[1]) + len(s[2]) - 1 for s in mb)) for mb in micro]
        for mb in micro:
            step, targets = self._step_for(mb)
            rec = None
            if record is not None:
                rec = lambda name, t, _k=step.keys: record(name, _k, t)  # noqa: E731
            self.ops.tape = Tape() if grad else None
            try:
                with torch.set_grad_enabled(grad):
                    logits = forward_step((self.dep, self.masters if grad else None), step, self.cache,
                                          ops_for(record, self.ops, step), record=rec)
                    lp = self.ops.logprobs(logits, targets)
                lens = [len(s[2]) for s in mb]
                parts = torch.split(lp, lens)
                keys = [s[0] for s in mb]
                res = {k: p.detach() for k, p in zip(keys, parts)}
                if on_micro is not None:
                    on_micro(keys, res)
                if grad:
                    loss = sum(-float(coef[k]) * p.sum() for k, p in zip(keys, parts) if coef and coef.get(k))
                    if torch.is_tensor(loss) and loss.requires_grad:
                        loss.backward()
                out.update(res)
            finally:
                self.ops.tape = None
        return out
