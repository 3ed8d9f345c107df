"""The vLLM mHC adapters (``zerodiff.integrations.vllm.mhc``): the five DeepSeek-V4 entry points equal the
zerodiff ops, batch invariance with a stock-split negative control, agreement with vLLM's own torch mHC up to
rounding (from the pinned tree, skipped without it), and the refusal of non-BF16 inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zerodiff.integrations import ConfigError
from zerodiff.integrations import vllm as zv

from integration_helpers import cuda_generator

REPO = Path(__file__).resolve().parents[1]


def _mhc_case(g, T=6, n=4, H=64):
    from zerodiff.reference import mhc as mref

    res = (torch.randn(T, n, H, generator=g) * 2).to(torch.bfloat16)
    res[0, 1, :3] = torch.tensor([0.0, -0.0, 1e-40])  # signed zeros and a denormal in the streams
    fn = torch.randn(mref.n_mix(n), n * H, generator=g) * 0.05
    scale = torch.tensor([1.5, 0.5, 0.25])
    base = torch.randn(mref.n_mix(n), generator=g) * 0.1
    return res, fn, scale, base


# rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat: distinct values, so a swapped
# argument in an adapter shows
MHC_ARGS = (1e-6, 0.01, 0.002, 2.0, 20)


def test_vllm_mhc_adapters_are_the_zerodiff_ops(seeded):
    """Each of the five DeepSeek-V4 entry points equals the zerodiff op (composition) the training side runs."""
    from zerodiff.ops import mhc as zmhc

    g = seeded()
    res, fn, scale, base = _mhc_case(g)
    T, n, H = res.shape
    kw = dict(rms_eps=1e-6, hc_pre_eps=0.01, hc_sinkhorn_eps=0.002, hc_post_mult=2.0, sinkhorn_iters=20)
    li, post, comb = zmhc.mhc_pre(res, fn, scale, base, **kw)
    p, c, x = zv.mhc_pre(res, fn, scale, base, *MHC_ARGS, n_splits=7)  # upstream's n_splits is ignored
    assert p.shape == (T, n, 1) and c.shape == (T, n, n) and x.shape == (T, H)
    assert torch.equal(p[..., 0], post) and torch.equal(c, comb) and torch.equal(x, li)
    # leading dims [2, 3, n, H] as upstream's (..., hc_mult, hidden) contract
    p4, c4, x4 = zv.mhc_pre(res.reshape(2, 3, n, H), fn, scale, base, *MHC_ARGS)
    assert p4.shape == (2, 3, n, 1) and torch.equal(x4.reshape(T, H), li)
    # fused RMSNorm = zerodiff's rms_norm of the layer input
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)
    _, _, xn = zv.mhc_pre(res, fn, scale, base, *MHC_ARGS, norm_weight=w, norm_eps=1e-5)
    assert torch.equal(xn, zv.rms_norm(li, w, 1e-5)) and not torch.equal(xn, li)
    # post, fused post+pre, broadcast, head
    y = torch.randn(T, H, generator=g).to(torch.bfloat16)
    new = zv.mhc_post(y, res, p, c)
    assert torch.equal(new, zmhc.mhc_post(y, res, post, comb))
    r2, p2, c2, x2 = zv.mhc_fused_post_pre(y, res, p, c, fn, scale, base, *MHC_ARGS, norm_weight=w)
    q = zmhc.mhc_pre(new, fn, scale, base, **kw)
    assert torch.equal(r2, new) and torch.equal(p2[..., 0], q[1]) and torch.equal(c2, q[2])
    assert torch.equal(x2, zv.rms_norm(q[0], w, 1e-6))
    rb, pb, cb, xb = zv.mhc_pre_broadcast(y, fn, scale, base, *MHC_ARGS, norm_weight=w,
                                          fn_broadcast=torch.full((fn.shape[0], H), float("nan")))
    q = zmhc.mhc_pre(y.unsqueeze(1).repeat(1, n, 1), fn, scale, base, **kw)
    assert all(torch.equal(rb[:, i], y) for i in range(n))  # exact copies; upstream's fn_broadcast unused
    assert torch.equal(pb[..., 0], q[1]) and torch.equal(xb, zv.rms_norm(q[0], w, 1e-6))
    hs, hb = torch.tensor([0.7]), base[:n].contiguous()
    assert torch.equal(zv.hc_head(res, fn[:n].contiguous(), hs, hb, 1e-6, 1e-6),
                       zmhc.hc_head(res, fn[:n].contiguous(), hs, hb, rms_eps=1e-6, hc_eps=1e-6))


def test_vllm_mhc_victim_in_batch_and_stock_control(seeded):
    """A token's mHC outputs through the adapter do not depend on the batch; the stock-style split chosen
    from the token count (what vLLM's TileLang path does) gives the same token other bits at T = 5000."""
    from zerodiff.baselines import mhc as stock_mhc

    g = seeded()
    res, fn, scale, base = _mhc_case(g, T=1, H=256)
    alone = zv.mhc_pre(res, fn, scale, base, *MHC_ARGS)
    for rnd in range(2):
        for T in (2, 17, 64, 129):
            batch, _, _, _ = _mhc_case(g, T=T, H=256)
            pos = (T // 3 + rnd) % T
            batch[pos] = res[0]
            got = zv.mhc_pre(batch, fn, scale, base, *MHC_ARGS)
            assert all(torch.equal(a[pos], b[0]) for a, b in zip(got, alone)), f"T={T} pos={pos}"
    big, _, _, _ = _mhc_case(g, T=5000, H=256)
    big[1234] = res[0]
    skw = dict(n_sms=132, gemm="torch", epilogue="torch", rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6,
               hc_post_mult=2.0, sinkhorn_iters=20)
    a = stock_mhc.mhc_pre_split_baseline(res, fn, scale, base, **skw)
    b = stock_mhc.mhc_pre_split_baseline(big, fn, scale, base, **skw)
    assert any(not torch.equal(x[0], y[1234]) for x, y in zip(a, b)), "stock control did not differ"


_VLLM_MHC_TORCH = REPO / "build" / "sources" / "vllm" / "vllm" / "model_executor" / "kernels" / "mhc" / "torch.py"


@pytest.mark.skipif(not _VLLM_MHC_TORCH.exists(), reason="needs the pinned vLLM tree (make sources)")
def test_vllm_mhc_adapters_match_upstream_torch_semantics(seeded):
    """Argument mapping against vLLM's own pure-torch mHC (loaded from the pinned tree, not copied): same
    outputs up to rounding (post / comb within 1e-6, layer input and post block within one bf16 step)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_mhc_torch", _VLLM_MHC_TORCH)
    up = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(up)
    g = seeded()
    res, fn, scale, base = _mhc_case(g, T=7, H=128)
    p, c, li = zv.mhc_pre(res, fn, scale, base, *MHC_ARGS)
    up_p, up_c, up_li = up.mhc_pre_torch(res, fn, scale, base, *MHC_ARGS)
    assert p.shape == up_p.shape and c.shape == up_c.shape and li.shape == up_li.shape
    assert (p - up_p).abs().max() < 1e-6 and (c - up_c).abs().max() < 1e-6
    assert (li.float() - up_li.float()).abs().max() <= 2 ** -7 * up_li.float().abs().max()
    x = torch.randn(7, 128, generator=g).to(torch.bfloat16)
    ours, theirs = zv.mhc_post(x, res, up_p, up_c).float(), up.mhc_post_torch(x, res, up_p, up_c).float()
    assert ((ours - theirs).abs() <= 2 ** -7 * theirs.abs()).all()  # at most one bf16 rounding step apart


def test_vllm_mhc_refuses_non_bf16(seeded):
    g = seeded()
    res, fn, scale, base = _mhc_case(g)
    with pytest.raises(ConfigError, match="mHC .*bfloat16"):
        zv.mhc_pre(res.float(), fn, scale, base, *MHC_ARGS)
    with pytest.raises(ConfigError, match="broadcast"):
        zv.mhc_pre_broadcast(res[:, 0].float(), fn, scale, base, *MHC_ARGS)


@pytest.mark.gpu
def test_gpu_mhc_adapters_under_torch_compile_and_victim_rows():
    """vLLM's DeepSeek-V4 mHC seam through the adapters (fused post+pre with the fused norm, then the head):
    eager == torch.compile(fullgraph) and a token's outputs alone == inside any batch; negative control: the
    stock-style split chosen from T changes the token (DeepGEMM TF32 GEMM where available)."""
    from zerodiff.baselines import mhc as stock_mhc
    from zerodiff.reference import mhc as mref

    g = cuda_generator(3)
    n, H = 4, 4096
    fn = torch.randn(mref.n_mix(n), n * H, device="cuda", generator=g) * 0.01
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn(mref.n_mix(n), device="cuda", generator=g) * 0.1
    wn = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    hfn, hs, hb = fn[:n].contiguous(), scale[:1].contiguous(), base[:n].contiguous()

    def f(x, res, post, comb):
        r, p, c, li = zv.mhc_fused_post_pre(x, res, post, comb, fn, scale, base, *MHC_ARGS, norm_weight=wn)
        return r, p, c, li, zv.hc_head(r, hfn, hs, hb, 1e-6, 1e-6)

    cf = torch.compile(f, fullgraph=True, dynamic=True)

    def case(T):
        res = torch.randn(T, n, H, device="cuda", generator=g).bfloat16()
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        post = torch.rand(T, n, 1, device="cuda", generator=g) * 2
        comb = torch.softmax(torch.randn(T, n, n, device="cuda", generator=g), -1)
        return x, res, post, comb

    victim = case(1)
    alone = f(*victim)
    for rnd in range(2):
        for T in (2, 15, 16, 17, 64, 65, 128, 1024):
            pos = (T // 3 + rnd) % T
            batch = case(T)
            for b, v in zip(batch, victim):
                b[pos] = v[0]
            for out in (f(*batch), cf(*batch)):
                for name, o, a in zip(("residual", "post", "comb", "layer_input", "head"), out, alone):
                    assert torch.equal(o[pos:pos + 1], a), (name, T, pos, rnd)
    big = torch.randn(5000, n, H, device="cuda", generator=g).bfloat16()
    big[1234] = victim[1][0]
    skw = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult=2.0, sinkhorn_iters=20)
    a = stock_mhc.mhc_pre_split_baseline(victim[1], fn, scale, base, **skw)
    b = stock_mhc.mhc_pre_split_baseline(big, fn, scale, base, **skw)
    assert any(not torch.equal(x[0], y[1234]) for x, y in zip(a, b)), "stock split control did not differ"
