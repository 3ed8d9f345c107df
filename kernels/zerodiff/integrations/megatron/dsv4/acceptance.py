"""``zerodiff megatron-check``: the DeepSeek-V4 actor against the zerodiff rollout engine, with RL updates,
refits and a checkpoint restore, all checked for diff = 0.

What :func:`run_check` does, in order:

1. ``torch.distributed`` (gloo on CPU, NCCL on CUDA) and ``megatron.core.parallel_state`` at world size 1.
2. Checkpoint: without ``checkpoint``, the harness masters of ``preset`` / ``seed`` are written as an actor
   checkpoint (:func:`.weights.save_checkpoint`: config.json, FP8 + scale shards, ``masters/``) into ``workdir``;
   the actor is built from that directory (``model_provider``-style, the config from ``config.json``) and its
   parameters must equal the masters bit for bit. A DeepSeek-V4 checkpoint from ``zerodiff make-checkpoint`` is
   refused by name (see :func:`.config.model_config_from_checkpoint_config`).
3. The rollout engine (:class:`zerodiff.rollout.engine.RolloutEngine`, consistent ops) gets its own FP8
   deployment, refitted in place from the actor's export; the export must equal the checkpoint's FP8 + scale
   tensors byte for byte.
4. Per RL step (``steps``): the same requests are sampled at every concurrency in ``concurrencies`` (the
   engine's running-batch size); the tokens must agree across concurrencies. The actor recomputes the sampled
   tokens' log-probs through Megatron-RL's path (``model(tokens)`` then ``selective_log_softmax(logits[:, :-1],
   tokens[:, 1:])``) and through the cross-entropy path (``model(tokens, labels=...)``); both must equal the
   rollout's bits (``zerodiff.rl.report.diff_report``). Then one update: loss ``-sum_i A_i sum_t lp_it / n``
   (group-normalised toy reward), backward, megatron-core ``Float16OptimizerWithFloat16Params.step()``
   (:mod:`.optimizer`); the next actor forward must equal a freshly built actor holding the new masters
   (the stale-weight check); the rollout deployment is refitted in place (``data_ptr()`` of every tensor
   unchanged, bits equal to a fresh deployment of the new masters); the same requests are sampled and
   recomputed again (diff = 0 after the update).
5. Restore: the actor is saved (actor checkpoint + optimizer state; on CUDA also megatron-core
   ``dist_checkpointing`` of ``sharded_state_dict()``, whose torch_dist writer needs CUDA; on the CPU a
   ``state_dict`` round trip instead), a fresh actor is built from the files, its parameters must equal the
   saved ones, the rollout is refitted from it, and one more step is sampled and recomputed (diff = 0). Then
   the first update after the restore (restored actor + a fresh optimizer loaded with the saved state) must
   give the same masters as the uninterrupted run's update, bit for bit; refit; recompute (diff = 0).

The result (a dict, written as JSON by the CLI) has ``trainer``, ``megatron_version``, ``rollout_engine``,
``device``, ``date``, ``steps``, ``tokens``, ``tokens_differ``, ``probs_diff_max``, ``k3_kl``,
``refit_checked``, ``restore_checked``, ``ok`` and the per-check rows; ``ok`` is true only when every
difference is 0 and every check passed.
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import tempfile
import time
from pathlib import Path

import torch

from ....model.config import preset as get_preset
from ....model.ops import make_ops
from ....model.weights import Deployment, init_masters
from ....ops.fp8_quant import Fp8Weight
from ....rl.report import diff_report
from ....rollout.engine import Request, RolloutEngine

CONCURRENCIES = (1, 4, 12)


def _mix(*xs) -> int:
    h = 1469598103934665603
    for x in xs:
        h = ((h ^ (int(x) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 61)
    return h


def init_parallel_state(device: str, workdir) -> bool:
    """``torch.distributed`` + ``parallel_state`` at world size 1 (no-op when already initialised)."""
    import torch.distributed as dist

    from .mcore import import_megatron

    import_megatron()
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{Path(workdir).absolute()}/pg-init", rank=0,
                                world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
        return True
    return False


def shutdown_parallel_state() -> None:
    """Tear down ``parallel_state`` and the process group (an NCCL group left alive at exit can keep the process
    from ending). Safe to call when nothing is initialised."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _same_bits(a: Deployment, b: Deployment) -> bool:
    for k, x in a.tensors.items():
        y = b.tensors[k]
        if isinstance(x, Fp8Weight):
            if not (torch.equal(x.q.view(torch.uint8), y.q.view(torch.uint8)) and torch.equal(x.scale, y.scale)):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 codes as bytes (``torch.equal`` on e4m3 compares bits, not values)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _pad(seqs, device):
    S = max(len(p) + len(r) for _, p, r in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.int64)
    lens = []
    for b, (_, p, r) in enumerate(seqs):
        t = list(p) + list(r)
        ids[b, : len(t)] = torch.tensor(t)
        lens.append(len(t))
    return ids.to(device), lens


