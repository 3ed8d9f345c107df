"""Block-table slot resolution: a request-local position -> the cache slot that holds it.

Token ``p`` of request ``req`` lives in cache block ``block_table[req, p // block_size]`` at row
``p % block_size``, so its slot (row of the ``[num_blocks * block_size, bytes]`` view) is
``block * block_size + p % block_size``. Every attention backend and the KV gather resolve positions with the one rule
written here, as a Triton device function (:func:`resolve_slots`) and as its torch twin
(:func:`resolve_slots_torch`); ``tests/test_attention_slots.py`` checks the two agree bit for bit.

* ``resolve_slots(bt_ptr, bt_s0, req, pos, num_blocks, max_blocks, BLOCK_SIZE) -> (slot, ok, valid)``
  (``@triton.jit``): ``pos`` a block of positions (any integer type; the arithmetic stays in that type, the
  block id is converted to it), ``req`` the request (scalar). ``valid = pos >= 0``; ``ok`` = valid and the
  logical block is inside the table (``< max_blocks``) and its entry is a block id in ``[0, num_blocks)``;
  ``slot`` is meaningful where ``ok`` only (callers mask it). The table is read only where
  ``valid & (logical block < max_blocks)``.
* ``resolve_slots_torch(block_table, req_ids, positions, num_blocks, block_size) -> (slot, ok, valid)``:
  the same per entry for int32 ``positions [Q, K]`` and ``req_ids [Q]``; ``slot`` int64, -1 where not ok.

What a caller does with an entry that is valid but not ok (a table hole, a position past the table, a block id
outside the cache) is its own contract: the in-register readers make the row NaN, the position translation
flags the row. Positions < -1 are not valid here; readers that refuse them do so in their host checks.
"""

from __future__ import annotations

import torch

from .._triton import HAVE_TRITON

__all__ = ["resolve_slots", "resolve_slots_torch"]

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def resolve_slots(bt_ptr, bt_s0, req, pos, num_blocks, max_blocks, BLOCK_SIZE: tl.constexpr):
        """(slot, ok, valid) of a block of request-local positions; see the module docstring."""
        valid = pos >= 0
        lb = tl.where(valid, pos // BLOCK_SIZE, 0)
        in_table = lb < max_blocks
        blk = tl.load(bt_ptr + req * bt_s0 + lb, mask=valid & in_table, other=-1).to(pos.dtype)
        ok = valid & in_table & (blk >= 0) & (blk < num_blocks)
        slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
        return slot, ok, valid


def resolve_slots_torch(block_table: torch.Tensor, req_ids: torch.Tensor, positions: torch.Tensor,
                        num_blocks: int, block_size: int):
    """Torch twin of :func:`resolve_slots` over ``positions [Q, K]``: (slot int64 [Q, K], -1 where not ok;
    ok bool [Q, K]; valid bool [Q, K])."""
    p = positions.long()
    valid = p >= 0
    lb = torch.where(valid, p // block_size, torch.zeros_like(p))
    mb = block_table.shape[1]
    in_table = lb < mb
    if mb:
        blk = block_table.long()[req_ids.long()[:, None].expand_as(p), lb.clamp(max=mb - 1)]
    else:
        blk = torch.full_like(p, -1)
    blk = torch.where(valid & in_table, blk, torch.full_like(blk, -1))
    ok = valid & in_table & (blk >= 0) & (blk < num_blocks)
    slot = torch.where(ok, blk * block_size + p % block_size, torch.full_like(p, -1))
    return slot, ok, valid
