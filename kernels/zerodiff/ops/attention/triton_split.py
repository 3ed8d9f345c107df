"""The split-index fused FP8 read path (``backend="triton_fp8_split"``): a shipped fallback.

It reads the paged FP8 cache in place and spreads one row over many programs, on any GPU Triton supports (and on
the CPU under ``TRITON_INTERPRET=1``). ``sparse_mla_attention`` runs it only when asked for (``READ_BACKEND`` or
``backend=``): where FlashMLA is missing it is the portable in-place reader; its tile-configuration variants
are in ``zerodiff.experimental.attention_variants``.

* ``sparse_mla_attention_fp8_split(q, cache, block_table, req_ids, positions, sm_scale, *, attn_sink=None,
  d_nope=512, d_rope=64, seq_lens=None, check=True, out=None) -> (out, lse)``: the arguments of the other read
  paths (``checks.check_fp8_read_args``), ``out`` bf16 [Q, H, d_nope] with unit last stride or None.
* ``split_config(d_nope=512, d_rope=64) -> dict``: the fixed launch configuration for a model shape (BLOCK_H,
  BLOCK_N, CHUNK, num_warps, num_stages, MERGE_BH, merge_warps).
* ``check_split_call(...)`` / ``run_split(...)``: the checks and the row-blocked launch pair, shared with the
  experimental variants (which pass their own configuration and kernels).

Numerical contract. Query row r, head h, index list ``positions[r]`` (width K, request-local, -1 = skip,
unresolvable = NaN poison as in ``kv_cache.gather_kv``):

* the list is cut into fixed chunks of CHUNK consecutive entries (``split_config``: 256 at the model shape;
  CHUNK depends on the model shape only, never on Q, the batch, the phase or the SM count), so chunk c always
  holds entries [c * CHUNK, (c + 1) * CHUNK) of that row;
* launch 1, program (r, head block of BLOCK_H, c): for sub-blocks of BLOCK_N entries in list order, the tokens
  are dequantised in registers to ``bf16(float(code) * scale)`` (the workspace path's values) with the rope
  bf16 copied; ``s = (k_nope . q_nope + k_rope . q_rope) * (sm_scale * log2 e)`` (fp32 MMA accumulation,
  computed transposed: entries x heads), online softmax in base 2 (running max m, ``p = exp2(s - m)`` rounded
  to bf16 for the P.V MMA, ``l`` sums the fp32 p, ``acc`` fp32, rescaled by ``exp2(m_old - m_new)``);
  writes (m, l, acc) of the chunk in fp32 (an empty chunk writes m = -inf, l = 0, acc = 0);
* launch 2, program (r, head block of MERGE_BH): ``M = max_c m_c``; ``L = sum_c l_c * exp2(m_c - M)`` and
  ``acc = sum_c acc_c * exp2(m_c - M)``, both summed in ascending chunk order; ``out = bf16(acc / L *
  1 / (1 + exp2(sink * log2 e - lse2)))``, ``lse = (M + log2 L) * ln 2``; no valid entry: out 0, lse +inf.

So a row's bits depend only on (q[r], the tokens its positions resolve to, their order, K, sm_scale, sink, the
fixed config): the same in prefill, chunked prefill, decode or training, alone or in any batch, eager or
graph-replayed. Rows are launched ``SPLIT_MAX_ROWS`` at a time to bound the fp32 partial buffers (1 MiB per
row at the model shape); rows are independent, so this never changes bits. K is part of the input (chunk
count = ceil(K / CHUNK)): callers pass the model-limit width, never a batch-dependent one. Bits differ from the
FlashMLA and the workspace paths (other reduction orders): a deployment uses one path for rollout AND training.

Bad input: the ``ValueError``s of ``checks.check_fp8_read_args`` and of ``kv_cache``'s value checks
(``check=True``); a device Triton cannot run on here; a bad ``out``.
"""

from __future__ import annotations

import torch

from ... import _triton
from ..._triton import HAVE_TRITON, LAUNCH_OPTS, require_triton, triton_usable_for
from .. import kv_cache as _kv
from .checks import LOG2E, check_fp8_read_args, check_out, fail, read_outputs