def _micro_batches(seqs, micro: int, micro_tokens):
    """Consecutive groups of at most ``micro`` sequences whose padded size (rows x longest) stays within
    ``micro_tokens`` (a single longer sequence is a group of its own)."""
    out, cur, longest = [], [], 0
    for s in seqs:
        n = len(s[1]) + len(s[2])
        if cur and (len(cur) >= micro or (micro_tokens and (len(cur) + 1) * max(longest, n) > micro_tokens)):
            out.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, n)
    return out + ([cur] if cur else [])


def actor_logprobs(model, seqs, *, path: str = "selective", micro: int = 8, micro_tokens=None,
                   grad: bool = False) -> dict:
    """Response-token log-probs per key through Megatron-RL's path (``selective``: logits then
    ``selective_log_softmax``) or the cross-entropy path (``cross_entropy``: ``-model(tokens, labels)``); rows in
    micro-batches of at most ``micro`` sequences and ``micro_tokens`` padded tokens."""
    from .functions import selective_log_softmax

    dev = next(model.parameters()).device
    out = {}
    for part in _micro_batches(seqs, micro, micro_tokens):
        ids, lens = _pad(part, dev)
        with torch.set_grad_enabled(grad):
            if path == "selective":
                lp = selective_log_softmax(model(ids, lengths=lens)[:, :-1], ids[:, 1:])
            else:
                labels = torch.zeros_like(ids)
                labels[:, :-1] = ids[:, 1:]
                lp = -model(ids, labels=labels, lengths=lens)[:, :-1]
        for b, (k, p, r) in enumerate(part):
            out[k] = lp[b, len(p) - 1: len(p) - 1 + len(r)]
    return out


def _requests(preset, seed, step):
    rc, cfg = preset.rollout, preset.model
    rng = random.Random(_mix(seed, step, 1))
    reqs = []
    for p in range(rc.prompts_per_step):
        prompt = [rng.randrange(cfg.vocab) for _ in range(rng.randint(*rc.prompt_len))]
        for j in range(rc.responses_per_prompt):
            reqs.append((_mix(step, p, j) % 1_000_000_007, prompt, rng.randint(*rc.response_len)))
    return reqs


def _advantages(preset, seqs) -> dict:
    groups: dict = {}
    for k, p, r in seqs:
        groups.setdefault(tuple(p), []).append((k, r))
    adv = {}
    for members in groups.values():
        rw = torch.tensor([sum(t < preset.rollout.reward_tokens for t in r) / len(r) for _, r in members],
                          dtype=torch.float64)
        a = (rw - rw.mean()) / (rw.std(unbiased=False) + 1e-6)
        adv.update({k: float(x) for (k, _), x in zip(members, a.tolist())})
    return adv


class _Check:
    def __init__(self, say):
        self.rows, self.say = [], say

    def add(self, name, rep, **extra):
        row = {"check": name, "tokens": rep["tokens"], "tokens_differ": rep["tokens_differ"],
               "probs_diff_max": rep["training/rollout_probs_diff_max"],
               "probs_diff_mean": rep["training/rollout_probs_diff_mean"],
               "probs_diff_std": rep["training/rollout_probs_diff_std"], "k3_kl": rep["rollout_corr/k3_kl"],
               "ok": bool(rep["bitwise_equal"]), **extra}
        self.rows.append(row)
        self.say(f"  {name}: {row['tokens']} tokens, {row['tokens_differ']} differ, probs_diff_max "
                 f"{row['probs_diff_max']:.3g}, k3_kl {row['k3_kl']:.3g} -> {'ok' if row['ok'] else 'DIFF'}")


