"""Expert-parallel MoE dispatch and combine whose values do not depend on the EP degree.

Public API::

    plan_ep_dispatch(ids, num_experts, ep_size, rank, capacity=None, *, validate=False) -> ExpertParallelPlan
    ExpertParallelPlan: ep_size, rank, num_experts, experts_per_rank, capacity, T, k,
        owner [T, k] int64 (destination rank of slot (t, j); -1 for ids == -1),
        send_counts [ep_size] int64 (valid rows per destination), send_rows (rows of the send buffer),
        send_flat [send_rows] int64 (t * k + j of each send row; -1 on padding rows),
        send_meta [send_rows, 3] int64 (source token, slot, local expert id; -1 on padding rows),
        dest [T, k] int64 (send-buffer row of slot (t, j); send_rows, the dump row, for ids == -1),
        expert_range(r) -> (first, end) of rank r's experts, split_sizes() -> per-destination rows
    TorchDistributedMover(group=None, mode="auto"|"all_to_all"|"all_gather")   (torch.distributed)
    DeepEPMover(...)                                                           (DeepEP low-latency; see below)
    mover.exchange(send [N, ...], send_splits, recv_splits) -> recv [sum(recv_splits), ...]
    mover.exchange_counts(send_counts [ep] int64) -> recv_counts [ep] int64
    ep_expert_rows(x, ids, experts_local, plan, mover, *, clamp_limit=None, backend=None, act_backend=None,
                   layout="contiguous", expert_capacity=None)
        -> y bf16 [send_rows + 1, H]   (y[plan.dest[t, j]] = expert output of slot (t, j); last row zero)
    ep_moe_experts(x, weights, ids, experts_local, plan, mover, *, clamp_limit=None, backend=None,
                   act_backend=None, layout="contiguous", expert_capacity=None) -> fp32 [T, H]
    local_experts(experts, ep_size, rank) -> MoEWeights   (rank's contiguous slice of the stacked experts)

Recipe (TP = 1). Experts are split into ``ep_size`` contiguous ranges of ``E / ep_size`` experts (rank r owns
``[r * E / ep_size, (r + 1) * E / ep_size)``; ``E`` must divide evenly). Each rank owns its tokens. For every
(token, slot) the owner rank of the slot's expert is its destination; the send buffer holds one BF16 row of
``x`` per valid (token, slot), ordered by (destination rank, token, slot), and a metadata row (source token
index, slot index, local expert id) travels WITH it. The receiving rank runs its local experts on the rows it
received (:func:`zerodiff.ops.moe.expert_rows`, ``k = 1``, the local expert ids, contiguous layout; masked with a
static capacity in captured graphs), sends the ``[rows, H]`` BF16 expert outputs back along the reversed splits,
and the token's owner combines them
with :func:`zerodiff.ops.moe.combine`: ``acc = +0; acc = acc + fp32(w[t, j]) * fp32(y_j)`` for
``j = 0..k-1`` in slot order, in FP32. That is exactly what EP = 1 computes, so EP = 2 and EP = 1 give the
same bits.

Numerical contract: ``ep_moe_experts(...)[t]`` is bitwise ``moe.moe_experts(x, weights, ids, experts)[t]``
(EP = 1, contiguous layout, same backend) for every ep_size, rank, capacity and every batch on the other
ranks. Reasons: (1) the mover only moves bytes (tensors are sent as ``uint8`` views; no reduction, no
dtype conversion, no arithmetic in the mover); (2) the per-row expert computation is row independent:
``quant_act`` is per token, the grouped FP8 GEMM's row result does not depend on the segment's other rows
(Triton: one fixed K loop per row tile; CPU reference: exact FP64 block products, the order of the sum
cannot change them), SiLU*mul->FP8 is per row, and an expert's position in the local stack does not enter
the math; (3) the combine runs on the owner in slot order with the same weights. Slots with ``ids == -1``
are not sent; they read the zero dump row with weight 0, as in EP = 1.

Modes:

* dynamic (``capacity=None``, training): each rank sends exactly its valid rows; the per-destination counts
  are exchanged first (:meth:`exchange_counts`, one small all-to-all), then the rows. Shapes depend on the
  routing (host sync on the counts).
* static (``capacity=C``, rollout): the send buffer always has ``ep_size * C`` rows, ``C`` per destination,
  padded with zero rows whose metadata is -1 (the receiver routes them to the dump row); every split is
  ``C`` so no counts are exchanged and all ranks move the same shape in lockstep (CUDA-graph friendly:
  shapes never depend on the batch contents). A destination needing more than ``C`` rows raises
  ``InputError`` naming the capacity (never a silent drop). The check is a host sync; it is skipped when
  overflow is impossible, i.e. ``C >= T * min(k, E / ep_size)`` (a token reaches a rank at most
  ``min(k, E / ep_size)`` times), which is the graph-safe setting.

Movers:

* :class:`TorchDistributedMover` uses ``torch.distributed.all_to_all_single`` with split sizes. Some backends
  lack all-to-all (gloo builds without it raise on ``all_to_all_single``); ``mode="auto"`` probes once at
  construction (a collective: every rank of the group must construct the mover together) and, when the probe
  raises, falls back to ``all_gather`` of every rank's send buffer (padded to the largest) plus its split
  sizes, and each rank selects the rows addressed to it. ``mover.mode`` says which one is in use. Both modes
  move the same bytes to the same places.
* :class:`DeepEPMover`: DeepEP low-latency buffers. Not wired: DeepEP's low-latency combine performs the
  weighted reduction inside its kernel and returns BF16 (a rounding before the shared expert is added), which
  is not :func:`zerodiff.ops.moe.combine`'s FP32 result; a mover here may only move data.
  Constructing it raises ``RuntimeError`` naming the setting when ``deep_ep`` is not installed, and
  ``NotImplementedError`` otherwise.

Failure modes: ``InputError`` for ``num_experts % ep_size != 0``, a rank outside ``[0, ep_size)``, bad
shapes/dtypes, ids outside ``[-1, E)`` (checked with ``validate=True``), local experts whose count is not
``E / ep_size``, capacity overflow; ``RuntimeError`` when the mover's group size differs from
``plan.ep_size``. All ranks must call :func:`ep_moe_experts` the same number of times in the same order
(collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from . import moe as _moe
from .moe import MoEWeights

__all__ = ["ExpertParallelPlan", "plan_ep_dispatch", "TorchDistributedMover", "DeepEPMover", "ep_expert_rows",
           "ep_moe_experts", "local_experts"]


@dataclass
class ExpertParallelPlan:
    """Where each (token, slot) of this rank goes (see the module docstring for the fields)."""

    ep_size: int
    rank: int
    num_experts: int
    experts_per_rank: int
    capacity: int | None
    T: int
    k: int
    owner: torch.Tensor
    send_counts: torch.Tensor
    send_rows: int
    send_flat: torch.Tensor
    send_meta: torch.Tensor
    dest: torch.Tensor

    def expert_range(self, r: int) -> tuple[int, int]:
        return r * self.experts_per_rank, (r + 1) * self.experts_per_rank

    def split_sizes(self) -> list[int]:
        """Rows sent to each destination rank (``capacity`` each in static mode)."""
        if self.capacity is not None:
            return [self.capacity] * self.ep_size
        return [int(c) for c in self.send_counts.tolist()]


def plan_ep_dispatch(ids: torch.Tensor, num_experts: int, ep_size: int, rank: int,
                     capacity: int | None = None, *, validate: bool = False) -> ExpertParallelPlan:
    """Plan this rank's dispatch: destination rank per (token, slot), send order (destination, token, slot),
    metadata rows, and the static-capacity padding. Raises ``InputError`` on overflow (naming the capacity).
    Device ops only in static mode with ``capacity >= T * min(k, E / ep_size)``; ``validate=True`` also checks
    that ids lie in ``[-1, E)`` (a host sync)."""
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise InputError(f"zerodiff.expert_parallel: ids must be int32/int64 [T, k], got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    E, P, r = int(num_experts), int(ep_size), int(rank)
    if P < 1 or E < 1 or E % P:
        raise InputError(f"zerodiff.expert_parallel: num_experts={E} must split evenly into ep_size={P} "
                         "contiguous ranges")
    if not 0 <= r < P:
        raise InputError(f"zerodiff.expert_parallel: rank={r} outside [0, ep_size={P})")
    T, k = ids.shape
    dev = ids.device
    epr = E // P
    flat = ids.reshape(-1).to(torch.int64)
    if validate and flat.numel() and (bool((flat >= E).any()) or bool((flat < -1).any())):
        raise InputError(f"zerodiff.expert_parallel: ids must lie in [-1, num_experts={E})")
    valid = flat >= 0
    owner = torch.where(valid, flat // epr, torch.full_like(flat, -1))
    key = torch.where(valid, owner, torch.full_like(flat, P))  # invalid slots sort last, never sent
    order = torch.argsort(key, stable=True)  # stable: inside a destination, (token, slot) order
    counts_all = torch.zeros(P + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    send_counts = counts_all[:P]
    starts = torch.cumsum(counts_all, 0) - counts_all
    pos_sorted = torch.arange(T * k, device=dev) - starts[key[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted  # rank of the slot inside its destination's block
    if capacity is None:
        row = starts[key] + pos
        send_rows = int(send_counts.sum())
    else:
        C = int(capacity)
        if C < 0:
            raise InputError(f"zerodiff.expert_parallel: capacity={capacity!r} must be >= 0")
        if C < T * min(k, epr) and P:
            cmax = int(send_counts.max())
            if cmax > C:
                d = int(torch.argmax(send_counts))
                raise InputError(f"zerodiff.expert_parallel: static capacity overflow: rank {r} sends {cmax} rows "
                                 f"to rank {d} but capacity={C}; raise capacity (capacity >= T * min(k, E / ep_size)"
                                 f" = {T * min(k, epr)} can never overflow)")
        row = key * C + pos
        send_rows = P * C
    row = torch.where(valid, row, torch.full_like(row, send_rows))
    send_flat = torch.full((send_rows + 1,), -1, dtype=torch.int64, device=dev)
    send_flat[row] = torch.arange(T * k, device=dev)
    send_flat = send_flat[:send_rows]
    sf = send_flat.clamp(min=0)
    meta = torch.stack([sf // max(k, 1), sf % max(k, 1), flat[sf] - owner[sf] * epr], dim=1) if T * k else \
        torch.zeros((send_rows, 3), dtype=torch.int64, device=dev)
    meta = torch.where((send_flat >= 0)[:, None], meta, torch.full_like(meta, -1))
    return ExpertParallelPlan(P, r, E, epr, None if capacity is None else int(capacity), T, k,
                              owner.reshape(T, k), send_counts, send_rows, send_flat, meta.contiguous(),
                              row.reshape(T, k))


# ------------------------------------------------------------------------------------------------ movers
def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> uint8 [N, row_bytes] view (the mover moves bytes only)."""
    t = t.contiguous()
    n = t.shape[0]
    nb = t.element_size()
    for d in t.shape[1:]:
        nb *= int(d)
    if t.numel() == 0:  # the row width comes from the shape, also with zero rows (the peers' splits use it)
        return torch.empty((n, nb), dtype=torch.uint8, device=t.device)
    return t.view(torch.uint8).reshape(n, nb)


