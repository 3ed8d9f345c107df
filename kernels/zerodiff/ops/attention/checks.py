"""Argument checks and shape constants shared by the sparse attention backends.

Every check raises :class:`zerodiff.errors.InputError` (the project's error type for bad arguments; a ``ValueError``) with a message that starts
with ``zerodiff.sparse_attention`` and, for a read path, its name in brackets
(``zerodiff.sparse_attention[flashmla_fp8]: ...``), then names the argument and what was expected.

* :func:`fail` ``(path, message) -> InputError``: the error, for the checks that stay next to their backend.
* :func:`check_fp8_read_args`: the arguments every read path over the paged FP8 cache takes (q, cache,
  block_table, req_ids, positions, attn_sink, the model dims, one device).
* :func:`check_workspace_args` ``(q, kv, indices, d_v, attn_sink) -> (kv [S, d_qk], indices [Q, K])``: the
  arguments of ``sparse_attention`` over a BF16 workspace.
* :func:`check_sink`, :func:`check_out`, :func:`check_positions`: single arguments.
"""

from __future__ import annotations

import torch

from ...errors import InputError
from .. import kv_cache as _kv

#: the op name every message starts with
OP = "zerodiff.sparse_attention"
#: log2(e) in double precision (the host-side scale conversion sm_scale -> base 2)
LOG2E = 1.4426950408889634
#: head counts FlashMLA's kernels take (the same kernel on SM90 and SM100)
FLASHMLA_HEADS = (64, 128)
#: FlashMLA's KV block: index-list widths are multiples of it
FLASHMLA_TOPK_BLOCK = 64
#: the model's latent split (d_nope, d_rope): the 656-byte token layout FlashMLA reads
MODEL_DIMS = (512, 64)
#: the query/key width of the model (d_nope + d_rope) and the value width
MODEL_D_QK = MODEL_DIMS[0] + MODEL_DIMS[1]
MODEL_D_V = MODEL_DIMS[0]


def fail(path: str | None, message: str) -> InputError:
    """The error of a refused argument: ``InputError("zerodiff.sparse_attention[path]: message")``."""
    return InputError(f"{OP}[{path}]: {message}" if path else f"{OP}: {message}")


def _desc(t) -> str:
    return f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}"


def check_sink(attn_sink, H: int, path: str | None = None) -> None:
    if attn_sink is not None and (attn_sink.dtype != torch.float32 or tuple(attn_sink.shape) != (H,)):
        raise fail(path, f"attn_sink must be fp32 [{H}], got {_desc(attn_sink)}")


def check_positions(positions, Q: int, path: str | None = None) -> None:
    if positions.dtype != torch.int32 or positions.dim() != 2 or positions.shape[0] != Q:
        raise fail(path, f"positions must be int32 [{Q}, W], got {_desc(positions)}")


def check_out(out, shape: tuple, path: str | None, *, contiguous: bool) -> None:
    """``out`` (when given) must be bf16 of ``shape``, contiguous or with a unit last stride."""
    if out is None:
        return
    layout_ok = out.is_contiguous() if contiguous else out.stride(-1) == 1
    if out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(shape) or not layout_ok:
        layout = "contiguous" if contiguous else "unit last stride"
        raise fail(path, f"out must be bf16 {list(shape)} ({layout}), got {_desc(out)}")


def read_outputs(q, d_v: int, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a read of q [Q, H, D]: ``out`` itself (already checked) or a new bf16 [Q, H, d_v], and a new
    fp32 lse [Q, H], both uninitialised, on q's device."""
    Q, H = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(Q, H, d_v, dtype=torch.bfloat16, device=q.device)
    return out, torch.empty(Q, H, dtype=torch.float32, device=q.device)


def check_fp8_read_args(q, cache, block_table, req_ids, positions, attn_sink, d_nope: int, d_rope: int,
                        path: str) -> None:
    """q bf16 [Q, H, d_nope + d_rope], positions int32 [Q, W], req_ids int32 [Q], block_table int32 2-D,
    attn_sink fp32 [H] or None, everything on q's device, and the cache layout of ``kv_cache``."""
    _kv._check_dims(d_nope, d_rope)
    _kv._check_cache(cache, d_nope, d_rope)
    D = d_nope + d_rope
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != D:
        raise fail(path, f"q must be bf16 [Q, H, {D}], got {_desc(q)}")
    Q, H, _ = q.shape
    check_positions(positions, Q, path)
    if req_ids.dtype != torch.int32 or tuple(req_ids.shape) != (Q,):
        raise fail(path, f"req_ids must be int32 [{Q}], got {_desc(req_ids)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise fail(path, f"block_table must be int32 [B, max_blocks], got {_desc(block_table)}")
    check_sink(attn_sink, H, path)
    for name, t in (("q", q), ("cache", cache), ("block_table", block_table), ("req_ids", req_ids),
                    ("positions", positions)):
        if t.device != q.device:
            raise fail(path, f"{name} is on {t.device}, q on {q.device}")


def check_workspace_args(q, kv, indices, d_v: int, attn_sink):
    """The arguments of ``sparse_attention``; returns (kv as [S, d_qk], indices as [Q, K])."""
    if q.dtype != torch.bfloat16 or q.dim() != 3:
        raise fail(None, f"q must be bf16 [Q, H, d_qk], got {_desc(q)}")
    Q, H, D = q.shape
    if kv.dtype != torch.bfloat16 or kv.shape[-1] != D or not (kv.dim() == 2 or (kv.dim() == 3 and kv.shape[1] == 1)):
        raise fail(None, f"kv must be bf16 [S, {D}] or [S, 1, {D}], got {_desc(kv)}")
    if indices.dtype != torch.int32 or indices.shape[0] != Q or not (
        indices.dim() == 2 or (indices.dim() == 3 and indices.shape[1] == 1)
    ):
        raise fail(None, f"indices must be int32 [{Q}, K] or [{Q}, 1, K], got {_desc(indices)}")
    if not (0 < d_v <= D) or (d_v & (d_v - 1)):
        raise fail(None, f"d_v={d_v} must be a power of two <= d_qk={D}")
    check_sink(attn_sink, H)
    return kv.reshape(kv.shape[0], D), indices.reshape(Q, indices.shape[-1])
