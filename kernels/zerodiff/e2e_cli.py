"""``zerodiff check`` and ``zerodiff bench``: the end-to-end acceptance harness.

``register(subparsers)`` adds the subcommands to the ``zerodiff`` CLI (``zerodiff.cli``); ``main(argv)``
runs them standalone (``python -m zerodiff.e2e_cli check ...``).

check
    Runs N GRPO-style RL steps of the tiny DeepSeek-V4-shaped model (rollout -> diff check -> backward ->
    AdamW on the masters -> in-place FP8 requantisation of the rollout's weights), prints one progress line
    per step and a report table, writes JSON. Exit 0 only if EVERY step had diff exactly 0 (all of
    ``training/rollout_probs_diff_max|mean|std`` and ``rollout_corr/k3_kl`` == 0.0 and no token's log-prob
    differs bitwise). A step with diff != 0 stops the run and names the first diverging layer (exit 1).
    ``--restore-at K`` saves a checkpoint after step K, restores it into a fresh run and continues there
    (the steps after the restore are checked like the others). ``--seeds N`` repeats the whole check for N
    seeds (a fresh run each); ``--train-packing greedy|all|none`` chooses how the training forward packs the
    step's sequences into micro-batches (``all``: one micro-batch; ``none``: one sequence each). ``--baseline``
    runs the NEGATIVE CONTROL: the same stock ops on both sides (frozen choice in
    ``zerodiff.model.ops.BASELINE_CHOICE``), preceded by the control probe (``zerodiff.rl.control``: equal bits
    on equal inputs, and where batch size / phase change them); it exits 0 only if the probe found the two
    sides equal on equal inputs AND diff > 0 was observed (that is the expected outcome).
locate
    Op-level divergence locator (``zerodiff.rl.locate``): one step's rollout and training forward with every op's
    output recorded per token; JSON naming the first op whose bits differ. Exit 0 when none differs.
bench
    Rollout output tokens/s of the consistent mode vs the baseline mode on the same requests in one run
    (weights fixed, no updates). Every decode graph of both modes is captured first; then per step the step's
    request set runs once untimed in each mode (the exact warm-up: the same shapes, batch sizes and kernels as
    the timed run), then both modes are timed back to back with the order alternating per step (default 20
    steps), then each mode's training forward gives the per-step diff (untimed). Any compilation inside a timed
    rollout (Triton cache miss, new Triton / DeepGEMM JIT cache entry, graph capture;
    :class:`zerodiff.bench_tools.JitDetector`) FAILS the run: exit 1, ``compiled_during_timing`` in the JSON.
    Reported: the median per-step ratio with its 95% order-statistic and bootstrap intervals, min/max, the
    forward event-time ratio (CUDA events, GPU idle gaps included), and a ``torch.profiler`` pass over
    ``--profile-steps`` request sets per mode: GPU kernel time per kernel and per zerodiff op
    (``profile``). The host-synchronising input-value checks of the cache ops are off in both modes; the
    baseline kernels that ran (per op and shape) and ``baseline_vs_vllm`` are stored. JSON plus a PNG plot
    (matplotlib when importable, otherwise skipped with a message).
--prompts / --max-batch / --token-budget / --graph-batch-sizes / --kv-blocks (check, bench)
    The rollout concurrency (:func:`zerodiff.bench_tools.apply_rollout_settings`); impossible combinations are
    refused with exit 2 and a message naming the option.
--time-budget SECONDS (both)
    Stop cleanly before a step that would end past SECONDS since the command started; the steps that ran are
    reported and decide the verdict (at least one must have run); the JSON is rewritten after every step.

On the CPU the harness pins torch to one intra-op thread (the reference backends run many small GEMMs;
threads only add contention), restored afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import time

import torch


def _device_name(dev) -> str:
    if str(dev).startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} (sm_{p.major}{p.minor})"
    return "cpu"


@contextlib.contextmanager
def _cpu_threads(device):
    old = torch.get_num_threads()
    if str(device) == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, choices=["cpu", "gpu_small", "h200"],
                   help="model/rollout preset (default: h200 when CUDA is present, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="weights / prompts / schedule seed (default 0)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop cleanly before a step would end past SECONDS since the command started (the steps "
                        "that ran are reported and written; the JSON is also rewritten after every step)")
    p.add_argument("--mhc-variant", default=None, metavar="NAME",
                   help="run the model's mHC pre with this zerodiff.experimental.mhc_variants.VARIANTS entry instead "
                        "of the shipped kernel, on BOTH sides of this process (an experiment: the bits change with "
                        "the variant; a real deployment must switch rollout and training together)")
    p.add_argument("--attn-backend", default=None, metavar="NAME",
                   help="run the sparse MLA read path with this zerodiff.ops.attention backend (e.g. "
                        "flashmla_fp8: FlashMLA's FP8 decode kernel under the fixed schedule) on BOTH sides of "
                        "this process instead of the default (an experiment: the bits change with the backend)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="write where the wall time went to FILE: every Triton compilation (per kernel) and the "
                        "top Python functions (cProfile)")


def _rollout_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rollout concurrency (default: the preset's; any of them validates the combination)")
    g.add_argument("--prompts", type=int, default=None, metavar="N",
                   help="prompts per step (each sampled responses_per_prompt times): the request set of a step")
    g.add_argument("--max-batch", default=None, metavar="LO,HI",
                   help="running requests per engine step, drawn per step from LO..HI (or N for N,N); refused when HI "
                        "exceeds the requests per step or the token budget's low end")
    g.add_argument("--token-budget", default=None, metavar="LO,HI", help="tokens per engine step, drawn from LO..HI")
    g.add_argument("--graph-batch-sizes", default=None, metavar="S1,S2,...",
                   help="padded batch sizes with a captured decode graph (default: the preset's, extended with powers "
                        "of two up to the first >= the --max-batch high end)")
    g.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks (default: the preset's, enlarged to what --max-batch needs; an explicit N "
                        "below that is refused)")


def _rollout_preset(cfg_name, args):
    """The preset with the rollout concurrency options applied (exit 2 with the message on an impossible one)."""
    from .bench_tools import SettingError, apply_rollout_settings
    from .model.config import preset as get_preset

    try:
        return apply_rollout_settings(get_preset(cfg_name), prompts=getattr(args, "prompts", None),
                                      max_batch=getattr(args, "max_batch", None),
                                      token_budget=getattr(args, "token_budget", None),
                                      graph_batch_sizes=getattr(args, "graph_batch_sizes", None),
                                      kv_blocks=getattr(args, "kv_blocks", None))
    except SettingError as e:
        print(str(e), file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _rollout_given(args) -> bool:
    return any(getattr(args, k, None) is not None
               for k in ("prompts", "max_batch", "token_budget", "graph_batch_sizes", "kv_blocks"))


def register(subparsers) -> None:
    c = subparsers.add_parser(
        "check", help="run N RL steps and verify rollout/training log-probs are bit-identical (diff = 0)",
        description="Run N GRPO-style RL steps of the tiny DeepSeek-V4-shaped model and verify, every step, that "
        "the rollout engine and the training forward give bit-identical log-probs for every sampled token. "
        "Exit status 0 only if every step had diff exactly 0; 1 otherwise (the first diverging layer is named). "
        "With --baseline (negative control, stock kernels on both sides) the exit status is 0 only if diff > 0 "
        "WAS observed, i.e. the check can see a difference.")
    _common(c)
    _rollout_opts(c)
    c.add_argument("--steps", type=int, default=3, help="RL steps (default 3; per seed)")
    c.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="run the check for N seeds (--seed, --seed+1, ...), each a fresh run of --steps steps; "
                        "exit 0 only if every seed passes")
    c.add_argument("--train-packing", default="greedy", choices=sorted(TRAIN_PACKINGS),
                   help="how the training forward packs the step's sequences into micro-batches: "
                        + "; ".join(f"{k}: {v}" for k, v in TRAIN_PACKINGS.items()))
    c.add_argument("--micro-tokens", type=int, default=None, metavar="N",
                   help="with --train-packing greedy: micro-batches of at most N tokens (default: the preset's)")
    c.add_argument("--baseline", action="store_true",
                   help="negative control: the same stock ops on both sides (same kernels, same precision); exit 0 "
                        "only if diff > 0 is observed AND both sides' ops give equal bits on equal inputs")
    c.add_argument("--restore-at", type=int, default=None, metavar="K",
                   help="after step K save a checkpoint, restore it into a fresh run and continue from it")
    c.add_argument("--save", default=None, help="save a checkpoint here at the end")
    c.add_argument("--resume", default=None, help="start from this checkpoint")
    c.add_argument("--rollout-ep", type=int, default=1, metavar="N",
                   help="expert-parallel rollout: N processes (NCCL, one GPU each, on CUDA; gloo on the CPU), each "
                        "serving its share of the requests with the model's routed experts spread over the N ranks, "
                        "against the EP = 1 training forward (zerodiff.rl.expert_parallel); default 1")
    c.add_argument("--ep-graphs", action="store_true",
                   help="with --rollout-ep: pure-decode steps replay decode graphs when every rank's step is one "
                        "(static per-rank capacity; CUDA: captured on every rank at start; CPU: the captured step "
                        "emulated eagerly); default off (eager)")
    c.set_defaults(func=cmd_check)
    lo = subparsers.add_parser(
        "locate", help="op-level divergence locator: the first op whose output bits differ between rollout and "
        "training (JSON)",
        description="Run one RL step's rollout and the training forward (no update) with every op's output recorded "
        "per token (op names follow the model's weight names, e.g. layers.0.wq_a, layers.1.attention), and report "
        "the first op in model order whose output differs bitwise: op, layer, request, position, first differing "
        "coordinate with both values, max |diff|. Every op before it was bitwise equal on every token, so the op "
        "named had equal inputs. JSON on stdout (and --json FILE), a summary line on stderr. Exit 0 when no op "
        "differs, 1 when one does; with --plant-divergence, 0 only if exactly the planted op is reported.")
    lo.add_argument("--config", default=None, choices=["cpu", "gpu_small", "h200"],
                    help="model/rollout preset (default: h200 when CUDA is present, else cpu)")
    lo.add_argument("--seed", type=int, default=0, help="weights / prompts / schedule seed (default 0)")
    lo.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    lo.add_argument("--baseline", action="store_true",
                    help="the stock ops on both sides (the negative control): shows where the stock kernels diverge")
    lo.add_argument("--mode", default=None, choices=["consistent", "baseline", "baseline_mixed"],
                    help="ops pairing (default consistent; --baseline = baseline; baseline_mixed = stock inference "
                         "ops vs stock training-style ops, the confounded pairing)")
    lo.add_argument("--steps-before", type=int, default=0, metavar="K",
                    help="run K RL steps (with updates) first, then locate on step K")
    lo.add_argument("--prompts", type=int, default=None, metavar="N",
                    help="prompts per step (default: the preset's; fewer keeps the recording small on big presets)")
    lo.add_argument("--train-packing", default="greedy", choices=sorted(TRAIN_PACKINGS),
                    help="training micro-batch packing, as for check")
    lo.add_argument("--plant-divergence", default=None, metavar="OP",
                    help="self-test of the locator: move the training side's output of OP one ulp; the locator must "
                         "report exactly OP")
    lo.add_argument("--json", dest="json_path", default=None, help="also write the JSON to this file")
    lo.add_argument("--mhc-variant", default=None, metavar="NAME", help="as for check")
    lo.add_argument("--attn-backend", default=None, metavar="NAME", help="as for check")
    lo.add_argument("--profile", default=None, metavar="FILE", help="as for check")
    lo.set_defaults(func=cmd_locate)
    from .warmup import add_parser as _add_warmup

    _add_warmup(subparsers)
    b = subparsers.add_parser(
        "bench", help="rollout tokens/s, consistent vs baseline, same requests, one run (JSON + PNG)",
        description="Rollout output tokens/s of the consistent mode vs the stock baseline on the same requests in "
        "one run, plus the per-step diff of each mode. Writes JSON and a PNG plot (if matplotlib is importable).")
    _common(b)
    _rollout_opts(b)
    b.add_argument("--steps", type=int, default=20,
                   help="steps (request sets) to time, each in both modes, interleaved with the order alternating per "
                        "step (default 20)")
    b.add_argument("--warmup", type=int, default=0,
                   help="extra untimed warm-up request sets per mode, on top of the exact warm-up (default 0)")
    b.add_argument("--no-exact-warmup", action="store_true",
                   help="skip running every timed request set once untimed per mode before timing (then a compilation "
                        "during timing is likely, and it fails the run)")
    b.add_argument("--watch-cache-dir", action="append", default=[], metavar="DIR",
                   help="also watch DIR for new JIT cache entries during timing (repeatable; Triton's and DeepGEMM's "
                        "cache dirs are always watched)")
    b.add_argument("--strict-cache-dirs", action="store_true",
                   help="count every new JIT cache entry found after a timed rollout as a compilation in it, even "
                        "without in-process evidence (use when no other process shares the cache dirs)")
    b.add_argument("--profile-steps", type=int, default=2, metavar="K",
                   help="after timing, run K request sets per mode under torch.profiler for the per-kernel / per-op "
                        "time breakdown (default 2; 0: none)")
    b.add_argument("--profile-decode", default="eager-static", choices=["eager-static", "replay"],
                   help="pure-decode steps in the profiler pass: eager-static runs the captured graphs' padded static "
                        "step eagerly (the same kernels, each attributed to its op; default), replay replays the "
                        "graphs (kernel time is the same; per op, graph kernels show as not attributed)")
    b.add_argument("--png", default=None, help="write the per-step throughput/diff plot here")
    b.set_defaults(func=cmd_bench)


def _settings_doc(preset) -> dict:
    from .bench_tools import rollout_settings_doc

    return rollout_settings_doc(preset)


def _log(args, msg):
    if not args.quiet:
        print(msg, flush=True)


def _over_budget(args, t0, last_step_s) -> bool:
    """True when the next step (estimated as long as the last one, +10%) would end past --time-budget
    (or when the budget is already spent)."""
    if args.time_budget is None:
        return False
    return (time.perf_counter() - t0) + 1.1 * last_step_s > args.time_budget


def _write_json(path, doc) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def _baseline_kernels() -> dict:
    from .model import baseline_cuda

    return baseline_cuda.choices_text()


def _kernel_variants(args) -> dict:
    """Apply ``--mhc-variant`` (validated) and return the kernel variants this process runs (for the JSON).

    A variant replaces the model's mHC pre binding (``zerodiff.model.ops.mhc_pre``, which rollout and training
    both call) for the rest of the process; the shipped modules are left as they are. The model has no
    hc_head call, so ``mhc_head`` stays the shipped name."""
    from .ops import attention as sa
    from .ops import mhc, topk

    name = getattr(args, "mhc_variant", None)
    mhc_name = mhc.DEFAULT_VARIANT
    if name is not None:
        import functools

        from .experimental import mhc_variants
        from .model import ops as model_ops

        if name not in mhc_variants.VARIANTS:
            raise SystemExit(f"zerodiff: --mhc-variant {name!r} is not one of {sorted(mhc_variants.VARIANTS)}")
        model_ops.mhc_pre = functools.partial(mhc_variants.mhc_pre, variant=name)
        mhc_name = name
    attn = getattr(args, "attn_backend", None)
    if attn is not None:
        if attn not in sa.READ_BACKENDS:
            raise SystemExit(f"zerodiff: --attn-backend {attn!r} is not one of {list(sa.READ_BACKENDS)}")
        sa.READ_BACKEND = attn
    return {"mhc": mhc_name, "mhc_head": mhc.DEFAULT_HEAD_VARIANT, "topk": topk.VARIANT,
            "attention_read": sa.READ_BACKEND or "default: flashmla_fp8 where supported, else workspace",
            "attention_pieces": _pieces()}


def _pieces():
    from .ops.attention import flashmla_fp8 as fd

    return fd.PIECES_PER_ROW


#: ``--train-packing``: how the training forward packs the step's whole sequences into micro-batches
TRAIN_PACKINGS = {
    "greedy": "shuffled, then packed greedily into micro-batches of at most train.micro_tokens tokens (the default)",
    "all": "every sequence of the step in ONE micro-batch (maximal packing)",
    "none": "one sequence per micro-batch (no packing)",
}


def _packed_preset(cfg_name: str, packing: str, micro_tokens=None, base=None):
    """The preset (``base``, else the named one) with the training packing of ``--train-packing`` /
    ``--micro-tokens`` applied."""
    import dataclasses

    from .model.config import preset as get_preset

    p = base if base is not None else get_preset(cfg_name)
    rc = p.rollout
    mt = micro_tokens or p.train.micro_tokens
    if packing == "all":
        mt = rc.prompts_per_step * rc.responses_per_prompt * p.model.max_pos
    elif packing == "none":
        mt = 1
    elif packing != "greedy":
        raise SystemExit(f"zerodiff: --train-packing {packing!r} is not one of {sorted(TRAIN_PACKINGS)}")
    return p if mt == p.train.micro_tokens else p.replace(train=dataclasses.replace(p.train, micro_tokens=mt))


def _check_preset(args, cfg_name: str, packing: str):
    """The preset ``check`` runs: the rollout options over ``cfg_name``, then the training packing."""
    return _packed_preset(cfg_name, packing, getattr(args, "micro_tokens", None), base=_rollout_preset(cfg_name, args))


def cmd_check_ep(args) -> int:
    """``zerodiff check --rollout-ep N`` (N > 1): EP = N rollout vs EP = 1 training (zerodiff.rl.expert_parallel)."""
    from .errors import InputError
    from .model.config import default_preset_name
    from .rl.expert_parallel import run_ep_check
    from .rl.report import format_table

    refused = [name for name, on in (("--baseline", args.baseline), ("--resume", args.resume), ("--save", args.save),
                                     ("--restore-at", args.restore_at is not None),
                                     ("--seeds", (getattr(args, "seeds", 1) or 1) > 1),
                                     ("--mhc-variant", args.mhc_variant), ("--attn-backend", args.attn_backend),
                                     ("--profile", args.profile)) if on]
    if refused:
        raise SystemExit(f"zerodiff: --rollout-ep {args.rollout_ep} cannot be combined with {', '.join(refused)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if str(device).startswith("cuda") else "gloo"
    cfg_name = args.config or default_preset_name()
    packing = getattr(args, "train_packing", None) or "greedy"
    preset = _check_preset(args, cfg_name, packing)
    t0 = time.perf_counter()
    try:
        doc = run_ep_check(preset, steps=args.steps, seed=args.seed, ep_size=args.rollout_ep, backend=backend,
                           graphs=args.ep_graphs, progress=None if args.quiet else (lambda m: _log(args, m)))
    except InputError as e:
        raise SystemExit(str(e)) from None
    doc.update(command="check", date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               config=cfg_name, steps_requested=args.steps, elapsed_s=round(time.perf_counter() - t0, 2),
               torch=torch.__version__, train_packing={"mode": packing, "what": TRAIN_PACKINGS[packing]},
               rollout_settings=_settings_doc(preset))
    print(format_table(doc["steps"]))
    for rep in doc["steps"]:
        print(f"step {rep['step']}: response tokens per rank {rep.get('rank_tokens')}, padding steps "
              f"{rep.get('pad_steps')}, graph steps {rep.get('graph_steps')} (rank 0), masters equal across ranks: "
              f"{rep.get('masters_equal_across_ranks')}")
    _write_json(args.json_path, doc)
    if doc["passed"]:
        print(f"PASS: diff = 0 on {len(doc['steps'])}/{args.steps} steps, rollout EP={args.rollout_ep} "
              f"({doc['backend']}, {doc['device']}) vs training EP=1")
        return 0
    print(f"FAIL: {doc['error'] or 'diff != 0 or the ranks disagree'}")
    return 1


def cmd_check(args) -> int:
    if int(getattr(args, "rollout_ep", 1) or 1) != 1:
        return cmd_check_ep(args)
    if getattr(args, "ep_graphs", False):
        raise SystemExit("zerodiff: --ep-graphs needs --rollout-ep N with N > 1")
    variants = _kernel_variants(args)
    from .model.config import default_preset_name
    from .rl.control import control_probe, describe
    from .rl.loop import DiffError, RLRun
    from .rl.report import format_table

    cfg_name = args.config or default_preset_name()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    mode = "baseline" if args.baseline else "consistent"
    n_seeds = max(1, int(getattr(args, "seeds", 1) or 1))
    seeds = [args.seed + i for i in range(n_seeds)]
    if n_seeds > 1 and (args.resume or args.save):
        raise SystemExit("zerodiff: --seeds N > 1 cannot be combined with --resume / --save")
    packing = getattr(args, "train_packing", None) or "greedy"
    preset = _check_preset(args, cfg_name, packing)
    t0 = time.perf_counter()
    reports, failure, restored_at = [], None, None
    per_seed, probes = [], []
    stopped_by_budget = False
    from .model.ops import BASELINE_CHOICE, CPU_EXACT_OPS, MODES

    def doc_now(passed=None):
        return {
            "command": "check", "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": _device_name(device), "config": cfg_name, "mode": mode, "seed": seeds[0], "seeds": seeds,
            "steps": args.steps, "steps_run": len(reports), "stopped_by_time_budget": stopped_by_budget,
            "time_budget_s": args.time_budget, "passed": passed, "elapsed_s": round(time.perf_counter() - t0, 2),
            "restore_at": args.restore_at, "torch": torch.__version__, "kernel_variants": variants,
            "train_packing": {"mode": packing, "micro_tokens": preset.train.micro_tokens,
                              "what": TRAIN_PACKINGS[packing]},
            "ops": {"rollout": MODES[mode][0].__name__, "train": MODES[mode][1].__name__},
            "per_seed": per_seed, "reports": reports, "failure": failure,
            "interim_ops": list(CPU_EXACT_OPS), "baseline_choice": BASELINE_CHOICE if args.baseline else None,
            "baseline_kernels_ran": _baseline_kernels() if args.baseline else None,
            "control_probe": probes if args.baseline else None,
            "rollout_settings": _settings_doc(preset),
        }

    with _cpu_threads(device):
        for seed in seeds:
            if stopped_by_budget or failure is not None:
                break
            n_before = len(reports)
            if args.resume:
                explicit = (packing != "greedy" or getattr(args, "micro_tokens", None)
                            or _rollout_given(args))  # else the checkpoint's own
                run = RLRun.load(args.resume, device, preset=preset if explicit else None)
                _log(args, f"resumed {args.resume} at step {run.step}")
            else:
                run = RLRun(preset, seed, mode, device)
            restored_at = None
            _log(args, f"model, caches and optimizer ready ({time.perf_counter() - t0:.1f} s)")
            _log(args, f"zerodiff check: config={run.preset.name} mode={mode} device={_device_name(device)} "
                       f"steps={args.steps} seed={run.seed}" + (f" ({seeds.index(seed) + 1} of {n_seeds} seeds)"
                                                                if n_seeds > 1 else "")
                       + f" train packing={packing} (micro-batches of <= {run.preset.train.micro_tokens} tokens)")
            probe = None
            if args.baseline:  # what makes the control a control: equal on equal inputs, different across batch/phase
                probe = control_probe(run)
                probe["seed"] = run.seed
                probes.append(probe)
                for line in describe(probe):
                    _log(args, line)
            last_s = 0.0
            for i in range(args.steps):
                # step 0 carries the one-off JIT compilations (Triton, DeepGEMM): it does not predict the next step
                if _over_budget(args, t0, last_s if i >= 2 else 0.0):
                    stopped_by_budget = True
                    _log(args, f"time budget {args.time_budget:.0f} s: stopping cleanly after {len(reports)} of "
                               f"{args.steps * n_seeds} steps ({time.perf_counter() - t0:.1f} s elapsed)")
                    break
                ts = time.perf_counter()
                try:
                    rep = run.run_step()
                except DiffError as e:
                    failure = {"message": str(e), "report": e.report, "divergence": e.divergence, "seed": run.seed}
                    if e.report:
                        e.report["seed"] = run.seed
                        reports.append(e.report)
                    _log(args, str(e))
                    break
                rep["seed"] = run.seed
                if restored_at is not None and rep["step"] == restored_at + 1:
                    rep["first_after_restore"] = True
                reports.append(rep)
                _log(args, f"[{i + 1}/{args.steps}] step {rep['step']}: tokens {rep['tokens']} differ "
                           f"{rep['tokens_differ']} probs_diff_max {rep['training/rollout_probs_diff_max']:.3g} "
                           f"k3 {rep['rollout_corr/k3_kl']:.3g} engine steps {rep['engine_steps']} "
                           f"(mixed {rep['mixed_steps']}, decode {rep['decode_steps']}, graphs {rep['graph_steps']}) "
                           f"batch sizes {rep['batch_sizes'][:6]}{'...' if len(rep['batch_sizes']) > 6 else ''} "
                           f"train micro-batches {rep.get('train_micro_batches')} (seqs "
                           f"{max(rep.get('train_seqs_per_micro') or [0])} max) "
                           f"reward {rep['reward_mean']:.3f} [{rep['rollout_s'] + rep['train_s']:.1f}s]"
                           + (" (first step after restore)" if rep.get("first_after_restore") else "")
                           + f" t={time.perf_counter() - t0:.0f}s")
                last_s = time.perf_counter() - ts
                _write_json(args.json_path, doc_now())
                if args.restore_at is not None and rep["step"] == args.restore_at and i + 1 < args.steps:
                    with tempfile.TemporaryDirectory() as d:
                        path = os.path.join(d, "ckpt.pt")
                        run.save(path)
                        run = RLRun.load(path, device, preset=run.preset)
                    restored_at = rep["step"]
                    _log(args, f"checkpoint saved after step {restored_at} and restored into a fresh run")
            if args.save:
                run.save(args.save)
            mine = reports[n_before:]
            per_seed.append({"seed": run.seed, "steps_run": len(mine), "tokens": sum(r["tokens"] for r in mine),
                             "tokens_differ": sum(r["tokens_differ"] for r in mine),
                             "steps_diff_zero": sum(1 for r in mine if r["bitwise_equal"]),
                             "control_same_inputs_equal": probe["same_inputs"]["equal"] if probe else None})
    elapsed = time.perf_counter() - t0
    ok_steps = [r for r in reports if r["bitwise_equal"]]
    ran = len(reports)
    if args.baseline:  # every seed saw a difference, and on equal inputs the two sides' ops were equal
        confounded = [p["seed"] for p in probes if not p["same_inputs"]["equal"]]
        passed = (not confounded and bool(per_seed)
                  and all(s["tokens_differ"] > 0 for s in per_seed if s["steps_run"] > 0)
                  and any(s["steps_run"] > 0 for s in per_seed))
    else:  # every step that ran had diff = 0 (all requested ones, unless the time budget stopped the run)
        confounded = []
        passed = failure is None and ran > 0 and len(ok_steps) == ran and (ran == args.steps * n_seeds
                                                                          or stopped_by_budget)
    print(format_table(reports))
    if args.baseline:
        for k, v in _baseline_kernels().items():
            print(f"baseline kernel: {k}: {v}")

    verdict = ("PASS" if passed else "FAIL")
    sd = f" over {len(per_seed)} seeds" if n_seeds > 1 else ""
    if args.baseline and confounded:
        what = (f"negative control CONFOUNDED: on equal inputs the two sides' ops differ (seeds {confounded}); "
                "the diff does not isolate batch / phase dependence")
    elif args.baseline and passed:
        what = f"negative control: diff > 0 observed{sd}, and the two sides' ops agree on equal inputs"
    elif args.baseline:
        what = "negative control: NO difference observed (the check cannot see a difference!)"
    else:
        what = f"diff = 0 on {len(ok_steps)}/{ran} steps run{sd}" + (
            f" (time budget reached: {ran} of {args.steps * n_seeds} requested)" if stopped_by_budget else "")
    print(f"{verdict}: {what} ({elapsed:.1f} s)", flush=True)
    doc = doc_now(passed)
    doc["config"], doc["seed"] = run.preset.name, per_seed[0]["seed"] if per_seed else seeds[0]
    _write_json(args.json_path, doc)
    return 0 if passed else 1


def cmd_locate(args) -> int:
    import dataclasses

    variants = _kernel_variants(args)
    from .model.config import default_preset_name
    from .model.ops import MODES
    from .rl.locate import locate
    from .rl.loop import RLRun

    cfg_name = args.config or default_preset_name()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    mode = args.mode or ("baseline" if args.baseline else "consistent")
    preset = _packed_preset(cfg_name, args.train_packing)
    if args.prompts:
        preset = preset.replace(rollout=dataclasses.replace(preset.rollout, prompts_per_step=args.prompts))
    t0 = time.perf_counter()
    with _cpu_threads(device):
        run = RLRun(preset, args.seed, mode, device, stop_on_diff=False)
        for _ in range(args.steps_before):
            run.run_step()
        try:
            res = locate(run, plant=args.plant_divergence)
        except ValueError as e:
            print(str(e), file=sys.stderr)
            return 2
    div = res["divergence"]
    doc = {"command": "locate", "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "device": _device_name(device), "config": cfg_name, "seed": args.seed, "mode": mode,
           "ops": {"rollout": MODES[mode][0].__name__, "train": MODES[mode][1].__name__},
           "kernel_variants": variants, "train_packing": args.train_packing, "torch": torch.__version__,
           "elapsed_s": round(time.perf_counter() - t0, 2), **res}
    head = f"zerodiff locate: config={cfg_name} mode={mode} seed={args.seed} step={res['step']}: " \
           f"{res['ops_compared']} ops compared over {res['tokens']} tokens: "
    if div is None:
        msg = head + f"no op differs; log-probs bitwise equal ({res['logprobs']['tokens']} tokens)"
    elif div["op"] == "logprobs":
        msg = head + f"every op equal, the log-probs differ ({div['tokens_differ']} of {div['tokens_compared']})"
    else:
        msg = head + (f"FIRST DIVERGING OP {div['op']} (layer {div['layer']}): request {div['request']} position "
                      f"{div['position']} coordinate {div['coordinate']}: rollout {div['rollout_value']!r} train "
                      f"{div['train_value']!r}; max |diff| {div['max_abs_diff']:.3g} over {div['tokens_differ']} of "
                      f"{div['tokens_compared']} tokens; the {div['ops_before_equal']} ops before it equal on every "
                      f"token")
    if args.plant_divergence:
        doc["planted_found"] = div is not None and div["op"] == args.plant_divergence
        msg += f" [planted {args.plant_divergence}: {'found' if doc['planted_found'] else 'NOT FOUND'}]"
    print(msg, file=sys.stderr, flush=True)
    print(json.dumps(doc, indent=1, default=str), flush=True)
    _write_json(args.json_path, doc)
    if args.plant_divergence:
        return 0 if doc["planted_found"] else 1
    return 0 if div is None else 1


def cmd_bench(args) -> int:
    """See the module docstring (bench) and docs/benchmarks.md: warm-up, interleaved timing, JIT detector,
    confidence interval, profiler breakdown."""
    variants = _kernel_variants(args)
    from . import bench_tools as bt
    from .model import ops as model_ops
    from .model.config import default_preset_name
    from .rl.loop import RLRun
    from .rl.report import diff_report

    cfg_name = args.config or default_preset_name()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = str(device).startswith("cuda")
    preset = _rollout_preset(cfg_name, args)
    if args.steps < 1:
        print("zerodiff: --steps must be >= 1", file=sys.stderr)
        return 2
    modes = ("consistent", "baseline")
    rows: list = []
    t0 = time.perf_counter()
    stopped_by_budget = False
    det = bt.JitDetector(strict=args.strict_cache_dirs)
    for d in args.watch_cache_dir:
        det.dirs[f"extra {d}"] = d
    info: dict = {"graphs": {}, "profile": None}

    def compiled():
        return det.during("timed:")

    def doc_now(tot=None, summary=None, pooled=None, dev_ratio=None):
        prof = info["profile"]
        return {
            "command": "bench", "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": _device_name(device), "config": cfg_name, "seed": args.seed, "rows": rows,
            "steps": args.steps, "steps_run": len(rows), "stopped_by_time_budget": stopped_by_budget,
            "rollout_settings": _settings_doc(preset),
            "timing": ("wall time of one mode's whole rollout of a step's request set (scheduling, sampling, host "
                       "work and GPU work), between torch.cuda.synchronize() calls on CUDA; the two modes alternate "
                       "which runs first from step to step"),
            "warmup": {"exact": not args.no_exact_warmup, "extra_sets": args.warmup,
                       "what": ("every timed request set runs once untimed in each mode right before it is timed "
                                "(the same requests and schedule: every padded batch size, token count and kernel "
                                "shape the timed run meets), after every decode graph was captured"
                                if not args.no_exact_warmup else "no exact warm-up (--no-exact-warmup)"),
                       "compilations": len(det.during("warm")), "graphs_captured": info["graphs"]},
            "jit_detector": det.summary(),
            "compiled_during_timing": compiled(),
            "consistent_tok_per_s": tot and tot["consistent"], "baseline_tok_per_s": tot and tot["baseline"],
            "ratio": summary and summary["median"],
            "ratio_ci95": summary and {"order_statistic": summary["ci95_order_statistic"],
                                       "bootstrap": summary["ci95_bootstrap"]},
            "ratio_min": summary and summary["min"], "ratio_max": summary and summary["max"],
            "statistic": ("median over timed steps (tok/s per mode; ratio = median of the per-step ratios consistent "
                          "tok/s / baseline tok/s, with its 95% confidence interval)"),
            "pooled_tok_per_s": pooled,
            "forward_device_ratio": dev_ratio,
            "forward_device_measure": ("CUDA events around each engine step's model forward, baseline / consistent: "
                                       "the GPU timeline from the forward's first to its last kernel, INCLUDING the "
                                       "idle gaps while the host enqueues eager steps; scheduling and sampling are "
                                       "outside the events"),
            "profile": prof,
            "baseline_choice": model_ops.BASELINE_CHOICE, "baseline_kernels_ran": _baseline_kernels(),
            "baseline_vs_vllm": _baseline_vs_vllm(),
            "interim_ops": list(model_ops.CPU_EXACT_OPS), "torch": torch.__version__,
            "kernel_variants": variants,
            "rollout_value_checks": "off in both modes (kv_cache / indexer host-side input checks sync the host)",
            "elapsed_s": round(time.perf_counter() - t0, 2),
        }

    def rollout(m, s, label):
        """One untimed or timed rollout of request set ``s`` in mode ``m`` inside a detector window."""
        run = runs[m]
        g = run.engine.graphs
        before = set(g.graphs) if g is not None else set()
        with det.window(f"{label}:{s}:{m}"):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            _reqs, out = run.rollout(s)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
        if g is not None and set(g.graphs) - before:
            det.events.append({"window": f"{label}:{s}:{m}", "kind": "cuda_graph_capture",
                               "what": f"batch sizes {sorted(set(g.graphs) - before)}"})
        return out, dt

    with _cpu_threads(device), det:
        runs = {m: RLRun(preset, args.seed, m, device) for m in modes}
        _log(args, f"zerodiff bench: config={cfg_name} device={_device_name(device)} "
                   f"settings={_settings_doc(preset)}; both modes ready ({time.perf_counter() - t0:.1f} s)")
        for run in runs.values():  # no host-synchronising input-value checks in the timed rollouts (both modes)
            run.engine.cache.check = False
            run.engine.time_device = cuda  # CUDA events around each engine forward
        for m, run in runs.items():  # capture every decode graph before anything is timed
            if run.engine.graphs is not None and not run.engine.emulate_graphs:
                with det.window(f"warm-capture:{m}"):
                    got = run.engine.graphs.capture_all()
                info["graphs"][m] = sorted(k for k, v in got.items() if v is None)
                _log(args, f"{m}: CUDA graphs captured for batch sizes {sorted(got)}"
                           + (f"; FAILED: {run.engine.graphs.disabled}" if run.engine.graphs.disabled else "")
                           + f" ({time.perf_counter() - t0:.1f} s)")
        for i in range(args.warmup):
            for m in modes:
                rollout(m, 1000 + i, "warm-extra")
        last_s = 0.0
        for s in range(args.steps):
            if s >= 1 and _over_budget(args, t0, last_s):
                stopped_by_budget = True
                _log(args, f"time budget {args.time_budget:.0f} s: stopping cleanly after {len(rows)} timed steps")
                break
            ts = time.perf_counter()
            if not args.no_exact_warmup:
                for m in modes:
                    rollout(m, s, "warm")
            order = modes if s % 2 == 0 else modes[::-1]
            row = {"step": s, "first": order[0]}
            outs = {}
            for m in order:
                out, dt = rollout(m, s, "timed")
                run = runs[m]
                outs[m] = out
                ntok = sum(len(o.response) for o in out.values())
                row[f"{m}_tok_per_s"] = ntok / dt
                row[f"{m}_s"] = dt
                row["tokens"] = ntok
                row[f"{m}_engine_steps"] = run.engine.stats["steps"]
                row[f"{m}_max_batch_seen"] = max(run.engine.stats["batch_sizes"] or [0])
                row[f"{m}_graph_steps"] = run.engine.stats["graph_steps"]
                if "forward_device_s" in run.engine.stats:
                    row[f"{m}_forward_device_s"] = run.engine.stats["forward_device_s"]
            for m in modes:  # the per-step diff of each mode (untimed)
                out = outs[m]
                seqs = [(k, o.prompt, o.response) for k, o in sorted(out.items())]
                lp_t = runs[m].trainer.run(seqs, pack_seed=s + 17, grad=False)
                rep = diff_report({k: o.logprobs for k, o in out.items()}, lp_t)
                row[f"{m}_probs_diff_max"] = rep["training/rollout_probs_diff_max"]
                row[f"{m}_tokens_differ"] = rep["tokens_differ"]
            row["ratio"] = row["consistent_tok_per_s"] / row["baseline_tok_per_s"]
            if "consistent_forward_device_s" in row and "baseline_forward_device_s" in row:
                row["forward_device_ratio"] = row["baseline_forward_device_s"] / row["consistent_forward_device_s"]
            row["compiled_during_timing"] = len(det.during(f"timed:{s}:"))
            rows.append(row)
            _log(args, f"step {s} ({order[0]} first): consistent {row['consistent_tok_per_s']:.1f} tok/s, baseline "
                       f"{row['baseline_tok_per_s']:.1f} tok/s, ratio {row['ratio']:.3f}; max batch "
                       f"{row['consistent_max_batch_seen']}; diff max consistent "
                       f"{row['consistent_probs_diff_max']:.3g} baseline {row['baseline_probs_diff_max']:.3g}"
                       + (f"; COMPILED DURING TIMING: {row['compiled_during_timing']}"
                          if row["compiled_during_timing"] else "") + f" t={time.perf_counter() - t0:.0f}s")
            _write_json(args.json_path, doc_now())
            last_s = time.perf_counter() - ts
        if rows and args.profile_steps > 0:
            if _over_budget(args, t0, min(args.profile_steps, len(rows)) * last_s):
                info["profile"] = {"skipped": "the time budget leaves no room for the profiler pass"}
                _log(args, "profiler pass skipped: the time budget leaves no room for it")
            else:
                info["profile"] = _profile_pass(args, runs, [r["step"] for r in rows][: args.profile_steps], cuda,
                                                det)
    if not rows:
        print("zerodiff bench: no timed step completed", flush=True)
        _write_json(args.json_path, doc_now())
        return 1
    tot = {m: statistics.median(r[f"{m}_tok_per_s"] for r in rows) for m in modes}
    summary = bt.ratio_summary([r["ratio"] for r in rows])
    pooled = {m: sum(r["tokens"] for r in rows) / sum(r[f"{m}_s"] for r in rows) for m in modes}
    dev_ratio = (statistics.median(r["forward_device_ratio"] for r in rows)
                 if all("forward_device_ratio" in r for r in rows) else None)
    ci, cb = summary["ci95_order_statistic"], summary["ci95_bootstrap"]
    print(f"rollout output tokens/s (median of {len(rows)} steps): consistent {tot['consistent']:.1f}, baseline "
          f"{tot['baseline']:.1f}, ratio {summary['median']:.3f} (median of the per-step ratios; 95% CI "
          f"[{ci['lo']:.3f}, {ci['hi']:.3f}] order statistics, coverage {ci['coverage']:.3f}; bootstrap "
          f"[{cb['lo']:.3f}, {cb['hi']:.3f}]; min {summary['min']:.3f} max {summary['max']:.3f}; pooled "
          f"{pooled['consistent'] / pooled['baseline']:.3f}) "
          f"({'CPU reference backends: not a performance number' if not cuda else _device_name(device)})")
    if dev_ratio is not None:
        print(f"model forward event time baseline / consistent (median per step; CUDA events around each forward, "
              f"GPU idle gaps while the host enqueues included, scheduling and sampling excluded): {dev_ratio:.3f}")
    if info["profile"] and "skipped" not in info["profile"]:
        p = info["profile"]
        for m in modes:
            for line in bt.format_breakdown(m, p[m]):
                print(line)
        if p.get("kernel_time_ratio") is not None:
            print(f"profiled {p['source']} time baseline / consistent over the same request sets "
                  f"({p['measure']}): {p['kernel_time_ratio']:.3f}")
    for k, v in _baseline_kernels().items():
        print(f"baseline kernel: {k}: {v}")
    bad = compiled()
    passed = not bad
    if det.foreign:
        print(f"note: {len(det.foreign)} new JIT cache entries appeared while this process compiled nothing (another "
              f"process shares the cache dir; not counted; --strict-cache-dirs counts them), e.g. "
              f"{det.foreign[0]['what']}")
    if bad:
        print(f"FAIL: {len(bad)} compilation(s) during timing (the timed numbers include JIT work):", flush=True)
        for e in bad[:20]:
            print(f"  {e['window']}: {e['kind']}: {e['what']}")
    _write_json(args.json_path, {**doc_now(tot, summary, pooled, dev_ratio), "passed": passed})
    if args.png:
        _bench_png(args.png, rows, cfg_name, device, summary)
    return 0 if passed else 1


def _baseline_vs_vllm() -> list:
    from .model import baseline_cuda

    try:
        return baseline_cuda.vs_vllm()
    except Exception as e:  # noqa: BLE001 - a bad ZERODIFF_BASELINE_VLLM_OPS value: reported, not fatal here
        return [{"op": "(error)", "harness": f"{type(e).__name__}: {e}", "vllm": "", "note": ""}]


def _profile_pass(args, runs, steps, cuda, det) -> dict:
    """``--profile-steps``: the given (already warm) request sets once more per mode under torch.profiler with
    every ops method in a ``zerodiff::<method>`` range; per-kernel and per-op time for both modes."""
    from torch.profiler import ProfilerActivity, profile

    from . import bench_tools as bt

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    res = {"steps": steps, "decode": args.profile_decode}
    for m, run in runs.items():
        eng = run.engine
        old_emul = eng.emulate_graphs
        if args.profile_decode == "eager-static" and eng.graphs is not None:
            eng.emulate_graphs = True  # the captured graphs' padded static step, eagerly: same kernels, attributable
        ntok = 0
        try:
            with det.window(f"profile:{m}"), bt.annotate_ops(eng.ops), profile(activities=acts) as prof:
                for s in steps:
                    _, out = run.rollout(s)
                    ntok += sum(len(o.response) for o in out.values())
                if cuda:
                    torch.cuda.synchronize()
        finally:
            eng.emulate_graphs = old_emul
        res[m] = bt.breakdown(prof.events(), steps=len(steps), tokens=ntok)
    c, b = res["consistent"], res["baseline"]
    res["source"], res["measure"] = c["source"], c["measure"]
    res["kernel_time_ratio"] = (b["total_us"] / c["total_us"]) if c["total_us"] > 0 else None
    res["what"] = ("baseline / consistent summed " + ("GPU activity" if c["source"] == "device" else "CPU op")
                   + " time over the same request sets; pure-decode steps "
                   + ("ran the graphs' padded static step eagerly (same kernels as the replay)"
                      if args.profile_decode == "eager-static" else "replayed the captured graphs"))
    return res


def _bench_png(path, rows, cfg_name, device, summary) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - depends on the machine
        print(f"PNG skipped: matplotlib is not importable here ({type(e).__name__}: {e})")
        return
    fig, ax = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    xs = [r["step"] for r in rows]
    for m in ("consistent", "baseline"):
        ax[0].plot(xs, [r[f"{m}_tok_per_s"] for r in rows], marker="o", label=m)
        ax[2].plot(xs, [r[f"{m}_probs_diff_max"] for r in rows], marker="o", label=m)
    ax[0].set_ylabel("rollout output tok/s")
    ax[0].legend()
    ci = summary["ci95_order_statistic"]
    ax[0].set_title(f"zerodiff bench ({cfg_name}, {_device_name(device)}): median ratio {summary['median']:.3f} "
                    f"[{ci['lo']:.3f}, {ci['hi']:.3f}]")
    ax[1].plot(xs, [r["ratio"] for r in rows], marker="o", color="k")
    ax[1].axhline(summary["median"], color="k", lw=0.8)
    ax[1].axhspan(ci["lo"], ci["hi"], alpha=0.2)
    ax[1].set_ylabel("ratio consistent / baseline")
    ax[2].set_ylabel("probs diff max")
    ax[2].set_xlabel("step")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="zerodiff")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(sub)
    args = ap.parse_args(argv)
    from .profiling import profiled

    with profiled(getattr(args, "profile", None)):
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