def run_check(*, steps: int = 2, seed: int = 0, device: str = "cpu", checkpoint=None, preset: str | None = None,
              concurrencies=CONCURRENCIES, workdir=None, progress=None) -> dict:
    """Run the acceptance (see the module docstring); returns the result dict. ``preset`` (the harness model
    and rollout config) defaults to ``cpu`` on the CPU and ``gpu_small`` on CUDA."""
    from .mcore import megatron_version
    from .optimizer import build_optimizer
    from .weights import export_deployment, read_actor_checkpoint, refit_, save_checkpoint
    from . import build_from_checkpoint

    say = progress or (lambda m: None)
    t0 = time.perf_counter()
    own_tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="zerodiff-megatron-check-")) if own_tmp else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device)
    preset = preset or ("gpu_small" if dev.type == "cuda" else "cpu")
    pr = get_preset(preset)
    init_parallel_state(dev.type, work)
    checks = _Check(say)
    flags = {}

    # ---- checkpoint -> actor
    if checkpoint is None:
        masters = init_masters(pr.model, seed)
        from .model import build_model

        holder = build_model(pr.model)
        holder.load_masters(masters)
        checkpoint = work / "checkpoint"
        save_checkpoint(holder, checkpoint, force=True)
        say(f"wrote the actor checkpoint of preset {preset!r}, seed {seed}, to {checkpoint}")
        del holder
    else:
        masters = None
    cfg, ck_masters, how = read_actor_checkpoint(checkpoint)
    pr = pr.replace(model=cfg)
    actor, how = build_from_checkpoint(checkpoint, device=device)
    actor.block_size = pr.rollout.block_size
    flags["load_bit_exact"] = how == "masters" and all(
        torch.equal(actor.masters[k].detach().cpu(), (masters or ck_masters)[k]) for k in actor.masters)
    say(f"actor built from {checkpoint} ({how}); masters bit-exact: {flags['load_bit_exact']}")

    # ---- rollout engine with its own deployment, refitted from the actor's export
    rollout_dep = Deployment({k: v.to(dev) for k, v in ck_masters.items()})
    from ....checkpoint.dsv4 import read_checkpoint

    _, files = read_checkpoint(checkpoint)
    exported = export_deployment(actor.refresh_deployment(), cfg)
    flags["export_equals_checkpoint"] = set(exported) == set(files) and all(
        torch.equal(_raw(exported[k].cpu()), _raw(files[k])) for k in files)
    refit_(rollout_dep, exported, cfg)
    engine = RolloutEngine(pr, rollout_dep, make_ops("consistent", "rollout", cfg), dev, sample_seed=_mix(seed, 7))
    opt = build_optimizer(actor, lr=pr.train.lr, betas=pr.train.betas, weight_decay=pr.train.weight_decay)
    say(f"rollout engine ready; optimizer {opt.cls_name}")

    def sample(step):
        reqs = _requests(pr, seed, step)
        outs = []
        for c in concurrencies:
            engine.rcfg = dataclasses.replace(pr.rollout, max_batch=(c, c))
            outs.append(engine.generate([Request(k, p, n) for k, p, n in reqs], sched_seed=_mix(seed, step, 2, c)))
        base = outs[0]
        same = all(o[k].response == base[k].response and torch.equal(o[k].logprobs, base[k].logprobs)
                   for o in outs[1:] for k in base)
        return base, outs, same

    def compare(name, step):
        base, outs, same = sample(step)
        seqs = [(k, o.prompt, o.response) for k, o in sorted(base.items())]
        for path in ("selective", "cross_entropy"):
            lp = actor_logprobs(actor, seqs, path=path, micro_tokens=mt)
            for c, out in zip(concurrencies, outs):
                checks.add(f"{name} {path} c={c}", diff_report({k: o.logprobs for k, o in out.items()}, lp),
                           step=step, concurrency=c, concurrency_invariant=same)
        return seqs

    mt = pr.train.micro_tokens

    def update(model, optim, seqs) -> bool:
        """One RL update: loss -sum_i A_i sum_t lp_it / n through Megatron-RL's log-prob path, backward,
        megatron-core optimizer step."""
        adv = _advantages(pr, seqs)
        ntok = sum(len(r) for _, _, r in seqs)
        optim.zero_grad()
        lp = actor_logprobs(model, seqs, path="selective", micro_tokens=mt, grad=True)
        sum(-(adv[k] / ntok) * lp[k].sum() for k, _, _ in seqs).backward()
        return optim.step()

    refit_ok, stale_ok = [], []
    for step in range(steps):
        say(f"step {step}: sample at concurrencies {list(concurrencies)}, recompute with the actor")
        seqs = compare(f"step {step} before update", step)
        ok = update(actor, opt, seqs)
        # stale-weight check: the next forward runs the new masters (== a fresh actor holding them)
        from .model import build_model

        fresh = build_model(cfg, device=device)
        fresh.load_masters({k: p.detach() for k, p in actor.masters.items()})
        ids, lens = _pad(seqs[:2], dev)
        with torch.no_grad():
            stale_ok.append(bool(ok) and torch.equal(actor(ids, lengths=lens), fresh(ids, lengths=lens)))
        del fresh
        # refit in place
        ptrs = rollout_dep.data_ptrs()
        refit_(rollout_dep, export_deployment(actor.refresh_deployment(), cfg), cfg)
        refit_ok.append(rollout_dep.data_ptrs() == ptrs and _same_bits(rollout_dep, Deployment(actor.masters)))
        say(f"step {step}: update applied ({opt.cls_name.rsplit('.', 1)[-1]}), next forward uses the new masters: "
            f"{stale_ok[-1]}, refit in place: {refit_ok[-1]}")
        compare(f"step {step} after update", step)

    # ---- save / restore
    saved = work / "restored-from"
    save_checkpoint(actor, saved, force=True)
    torch.save(opt.state_dict(), saved / "optimizer.pt")
    dist_ok, dist_note = None, ""
    sd_state = {k: v.detach().clone() for k, v in actor.state_dict().items()}
    restored, _ = build_from_checkpoint(saved, device=device)
    restored.block_size = pr.rollout.block_size
    if dev.type == "cuda":
        try:
            from megatron.core import dist_checkpointing

            dd = work / "dist-ckpt"
            dd.mkdir(exist_ok=True)
            dist_checkpointing.save(actor.sharded_state_dict(), str(dd))
            other, _ = build_from_checkpoint(saved, device=device)
            other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), str(dd)))
            dist_ok = all(torch.equal(a, b) for a, b in zip(actor.parameters(), other.parameters()))
            dist_note = "dist_checkpointing torch_dist save/load of sharded_state_dict()"
        except Exception as e:  # reported, not fatal: the actor checkpoint is the restore path
            dist_ok, dist_note = False, f"dist_checkpointing failed: {type(e).__name__}: {e}"
    else:
        other, _ = build_from_checkpoint(saved, device=device)
        other.load_state_dict(sd_state)
        dist_ok = all(torch.equal(a, b) for a, b in zip(actor.parameters(), other.parameters()))
        dist_note = ("state_dict round trip (megatron-core's torch_dist writer synchronises CUDA; "
                     "sharded_state_dict() itself is built on the CPU)")
        del other
    same_params = all(torch.equal(actor.masters[k], restored.masters[k]) for k in actor.masters)
    orig, actor = actor, restored
    opt2 = build_optimizer(restored, lr=pr.train.lr, betas=pr.train.betas, weight_decay=pr.train.weight_decay)
    opt2.load_state_dict(torch.load(saved / "optimizer.pt", weights_only=False))
    ptrs = rollout_dep.data_ptrs()
    refit_(rollout_dep, export_deployment(actor.refresh_deployment(), cfg), cfg)
    restore_refit = rollout_dep.data_ptrs() == ptrs
    say(f"restored from {saved}: parameters equal {same_params}; {dist_note}: {dist_ok}")
    seqs = compare("after restore", steps)
    # the first update after the restore: the restored actor + optimizer state take the update the original
    # would have taken, bit for bit; then refit and check again
    ok_a, ok_b = update(orig, opt, seqs), update(restored, opt2, seqs)
    continued = ok_a and ok_b and all(torch.equal(orig.masters[k], restored.masters[k]) for k in orig.masters)
    del orig
    ptrs = rollout_dep.data_ptrs()
    refit_(rollout_dep, export_deployment(actor.refresh_deployment(), cfg), cfg)
    restore_refit = restore_refit and rollout_dep.data_ptrs() == ptrs
    say(f"first update after the restore equals the uninterrupted run's: {continued}")
    compare("after restore update", steps)
    restore_ok = same_params and restore_refit and bool(dist_ok) and continued

    rows = checks.rows
    res = {
        "trainer": "zerodiff DeepSeek-V4 actor (megatron-core MegatronModule, "
                   "zerodiff.integrations.megatron.dsv4)",
        "megatron_version": megatron_version(),
        "rollout_engine": "zerodiff rollout engine",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "preset": preset,
        "seed": seed,
        "steps": steps,
        "concurrencies": list(concurrencies),
        "optimizer": opt.cls_name,
        "checkpoint": str(checkpoint),
        "tokens": sum(r["tokens"] for r in rows),
        "tokens_differ": sum(r["tokens_differ"] for r in rows),
        "probs_diff_max": max((r["probs_diff_max"] for r in rows), default=0.0),
        "k3_kl": max((abs(r["k3_kl"]) for r in rows), default=0.0),
        "concurrency_invariant": all(r["concurrency_invariant"] for r in rows),
        "load_bit_exact": flags["load_bit_exact"],
        "export_equals_checkpoint": flags["export_equals_checkpoint"],
        "stale_weight_checked": bool(stale_ok) and all(stale_ok),
        "refit_checked": bool(refit_ok) and all(refit_ok) and flags["export_equals_checkpoint"],
        "restore_checked": restore_ok,
        "restore_state": dist_note,
        "checks": rows,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    res["ok"] = (res["tokens_differ"] == 0 and res["probs_diff_max"] == 0.0 and res["k3_kl"] == 0.0
                 and all(r["ok"] for r in rows) and res["concurrency_invariant"] and res["load_bit_exact"]
                 and res["stale_weight_checked"] and res["refit_checked"] and res["restore_checked"])
    if own_tmp:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return res