class TorchDistributedMover:
    """All-to-all over a ``torch.distributed`` group; moves bytes, never reduces (see module docstring)."""

    def __init__(self, group=None, mode: str = "auto"):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("zerodiff.expert_parallel: torch.distributed is not initialised")
        if mode not in ("auto", "all_to_all", "all_gather"):
            raise InputError(f"zerodiff.expert_parallel: mode={mode!r} (auto, all_to_all or all_gather)")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        self.mode = mode
        self.probe_error = ""
        if mode == "auto":
            self.mode = "all_to_all"
            try:
                probe = torch.zeros(self.size, dtype=torch.uint8, device=self.device)
                dist.all_to_all_single(torch.empty_like(probe), probe, group=group)
            except (RuntimeError, NotImplementedError, ValueError) as ex:
                self.mode = "all_gather"
                self.probe_error = f"{type(ex).__name__}: {ex}"

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """``recv[s]`` = rows rank s sends to this rank."""
        c = send_counts.to(torch.int64).reshape(self.size, 1).to(self.device)
        return self.exchange(c, [1] * self.size, [1] * self.size).reshape(self.size)

    def exchange(self, send: torch.Tensor, send_splits, recv_splits) -> torch.Tensor:
        """Rows ``send[off_d : off_d + send_splits[d]]`` go to rank d; returns the rows received, grouped by
        source rank in rank order (``recv_splits[s]`` from rank s). Bytes only."""
        import torch.distributed as dist

        send_splits = [int(s) for s in send_splits]
        recv_splits = [int(s) for s in recv_splits]
        if len(send_splits) != self.size or len(recv_splits) != self.size or sum(send_splits) != send.shape[0]:
            raise InputError(f"zerodiff.expert_parallel: split sizes {send_splits} / {recv_splits} do not match "
                             f"the group size {self.size} and {send.shape[0]} rows")
        tail = tuple(send.shape[1:])
        b = _as_bytes(send.to(self.device))
        nb = b.shape[1]
        out = torch.empty((sum(recv_splits), nb), dtype=torch.uint8, device=self.device)
        if self.mode == "all_to_all":
            # always called (a collective), also when this rank sends and receives nothing
            dist.all_to_all_single(out, b, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                   group=self.group)
        else:
            out = self._gather_select(b, send_splits, nb)
            if out.shape[0] != sum(recv_splits):
                raise RuntimeError(f"zerodiff.expert_parallel: received {out.shape[0]} rows, expected "
                                   f"{sum(recv_splits)}")
        if out.numel() == 0:
            return torch.empty((out.shape[0],) + tail, dtype=send.dtype, device=self.device)
        return out.view(send.dtype).reshape((out.shape[0],) + tail)

    def _gather_select(self, b, send_splits, nb):
        import torch.distributed as dist

        P = self.size
        splits = torch.tensor(send_splits, dtype=torch.int64, device=self.device)
        all_splits = [torch.empty_like(splits) for _ in range(P)]
        dist.all_gather(all_splits, splits, group=self.group)
        all_splits = [s.tolist() for s in all_splits]
        nmax = max(sum(s) for s in all_splits)
        pad = torch.zeros((nmax, nb), dtype=torch.uint8, device=self.device)
        pad[: b.shape[0]] = b
        bufs = [torch.empty_like(pad) for _ in range(P)]
        if nmax and nb:
            dist.all_gather(bufs, pad, group=self.group)
        parts = []
        for s in range(P):
            off = sum(all_splits[s][: self.rank])
            parts.append(bufs[s][off : off + all_splits[s][self.rank]])
        return torch.cat(parts, 0) if parts else pad[:0]


