"""Batch-invariant block-FP8 GEMM (zerodiff.ops.fp8_gemm)."""

import pytest
import torch

from bitwise import assert_batch_dependent, assert_bitwise_equal, assert_victims_in_batch, victim_batches
from gpu_inputs import CPU_MS, GPU_MS
from zerodiff import backends
from zerodiff.ops import fp8_gemm as fg
from zerodiff.ops.fp8_quant import Fp8Weight, quant_act
from zerodiff.reference.fp8_gemm import fp8_gemm_ref, fp8_linear_ref


def _operands(g, M, N, K, device="cpu"):
    x = (torch.randn(M, K, generator=g) * 2).to(torch.bfloat16)
    x[0, :5] = -0.0
    if M > 1:
        x[1, : min(K, 128)] = 1e-39  # denormal group (scale from the plateau)
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    w[:, :3] = 0.0
    x, w = x.to(device), w.to(device)
    fw = Fp8Weight.from_master(w, backend="triton" if device != "cpu" else "reference")
    q, s = quant_act(x, backend="triton" if device != "cpu" else "reference")
    return x, w, fw, q, s


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_triton_equals_reference_bitwise(seeded, out_dtype):
    g = seeded()
    for (M, N, K) in ((33, 200, 300), (5, 128, 256)):
        x, w, fw, q, s = _operands(g, M, N, K)
        o = fg.fp8_gemm(q, s, fw.q, fw.scale, out_dtype=out_dtype, backend="triton")
        r = fp8_gemm_ref(q, s, fw.q, fw.scale, out_dtype)
        assert o.dtype == out_dtype
        assert_bitwise_equal(o, r, f"M, N, K = {M}, {N}, {K}")


def test_fp8_linear_matches_reference(seeded):
    g = seeded()
    x, w, fw, q, s = _operands(g, 17, 130, 256)
    o = fg.fp8_linear(x, fw, backend="triton")
    assert_bitwise_equal(o, fp8_linear_ref(x, fw.q, fw.scale), "fp8_linear vs its reference")
    # and stays close to the BF16 product (sanity of the scale handling)
    exact = x.double() @ w.double().T
    rel = (o.double() - exact).norm() / exact.norm()
    assert rel < 0.08


def test_victim_in_batch(seeded):
    g = seeded()
    N, K = 136, 256
    _, _, fw, _, _ = _operands(g, 1, N, K)
    pool = (torch.randn(70, K, generator=g) * 3).to(torch.bfloat16)
    victims = pool[:3]
    alone = [fg.fp8_linear(victims[i : i + 1], fw, backend="triton") for i in range(3)]
    fill = lambda M, rnd: (torch.randn(M, K, generator=g) * (1 + rnd)).to(torch.bfloat16)  # noqa: E731
    for rnd, _, pos, b in victim_batches(victims, CPU_MS, fill):
        assert_victims_in_batch(fg.fp8_linear(b, fw, backend="triton"), alone, pos, f"round {rnd}")


def test_grouped_rows_equal_dense(seeded):
    g = seeded()
    E, N, K = 3, 128, 256
    w = (torch.randn(E, N, K, generator=g) * 0.05).to(torch.bfloat16)
    fw = Fp8Weight.from_master(w)
    x = (torch.randn(3 * fg.BLOCK_M, K, generator=g)).to(torch.bfloat16)
    q, s = quant_act(x)
    te = torch.tensor([2, -1, 0], dtype=torch.int32)
    out = torch.full((x.shape[0], N), 7.0).to(torch.bfloat16)
    fg.grouped_fp8_gemm(q, s, fw.q, fw.scale, te, backend="triton", out=out)
    B = fg.BLOCK_M
    d2 = fg.fp8_gemm(q[:B], s[:B], fw.q[2], fw.scale[2], backend="triton")
    d0 = fg.fp8_gemm(q[2 * B :], s[2 * B :], fw.q[0], fw.scale[0], backend="triton")
    assert_bitwise_equal(out[:B], d2, "tile 0 (expert 2)")
    assert_bitwise_equal(out[2 * B :], d0, "tile 2 (expert 0)")
    assert bool((out[B : 2 * B] == 7.0).all()), "skipped tiles must be left untouched"
    r = fg.grouped_fp8_gemm(q, s, fw.q, fw.scale, te, backend="reference")
    assert_bitwise_equal(r[:B], d2, "reference tile 0 (expert 2)")
    assert_bitwise_equal(r[2 * B :], d0, "reference tile 2 (expert 0)")


def test_config_depends_on_n_k_only():
    assert fg.gemm_config(4096, 7168) == fg.gemm_config(4096, 7168)
    assert fg.gemm_config(4096, 7168)["BLOCK_K"] == 128
    import inspect

    assert list(inspect.signature(fg.gemm_config).parameters) == ["N", "K"]


