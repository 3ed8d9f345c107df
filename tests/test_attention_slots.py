"""The one block-table slot resolution of the attention backends (``zerodiff.ops.block_slots``): the Triton
device function against its torch twin, bit for bit, on adversarial block tables (holes, negative and
out-of-range block ids, positions past the table, -1 / -2 entries, a zero-width table, block sizes that are not
powers of two, int32 and int64 positions); the twin against a plain Python loop; and the readers built on it
(the translation kernel, the in-register FP8 reader) agreeing with it."""

import pytest
import torch
from attention_inputs import SMALL, small_cache
from bitwise import assert_bitwise_equal

from zerodiff._triton import HAVE_TRITON, triton_usable_for
from zerodiff.ops.attention import flashmla_fp8 as fd
from zerodiff.ops.block_slots import resolve_slots_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not (HAVE_TRITON and triton_usable_for(torch.device(DEVICE))),
                                  reason="Triton cannot run here (CPU needs TRITON_INTERPRET=1)")

#: (block_size, num_blocks, requests, table width): power-of-two and odd block sizes, a zero-width table
TABLES = [(8, 40, 3, 6), (6, 13, 4, 5), (64, 7, 2, 3), (1, 9, 2, 12), (4, 5, 2, 0)]
#: the position dtypes the readers resolve in (int32: translation and pipelined reads; int64: the others)
POS_DTYPES = [torch.int32, torch.int64]

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from zerodiff.ops.block_slots import resolve_slots

    @triton.jit
    def _slots_kernel(pos_ptr, req_ptr, bt_ptr, bt_s0, slot_ptr, ok_ptr, valid_ptr, K, num_blocks, max_blocks,
                      BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK_K)
        inside = offs < K
        p = tl.load(pos_ptr + r * K + offs, mask=inside, other=-1)
        req = tl.load(req_ptr + r).to(tl.int64)
        slot, ok, valid = resolve_slots(bt_ptr, bt_s0, req, p, num_blocks, max_blocks, BLOCK_SIZE)
        tl.store(slot_ptr + r * K + offs, tl.where(ok, slot, -1).to(tl.int64), mask=inside)
        tl.store(ok_ptr + r * K + offs, ok.to(tl.int32), mask=inside)
        tl.store(valid_ptr + r * K + offs, valid.to(tl.int32), mask=inside)


