"""The exact-rounding cast helpers in zerodiff._triton give torch's bits (RNE, saturating e4m3)."""

import pytest
import torch

from zerodiff import _triton as zt

pytestmark = pytest.mark.skipif(not zt.HAVE_TRITON, reason="triton not installed")

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _cast_kernel(x_ptr, bf_ptr, f8_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(bf_ptr + offs, zt.f32_to_bf16_rne(x), mask=m)
        tl.store(f8_ptr + offs, zt.f32_to_e4m3_rne_sat_bits(x), mask=m)


def _inputs(g):
    # every bf16 bit pattern widened to fp32 (exact), plus random fp32 around the e4m3 grid and the
    # adversarial set: exact ties of both roundings, +-0, fp32 denormals, e4m3 subnormals, overflow, inf
    allbf = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    allbf = allbf[~torch.isnan(allbf)]
    rnd = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 10, (20000,), generator=g).float())
    e4 = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = e4[~torch.isnan(e4)]
    mids = (e4[:-1] + e4[1:]) / 2  # exact midpoints between neighbouring e4m3 codes (ties)
    adv = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, 2.0**-10, 2.0**-9 * 1.5, 448.0, 449.0, 464.0,
                        1e30, float("inf"), -float("inf")])
    return torch.cat([allbf, rnd, e4, mids, -mids, adv]).contiguous()


def test_casts_match_torch(seeded):
    x = _inputs(seeded())
    n = x.numel()
    bf = torch.empty(n, dtype=torch.bfloat16)
    f8 = torch.empty(n, dtype=torch.uint8)
    dev_x = x.cuda() if torch.cuda.is_available() else x
    if torch.cuda.is_available():
        bf, f8 = bf.cuda(), f8.cuda()
    BLOCK = 4096
    _cast_kernel[(triton.cdiv(n, BLOCK),)](dev_x, bf, f8, n, BLOCK=BLOCK, **zt.LAUNCH_OPTS)
    assert torch.equal(bf.cpu().view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(f8.cpu(), x.to(torch.float8_e4m3fn).view(torch.uint8))
    # negative control: plain truncation of fp32->bf16 must differ on this input set
    trunc = (x.view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(trunc, x.to(torch.bfloat16).view(torch.int16))