__all__ = ["SPLIT_MAX_ROWS", "check_split_call", "run_split", "sparse_mla_attention_fp8_split", "split_config"]

PATH = "triton_fp8_split"

#: fixed launch configurations per model shape (d_nope, d_rope). Never chosen from the batch, the number of rows,
#: the top-k width or the SM count: CHUNK is the number of index-list entries one program reduces, so the chunk
#: boundaries of a row are the same for every batch and phase.
_SPLIT_CONFIGS = {
    # model shape (DeepSeek V3.2 / V4 latent): 64 or 128 heads, 512 nope + 64 rope, 656-byte tokens.
    (512, 64): dict(BLOCK_H=32, BLOCK_N=16, CHUNK=256, num_warps=8, num_stages=2, MERGE_BH=16, merge_warps=4),
}
#: query rows per launch pair (a memory bound for the partials only; rows are independent).
SPLIT_MAX_ROWS = 512
#: other shapes (the CPU interpreter tests' small dims); a small CHUNK so short index lists still cross chunk
#: boundaries.
_SPLIT_SMALL = dict(BLOCK_H=16, BLOCK_N=16, CHUNK=32, num_warps=4, num_stages=1, MERGE_BH=16, merge_warps=4)

def split_config(d_nope: int = 512, d_rope: int = 64) -> dict:
    """The fixed launch configuration of the split kernel for a model shape (a copy; see ``_SPLIT_CONFIGS``)."""
    return dict(_SPLIT_CONFIGS.get((d_nope, d_rope), _SPLIT_SMALL))

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..._triton import cast_bf16

    from ..block_slots import resolve_slots
    from .triton_fallback import finish_softmax_rows

    @triton.jit
    def split_load_q(q_ptr, q_s0, q_s1, r, h, hm, D_V: tl.constexpr, D_R: tl.constexpr, EXACT: tl.constexpr):
        """Query row ``r``'s heads ``h`` transposed, (nope [D_V, BLOCK_H], rope [D_R, BLOCK_H]): bf16, or fp32
        copies of the bf16 values when EXACT (the interpreter's dot)."""
        dv = tl.arange(0, D_V)
        dr = tl.arange(0, D_R)
        qrow = q_ptr + r * q_s0 + h[None, :] * q_s1
        qnt = tl.load(qrow + dv[:, None], mask=hm[None, :], other=0.0)  # [D_V, BLOCK_H]
        qrt = tl.load(qrow + D_V + dr[:, None], mask=hm[None, :], other=0.0)  # [D_R, BLOCK_H]
        if EXACT:
            qnt = qnt.to(tl.float32)
            qrt = qrt.to(tl.float32)
        return qnt, qrt

    @triton.jit
    def split_softmax_step(kn, kr, valid, qnt, qrt, m, l, acc, scale_log2, EXACT: tl.constexpr):
        """One sub-block of the transposed online softmax (module docstring, launch 1): dequantised tokens
        (kn bf16 [BLOCK_N, D_V], kr bf16 [BLOCK_N, D_R], valid [BLOCK_N]) folded into (m, l [BLOCK_H], acc
        [D_V, BLOCK_H]); returns the new (m, l, acc)."""
        if EXACT:
            kn = kn.to(tl.float32)
            kr = kr.to(tl.float32)
        s = tl.dot(kn, qnt) + tl.dot(kr, qrt)  # [BLOCK_N, BLOCK_H] = scores^T
        s = s * scale_log2
        s = tl.where(valid[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l = l * alpha + tl.sum(p, axis=0)
        pb = cast_bf16(p, EXACT)
        if EXACT:
            pb = pb.to(tl.float32)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(kn), pb)  # [D_V, BLOCK_H]
        return m_new, l, acc

    @triton.jit
    def split_store_partials(pm_ptr, pl_ptr, pacc_ptr, r, c, NCH, H, h, hm, m, l, acc, D_V: tl.constexpr):
        """Write chunk ``c``'s (m, l, acc) of row ``r``: m / l as [Q, NCH, H], acc as [Q, NCH, D_V, H] (heads
        contiguous, the transposed tile stored as it is)."""
        dv = tl.arange(0, D_V)
        prow = (r * NCH + c) * H + h  # [BLOCK_H] row of the [Q, NCH, H] partial arrays
        tl.store(pm_ptr + prow, m, mask=hm)
        tl.store(pl_ptr + prow, l, mask=hm)
        tl.store(pacc_ptr + ((r * NCH + c) * D_V + dv[:, None]) * H + h[None, :], acc, mask=hm[None, :])

    @triton.jit
    def split_merge_rows(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, r, h, hm, dv, H, NCH, D_V: tl.constexpr,
                         HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, NC: tl.constexpr):
        """Launch 2 for row ``r``, heads ``h`` and output columns ``dv`` (NC of them): the chunk partials
        combined in ascending chunk order, then :func:`finish_softmax_rows`; returns (o [BLOCK_H, NC], lse)."""
        mx = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for c in range(0, NCH):
            mx = tl.maximum(mx, tl.load(pm_ptr + (r * NCH + c) * H + h, mask=hm, other=float("-inf")))
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, NC], tl.float32)
        for c in range(0, NCH):
            prow = (r * NCH + c) * H + h
            mc = tl.load(pm_ptr + prow, mask=hm, other=float("-inf"))
            w = tl.exp2(mc - mx_safe)  # 0 for an empty chunk (mc = -inf)
            l = l + tl.load(pl_ptr + prow, mask=hm, other=0.0) * w
            at = tl.load(pacc_ptr + ((r * NCH + c) * D_V + dv[:, None]) * H + h[None, :], mask=hm[None, :], other=0.0)
            acc = acc + tl.trans(at) * w[:, None]
        return finish_softmax_rows(acc, l, mx_safe, sink_ptr, h, hm, HAS_SINK)

    @triton.jit
    def _split_dequant_tile(cache_ptr, bt_ptr, bt_s0, req, idx, num_blocks, max_blocks,
                            BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
                            EXACT: tl.constexpr):
        """Resolve a block of request-local positions through the block table and dequantise the tokens:
        (nope bf16 [N, D_V] = bf16(float(code) * scale), rope bf16 [N, D_R], valid [N]). Empty entries (-1)
        are invalid; unresolvable ones (hole, past the table) are valid-but-NaN so the output is poisoned."""
        G: tl.constexpr = D_V // 128
        slot, ok, valid = resolve_slots(bt_ptr, bt_s0, req, idx, num_blocks, max_blocks, BLOCK_SIZE)
        bad = valid & (~ok)
        base = cache_ptr + tl.where(ok, slot, 0) * BPT  # [N]
        gi = tl.arange(0, G)
        ci = tl.arange(0, 128)
        off = gi[None, :, None] * 128 + ci[None, None, :]  # [1, G, 128]
        code = tl.load(base[:, None, None] + off, mask=ok[:, None, None], other=0)
        sc = tl.load((base[:, None] + D_V).to(tl.pointer_type(tl.float32)) + gi[None, :], mask=ok[:, None], other=0.0)
        k3 = cast_bf16(code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None], EXACT)
        kn = tl.reshape(k3, [k3.shape[0], D_V])
        dr = tl.arange(0, D_R)
        kr = tl.load((base[:, None] + D_V + 4 * G).to(tl.pointer_type(tl.bfloat16)) + dr[None, :],
                     mask=ok[:, None], other=0.0)
        nan = tl.full([1, 1], float("nan"), tl.float32).to(tl.bfloat16)
        kn = tl.where(bad[:, None], nan, kn)
        kr = tl.where(bad[:, None], nan, kr)
        return kn, kr, valid

    @triton.jit
    def _split_partial_kernel(
        q_ptr, q_s0, q_s1, pos_ptr, pos_s0, req_ptr, cache_ptr, bt_ptr, bt_s0,
        pm_ptr, pl_ptr, pacc_ptr, H, K, NCH, num_blocks, max_blocks, scale_log2,
        D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, EXACT: tl.constexpr,
    ):
        # grid: (head block, chunk, query row). Program (r, hb, c) reduces entries [c*CHUNK, (c+1)*CHUNK) of
        # row r's index list, in order, in sub-blocks of BLOCK_N, for heads [hb*BLOCK_H, (hb+1)*BLOCK_H).
        # Computed transposed (KV entries / latent channels as the MMA's M dimension, heads as N): the
        # dequantised tile is the A operand straight from registers, q^T stays in shared memory as the B
        # operand, so no warp holds a replicated copy of q in registers (what made the untransposed form spill).
        hb = tl.program_id(0)  # fastest-varying: the head blocks of one (row, chunk) run side by side and
        c = tl.program_id(1)  # share its FP8 tokens through L2
        r = tl.program_id(2).to(tl.int64)
        req = tl.load(req_ptr + r).to(tl.int64)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        qnt, qrt = split_load_q(q_ptr, q_s0, q_s1, r, h, hm, D_V, D_R, EXACT)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([D_V, BLOCK_H], tl.float32)  # transposed accumulator
        n_lo = c * CHUNK
        for n0 in range(0, CHUNK, BLOCK_N):
            n = n_lo + n0 + tl.arange(0, BLOCK_N)
            idx = tl.load(pos_ptr + r * pos_s0 + n, mask=n < K, other=-1).to(tl.int64)
            kn, kr, valid = _split_dequant_tile(cache_ptr, bt_ptr, bt_s0, req, idx, num_blocks, max_blocks,
                                                BLOCK_SIZE, BPT, D_V, D_R, EXACT)
            m, l, acc = split_softmax_step(kn, kr, valid, qnt, qrt, m, l, acc, scale_log2, EXACT)
        split_store_partials(pm_ptr, pl_ptr, pacc_ptr, r, c, NCH, H, h, hm, m, l, acc, D_V)

    @triton.jit
    def _split_merge_kernel(
        pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, o_s0, o_s1, lse_ptr, lse_s0, H, NCH,
        D_V: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr,
    ):
        # grid: (query row, head block). Combines the row's chunk partials in ascending chunk order.
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        dv = tl.arange(0, D_V)
        o, lse = split_merge_rows(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, r, h, hm, dv, H, NCH, D_V, HAS_SINK, BLOCK_H,
                                  D_V)
        tl.store(out_ptr + r * o_s0 + h[:, None] * o_s1 + dv[None, :], cast_bf16(o, EXACT), mask=hm[:, None])
        tl.store(lse_ptr + r * lse_s0 + h, lse, mask=hm)

