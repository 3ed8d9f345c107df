"""``zerodiff make-checkpoint``: write a seeded DeepSeek-V4 checkpoint in the released FP8 layout.

``register(subparsers)`` adds the subcommand to the ``zerodiff`` CLI (``zerodiff.cli``); ``main(argv)`` runs
it standalone (``python -m zerodiff.checkpoint.cli --preset tiny --out DIR``). The checkpoint itself is
:func:`zerodiff.checkpoint.dsv4.make_checkpoint`; this module only validates the settings, reports progress
on stderr and prints the summary on stdout.

Exit status: 0 written; 2 a bad setting (the message names it; nothing is written); 1 writing failed (the
message says why; nothing is left at ``--out``, and an existing directory replaced with ``--force`` is kept).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

PROG = "zerodiff make-checkpoint"

_EPILOG = """\
What is written (Hugging Face layout, as vLLM 0.33.0's DeepseekV4ForCausalLM loads it):
  config.json                          model_type deepseek_v4, expert_dtype fp8, quantization_config
                                       fp8 / e4m3 / ue8m0 / weight_block_size [128, 128]
  model-0000i-of-0000n.safetensors     block-FP8 linears (e4m3 .weight + FP32 .scale per 128 x 128
                                       block, powers of two), BF16 / FP32 / int64 elsewhere
  model.safetensors.index.json         tensor -> shard
  masters/                             with --masters only: the BF16 / FP32 masters (vLLM never reads it)

The same preset, seed and --shard-bytes give byte-identical files on every machine. The output is written
into a temporary sibling directory and renamed into place when complete. Tables of every tensor:
docs/checkpoint.md.

Presets:
"""


def _epilog() -> str:
    from .dsv4 import PRESETS

    rows = [textwrap.fill(PRESETS[name].description, 104, initial_indent=f"  {name:<6} ",
                          subsequent_indent=" " * 9) for name in sorted(PRESETS)]
    return _EPILOG + "\n".join(rows) + "\n"


def add_parser(sub) -> argparse.ArgumentParser:
    from .dsv4 import DEFAULT_SHARD_BYTES, PRESETS

    p = sub.add_parser(
        "make-checkpoint",
        help="write a seeded tiny DeepSeek-V4 checkpoint in the released FP8 layout (what vllm-check loads)",
        description="Write a seeded DeepSeek-V4 checkpoint (config.json + safetensors shards) in the released\n"
        "FP8 base checkpoint's layout, for vLLM 0.33.0. Every value comes from --seed alone.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", required=True, metavar="NAME",
                   help=f"model shape: one of {', '.join(sorted(PRESETS))} (see below)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="checkpoint directory to create; must not exist or be empty (see --force)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of every master value (0)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing non-empty --out directory (removed only once the new one is complete)")
    p.add_argument("--masters", action="store_true",
                   help="also write the BF16 / FP32 masters the FP8 weights were quantised from, under DIR/masters/")
    p.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, metavar="N",
                   help=f"largest safetensors shard in bytes ({DEFAULT_SHARD_BYTES}); a tensor is never split, "
                   "one larger than N gets a shard of its own")
    p.set_defaults(func=run)
    return p


def _error(msg: str) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return 2


def _validate(args) -> str | None:
    """The first bad setting as a message naming it, or None."""
    from .dsv4 import PRESETS

    if args.preset not in PRESETS:
        return f"--preset {args.preset}: unknown preset; choose one of {', '.join(sorted(PRESETS))}"
    if args.seed < 0:
        return f"--seed {args.seed}: must be >= 0"
    if args.shard_bytes < 1:
        return f"--shard-bytes {args.shard_bytes}: must be a positive number of bytes"
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out {args.out}: exists and is not a directory"
    if out.is_dir() and any(out.iterdir()) and not args.force:
        return f"--out {args.out}: exists and is not empty; pass --force to replace it"
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"--out {args.out}: {parent} is not a directory"
    return None


def run(args) -> int:
    from .dsv4 import CheckpointError, make_checkpoint

    bad = _validate(args)
    if bad:
        return _error(bad)

    def progress(msg: str) -> None:
        print(f"[make-checkpoint] {msg}", file=sys.stderr, flush=True)

    out = Path(args.out)
    kept = "the existing --out directory is unchanged" if out.is_dir() and any(out.iterdir()) else \
        "nothing was left at --out"
    progress(f"preset {args.preset}, seed {args.seed} -> {args.out}")
    try:
        summary = make_checkpoint(args.out, args.preset, args.seed, masters=args.masters, force=args.force,
                                  shard_bytes=args.shard_bytes, progress=progress)
    except CheckpointError as e:
        return _error(str(e))
    except OSError as e:
        print(f"{PROG}: writing {args.out} failed: {e}; {kept}", file=sys.stderr)
        return 1
    print(summary.text())
    return 0


def register(subparsers) -> None:
    add_parser(subparsers)


def main(argv=None) -> int:
    from ..subcommand import run_command

    return run_command("make-checkpoint", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
