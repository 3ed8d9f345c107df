"""The harness model's ops with the routed experts spread over an expert-parallel group.

Public API::

    ExpertParallelOps(cfg, *, ep_size, rank, mover, capacity=None, graph_capacity=None)   (a ConsistentOps)
    ops.ep_calls -> int   (MoE layers this instance has run; every rank must reach the same count)

``ExpertParallelOps`` is :class:`zerodiff.model.ops.ConsistentOps` except for the routed experts of every MoE
layer: the rank holds the whole expert stack of the deployment but runs only its contiguous slice
(:func:`zerodiff.ops.expert_parallel.local_experts`); each (token, slot) row travels to the rank that owns the
slot's expert with its routing metadata, comes back, and is combined on the token's rank in FP32 in slot order
(:func:`zerodiff.ops.expert_parallel.ep_moe_experts`). The shared expert, the router, attention and everything
else run locally, exactly as in ``ConsistentOps``.

Numerical contract: a token's logits and log-probs under ``ExpertParallelOps`` at any ``ep_size`` are bitwise
those of ``ConsistentOps`` (EP = 1) on the same token, whatever the other ranks' batches hold: the mover only
moves bytes, the expert rows are row independent, and the combine is EP = 1's slot-order FP32 sum. On CUDA that
is ``zerodiff.ops.moe.moe_experts`` with the contiguous layout (eager steps and training). ``capacity`` (rows
per destination rank) makes every call static (every rank moves ``ep_size * capacity`` rows, no count exchange);
``None`` exchanges the counts first (a host sync). Captured decode graphs (``graph_safe``) use ``graph_capacity``,
which must be the same on every rank and cover the largest padded graph batch (``S * min(k, E / ep_size)`` never
overflows); a capacity that overflows raises ``InputError`` naming it.

Failure modes: the expert count not divisible by ``ep_size``, or a mover whose group size differs from
``ep_size``, raise at the first MoE layer (``InputError`` / ``RuntimeError``); ranks that run different numbers
of MoE layers deadlock in the mover's collectives (the caller keeps ranks in lockstep, e.g. by running a padding
step on a rank that has no tokens). Inference only: the training side (the tape) runs ``ConsistentOps``.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..ops import expert_parallel as _ep
from ..ops import moe as _moe_op
from .ops import ConsistentOps, _cuda

__all__ = ["ExpertParallelOps"]


class ExpertParallelOps(ConsistentOps):
    """ConsistentOps whose routed experts run on an expert-parallel group (see the module docstring)."""

    name = "consistent_ep"
    side = "rollout"

    def __init__(self, cfg, *, ep_size: int, rank: int, mover, capacity: int | None = None,
                 graph_capacity: int | None = None):
        super().__init__(cfg)
        if int(ep_size) < 1 or not 0 <= int(rank) < int(ep_size):
            raise InputError(f"zerodiff ExpertParallelOps: rank={rank} is not in [0, ep_size={ep_size})")
        for name, c in (("capacity", capacity), ("graph_capacity", graph_capacity)):
            if c is not None and int(c) < 1:
                raise InputError(f"zerodiff ExpertParallelOps: {name}={c} (a positive row count or None)")
        self.ep_size = int(ep_size)
        self.rank = int(rank)
        self.mover = mover
        self.capacity = None if capacity is None else int(capacity)
        self.graph_capacity = None if graph_capacity is None else int(graph_capacity)
        self.ep_calls = 0

    def kernel_moe_visible(self, x, wts, ids, w13, w2, s13, s2):
        """MoE block value: routed experts over the EP group, combined on this rank in FP32 in slot order, plus
        the local shared expert in FP32, one rounding to BF16 (ConsistentOps' arithmetic)."""
        if self.grad:
            raise InputError("zerodiff ExpertParallelOps: inference only; the training forward runs ConsistentOps")
        experts = _ep.local_experts(_moe_op.MoEWeights(w13, w2), self.ep_size, self.rank)
        cap = self.graph_capacity if self.graph_safe else self.capacity
        if cap is None and self.graph_safe:
            raise InputError("zerodiff ExpertParallelOps: CUDA-graph decode needs a static graph_capacity (None "
                             "exchanges counts, a host sync)")
        plan = _ep.plan_ep_dispatch(ids, int(w13.q.shape[0]), self.ep_size, self.rank, cap)
        backend = None if _cuda(x) else "reference"
        # captured decode steps: the received rows grouped per local expert in the masked layout with a static
        # capacity (every received row could be one expert's), no host sync
        grouping = dict(layout="masked", expert_capacity=self.ep_size * cap) if self.graph_safe else {}
        routed = _ep.ep_moe_experts(x, wts, ids, experts, plan, self.mover, backend=backend, **grouping)
        self.ep_calls += 1
        shared = self._expert_visible(x, s13, s2).float()
        return (routed + shared).to(torch.bfloat16)
