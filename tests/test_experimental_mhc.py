"""mHC projection variants that did not ship (zerodiff.experimental.mhc_variants): registry, victim-in-batch,
accuracy, negative controls, and that the shipped path never depends on them.

CPU tests run the kernels through the interpreter on small shapes (H = 256 / 512); ``gpu`` tests verify every
named variant at the DeepSeek-V4 shape (H = 7168).
"""

import pytest
import torch
from bitwise import assert_batch_dependent, assert_bitwise_equal, assert_victim_in_batch, bits
from mhc_cases import (GPU_TS, N_HC, NM, PRE_KW, assert_close_bf16, bf16_ulps, gpu_case, head_weights,
                       projection_error, streams, weights)

from zerodiff import _triton as zt
from zerodiff.baselines import mhc as stock
from zerodiff.experimental import mhc_variants as xm
from zerodiff.ops import mhc
from zerodiff.reference import mhc as ref

needs_triton = pytest.mark.skipif(not zt.HAVE_TRITON, reason="triton not installed")

# configurations outside the registry, built as PrenormVariant objects (the variant= argument takes them):
# other split counts and the 3-pass TF32 precision, so the CPU tests cover more than the registered names
TEST_ONLY_VARIANTS = {
    "ieee_s16": xm.PrenormVariant("ieee_s16", 16, "ieee", block_m=16),
    "tf32_s32": xm.PrenormVariant("tf32_s32", 32, "tf32", warps=8),
    "bf16x3_s16": xm.PrenormVariant("bf16x3_s16", 16, "bf16x3", warps=8),
    "tf32x3_s32": xm.PrenormVariant("tf32x3_s32", 32, "tf32x3", warps=8),
}
# variants exercised on the interpreter: one per precision, split counts that differ at K = 2048
CPU_VARIANTS = ("ieee_s16", "tf32_s32", "bf16x3_s112", "tf32x3_s32")
CPU_HEAD_VARIANTS = ("bf16x3_s112",)
# (T, position) of the split-K partials across row-block boundaries: 65 is two row blocks of 64 (ieee: 5 of 16)
PARTIAL_SLOTS = ((17, 0), (65, 64), (17, 16), (65, 31))
GPU_VARIANTS = tuple(xm.VARIANTS)
GPU_GRAPH_VARIANTS = ("tf32_s112", "bf16x3_s32")


def _tv(name):
    """A variant by name: the registry's, else one of TEST_ONLY_VARIANTS."""
    return xm.VARIANTS.get(name) or TEST_ONLY_VARIANTS[name]


def _all_bits(outs):
    """One int64 vector of the bits of every output (outputs of different dtypes compared at once)."""
    return torch.cat([bits(o).flatten().to(torch.int64) for o in outs])


def _variant_run(name, res, fn, scale, base):
    out = xm.mhc_pre(res, fn, scale, base, backend="triton", variant=_tv(name), **PRE_KW)
    mix, sq = xm.prenorm_gemm_splitk(res, fn, _tv(name))
    return out, mix, sq


