"""Expert-parallel MoE (zerodiff.ops.expert_parallel): EP = 2 on a CPU gloo world of 2 equals EP = 1 bitwise."""

from __future__ import annotations

import os

import pytest
import torch

import ep_cases as C
from bitwise import assert_batch_dependent, assert_bitwise_equal, assert_victim_in_batch
from zerodiff.errors import InputError
from zerodiff.ops import expert_parallel as ep
from zerodiff.ops import fp8_gemm as g
from zerodiff.ops import moe
from zerodiff.ops.fp8_quant import quant_act


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One gloo world of 2 runs every call of ep_cases.build_calls; returns (per-rank results, calls)."""
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("ep")
    mp.spawn(C.worker, args=(str(d / "store"), str(d)), nprocs=C.WORLD, join=True)
    res = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(C.WORLD)]
    return res, {c[0]: c for c in C.build_calls()}


@pytest.fixture(scope="module")
def experts():
    return C.make_experts()


def _ep1(x, w, ids, experts):
    return moe.moe_experts(x, w, ids, experts, backend=C.BACKEND)


# ------------------------------------------------------------------------------------------------ plan
@pytest.mark.parametrize("cap", [None, 40])
@pytest.mark.parametrize("rank", [0, 1])
def test_plan_sends_every_slot_once(rank, cap):
    x, w, ids = C.adversarial_inputs(20, 6)
    plan = ep.plan_ep_dispatch(ids, C.E, 2, rank, capacity=cap)
    T, k = ids.shape
    valid = (ids.reshape(-1) >= 0)
    sent = plan.send_flat[plan.send_flat >= 0]
    assert sorted(sent.tolist()) == [i for i in range(T * k) if valid[i]]  # each valid (token, slot) once
    assert plan.send_rows == (int(valid.sum()) if cap is None else 2 * cap)
    for r in range(plan.send_rows):
        f = int(plan.send_flat[r])
        if f < 0:
            assert plan.send_meta[r].tolist() == [-1, -1, -1]
            continue
        t, j = divmod(f, k)
        e = int(ids[t, j])
        d = e // plan.experts_per_rank
        assert plan.send_meta[r].tolist() == [t, j, e - d * plan.experts_per_rank]
        assert int(plan.dest[t, j]) == r and int(plan.owner[t, j]) == d
        if cap is not None:  # static mode: destination d's rows are the block [d * cap, (d + 1) * cap)
            assert d * cap <= r < (d + 1) * cap
    order = [(int(plan.owner.reshape(-1)[f]), int(f)) for f in plan.send_flat.tolist() if f >= 0]
    assert order == sorted(order)  # (destination, token, slot) order
    if cap is not None:
        for d in range(2):
            blk = plan.send_flat[d * cap:(d + 1) * cap]
            n = int(plan.send_counts[d])
            assert bool((blk[:n] >= 0).all()) and bool((blk[n:] == -1).all())
    assert bool((plan.dest[ids < 0] == plan.send_rows).all())  # -1 slots read the dump row


def test_plan_refusals():
    ids = torch.zeros((3, 2), dtype=torch.int32)
    with pytest.raises(InputError, match="split evenly"):
        ep.plan_ep_dispatch(ids, 7, 2, 0)
    with pytest.raises(InputError, match="rank=2"):
        ep.plan_ep_dispatch(ids, 8, 2, 2)
    with pytest.raises(InputError, match="num_experts=8"):
        ep.plan_ep_dispatch(ids + 8, 8, 2, 0, validate=True)


def test_capacity_overflow_raises_naming_capacity():
    x, w, ids = C.random_inputs(60, 8, k=4, lo=0, hi=4)  # 32 rows for rank 0
    with pytest.raises(InputError, match=r"to rank 0 but capacity=31"):
        ep.plan_ep_dispatch(ids, C.E, 2, 1, capacity=31)
    ep.plan_ep_dispatch(ids, C.E, 2, 1, capacity=32)  # exactly full: fine
    ep.plan_ep_dispatch(ids, C.E, 2, 1, capacity=8 * 4)  # the never-overflows bound: check skipped


def test_grouped_gemm_row_independent_of_segment_rows(experts):
    """CPU reference path: a row's expert output alone == inside a segment of other rows (any position)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn((70, C.H), generator=gen) * 3).to(torch.bfloat16)
    ids = torch.full((70, 1), 3, dtype=torch.int32)
    y, plan = moe.expert_rows(x, ids, experts, backend="reference")
    for t in (0, 33, 69):
        y1, p1 = moe.expert_rows(x[t:t + 1], ids[:1], experts, backend="reference")
        assert_bitwise_equal(y[plan.dest[t, 0]], y1[p1.dest[0, 0]], f"row {t}")
    xq, xs = quant_act(x, backend="reference")
    te = torch.tensor([3, 3], dtype=torch.int32)
    full = g.grouped_fp8_gemm(torch.cat([xq, xq[:58]]), torch.cat([xs, xs[:58]]), experts.w13.q, experts.w13.scale,
                              te, backend="reference")
    one = g.grouped_fp8_gemm(xq[33:34], xs[33:34], experts.w13.q, experts.w13.scale, te[:1], backend="reference")
    assert_bitwise_equal(full[33:34], one)


