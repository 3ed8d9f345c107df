"""The shipped read path: FlashMLA's FP8 sparse decode kernel under zerodiff's fixed schedule
(``zerodiff.ops.attention.flashmla_fp8``).

CPU: the schedule table (every row reduced in the same pieces whatever the row count, every piece once, partial
slots inside the kernel's buffers; a batch-scaled schedule is caught by the same check), the position
translation kernel (interpreter) against its torch reference on adversarial positions, bad input.
GPU (H200): agreement with the float64 reference, victim-in-batch across the CTA-count and launch boundaries,
prefill rows == decode rows, CUDA-graph replay == eager, NaN poisoning of unresolvable rows, and negative
controls (the stock scheduler on the same inputs, another piece count, reversed order)."""

import math

import pytest
import torch

from zerodiff._triton import INTERPRET
from zerodiff.experimental import attention_variants as av
from zerodiff.ops import attention as sa
from zerodiff.ops import kv_cache as kc
from zerodiff.ops.attention import flashmla_fp8 as fd
from zerodiff.reference.sparse_attention import sparse_attention_ref

from flashmla_emulation import dequant_v4, install_emulation, request_cache, v4_cache

#: CTA counts of the schedule tests (H200 132 SMs, halves and quarters, another GPU's 148)
PARTS = [132, 66, 33, 148]
#: pieces per row of the emulated-kernel plumbing test
EMULATED_PIECES = [1, 2, 4]
GPU_TOPK = 2048
SC = 1 / math.sqrt(576)


def _row_pieces(meta, splits, rows, blocks):
    """row -> sorted list of (start_block, end_block, no_split); also checks coverage and slots."""
    pieces = fd.schedule_pieces(meta, splits, rows, blocks)
    per_row = {r: [] for r in range(rows)}
    slots = []
    for _cta, r, start, end, no_split, slot in pieces:
        per_row[r].append((start, end, no_split))
        if slot is not None:
            slots.append(slot)
    for r, ps in per_row.items():
        ps.sort()
        cover = [b for s, e, _ in ps for b in range(s, e)]
        assert cover == list(range(blocks)), f"row {r} not covered exactly once: {ps}"
        assert all(ns == (len(ps) == 1) for _s, _e, ns in ps), f"row {r}: split flags inconsistent {ps}"
    assert len(slots) == len(set(slots)), "two pieces write the same partial slot"
    parts = meta.shape[0]
    assert all(0 <= s < rows + parts for s in slots), "partial slot outside the kernel's rows + CTAs buffers"
    return per_row


def _invariant(schedule_fn, blocks, row_counts):
    """True when every row is reduced in the same pieces for every row count."""
    seen = None
    for rows in row_counts:
        meta, splits = schedule_fn(rows)
        per_row = _row_pieces(meta, splits, rows, blocks)
        shapes = {tuple(v) for v in per_row.values()}
        if len(shapes) != 1:
            return False
        (shape,) = shapes
        if seen is None:
            seen = shape
        elif shape != seen:
            return False
    return True


