"""The Triton cast helpers in zerodiff._triton give the reference bits (RNE; e4m3 saturating at +-448).

On the CPU the integer emulation runs through the interpreter; on the GPU both the emulation and the
native casts (``EXACT=False``) are checked.
"""

import pytest
import torch

from bitwise import assert_batch_dependent, assert_bitwise_equal
from zerodiff import _triton as zt
from zerodiff.reference.fp8_quant import e4m3_rne_saturate

pytestmark = pytest.mark.skipif(not zt.HAVE_TRITON, reason="triton not installed")

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _cast_kernel(x_ptr, bf_ptr, f8_ptr, n, BLOCK: tl.constexpr, EXACT: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(bf_ptr + offs, zt.cast_bf16(x, EXACT), mask=m)
        tl.store(f8_ptr + offs, zt.cast_e4m3(x, EXACT).to(tl.uint8, bitcast=True), mask=m)


def _inputs(g):
    # every bf16 bit pattern widened to fp32 (exact), plus random fp32 around the e4m3 grid and the
    # adversarial set: exact ties of both roundings, +-0, fp32 denormals, e4m3 subnormals, overflow, inf
    allbf = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    allbf = allbf[~torch.isnan(allbf)]
    rnd = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 10, (20000,), generator=g).float())
    e4 = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = e4[~torch.isnan(e4)]
    mids = (e4[:-1] + e4[1:]) / 2  # exact midpoints between neighbouring e4m3 codes (ties)
    adv = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, 2.0**-10, 2.0**-9 * 1.5, 448.0, 449.0, 463.9, 464.0,
                        465.0, 1e30, float("inf"), -float("inf")])
    return torch.cat([allbf, rnd, e4, mids, -mids, adv]).contiguous()


def _run(x, exact, device):
    n = x.numel()
    bf = torch.empty(n, dtype=torch.bfloat16, device=device)
    f8 = torch.empty(n, dtype=torch.uint8, device=device)
    BLOCK = 4096
    _cast_kernel[(triton.cdiv(n, BLOCK),)](x.to(device), bf, f8, n, BLOCK=BLOCK, EXACT=exact, **zt.LAUNCH_OPTS)
    return bf.cpu().view(torch.int16), f8.cpu()


def _check(x, bf, f8):
    assert_bitwise_equal(bf, x.to(torch.bfloat16).view(torch.int16), "fp32 -> bf16 (RNE)")
    assert_bitwise_equal(f8, e4m3_rne_saturate(x).view(torch.uint8), "fp32 -> e4m3 (RNE, saturating)")


def test_exact_casts_match_reference(seeded):
    x = _inputs(seeded())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(x, *_run(x, True, device))
    # negative control: plain truncation of fp32->bf16 must differ on this input set
    trunc = (x.view(torch.int32) >> 16).to(torch.int16)
    assert_batch_dependent(x.to(torch.bfloat16).view(torch.int16), [("truncation", trunc)], "another rounding rule")


@pytest.mark.gpu
def test_native_gpu_casts_match_reference(seeded):
    x = _inputs(seeded())
    _check(x, *_run(x, False, "cuda"))