def test_expert_rows_is_moe_experts_before_combine(experts):
    x, w, ids = C.adversarial_inputs(20, 6)
    y, plan = moe.expert_rows(x, ids, experts, backend="reference")
    wz = torch.where(ids >= 0, w, torch.zeros(()))
    assert_bitwise_equal(moe.combine(y, plan.dest, wz, backend="reference"), _ep1(x, w, ids, experts))


# ------------------------------------------------------------------------------------------------ world of 2
def test_gloo_mover_mode_is_recorded(world):
    res, _ = world
    assert res[0]["mode"] in ("all_to_all", "all_gather") and res[0]["mode"] == res[1]["mode"]
    if res[0]["mode"] == "all_gather":
        assert res[0]["probe_error"]


@pytest.mark.parametrize("label", [c[0] for c in C.build_calls() if not c[0].startswith("victim")])
def test_ep2_equals_ep1_bitwise(world, experts, label):
    res, calls = world
    _, cap, _, per_rank = calls[label]
    for r in range(2):
        x, w, ids = per_rank[r]
        out = res[r]["calls"][label]["out"]
        assert out.shape == (x.shape[0], C.H)
        if x.shape[0]:
            assert_bitwise_equal(out, _ep1(x, w, ids, experts), f"{label} rank {r}")
    # also equal to EP = 1 over both ranks' tokens in one batch
    xs = torch.cat([p[0] for p in per_rank])
    if xs.shape[0]:
        ref = _ep1(xs, torch.cat([p[1] for p in per_rank]), torch.cat([p[2] for p in per_rank]), experts)
        assert_bitwise_equal(torch.cat([res[r]["calls"][label]["out"] for r in range(2)]), ref, label)


def test_receiver_gets_nothing_when_all_routed_elsewhere(world):
    res, _ = world
    for tag in ("dyn", "cap64"):
        c1 = res[1]["calls"][f"all-to-rank0-{tag}"]
        assert bool((c1["rmeta"] == -1).all())  # rank 1 received no real row (only padding in static mode)
        assert sum(c1["recv_splits"]) == (0 if tag == "dyn" else 128)


@pytest.mark.parametrize("label", ["random-dyn", "adversarial-cap64", "random-dyn-allgather", "empty-rank1-dyn"])
def test_metadata_travels_with_rows(world, label):
    res, calls = world
    _, cap, _, per_rank = calls[label]
    for d in range(2):
        c = res[d]["calls"][label]
        assert c["meta_round_trip"]
        off = 0
        for s in range(2):
            n = c["recv_splits"][s]
            meta, rx = c["rmeta"][off:off + n], c["rx"][off:off + n]
            off += n
            x, _, ids = per_rank[s]
            plan = ep.plan_ep_dispatch(ids, C.E, 2, s, capacity=cap)
            real = meta[:, 0] >= 0
            assert int(real.sum()) == int(plan.send_counts[d])
            for row, (t, j, le) in zip(rx[real], meta[real].tolist()):
                assert int(ids[t, j]) == d * plan.experts_per_rank + le
                assert_bitwise_equal(row, x[t])


def test_victim_in_batch_across_both_ranks(world, experts):
    res, calls = world
    vx, vw, vids = C.random_inputs(50, 1)
    alone = _ep1(vx, vw, vids, experts)
    runs = []
    for label, (_, cap, _, per_rank) in calls.items():
        if label.startswith("victim"):
            pos = int(label.split("pos=")[1].split("-")[0])
            runs.append((label, res[0]["calls"][label]["out"][pos:pos + 1]))
    assert len(runs) == 24
    assert_victim_in_batch(alone, runs)


