"""Helpers shared by the end-to-end test files (tests/test_e2e_*.py, test_evidence.py, test_bench.py): random
rollout requests, fresh copies of them, and ``zerodiff`` commands run with ``--json``."""

from __future__ import annotations

import json
import random

from zerodiff import e2e_cli
from zerodiff.rollout.engine import Request


def make_requests(seed, n, vocab, plen=(8, 24), rlen=(8, 16), first_rid=1000):
    """``n`` requests with random prompts (lengths drawn from ``plen``) and response budgets (from ``rlen``)."""
    rng = random.Random(seed)
    return [Request(first_rid + i, [rng.randrange(vocab) for _ in range(rng.randint(*plen))], rng.randint(*rlen))
            for i in range(n)]


def clone_requests(reqs):
    """Fresh copies (an engine consumes the requests it is given)."""
    return [Request(r.rid, list(r.prompt), r.max_new) for r in reqs]


def cli_json(path, *argv):
    """Run ``zerodiff *argv --json path``; returns the exit code and the JSON document it wrote (None if none:
    a file left from an earlier call is removed first, so a stale document never passes for a new one)."""
    path.unlink(missing_ok=True)
    rc = e2e_cli.main([*argv, "--json", str(path)])
    return rc, (json.loads(path.read_text()) if path.exists() else None)
