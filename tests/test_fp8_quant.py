"""FP8 quantisation (zerodiff.ops.fp8_quant) against the deployment rule (zerodiff.reference.fp8_quant)."""

import pytest
import torch

from bitwise import assert_batch_dependent, assert_bitwise_equal, assert_victim_in_batch
from zerodiff.ops.fp8_quant import Fp8Weight, quant_act, quant_weight
from zerodiff.reference import fp8_quant as ref

U8 = torch.uint8


def _adversarial_act(g, M=6, K=300):
    x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
    x[0, :128] = 0.0  # all-zero group -> EPS scale
    x[0, 128:140] = -0.0
    x[1, :128] = torch.tensor(1e-39).to(torch.bfloat16)  # denormal plateau (tie in amax)
    x[1, 128:256] = -torch.tensor(1e-39).to(torch.bfloat16)
    x[2, :] = 7.0  # plateau / ties
    x[2, 5] = -7.0
    x[3, :64] = 3.0e38  # huge: scale near the fp32 range top
    x[4, 10] = 448.0
    x[4, 11] = -448.0 * 1.5
    x[5, ::7] = 2.0**-133  # bf16 denormals mixed with normal values
    return x


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quant_act_triton_matches_rule(seeded, ue8m0):
    g = seeded()
    for x in (_adversarial_act(g), (torch.randn(5, 256, generator=g) * 0.01).to(torch.bfloat16),
              torch.randn(3, 200, generator=g).to(torch.float32)):
        q, s = quant_act(x, ue8m0=ue8m0, backend="triton")
        q2, s2 = ref.quant_per_token_group_ref(x, 128, ue8m0)
        assert_bitwise_equal(q.view(U8), q2.view(U8), f"q, {tuple(x.shape)} {x.dtype}")
        assert_bitwise_equal(s, s2, f"scale, {tuple(x.shape)} {x.dtype}")
        if ue8m0:
            bits = s.view(torch.int32)
            assert bool(((bits & 0x7FFFFF) == 0).all()), "ue8m0 scales must be powers of two"


