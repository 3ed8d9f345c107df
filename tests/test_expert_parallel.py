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
