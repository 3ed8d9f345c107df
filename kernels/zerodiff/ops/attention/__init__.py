"""Sparse MLA attention: the one read path prefill, chunked prefill, decode and training share.

Layout (one module per backend; no backend imports this dispatcher):

* ``flashmla_fp8``: **shipped**. FlashMLA's FP8 sparse decode kernel reading the paged cache in place under a
  schedule zerodiff writes (every row cut into ``PIECES_PER_ROW`` fixed pieces, merged in piece order).
* ``workspace``: shipped fallback where ``flashmla_fp8`` cannot take the call (no CUDA, FlashMLA missing, other
  head counts or latent dims): ``kv_cache.gather_kv`` into a BF16 workspace, then ``sparse_attention`` with the
  ``flash_mla_sparse_fwd`` / Triton / float64 reference kernel.
* ``triton_fallback``: the Triton kernel of the workspace path (what the CPU interpreter and GPUs without
  FlashMLA run).
* ``triton_split``: shipped fallback on request (``backend="triton_fp8_split"``): a Triton kernel reading the
  FP8 cache in place on any GPU Triton supports.
* ``checks`` (argument checks, shape constants) and ``slots`` (block-table slot resolution, Triton and torch).
Runners-up live in ``zerodiff.experimental.attention_variants``.

Public API:

* ``sparse_mla_attention(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink=None, d_nope=512,
  d_rope=64, seq_lens=None, rows_per_chunk=256, workspace="per_row", check=True, backend=None,
  gather_backend=None) -> (out, lse)``: query row r attends to the request-local ``positions[r]`` (int32 [Q, W],
  e.g. the DSA Top-K output, -1 = empty) of request ``req_ids[r]`` in the paged FP8 ``cache`` through
  ``block_table``. ``q`` bf16 [Q, H, d_nope + d_rope]; returns ``out`` bf16 [Q, H, d_nope] and ``lse`` fp32 [Q, H]
  (natural log; +inf and out 0 for a row without a valid position). ``backend``: one of ``READ_BACKENDS``;
  None runs ``READ_BACKEND`` when set, else ``default_read_backend`` (``"flashmla_fp8"`` where it takes the
  call, else the workspace path with ``sparse_attention``'s own kernel pick). ``workspace`` ("per_row" or
  "per_request", which needs ``seq_lens``), ``rows_per_chunk`` and ``gather_backend`` shape the workspace path
  only (a gather backend asks for it); they never change a row's bits. ``check=False`` inside CUDA graphs.
* ``sparse_attention(q, kv, indices, sm_scale, *, d_v=512, attn_sink=None, out=None, backend=None)``: attention
  over a BF16 workspace (``workspace`` module).
* ``sparse_mla_attention_flashmla_fp8``, ``flashmla_fp8_attention`` (global token indices: vLLM's layout),
  ``sparse_mla_attention_fp8_split``, ``split_config``: the backends' own entry points.
* ``READ_BACKEND`` (None or a name of ``READ_BACKENDS``): what ``backend=None`` runs. Rollout and training read
  the same value; ``zerodiff check|bench --attn-backend NAME`` sets it. Changing it changes the bits of both
  sides together.
* ``default_read_backend(q, positions, d_nope=512, d_rope=64) -> "flashmla_fp8" | None`` and
  ``default_sm_scale(d_qk=576) -> 1 / sqrt(d_qk)``.

Numerical contract (bitwise, every backend): a row's ``out``/``lse`` depend only on q[r], the tokens its
positions resolve to and their ORDER, the index-list width, sm_scale, the sink and the backend's fixed
configuration; never on the other rows, the batch size, the row's place in the batch, prefill vs decode, or
eager vs CUDA-graph replay. Backends differ from each other in the last bits (other reduction orders), so a
deployment runs one backend for rollout AND training; the automatic choice depends only on the device, the
library and the model shape. Each backend module states its arithmetic.

Bad input raises ``InputError`` (a ``ValueError``; ``checks``): argument dtypes / shapes / devices, an unknown backend, options that
do not apply to the chosen backend, a backend requested where it cannot run, positions the block table cannot
resolve (``check=True``; with ``check=False`` such a row comes out NaN).
"""

from __future__ import annotations

import math

from .checks import MODEL_D_QK, fail
from .flashmla_fp8 import flashmla_fp8_attention, sparse_mla_attention_flashmla_fp8, supports
from .triton_split import sparse_mla_attention_fp8_split, split_config
from .workspace import KERNELS, read_per_request, read_per_row, sparse_attention

