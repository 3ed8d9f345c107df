"""The attention read paths and configurations that did not ship (``zerodiff.experimental.attention_variants``):
the split kernel's variants (fixed per shape, fail closed, the pipelined variant's bits in the interpreter, the
other-tile variants' own contract and their bits differing from the shipped ones, the GPU invariance pass), the
unsplit fused FP8 read (== the workspace path in the interpreter; close and invariant on the GPU), and the smaller
piece-merge tile of ``flashmla_fp8`` (the same bits)."""

import math

import pytest
import torch
from attention_inputs import GPU_H, SMALL, SPLIT, causal_positions, gpu_setup, same_bits, small_cache
from attention_inputs import prefill_positions, split_inputs
from bitwise import bits

from zerodiff._triton import INTERPRET
from zerodiff.experimental import attention_variants as av
from zerodiff.ops import attention as sa
from zerodiff.ops import kv_cache as kc
from zerodiff.ops.attention import flashmla_fp8 as fd
from zerodiff.ops.attention import triton_split as ts
from zerodiff.reference.sparse_attention import sparse_attention_ref

#: the variants with other tiles than the shipped configuration (other bits), checked on the CPU
OTHER_BITS_VARIANTS = [v for v in ("pf_bn2x", "pf_chunk2x") if v in av.SPLIT_VARIANTS]
#: every variant but the shipped one, checked on the GPU
GPU_VARIANTS = [v for v in av.SPLIT_VARIANTS if v != "default"]
#: piece counts of the GPU merge-tile check
MERGE_PIECES = [2, 4]
#: the split read under a named variant
variant_read = av.sparse_mla_attention_fp8_split_variant


def _need():
    from zerodiff import backends

    if backends.flash_mla() is None:
        pytest.skip(f"FlashMLA not importable: {backends.status()['flashmla']['detail']}")


def test_fused_fp8_read_equals_workspace_path(seeded):
    """The Triton kernel reading the FP8 cache directly == gather into the workspace + the same kernel, bitwise,
    including a sink, -1 padding, rows alone and in a batch; a table hole poisons only its row."""
    g = seeded()
    lens = [40, 19]
    cache, bt = small_cache(g, lens, SMALL)
    W, H = 24, 4
    pos = torch.cat([causal_positions(g, L, W) for L in lens])
    req = torch.cat([torch.full((L,), b, dtype=torch.int32) for b, L in enumerate(lens)])
    q = torch.randn(len(req), H, 144, generator=g).to(torch.bfloat16)
    sink = torch.tensor([0.3, -0.2, 1.0, 0.0])
    kw = dict(attn_sink=sink, **SMALL)
    a = sa.sparse_mla_attention(q, cache, bt, req, pos, 0.15, backend="triton", gather_backend="triton", **kw)
    b = av.sparse_mla_attention_fp8(q, cache, bt, req, pos, 0.15, **kw)
    assert same_bits(a, b)
    one = av.sparse_mla_attention_fp8(q[45:46], cache, bt, req[45:46], pos[45:46], 0.15, **kw)
    assert same_bits((a[0][45:46], a[1][45:46]), one)
    bad = pos[:2].clone()
    bad[0, 0] = 7 * 8 + 1  # block 7 of request 0 does not exist -> past the table
    with pytest.raises(ValueError, match="longer than the table"):
        av.sparse_mla_attention_fp8(q[:2], cache, bt, req[:2], bad, 0.15, **kw)
    o, _ = av.sparse_mla_attention_fp8(q[:2], cache, bt, req[:2], bad, 0.15, check=False, **kw)
    assert bool(o[0].isnan().all()) and not bool(o[1].isnan().any())


