"""Inputs and tolerances shared by the mHC tests (tests/test_mhc.py, tests/test_experimental_mhc.py)."""

from __future__ import annotations

import torch

from zerodiff.reference import mhc as ref

N_HC = 4
NM = ref.n_mix(N_HC)
# checkpoint-like magnitudes: hc scales ~[2, 0.02, 0.25], small projection weights, O(1) bases
SCALE = [2.0, 0.02, 0.25]
# the epilogue arguments with 3 Sinkhorn rounds (keeps the interpreter fast; the per-row code path is the
# same for any count)
PRE_KW = dict(rms_eps=ref.RMS_EPS, hc_pre_eps=ref.HC_EPS, hc_sinkhorn_eps=ref.HC_EPS,
              hc_post_mult=ref.POST_MULT, sinkhorn_iters=3)
# the same with the model's Sinkhorn rounds
FULL_KW = dict(PRE_KW, sinkhorn_iters=ref.SINKHORN_ITERS)
# token counts of the GPU victim-in-batch tests: every row-block and dispatch boundary up to 1000
GPU_TS = (1, 7, 8, 15, 16, 17, 63, 64, 65, 128, 129, 192, 193, 256, 1000)


def weights(g, H, device="cpu"):
    fn = (torch.randn(NM, N_HC * H, generator=g) * 0.02).to(device)
    scale = torch.tensor(SCALE, dtype=torch.float32).to(device)
    base = (torch.randn(NM, generator=g) * 0.5).to(device)
    return fn, scale, base


def head_weights(g, H, device="cpu"):
    fn = (torch.randn(N_HC, N_HC * H, generator=g) * 0.02).to(device)
    return fn, torch.tensor([0.5], dtype=torch.float32).to(device), (torch.randn(N_HC, generator=g) * 0.5).to(device)


def streams(g, T, H, device="cpu", adversarial=True):
    """Random bf16 residual streams; with ``adversarial`` some rows hold +-0, bf16 denormals, exact
    ties (all streams equal), huge and tiny magnitudes (never zeros only)."""
    r = torch.randn(T, N_HC, H, generator=g) * torch.exp2(torch.randint(-3, 4, (T, 1, 1), generator=g).float())
    if adversarial and T >= 4:
        r[1, :, ::3] = 0.0
        r[1, :, 1::3] = -0.0
        r[2] = r[2, 0:1]  # all streams identical: ties in the aggregation and the projection
        r[3, :, : H // 2] = torch.randn(N_HC, H // 2, generator=g) * 1e-39  # bf16 denormals
        r[3, :, H // 2 :] *= 1e3
    if adversarial and T >= 6:
        r[5] = 0.0  # an all-zero token: sqrsum 0, rms = 1/sqrt(eps), mixes = bases only
    return r.to(torch.bfloat16).to(device)


def gpu_case(H, seed):
    g = torch.Generator().manual_seed(seed)
    fn, scale, base = weights(g, H, "cuda")
    victim = streams(g, 1, H, "cuda", adversarial=False)
    return g, fn, scale, base, victim


def bf16_ulps(a, b):
    """|a - b| in bf16 ulps, elementwise (bit patterns compared as integers; same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_close_bf16(out, ref_out, mean_frac=2.0**-8):
    """Closeness of a BF16 stream aggregate to the float64 reference: 2^-7 relative plus ``mean_frac`` (2^-8) of
    the row's mean magnitude. A pure ulp bound is wrong here: elements near zero come from cancelling sums, where
    the GPU's approximate exp (in the mixing weights) moves the result across many bf16 ulps of a tiny value
    (docs/benchmarks.md records the largest such distance measured)."""
    o, r = out.float(), ref_out.float()
    atol = mean_frac * r.abs().mean(dim=-1, keepdim=True)
    bad = (o - r).abs() > 2.0**-7 * r.abs() + atol
    assert not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} elements outside tolerance"


def projection_error(mix, sq, res, fn):
    """max |sum of partials - exact| / sum |x_k w_mk| over tokens and mixes, and the sqrsum's relative error."""
    x = res.reshape(res.shape[0], -1).double()
    exact = x @ fn.double().t()
    mag = (x.abs() @ fn.double().abs().t()).clamp_min(1e-300)
    err = ((mix.double().sum(0) - exact).abs() / mag).max().item()
    sq_exact = (x * x).sum(-1).clamp_min(1e-300)
    sq_err = ((sq.double().sum(0) - sq_exact).abs() / sq_exact).max().item()
    return err, sq_err