__all__ = [
    "READ_BACKEND", "READ_BACKENDS", "default_read_backend", "default_sm_scale", "flashmla_fp8_attention",
    "sparse_attention", "sparse_mla_attention", "sparse_mla_attention_flashmla_fp8",
    "sparse_mla_attention_fp8_split", "split_config",
]

#: the backend ``sparse_mla_attention(backend=None)`` runs. None: ``default_read_backend`` decides from the device,
#: the library and the model shape. Rollout and training read the same value; ``zerodiff check|bench
#: --attn-backend`` sets it.
READ_BACKEND = None
#: the read paths: the workspace path's kernels, then the in-place readers
READ_BACKENDS = KERNELS + ("triton_fp8_split", "flashmla_fp8")
#: the workspace layouts of the workspace path
WORKSPACES = ("per_row", "per_request")
_WORKSPACE_READERS = {"per_row": read_per_row, "per_request": read_per_request}


def default_read_backend(q, positions, d_nope: int = 512, d_rope: int = 64):
    """What ``sparse_mla_attention(backend=None)`` runs when ``READ_BACKEND`` is None: "flashmla_fp8" where it can
    take the call, else None (the workspace path). Depends on the device, the library and the model shape only,
    so rollout and training pick the same."""
    return "flashmla_fp8" if supports(q, positions, d_nope, d_rope) is None else None


def sparse_mla_attention(q, cache, block_table, req_ids, positions, sm_scale: float, *, attn_sink=None,
                         d_nope: int = 512, d_rope: int = 64, seq_lens=None, rows_per_chunk: int = 256,
                         workspace: str = "per_row", check: bool = True, backend=None, gather_backend=None):
    """The read path; see the module docstring."""
    Q = q.shape[0]
    if backend is None:
        if READ_BACKEND is not None:
            backend = READ_BACKEND
        elif gather_backend is None:  # a gather backend asks for the workspace path
            backend = default_read_backend(q, positions, d_nope, d_rope)
    if backend is not None and backend not in READ_BACKENDS:
        raise fail(None, f"unknown backend {backend!r} (one of {READ_BACKENDS}; the read paths that did not ship "
                         "are in zerodiff.experimental.attention_variants)")
    if positions.dim() != 2 or positions.shape[0] != Q:
        raise fail(None, f"positions must be int32 [{Q}, W], got {tuple(positions.shape)}")
    if workspace not in WORKSPACES:
        raise fail(None, f"workspace={workspace!r} (use 'per_row' or 'per_request')")
    if backend == "flashmla_fp8":
        if gather_backend is not None:
            raise fail(None, "backend='flashmla_fp8' reads the FP8 cache in place; "
                             f"workspace={workspace!r} / gather_backend={gather_backend!r} cannot apply")
        return sparse_mla_attention_flashmla_fp8(q, cache, block_table, req_ids, positions, sm_scale,
                                                 attn_sink=attn_sink, d_nope=d_nope, d_rope=d_rope,
                                                 seq_lens=seq_lens, check=check)
    if backend == "triton_fp8_split":
        # reads the FP8 cache directly, no workspace (rows are independent: no row chunking needed)
        if gather_backend not in (None, "triton"):
            raise fail(None, f"backend={backend!r} dequantises inside the attention kernel; "
                             f"gather_backend={gather_backend!r} cannot apply (leave it None)")
        return sparse_mla_attention_fp8_split(q, cache, block_table, req_ids, positions, sm_scale,
                                              attn_sink=attn_sink, d_nope=d_nope, d_rope=d_rope,
                                              seq_lens=seq_lens, check=check)
    if rows_per_chunk <= 0:
        raise fail(None, f"rows_per_chunk={rows_per_chunk} must be positive")
    return _WORKSPACE_READERS[workspace](q, cache, block_table, req_ids, positions, sm_scale, attn_sink=attn_sink,
                                        d_nope=d_nope, d_rope=d_rope, seq_lens=seq_lens,
                                        rows_per_chunk=rows_per_chunk, check=check, backend=backend,
                                        gather_backend=gather_backend)


def default_sm_scale(d_qk: int = MODEL_D_QK) -> float:
    """1 / sqrt(d_qk)."""
    return 1.0 / math.sqrt(d_qk)

