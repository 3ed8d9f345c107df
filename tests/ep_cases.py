"""Cases and the gloo worker for tests/test_expert_parallel.py (a world of 2 CPU processes).

Every call is built from fixed seeds by :func:`build_calls`, so the parent (which computes the EP = 1
reference with ``moe.moe_experts``) and the two workers (which run ``ep_moe_experts``) see the same inputs.
Each worker saves, per call label, its EP output, the reduce-scatter-style control and the metadata it
received, to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import os

import torch

E, H, I, WORLD = 8, 128, 128, 2
BACKEND = "reference"


def make_experts():
    from zerodiff.ops.moe import MoEWeights

    g = torch.Generator().manual_seed(1234)
    w13 = (torch.randn((E, 2 * I, H), generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn((E, H, I), generator=g) * 0.05).to(torch.bfloat16)
    return MoEWeights.from_master(w13, w2, backend="reference")


def _ids_unique(g, T, k, lo=0, hi=E):
    return torch.stack([torch.randperm(hi - lo, generator=g)[:k] + lo for _ in range(T)]).to(torch.int32) \
        if T else torch.zeros((0, k), dtype=torch.int32)


def random_inputs(seed, T, k=4, lo=0, hi=E):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((T, H), generator=g) * 2).to(torch.bfloat16)
    ids = _ids_unique(g, T, k, lo, hi)
    w = torch.rand((T, k), generator=g).to(torch.float32) + 0.01
    w = w / w.sum(dim=1, keepdim=True) if T else w
    return x, w.contiguous(), ids


def adversarial_inputs(seed, T, k=4):
    """Ties in the routing weights, +-0 rows and entries, denormal BF16 inputs and FP32 weights, -1 slots."""
    x, w, ids = random_inputs(seed, T, k)
    if T >= 1:
        w[0] = 0.25  # all four weights tie
        x[0, ::3] = -0.0
    if T >= 2:
        x[1] = 0.0
        x[1, 5] = -0.0
        w[1, 1] = -0.0
    if T >= 3:
        x[2] = torch.tensor(1e-39, dtype=torch.float32).to(torch.bfloat16)  # a BF16 denormal row
        x[2, ::2] = -x[2, ::2]
        w[2, 2] = 1e-40  # an FP32 denormal weight
    if T >= 4:
        ids[3, 3] = -1  # Top-K padding slot
        w[3, 3] = 0.7
    if T >= 5:
        w[4, 0] = w[4, 1] = w[4, 2] = 1.0 / 3.0
    return x, w, ids


def build_calls():
    """[(label, capacity, mode, [(x, w, ids) for rank 0, rank 1])]; capacity None = dynamic."""
    calls = []
    for cap in (None, 64):
        tag = "dyn" if cap is None else f"cap{cap}"
        calls.append((f"random-{tag}", cap, "auto", [random_inputs(10, 9), random_inputs(11, 13)]))
        calls.append((f"adversarial-{tag}", cap, "auto", [adversarial_inputs(20, 6), adversarial_inputs(21, 7)]))
        # every token of both ranks routed to rank 0's experts: rank 1 receives nothing
        calls.append((f"all-to-rank0-{tag}", cap, "auto",
                      [random_inputs(30, 5, k=3, lo=0, hi=4), random_inputs(31, 6, k=3, lo=0, hi=4)]))
        # rank 1 has no tokens at all
        calls.append((f"empty-rank1-{tag}", cap, "auto", [random_inputs(40, 6), random_inputs(41, 0)]))
    calls.append(("random-dyn-allgather", None, "all_gather", [random_inputs(10, 9), random_inputs(11, 13)]))
    calls.append(("random-cap64-allgather", 64, "all_gather", [random_inputs(10, 9), random_inputs(11, 13)]))
    # victim-in-batch: the victim is token 0 of rank 0's seed-50 batch; both ranks' batch sizes vary
    vx, vw, vids = random_inputs(50, 1)
    for cap in (None, 96):
        for T0, pos in ((1, 0), (6, 3), (12, 11)):
            for T1 in (0, 1, 7, 20):
                x0, w0, i0 = random_inputs(100 + T0 * 7 + T1, T0)
                x0[pos], w0[pos], i0[pos] = vx[0], vw[0], vids[0]
                calls.append((f"victim-T0={T0}-pos={pos}-T1={T1}-cap={cap}", cap, "auto",
                              [(x0, w0, i0), random_inputs(200 + T1 * 3 + T0, T1)]))
    return calls


def control_partial_sums(y, plan, weights, ids, partial_dtype=None):
    """Negative control: reduce-scatter style, per destination rank a partial sum over that rank's slots (in
    slot order, FP32), then the partials added in rank order. ``partial_dtype`` (e.g. BF16): each partial is
    rounded to it first, as a combine that reduces on the expert side and returns that dtype."""
    T, k = ids.shape
    w = torch.where(ids >= 0, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    out = torch.zeros((T, y.shape[1]), dtype=torch.float32, device=y.device)
    for d in range(plan.ep_size):
        part = torch.zeros((T, y.shape[1]), dtype=torch.float32, device=y.device)
        for j in range(k):
            on = (plan.owner[:, j] == d)[:, None]
            term = w[:, j : j + 1] * y[plan.dest[:, j]].to(torch.float32)
            part = torch.where(on, part + term, part)
        out = out + (part if partial_dtype is None else part.to(partial_dtype).to(torch.float32))
    return out


def worker(rank, store_path, out_dir):
    import torch.distributed as dist

    from zerodiff.ops import expert_parallel as ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        experts = make_experts()
        mine = ep.local_experts(experts, WORLD, rank)
        movers = {"auto": ep.TorchDistributedMover(), "all_gather": ep.TorchDistributedMover(mode="all_gather")}
        res = {"mode": movers["auto"].mode, "probe_error": movers["auto"].probe_error, "calls": {}}
        for label, cap, mode, per_rank in build_calls():
            x, w, ids = per_rank[rank]
            mover = movers[mode]
            plan = ep.plan_ep_dispatch(ids, E, WORLD, rank, capacity=cap)
            out = ep.ep_moe_experts(x, w, ids, mine, plan, mover, backend=BACKEND)
            y = ep.ep_expert_rows(x, ids, mine, plan, mover, backend=BACKEND)
            # metadata: what this rank receives, and the round trip back to the sender
            splits = plan.split_sizes()
            recv = splits if cap is not None else [int(c) for c in mover.exchange_counts(plan.send_counts)]
            rmeta = mover.exchange(plan.send_meta, splits, recv)
            rx = mover.exchange(torch.where((plan.send_meta[:, :1] >= 0),
                                            x[plan.send_meta[:, 0].clamp(min=0)] if x.shape[0] else
                                            torch.zeros((plan.send_rows, H), dtype=x.dtype),
                                            torch.zeros((), dtype=x.dtype)), splits, recv)
            back = mover.exchange(rmeta, recv, splits)
            res["calls"][label] = dict(out=out, control=control_partial_sums(y, plan, w, ids), rmeta=rmeta,
                                       rx=rx, recv_splits=recv, meta_round_trip=bool(torch.equal(back, plan.send_meta)))
        # capacity overflow must raise on the rank that overflows (before any collective of that call)
        x, w, ids = random_inputs(60, 8, k=4, lo=0, hi=4) if rank == 0 else random_inputs(61, 8)
        try:
            ep.plan_ep_dispatch(ids, E, WORLD, rank, capacity=5)
            res["overflow"] = ""
        except Exception as ex:  # noqa: BLE001 - the test checks the type and message
            res["overflow"] = f"{type(ex).__name__}: {ex}"
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