def test_split_variant_configs_fixed_per_shape_and_fail_closed():
    import inspect

    assert av.split_variant_config("default", 512, 64) == ts.split_config(512, 64)
    assert set(inspect.signature(av.split_variant_config).parameters) == {"variant", "d_nope", "d_rope"}
    for v in av.SPLIT_VARIANTS:
        for dims in ((512, 64), (128, 16)):
            cfg = av.split_variant_config(v, *dims)
            assert cfg == av.split_variant_config(v, *dims) and cfg["CHUNK"] % cfg["BLOCK_N"] == 0, (v, dims)
            assert dims[0] % cfg.get("MERGE_DV", dims[0]) == 0
    for v in ("pf", "pf_s2"):  # same tiles as default: only schedule / merge grid differ
        a, b = av.split_variant_config(v), ts.split_config()
        assert all(a[k] == b[k] for k in ("BLOCK_H", "BLOCK_N", "CHUNK", "num_warps", "MERGE_BH")), v
    assert av.SPLIT_SAME_BITS_AS_DEFAULT == ()  # "pf" differs from "default" on the H200 (2026-11-30)
    g = torch.Generator().manual_seed(0)
    cache, bt, pos, req, q = split_inputs(g, lens=(20,), W=8, H=4, adversarial=False)
    with pytest.raises(ValueError, match="variant 'nope' unknown"):
        av.sparse_mla_attention_fp8_split_variant(q[:1], cache, bt, req[:1], pos[:1], 0.1, **SMALL, variant="nope")
    with pytest.raises(ValueError, match="experimental"):  # the dispatcher runs shipped backends only
        sa.sparse_mla_attention(q[:1], cache, bt, req[:1], pos[:1], 0.1, **SMALL, backend="triton_fp8")
    with pytest.raises(ValueError, match="MERGE_DV"):
        av.sparse_mla_attention_fp8_split_variant(q[:1], cache, bt, req[:1], pos[:1], 0.1, **SMALL,
                                                  config=dict(av.split_variant_config("pf", 128, 16), MERGE_DV=48))
    raw = torch.empty(cache.numel() + 1, dtype=torch.uint8)
    odd = raw[1:].view(cache.shape)  # a cache base off 16-byte alignment: the pipelined loads' hints would lie
    odd.copy_(cache)
    with pytest.raises(ValueError, match="16-byte"):
        av.sparse_mla_attention_fp8_split_variant(q[:1], odd, bt, req[:1], pos[:1], 0.1, **SMALL, variant="pf")


def test_split_pipelined_variant_same_bits_as_default_in_the_interpreter(seeded):
    """"pf" (hand-pipelined loads, column-split merge) has the default's statements in the default's order: in
    the interpreter (which executes the source as written) the same bits on adversarial rows (chunk boundaries,
    empty chunks, -1 interleaved, lonely row, exact ties, +-0, denormals, sink) and the same NaN poisoning of an
    unchecked bad slot. A structural check of the source only: on the H200 the compiled kernels differ in 5448
    values (``av.SPLIT_SAME_BITS_AS_DEFAULT`` is empty; the GPU variant test checks each variant's own
    invariance)."""
    g = seeded()
    cache, bt, pos, req, q = split_inputs(g)
    rows = torch.tensor([89, 60, 3, 120, 100, 0, 44])
    pos, req, q = pos[rows].clone(), req[rows].clone(), q[rows].contiguous()
    pos[0, 32:64] = -1
    pos[1, 1::3] = -1
    pos[2, :] = -1
    pos[3, 40:44] = pos[3, 0]
    pos[4, 64:] = -1
    pos[6, 5] = 12 * 8 + 3  # past request 0's table: unchecked, the row is NaN-poisoned
    sink = torch.linspace(-2, 2, 16)
    kw = dict(attn_sink=sink, check=False, **SMALL)
    base = ts.sparse_mla_attention_fp8_split(q, cache, bt, req, pos, 0.13, **kw)
    assert bool(base[0][6].isnan().all()) and not bool(base[0][:6].isnan().any())
    pf = av.sparse_mla_attention_fp8_split_variant(q, cache, bt, req, pos, 0.13, variant="pf", **kw)
    assert same_bits(base, pf)
    via = sa.sparse_mla_attention(q[:3], cache, bt, req[:3], pos[:3], 0.13, attn_sink=sink, **SPLIT)
    assert same_bits(via, (base[0][:3], base[1][:3]))  # the dispatcher's route runs the same call


@pytest.mark.parametrize("variant", OTHER_BITS_VARIANTS)
def test_split_other_tile_variants_reference_victim_prefill_and_control(seeded, variant):
    """Variants with other tiles (other bits than default) keep the contract on their own: close to the float64
    reference; a row alone == in a batch at the front and the end == inside a prefill chunk of its request; and
    their bits differ from the default's (so a switch is a deliberate, all-sides change)."""
    g = seeded()
    cache, bt, pos, req, q = split_inputs(g, lens=(70, 40), W=72)
    sink = torch.linspace(-1, 1, 16)
    kw = dict(attn_sink=sink, variant=variant, **SMALL)
    victim = 69
    alone = variant_read(q[victim:victim + 1], cache, bt, req[victim:victim + 1], pos[victim:victim + 1],
                         0.2, **kw)
    ws = kc.gather_kv(cache, bt, req[victim:victim + 1], pos[victim:victim + 1], **SMALL, backend="reference")
    ro, rl = sparse_attention_ref(q[victim:victim + 1], ws.view(-1, 144), kc.workspace_indices(pos[victim:victim + 1]),
                                  0.2, d_v=128, attn_sink=sink, return_fp64=True)
    assert torch.allclose(alone[0].double(), ro, atol=2e-2, rtol=2e-2)
    assert torch.allclose(alone[1].double(), rl, atol=1e-4, rtol=1e-5)
    fillers = torch.tensor([100, 3, 75, 50])
    for where in (0, 4):
        rows = torch.cat([fillers[:where], torch.tensor([victim]), fillers[where:]])
        o, l = variant_read(q[rows], cache, bt, req[rows], pos[rows], 0.2, **kw)
        assert torch.equal(bits(o[where]), bits(alone[0][0])) and torch.equal(bits(l[where]), bits(alone[1][0]))
    pre = variant_read(q[66:70], cache, bt, req[66:70], pos[66:70], 0.2, **kw)
    assert same_bits((pre[0][3:4], pre[1][3:4]), alone)
    default = sa.sparse_mla_attention(q[victim:victim + 1], cache, bt, req[victim:victim + 1], pos[victim:victim + 1],
                                      0.2, attn_sink=sink, **SPLIT)
    assert not torch.equal(bits(default[0]), bits(alone[0])), f"{variant} gave the default's bits: control is void"


