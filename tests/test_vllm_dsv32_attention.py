"""The DeepSeek-V3.2-style sparse MLA adapter (``zerodiff.integrations.vllm.dsv32_attention``): the FP8-cache
path through the fixed-schedule kernel, close to a float64 reference for 32 / 64 / 128 heads and batch
invariant (CPU emulation of the kernel's contract)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from zerodiff.integrations import ConfigError
from zerodiff.integrations import vllm as zv

from flashmla_emulation import install_emulation, request_cache


HEAD_COUNTS = [32, 64, 128]  # padded to 64 / 128 heads, or kept


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_dsv32_sparse_fp8_adapter_reference_heads_and_batch_invariance(seeded, monkeypatch, heads):
    """FlashMLASparseImpl's FP8-cache path in consistency mode: vLLM's converter gives global 64-token-page slots,
    q is padded to 64 / 128 heads and the output sliced back, every token through the fixed-schedule kernel:
    ~= float64 reference, a token alone == inside the batch (CPU emulation of the kernel's contract)."""
    from zerodiff.ops.attention import flashmla_fp8 as fd
    from zerodiff.ops import kv_cache as kvc
    from zerodiff.reference.sparse_attention import sparse_attention_ref

    install_emulation(monkeypatch)
    g = seeded()
    lens, bs = (300, 130, 77), 64
    cache, bt = request_cache(g, lens, bs)
    nb = cache.shape[0]
    T, K = 9, 128
    req = torch.tensor([0, 1, 2, 0, 0, 1, 2, 2, 0], dtype=torch.int32)
    topk = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        L = lens[int(req[t])]
        k = min(L, K - 5 * t)
        topk[t, :k] = torch.randperm(L, generator=g)[:k].int()
    q = (torch.randn(T, heads, 576, generator=g) * 0.3).bfloat16()

    def convert(req_id, block_table, token_indices, BLOCK_SIZE=64, BLOCK_STRIDE_ROWS=None, NUM_TOPK_TOKENS=2048):
        assert BLOCK_STRIDE_ROWS is None and NUM_TOPK_TOKENS == token_indices.shape[1]
        return fd._translate_torch(block_table, req_id, token_indices, nb, BLOCK_SIZE)[0]

    impl = NS(softmax_scale=0.05, dcp_world_size=1)
    md = NS(block_size=bs, block_table=bt, req_id_per_token=req)
    out, lse = zv.dsv32_sparse_fp8_attention(impl, q, cache, topk, md, lambda c, b: (c, None), convert)
    assert lse is None and out.shape == (T, heads, 512)
    ws = kvc.gather_kv(cache, bt, req, topk, backend="reference")
    ro, _ = sparse_attention_ref(q, ws.view(-1, 576), kvc.workspace_indices(topk), 0.05, return_fp64=True)
    assert torch.allclose(out.double(), ro, atol=2e-2, rtol=2e-2)
    for t in (0, 4, 8):
        md1 = NS(block_size=bs, block_table=bt, req_id_per_token=req[t:t + 1])
        one, _ = zv.dsv32_sparse_fp8_attention(impl, q[t:t + 1], cache, topk[t:t + 1], md1, lambda c, b: (c, None),
                                               convert)
        assert torch.equal(one[0], out[t]), t
    with pytest.raises(ConfigError, match="context parallelism"):
        zv.dsv32_sparse_fp8_attention(NS(softmax_scale=0.05, dcp_world_size=2), q, cache, topk, md,
                                      lambda c, b: (c, None), convert)
