"""End-to-end harness on CUDA, with zerodiff's Triton kernels: diff = 0 through RL steps,
negative control, CUDA graph == eager, in-place weight update under captured graphs.

Uses the ``gpu_small`` preset (H200 per-head shapes, 64 heads, few experts, short requests). The full
``h200`` preset runs through ``gpu/e2e-device.sh`` / ``zerodiff check --config h200`` (see docs/results.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu


def _preset(**rc):
    from zerodiff.model.config import GPU_SMALL

    return GPU_SMALL.replace(rollout=dataclasses.replace(GPU_SMALL.rollout, **rc)) if rc else GPU_SMALL


def test_gpu_rl_steps_diff_zero_with_graphs():
    from zerodiff.rl.loop import RLRun

    run = RLRun(_preset(), seed=0, mode="consistent", device="cuda")
    assert run.engine.graphs is not None
    ptrs = run.rollout_dep.data_ptrs()
    for _ in range(3):
        rep = run.run_step()
        assert rep["bitwise_equal"], rep
        assert rep["mixed_steps"] > 0 and rep["decode_steps"] > 0
    assert run.rollout_dep.data_ptrs() == ptrs  # requantised in place: captured graphs stay valid
    assert sum(h["graph_steps"] for h in run.history) > 0, run.engine.graphs.disabled


def test_gpu_baseline_shows_diff_on_the_stock_kernels():
    """Negative control on the frozen CUDA baseline; also checks that the stock kernels really ran (DeepGEMM dense
    and grouped in both layouts, FlashMLA FP8 decode inside captured graphs, FlashMLA sparse prefill)."""
    from zerodiff.model import baseline_cuda
    from zerodiff.rl.loop import RLRun

    run = RLRun(_preset(), seed=0, mode="baseline", device="cuda")
    rep = run.run_step()
    ran = baseline_cuda.choices_text()
    print("baseline kernels:", ran)
    assert rep["tokens_differ"] > 0 and rep["training/rollout_probs_diff_max"] > 0
    assert rep["graph_steps"] > 0, run.engine.graphs.disabled  # same CUDA-graph policy as the consistent mode
    assert "FlashMLA" in ran.get("attention decode", "") and "flash_mla_sparse_fwd" in ran.get("attention prefill", "")
    assert any(k.startswith("dense fp8 linear") and "DeepGEMM" in v for k, v in ran.items()), ran
    assert any(k.startswith("moe w13 masked") for k in ran) and any(k.startswith("moe w13 contiguous") for k in ran), ran


def _requests(seed, n, vocab):
    import random

    from zerodiff.rollout.engine import Request

    rng = random.Random(seed)
    return [Request(i, [rng.randrange(vocab) for _ in range(rng.randint(64, 300))], rng.randint(8, 32))
            for i in range(n)]


def test_gpu_cuda_graph_equals_eager():
    from zerodiff.model.ops import make_ops
    from zerodiff.model.weights import Deployment, init_masters
    from zerodiff.rollout.engine import Request, RolloutEngine

    p = _preset()
    masters = init_masters(p.model, 1, "cuda")
    reqs = _requests(3, 12, p.model.vocab)
    res = {}
    for graphs in (True, False):
        eng = RolloutEngine(p, Deployment(masters), make_ops("consistent", "rollout", p.model), "cuda",
                            sample_seed=3, use_graphs=graphs)
        res[graphs] = eng.generate([Request(r.rid, list(r.prompt), r.max_new) for r in reqs], 5)
        if graphs:
            assert eng.stats["graph_steps"] > 0, eng.graphs.disabled
    for r in reqs:
        assert res[True][r.rid].response == res[False][r.rid].response
        assert torch.equal(res[True][r.rid].logprobs, res[False][r.rid].logprobs)


def test_gpu_victim_in_batch_engine():
    from zerodiff.model.ops import make_ops
    from zerodiff.model.weights import Deployment, init_masters
    from zerodiff.rollout.engine import Request, RolloutEngine

    p = _preset()
    masters = init_masters(p.model, 2, "cuda")
    reqs = _requests(4, 16, p.model.vocab)
    victim = reqs[7]
    outs = []
    for sched, budget, mb in [(0, (4096, 4096), (1, 1)), (1, (256, 1024), (4, 16)), (2, (33, 300), (2, 16))]:
        pp = _preset(token_budget=budget, max_batch=mb)
        eng = RolloutEngine(pp, Deployment(masters), make_ops("consistent", "rollout", pp.model), "cuda",
                            sample_seed=1)
        todo = [victim] if mb == (1, 1) else reqs
        outs.append(eng.generate([Request(r.rid, list(r.prompt), r.max_new) for r in todo], sched))
    for o in outs[1:]:
        assert o[victim.rid].response == outs[0][victim.rid].response
        assert torch.equal(o[victim.rid].logprobs, outs[0][victim.rid].logprobs)


def test_gpu_gradient_check_bound():
    """STE training gradients on the H200 (gpu_small shapes, zerodiff's CUDA kernels) vs the independent float64
    model; prints the per-group relative errors (docs/results.md takes them from this line)."""
    from zerodiff.rl.loop import RLRun
    from zerodiff.training.gradcheck import gradient_check

    # short requests: the float64 reference model runs on the host CPU
    run = RLRun(_preset(prompts_per_step=2, prompt_len=(32, 96), response_len=(8, 16)), seed=0, mode="consistent",
                device="cuda")
    _, out = run.rollout(0)
    seqs = [(k, o.prompt, o.response) for k, o in sorted(out.items())[:3]]
    g = torch.Generator().manual_seed(1)
    coef = {k: float(torch.randn(1, generator=g)) for k, _, _ in seqs}
    err = gradient_check(run.trainer, seqs, coef)
    print("E2E_GRAD_ERRORS", {k: round(v, 4) for k, v in sorted(err.items())})
    assert max(err.values()) < 0.15, err
