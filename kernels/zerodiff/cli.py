"""The ``zerodiff`` command.

    zerodiff --version        print the package version
    zerodiff doctor [--json]  what this machine can run (torch, Triton, CUDA, backends, pins, verdict)

    zerodiff make-checkpoint  write a seeded DeepSeek-V4 checkpoint in the released FP8 layout
                              (zerodiff.checkpoint.cli)
    zerodiff vllm-check       engine-level acceptance inside real (patched) vLLM (zerodiff.vllm_check)
    zerodiff megatron-check   the DeepSeek-V4 actor in megatron-core vs the rollout engine
                              (zerodiff.integrations.megatron.dsv4.cli)

End-to-end subcommands (``check``, ``bench``) come from ``zerodiff.e2e_cli`` when that module exists: it
exposes ``register(subparsers)`` and each subparser it adds sets ``func`` (called with the parsed args,
returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="zerodiff",
        description="zerodiff: batch-invariant kernels shared by vLLM rollout and Megatron training, so both "
        "compute bit-identical log-probabilities for every sampled token (diff = 0).",
        epilog="Build, patch and test targets live in the Makefile of the checkout: run `make help` there.",
    )
    ap.add_argument("--version", action="version", version=f"zerodiff {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    doc = sub.add_parser(
        "doctor",
        help="report torch / Triton / CUDA / compute capability, importable backends, pins, and whether the "
        "consistency mode can run here",
        description="Report Python, torch (and its CUDA build), Triton, CUDA availability, device and compute "
        "capability, which backends are importable (DeepGEMM, FlashMLA, Triton, reference), the pins from "
        "build/pins, and whether the consistency mode can run here. Always exits 0.",
    )
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.set_defaults(func=_doctor)
    name = f"{__package__}.e2e_cli"
    try:
        e2e_cli = importlib.import_module(name)
    except ImportError as e:
        if e.name != name:  # the module exists but one of its own imports is broken: say so loudly
            raise
    else:
        e2e_cli.register(sub)
    from .checkpoint.cli import register as _register_make_checkpoint
    from .vllm_check import register as _register_vllm_check

    _register_make_checkpoint(sub)
    _register_vllm_check(sub)
    from .integrations.megatron.dsv4.cli import register as _register_megatron_check

    _register_megatron_check(sub)
    return ap


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.main(as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if getattr(args, "func", None) is None:
        ap.print_help()
        return 2
    from .profiling import profiled

    with profiled(getattr(args, "profile", None)):
        return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
