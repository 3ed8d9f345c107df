"""GRPO-style RL loop with a diff = 0 check on every step, checkpoint save/restore.

One step (1 optimizer update per step, on-policy):

1. requests: ``prompts_per_step`` random prompts (seeded by (seed, step)), each sampled
   ``responses_per_prompt`` times (one group per prompt); response lengths drawn per request;
2. rollout (:class:`~zerodiff.rollout.engine.RolloutEngine`), with a schedule seed drawn per step so the
   batch composition changes from step to step and run to run;
3. toy verifiable reward: fraction of response tokens with id < ``reward_tokens``; group-normalised
   advantages ``(r - mean_group) / (std_group + 1e-6)``;
4. training forward on a different packing (seeded differently), per micro-batch: log-probs -> diff check
   against the rollout's -> backward of ``-sum_i A_i * sum_t lp_it / n_tokens`` (STE gradients w.r.t. the
   masters). A micro-batch with diff != 0 stops the step BEFORE any update (when ``stop_on_diff``) and the
   first diverging layer is located by re-running both sides with per-layer recording;
5. AdamW on FP32 main copies of the trainable masters, masters overwritten in place (BF16/FP32), then the
   rollout's deployment requantised IN PLACE from them (same storage: captured CUDA graphs stay valid).

Checkpoint (``save``/``load``): masters, FP32 main params, optimizer state, step, seed, preset and mode;
the step RNGs derive from (seed, step), so a restored run continues bit-identically, and the first step
after restore is checked like any other.
"""

from __future__ import annotations

import random
import time

import torch

from ..model.config import preset as get_preset
from ..model.ops import make_ops
from ..model.weights import Deployment, init_masters
from ..rollout.engine import Request, RolloutEngine
from ..training.forward import TrainingForward
from .diverge import Recorder, first_divergence
from .report import diff_report


class DiffError(RuntimeError):
    def __init__(self, msg, report=None, divergence=None):
        super().__init__(msg)
        self.report = report
        self.divergence = divergence