class DeepEPMover:
    """DeepEP low-latency buffers as the data mover: not wired (see module docstring)."""

    def __init__(self, *args, **kwargs):
        try:
            import deep_ep  # noqa: F401
        except ImportError as ex:
            raise RuntimeError("zerodiff.expert_parallel: DeepEPMover needs the deep_ep package (the DeepEP "
                               "low-latency kernels behind vLLM's all2all_backend='deepep_low_latency'); it is "
                               f"not installed ({ex}). Use TorchDistributedMover.") from ex
        raise NotImplementedError("zerodiff.expert_parallel: DeepEPMover is not wired: DeepEP's low-latency "
                                  "combine reduces the expert outputs with the top-k weights inside its kernel "
                                  "and returns BF16, not the owner's FP32 slot-order combine "
                                  "(zerodiff.ops.moe.combine). Use TorchDistributedMover.")


# ------------------------------------------------------------------------------------------------ experts
def local_experts(experts: MoEWeights, ep_size: int, rank: int) -> MoEWeights:
    """Rank ``rank``'s contiguous slice ``[rank * E / ep_size, (rank + 1) * E / ep_size)`` (views, same bits)."""
    from .fp8_quant import Fp8Weight

    E = experts.num_experts
    if E % ep_size or not 0 <= rank < ep_size:
        raise InputError(f"zerodiff.expert_parallel: cannot slice E={E} experts for ep_size={ep_size}, rank={rank}")
    n = E // ep_size
    sl = slice(rank * n, (rank + 1) * n)
    return MoEWeights(Fp8Weight(experts.w13.q[sl], experts.w13.scale[sl], experts.w13.ue8m0),
                      Fp8Weight(experts.w2.q[sl], experts.w2.scale[sl], experts.w2.ue8m0))


