"""Paged FP8 caches of the model (MLA latent + DSA index keys) and the block allocator.

* MLA latent: ``zerodiff.ops.kv_cache`` (the fp8_ds_mla layout: FP8 nope latent with one FP32 scale
  per 128 channels + BF16 rope), one uint8 tensor per layer. Read ONLY through ``gather_kv`` into a
  workspace of ``topk`` rows per query token (sized by the model limit, never by the batch): the one
  read path of prefill, decode and training.
* DSA index keys: on CUDA the ``zerodiff.ops.indexer`` cache; on the CPU (read by the exact-structure
  scorer of :mod:`zerodiff.model.exact_ops`) FP8 e4m3 codes ``[slots, idx_dim]`` with one FP32 scale per token,
  quantised by the rule of ``reference/fp8_quant.py`` (one group of ``idx_dim``): the same values in a different
  layout.

Rollout and training use the same class; training allocates a PRIVATE instance and writes its K through
the same FP8 round trip.
"""

from __future__ import annotations

import torch

from zerodiff.ops.kv_cache import gather_kv, new_kv_cache, write_kv_cache
from zerodiff.reference.fp8_quant import quant_per_token_group_ref

from .ops import _backend_for


class BlockAllocator:
    """LIFO free list of block ids (recycled ids differ run to run with the schedule: paging is exercised)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    def alloc(self, n: int) -> list:
        if n > len(self.free_ids):
            raise RuntimeError(f"zerodiff: KV cache out of blocks (need {n}, {len(self.free_ids)} free of "
                               f"{self.num_blocks}); raise num_blocks in the rollout config")
        return [self.free_ids.pop() for _ in range(n)]

    def free(self, ids) -> None:
        self.free_ids.extend(ids)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)


class PagedCache:
    def __init__(self, cfg, num_blocks: int, block_size: int, device="cpu"):
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv = [new_kv_cache(num_blocks, block_size, d_nope=cfg.d_latent, d_rope=cfg.d_rope, device=device)
                   for _ in range(cfg.layers)]
        slots = num_blocks * block_size
        self.idx_cache = None
        if self.device.type == "cuda":  # zerodiff.ops.indexer's FP8 index-key cache (codes | fp32 scale per token)
            from zerodiff.ops.indexer import new_index_cache

            self.idx_cache = [new_index_cache(num_blocks, block_size, d=cfg.idx_dim, device=device)
                              for _ in range(cfg.layers)]
        self.idx_q = [torch.zeros(slots, cfg.idx_dim, dtype=torch.float8_e4m3fn, device=device)
                      for _ in range(cfg.layers)]
        self.idx_s = [torch.zeros(slots, 1, dtype=torch.float32, device=device) for _ in range(cfg.layers)]
        self.allocator = BlockAllocator(num_blocks)
        self.check = True  # host-side value checks of the kv_cache op (off inside CUDA-graph capture)

    def write(self, layer: int, step, kv_nope, k_rope, idx_k) -> None:
        slots = step.slot_mapping(self.block_size)
        write_kv_cache(kv_nope.contiguous(), k_rope.contiguous(), self.kv[layer], slots,
                       d_nope=self.cfg.d_latent, d_rope=self.cfg.d_rope, check=self.check,
                       backend=_backend_for(kv_nope))
        if self.idx_cache is not None:
            from zerodiff.ops.indexer import write_index_cache

            write_index_cache(idx_k.contiguous(), self.idx_cache[layer], slots, check=self.check)
            return
        q, s = quant_per_token_group_ref(idx_k, group=self.cfg.idx_dim)
        self.idx_q[layer][slots] = q
        self.idx_s[layer][slots] = s

    def gather(self, layer: int, step, sel):
        return gather_kv(self.kv[layer], step.block_table, step.slot, sel, d_nope=self.cfg.d_latent,
                         d_rope=self.cfg.d_rope, check=self.check, backend=_backend_for(sel))

    def gather_index_keys(self, layer: int, step, W: int):
        """Index keys of positions 0..W-1 of each token's request: (codes [T, W, d], scales [T, W, 1])."""
        bs = self.block_size
        j = torch.arange(W, device=self.device)
        bt = step.block_table.long()[step.slot.long()]  # [T, max_blocks]
        blk_idx = (j // bs).clamp(max=bt.shape[1] - 1)
        blk = bt[:, blk_idx]  # [T, W]
        valid = (j[None, :] <= step.pos.long()[:, None]) & (blk >= 0) & ((j // bs) < bt.shape[1])[None, :]
        flat = torch.where(valid, blk * bs + (j % bs)[None, :], torch.zeros_like(blk))
        kq = self.idx_q[layer][flat]
        ks = self.idx_s[layer][flat]
        ks = torch.where(valid.unsqueeze(-1), ks, torch.zeros_like(ks))
        return kq, ks
