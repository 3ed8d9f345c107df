"""The ``zerodiff_vllm::*`` torch custom ops (``zerodiff.integrations.vllm.custom_ops``): they trace with fake
tensors, and on the GPU eager == ``torch.compile(fullgraph)`` with a victim row independent of the batch."""

from __future__ import annotations

import pytest
import torch

from zerodiff.integrations import vllm as zv

from integration_helpers import cuda_generator


def test_vllm_custom_ops_trace_with_fake_tensors(seeded):
    from torch._subclasses.fake_tensor import FakeTensorMode

    zv._ops()
    with FakeTensorMode():
        x = torch.empty(7, 64, dtype=torch.bfloat16)
        w = torch.empty(8, 64, dtype=torch.bfloat16)
        assert torch.ops.zerodiff_vllm.router_logits(x, w).shape == (7, 8)
        y, r = torch.ops.zerodiff_vllm.rms_norm_residual(x, x, torch.empty(64), 1e-6)
        assert y.shape == r.shape == (7, 64)
        res = torch.empty(7, 4, 64, dtype=torch.bfloat16)
        li, post, comb = torch.ops.zerodiff_vllm.mhc_pre(res, torch.empty(24, 256), torch.empty(3), torch.empty(24),
                                                         1e-6, 1e-6, 1e-6, 2.0, 20)
        assert li.shape == (7, 64) and post.shape == (7, 4) and comb.shape == (7, 4, 4)
        assert torch.ops.zerodiff_vllm.mhc_post(x, res, post, comb).shape == (7, 4, 64)
        assert torch.ops.zerodiff_vllm.hc_head(res, torch.empty(4, 256), torch.empty(1), torch.empty(4),
                                               1e-6, 1e-6).shape == (7, 64)


@pytest.mark.gpu
def test_gpu_custom_ops_under_torch_compile_and_victim_rows():
    g = cuda_generator(1)
    H, E = 4096, 256
    wg = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16()
    wn = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()

    def f(x, r):
        y, nr = zv.rms_norm(x, wn, 1e-6, residual=r)
        return zv.router_logits(y, wg), nr

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    victim_x = torch.randn(1, H, device="cuda", generator=g).bfloat16()
    victim_r = torch.randn(1, H, device="cuda", generator=g).bfloat16()
    alone = f(victim_x, victim_r)
    for n in (1, 2, 15, 16, 17, 31, 33, 64, 65, 128, 1024):
        for pos in (0, n // 2, n - 1):
            x = torch.randn(n, H, device="cuda", generator=g).bfloat16()
            r = torch.randn(n, H, device="cuda", generator=g).bfloat16()
            x[pos], r[pos] = victim_x[0], victim_r[0]
            for out in (f(x, r), cf(x, r)):
                assert torch.equal(out[0][pos:pos + 1], alone[0]), (n, pos)
                assert torch.equal(out[1][pos:pos + 1], alone[1]), (n, pos)
    # negative control: stock FP32 router GEMM changes a row with M (it does once M >= 16)
    xs = torch.randn(1024, H, device="cuda", generator=g).bfloat16()
    stock_all = torch.mm(xs, wg.T, out_dtype=torch.float32)
    stock_one = torch.mm(xs[:1], wg.T, out_dtype=torch.float32)
    assert not torch.equal(stock_all[:1], stock_one)
