"""Router gate GEMM (zerodiff.ops.router_gemm): FP32 logits, one kernel for every M."""

import pytest
import torch
import torch.nn.functional as F

from bitwise import assert_batch_dependent, assert_bitwise_equal, assert_victims_in_batch, victim_batches
from gpu_inputs import CPU_MS, GPU_MS
from zerodiff.ops.router_gemm import gemm_config, router_gemm
from zerodiff.reference.router_gemm import router_gemm_ref


def test_close_to_reference(seeded):
    g = seeded()
    x = torch.randn(9, 512, generator=g).to(torch.bfloat16)
    w = (torch.randn(48, 512, generator=g) * 0.05).to(torch.bfloat16)
    o = router_gemm(x, w, backend="triton")
    assert o.dtype == torch.float32 and o.shape == (9, 48)
    assert torch.allclose(o, router_gemm_ref(x, w), rtol=1e-5, atol=1e-6)
    assert_bitwise_equal(router_gemm(x, w, backend="reference"), router_gemm_ref(x, w), "reference backend")


def test_victim_in_batch(seeded):
    g = seeded()
    E, H = 32, 768
    w = (torch.randn(E, H, generator=g) * 0.05).to(torch.bfloat16)
    v = torch.randn(3, H, generator=g).to(torch.bfloat16)
    v[0, :16] = -0.0
    v[1, :] = 0.5  # plateau: every logit a tie-prone sum
    alone = [router_gemm(v[i : i + 1], w, backend="triton") for i in range(3)]
    fill = lambda M, rnd: (torch.randn(M, H, generator=g) * (1 + rnd)).to(torch.bfloat16)  # noqa: E731
    for rnd, _, pos, b in victim_batches(v, CPU_MS, fill):
        assert_victims_in_batch(router_gemm(b, w, backend="triton"), alone, pos, f"round {rnd}")


def test_config_and_errors():
    c = gemm_config(256, 7168)
    assert c["SPLIT"] >= 1 and c["BLOCK_N"] == 64
    with pytest.raises(ValueError, match="router_gemm"):
        router_gemm(torch.zeros(2, 64), torch.zeros(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K mismatch"):
        router_gemm(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(4, 32, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("EH", [(256, 4096), (256, 7168)])
def test_gpu_victim_in_batch_and_negative_control(EH):
    E, H = EH
    g = torch.Generator(device="cuda")
    g.manual_seed(5)
    w = (torch.randn(E, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    pool = torch.randn(max(GPU_MS) + 3, H, generator=g, device="cuda").to(torch.bfloat16)
    v = pool[-3:]
    alone = [router_gemm(v[i : i + 1], w) for i in range(3)]
    stock_alone = F.linear(v[:1].float(), w.float())
    stock_runs = []
    for rnd, M, pos, b in victim_batches(v, GPU_MS, pool):
        assert_victims_in_batch(router_gemm(b, w), alone, pos, f"E, H = {EH}, round {rnd}")
        stock = F.linear(b.float(), w.float())[pos[0] : pos[0] + 1]
        stock_runs.append((f"at {pos[0]} of {M}, round {rnd}", stock))
    assert_batch_dependent(stock_alone, stock_runs, "stock FP32 F.linear")
    assert torch.allclose(alone[0], router_gemm_ref(v[:1], w), rtol=1e-4, atol=1e-5)