def _mix(*xs) -> int:
    h = 1469598103934665603
    for x in xs:
        h = ((h ^ (int(x) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 61)
    return h


class RLRun:
    def __init__(self, preset="cpu", seed: int = 0, mode: str = "consistent", device=None, stop_on_diff=None):
        self.preset = get_preset(preset) if isinstance(preset, str) else preset
        self.cfg = self.preset.model
        self.seed = int(seed)
        self.mode = mode
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.stop_on_diff = (mode == "consistent") if stop_on_diff is None else stop_on_diff
        self.masters = init_masters(self.cfg, self.seed, self.device)
        self.trainable = [k for k, p in self.masters.items() if p.requires_grad]
        self.main = {k: self.masters[k].detach().float().clone() for k in self.trainable}
        tc = self.preset.train
        self.opt = torch.optim.AdamW([self.main[k] for k in self.trainable], lr=tc.lr, betas=tc.betas,
                                     weight_decay=tc.weight_decay)
        self.rollout_dep = Deployment(self.masters)
        self.train_dep = Deployment(self.masters)
        self.engine = self._make_engine()
        self.trainer = TrainingForward(self.preset, self.masters, self.train_dep, make_ops(mode, "train", self.cfg),
                                       self.device)
        self.step = 0
        self.history: list = []

    # ---- pieces ------------------------------------------------------------------------------------
    def _make_engine(self) -> RolloutEngine:
        """The rollout engine over ``self.rollout_dep`` (the expert-parallel run overrides it)."""
        return RolloutEngine(self.preset, self.rollout_dep, make_ops(self.mode, "rollout", self.cfg), self.device,
                             sample_seed=_mix(self.seed, 7))

    def make_requests(self, step: int):
        rc = self.preset.rollout
        rng = random.Random(_mix(self.seed, step, 1))
        reqs = []
        for p in range(rc.prompts_per_step):
            prompt = [rng.randrange(self.cfg.vocab) for _ in range(rng.randint(*rc.prompt_len))]
            for j in range(rc.responses_per_prompt):
                rid = _mix(step, p, j) % 1_000_000_007
                reqs.append(Request(rid, prompt, rng.randint(*rc.response_len)))
        return reqs

    def rollout(self, step: int, record=None):
        reqs = self.make_requests(step)
        self.engine.stats = {"steps": 0, "mixed_steps": 0, "decode_steps": 0, "graph_steps": 0, "batch_sizes": []}
        out = self.engine.generate(reqs, sched_seed=_mix(self.seed, step, 2), record=record)
        return reqs, out

    def advantages(self, reqs, out) -> dict:
        rc = self.preset.rollout
        groups: dict = {}
        for r in reqs:
            groups.setdefault(tuple(r.prompt), []).append(r.rid)
        adv, rewards = {}, {}
        for rids in groups.values():
            rw = torch.tensor([float(sum(t < rc.reward_tokens for t in out[i].response)) / len(out[i].response)
                               for i in rids], dtype=torch.float64)
            a = (rw - rw.mean()) / (rw.std(unbiased=False) + 1e-6)
            for i, x, r in zip(rids, a.tolist(), rw.tolist()):
                adv[i], rewards[i] = x, r
        return adv, rewards

    def locate(self, step: int) -> dict | None:
        """Re-run the step's rollout and training forward with per-layer recording; first diverging layer."""
        rr, rt = Recorder(), Recorder()
        _, out = self.rollout(step, record=rr)
        seqs = [(k, o.prompt, o.response) for k, o in sorted(out.items())]
        self.trainer.run(seqs, pack_seed=_mix(self.seed, step, 3), grad=False, record=rt)
        return first_divergence(rr, rt)

    # ---- one RL step ------------------------------------------------------------------------------
    def run_step(self) -> dict:
        step = self.step
        t0 = time.perf_counter()
        reqs, out = self.rollout(step)
        t_roll = time.perf_counter() - t0
        adv, rewards = self.advantages(reqs, out)
        ntok = sum(len(o.response) for o in out.values())
        coef = {k: adv[k] / ntok for k in out}
        seqs = [(k, o.prompt, o.response) for k, o in sorted(out.items())]
        lp_roll = {k: o.logprobs for k, o in out.items()}

        def on_micro(keys, lps):
            if not self.stop_on_diff:
                return
            rep = diff_report({k: lp_roll[k] for k in keys}, lps)
            if not rep["bitwise_equal"]:
                raise DiffError("diff != 0", rep)

        for p in self.masters.values():
            p.grad = None
        t1 = time.perf_counter()
        try:
            lp_train = self.trainer.run(seqs, pack_seed=_mix(self.seed, step, 3), grad=True, coef=coef,
                                        on_micro=on_micro)
        except DiffError as e:
            div = self.locate(step)
            e.divergence = div
            lp_eval = self.trainer.run(seqs, pack_seed=_mix(self.seed, step, 3), grad=False)
            e.report = self._report(step, lp_roll, lp_eval, rewards, t_roll, 0.0, div)
            where = f"first diverging layer {div['layer']} (request {div['request']}, position {div['position']})" \
                if div else "no per-layer difference found (divergence after the last recorded layer: LM head / log-softmax)"
            raise DiffError(f"zerodiff: step {step}: rollout and training log-probs differ "
                            f"({e.report['tokens_differ']} of {e.report['tokens']} tokens); {where}",
                            e.report, div) from None
        t_train = time.perf_counter() - t1
        self._optimizer_step()
        rep = self._report(step, lp_roll, lp_train, rewards, t_roll, t_train, None)
        self.history.append(rep)
        self.step += 1
        return rep

    def _report(self, step, lp_roll, lp_train, rewards, t_roll, t_train, div):
        rep = diff_report(lp_roll, lp_train)
        st = self.engine.stats
        ntok = rep["tokens"]
        rep.update(step=step, mode=self.mode, engine_steps=st["steps"], mixed_steps=st["mixed_steps"],
                   decode_steps=st["decode_steps"], graph_steps=st["graph_steps"],
                   batch_sizes=sorted(set(st["batch_sizes"])), reward_mean=sum(rewards.values()) / max(1, len(rewards)),
                   rollout_s=round(t_roll, 4), train_s=round(t_train, 4),
                   rollout_tok_per_s=round(ntok / t_roll, 2) if t_roll > 0 else None)
        pk = getattr(self.trainer, "last_packing", None)
        if pk:
            rep["train_micro_batches"] = len(pk)
            rep["train_seqs_per_micro"] = [n for n, _ in pk]
            rep["train_tokens_per_micro"] = [t for _, t in pk]
        if div is not None:
            rep["first_divergence"] = div
        g = self.engine.graphs
        if g is not None and g.disabled:
            rep["cuda_graphs_disabled"] = g.disabled
        return rep

    def _optimizer_step(self) -> None:
        with torch.no_grad():
            for k in self.trainable:
                g = self.masters[k].grad
                self.main[k].grad = None if g is None else g.detach().float()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            for k in self.trainable:
                self.masters[k].copy_(self.main[k].to(self.masters[k].dtype))
                self.masters[k].grad = None
            self.rollout_dep.update_(self.masters)  # in place: same storage for captured graphs

    # ---- checkpoint ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "format": "zerodiff-e2e-1", "preset": self.preset.name, "preset_obj": self.preset, "seed": self.seed, "mode": self.mode,
            "step": self.step, "masters": {k: v.detach().cpu() for k, v in self.masters.items()},
            "main": {k: v.detach().cpu() for k, v in self.main.items()}, "opt": self.opt.state_dict(),
            "history": self.history,
        }

    def save(self, path) -> None:
        torch.save(self.state_dict(), path)

    @classmethod
    def load(cls, path, device=None, preset=None) -> "RLRun":
        sd = torch.load(path, map_location="cpu", weights_only=False)
        if sd.get("format") != "zerodiff-e2e-1":
            raise ValueError(f"zerodiff: {path} is not a zerodiff e2e checkpoint")
        run = cls(preset or sd.get("preset_obj") or sd["preset"], sd["seed"], sd["mode"], device)
        with torch.no_grad():
            for k, v in sd["masters"].items():
                run.masters[k].copy_(v.to(run.device))
            for k, v in sd["main"].items():
                run.main[k].copy_(v.to(run.device))
        run.opt.load_state_dict(sd["opt"])
        run.rollout_dep.update_(run.masters)
        run.train_dep.update_(run.masters)
        run.step = sd["step"]
        run.history = list(sd.get("history", []))
        return run