@pytest.mark.skipif(not INTERPRET, reason="the Triton merge kernel runs on the CPU only under TRITON_INTERPRET=1")
def test_merge_tile_does_not_change_bits_in_the_interpreter(seeded):
    g = seeded()
    Q, P, H, DV = 3, 2, 20, 32
    o = (torch.randn(Q, P, H, DV, generator=g) * 2).to(torch.bfloat16).contiguous()
    lse = (torch.randn(Q, P, H, generator=g) * 3 + 5)
    sink = torch.linspace(-3, 3, H)
    a = fd.merge_pieces(o, lse, sink, bh=fd.MERGE_BH)
    b = fd.merge_pieces(o, lse, sink, bh=av.MERGE_BH_SMALL)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_gpu_fused_fp8_triton_close_to_workspace_triton_and_is_batch_invariant():
    """The unsplit fused FP8 kernel is batch-invariant (bitwise) and close to the workspace Triton kernel.

    It is NOT bitwise equal to the workspace kernel on the H200 (measured 2026-11-30; they are equal in the
    CPU interpreter): the two compile to different MMA tilings. So a deployment picks ONE read path for
    prefill, decode and training alike; mixing paths is never allowed.
    """
    cache, bt, pos, q = gpu_setup(65, 8192, seed=9)
    pos[3, 1000:] = -1
    sc = 1 / math.sqrt(576)
    sink = torch.linspace(-1, 1, GPU_H, device="cuda")
    req = torch.arange(65, dtype=torch.int32, device="cuda")
    ws = sa.sparse_mla_attention(q, cache, bt, req, pos, sc, attn_sink=sink, backend="triton")
    fused = av.sparse_mla_attention_fp8(q, cache, bt, req, pos, sc, attn_sink=sink)
    assert torch.allclose(ws[0].float(), fused[0].float(), rtol=2**-6, atol=2**-8)
    assert torch.allclose(ws[1], fused[1], rtol=1e-5, atol=1e-5)
    for r in (0, 3, 64):
        one = av.sparse_mla_attention_fp8(q[r : r + 1], cache, bt, req[r : r + 1], pos[r : r + 1], sc, attn_sink=sink)
        assert torch.equal(one[0][0], fused[0][r]) and torch.equal(one[1][0], fused[1][r])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_gpu_split_variant_invariance_andbits(variant):
    """Each split variant on the compiled kernels: close to the float64 reference; victim alone == in batches at
    the dispatch boundaries (front / middle / end); prefill rows == decode rows == a shuffled batch; CUDA graph
    replay == eager (10 rounds); for SPLIT_SAME_BITS_AS_DEFAULT variants, bitwise equal to "default" on every row
    (otherwise: reported, not asserted, and the bits must differ from default's only through the tiles)."""
    B = 65
    cache, bt, pos, q = gpu_setup(B, 4096, seed=21)
    pos[1, 256:512] = -1
    pos[2, 1::5] = -1
    pos[3, :] = -1
    sc = 1 / math.sqrt(576)
    sink = torch.linspace(-1, 1, GPU_H, device="cuda")
    req = torch.arange(B, dtype=torch.int32, device="cuda")
    kw = dict(attn_sink=sink, variant=variant)
    full = variant_read(q, cache, bt, req, pos, sc, **kw)
    ws = kc.gather_kv(cache, bt, req[:6], pos[:6])
    ro, rl = sparse_attention_ref(q[:6].cpu(), ws.view(-1, 576).cpu(), kc.workspace_indices(pos[:6]).cpu(), sc,
                                  attn_sink=sink.cpu(), return_fp64=True)
    assert torch.allclose(full[0][:6].cpu().double(), ro, atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(rl)
    assert torch.allclose(full[1][:6].cpu().double()[fin], rl[fin], atol=1e-3, rtol=1e-4)
    default = sa.sparse_mla_attention(q, cache, bt, req, pos, sc, attn_sink=sink, backend="triton_fp8_split")
    same = torch.equal(full[0].view(torch.int16), default[0].view(torch.int16)) and torch.equal(full[1], default[1])
    if variant in av.SPLIT_SAME_BITS_AS_DEFAULT:
        n = int((full[0].view(torch.int16) != default[0].view(torch.int16)).sum())
        assert same, f"{variant}: {n} values differ from the default variant (claimed identical arithmetic)"
    else:
        print(f"{variant}: bitwise equal to default: {same}")
    for victim in (0, 2, 64):
        alone = variant_read(q[victim:victim + 1], cache, bt, req[victim:victim + 1],
                             pos[victim:victim + 1], sc, **kw)
        assert torch.equal(alone[0][0], full[0][victim]) and torch.equal(alone[1][0], full[1][victim]), victim
        others = torch.tensor([r for r in range(B) if r != victim], device="cuda")
        for nb in (2, 16, 17, 33, 64, 65):
            for where in sorted({0, nb // 2, nb - 1}):
                f = others[: nb - 1]
                rows = torch.cat([f[:where], torch.tensor([victim], device="cuda"), f[where:]])
                o, l = variant_read(q[rows], cache, bt, req[rows], pos[rows], sc, **kw)
                assert torch.equal(o[where], alone[0][0]) and torch.equal(l[where], alone[1][0]), (victim, nb, where)
    # prefill rows of one request == the same rows as decode rows == a shuffled batch of them
    T = 256
    pp = prefill_positions(pos[0], 4096, T)
    qq = (torch.randn(T, GPU_H, 576, device="cuda") * 0.5).to(torch.bfloat16)
    r0 = torch.zeros(T, dtype=torch.int32, device="cuda")
    pre = variant_read(qq, cache, bt, r0, pp, sc, **kw)
    for t in (0, 100, 255):
        d = variant_read(qq[t : t + 1], cache, bt, r0[:1], pp[t : t + 1], sc, **kw)
        assert torch.equal(d[0][0], pre[0][t]) and torch.equal(d[1][0], pre[1][t]), t
    sel = torch.randperm(T, device="cuda")[:33]
    mixed = variant_read(qq[sel], cache, bt, r0[sel], pp[sel], sc, **kw)
    assert torch.equal(mixed[0], pre[0][sel]) and torch.equal(mixed[1], pre[1][sel])
    # CUDA graph replay == eager, repeated
    gkw = dict(kw, check=False)
    eager = variant_read(q, cache, bt, req, pos, sc, **gkw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            variant_read(q, cache, bt, req, pos, sc, **gkw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, gl = variant_read(q, cache, bt, req, pos, sc, **gkw)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(go, eager[0]) and torch.equal(gl, eager[1])
    assert torch.equal(eager[0], full[0]) and torch.equal(eager[1], full[1])
    # negative control for the victim checks: the batch-dependent split (another CHUNK) changes these rows' bits
    cfg = dict(av.split_variant_config(variant), CHUNK=av.split_variant_config(variant)["CHUNK"] * 4)
    other = av.sparse_mla_attention_fp8_split_variant(q[:8], cache, bt, req[:8], pos[:8], sc, attn_sink=sink,
                                                      config=cfg)
    assert not torch.equal(other[0], full[0][:8]), "another CHUNK gave the same bits: the control proves nothing"


@pytest.mark.gpu
@pytest.mark.parametrize("S", MERGE_PIECES)
def test_gpu_merge_tile_does_not_change_bits(S):
    """The merge is elementwise per (row, head, column) in a fixed piece order: another tile (heads per program)
    must give the same bits; this is what allows switching to MERGE_BH_SMALL without changing any result."""
    _need()
    g = torch.Generator().manual_seed(13)
    Q, H = 200, 64
    o = (torch.randn(Q, S, H, 512, generator=g) * 2).to(torch.bfloat16).cuda()
    lse = (torch.randn(Q, S, H, generator=g) * 3 + 5).cuda()
    lse[5, 1] = math.inf  # an empty piece
    sink = torch.linspace(-2, 2, H, device="cuda")
    a = fd.merge_pieces(o, lse, sink, bh=fd.MERGE_BH)
    b = fd.merge_pieces(o, lse, sink, bh=av.MERGE_BH_SMALL)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
