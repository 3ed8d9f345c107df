"""One ``zerodiff`` subcommand run as a program of its own (``python -m zerodiff.<module>``).

A leaf module: the subcommand modules import it, ``zerodiff.cli`` imports them, so it imports neither.
"""

from __future__ import annotations

import argparse
import sys


def run_command(command: str, add_parser, argv: list[str] | None = None) -> int:
    """``zerodiff <command> <argv>`` as a program of its own: a parser holding only the subcommand that
    ``add_parser(subparsers)`` adds; ``argv`` None means ``sys.argv[1:]``. Returns the subcommand's exit status."""
    ap = argparse.ArgumentParser(prog="zerodiff")
    sub = ap.add_subparsers(dest="command")
    add_parser(sub)
    args = ap.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