def check_split_call(q, cache, block_table, req_ids, positions, attn_sink, d_nope, d_rope, seq_lens, check, out,
                     path: str = PATH) -> None:
    """The checks of a split read (device, arguments, ``out``, and the block-table values when ``check``)."""
    require_triton()
    if not triton_usable_for(q.device):
        raise fail(path, f"cannot run on {q.device} here (CPU tensors need TRITON_INTERPRET=1; CUDA tensors need "
                         "it unset)")
    check_fp8_read_args(q, cache, block_table, req_ids, positions, attn_sink, d_nope, d_rope, path)
    Q, H, _ = q.shape
    check_out(out, (Q, H, d_nope), path, contiguous=False)
    if check:
        _kv._check_gather_values(cache, block_table, req_ids, positions, seq_lens)

def sparse_mla_attention_fp8_split(q, cache, block_table, req_ids, positions, sm_scale: float, *, attn_sink=None,
                                   d_nope: int = 512, d_rope: int = 64, seq_lens=None, check: bool = True,
                                   out=None):
    """The split-index fused FP8 read path; see the module docstring."""
    check_split_call(q, cache, block_table, req_ids, positions, attn_sink, d_nope, d_rope, seq_lens, check, out)
    return run_split(q, cache, block_table, req_ids, positions, sm_scale, attn_sink, d_nope, d_rope, out,
                     split_config(d_nope, d_rope))

