"""DeepSeek-V3.2-style sparse MLA with the FP8 cache through FlashMLA's FP8 kernel under zerodiff's schedule."""

from __future__ import annotations

from typing import Any

import torch

from .. import ConfigError

def dsv32_sparse_fp8_attention(impl: Any, q: torch.Tensor, kv_cache: torch.Tensor, topk_indices: torch.Tensor,
                               attn_metadata: Any, kv_pages_fn, convert_fn):
    """Consistency-mode body of ``FlashMLASparseImpl.forward_mqa`` (vLLM 0.33.0,
    ``vllm/v1/attention/backends/mla/flashmla_sparse.py``) for the FP8 ``fp8_ds_mla`` cache: all the step's MQA
    tokens (decode and prefill alike) read the cache in place through
    ``zerodiff.ops.attention.flashmla_fp8.flashmla_fp8_attention`` (FlashMLA's FP8 decode kernel under zerodiff's
    batch-independent schedule). The request-local top-k indices become global 64-token-page slots with vLLM's own
    converter (``convert_fn`` = ``triton_convert_req_index_to_global_index``, integer arithmetic) over the page
    view ``kv_pages_fn`` (= ``_fp8_kv_pages``) gives; q is zero-padded to 64 / 128 heads as vLLM's FP8 kernel
    path does. Returns ``(out [T, H, 512], None)`` (the lse only serves decode context parallelism, which
    consistency mode refuses). Refused: more than 128 heads, DCP. CPU-tested against an emulation of the kernel;
    not yet run inside vLLM on a GPU."""
    from ...ops.attention import flashmla_fp8 as fd

    if int(getattr(impl, "dcp_world_size", 1)) > 1:
        raise ConfigError("zerodiff DSV3.2 sparse MLA: decode context parallelism is not supported")
    T = int(topk_indices.shape[0])
    qq = q[:T]
    H = int(qq.shape[1])
    if H > 128:
        raise ConfigError(f"zerodiff DSV3.2 sparse MLA: {H} heads (FlashMLA's FP8 kernel takes up to 128)")
    Hp = 64 if H <= 64 else 128
    if H < Hp:
        qp = qq.new_zeros((T, Hp, qq.shape[2]))
        qp[:, :H] = qq
    else:
        qp = qq if qq.is_contiguous() else qq.contiguous()
    bs = int(attn_metadata.block_size)
    kv_pages, stride_rows = kv_pages_fn(kv_cache, bs)
    idx = convert_fn(attn_metadata.req_id_per_token[:T], attn_metadata.block_table, topk_indices, BLOCK_SIZE=bs,
                     BLOCK_STRIDE_ROWS=stride_rows, NUM_TOPK_TOKENS=int(topk_indices.shape[1]))
    if isinstance(idx, tuple):
        idx = idx[0]
    out, _lse = fd.flashmla_fp8_attention(qp, kv_pages.view(torch.uint8), idx.to(torch.int32),
                                          float(impl.softmax_scale))
    return (out if H == Hp else out[:, :H]), None
