"""RL steps with an expert-parallel rollout (EP = ``ep_size`` ranks) and an EP = 1 training forward.

Public API::

    Lockstep(group=None, device="cpu")      .agree(active, graph) -> (any active, all graph), .pad_step(engine)
    ExpertParallelRLRun(preset, seed, *, ep_size, rank, device=None, group=None, graphs=False)   (an RLRun)
    run_ep_check(preset="cpu", *, steps=2, seed=0, ep_size=2, backend=None, graphs=False, progress=None) -> dict
    init_rank(rank, world_size, backend, store_path) -> torch.device   (join a file-store world)
    EP_CHECK_FORMAT = "zerodiff-ep-check-1"

Each rank of a ``torch.distributed`` world of ``ep_size`` processes holds the same masters (same seed) and its
own rollout engine whose MoE layers run through :class:`zerodiff.model.expert_parallel_ops.ExpertParallelOps`
(the rank's slice of the experts; tokens travel to the owning rank and back, combined on the token's rank in FP32
in slot order). A step's requests are dealt round-robin to the ranks (request ``i`` to rank ``i % ep_size``);
each rank schedules its own requests (its own schedule seed), so the ranks' batches differ in size and content
every engine step. The engines run in lockstep (:class:`Lockstep`): a rank without work runs a padding step.
``graphs``: pure-decode steps through the engine's decode graphs when every rank's step is one (the static
``graph_capacity`` = largest graph batch x ``min(k, E / ep_size)`` rows per destination, the same on every rank;
on CUDA every rank captures every size at start, in the same order, so the capture's collectives match; on the
CPU the captured step is emulated eagerly); mixed steps and padding steps run eagerly with counts exchanged.
The rollout results are gathered on every rank; every rank then runs the same EP = 1 training forward
(``ConsistentOps``, all experts local) over all responses, checks diff = 0 against the rollout's log-probs per
micro-batch before any update, and applies the same optimizer step (the ranks' masters stay equal; the run
compares a digest of them after every step).

Numerical contract: the rollout log-probs of every response token equal the training forward's bitwise, for
any ``ep_size`` and any distribution of the requests over the ranks (the contract of ``ExpertParallelOps``).

Failure modes: ``InputError`` for ``ep_size < 2``, an expert count not divisible by ``ep_size``, or a CUDA run
with fewer visible GPUs than ``ep_size`` (``--rollout-ep`` is named in the message); a diff != 0 raises
:class:`zerodiff.rl.loop.DiffError` on every rank (the report names the first diverging layer).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import torch

from ..errors import InputError
from ..model.config import preset as get_preset
from ..model.expert_parallel_ops import ExpertParallelOps
from ..model.forward import build_step, forward_step
from ..ops.expert_parallel import TorchDistributedMover
from ..rollout.engine import RolloutEngine, RolloutResult
from .loop import DiffError, RLRun, _mix

EP_CHECK_FORMAT = "zerodiff-ep-check-1"

__all__ = ["Lockstep", "ExpertParallelRLRun", "run_ep_check", "init_rank", "EP_CHECK_FORMAT"]


class Lockstep:
    """Keeps the rollout engines of an EP group stepping together (one model forward per engine step)."""

    def __init__(self, group=None, device="cpu"):
        self.group = group
        self.device = torch.device(device)
        self.pad_steps = 0
        self._block = None

    def agree(self, active: bool, graph: bool) -> tuple[bool, bool]:
        """One collective per engine step on every rank: (any rank still has requests, every rank runs this
        step as a decode-graph replay). A rank without requests passes (False, False)."""
        import torch.distributed as dist

        flags = torch.tensor([1 if active else 0, 0 if graph else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        any_active, any_eager = (bool(v) for v in flags.tolist())
        return any_active, not any_eager

    def pad_step(self, engine: RolloutEngine) -> None:
        """One forward of a single padding token in a block reserved for it; no logits, no sampling."""
        if self._block is None:
            self._block = engine.cache.allocator.alloc(1)
        step = build_step([{"tokens": [0], "start": 0, "blocks": self._block, "logits_set": set(), "key": -1}],
                          engine.device)
        with torch.no_grad():
            forward_step(engine.dep, step, engine.cache, engine.ops)
        self.pad_steps += 1


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(k.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class ExpertParallelRLRun(RLRun):
    """RLRun whose rollout runs at EP = ``ep_size`` on this rank (see the module docstring)."""

    def __init__(self, preset, seed: int = 0, *, ep_size: int, rank: int, device=None, group=None,
                 graphs: bool = False):
        p = get_preset(preset) if isinstance(preset, str) else preset
        _check_ep_size(p, ep_size)
        self.ep_size, self.rank, self.group, self.graphs_on = int(ep_size), int(rank), group, bool(graphs)
        self.mover = TorchDistributedMover(group)
        self.rank_tokens: list = []
        super().__init__(p, seed, "consistent", device)  # builds the engine through _make_engine
        if self.engine.graphs is not None and not self.engine.emulate_graphs:
            # every rank, every size, in the same order: the captures' collectives match
            self.graph_capture = self.engine.graphs.capture_all()

    def _make_engine(self) -> RolloutEngine:
        rc = self.preset.rollout
        graph_capacity = max(rc.graph_batch_sizes) * min(self.cfg.top_experts, self.cfg.experts // self.ep_size)
        self.ep_ops = ExpertParallelOps(self.cfg, ep_size=self.ep_size, rank=self.rank, mover=self.mover,
                                        graph_capacity=graph_capacity)
        use_graphs = False if not self.graphs_on else (True if self.device.type == "cuda" else "emulate")
        engine = RolloutEngine(self.preset, self.rollout_dep, self.ep_ops, self.device,
                               sample_seed=_mix(self.seed, 7), use_graphs=use_graphs)
        engine.lockstep = Lockstep(self.group, self.device if self.device.type == "cuda" else "cpu")
        return engine

    def rollout(self, step: int, record=None):
        import torch.distributed as dist

        reqs = self.make_requests(step)
        mine = reqs[self.rank::self.ep_size]
        self.engine.stats = {"steps": 0, "mixed_steps": 0, "decode_steps": 0, "graph_steps": 0, "batch_sizes": []}
        local = self.engine.generate(mine, sched_seed=_mix(self.seed, step, 2, self.rank), record=record)
        payload = {rid: (o.prompt, o.response, o.logprobs.cpu()) for rid, o in local.items()}
        gathered = [None] * self.ep_size
        dist.all_gather_object(gathered, payload, group=self.group)
        out = {}
        self.rank_tokens = []
        for part in gathered:
            self.rank_tokens.append(sum(len(v[1]) for v in part.values()))
            for rid, (prompt, response, lp) in part.items():
                out[rid] = RolloutResult(rid, prompt, response, lp.to(self.device))
        return reqs, out

    def masters_digest(self) -> str:
        return _digest(self.masters)


def _check_ep_size(p, ep_size) -> None:
    if int(ep_size) < 2:
        raise InputError(f"zerodiff: --rollout-ep={ep_size}: an expert-parallel rollout needs at least 2 ranks")
    if p.model.experts % int(ep_size):
        raise InputError(f"zerodiff: --rollout-ep={ep_size} does not divide the preset's {p.model.experts} experts")


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def init_rank(rank: int, world_size: int, backend: str, store_path: str) -> torch.device:
    """Join a ``torch.distributed`` world through a file store and return this rank's device: NCCL on GPU
    ``rank``, gloo on the CPU (one intra-op thread, so the ranks of one host do not compete for cores)."""
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    return device


def _worker(rank, ep_size, backend, preset_obj, steps, seed, store, out_dir, verbose=False, graphs=False):
    import torch.distributed as dist

    device = init_rank(rank, ep_size, backend, store)
    result = {"rank": rank, "steps": [], "error": None}
    try:
        run = ExpertParallelRLRun(preset_obj, seed, ep_size=ep_size, rank=rank, device=device, graphs=graphs)
        result["mover"] = run.mover.mode
        pads = 0
        for i in range(steps):
            try:
                rep = run.run_step()
            except DiffError as e:
                result["error"] = str(e)
                result["steps"].append(e.report)
                break
            digests = [None] * ep_size
            dist.all_gather_object(digests, run.masters_digest())
            rep = dict(rep, rank_tokens=list(run.rank_tokens), pad_steps=run.engine.lockstep.pad_steps - pads,
                       masters_equal_across_ranks=len(set(digests)) == 1)
            pads = run.engine.lockstep.pad_steps
            result["steps"].append(rep)
            if verbose and rank == 0:
                print(f"[{i + 1}/{steps}] step {rep['step']}: tokens {rep['tokens']} (per rank {rep['rank_tokens']}) "
                      f"differ {rep['tokens_differ']} probs_diff_max {rep['training/rollout_probs_diff_max']:.3g} "
                      f"k3 {rep['rollout_corr/k3_kl']:.3g} engine steps {rep['engine_steps']} (rank 0; padding "
                      f"{rep['pad_steps']}) masters equal across ranks {rep['masters_equal_across_ranks']}",
                      file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        torch.save(result, os.path.join(out_dir, f"ep-rank{rank}.pt"))
        dist.destroy_process_group()


def run_ep_check(preset="cpu", *, steps: int = 2, seed: int = 0, ep_size: int = 2, backend=None,
                 graphs: bool = False, progress=None) -> dict:
    """Spawn a world of ``ep_size`` processes (NCCL, one GPU each, when CUDA is available, else gloo on the CPU),
    run ``steps`` RL steps of :class:`ExpertParallelRLRun`, return rank 0's view plus every rank's agreement:
    ``{"format", "preset", "seed", "ep_size", "backend", "device", "steps": [per-step diff reports],
    "passed", "error"}``."""
    import torch.multiprocessing as mp

    p = get_preset(preset) if isinstance(preset, str) else preset
    _check_ep_size(p, ep_size)
    if backend is None:
        backend = "nccl" if _visible_gpus() > 0 else "gloo"
    if backend == "nccl" and _visible_gpus() < int(ep_size):
        raise InputError(f"zerodiff: --rollout-ep={ep_size} on CUDA needs {ep_size} visible GPUs (one per rank), "
                         f"found {_visible_gpus()}; run on a host with {ep_size} GPUs or on the CPU (gloo)")
    with tempfile.TemporaryDirectory(prefix="zerodiff-ep-") as d:
        if progress:
            progress(f"zerodiff: EP={ep_size} rollout vs EP=1 training, {steps} step(s), {backend}, preset {p.name}")
        mp.spawn(_worker, args=(int(ep_size), backend, p, int(steps), int(seed), os.path.join(d, "store"), d,
                                progress is not None, bool(graphs)),
                 nprocs=int(ep_size), join=True)
        ranks = [torch.load(os.path.join(d, f"ep-rank{r}.pt"), weights_only=False) for r in range(int(ep_size))]
    r0 = ranks[0]
    errors = [r["error"] for r in ranks if r["error"]]
    ok_steps = [s for s in r0["steps"] if s is not None]
    passed = not errors and len(ok_steps) == int(steps) and all(
        s.get("bitwise_equal") and s.get("masters_equal_across_ranks") for s in ok_steps) and all(
        [s.get("bitwise_equal") for s in r["steps"]] == [s.get("bitwise_equal") for s in ok_steps] for r in ranks)
    device = "cpu" if backend == "gloo" else torch.cuda.get_device_name(0)
    rollout = f"EP={ep_size} (ExpertParallelOps, {'decode graphs' if graphs else 'eager'})"
    return {"format": EP_CHECK_FORMAT, "preset": p.name, "seed": int(seed), "ep_size": int(ep_size),
            "backend": backend, "device": device, "mover": r0.get("mover"), "rollout": rollout,
            "graphs": bool(graphs), "training": "EP=1 (ConsistentOps)", "steps": ok_steps, "passed": bool(passed),
            "error": errors[0] if errors else None}