def run_split(q, cache, block_table, req_ids, positions, sm_scale, attn_sink, d_nope, d_rope, out, cfg,
              partials=None, merge=None):
    """The launch pair over rows in blocks of ``SPLIT_MAX_ROWS`` (arguments already checked). ``partials`` /
    ``merge`` (default: this module's kernels) take the arguments of :func:`_split_partials` / :func:`_split_merge`."""
    partials = _split_partials if partials is None else partials
    merge = _split_merge if merge is None else merge
    chunk, bn = int(cfg["CHUNK"]), int(cfg["BLOCK_N"])
    if chunk <= 0 or bn <= 0 or chunk % bn:
        raise fail(PATH, f"CHUNK={chunk} must be a positive multiple of BLOCK_N={bn}")
    Q, H, _ = q.shape
    out, lse = read_outputs(q, d_nope, out)
    if Q == 0:
        return out, lse
    q = q if q.stride(2) == 1 else q.contiguous()
    positions = positions if positions.stride(1) == 1 else positions.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    req_ids = req_ids.contiguous()
    # rows are independent, so launching SPLIT_MAX_ROWS rows at a time only bounds the fp32 partial buffers
    # (Q x chunks x H x d_nope x 4 B: 1 MiB per row at the model shape); it never changes a row's bits.
    for r0 in range(0, Q, SPLIT_MAX_ROWS):
        r1 = min(Q, r0 + SPLIT_MAX_ROWS)
        parts = partials(q[r0:r1], cache, block_table, req_ids[r0:r1], positions[r0:r1], sm_scale,
                         d_nope, d_rope, cfg)
        merge(parts, attn_sink, out[r0:r1], lse[r0:r1], cfg)
    return out, lse