def test_quant_act_row_invariant(seeded):
    g = seeded()
    x = _adversarial_act(g, M=40, K=256)
    qa, sa = quant_act(x, backend="triton")
    for M in (1, 2, 17, 33):
        for pos in (0, M // 2, M - 1):
            batch = torch.randn(M, 256, generator=g).to(torch.bfloat16) * 5
            batch[pos] = x[7]
            q, s = quant_act(batch, backend="triton")
            assert_victim_in_batch(qa[7].view(U8), [(f"q at {pos} of {M}", q[pos].view(U8))])
            assert_victim_in_batch(sa[7], [(f"scale at {pos} of {M}", s[pos])])


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quant_weight_triton_matches_rule(seeded, ue8m0):
    g = seeded()
    w = (torch.randn(200, 260, generator=g) * 0.02).to(torch.bfloat16)
    w[:128, :128] = 0.0
    w[130, 3] = -0.0
    w[131, 4] = 1e-39
    q, s = quant_weight(w, ue8m0=ue8m0, backend="triton")
    q2, s2 = ref.quant_weight_block_ref(w, 128, ue8m0)
    assert_bitwise_equal(q.view(U8), q2.view(U8), "q")
    assert_bitwise_equal(s, s2, "scale")
    w3 = (torch.randn(3, 256, 130, generator=g) * 0.05).to(torch.bfloat16)
    q3, s3 = quant_weight(w3, ue8m0=ue8m0, backend="triton")
    assert q3.shape == (3, 256, 130) and s3.shape == (3, 2, 2)
    for e in range(3):
        qe, se = ref.quant_weight_block_ref(w3[e], 128, ue8m0)
        assert_bitwise_equal(q3[e].view(U8), qe.view(U8), f"expert {e} q")
        assert_bitwise_equal(s3[e], se, f"expert {e} scale")
    # reference backend gives the same thing
    q4, s4 = quant_weight(w3, ue8m0=ue8m0, backend="reference")
    assert_bitwise_equal(q4.view(U8), q3.view(U8), "reference backend q")
    assert_bitwise_equal(s4, s3, "reference backend scale")


def test_requantize_in_place(seeded):
    g = seeded()
    w = (torch.randn(256, 256, generator=g) * 0.05).to(torch.bfloat16)
    fw = Fp8Weight.from_master(w, backend="triton")
    pq, ps = fw.q.data_ptr(), fw.scale.data_ptr()
    w2 = (torch.randn(256, 256, generator=g) * 0.07).to(torch.bfloat16)
    fw.requantize_(w2, backend="triton")
    assert fw.q.data_ptr() == pq and fw.scale.data_ptr() == ps
    q2, s2 = ref.quant_weight_block_ref(w2)
    assert_bitwise_equal(fw.q.view(U8), q2.view(U8), "requantised q")
    assert_bitwise_equal(fw.scale, s2, "requantised scale")
    with pytest.raises(ValueError, match="requantize_"):
        fw.requantize_(w2[:128])


def test_bad_inputs():
    with pytest.raises(ValueError, match="x must be"):
        quant_act(torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        quant_act(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="N % 128"):
        quant_weight(torch.zeros(2, 100, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="block"):
        quant_weight(torch.zeros(128, 128, dtype=torch.bfloat16), block=64)
    with pytest.raises(ValueError, match="backend"):
        quant_act(torch.zeros(2, 128, dtype=torch.bfloat16), backend="cuda")


def test_negative_control_reciprocal_rule_differs(seeded):
    """A common stock rule (x * (1/scale), amax clamped at 1e-4) must differ from ours on the same inputs,
    otherwise the bitwise comparison above would not discriminate between rules."""
    g = seeded()
    x = (torch.randn(64, 256, generator=g) * 3).to(torch.bfloat16)
    x[::4] = (x[::4].float() * 1e-6).to(torch.bfloat16)  # small-magnitude tokens: the EPS clamp matters
    q, s = quant_act(x, backend="triton")
    xf = x.float().view(64, 2, 128)
    sf = xf.abs().amax(-1).clamp(min=1e-4) / 448.0
    q_stock = (xf * (1.0 / sf[..., None])).to(torch.float8_e4m3fn).view(64, 256)
    assert_batch_dependent(q.view(U8), [("x * (1 / scale), amax >= 1e-4", q_stock.view(U8))], "another rule")


def test_reference_error_bound(seeded):
    g = seeded()
    x = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    q, s = ref.quant_per_token_group_ref(x)
    d = ref.dequant_per_token_group_ref(q, s)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal codes
    err = (d - x.float()).abs()
    bound = x.float().abs() * 2.0**-4 + s.repeat_interleave(128, 1) * 2.0**-9
    assert bool((err <= bound).all())


@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", [False, True])
def test_gpu_quant_matches_rule(ue8m0):
    g = torch.Generator().manual_seed(1)
    x = _adversarial_act(g, M=6, K=7168 + 64).cuda()
    x = torch.cat([x, (torch.randn(4090, 7168 + 64, generator=g) * 4).to(torch.bfloat16).cuda()])
    q, s = quant_act(x, ue8m0=ue8m0, backend="triton")
    q2, s2 = ref.quant_per_token_group_ref(x, 128, ue8m0)
    assert_bitwise_equal(s, s2, "scale")
    assert_bitwise_equal(q.view(U8), q2.view(U8), "q")
    w = (torch.randn(2048 + 64, 7168, generator=g) * 0.02).to(torch.bfloat16).cuda()
    qw, sw = quant_weight(w, ue8m0=ue8m0, backend="triton")
    qw2, sw2 = ref.quant_weight_block_ref(w, 128, ue8m0)
    assert_bitwise_equal(qw.view(U8), qw2.view(U8), "weight q")
    assert_bitwise_equal(sw, sw2, "weight scale")


@pytest.mark.gpu
def test_gpu_quant_act_victim_in_batch():
    g = torch.Generator().manual_seed(2)
    pool = (torch.randn(4096 + 1, 4096, generator=g) * 2).to(torch.bfloat16).cuda()
    qa, sa = quant_act(pool[-1:], backend="triton")
    for _ in range(2):
        for M in (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 1000, 4096):
            for pos in sorted({0, M // 2, M - 1}):
                b = pool[:M].clone()
                b[pos] = pool[-1]
                q, s = quant_act(b, backend="triton")
                assert_victim_in_batch(qa[0].view(U8), [(f"q at {pos} of {M}", q[pos].view(U8))])
                assert_victim_in_batch(sa[0], [(f"scale at {pos} of {M}", s[pos])])
