"""Rollout engine: request queue, continuous batching under a token budget, paged FP8 KV cache, seeded
sampling, per-token log-probs of the sampled tokens.

Scheduling (every choice drawn from ``random.Random(sched_seed)`` so batch composition varies run to run
while staying reproducible): the queue is shuffled (arrival order); every engine step draws a token budget
and a max batch size from the rollout config's ranges; running requests are visited decode-first, the
rest in a shuffled order, each taking ``min(remaining uncomputed tokens, budget left)`` tokens, so steps
mix chunked-prefill chunks and decode tokens; the flat order of the scheduled requests is shuffled too.
KV blocks come from a LIFO allocator and are freed when a request finishes (block ids get recycled).

Decode goes through the same read path as prefill (``forward_step``: FP8 cache -> workspace gather ->
sparse attention). CUDA graphs: pure-decode steps on CUDA replay a captured graph (see
:mod:`zerodiff.rollout.graphs`; ``use_graphs=None`` -> on for CUDA when the config enables them); mixed
steps run eagerly; on the CPU everything is eager (``use_graphs="emulate"`` runs the graphs' padded static
decode step eagerly, so the padding / scratch-block / graph-safe MoE logic is tested on the CPU too).

Sampling: temperature 1, Gumbel-max with a counter-based hash (:mod:`zerodiff.model.sampling`): the token
of request ``rid`` at position ``p`` is a pure function of (logits row, seed, rid, p). The log-prob stored
for a sampled token is ``ops.logprobs(logits_row, token)`` (FP32 log-softmax of the raw FP32 logits).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ..model.cache import PagedCache
from ..model.forward import build_step, forward_step
from ..model.sampling import sample_tokens
from ..rl.diverge import ops_for


@dataclass
class Request:
    rid: int
    prompt: list
    max_new: int
    tokens: list = field(default_factory=list)
    computed: int = 0
    blocks: list = field(default_factory=list)
    out_tokens: list = field(default_factory=list)
    out_lp: list = field(default_factory=list)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)


@dataclass
class RolloutResult:
    rid: int
    prompt: list
    response: list
    logprobs: torch.Tensor  # fp32 [len(response)]


class RolloutEngine:
    def __init__(self, preset, deployment, ops, device="cpu", sample_seed: int = 0, use_graphs=None):
        self.preset = preset
        self.cfg = preset.model
        self.rcfg = preset.rollout
        self.dep = deployment
        self.ops = ops
        self.device = torch.device(device)
        self.sample_seed = sample_seed
        self.cache = PagedCache(self.cfg, self.rcfg.num_blocks, self.rcfg.block_size, device)
        if use_graphs is None:
            use_graphs = self.rcfg.cuda_graphs and self.device.type == "cuda"
        self.graphs = None
        self.emulate_graphs = use_graphs == "emulate"  # CPU test mode: the padded static decode step, eagerly
        if use_graphs:
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)
        self.stats = {"steps": 0, "mixed_steps": 0, "decode_steps": 0, "graph_steps": 0, "batch_sizes": []}
        #: when True (CUDA only), every engine step's model forward is bracketed by CUDA events and
        #: ``generate`` adds ``stats["forward_device_s"]``: the GPU time from the forward's first kernel to its
        #: last (graph replays: the graph's device time; eager steps: includes gaps while the host enqueues).
        #: Sampling and host bookkeeping are outside the brackets. Off by default (events cost a little).
        self.time_device = False
        #: an expert-parallel group's lockstep (see :class:`zerodiff.rl.expert_parallel.Lockstep`): every rank
        #: runs one model forward per engine step until no rank has work; a rank without work runs a padding
        #: step (one token of a reserved block, no logits) so the MoE layers' collectives stay matched, and the
        #: ranks replay decode graphs only in a step where every rank does.
        self.lockstep = None

    def _ensure_blocks(self, r: Request, upto: int) -> None:
        bs = self.rcfg.block_size
        need = (upto + bs - 1) // bs
        if need > len(r.blocks):
            r.blocks.extend(self.cache.allocator.alloc(need - len(r.blocks)))

    def generate(self, requests, sched_seed: int, record=None, max_steps: int = 100000) -> dict:
        """Run all ``requests`` (list of :class:`Request`) to completion; returns ``{rid: RolloutResult}``."""
        rng = random.Random(sched_seed)
        queue = list(requests)
        rng.shuffle(queue)
        running: list = []
        done = {}
        lo_b, hi_b = self.rcfg.token_budget
        lo_m, hi_m = self.rcfg.max_batch
        events = [] if (self.time_device and self.device.type == "cuda") else None
        for _ in range(max_steps):
            if not queue and not running:
                if self.lockstep is None or not self.lockstep.agree(False, False)[0]:
                    break
                self.lockstep.pad_step(self)
                continue
            budget = rng.randint(lo_b, hi_b)
            maxb = rng.randint(lo_m, hi_m)
            while queue and len(running) < maxb:
                running.append(queue.pop(0))
            order = running[:]
            rng.shuffle(order)
            order.sort(key=lambda r: 0 if len(r.tokens) - r.computed == 1 and r.computed > 0 else 1)
            sched = []
            for r in order[:maxb]:
                if budget <= 0:
                    break
                n = min(len(r.tokens) - r.computed, budget)
                self._ensure_blocks(r, r.computed + n)
                sched.append((r, n))
                budget -= n
            rng.shuffle(sched)
            seqs = []
            for r, n in sched:
                last = r.computed + n == len(r.tokens)
                seqs.append({"tokens": r.tokens[r.computed: r.computed + n], "start": r.computed,
                             "blocks": r.blocks, "logits_set": {n - 1} if last else set(), "key": r.rid})
            step = build_step(seqs, self.device)
            pure_decode = all(n == 1 and r.computed > 0 for r, n in sched)
            self.stats["steps"] += 1
            self.stats["batch_sizes"].append(len(sched))
            self.stats["decode_steps" if pure_decode else "mixed_steps"] += 1
            rec = None
            if record is not None:
                rec = lambda name, t, _k=step.keys: record(name, _k, t)  # noqa: E731
            use_graph = pure_decode and self.graphs is not None and rec is None and self.graphs.supports(step)
            if self.lockstep is not None:  # the ranks replay graphs together or run eagerly together
                use_graph = self.lockstep.agree(True, use_graph)[1]
            with torch.no_grad():
                if events is not None:
                    events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                    events[-1][0].record()
                if use_graph:
                    logits = self.graphs.run(step, eager=self.emulate_graphs)
                    self.stats["graph_steps"] += int(self.graphs.disabled is None)
                else:
                    logits = forward_step(self.dep, step, self.cache, ops_for(record, self.ops, step), record=rec)
                if events is not None:
                    events[-1][1].record()
                # sample + log-probs for the rows that produced logits (in logits_rows order)
                rows = step.logits_rows.tolist()
                owners = [step.keys[i] for i in rows]
                req = torch.tensor([o[0] for o in owners], dtype=torch.int64, device=self.device)
                pos = torch.tensor([o[1] for o in owners], dtype=torch.int64, device=self.device)
                toks = sample_tokens(logits, self.sample_seed, req, pos)
                lps = self.ops.logprobs(logits, toks)
            by_rid = {o[0]: (int(t), lp) for o, t, lp in zip(owners, toks.tolist(), lps.unbind(0))}
            for r, n in sched:
                r.computed += n
                if r.rid in by_rid:
                    t, lp = by_rid[r.rid]
                    r.tokens.append(t)
                    r.out_tokens.append(t)
                    r.out_lp.append(lp)
                    if len(r.out_tokens) >= r.max_new:
                        self.cache.allocator.free(r.blocks)
                        r.blocks = []
                        running.remove(r)
                        done[r.rid] = RolloutResult(r.rid, list(r.prompt), list(r.out_tokens),
                                                    torch.stack(r.out_lp).float())
        else:
            raise RuntimeError("zerodiff: rollout did not finish within max_steps")
        if events:
            torch.cuda.synchronize(self.device)
            self.stats["forward_device_s"] = sum(a.elapsed_time(b) for a, b in events) / 1e3
        return done
