"""``zerodiff megatron-check``: the DeepSeek-V4 actor in megatron-core against the zerodiff rollout engine.

``register(subparsers)`` adds the subcommand to the ``zerodiff`` CLI; the check itself is
:func:`zerodiff.integrations.megatron.dsv4.acceptance.run_check`. Progress goes to stderr, the verdict to
stdout, the full result to ``--json OUT``.

Exit status: 0 every difference is 0 and every check passed; 1 a difference or a failed check; 2 a refused
setting or checkpoint (the message names it) or megatron-core not importable.
"""

from __future__ import annotations

import argparse
import json
import sys

_EPILOG = """\
What runs (all on --device; CPU uses the ops' exact CPU paths, CUDA the Triton / verified kernels):
  checkpoint        the harness masters of --preset / --seed written as an actor checkpoint (config.json,
                    FP8 + scale shards, masters/), or --checkpoint DIR; the actor is built from it and must
                    hold the masters bit for bit
  rollout           zerodiff's rollout engine, the same requests at every --concurrency (running batch)
  recompute         the actor (megatron-core MegatronModule) through Megatron-RL's selective_log_softmax
                    path and through the cross-entropy path; diff metrics per check
  --steps updates   megatron-core Float16OptimizerWithFloat16Params.step(); the next forward must run the new
                    masters; the rollout's FP8 deployment refitted in place (same data_ptr); diff = 0 re-checked
  restore           actor checkpoint + optimizer state saved, a fresh actor built from it, diff = 0 re-checked

Megatron-core comes from the installed package, or $MEGATRON_SRC, or build/sources/megatron (make sources apply).
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "megatron-check",
        help="the DeepSeek-V4 actor in megatron-core vs the zerodiff rollout engine: diff = 0 through RL updates, "
             "refits and a restore",
        description="Sample with zerodiff's rollout engine, recompute with the megatron-core DeepSeek-V4 actor, "
                    "run RL updates with megatron-core's optimizer, refit the rollout in place, save/restore; "
                    "exit 0 only when every log-prob is bit-identical.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2, metavar="N", help="RL updates (default 2)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="masters and request seed (default 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where everything runs (default cpu)")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="harness model and rollout preset: cpu, gpu_small, h200 (default: cpu on --device cpu, "
                        "gpu_small on cuda); with --checkpoint its model comes from the checkpoint")
    p.add_argument("--checkpoint", metavar="DIR", help="an actor checkpoint to start from (default: write one)")
    p.add_argument("--concurrency", type=int, nargs="+", metavar="C", default=None,
                   help="running-batch sizes the rollout samples at (default 1 4 12)")
    p.add_argument("--workdir", metavar="DIR", help="keep the checkpoints here (default: a temporary directory)")
    p.add_argument("--json", metavar="OUT", help="write the result as JSON to OUT")
    p.set_defaults(func=_run)
    return p


def register(sub) -> None:
    add_parser(sub)


def _run(args) -> int:
    from ... import ConfigError
    from ....checkpoint.dsv4 import CheckpointError

    def say(msg):
        print(f"megatron-check: {msg}", file=sys.stderr, flush=True)

    if args.steps < 1:
        print("megatron-check: --steps must be >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("megatron-check: --device cuda: no CUDA device", file=sys.stderr)
            return 2
    try:
        from .acceptance import CONCURRENCIES, run_check

        res = run_check(steps=args.steps, seed=args.seed, device=args.device, checkpoint=args.checkpoint,
                        preset=args.preset, concurrencies=tuple(args.concurrency or CONCURRENCIES),
                        workdir=args.workdir, progress=say)
    except ImportError as e:
        print(f"megatron-check: {e}", file=sys.stderr)
        return 2
    except (ConfigError, CheckpointError) as e:
        print(f"megatron-check: refused: {e}", file=sys.stderr)
        return 2
    finally:
        try:
            from .acceptance import shutdown_parallel_state

            shutdown_parallel_state()
        except ImportError:
            pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    print(f"megatron-check: {res['tokens']} tokens over {len(res['checks'])} checks, {res['tokens_differ']} differ, "
          f"probs_diff_max {res['probs_diff_max']:g}, k3_kl {res['k3_kl']:g}; refit {res['refit_checked']}, "
          f"restore {res['restore_checked']}, stale-weight {res['stale_weight_checked']} -> "
          f"{'PASS' if res['ok'] else 'FAIL'}")
    return 0 if res["ok"] else 1