def _adversarial(seed, bs, nb, B, mb, K=37, Q=9):
    g = torch.Generator().manual_seed(seed)
    bt = torch.randint(0, nb, (B, mb), generator=g, dtype=torch.int32)
    if mb:
        bt[0, mb // 2] = -1  # a hole
        bt[1 % B, 0] = nb  # one past the last block
        bt[-1, -1] = -5  # a negative id other than -1
        bt[-1, 0] = 2**31 - 1  # far out of range
    req = torch.randint(0, B, (Q,), generator=g, dtype=torch.int32)
    pos = torch.randint(-3, (mb + 2) * bs, (Q, K), generator=g, dtype=torch.int32)
    pos[0, :] = -1  # an empty row
    pos[1, ::2] = torch.arange(0, K, 2, dtype=torch.int32)[: pos[1, ::2].numel()] % max(mb * bs, 1)
    pos[2, 3] = mb * bs  # just past the table
    pos[2, 4] = 2**31 - 1  # far past it
    pos[3, 5] = -2
    return bt, req, pos


def _triton_slots(bt, req, pos, nb, bs):
    Q, K = pos.shape
    dev = torch.device(DEVICE)
    bt_d = bt.to(dev) if bt.shape[1] else torch.full((bt.shape[0], 1), -1, dtype=torch.int32, device=dev)
    out = torch.empty(Q, K, dtype=torch.int64, device=dev)
    ok = torch.empty(Q, K, dtype=torch.int32, device=dev)
    valid = torch.empty(Q, K, dtype=torch.int32, device=dev)
    _slots_kernel[(Q,)](pos.to(dev).contiguous(), req.to(dev), bt_d, bt_d.stride(0), out, ok, valid, K, nb,
                        bt.shape[1], BLOCK_SIZE=bs, BLOCK_K=triton.next_power_of_2(K))
    return out.cpu(), ok.cpu().bool(), valid.cpu().bool()


@needs_triton
@pytest.mark.parametrize("dtype", POS_DTYPES)
@pytest.mark.parametrize("table", TABLES)
def test_device_function_equals_torch_twin_bitwise(table, dtype):
    bs, nb, B, mb = table
    for seed in range(3):
        bt, req, pos = _adversarial(seed, bs, nb, B, mb)
        got = _triton_slots(bt, req, pos.to(dtype), nb, bs)
        want = resolve_slots_torch(bt, req, pos.to(dtype), nb, bs)
        for name, a, b in zip(("slot", "ok", "valid"), got, want):
            assert_bitwise_equal(a, b, f"{name} (table {table}, {dtype}, seed {seed})")


@pytest.mark.parametrize("table", TABLES)
def test_torch_twin_equals_the_rule_written_out(table):
    """slot = block_table[req, p // bs] * bs + p % bs where p >= 0, p // bs < width and the id is in [0, nb)."""
    bs, nb, B, mb = table
    bt, req, pos = _adversarial(7, bs, nb, B, mb)
    slot, ok, valid = resolve_slots_torch(bt, req, pos, nb, bs)
    for r in range(pos.shape[0]):
        for j in range(pos.shape[1]):
            p = int(pos[r, j])
            v = p >= 0
            blk = int(bt[int(req[r]), p // bs]) if v and p // bs < mb else -1
            good = v and 0 <= blk < nb
            assert bool(valid[r, j]) == v and bool(ok[r, j]) == good, (r, j, p, blk)
            assert int(slot[r, j]) == (blk * bs + p % bs if good else -1), (r, j, p, blk)


@needs_triton
def test_translation_kernel_uses_the_rule():
    """The position translation of ``flashmla_fp8`` (Triton) == the twin's slots, and its row flags == rows holding
    a valid-but-unresolvable position or an entry below -1."""
    bs, nb, B, mb = 8, 40, 3, 6
    bt, req, pos = _adversarial(3, bs, nb, B, mb, K=600)
    dev = torch.device(DEVICE)
    idx, bad = fd.translate_positions(bt.to(dev), req.to(dev), pos.to(dev), nb, bs)
    slot, ok, valid = resolve_slots_torch(bt, req, pos, nb, bs)
    assert_bitwise_equal(idx.cpu(), slot.to(torch.int32))
    assert_bitwise_equal(bad.cpu(), ((valid & ~ok) | (pos < -1)).any(dim=1).to(torch.int32))


@needs_triton
def test_in_register_reader_poisons_exactly_the_unresolvable_rows(seeded):
    """The split reader (``check=False``) makes a row NaN exactly where the twin finds a valid position it cannot
    resolve; every other row is finite."""
    from zerodiff.ops.attention import triton_split as ts

    g = seeded()
    cache, bt = small_cache(g, [20, 13], SMALL)
    bt = bt.clone()
    bt[1, 1] = -1  # a hole in request 1
    Q, W, H = 6, 16, 4
    req = torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.int32)
    pos = torch.randint(0, 13, (Q, W), generator=g, dtype=torch.int32)
    pos[0, 3] = bt.shape[1] * 8 + 1  # past the table
    pos[2, :] = -1
    pos[3, ::3] = -1
    q = torch.randn(Q, H, 144, generator=g).to(torch.bfloat16)
    dev = torch.device(DEVICE)
    o, _ = ts.sparse_mla_attention_fp8_split(q.to(dev), cache.to(dev), bt.to(dev), req.to(dev), pos.to(dev), 0.1,
                                             check=False, **SMALL)
    _slot, ok, valid = resolve_slots_torch(bt, req, pos, cache.shape[0], cache.shape[1])
    poisoned = (valid & ~ok).any(dim=1)
    assert poisoned.tolist() == [bool(o[r].isnan().any()) for r in range(Q)]
    assert bool(poisoned[0]) and not bool(poisoned[2])
