"""The harness model at EP = 2 (a gloo world of 2 CPU processes) for tests/test_expert_parallel.py.

Each rank serves its own requests (prefill, then decode steps, in lockstep with the other rank) with
:class:`zerodiff.model.expert_parallel_ops.ExpertParallelOps`; the parent recomputes every rank's requests alone
with ``ConsistentOps`` (EP = 1). Rounds change the other rank's batch while the victim request stays, so the
victim's bits must not move. The negative control runs one other combine (reduced per expert rank and rounded to
BF16 there, then summed) at EP = 2 and at EP = 1: the two must differ somewhere.
"""

from __future__ import annotations

import os
import random

import torch

WORLD = 2
SEED = 31
DECODE_STEPS = 2


def _prompts(seed, n, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(5, 28))] for _ in range(n)]


def rounds(vocab):
    """[(label, prompts of rank 0, prompts of rank 1)]; the victim is request 0 of rank 0 in every round."""
    victim = _prompts(7, 1, vocab)[0]
    out = []
    for label, n0, n1, s in (("r0=3,r1=2", 3, 2, 1), ("r0=1,r1=5", 1, 5, 2), ("r0=6,r1=1", 6, 1, 3)):
        p0 = _prompts(100 + s, n0, vocab)
        p0[0] = victim
        if n0 > 2:  # the victim also at another position of its batch
            p0[0], p0[n0 // 2] = p0[n0 // 2], p0[0]
        out.append((label, p0, _prompts(200 + s, n1, vocab)))
    return out


def victim_index(p0, vocab):
    victim = _prompts(7, 1, vocab)[0]
    return next(i for i, p in enumerate(p0) if p == victim)


def next_token(prompt, step, vocab):
    """The fixed token fed at decode step ``step`` (a function of the request's own prompt only)."""
    return (sum(prompt) + 5 * step + 3) % vocab


def model_config():
    """The CPU preset's model with 6 experts per token: with 2 slots any combine order gives the same FP32 sum
    (a + b == b + a), so the control could not differ; with 4 the order is visible."""
    import dataclasses

    from zerodiff.model.config import CPU

    return dataclasses.replace(CPU.model, top_experts=6)


def serve(dep, cfg, ops, prompts, device="cpu"):
    """Prefill every request (logits at every position), then DECODE_STEPS decode steps (fixed next tokens):
    returns (per request: logits [len + DECODE_STEPS, V] fp32, log-probs of the next tokens), on the CPU."""
    from zerodiff.model.cache import PagedCache
    from zerodiff.model.forward import build_step, forward_step
    from zerodiff.model.ops import token_logprobs

    cache = PagedCache(cfg, 256, 8, device=device)
    blocks = [cache.allocator.alloc(5) for _ in prompts]
    pre = [{"tokens": p, "start": 0, "blocks": b, "key": i, "logits_set": set(range(len(p)))}
           for i, (p, b) in enumerate(zip(prompts, blocks))]
    per = [[] for _ in prompts]
    with torch.no_grad():
        lg = forward_step(dep, build_step(pre, device=device), cache, ops)
        at = 0
        for i, p in enumerate(prompts):
            per[i].append(lg[at: at + len(p)])
            at += len(p)
        for d in range(DECODE_STEPS):
            seqs = [{"tokens": [next_token(p, d, cfg.vocab)], "start": len(p) + d, "blocks": blocks[i], "key": i,
                     "logits_set": {0}} for i, p in enumerate(prompts)]
            lg = forward_step(dep, build_step(seqs, device=device), cache, ops)
            for i in range(len(prompts)):
                per[i].append(lg[i: i + 1])
    out = []
    for i, p in enumerate(prompts):
        logits = torch.cat(per[i]).float()
        nxt = torch.tensor(p[1:] + [next_token(p, d, cfg.vocab) for d in range(DECODE_STEPS)] + [0],
                           device=logits.device)
        out.append((logits.cpu(), token_logprobs(logits, nxt[: logits.shape[0]]).cpu()))
    return out


def control_ops_classes():
    """The negative control, one combine at two EP degrees: (EP = 2 ops class, EP = 1 ops class) whose routed
    experts are reduced per expert rank and rounded to BF16 there, then summed on the token's rank. At EP = 1
    that is one partial (the slot-order sum, rounded once); at EP = 2 two partials: same code and precision,
    only the EP degree differs."""
    from ep_cases import control_partial_sums
    from zerodiff.model.expert_parallel_ops import ExpertParallelOps
    from zerodiff.model.ops import ConsistentOps
    from zerodiff.ops import expert_parallel as ep
    from zerodiff.ops import moe

    class ReducedOnExpertRankOps(ExpertParallelOps):
        def kernel_moe_visible(self, x, wts, ids, w13, w2, s13, s2):
            experts = ep.local_experts(moe.MoEWeights(w13, w2), self.ep_size, self.rank)
            plan = ep.plan_ep_dispatch(ids, int(w13.q.shape[0]), self.ep_size, self.rank, self.capacity)
            y = ep.ep_expert_rows(x, ids, experts, plan, self.mover, backend=None if x.is_cuda else "reference")
            routed = control_partial_sums(y, plan, wts, ids, partial_dtype=torch.bfloat16)
            return (routed + self._expert_visible(x, s13, s2).float()).to(torch.bfloat16)

    class ReducedOnOneRankOps(ConsistentOps):
        def kernel_moe_visible(self, x, wts, ids, w13, w2, s13, s2):
            routed = self._routed_generic(x, wts, ids, w13, w2).to(torch.bfloat16).to(torch.float32)
            return (routed + self._expert_visible(x, s13, s2).float()).to(torch.bfloat16)

    return ReducedOnExpertRankOps, ReducedOnOneRankOps


def worker(rank, store_path, out_dir):
    import torch.distributed as dist

    from zerodiff.model.expert_parallel_ops import ExpertParallelOps
    from zerodiff.model.weights import Deployment, init_masters
    from zerodiff.ops import expert_parallel as ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        cfg = model_config()
        dep = Deployment(init_masters(cfg, SEED))
        mover = ep.TorchDistributedMover()
        res = {"rounds": {}, "control": {}, "calls": {}}
        for label, p0, p1 in rounds(cfg.vocab):
            mine = p0 if rank == 0 else p1
            for cap in (None, 512):
                ops = ExpertParallelOps(cfg, ep_size=WORLD, rank=rank, mover=mover, capacity=cap)
                res["rounds"][(label, cap)] = serve(dep, cfg, ops, mine)
                res["calls"][(label, cap)] = ops.ep_calls
            ctl = control_ops_classes()[0](cfg, ep_size=WORLD, rank=rank, mover=mover)
            res["control"][label] = serve(dep, cfg, ctl, mine)
        torch.save(res, os.path.join(out_dir, f"model-rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def summary_worker(rank, store_path, out_dir, backend="nccl"):
    """The rounds on one device per rank (NCCL: GPU ``rank``, CUDA kernels; gloo: the CPU): each rank compares
    its EP = 2 results with EP = 1 (ConsistentOps) on its own device and the control at EP = 2 with the control
    at EP = 1; saves a summary (``summary-rank<r>.pt``)."""
    import torch.distributed as dist

    from zerodiff.model.expert_parallel_ops import ExpertParallelOps
    from zerodiff.model.ops import ConsistentOps
    from zerodiff.model.weights import Deployment, init_masters
    from zerodiff.ops import expert_parallel as ep

    from zerodiff.rl.expert_parallel import init_rank

    dev = init_rank(rank, WORLD, backend, store_path)
    try:
        cfg = model_config()
        dep = Deployment(init_masters(cfg, SEED, device=dev))
        mover = ep.TorchDistributedMover()
        ep2_ctl, ep1_ctl = control_ops_classes()
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        summary = {"rank": rank, "device": name, "backend": backend, "mover": mover.mode, "rounds": []}
        for label, p0, p1 in rounds(cfg.vocab):
            mine = p0 if rank == 0 else p1
            ref = serve(dep, cfg, ConsistentOps(cfg), mine, dev)
            for cap in (None, 512):
                got = serve(dep, cfg, ExpertParallelOps(cfg, ep_size=WORLD, rank=rank, mover=mover, capacity=cap),
                            mine, dev)
                differ = sum(int((a[0].view(torch.int32) != b[0].view(torch.int32)).sum()) +
                             int((a[1].view(torch.int32) != b[1].view(torch.int32)).sum()) for a, b in zip(got, ref))
                summary["rounds"].append({"round": label, "capacity": cap, "requests": len(mine),
                                          "tokens": sum(a[0].shape[0] for a in got), "values_differ": differ})
            c2 = serve(dep, cfg, ep2_ctl(cfg, ep_size=WORLD, rank=rank, mover=mover), mine, dev)
            c1 = serve(dep, cfg, ep1_ctl(cfg), mine, dev)
            summary["rounds"].append({"round": label, "control": "expert-side BF16 partials, EP 2 vs EP 1",
                                      "requests_differ": sum(not torch.equal(a[0], b[0]) for a, b in zip(c2, c1))})
        torch.save(summary, os.path.join(out_dir, f"summary-rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rl_control_worker(rank, store_path, out_dir):
    """One RL step of ExpertParallelRLRun (CPU preset, gloo) whose rollout combines on the expert rank in BF16
    (the control ops): the diff check must see it (DiffError), on both ranks."""
    import torch.distributed as dist

    from zerodiff.rl.expert_parallel import ExpertParallelRLRun
    from zerodiff.rl.loop import DiffError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        run = ExpertParallelRLRun("cpu", 0, ep_size=WORLD, rank=rank, device="cpu")
        ctl = control_ops_classes()[0](run.cfg, ep_size=WORLD, rank=rank, mover=run.mover)
        run.engine.ops = ctl
        try:
            run.run_step()
            res = {"error": None}
        except DiffError as e:
            res = {"error": str(e), "tokens_differ": (e.report or {}).get("tokens_differ")}
        torch.save(res, os.path.join(out_dir, f"rl-control-rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rl_graphs_worker(rank, store_path, out_dir):
    """One step's EP = 2 rollout (CPU preset, gloo) eagerly and with the decode graphs (emulated on the CPU: the
    padded static step with the static graph capacity): the same responses and log-probs bit for bit."""
    import torch.distributed as dist

    from zerodiff.rl.expert_parallel import ExpertParallelRLRun

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        outs, graph_steps = {}, {}
        for graphs in (False, True):
            run = ExpertParallelRLRun("cpu", 5, ep_size=WORLD, rank=rank, device="cpu", graphs=graphs)
            _reqs, out = run.rollout(0)
            outs[graphs] = {rid: (o.response, o.logprobs) for rid, o in out.items()}
            graph_steps[graphs] = run.engine.stats["graph_steps"]
        torch.save({"outs": outs, "graph_steps": graph_steps}, os.path.join(out_dir, f"rl-graphs-rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
