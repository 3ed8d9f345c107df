"""FP8 MLA KV cache: write (quantise + insert) and read (dequantise + gather), reference and Triton."""

import pytest
import torch

from bitwise import assert_bitwise_equal, assert_victim_in_batch
from zerodiff.ops import kv_cache as kc
from zerodiff.reference import kv_cache as ref
from zerodiff.reference.fp8_quant import quant_per_token_group_ref

SMALL = dict(d_nope=128, d_rope=16)  # interpreter-sized layout: 128 + 4 + 32 = 164 bytes per token


def _adversarial_rows(T, d, g):
    x = torch.randn(T, d, generator=g) * torch.logspace(-6, 3, T)[:, None]
    x = x.to(torch.bfloat16)
    if T >= 6:
        x[0] = 0.0  # all zeros -> EPS scale
        x[1, : d // 2] = -0.0
        x[2] = torch.tensor(1e-40).to(torch.bfloat16)  # denormal-ish (bf16 keeps denormals)
        x[3, ::2] = 448.0
        x[3, 1::2] = -448.0  # exact ties on amax
        x[4] = torch.linspace(-3, 3, d).to(torch.bfloat16)  # plateau/ties after scaling
        x[5, 0] = 3.0e38  # huge
    return x


def test_layout_is_656_bytes():
    assert kc.bytes_per_token() == 656
    c = kc.new_kv_cache(3, 64)
    assert c.shape == (3, 64, 656) and c.dtype == torch.uint8


def test_reference_roundtrip_matches_fp8_rule(seeded):
    g = seeded()
    x = _adversarial_rows(12, 512, g)
    rope = torch.randn(12, 64, generator=g).to(torch.bfloat16)
    packed = ref.quantize_kv_ref(x, rope)
    assert packed.shape == (12, 656)
    q, s = quant_per_token_group_ref(x, 128)
    assert_bitwise_equal(packed[:, :512], q.view(torch.uint8), "packed fp8 codes")
    assert_bitwise_equal(packed[:, 512:528].contiguous().view(torch.float32), s, "packed scales")
    deq = ref.dequantize_kv_ref(packed)
    want = (q.float().reshape(12, 4, 128) * s[..., None]).reshape(12, 512).to(torch.bfloat16)
    assert_bitwise_equal(deq[:, :512], want, "dequantised nope part")
    assert_bitwise_equal(deq[:, 512:].view(torch.int16), rope.view(torch.int16), "rope part")


def _setup(g, dims, nb=10, bs=4, lens=(7, 13, 2)):
    d_nope, d_rope = dims["d_nope"], dims["d_rope"]
    B = len(lens)
    max_blocks = 5
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    bt = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used = 0
    slots, toks = [], []
    for b, L in enumerate(lens):
        nblk = (L + bs - 1) // bs
        bt[b, :nblk] = perm[used : used + nblk]
        used += nblk
        for p in range(L):
            slots.append(int(bt[b, p // bs]) * bs + p % bs)
            toks.append((b, p))
    T = len(slots)
    x = _adversarial_rows(T, d_nope, g)
    rope = (torch.randn(T, d_rope, generator=g) * 10).to(torch.bfloat16)
    return bt, torch.tensor(slots, dtype=torch.int64), toks, x, rope, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_write_then_read_returns_quantised_values(seeded, backend):
    g = seeded()
    bt, slots, toks, x, rope, lens = _setup(g, SMALL)
    cache = kc.new_kv_cache(10, 4, **SMALL)
    # skip marker: add one skipped token that must not land anywhere
    xs = torch.cat([x, torch.full((1, 128), 7.0, dtype=torch.bfloat16)])
    rs = torch.cat([rope, torch.full((1, 16), 7.0, dtype=torch.bfloat16)])
    sl = torch.cat([slots, torch.tensor([-1])])
    kc.write_kv_cache(xs, rs, cache, sl, **SMALL, backend=backend)
    # bytes at each slot == reference packing
    packed = ref.quantize_kv_ref(x, rope)
    flat = cache.view(-1, cache.shape[-1])
    assert_bitwise_equal(flat[slots], packed, "bytes at the slots")
    # untouched slots stay zero
    mask = torch.ones(flat.shape[0], dtype=torch.bool)
    mask[slots] = False
    assert int(flat[mask].abs().sum()) == 0
    # read back every token of every request, in a shuffled order, with -1 padding
    W = 16
    R = 3
    pos = torch.full((R, W), -1, dtype=torch.int32)
    for b in range(R):
        L = int(lens[b])
        pos[b, :L] = torch.randperm(L, generator=g).to(torch.int32)
    req = torch.arange(R, dtype=torch.int32)
    ws = kc.gather_kv(cache, bt, req, pos, seq_lens=lens, **SMALL, backend=backend)
    deq = ref.dequantize_kv_ref(packed, **SMALL)
    index = {t: i for i, t in enumerate(toks)}
    for b in range(R):
        for j in range(W):
            p = int(pos[b, j])
            if p < 0:
                assert int((ws[b, j] != 0).sum()) == 0
            else:
                assert_bitwise_equal(ws[b, j].view(torch.int16), deq[index[(b, p)]].view(torch.int16),
                                     f"request {b} workspace row {j} (position {p})")


def test_triton_gather_equals_reference_and_is_row_invariant(seeded):
    g = seeded()
    bt, slots, toks, x, rope, lens = _setup(g, SMALL)
    cache = kc.new_kv_cache(10, 4, **SMALL)
    kc.write_kv_cache(x, rope, cache, slots, **SMALL, backend="triton")
    R, W = 6, 20
    req = torch.tensor([0, 1, 2, 1, 0, 1], dtype=torch.int32)
    pos = torch.full((R, W), -1, dtype=torch.int32)
    for r in range(R):
        L = int(lens[req[r]])
        k = min(L, W)
        pos[r, :k] = torch.randperm(L, generator=g)[:k].to(torch.int32)
    a = kc.gather_kv(cache, bt, req, pos, **SMALL, backend="triton")
    b = kc.gather_kv(cache, bt, req, pos, **SMALL, backend="reference")
    assert_bitwise_equal(a.view(torch.int16), b.view(torch.int16), "triton vs reference gather")
    # a single row gathered alone (decode) == the same row inside the batch (prefill)
    for r in (0, 3, 5):
        one = kc.gather_kv(cache, bt, req[r : r + 1], pos[r : r + 1], **SMALL, backend="triton")
        assert_victim_in_batch(one[0].view(torch.int16), [(f"at {r} of {R}", a[r].view(torch.int16))])


def test_write_from_strided_latent_slices(seeded):
    """vLLM hands the latent as slices of one [T, d_nope + d_rope] tensor: strided rows must work."""
    g = seeded()
    kv = (torch.randn(9, 144, generator=g) * 5).to(torch.bfloat16)
    slots = torch.tensor([3, 0, 7, -1, 12, 15, 1, 2, 9])
    a = kc.new_kv_cache(4, 4, **SMALL)
    b = kc.new_kv_cache(4, 4, **SMALL)
    kc.write_kv_cache(kv[:, :128], kv[:, 128:], a, slots, **SMALL, backend="triton")
    ref.write_kv_cache_ref(kv[:, :128].contiguous(), kv[:, 128:].contiguous(), b, slots)
    assert_bitwise_equal(a, b, "strided latent slices vs contiguous reference")


def test_workspace_indices():
    pos = torch.tensor([[5, 3, -1], [0, -1, -1]], dtype=torch.int32)
    assert kc.workspace_indices(pos).tolist() == [[0, 1, -1], [3, -1, -1]]


def test_bad_inputs_raise_clear_errors(seeded):
    g = seeded()
    bt, slots, toks, x, rope, lens = _setup(g, SMALL)
    cache = kc.new_kv_cache(10, 4, **SMALL)
    kc.write_kv_cache(x, rope, cache, slots, **SMALL, backend="reference")
    req = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="slot_mapping"):
        kc.write_kv_cache(x[:1], rope[:1], cache, torch.tensor([40]), **SMALL)
    with pytest.raises(ValueError, match="uint8"):
        kc.write_kv_cache(x, rope, cache, slots)  # default 656-byte layout vs a 164-byte cache
    with pytest.raises(ValueError, match="longer than the table"):
        kc.gather_kv(cache, bt, req, torch.tensor([[20]], dtype=torch.int32), **SMALL)
    with pytest.raises(ValueError, match="hole"):
        kc.gather_kv(cache, bt, req, torch.tensor([[10]], dtype=torch.int32), **SMALL)  # block 2 of req 0 is -1
    with pytest.raises(ValueError, match="seq_lens"):
        kc.gather_kv(cache, bt, req, torch.tensor([[7]], dtype=torch.int32), seq_lens=lens, **SMALL)
    with pytest.raises(ValueError, match="< -1"):
        kc.gather_kv(cache, bt, req, torch.tensor([[-2]], dtype=torch.int32), **SMALL)
    with pytest.raises(ValueError, match="req_ids"):
        kc.gather_kv(cache, bt, torch.tensor([3], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), **SMALL)
    with pytest.raises(ValueError, match="positions must be int32"):
        kc.gather_kv(cache, bt, req, torch.tensor([[0]]), **SMALL)
    with pytest.raises(ValueError, match="d_nope"):
        kc.new_kv_cache(1, 4, d_nope=100)


def test_unchecked_hole_is_poisoned_not_silent(seeded):
    g = seeded()
    bt, slots, toks, x, rope, lens = _setup(g, SMALL)
    cache = kc.new_kv_cache(10, 4, **SMALL)
    kc.write_kv_cache(x, rope, cache, slots, **SMALL, backend="triton")
    pos = torch.tensor([[10, 0, -1]], dtype=torch.int32)  # block hole, a valid one, empty
    ws = kc.gather_kv(cache, bt, torch.tensor([0], dtype=torch.int32), pos, **SMALL, check=False, backend="triton")
    assert bool(ws[0, 0].isnan().all())
    assert not bool(ws[0, 1].isnan().any())
    assert int((ws[0, 2] != 0).sum()) == 0


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_write_and_gather_bitwise_equal_reference_full_layout():
    dev = "cuda"
    g = torch.Generator().manual_seed(1234)
    nb, bs = 64, 64
    T = 3000
    x = _adversarial_rows(T, 512, g)
    rope = torch.randn(T, 64, generator=g).to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[::97] = -1
    cache = kc.new_kv_cache(nb, bs, device=dev)
    cache_ref = cache.clone().cpu()
    kc.write_kv_cache(x.to(dev), rope.to(dev), cache, slots.to(dev), backend="triton")
    ref.write_kv_cache_ref(x, rope, cache_ref, slots)
    assert_bitwise_equal(cache.cpu(), cache_ref, "written cache")
    # one request owning all blocks in a shuffled order
    bt = torch.randperm(nb, generator=g).to(torch.int32)[None]
    R, W = 33, 2048
    pos = torch.randint(0, nb * bs, (R, W), generator=g, dtype=torch.int32)
    pos[:, -100:] = -1
    req = torch.zeros(R, dtype=torch.int32)
    a = kc.gather_kv(cache, bt.to(dev), req.to(dev), pos.to(dev), backend="triton")
    b = ref.gather_kv_ref(cache_ref, bt, req, pos)
    assert_bitwise_equal(a.cpu().view(torch.int16), b.view(torch.int16), "triton vs reference gather")
    for r in (0, 16, 32):  # decode (one row) == the row inside the batch
        one = kc.gather_kv(cache, bt.to(dev), req[r : r + 1].to(dev), pos[r : r + 1].to(dev), backend="triton")
        assert_victim_in_batch(one[0].view(torch.int16), [(f"at {r} of {R}", a[r].view(torch.int16))])