def ep_expert_rows(x: torch.Tensor, ids: torch.Tensor, experts_local: MoEWeights, plan: ExpertParallelPlan,
                   mover, *, clamp_limit=None, backend=None, act_backend=None, layout: str = "contiguous",
                   expert_capacity=None) -> torch.Tensor:
    """Dispatch, run the local experts, return the outputs: bf16 [send_rows + 1, H], row ``plan.dest[t, j]``
    = expert output of slot (t, j) (bitwise EP = 1's), last row zero (the dump row). ``layout`` /
    ``expert_capacity``: how the received rows are grouped per local expert (``zerodiff.ops.moe.expert_rows``;
    "masked" with a static ``expert_capacity``, e.g. ``ep_size * capacity``, has no host sync: CUDA graphs)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[0] != plan.T:
        raise InputError(f"zerodiff.expert_parallel: x must be bf16 [T={plan.T}, H], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if tuple(ids.shape) != (plan.T, plan.k):
        raise InputError(f"zerodiff.expert_parallel: ids {tuple(ids.shape)} is not the planned [{plan.T}, {plan.k}]")
    if not isinstance(experts_local, MoEWeights) or experts_local.num_experts != plan.experts_per_rank:
        raise InputError(f"zerodiff.expert_parallel: experts_local must be a MoEWeights of E / ep_size = "
                         f"{plan.experts_per_rank} experts (see local_experts)")
    if getattr(mover, "size", plan.ep_size) != plan.ep_size:
        raise RuntimeError(f"zerodiff.expert_parallel: the mover's group has {mover.size} ranks, the plan "
                           f"{plan.ep_size}")
    H = x.shape[1]
    dev = x.device
    # send buffer: BF16 rows in (destination, token, slot) order; padding rows zero
    tok = plan.send_meta[:, 0]
    xs = torch.where((tok >= 0)[:, None], x[tok.clamp(min=0)] if plan.T else
                     torch.zeros((plan.send_rows, H), dtype=x.dtype, device=dev),
                     torch.zeros((), dtype=x.dtype, device=dev))
    send_splits = plan.split_sizes()
    if plan.capacity is None:
        recv_splits = [int(c) for c in mover.exchange_counts(plan.send_counts).tolist()]
    else:
        recv_splits = send_splits
    rx = mover.exchange(xs, send_splits, recv_splits).to(dev)
    rmeta = mover.exchange(plan.send_meta, send_splits, recv_splits).to(dev)
    # the local experts on the received rows: the same per-row path as EP = 1 (k = 1, local expert ids)
    lid = rmeta[:, 2:3].to(torch.int32).contiguous()
    y_loc, lp = _moe.expert_rows(rx, lid, experts_local, layout=layout, capacity=expert_capacity,
                                 clamp_limit=clamp_limit, backend=backend, act_backend=act_backend)
    ry = y_loc[lp.dest[:, 0]] if rx.shape[0] else y_loc[:0]
    back = mover.exchange(ry, recv_splits, send_splits).to(dev)
    y = torch.zeros((plan.send_rows + 1, H), dtype=torch.bfloat16, device=dev)
    y[: plan.send_rows] = back
    return y


def ep_moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_local: MoEWeights,
                   plan: ExpertParallelPlan, mover, *, clamp_limit=None, backend=None,
                   act_backend=None, layout: str = "contiguous", expert_capacity=None) -> torch.Tensor:
    """Routed experts over EP ranks, combined on the owner in FP32 in slot order -> fp32 [T, H]; bitwise
    ``moe.moe_experts(x, weights, ids, experts)`` (see module contract)."""
    if weights.shape != ids.shape or weights.dtype != torch.float32:
        raise InputError(f"zerodiff.expert_parallel: weights must be fp32 with the shape of ids "
                         f"{tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    y = ep_expert_rows(x, ids, experts_local, plan, mover, clamp_limit=clamp_limit, backend=backend,
                       act_backend=act_backend, layout=layout, expert_capacity=expert_capacity)
    w = torch.where(ids >= 0, weights, torch.zeros((), dtype=weights.dtype, device=x.device))
    return _moe.combine(y, plan.dest, w, backend=backend)