def _batch_scaled_schedule(rows, parts, blocks):
    """A schedule that uses every CTA by cutting each row into parts // rows pieces (what a load balancer does):
    the control the invariance check must reject. Built from the fixed table by cutting its rows."""
    S = max(1, min(blocks, parts // rows))
    while blocks % S:
        S -= 1
    G = blocks // S
    meta = torch.zeros(parts, fd.META_FIELDS, dtype=torch.int32)
    meta[:, 0] = rows
    meta[:, 1] = rows - 1
    for i in range(rows * S):
        r, s = divmod(i, S)
        meta[i] = torch.tensor([r, r, s * G, (s + 1) * G, s, int(S > 1), int(S > 1), 0], dtype=torch.int32)
    return meta, torch.arange(rows + 1, dtype=torch.int32) * S


@pytest.mark.parametrize("parts", PARTS)
def test_schedule_rows_are_whole_whatever_the_row_count(parts):
    blocks = 32
    counts = [1, 2, 3, parts - 1, parts, parts + 1, 2 * parts + 5, fd.rows_per_launch(1)]
    assert _invariant(lambda n: fd.fixed_schedule(n, parts, blocks, "cpu"), blocks, counts)
    # negative control: the same check rejects a schedule whose cuts follow the batch
    assert not _invariant(lambda n: _batch_scaled_schedule(n, parts, blocks), blocks, [1, 2, 3, 8])


def test_schedule_with_rows_of_their_own_lengths():
    """topk_length / an extra cache: every row whole at its own block count, whatever the row count; the count is
    the kernel's (main list at least one block, extra list rounded up on its own)."""
    tl = torch.tensor([0, 1, 64, 65, 2048, 100, 3], dtype=torch.int32)
    etl = torch.tensor([128, 0, 1, 64, 65, 127, 3], dtype=torch.int32)
    counts = fd.row_block_counts(7, 2048, tl, 128, etl)
    assert counts.tolist() == [1 + 2, 1 + 0, 1 + 1, 2 + 1, 32 + 2, 2 + 2, 1 + 1]
    assert fd.row_block_counts(3, 2048, extra_topk=128).tolist() == [34, 34, 34]
    assert fd.row_block_counts(2, 2048).tolist() == [32, 32]
    g = torch.Generator().manual_seed(3)
    pool = torch.randint(1, 40, (1100,), generator=g)
    for parts in (132, 33):
        seen = {}
        for rows in (1, 2, parts - 1, parts, parts + 1, 2 * parts + 5, 1100):
            rb = pool[:rows]
            meta, splits = fd.fixed_schedule(rows, parts, 32, "cpu", row_blocks=rb)
            per_row = {}
            for _cta, r, start, end, no_split, slot in fd.schedule_pieces(meta, splits, rows, rb.tolist()):
                per_row.setdefault(r, []).append((start, end, no_split, slot))
            for r in range(rows):
                assert per_row[r] == [(0, int(rb[r]), True, None)], (parts, rows, r, per_row.get(r))
                assert seen.setdefault(r, per_row[r]) == per_row[r]
    with pytest.raises(ValueError, match="row_blocks must have shape"):
        fd.fixed_schedule(3, 132, 32, "cpu", row_blocks=torch.ones(4, dtype=torch.int64))


def test_schedule_unused_ctas_exit_and_runs_are_contiguous():
    meta, splits = fd.fixed_schedule(5, 132, 32, "cpu")
    assert meta.dtype == torch.int32 and meta.shape == (132, fd.META_FIELDS)
    assert torch.equal(splits, torch.arange(6, dtype=torch.int32))
    assert bool((meta[5:, 0] == 5).all()), "unused CTAs must start past the last row (the kernel returns at once)"
    meta, _ = fd.fixed_schedule(1000, 132, 32, "cpu")
    b, e = meta[:, 0].long(), meta[:, 1].long()
    assert int(b[0]) == 0 and int(e[-1]) == 999 and bool((b[1:] == e[:-1] + 1).all())
    assert int((e - b + 1).max() - (e - b + 1).min()) <= 1


def test_schedule_bad_arguments():
    with pytest.raises(ValueError, match="rows=0"):
        fd.fixed_schedule(0, 132, 32, "cpu")
    with pytest.raises(ValueError, match="blocks_per_row=0"):
        fd.fixed_schedule(3, 132, 0, "cpu")
    with pytest.raises(ValueError, match=">= 1"):
        fd.rows_per_launch(0)
    assert fd.rows_per_launch(4) == fd.MAX_PAIRS_PER_LAUNCH // 4


@pytest.mark.skipif(not INTERPRET, reason="the Triton merge kernel runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("with_sink", [False, True])
def test_merge_pieces_kernel_matches_float64_reference(seeded, with_sink):
    g = seeded()
    Q, P, H, DV = 5, 4, 20, 32  # H not a multiple of the kernel's 16-head block
    o = (torch.randn(Q, P, H, DV, generator=g) * 2).to(torch.bfloat16)
    o[0, 1, 3, :4] = torch.tensor([0.0, -0.0, 1e-40, -1e-40]).to(torch.bfloat16)  # +-0 and denormals
    lse_hp = torch.randn(Q, H, P, generator=g) * 3 + 5  # the kernel's layout: [Q, H, P]
    lse_hp[1, :, 2] = math.inf  # an empty piece
    lse_hp[2] = math.inf  # an empty row
    o[1, 2] = 0
    o[2] = 0
    lse_hp[3, :, 1] = lse_hp[3, :, 0]  # tied piece lse
    sink = torch.linspace(-3, 3, H) if with_sink else None
    lse = lse_hp.transpose(1, 2)
    got_o, got_l = fd.merge_pieces(o.contiguous(), lse, sink)
    ref_o, ref_l = fd.merge_pieces_ref(o, lse, sink)
    assert torch.allclose(got_o.double(), ref_o, atol=1e-2, rtol=1.6e-2)  # bf16 rounding (interpreter truncates)
    fin = torch.isfinite(ref_l)
    assert torch.allclose(got_l.double()[fin], ref_l[fin], atol=1e-5, rtol=1e-6)
    assert bool((got_l[2] == math.inf).all()) and bool((got_o[2].float() == 0).all()), "empty row: out 0, lse +inf"
    bad = torch.zeros(Q, 3, dtype=torch.int32)  # per-chunk flags of the translation: row 3's last chunk
    bad[3, 2] = 1
    po, pl = fd.merge_pieces(o.contiguous(), lse, sink, bad)
    assert bool(torch.isnan(po[3].float()).all()) and bool(torch.isnan(pl[3]).all())
    assert torch.equal(po[4], got_o[4]) and torch.equal(pl[4], got_l[4])


def _adversarial_positions(g, Q, K, max_blocks, bs):
    pos = torch.randint(0, max_blocks * bs, (Q, K), generator=g, dtype=torch.int32)
    pos[0, ::3] = -1
    pos[1, 5] = -2  # invalid marker
    pos[2, 7] = max_blocks * bs + 3  # past the table
    pos[3, :] = -1  # empty row
    return pos


@pytest.mark.skipif(not INTERPRET, reason="the Triton translation kernel runs on the CPU only under TRITON_INTERPRET=1")
def test_translate_kernel_matches_torch_reference(seeded):
    g = seeded()
    bs, nb, B, mb = 8, 40, 3, 6
    bt = torch.randint(0, nb, (B, mb), generator=g, dtype=torch.int32)
    bt[1, 2] = -1  # hole
    bt[2, 4] = nb + 7  # out-of-range block id
    Q, K = 7, 1100  # three 512-wide chunks, the last one partial
    req = torch.randint(0, B, (Q,), generator=g, dtype=torch.int32)
    pos = _adversarial_positions(g, Q, K, mb, bs)
    pos[4, 1050] = 2 * bs + 1  # in the last chunk
    pos[4, :1050] = pos[4, :1050].clamp(max=2 * bs - 1)  # every other position of row 4 before the hole
    req[4] = 1  # position in the hole
    req[0] = 0  # row 0: a table without holes, so only its -1 entries are skipped
    got = fd.translate_positions(bt, req, pos, nb, bs)
    ref = fd._translate_torch(bt, req, pos, nb, bs)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert ref[1].tolist()[:5] == [0, 1, 1, 0, 1]
    ok = pos[0] >= 0
    expect = bt.long()[req[0].long(), pos[0].long().clamp(min=0) // bs] * bs + pos[0].long().clamp(min=0) % bs
    good = ok & (expect >= 0) & (expect < nb * bs)
    assert torch.equal(ref[0][0][good].long(), expect[good])
    assert bool((ref[0][3] == -1).all())


def test_translate_torch_reference_semantics():
    bt = torch.tensor([[4, -1, 2], [0, 1, 9]], dtype=torch.int32)
    pos = torch.tensor([[0, 3, 5, 9, -1, 17], [23, 4, 8, -1, -1, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    idx, bad = fd._translate_torch(bt, req, pos, num_blocks=5, block_size=4)
    # row 0: 0 -> blk 4 -> 16; 3 -> 19; 5 -> hole; 9 -> blk 2 -> 9; -1; 17 -> past the table
    assert idx.tolist() == [[16, 19, -1, 9, -1, -1], [-1, 4, -1, -1, -1, -1]]
    assert bad.tolist() == [1, 1]  # row 1: 23 is past the table, 8 -> block id 9 >= num_blocks


def test_pieces_env_is_validated(monkeypatch):
    monkeypatch.setenv("ZD_FLASHMLA_PIECES", "4")
    assert fd._pieces_from_env() == 4
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv("ZD_FLASHMLA_PIECES", bad)
        with pytest.raises(ValueError, match="ZD_FLASHMLA_PIECES"):
            fd._pieces_from_env()


def test_bad_inputs_are_refused():
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    cache = kc.new_kv_cache(4, 64)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    req = torch.zeros(2, dtype=torch.int32)
    pos = torch.zeros(2, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fd.sparse_mla_attention_flashmla_fp8(q, cache, bt, req, pos, 0.1)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, backend="flashmla_fp8")
    with pytest.raises(ValueError, match="gather_backend"):
        sa.sparse_mla_attention(q, cache, bt, req, pos, 0.1, backend="flashmla_fp8", gather_backend="triton")
    with pytest.raises(ValueError, match="positions must be int32"):
        fd.sparse_mla_attention_flashmla_fp8(q, cache, bt, req, pos.long(), 0.1)


def test_sanitize_indices_kernel_and_torch_path_agree():
    """Global indices: -1 and in-cache entries pass, anything else becomes -1 and flags its chunk (interpreter
    kernel vs the torch path of the same function)."""
    g = torch.Generator().manual_seed(5)
    Q, K, cap = 4, 1100, 300
    v = torch.randint(-1, cap, (Q, K), generator=g, dtype=torch.int32)
    v[1, 1050] = cap  # just past the cache, last chunk
    v[2, 3] = -7
    ref_idx = torch.where((v >= 0) & (v < cap), v, torch.full_like(v, -1))
    idx, bad = fd.sanitize_indices(v, cap)
    assert torch.equal(idx, ref_idx)
    assert bad.tolist() == [[0, 0, 0], [0, 0, 1], [1, 0, 0], [0, 0, 0]]


def test_global_entry_bad_inputs_are_refused():
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fd.flashmla_fp8_attention(q, cache, idx, 0.1)
    with pytest.raises(ValueError, match="d_qk=600"):
        fd.flashmla_fp8_attention(torch.zeros(2, 64, 600, dtype=torch.bfloat16), cache, idx, 0.1)
    with pytest.raises(ValueError, match="584"):  # the V4 width needs the V4 layout
        fd.flashmla_fp8_attention(torch.zeros(2, 64, 512, dtype=torch.bfloat16), cache, idx, 0.1)
    with pytest.raises(ValueError, match="64 or 128 heads"):
        fd.flashmla_fp8_attention(torch.zeros(2, 32, 576, dtype=torch.bfloat16), cache, idx, 0.1)
    with pytest.raises(ValueError, match="multiple of 64"):
        fd.flashmla_fp8_attention(q, cache, idx[:, :100], 0.1)
    with pytest.raises(ValueError, match="indices must be int32"):
        fd.flashmla_fp8_attention(q, cache, idx.long(), 0.1)
    q4 = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    c4 = torch.zeros(4, 64, 584, dtype=torch.uint8)
    tl = torch.full((2,), 100, dtype=torch.int32)
    with pytest.raises(ValueError, match="DeepSeek-V4 layout"):
        fd.flashmla_fp8_attention(q, cache, idx, 0.1, topk_length=tl)
    with pytest.raises(ValueError, match="pieces_per_row=1"):
        fd.flashmla_fp8_attention(q4, c4, idx, 0.1, topk_length=tl, pieces_per_row=2)
    with pytest.raises(ValueError, match="come together"):
        fd.flashmla_fp8_attention(q4, c4, idx, 0.1, extra_kv_cache=c4)
    with pytest.raises(ValueError, match="topk_length must be int32"):
        fd.flashmla_fp8_attention(q4, c4, idx, 0.1, topk_length=tl.long())
    with pytest.raises(ValueError, match="extra_topk_length without"):
        fd.flashmla_fp8_attention(q4, c4, idx, 0.1, extra_topk_length=tl)
    with pytest.raises(ValueError, match="needs CUDA"):  # a well-formed V4 call reaches the device check
        fd.flashmla_fp8_attention(q4, c4, idx, 0.1, topk_length=tl, extra_kv_cache=c4, extra_indices=idx[:, :64],
                                  extra_topk_length=tl)


@pytest.mark.parametrize("S", EMULATED_PIECES)
def test_wrapper_plumbing_against_an_emulated_kernel(seeded, monkeypatch, S):
    """Request-local positions -> translation -> launches of rows_per_launch rows -> pieces -> merge: equal to the
    float64 reference to bf16 rounding, a row's bits independent of the batch under the emulated kernel, NaN rows
    for unresolvable positions; the launches really were split."""
    kern = install_emulation(monkeypatch)
    g = seeded()
    lens = (300, 200, 260, 150)
    cache, bt = request_cache(g, lens)
    Q, H, K = 21, 64, 256
    req = torch.tensor([i % 4 for i in range(Q)], dtype=torch.int32)
    pos = torch.full((Q, K), -1, dtype=torch.int32)
    for r in range(Q):
        L = lens[int(req[r])]
        k = min(L, K - 3 * r)
        pos[r, :k] = torch.randperm(L, generator=g)[:k].to(torch.int32)
    q = (torch.randn(Q, H, 576, generator=g) * 0.3).to(torch.bfloat16)
    sink = torch.linspace(-1, 1, H)
    def call(q, bt, req, pos, check=True):
        return fd.sparse_mla_attention_flashmla_fp8(q, cache, bt, req, pos, 0.05, attn_sink=sink, check=check,
                                                    pieces_per_row=S)

    o, l = call(q, bt, req, pos)
    assert len(kern.launches) == -(-Q // fd.rows_per_launch(S)) > 1
    ws = kc.gather_kv(cache, bt, req, pos, backend="reference")
    ro, rl = sparse_attention_ref(q, ws.view(-1, 576), kc.workspace_indices(pos), 0.05, attn_sink=sink,
                                  return_fp64=True)
    assert torch.allclose(o.double(), ro, atol=2e-2, rtol=2e-2)
    assert torch.allclose(l.double(), rl, atol=1e-3, rtol=1e-4)
    for victim in (0, 13):
        alone = call(q[victim:victim + 1], bt, req[victim:victim + 1], pos[victim:victim + 1])
        assert torch.equal(alone[0][0], o[victim]) and torch.equal(alone[1][0], l[victim])
    bt2 = bt.clone()
    bt2[int(req[5]), int(pos[5, 0]) // 8] = -1
    with pytest.raises(ValueError, match="hole"):
        call(q, bt2, req, pos)
    o2, _ = call(q, bt2, req, pos, check=False)
    bad_rows = {r for r in range(Q) if int(req[r]) == int(req[5]) and
                bool(((pos[r] >= 0) & (pos[r].long() // 8 == int(pos[5, 0]) // 8)).any())}
    for r in range(Q):
        assert bool(torch.isnan(o2[r].float()).all()) == (r in bad_rows), r


def test_global_entry_lengths_and_extra_cache_against_an_emulated_kernel(seeded, monkeypatch):
    """topk_length / extra cache plumbing: the table ends every CTA's last row at that row's own count (the
    emulation raises otherwise), rows are whole, lengths and the extra list reach the kernel, batch-invariant."""
    kern = install_emulation(monkeypatch)
    g = seeded()
    cache, deq = v4_cache(50, 8, seed=31)
    extra, deq2 = v4_cache(13, 8, seed=32)
    assert torch.equal(dequant_v4(cache), deq) and torch.equal(dequant_v4(extra), deq2)  # the layout helpers agree
    Q, H, K, K2 = 19, 64, 256, 64
    cap, cap2 = cache.shape[0] * cache.shape[1], extra.shape[0] * extra.shape[1]
    idx = torch.stack([torch.randperm(cap, generator=g)[:K] for _ in range(Q)]).to(torch.int32)
    eidx = torch.stack([torch.randperm(cap2, generator=g)[:K2] for _ in range(Q)]).to(torch.int32)
    tl = torch.randint(1, K + 1, (Q,), generator=g, dtype=torch.int32)
    etl = torch.randint(0, K2 + 1, (Q,), generator=g, dtype=torch.int32)
    q = (torch.randn(Q, H, 512, generator=g) * 0.3).to(torch.bfloat16)
    extra_args = dict(topk_length=tl, extra_kv_cache=extra, extra_indices=eidx, extra_topk_length=etl)
    o, l = fd.flashmla_fp8_attention(q, cache, idx, 0.05, **extra_args)
    for r in (0, 7):  # float64: the row's main list cut at its length, then its extra list cut at its length
        kv = torch.cat([deq[idx[r, : tl[r]].long()], deq2[eidx[r, : etl[r]].long()]])
        s_ = (q[r].double() @ kv.T) * 0.05
        assert torch.allclose(o[r].double(), torch.softmax(s_, -1) @ kv, atol=2e-2, rtol=2e-2)
    assert len(kern.launches) > 1
    for victim in (0, 11):
        sub = {k: (v[victim:victim + 1] if k != "extra_kv_cache" else v) for k, v in extra_args.items()}
        alone = fd.flashmla_fp8_attention(q[victim:victim + 1], cache, idx[victim:victim + 1], 0.05, **sub)
        assert torch.equal(alone[0][0], o[victim]) and torch.equal(alone[1][0], l[victim])


def _need():
    from zerodiff import backends

    fm = backends.flash_mla()
    if fm is None:
        pytest.skip(f"FlashMLA not importable: {backends.status()['flashmla']['detail']}")
    return fm


def _setup(nreq, ctx, H=64, topk=GPU_TOPK, seed=0, bs=64):
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = (ctx + bs - 1) // bs
    nb = nreq * nblk + 2
    perm = torch.randperm(nb, generator=g)[: nreq * nblk].to(torch.int32)
    bt = perm.reshape(nreq, nblk).cuda()
    cache = kc.new_kv_cache(nb, bs, device="cuda")
    p = torch.arange(ctx).repeat(nreq)
    b = torch.arange(nreq).repeat_interleave(ctx)
    slots = (bt.cpu().long()[b, p // bs] * bs + p % bs).cuda()
    x = (torch.randn(nreq * ctx, 512, generator=g) * 3).to(torch.bfloat16).cuda()
    x[::97, ::5] = 0.0
    x[1::89, 3] = -0.0
    rope = torch.randn(nreq * ctx, 64, generator=g).to(torch.bfloat16).cuda()
    kc.write_kv_cache(x, rope, cache, slots)
    pos = torch.stack([torch.randperm(ctx, generator=g)[:topk].sort(descending=True).values for _ in range(nreq)])
    pos = pos.to(torch.int32).cuda()
    q = (torch.randn(nreq, H, 576, generator=g) * 0.5).to(torch.bfloat16).cuda()
    q[:, :, ::7] = q[:, :, 1::7][:, :, : q[:, :, ::7].shape[2]]  # repeated values (ties in the scores)
    return cache, bt, pos, q


def _call(q, cache, bt, req, pos, S=None, sink=None, check=True, q_copy=False):
    read = av.sparse_mla_attention_flashmla_fp8_q_copy if q_copy else fd.sparse_mla_attention_flashmla_fp8
    return read(q, cache, bt, req, pos, SC, attn_sink=sink, check=check, pieces_per_row=S)


PIECES = sorted({1, 2, 4, 8, fd.PIECES_PER_ROW})


@pytest.mark.gpu
@pytest.mark.parametrize("S", PIECES)
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_matches_reference_with_sink_and_short_lists(H, S):
    _need()
    cache, bt, pos, q = _setup(4, 4096, H=H, topk=512)
    pos[1, 300:] = -1
    pos[2, 1::2] = -1
    pos[3, 64:128] = -1  # an empty piece for 8 pieces (width 64 each)
    sink = torch.linspace(-2, 2, H, device="cuda")
    req = torch.arange(4, dtype=torch.int32, device="cuda")
    o, l = _call(q, cache, bt, req, pos, S=S, sink=sink)
    ws = kc.gather_kv(cache, bt, req, pos)
    ro, rl = sparse_attention_ref(q.cpu(), ws.view(-1, 576).cpu(), kc.workspace_indices(pos).cpu(), SC,
                                  attn_sink=sink.cpu(), return_fp64=True)
    assert torch.allclose(o.cpu().double(), ro, atol=2e-2, rtol=2e-2)
    # FlashMLA dequantises with its own rounding (measured: lse within ~2e-3 of the workspace values' lse)
    assert torch.allclose(l.cpu().double(), rl, atol=5e-3, rtol=1e-4), (
        f"lse convention differs from the natural log: got {l[0, :4].tolist()} want {rl[0, :4].tolist()}")
    if S == fd.PIECES_PER_ROW:
        o2, _ = sa.sparse_mla_attention(q, cache, bt, req, pos, SC, attn_sink=sink, backend="flashmla_fp8")
        assert torch.equal(o2, o), "the sparse_mla_attention route must run the same call"
    if S > 1:  # the stride-0 q broadcast gives the bits of a materialised copy
        oc, lc = _call(q, cache, bt, req, pos, S=S, sink=sink, q_copy=True)
        assert torch.equal(oc, o) and torch.equal(lc, l), "stride-0 q broadcast differs from a copy"


@pytest.mark.gpu
@pytest.mark.parametrize("S", PIECES)
def test_gpu_victim_in_batch_across_cta_and_launch_boundaries(S):
    _need()
    npool = 150
    cache, bt, pos, q = _setup(npool, 4096, seed=1)
    sink = torch.linspace(-1, 1, 64, device="cuda")
    req_all = torch.arange(npool, dtype=torch.int32, device="cuda")
    parts = fd.num_sm_parts(64, 576, S)
    cap = fd.rows_per_launch(S)
    sizes = sorted({2, 3, parts - 1, parts, parts + 1, 2 * parts + 1, 300, cap, cap + 3})
    g = torch.Generator(device="cpu").manual_seed(11 + S)
    for victim in (0, 77):
        alone = _call(q[victim:victim + 1], cache, bt, req_all[victim:victim + 1], pos[victim:victim + 1], S, sink)
        for B in sizes:
            others = torch.randint(0, npool, (B - 1,), generator=g).cuda()
            for where in sorted({0, B // 2, B - 1}):
                rows = torch.cat([others[:where], torch.tensor([victim], device="cuda"), others[where:]])
                o, l = _call(q[rows], cache, bt, req_all[rows], pos[rows], S, sink)
                assert torch.equal(o[where].view(torch.int16), alone[0][0].view(torch.int16)), (S, victim, B, where)
                assert torch.equal(l[where], alone[1][0]), (S, victim, B, where)


@pytest.mark.gpu
@pytest.mark.parametrize("S", PIECES)
def test_gpu_prefill_rows_equal_decode_rows_repeated(S):
    _need()
    cache, bt, pos, q = _setup(2, 8192, seed=2)
    T = 300
    p1 = pos[0:1].repeat(T, 1)
    for t in range(T):  # distinct histories: drop t entries from the tail
        if t:
            p1[t, GPU_TOPK - t:] = -1
    qq = (q[0:1] + torch.randn(T, 64, 576, device="cuda").to(torch.bfloat16)).contiguous()
    req0 = torch.zeros(T, dtype=torch.int32, device="cuda")
    pre = _call(qq, cache, bt, req0, p1, S)
    for _ in range(3):
        again = _call(qq, cache, bt, req0, p1, S)
        assert torch.equal(again[0], pre[0]) and torch.equal(again[1], pre[1])
    for c0, c1 in ((0, 7), (7, 140), (140, 300)):  # chunked prefill
        chunk = _call(qq[c0:c1], cache, bt, req0[c0:c1], p1[c0:c1], S)
        assert torch.equal(chunk[0], pre[0][c0:c1]) and torch.equal(chunk[1], pre[1][c0:c1])
    for t in (0, 1, 131, 132, 299):  # decode: one row alone
        d = _call(qq[t:t + 1], cache, bt, req0[:1], p1[t:t + 1], S)
        assert torch.equal(d[0][0], pre[0][t]) and torch.equal(d[1][0], pre[1][t]), t


@pytest.mark.gpu
@pytest.mark.parametrize("S", PIECES)
@pytest.mark.parametrize("B", [64, 200])
def test_gpu_cuda_graph_replay_equals_eager(B, S):
    _need()
    cache, bt, pos, q = _setup(B, 8192, seed=3)
    req = torch.arange(B, dtype=torch.int32, device="cuda")
    eager = _call(q, cache, bt, req, pos, S, check=False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _call(q, cache, bt, req, pos, S, check=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, gl = _call(q, cache, bt, req, pos, S, check=False)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(go, eager[0]) and torch.equal(gl, eager[1])


@pytest.mark.gpu
@pytest.mark.parametrize("S", PIECES)
def test_gpu_unresolvable_rows_fail_closed(S):
    _need()
    cache, bt, pos, q = _setup(4, 4096, seed=4)
    req = torch.arange(4, dtype=torch.int32, device="cuda")
    clean = _call(q, cache, bt, req, pos, S)
    bt2 = bt.clone()
    bt2[2, int(pos[2, 10]) // 64] = -1  # a hole under one of row 2's positions
    with pytest.raises(ValueError, match="hole"):
        _call(q, cache, bt2, req, pos, S)
    o, _ = _call(q, cache, bt2, req, pos, S, check=False)
    assert bool(torch.isnan(o[2].float()).all()), "a row reading a table hole must come out NaN"
    for r in (0, 1, 3):
        assert torch.equal(o[r], clean[0][r])


@pytest.mark.gpu
@pytest.mark.parametrize("S", PIECES)
def test_gpu_empty_row_gives_zero_output(S):
    _need()
    cache, bt, pos, q = _setup(3, 4096, seed=6)
    pos[1] = -1
    req = torch.arange(3, dtype=torch.int32, device="cuda")
    o, l = _call(q, cache, bt, req, pos, S)
    assert bool((o[1].float() == 0).all()), f"empty row: out not zero (lse {l[1, :4].tolist()})"
    assert torch.isfinite(o[0].float()).all() and torch.isfinite(o[2].float()).all()


@pytest.mark.gpu
def test_gpu_negative_controls_stock_schedule_other_pieces_reversed_order():
    fm = _need()
    B = 128
    cache, bt, pos, q = _setup(B, 8192, seed=7)
    req = torch.arange(B, dtype=torch.int32, device="cuda")
    idx, _ = fd.translate_positions(bt, req, pos, cache.shape[0], cache.shape[1])

    def stock(rows):
        meta, _ = fm.get_mla_metadata()
        o, _l = fm.flash_mla_with_kvcache(q[rows][:, None], cache.unsqueeze(-2), None, None, 512, meta,
                                          softmax_scale=SC, is_fp8_kvcache=True, indices=idx[rows][:, None].contiguous())
        return o[:, 0]

    ours = _call(q, cache, bt, req, pos)[0]
    diffs = []
    for n in (16, 64, 128):
        diffs.append(int((stock(torch.arange(n, device="cuda"))[0] != stock(torch.zeros(1, dtype=torch.long,
                                                                                        device="cuda"))[0]).sum()))
    assert max(diffs) > 0, f"the stock schedule did not change row 0 with the batch ({diffs}): control void"
    alone = _call(q[:1], cache, bt, req[:1], pos[:1])[0]
    assert torch.equal(alone[0], ours[0])
    other_p = 4 if fd.PIECES_PER_ROW != 4 else 8
    other = _call(q, cache, bt, req, pos, S=other_p)[0]
    assert not torch.equal(other, ours), "another piece count must change bits (else pieces are not tested)"
    assert torch.allclose(other.float(), ours.float(), atol=2e-2, rtol=2e-2)
    rev = _call(q, cache, bt, req, pos.flip(-1).contiguous())[0]
    assert not torch.equal(rev, ours), "reversed index order must change the output"


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 2])
def test_gpu_global_indices_give_the_request_local_bits(S):
    _need()
    cache, bt, pos, q = _setup(6, 4096, seed=8)
    req = torch.arange(6, dtype=torch.int32, device="cuda")
    sink = torch.linspace(-1, 1, 64, device="cuda")
    idx, _bad = fd.translate_positions(bt, req, pos, cache.shape[0], cache.shape[1])
    a = _call(q, cache, bt, req, pos, S, sink)
    b = fd.flashmla_fp8_attention(q, cache, idx, SC, attn_sink=sink, pieces_per_row=S)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    idx2 = idx.clone()
    idx2[4, 7] = cache.shape[0] * cache.shape[1]  # past the cache: not read, the row is NaN
    c = fd.flashmla_fp8_attention(q, cache, idx2, SC, attn_sink=sink, pieces_per_row=S)
    assert bool(torch.isnan(c[0][4].float()).all()) and bool(torch.isnan(c[1][4]).all())
    for r in (0, 1, 2, 3, 5):
        assert torch.equal(c[0][r], a[0][r])


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 2])
def test_gpu_v4_layout_reference_victim_in_batch_and_stock_control(S):
    fm = _need()
    nb, bs, H, K = 300, 64, 64, 512
    raw, deq = v4_cache(nb, bs, seed=9)
    cache = raw.cuda()
    g = torch.Generator().manual_seed(10)
    npool = 150
    idx = torch.stack([torch.randperm(nb * bs, generator=g)[:K] for _ in range(npool)]).to(torch.int32)
    idx[3, 200:] = -1
    q = (torch.randn(npool, H, 512, generator=g) * 0.5).to(torch.bfloat16)
    sc = 1 / math.sqrt(512)
    sink = torch.linspace(-1, 1, H)
    o, l = fd.flashmla_fp8_attention(q.cuda(), cache, idx.cuda(), sc, attn_sink=sink.cuda(), pieces_per_row=S)
    for r in (0, 3, 77):  # float64 reference
        ok = idx[r] >= 0
        kv = deq[idx[r][ok].long()]
        s_ = (q[r].double() @ kv.T) * sc
        lse = torch.logsumexp(s_, dim=-1)
        ref = (torch.softmax(s_, dim=-1) @ kv) / (1 + torch.exp(sink.double() - lse))[:, None]
        assert torch.allclose(o[r].cpu().double(), ref, atol=2e-2, rtol=2e-2), r
        assert torch.allclose(l[r].cpu().double(), lse, atol=5e-3, rtol=1e-4), r
    qc, ic, skc = q.cuda(), idx.cuda(), sink.cuda()
    parts = fd.num_sm_parts(H, 512, S)
    gg = torch.Generator().manual_seed(12)
    for victim in (0, 77):
        alone = fd.flashmla_fp8_attention(qc[victim:victim + 1], cache, ic[victim:victim + 1], sc, attn_sink=skc,
                                          pieces_per_row=S)
        for B in sorted({2, parts - 1, parts, parts + 1, 2 * parts + 1, 300}):
            others = torch.randint(0, npool, (B - 1,), generator=gg).cuda()
            for where in sorted({0, B // 2, B - 1}):
                rows = torch.cat([others[:where], torch.tensor([victim], device="cuda"), others[where:]])
                ob, lb = fd.flashmla_fp8_attention(qc[rows], cache, ic[rows], sc, attn_sink=skc, pieces_per_row=S)
                assert torch.equal(ob[where], alone[0][0]) and torch.equal(lb[where], alone[1][0]), (S, victim, B, where)

    def stock(rows):
        meta, _ = fm.get_mla_metadata()
        out, _l = fm.flash_mla_with_kvcache(qc[rows][:, None], cache, None, None, 512, meta, softmax_scale=sc,
                                            is_fp8_kvcache=True, indices=ic[rows][:, None].contiguous())
        return out[:, 0]

    full = stock(torch.arange(128, device="cuda"))
    alone_s = stock(torch.zeros(1, dtype=torch.long, device="cuda"))
    ours0 = fd.flashmla_fp8_attention(qc[:1], cache, ic[:1], sc, pieces_per_row=S)[0][0]
    assert torch.allclose(full[0].float(), ours0.float(), atol=2e-2, rtol=2e-2), "stock reads the layout otherwise"
    assert int((full[0] != alone_s[0]).sum()) > 0, "the stock scheduler did not change row 0 on the V4 layout"


@pytest.mark.gpu
def test_gpu_v4_extra_cache_and_lengths_reference_victim_and_stock_control():
    """DeepSeek-V4 attention as vLLM calls it: a compressed-cache list cut by topk_length plus an SWA extra cache
    cut by extra_topk_length. Float64 reference, victim-in-batch across the CTA bound, and the stock scheduler on
    the same inputs as the negative control. (Written from the kernel's public contract; first run pending.)"""
    fm = _need()
    nb, bs, H, K, K2 = 200, 64, 64, 512, 128
    raw, deq = v4_cache(nb, bs, seed=21)
    raw2, deq2 = v4_cache(40, bs, seed=22)
    cache, extra = raw.cuda(), raw2.cuda()
    g = torch.Generator().manual_seed(23)
    npool = 150
    idx = torch.stack([torch.randperm(nb * bs, generator=g)[:K] for _ in range(npool)]).to(torch.int32)
    eidx = torch.stack([torch.randperm(40 * bs, generator=g)[:K2] for _ in range(npool)]).to(torch.int32)
    tl = torch.randint(1, K + 1, (npool,), generator=g, dtype=torch.int32)
    etl = torch.randint(0, K2 + 1, (npool,), generator=g, dtype=torch.int32)
    q = (torch.randn(npool, H, 512, generator=g) * 0.5).to(torch.bfloat16)
    sc = 1 / math.sqrt(512)
    qc, ic, ec, tlc, etlc = q.cuda(), idx.cuda(), eidx.cuda(), tl.cuda(), etl.cuda()

    def ours(rows):
        return fd.flashmla_fp8_attention(qc[rows], cache, ic[rows], sc, topk_length=tlc[rows], extra_kv_cache=extra,
                                         extra_indices=ec[rows], extra_topk_length=etlc[rows])

    o, l = ours(torch.arange(npool, device="cuda"))
    for r in (0, 5, 77):
        kv = torch.cat([deq[idx[r, : tl[r]].long()], deq2[eidx[r, : etl[r]].long()]])
        s_ = (q[r].double() @ kv.T) * sc
        ref = torch.softmax(s_, dim=-1) @ kv
        assert torch.allclose(o[r].cpu().double(), ref, atol=2e-2, rtol=2e-2), r
        assert torch.allclose(l[r].cpu().double(), torch.logsumexp(s_, dim=-1), atol=5e-3, rtol=1e-4), r
    parts = fd.num_sm_parts(H, 512, 1)
    gg = torch.Generator().manual_seed(24)
    for victim in (0, 77):
        alone = ours(torch.tensor([victim], device="cuda"))
        for B in sorted({2, parts - 1, parts, parts + 1, 2 * parts + 1}):
            others = torch.randint(0, npool, (B - 1,), generator=gg).cuda()
            for where in sorted({0, B // 2, B - 1}):
                rows = torch.cat([others[:where], torch.tensor([victim], device="cuda"), others[where:]])
                ob, lb = ours(rows)
                assert torch.equal(ob[where], alone[0][0]) and torch.equal(lb[where], alone[1][0]), (victim, B, where)

    def stock(rows):
        meta, _ = fm.get_mla_metadata()
        out, _l = fm.flash_mla_with_kvcache(qc[rows][:, None], cache, None, None, 512, meta, softmax_scale=sc,
                                            is_fp8_kvcache=True, indices=ic[rows][:, None].contiguous(),
                                            topk_length=tlc[rows], extra_k_cache=extra,
                                            extra_indices_in_kvcache=ec[rows][:, None].contiguous(),
                                            extra_topk_length=etlc[rows])
        return out[:, 0]

    full = stock(torch.arange(128, device="cuda"))
    assert torch.allclose(full[0].float(), o[0].float(), atol=2e-2, rtol=2e-2), "stock reads these inputs otherwise"
    alone_s = stock(torch.zeros(1, dtype=torch.long, device="cuda"))
    assert int((full[0] != alone_s[0]).sum()) > 0, "the stock scheduler did not change row 0 (control void)"