def test_negative_control_partial_sums_per_rank_differ(world, experts):
    """Reduce-scatter style (partial sum per expert rank, then summed) is not EP = 1's slot-order combine."""
    res, calls = world
    diffs = []
    for label in ("random-dyn", "random-cap64", "adversarial-dyn"):
        for r in range(2):
            x, w, ids = calls[label][3][r]
            ref = _ep1(x, w, ids, experts)
            ctrl = res[r]["calls"][label]["control"]
            diffs.append((f"{label} rank {r}", ctrl))
            assert_bitwise_equal(res[r]["calls"][label]["out"], ref)
            assert not torch.equal(ctrl.view(torch.int32), ref.view(torch.int32)), f"{label} rank {r}: control equal"
        assert_batch_dependent(ref, [diffs[-1]], what="partial-sum combine")


def test_deepep_mover_refuses():
    with pytest.raises((RuntimeError, NotImplementedError), match="DeepEP|deep_ep"):
        ep.DeepEPMover()


def test_local_experts_slice(experts):
    mine = ep.local_experts(experts, 2, 1)
    assert mine.num_experts == 4 and torch.equal(mine.w13.q.view(torch.uint8), experts.w13.q[4:].view(torch.uint8))
    with pytest.raises(InputError):
        ep.local_experts(experts, 3, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ep2_nccl_equals_ep1_two_gpus(tmp_path):
    """2 GPUs, NCCL, Triton backend: EP = 2 equals EP = 1 on each rank's tokens (run on a 2-GPU host)."""
    import torch.multiprocessing as mp

    mp.spawn(_nccl_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        assert torch.load(tmp_path / f"ok{r}.pt")


def _nccl_worker(rank, store, out):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        dev = torch.device("cuda", rank)
        experts = C.make_experts()
        experts = moe.MoEWeights(type(experts.w13)(experts.w13.q.to(dev), experts.w13.scale.to(dev), False),
                                 type(experts.w2)(experts.w2.q.to(dev), experts.w2.scale.to(dev), False))
        mover = ep.TorchDistributedMover()
        ok = True
        for label, cap, _, per_rank in C.build_calls():
            x, w, ids = (t.to(dev) for t in per_rank[rank])
            plan = ep.plan_ep_dispatch(ids, C.E, 2, rank, capacity=cap)
            out = ep.ep_moe_experts(x, w, ids, ep.local_experts(experts, 2, rank), plan, mover)
            if x.shape[0]:
                ok &= bool(torch.equal(out.view(torch.int32), moe.moe_experts(x, w, ids, experts).view(torch.int32)))
        torch.save(ok, os.path.join(out, f"ok{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_overflow_raises_in_the_world(world):
    res, _ = world
    for r in range(2):
        assert res[r]["overflow"].startswith("InputError") and "capacity=5" in res[r]["overflow"]


# ------------------------------------------------------------------------------------------------ guards
def test_megatron_guard_still_refuses_ep_and_names_the_unwired_dispatcher():
    from zerodiff.integrations import ConfigError
    from zerodiff.integrations.megatron import guard as mg

    with pytest.raises(ConfigError, match=r"expert_model_parallel_size=2.*zerodiff\.ops\.expert_parallel.*not wired"):
        mg.validate_config(num_moe_experts=8, expert_model_parallel_size=2)
    mg.validate_config(num_moe_experts=8, expert_model_parallel_size=1)


def test_vllm_guard_ep_refusal_names_the_unwired_dispatcher():
    from zerodiff.integrations import ConfigError
    from zerodiff.integrations.vllm import guard as vg

    with pytest.raises(ConfigError, match=r"allgather_reducescatter.*zerodiff\.ops\.expert_parallel.*not wired"):
        vg.validate_config(enable_expert_parallel=True, expert_parallel_world=2,
                           all2all_backend="allgather_reducescatter")


# ------------------------------------------------------------------------------- the harness model at EP = 2
@pytest.fixture(scope="module")
def model_world(tmp_path_factory):
    """A gloo world of 2 serving the harness model with ExpertParallelOps (ep_model_cases.worker)."""
    import torch.multiprocessing as mp

    import ep_model_cases as M

    d = tmp_path_factory.mktemp("ep-model")
    mp.spawn(M.worker, args=(str(d / "store"), str(d)), nprocs=M.WORLD, join=True)
    return [torch.load(os.path.join(d, f"model-rank{r}.pt"), weights_only=False) for r in range(M.WORLD)]


@pytest.fixture(scope="module")
def model_ep1():
    """Every rank's requests of every round served alone with ConsistentOps (EP = 1)."""
    import ep_model_cases as M
    from zerodiff.model.ops import ConsistentOps
    from zerodiff.model.weights import Deployment, init_masters

    torch.set_num_threads(1)
    cfg = M.model_config()
    dep = Deployment(init_masters(cfg, M.SEED))
    return {label: [M.serve(dep, cfg, ConsistentOps(cfg), p) for p in (p0, p1)]
            for label, p0, p1 in M.rounds(cfg.vocab)}


def test_model_ep2_logits_and_logprobs_equal_ep1(model_world, model_ep1):
    """Every request's logits (prefill positions and decode steps) and log-probs at EP = 2, dynamic and static
    capacity, equal EP = 1's bits on the same requests; both ranks ran the same number of MoE layers."""
    import ep_model_cases as M

    for label, _p0, _p1 in M.rounds(M.model_config().vocab):
        for cap in (None, 512):
            assert model_world[0]["calls"][(label, cap)] == model_world[1]["calls"][(label, cap)] > 0
            for r in range(M.WORLD):
                got, ref = model_world[r]["rounds"][(label, cap)], model_ep1[label][r]
                assert len(got) == len(ref)
                for i, ((lg, lp), (lg1, lp1)) in enumerate(zip(got, ref)):
                    assert_bitwise_equal(lg, lg1, f"{label} cap={cap} rank {r} request {i} logits")
                    assert_bitwise_equal(lp, lp1, f"{label} cap={cap} rank {r} request {i} log-probs")


def test_model_ep2_victim_independent_of_both_ranks_batches(model_world):
    """The victim request (rank 0) keeps its bits while rank 0's batch holds 1, 3 or 6 requests (at several
    positions) and rank 1's holds 5, 2 or 1."""
    import ep_model_cases as M

    v = M.model_config().vocab
    runs = []
    for label, p0, _p1 in M.rounds(v):
        for cap in (None, 512):
            runs.append((f"{label} cap={cap}", model_world[0]["rounds"][(label, cap)][M.victim_index(p0, v)][0]))
    assert_victim_in_batch(runs[0][1], runs[1:])


def test_model_control_combine_depends_on_the_ep_degree(model_world):
    """Negative control, the same combine code at EP = 2 and EP = 1: reducing on the expert rank and rounding
    there (a reduce-scatter / expert-side combine) changes the logits with the EP degree; EP = 1 is recomputed
    here with that combine."""
    import ep_model_cases as M
    from zerodiff.model.weights import Deployment, init_masters

    torch.set_num_threads(1)
    cfg = M.model_config()
    dep = Deployment(init_masters(cfg, M.SEED))
    _ep2_cls, ep1_cls = M.control_ops_classes()
    runs = []
    for label, p0, p1 in M.rounds(cfg.vocab):
        for r, prompts in enumerate((p0, p1)):
            ep1 = M.serve(dep, cfg, ep1_cls(cfg), prompts)
            for i, ((lg2, _), (lg1, _)) in enumerate(zip(model_world[r]["control"][label], ep1)):
                runs.append((f"{label} rank {r} request {i}", lg2, lg1))
    differ = [name for name, a, b in runs if not torch.equal(a, b)]
    assert differ, "the expert-side combine gave the same bits at EP = 2 and EP = 1 on every request"


def _model_summary(tmp_path, backend):
    import json

    import torch.multiprocessing as mp

    import ep_model_cases as M

    mp.spawn(M.summary_worker, args=(str(tmp_path / "store"), str(tmp_path), backend), nprocs=M.WORLD, join=True)
    res = [torch.load(tmp_path / f"summary-rank{r}.pt", weights_only=False) for r in range(M.WORLD)]
    print("EP2_MODEL_RESULT", json.dumps(res))
    for r in res:
        checked = [x for x in r["rounds"] if "values_differ" in x]
        assert len(checked) == 6 and all(x["values_differ"] == 0 for x in checked), r
    assert any(x.get("requests_differ", 0) > 0 for r in res for x in r["rounds"]), "the control never differed"
    return res


def test_model_ep2_summary_gloo(tmp_path):
    """The 2-GPU run's summary code on the CPU (gloo): EP = 2 equals EP = 1, the control differs."""
    res = _model_summary(tmp_path, "gloo")
    assert res[0]["backend"] == "gloo" and res[0]["device"] == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_model_ep2_nccl_equals_ep1_two_gpus(tmp_path):
    """2 GPUs, NCCL, CUDA kernels: the harness model's logits and log-probs at EP = 2 equal EP = 1's on every
    rank and round; the expert-side combine differs between EP = 2 and EP = 1. Prints EP2_MODEL_RESULT (JSON)."""
    _model_summary(tmp_path, "nccl")


def test_expert_parallel_ops_refusals():
    from zerodiff.model.config import CPU
    from zerodiff.model.expert_parallel_ops import ExpertParallelOps

    with pytest.raises(InputError, match="rank=2"):
        ExpertParallelOps(CPU.model, ep_size=2, rank=2, mover=None)
    with pytest.raises(InputError, match="capacity=0"):
        ExpertParallelOps(CPU.model, ep_size=2, rank=0, mover=None, capacity=0)


# ------------------------------------------------------------------ RL steps: EP = 2 rollout, EP = 1 training
def test_rl_check_ep2_rollout_ep1_training_diff_zero():
    """`zerodiff check --rollout-ep 2` on the CPU (gloo): two RL steps, each rank serving half the requests in
    lockstep (padding steps when its queue is empty), diff = 0 on every response token against the EP = 1
    training forward, the ranks' masters equal after every update."""
    from zerodiff.rl.expert_parallel import run_ep_check

    doc = run_ep_check("cpu", steps=2, seed=3, ep_size=2)
    assert doc["passed"], doc["error"]
    assert doc["backend"] == "gloo" and len(doc["steps"]) == 2
    for rep in doc["steps"]:
        assert rep["bitwise_equal"] and rep["tokens_differ"] == 0 and rep["tokens"] > 0
        assert rep["masters_equal_across_ranks"]
        assert len(rep["rank_tokens"]) == 2 and all(n > 0 for n in rep["rank_tokens"])
        assert sum(rep["rank_tokens"]) == rep["tokens"]


def test_rl_check_sees_an_ep_dependent_combine(tmp_path):
    """Control for the check above: the same EP = 2 run whose rollout reduces on the expert rank in BF16 fails
    the diff check on both ranks (the check can see a combine that depends on the EP layout)."""
    import torch.multiprocessing as mp

    import ep_model_cases as M

    mp.spawn(M.rl_control_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=M.WORLD, join=True)
    for r in range(M.WORLD):
        res = torch.load(tmp_path / f"rl-control-rank{r}.pt", weights_only=False)
        assert res["error"] and "differ" in res["error"] and res["tokens_differ"] > 0, res


def test_rl_check_ep_refusals(capsys):
    from zerodiff.cli import main
    from zerodiff.rl.expert_parallel import run_ep_check

    with pytest.raises(InputError, match="--rollout-ep=1"):
        run_ep_check("cpu", ep_size=1)
    with pytest.raises(InputError, match="--rollout-ep=3 does not divide"):
        run_ep_check("cpu", ep_size=3)
    with pytest.raises(InputError, match="at least 2 ranks"):
        run_ep_check("cpu", ep_size=0)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        with pytest.raises(InputError, match="needs 2 visible GPUs"):
            run_ep_check("cpu", ep_size=2, backend="nccl")
    for extra in (["--baseline"], ["--seeds", "2"], ["--restore-at", "0"]):
        with pytest.raises(SystemExit, match="--rollout-ep 2 cannot be combined with"):
            main(["check", "--rollout-ep", "2", "--config", "cpu", "--device", "cpu", *extra])
    with pytest.raises(SystemExit, match="--ep-graphs needs --rollout-ep"):
        main(["check", "--ep-graphs", "--config", "cpu", "--device", "cpu"])


def test_rl_ep2_decode_graphs_equal_eager(tmp_path):
    """EP = 2 rollout with decode graphs (emulated on the CPU: the padded static step, static graph capacity,
    the ranks agreeing per step to replay together) equals the eager EP = 2 rollout: same responses, log-probs
    bitwise, on both ranks; graph steps did run."""
    import torch.multiprocessing as mp

    import ep_model_cases as M

    mp.spawn(M.rl_graphs_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=M.WORLD, join=True)
    for r in range(M.WORLD):
        res = torch.load(tmp_path / f"rl-graphs-rank{r}.pt", weights_only=False)
        assert res["graph_steps"][False] == 0 and res["graph_steps"][True] > 0, res["graph_steps"]
        eager, graphs = res["outs"][False], res["outs"][True]
        assert sorted(eager) == sorted(graphs) and eager
        for rid in eager:
            assert eager[rid][0] == graphs[rid][0], rid
            assert_bitwise_equal(graphs[rid][1], eager[rid][1], f"rank {r} request {rid}")
