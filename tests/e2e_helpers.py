"""Helpers shared by the end-to-end test files (tests/test_e2e_*.py, test_evidence.py, test_bench.py): random
rollout requests, fresh copies of them, the same requests through the emulated CUDA-graph decode path and the
eager one, and ``zerodiff`` commands run with ``--json``."""

from __future__ import annotations

import json
import random

from bitwise import assert_bitwise_equal
from zerodiff import e2e_cli
from zerodiff.model.ops import make_ops
from zerodiff.model.weights import Deployment
from zerodiff.rollout.engine import Request, RolloutEngine


def make_requests(seed, n, vocab, plen=(8, 24), rlen=(8, 16), first_rid=1000):
    """``n`` requests with random prompts (lengths drawn from ``plen``) and response budgets (from ``rlen``)."""
    rng = random.Random(seed)
    return [Request(first_rid + i, [rng.randrange(vocab) for _ in range(rng.randint(*plen))], rng.randint(*rlen))
            for i in range(n)]


def clone_requests(reqs):
    """Fresh copies (an engine consumes the requests it is given)."""
    return [Request(r.rid, list(r.prompt), r.max_new) for r in reqs]


def graph_and_eager(preset, masters, mode, reqs, schedule, sample_seed, guard=False):
    """``reqs`` through a rollout engine of ``mode`` with the CUDA-graph decode step emulated on the CPU and through
    a plain eager one. Returns ``({"emulate": results, False: results}, the emulating engine)``; with ``guard`` the
    emulated captured step runs under the host-sync guard (any host<->device traffic from the harness raises)."""
    res = {}
    for g in ("emulate", False):
        eng = RolloutEngine(preset, Deployment(masters), make_ops(mode, "rollout", preset.model),
                            sample_seed=sample_seed, use_graphs=g)
        if g:
            emulating = eng
            if guard:
                eng.graphs.guard = True
        res[g] = eng.generate(clone_requests(reqs), schedule)
    return res, emulating


def assert_graph_equals_eager(res, reqs, responses=True):
    """Every request's log-probs (and with ``responses`` its tokens) equal in both results of ``graph_and_eager``."""
    for r in reqs:
        if responses:
            assert res["emulate"][r.rid].response == res[False][r.rid].response, f"request {r.rid}"
        assert_bitwise_equal(res["emulate"][r.rid].logprobs, res[False][r.rid].logprobs, f"request {r.rid}")


def cli_json(path, *argv):
    """Run ``zerodiff *argv --json path``; returns the exit code and the JSON document it wrote (None if none:
    a file left from an earlier call is removed first, so a stale document never passes for a new one)."""
    path.unlink(missing_ok=True)
    rc = e2e_cli.main([*argv, "--json", str(path)])
    return rc, (json.loads(path.read_text()) if path.exists() else None)