def _partial_buffers(q, positions, d_nope, cfg):
    """(chunk count, m, l, acc) fp32 partial buffers of a launch 1."""
    Q, H, _ = q.shape
    K = positions.shape[1]
    nch = max(triton.cdiv(K, int(cfg["CHUNK"])), 1)  # from the index-list width (a model limit), never the batch
    pm = torch.empty(Q, nch, H, dtype=torch.float32, device=q.device)
    pl = torch.empty(Q, nch, H, dtype=torch.float32, device=q.device)
    pacc = torch.empty(Q, nch, d_nope, H, dtype=torch.float32, device=q.device)
    return nch, pm, pl, pacc

def _split_partials(q, cache, block_table, req_ids, positions, sm_scale, d_nope, d_rope, cfg):
    """Launch 1 of 2: per (row, head block, chunk) partials (m, l, acc) in fp32."""
    Q, H, _ = q.shape
    K = positions.shape[1]
    nch, pm, pl, pacc = _partial_buffers(q, positions, d_nope, cfg)
    _split_partial_kernel[(triton.cdiv(H, cfg["BLOCK_H"]), nch, Q)](
        q, q.stride(0), q.stride(1), positions, positions.stride(0), req_ids, cache, block_table,
        block_table.stride(0), pm, pl, pacc, H, K, nch, cache.shape[0], block_table.shape[1],
        float(sm_scale) * LOG2E,
        D_V=d_nope, D_R=d_rope, BLOCK_SIZE=cache.shape[1], BPT=cache.shape[2],
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], CHUNK=int(cfg["CHUNK"]), EXACT=_triton.EXACT_CASTS,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **LAUNCH_OPTS,
    )
    return pm, pl, pacc

def _split_merge(parts, attn_sink, out, lse, cfg):
    """Launch 2 of 2: combine a row's chunk partials in ascending chunk order, sink, bf16 out + lse."""
    pm, pl, pacc = parts
    Q, nch, H = pm.shape
    sink = attn_sink if attn_sink is not None else lse  # dummy pointer when HAS_SINK is false
    _split_merge_kernel[(Q, triton.cdiv(H, cfg["MERGE_BH"]))](
        pm, pl, pacc, sink, out, out.stride(0), out.stride(1), lse, lse.stride(0), H, nch,
        D_V=pacc.shape[2], HAS_SINK=attn_sink is not None, BLOCK_H=cfg["MERGE_BH"], EXACT=_triton.EXACT_CASTS,
        num_warps=cfg["merge_warps"], **LAUNCH_OPTS,
    )
    return out, lse