def test_bad_inputs_and_fail_closed(seeded):
    g = seeded()
    x, w, fw, q, s = _operands(g, 4, 128, 256)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fg.fp8_gemm(q.float(), s, fw.q, fw.scale)
    with pytest.raises(ValueError, match="a_scale"):
        fg.fp8_gemm(q, s[:, :1], fw.q, fw.scale)
    with pytest.raises(ValueError, match="K mismatch"):
        fg.fp8_gemm(q[:, :128], s[:, :1], fw.q, fw.scale)
    with pytest.raises(ValueError, match="backend"):
        fg.fp8_gemm(q, s, fw.q, fw.scale, backend="cublas")
    # DeepGEMM is never silently used: on the CPU it is refused with the reason
    with pytest.raises(RuntimeError, match="deepgemm"):
        fg.fp8_gemm(q, s, fw.q, fw.scale, backend="deepgemm")
    ok, why = fg.deepgemm_verdict(128, 256, "cpu")
    assert not ok and why
    assert fg.selected_backend(128, 256, "cpu") == "reference"


def test_negative_control_blockwise_order_matters(seeded):
    """Dequantise-then-one-FP32-matmul (a different accumulation structure) must differ from our per-block
    scaled accumulation on the same inputs, so the bitwise test above pins the order."""
    g = seeded()
    x, w, fw, q, s = _operands(g, 33, 200, 512)
    o = fg.fp8_gemm(q, s, fw.q, fw.scale, out_dtype=torch.float32, backend="triton")
    from zerodiff.reference.fp8_quant import dequant_per_token_group_ref, dequant_weight_block_ref

    stock = dequant_per_token_group_ref(q, s) @ dequant_weight_block_ref(fw.q, fw.scale).T
    assert_batch_dependent(o, [("dequantise then one fp32 matmul", stock)], "another accumulation structure")


# ------------------------------------------------------------------------------------------------- GPU
def _gpu_setup(N, K, seed=0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    w = (torch.randn(N, K, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    fw = Fp8Weight.from_master(w)
    pool = (torch.randn(max(GPU_MS) + 3, K, generator=g, device="cuda") * 2).to(torch.bfloat16)
    return w, fw, pool


def _victims_check(fn, pool, label):
    n = pool.shape[0] - 3
    victims = pool[n:]
    alone = [fn(victims[i : i + 1]) for i in range(3)]
    for rnd, _, pos, b in victim_batches(victims, GPU_MS, pool):
        assert_victims_in_batch(fn(b), alone, pos, f"{label}, round {rnd}")


@pytest.mark.gpu
@pytest.mark.parametrize("NK", [(4096, 7168), (7168, 2048), (2048, 7168)])
def test_gpu_triton_victim_in_batch(NK):
    N, K = NK
    w, fw, pool = _gpu_setup(N, K)
    _victims_check(lambda a: fg.fp8_linear(a, fw, backend="triton"), pool, f"triton {NK}")
    # accuracy against the float64 block reference (the MMA block partial is not exact FP32)
    q, s = quant_act(pool[:64])
    o = fg.fp8_gemm(q, s, fw.q, fw.scale, out_dtype=torch.float32, backend="triton")
    r = fp8_gemm_ref(q, s, fw.q, fw.scale, torch.float32)
    assert ((o - r).norm() / r.norm()) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("NK", [(4096, 7168), (7168, 2048)])
def test_gpu_deepgemm_probe_and_invariance(NK):
    N, K = NK
    if backends.deep_gemm() is None:
        pytest.skip(f"DeepGEMM unavailable: {backends.status()['deepgemm']['detail']}")
    w, fw, pool = _gpu_setup(N, K, seed=1)
    ok, why = fg.deepgemm_verdict(N, K, "cuda")
    if not ok:  # fail closed: the backend must refuse, never silently fall back
        with pytest.raises(RuntimeError, match="refused"):
            fg.fp8_linear(pool[:4], fw, backend="deepgemm")
        pytest.skip(f"DeepGEMM not row-invariant for {NK}: {why} (refusal verified)")
    _victims_check(lambda a: fg.fp8_linear(a, fw, backend="deepgemm"), pool, f"deepgemm {NK}")
    assert fg.selected_backend(N, K, "cuda") in ("deepgemm", "triton")


@pytest.mark.gpu
def test_gpu_negative_control_bf16_matmul_changes_with_m():
    """Stock bf16 torch.matmul: a row's result changes with M on the H200 (measured from M >= 31)."""
    N, K = 4096, 7168
    w, fw, pool = _gpu_setup(N, K, seed=2)
    v = pool[-1:]
    alone = v @ w.T

    def runs():
        for M in GPU_MS[1:]:
            b = pool[:M].clone()
            b[M - 1] = v[0]
            yield f"at {M - 1} of {M}", (b @ w.T)[M - 1 : M]

    assert_batch_dependent(alone, runs(), "stock bf16 torch.matmul")
