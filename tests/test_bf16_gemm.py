"""Fixed-order BF16 GEMM (zerodiff.ops.bf16_gemm)."""

import inspect

import pytest
import torch

from bitwise import assert_batch_dependent, assert_bitwise_equal, assert_victims_in_batch, victim_batches
from gpu_inputs import CPU_MS, GPU_MS
from zerodiff.ops.bf16_gemm import bf16_gemm, gemm_config
from zerodiff.reference.bf16_gemm import bf16_gemm_ref


def _xw(g, M, N, K):
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    x[0, :4] = -0.0
    x[-1, 4:8] = 1e-39
    w = (torch.randn(N, K, generator=g) * 0.1).to(torch.bfloat16)
    return x, w


def test_config_from_n_k_only():
    assert list(inspect.signature(gemm_config).parameters) == ["N", "K"]
    c = gemm_config(64, 7168)
    assert c["SPLIT"] > 1 and c["K_PER_SPLIT"] % c["BLOCK_K"] == 0
    assert c["SPLIT"] * c["K_PER_SPLIT"] >= 7168 > (c["SPLIT"] - 1) * c["K_PER_SPLIT"]
    assert gemm_config(129280, 4096)["SPLIT"] == 1


@pytest.mark.parametrize("NK", [(64, 1024), (200, 300), (600, 128)])
def test_close_to_reference_and_out_dtypes(seeded, NK):
    g = seeded()
    N, K = NK
    x, w = _xw(g, 17, N, K)
    o32 = bf16_gemm(x, w, out_dtype=torch.float32, backend="triton")
    r = bf16_gemm_ref(x, w, torch.float32)
    assert torch.allclose(o32, r, rtol=1e-5, atol=1e-5)
    ob = bf16_gemm(x, w, backend="triton")
    assert_bitwise_equal(ob, o32.to(torch.bfloat16), "bf16 out = one rounding of the fp32 out")


def test_victim_in_batch(seeded):
    g = seeded()
    N, K = 64, 1024  # SPLIT > 1 path
    assert gemm_config(N, K)["SPLIT"] > 1
    _, w = _xw(g, 1, N, K)
    v = torch.randn(3, K, generator=g).to(torch.bfloat16)
    alone = [bf16_gemm(v[i : i + 1], w, out_dtype=torch.float32, backend="triton") for i in range(3)]
    fill = lambda M, rnd: (torch.randn(M, K, generator=g) * (1 + rnd)).to(torch.bfloat16)  # noqa: E731
    for rnd, _, pos, b in victim_batches(v, CPU_MS, fill):
        o = bf16_gemm(b, w, out_dtype=torch.float32, backend="triton")
        assert_victims_in_batch(o, alone, pos, f"round {rnd}")


def test_bad_inputs():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        bf16_gemm(x.float(), torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K mismatch"):
        bf16_gemm(x, torch.zeros(8, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        bf16_gemm(x, torch.zeros(8, 64, dtype=torch.bfloat16), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="backend"):
        bf16_gemm(x, torch.zeros(8, 64, dtype=torch.bfloat16), backend="cublas")


def test_negative_control_other_split_differs(seeded):
    """Summing the same products with another K split (what an M-chosen split-K would do) changes bits."""
    g = seeded()
    x, w = _xw(g, 16, 64, 1024)
    o = bf16_gemm(x, w, out_dtype=torch.float32, backend="triton")
    xf, wf = x.float(), w.float()
    other = xf[:, :512] @ wf[:, :512].T + xf[:, 512:] @ wf[:, 512:].T
    other2 = sum(xf[:, i : i + 64] @ wf[:, i : i + 64].T for i in range(0, 1024, 64))
    assert_batch_dependent(o, [("two K halves", other), ("sixteen K blocks of 64", other2)], "another K split")


@pytest.mark.gpu
@pytest.mark.parametrize("NK", [(64, 4096), (64, 7168), (129280, 4096)])
def test_gpu_victim_in_batch(NK):
    N, K = NK
    g = torch.Generator(device="cuda")
    g.manual_seed(3)
    w = (torch.randn(N, K, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    Ms = GPU_MS if N < 100000 else (1, 2, 16, 17, 33, 65, 128, 1000)
    pool = torch.randn(max(Ms) + 3, K, generator=g, device="cuda").to(torch.bfloat16)
    v = pool[-3:]
    alone = [bf16_gemm(v[i : i + 1], w) for i in range(3)]
    for rnd, _, pos, b in victim_batches(v, Ms, pool):
        assert_victims_in_batch(bf16_gemm(b, w), alone, pos, f"N, K = {NK}, round {rnd}")
    r = bf16_gemm_ref(pool[:8], w, torch.float32)
    assert torch.allclose(bf16_gemm(pool[:8], w, out_dtype=torch.float32), r, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_negative_control_matmul():
    g = torch.Generator(device="cuda")
    g.manual_seed(4)
    w = (torch.randn(4096, 7168, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    pool = torch.randn(4097, 7168, generator=g, device="cuda").to(torch.bfloat16)
    alone = pool[-1:] @ w.T

    def runs():
        for M in GPU_MS[1:]:
            b = pool[:M].clone()
            b[0] = pool[-1]
            yield f"at 0 of {M}", (b @ w.T)[:1]

    assert_batch_dependent(alone, runs(), "stock bf16 matmul")