def test_variant_registry_split_counts():
    assert mhc.DEFAULT_VARIANT not in xm.VARIANTS  # the registry holds the runners-up only
    assert xm.SHIPPED == xm.PrenormVariant("bf16x3_s112_e1", 112, "bf16x3", warps=8, epi_warps=1)
    for name, v in xm.VARIANTS.items():
        for H in (256, 512, 4096, 7168):
            K = N_HC * H
            S, bps = xm.variant_splits(K, name)
            nblocks = -(-K // v.block_k)
            assert S * bps == nblocks and 1 <= S <= max(v.splits, 1), (name, H, S, bps)
    # DeepSeek-V4 (H 7168): the requested counts are used exactly; H 4096 rounds to whole blocks
    assert xm.variant_splits(4 * 7168, "tf32_s112") == (112, 4)
    assert xm.variant_splits(4 * 7168, _tv("bf16x3_s16")) == (16, 28)
    assert xm.variant_splits(4 * 4096, "bf16x3_s112") == (64, 4)
    assert xm.variant_splits(4 * 7168, xm.SHIPPED) == mhc.split_count(4 * 7168)
    with pytest.raises(ValueError, match="unknown variant"):
        xm.variant_splits(1024, "tf32_s7")


@needs_triton
def test_shipped_configuration_as_a_variant_is_the_shipped_op(seeded):
    """The variant path with the shipped configuration gives the shipped op's bits (same kernels, same launch)."""
    g = seeded()
    H = 256
    fn, scale, base = weights(g, H)
    res = streams(g, 6, H)
    a = mhc.mhc_pre(res, fn, scale, base, backend="triton", **PRE_KW)
    b = xm.mhc_pre(res, fn, scale, base, backend="triton", variant=xm.SHIPPED, **PRE_KW)
    for name, x, y in zip(("layer_input", "post", "comb"), a, b):
        assert_bitwise_equal(x, y, f"shipped config through the variant path: {name}")
    hfn, hscale, hbase = head_weights(g, H)
    assert_bitwise_equal(xm.hc_head(res, hfn, hscale, hbase, backend="triton", variant=xm.SHIPPED),
                         mhc.hc_head(res, hfn, hscale, hbase, backend="triton"), "hc_head")


@needs_triton
@pytest.mark.parametrize("name", CPU_VARIANTS)
def test_triton_variant_victim_in_batch(seeded, name):
    g = seeded()
    H = 512  # K = 2048 = 32 blocks of 64: 16 or 32 splits
    fn, scale, base = weights(g, H)
    victim = streams(g, 1, H, adversarial=False)
    (alone, mix_a, sq_a) = _variant_run(name, victim, fn, scale, base)
    S, _ = xm.variant_splits(N_HC * H, _tv(name))
    assert mix_a.shape == (S, 1, NM) and sq_a.shape == (S, 1)
    # close to the float64 reference (the interpreter computes tf32 / bf16 products in fp32)
    r = ref.mhc_pre_ref(victim, fn, scale, base, sinkhorn_iters=3)
    assert torch.allclose(alone[1], r[1], rtol=2e-6, atol=1e-6)
    assert torch.allclose(alone[2], r[2], rtol=2e-5, atol=1e-6)
    # the whole op at small T (the epilogue is one program per row: nothing crosses rows) ...
    batch = streams(g, 9, H)
    batch[8] = victim[0]
    out, mix, sq = _variant_run(name, batch, fn, scale, base)
    for nm_, a, b in zip(("layer_input", "post", "comb"), out, alone):
        assert_victim_in_batch(b, [(f"{name} {nm_} at 8 of T=9", a[8:9])])
    assert_victim_in_batch(mix_a, [(f"{name} partials at 8 of T=9", mix[:, 8:9])])
    # ... and the split-K partials (the only stage that tiles rows) across row-block boundaries
    mixes, sqs = [], []
    for T, pos in PARTIAL_SLOTS:
        batch = streams(g, T, H)
        batch[pos] = victim[0]
        mix, sq = xm.prenorm_gemm_splitk(batch, fn, _tv(name))
        mixes.append((f"{name} at {pos} of T={T}", mix[:, pos:pos + 1]))
        sqs.append((f"{name} at {pos} of T={T}", sq[:, pos:pos + 1]))
    assert_victim_in_batch(mix_a, mixes)
    assert_victim_in_batch(sq_a, sqs)


@needs_triton
def test_triton_variant_negative_control_split_count_matters(seeded):
    """Why the split count must be a function of K only: the same kernel with another split count gives
    the same token other bits (so a T-dependent count would make it batch-dependent)."""
    g = seeded()
    H = 512
    fn, scale, base = weights(g, H)
    assert xm.variant_splits(N_HC * H, _tv("bf16x3_s16"))[0] != xm.variant_splits(N_HC * H, "bf16x3_s112")[0]
    res = streams(g, 8, H, adversarial=False)
    a = xm.mhc_pre(res, fn, scale, base, backend="triton", variant=_tv("bf16x3_s16"), **PRE_KW)
    b = xm.mhc_pre(res, fn, scale, base, backend="triton", variant="bf16x3_s112", **PRE_KW)
    assert_batch_dependent(_all_bits(a), [("16 vs 32 splits", _all_bits(b))], "another split count")
    # and a split-K variant of another precision differs from the shipped op on the same tokens
    d = mhc.mhc_pre(res, fn, scale, base, backend="triton", **PRE_KW)
    e = xm.mhc_pre(res, fn, scale, base, backend="triton", variant=_tv("ieee_s16"), **PRE_KW)
    assert any(not torch.equal(x, y) for x, y in zip(d, e))


@needs_triton
def test_triton_variant_ragged_k_and_small_hc(seeded):
    """K not a multiple of the k-block (masked k path) and hc_mult 2 (8 mixes, 16-wide tile)."""
    g = seeded()
    H = 200  # K = 800 = 12.5 blocks of 64 -> 13 blocks, one split per block
    fn, scale, base = weights(g, H)
    res = streams(g, 4, H)
    assert xm.variant_splits(N_HC * H, _tv("ieee_s16")) == (13, 1)
    mix, sq = xm.prenorm_gemm_splitk(res, fn, _tv("ieee_s16"))
    x = res.reshape(4, -1).double()
    assert torch.allclose(mix.double().sum(0), x @ fn.double().t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(sq.double().sum(0), (x * x).sum(-1), rtol=1e-6)
    mix1, _ = xm.prenorm_gemm_splitk(res[2:3].contiguous(), fn, _tv("ieee_s16"))
    assert_victim_in_batch(mix1, [("ragged-K partials at 2 of T=4", mix[:, 2:3])])
    n2 = 2
    res2 = res[:, :n2].contiguous()
    fn2 = fn[: ref.n_mix(n2), : n2 * H].contiguous()
    li, post, comb = xm.mhc_pre(res2, fn2, scale, base[: ref.n_mix(n2)].contiguous(), backend="triton",
                                variant=_tv("tf32_s32"), **PRE_KW)
    r = ref.mhc_pre_ref(res2, fn2, scale, base[: ref.n_mix(n2)].contiguous(), sinkhorn_iters=3)
    assert torch.allclose(post, r[1], rtol=2e-6, atol=1e-6) and torch.allclose(comb, r[2], rtol=2e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("name", CPU_HEAD_VARIANTS)
def test_triton_hc_head_variant_victim(seeded, name):
    g = seeded()
    H = 512
    fn, scale, base = head_weights(g, H)
    res = streams(g, 4, H)
    out = xm.hc_head(res, fn, scale, base, backend="triton", variant=name)
    r = ref.hc_head_ref(res, fn, scale, base)
    ulp = bf16_ulps(out, r)
    assert ulp.max() <= 1 and (ulp != 0).float().mean() < 0.02
    alone = xm.hc_head(res[2:3].contiguous(), fn, scale, base, backend="triton", variant=name)
    batch = streams(g, 5, H)
    batch[4] = res[2]
    assert_victim_in_batch(alone, [(f"hc_head {name} at 4 of T=5",
                                    xm.hc_head(batch, fn, scale, base, backend="triton", variant=name)[4:5])])
    mix_a, sq_a = xm.prenorm_gemm_splitk(res[2:3].contiguous(), fn, name)
    for T, pos in ((17, 0), (65, 64)):  # the projection partials across the row-block boundary
        batch = streams(g, T, H)
        batch[pos] = res[2]
        mix, sq = xm.prenorm_gemm_splitk(batch, fn, name)
        assert_victim_in_batch(mix_a, [(f"hc_head {name} partials at {pos} of T={T}", mix[:, pos:pos + 1])])
        assert_victim_in_batch(sq_a, [(f"hc_head {name} sqrsum at {pos} of T={T}", sq[:, pos:pos + 1])])


def test_bad_variants_raise_clear_errors():
    H = 64
    g = torch.Generator().manual_seed(0)
    fn, scale, base = weights(g, H)
    res = streams(g, 4, H)
    cases = [
        (lambda: xm.mhc_pre(res, fn, scale, base, variant="bf16x3_s7"), "unknown variant"),
        (lambda: xm.mhc_pre(res, fn, scale, base, variant="fp32_s1"), "unknown variant"),  # deleted
        (lambda: xm.hc_head(res, fn[:4], scale[:1], base[:4], variant=3), "unknown variant"),
        (lambda: xm.mhc_pre(res, fn, scale, base, variant=xm.PrenormVariant("x", 0, "tf32")), "splits"),
        (lambda: xm.mhc_pre(res, fn, scale, base, variant=xm.PrenormVariant("x", 4, "fp16")), "precision"),
        (lambda: xm.mhc_pre(res, fn, scale, base, variant=xm.PrenormVariant("x", 4, "tf32", block_m=24)),
         "block_m"),
        (lambda: xm.mhc_pre(res, fn, scale, base, variant=xm.PrenormVariant("x", 4, "tf32", epi_warps=3)),
         "epi_warps"),
        (lambda: xm.mhc_pre(res.float(), fn, scale, base, variant="tf32_s112"), "residual must be a bf16"),
    ]
    for fn_call, text in cases:
        with pytest.raises(ValueError, match=text):
            fn_call()
    with pytest.raises(TypeError):
        mhc.mhc_pre(res, fn, scale, base, variant="tf32_s112")  # the shipped op has no variant switch


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_VARIANTS)
def test_gpu_variant_victim_in_batch_accuracy_and_control(name):
    """Every named variant: victim-in-batch for T = 1..1000 at several positions (2 rounds), projection
    accuracy against float64, outputs close to the reference, and the stock split-from-T negative control
    on the same victim."""
    H = 7168
    v = xm.VARIANTS[name]
    g, fn, scale, base, victim = gpu_case(H, 21)
    alone = xm.mhc_pre(victim, fn, scale, base, variant=name)
    for rnd in range(2):
        for T in GPU_TS:
            batch = streams(g, T, H, "cuda")
            positions = sorted({0, T // 2, T - 1, (37 * rnd + 5) % T})
            for pos in positions:
                batch[pos] = victim[0]
            out = xm.mhc_pre(batch, fn, scale, base, variant=name)
            for pos in positions:
                for nm_, a, b in zip(("layer_input", "post", "comb"), out, alone):
                    assert_bitwise_equal(a[pos], b[0], f"{name} {nm_}: victim at {pos} of T={T}, round {rnd}")
    # accuracy (tf32 rounds the weights to 10 mantissa bits; the others keep fp32-class products)
    res = streams(g, 64, H, "cuda", adversarial=False)
    mix, sq = xm.prenorm_gemm_splitk(res, fn, name)
    err, sq_err = projection_error(mix.cpu(), sq.cpu(), res.cpu(), fn.cpu())
    bound = 2.0**-8 if v.precision == "tf32" else 2.0**-12
    assert err < bound, f"{name}: projection error {err:.3g} of sum|x*w| (bound {bound:.3g})"
    assert sq_err < 2.0**-12, f"{name}: sqrsum relative error {sq_err:.3g}"
    li, post, comb = xm.mhc_pre(res, fn, scale, base, variant=name)
    li_r, post_r, comb_r = ref.mhc_pre_ref(res.cpu(), fn.cpu(), scale.cpu(), base.cpu())
    p_atol, c_atol = (2e-4, 2e-3) if v.precision == "tf32" else (1e-5, 1e-5)
    assert torch.allclose(post.cpu(), post_r, rtol=1e-4, atol=p_atol), \
        f"{name}: post max diff {(post.cpu() - post_r).abs().max().item():.3g}"
    assert torch.allclose(comb.cpu(), comb_r, rtol=1e-4, atol=c_atol), \
        f"{name}: comb max diff {(comb.cpu() - comb_r).abs().max().item():.3g}"
    # TF32 variants: the mixing weights carry TF32's input rounding (projection bound 2^-8, not 2^-12), so the
    # row-mean term of the layer-input tolerance is 2^-6 (docs/benchmarks.md records the measured outliers)
    assert_close_bf16(li.cpu(), li_r, mean_frac=2.0**-6 if v.precision == "tf32" else 2.0**-8)
    # negative control on the same victim: the stock split count from T changes its bits, ours does not
    big = streams(g, 1000, H, "cuda")
    big[500] = victim[0]
    a = stock.mhc_pre_split_baseline(victim, fn, scale, base)
    b = stock.mhc_pre_split_baseline(big, fn, scale, base)
    n_diff = sum((x[0] != y[500]).sum().item() for x, y in zip(a, b))
    assert n_diff > 0, "negative control failed: the stock split gave the same bits at T=1 and T=1000"
    ours = xm.mhc_pre(big, fn, scale, base, variant=name)
    for nm_, x, y in zip(("layer_input", "post", "comb"), ours, alone):
        assert_bitwise_equal(x[500], y[0], f"{name} {nm_}: victim at 500 of T=1000 (control inputs)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_VARIANTS)
def test_gpu_hc_head_variant_victim(name):
    H = 7168
    g = torch.Generator().manual_seed(22)
    fn, scale, base = head_weights(g, H, "cuda")
    victim = streams(g, 1, H, "cuda", adversarial=False)
    alone = xm.hc_head(victim, fn, scale, base, variant=name)
    assert_close_bf16(alone.cpu(), ref.hc_head_ref(victim.cpu(), fn.cpu(), scale.cpu(), base.cpu()))
    for rnd in range(2):
        for T in GPU_TS:
            batch = streams(g, T, H, "cuda")
            pos = (7 * rnd + T // 3) % T
            batch[pos] = victim[0]
            assert_bitwise_equal(xm.hc_head(batch, fn, scale, base, variant=name)[pos], alone[0],
                                 f"hc_head {name}: victim at {pos} of T={T}, round {rnd}")
    # negative control: a torch fp32 eager projection (cuBLAS) gives other mixing logits than the variant
    batch = streams(g, 64, H, "cuda")
    eager = batch.reshape(64, -1).float() @ fn.t()
    mix, _ = xm.prenorm_gemm_splitk(batch, fn, name)
    assert not torch.equal(eager, mix.sum(0)), f"negative control: eager projection matched {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_GRAPH_VARIANTS)
def test_gpu_variant_cuda_graph_replay_equals_eager(name):
    H = 7168
    g, fn, scale, base, _ = gpu_case(H, 23)
    res = streams(g, 64, H, "cuda")
    eager = xm.mhc_pre(res, fn, scale, base, variant=name)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            xm.mhc_pre(res, fn, scale, base, variant=name)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = xm.mhc_pre(res, fn, scale, base, variant=name)
    for rnd in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for nm_, a, b in zip(("layer_input", "post", "comb"), out, eager):
            assert_bitwise_equal(a, b, f"{name} graph replay {rnd}: {nm_}")
