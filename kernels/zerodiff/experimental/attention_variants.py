"""Sparse attention read paths and configurations that did not ship.

* Split-kernel variants (``triton_fp8_split`` under other fixed configurations): :data:`SPLIT_VARIANTS`,
  :func:`split_variant_config` ``(variant, d_nope=512, d_rope=64) -> dict`` and
  :func:`sparse_mla_attention_fp8_split_variant` ``(q, cache, block_table, req_ids, positions, sm_scale, *,
  attn_sink=None, d_nope=512, d_rope=64, seq_lens=None, check=True, out=None, variant="default", config=None)
  -> (out, lse)``: the shipped ``triton_split`` read under a named variant, or under any ``config`` (a full
  launch configuration: the benchmark's exploration and the negative controls, which show that another CHUNK
  changes the bits). "default" is the shipped configuration.
* :func:`sparse_mla_attention_fp8` (same arguments as the split read, no ``variant``): the workspace path's
  Triton kernel (``triton_fallback``) reading the FP8 cache in registers instead of a BF16 workspace.
* :func:`sparse_mla_attention_flashmla_fp8_q_copy` (the arguments of ``flashmla_fp8``'s request-local entry):
  the shipped ``flashmla_fp8`` read with q materialised per piece instead of broadcast (the same values).
* :data:`MERGE_BH_SMALL`: a smaller head tile for ``flashmla_fp8.merge_pieces(bh=)`` (fewer registers per
  program); the merge is elementwise with a fixed piece order, so the tile does not enter the bits.

Contract: each variant is batch-invariant on its own, with the shipped path's contract and a row's bits a
function of the variant's fixed configuration; bits differ from the shipped kernels' unless a test says
otherwise (:data:`SPLIT_SAME_BITS_AS_DEFAULT`). Running one is a change rollout and training make together.
Verified by ``tests/test_experimental_attention.py``; measurements in docs/kernels-attention.md.

Bad input: the shipped paths' ``ValueError``s plus an unknown variant, a CHUNK that is not a positive multiple of
BLOCK_N, a MERGE_DV that is not a power of two dividing d_nope, and (pipelined variants) a cache base that is not
16-byte aligned or holds 2^31 tokens or more.
"""

from __future__ import annotations

import torch

from zerodiff import _triton as zt
from zerodiff.ops import kv_cache as _kv
from zerodiff.ops.attention import flashmla_fp8 as _fm
from zerodiff.ops.attention import triton_fallback as _tf
from zerodiff.ops.attention import triton_split as _ts
from zerodiff.ops.attention.checks import LOG2E, check_fp8_read_args, check_out, fail, read_outputs

__all__ = ["MERGE_BH_SMALL", "SPLIT_SAME_BITS_AS_DEFAULT", "SPLIT_VARIANTS", "sparse_mla_attention_flashmla_fp8_q_copy",
           "sparse_mla_attention_fp8", "sparse_mla_attention_fp8_split_variant", "split_variant_config"]

#: heads per program of the smaller piece-merge tile (the shipped tile is ``flashmla_fp8.MERGE_BH``)
MERGE_BH_SMALL = 4

#: Named variants of the split kernel. Each is a fixed function of the model shape (never of the batch), applied on
#: top of ``triton_split.split_config``:
#:
#: * ``"default"``: the shipped configuration.
#: * ``"pf"``: the SAME tiles and the same statements in the same order as "default" (the same bits in the
#:   interpreter, not on the GPU: see ``SPLIT_SAME_BITS_AS_DEFAULT``), with the loads software-pipelined by
#:   hand: the index list and block table of sub-block i+2 and the raw FP8 bytes of sub-block i+1 are loaded while
#:   sub-block i is computed (removes the idx -> block table -> token dependent-load chain from each step);
#:   Triton's own pipeliner off (num_stages 1); 16-byte-aligned row offsets. Merge split over 4 V column blocks
#:   (MERGE_DV = D_V / 4: 4x the merge programs).
#: * ``"pf_s2"``: "pf" with num_stages 2.
#: * ``"pf_bn2x"``: "pf" with BLOCK_N doubled (half the rescales / steps; OTHER bits than "default").
#: * ``"pf_chunk2x"``: "pf" with CHUNK doubled (half the partials traffic; OTHER bits than "default").
#: * ``"pf_bh2x"``: "pf" with BLOCK_H doubled (64 heads per program: each token dequantised once, not twice).
#:   Same per-head operations, but another MMA N may select another MMA instruction: bits vs "default" not
#:   claimed (the GPU sweep test reports it); invariant on its own like every variant.
#: * ``"pf_bhhalf_w4"``: "pf" with BLOCK_H halved and 4 warps (16 heads at the model shape: 254 registers x 128
#:   threads, so two CTAs fit on an SM and hide each other's load latency; tokens dequantised 4x, from L2).
#:   Bits vs "default" not claimed, as for "pf_bh2x".
#:
#: Switching to a variant is a decision made for rollout AND training together (variants marked "OTHER bits"
#: change every output).
SPLIT_VARIANTS = ("default", "pf", "pf_s2", "pf_bn2x", "pf_chunk2x", "pf_bh2x", "pf_bhhalf_w4")
#: variants whose bits equal "default" on the GPU. Empty: "pf" / "pf_s2" were written to be (same tiles, same
#: statements in the same order; bitwise equal in the interpreter), but the compiled kernels differ (the compiled
#: reductions and FMA contraction follow the register layout and schedule, not the source order; the GPU run is
#: in docs/kernels-attention.md). Only a GPU run can show two Triton kernels give equal bits.
SPLIT_SAME_BITS_AS_DEFAULT: tuple = ()



def split_variant_config(variant: str = "default", d_nope: int = 512, d_rope: int = 64) -> dict:
    """The fixed launch configuration of a named split variant for a model shape (see ``SPLIT_VARIANTS``)."""
    if variant not in SPLIT_VARIANTS:
        raise fail(None, f"split variant {variant!r} unknown (one of {SPLIT_VARIANTS})")
    cfg = _ts.split_config(d_nope, d_rope)
    if variant == "default":
        return cfg
    cfg.update(PREFETCH=True, num_stages=1, MERGE_DV=max(d_nope // 4, 32))
    if variant == "pf_s2":
        cfg["num_stages"] = 2
    elif variant == "pf_bn2x":
        cfg["BLOCK_N"] *= 2
    elif variant == "pf_chunk2x":
        cfg["CHUNK"] *= 2
    elif variant == "pf_bh2x":
        cfg["BLOCK_H"] *= 2
    elif variant == "pf_bhhalf_w4":
        cfg["BLOCK_H"] //= 2
        cfg["num_warps"] = 4
    return cfg



if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    from zerodiff._triton import cache_row_offset, cast_bf16
    from zerodiff.ops.attention.triton_split import (split_load_q, split_merge_rows, split_softmax_step,
                                                     split_store_partials)
    from zerodiff.ops.block_slots import resolve_slots

    @triton.jit
    def _split_pf_resolve(pos_ptr, pos_s0, r, n, n_end, K, bt_ptr, bt_s0, req, num_blocks, max_blocks,
                          BLOCK_SIZE: tl.constexpr):
        """Entries n (< n_end, < K) of row r's list -> int32 cache slot, -1 for an empty entry, -2 for an
        unresolvable one (hole, past the table): ``_split_dequant_tile``'s resolution, integer logic only, packed
        into one int32 per entry so the pipelined kernel carries one small tensor between steps."""
        idx = tl.load(pos_ptr + r * pos_s0 + n, mask=(n < K) & (n < n_end), other=-1)
        idx = tl.load(pos_ptr + r * pos_s0 + n, mask=(n < K) & (n < n_end), other=-1)
        slot, ok, valid = resolve_slots(bt_ptr, bt_s0, req, idx, num_blocks, max_blocks, BLOCK_SIZE)
        # slot < 2^31: the cache holds fewer tokens than that (checked by _pf_alignments)
        return tl.where(ok, slot, tl.where(valid, -2, -1))

    @triton.jit
    def _split_pf_raw(cache_ptr, slot, D_V: tl.constexpr, D_R: tl.constexpr, BPT: tl.constexpr,
                      AL_C: tl.constexpr, AL_S: tl.constexpr, AL_R: tl.constexpr):
        """The raw bytes of resolved tokens: e4m3 codes uint8 [N, G, 128], fp32 scales [N, G], bf16 rope [N, D_R].
        AL_C / AL_S / AL_R: the byte alignment of each field's start (cache base 16-aligned, checked by the
        caller), stated so the loads vectorise (16-byte code loads at the model shape instead of byte loads)."""
        G: tl.constexpr = D_V // 128
        ok = slot >= 0
        base = cache_ptr + cache_row_offset(tl.where(ok, slot, 0).to(tl.int64), BPT)
        gi = tl.arange(0, G)
        ci = tl.arange(0, 128)
        off = gi[None, :, None] * 128 + ci[None, None, :]
        cptr = base[:, None, None] + off
        cptr = tl.max_contiguous(tl.multiple_of(cptr, [1, 1, AL_C]), [1, 1, AL_C])
        code = tl.load(cptr, mask=ok[:, None, None], other=0)
        sptr = (base[:, None] + D_V).to(tl.pointer_type(tl.float32)) + gi[None, :]
        sptr = tl.max_contiguous(tl.multiple_of(sptr, [1, AL_S]), [1, AL_S // 4])
        sc = tl.load(sptr, mask=ok[:, None], other=0.0)
        dr = tl.arange(0, D_R)
        rptr = (base[:, None] + D_V + 4 * G).to(tl.pointer_type(tl.bfloat16)) + dr[None, :]
        rptr = tl.max_contiguous(tl.multiple_of(rptr, [1, AL_R]), [1, AL_R // 2])
        kr = tl.load(rptr, mask=ok[:, None], other=0.0)
        return code, sc, kr

    @triton.jit
    def _split_partial_pf_kernel(
        q_ptr, q_s0, q_s1, pos_ptr, pos_s0, req_ptr, cache_ptr, bt_ptr, bt_s0,
        pm_ptr, pl_ptr, pacc_ptr, H, K, NCH, num_blocks, max_blocks, scale_log2,
        D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BPT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, EXACT: tl.constexpr,
        AL_C: tl.constexpr, AL_S: tl.constexpr, AL_R: tl.constexpr,
    ):
        # The arithmetic of _split_partial_kernel, statement for statement and in the same order (hence the same
        # bits for the same tiles); only the loads are scheduled differently: a two-deep software pipeline in
        # registers. Step i computes sub-block i from raw bytes loaded during step i-1, issues the raw loads of
        # sub-block i+1 (addresses resolved during step i-1) and resolves sub-block i+2 (index + block table).
        hb = tl.program_id(0)
        c = tl.program_id(1)
        r = tl.program_id(2).to(tl.int64)
        req = tl.load(req_ptr + r).to(tl.int64)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        qnt, qrt = split_load_q(q_ptr, q_s0, q_s1, r, h, hm, D_V, D_R, EXACT)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([D_V, BLOCK_H], tl.float32)
        n_lo = c * CHUNK
        n_end = n_lo + CHUNK
        ar = tl.arange(0, BLOCK_N)
        # prologue: sub-block 0 resolved and loaded, sub-block 1 resolved
        slot0 = _split_pf_resolve(pos_ptr, pos_s0, r, n_lo + ar, n_end, K, bt_ptr, bt_s0, req, num_blocks,
                                  max_blocks, BLOCK_SIZE)
        code, sc, kr_raw = _split_pf_raw(cache_ptr, slot0, D_V, D_R, BPT, AL_C, AL_S, AL_R)
        slot = slot0
        slot1 = _split_pf_resolve(pos_ptr, pos_s0, r, n_lo + BLOCK_N + ar, n_end, K, bt_ptr, bt_s0, req,
                                  num_blocks, max_blocks, BLOCK_SIZE)
        for n0 in range(0, CHUNK, BLOCK_N):
            # issue the next loads first (their results are consumed one / two steps later)
            code_n, sc_n, kr_n = _split_pf_raw(cache_ptr, slot1, D_V, D_R, BPT, AL_C, AL_S, AL_R)
            slot2 = _split_pf_resolve(pos_ptr, pos_s0, r, n_lo + n0 + 2 * BLOCK_N + ar, n_end, K, bt_ptr, bt_s0,
                                      req, num_blocks, max_blocks, BLOCK_SIZE)
            bad = slot == -2
            valid = slot != -1
            # sub-block n0: dequantise exactly as _split_dequant_tile, then the default kernel's step
            k3 = cast_bf16(code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None], EXACT)
            kn = tl.reshape(k3, [k3.shape[0], D_V])
            nan = tl.full([1, 1], float("nan"), tl.float32).to(tl.bfloat16)
            kn = tl.where(bad[:, None], nan, kn)
            kr = tl.where(bad[:, None], nan, kr_raw)
            m, l, acc = split_softmax_step(kn, kr, valid, qnt, qrt, m, l, acc, scale_log2, EXACT)
            # rotate the pipeline
            code = code_n
            sc = sc_n
            kr_raw = kr_n
            slot = slot1
            slot1 = slot2
        split_store_partials(pm_ptr, pl_ptr, pacc_ptr, r, c, NCH, H, h, hm, m, l, acc, D_V)

    @triton.jit
    def _split_merge_v_kernel(
        pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, o_s0, o_s1, lse_ptr, lse_s0, H, NCH,
        D_V: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, MERGE_DV: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        # _split_merge_kernel with the output columns split over a third grid axis: program (r, head block, vb)
        # writes columns [vb * MERGE_DV, (vb + 1) * MERGE_DV). Every output element and l see exactly the default
        # merge's operations in the same (ascending chunk) order, so the bits are the default merge's.
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        vb = tl.program_id(2)
        hm = h < H
        dv = vb * MERGE_DV + tl.arange(0, MERGE_DV)
        o, lse = split_merge_rows(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, r, h, hm, dv, H, NCH, D_V, HAS_SINK,
                                  BLOCK_H, MERGE_DV)
        tl.store(out_ptr + r * o_s0 + h[:, None] * o_s1 + dv[None, :], cast_bf16(o, EXACT), mask=hm[:, None])
        tl.store(lse_ptr + r * lse_s0 + h, lse, mask=hm & (vb == 0))



def _pow2_align(n: int, cap: int = 16) -> int:
    a = 1
    while a < cap and n % (2 * a) == 0:
        a *= 2
    return a


def _pf_alignments(cache, d_nope):
    """Byte alignment of the code / scale / rope fields of every cache token (constexprs of the pipelined kernel).
    Fails closed when the cache base itself is not 16-byte aligned (the alignment hints would then be false)."""
    if cache.data_ptr() % 16:
        raise fail(_ts.PATH, "the pipelined split variants need a 16-byte aligned cache base "
                             f"(data_ptr % 16 = {cache.data_ptr() % 16}); use variant='default'")
    if cache.shape[0] * cache.shape[1] >= 2**31:
        raise fail(_ts.PATH, "the pipelined split variants address tokens with int32 slots; this cache holds "
                             f"{cache.shape[0] * cache.shape[1]} (>= 2^31)")
    bpt = cache.shape[2]
    a = _pow2_align(bpt)
    if a < 4:
        raise fail(_ts.PATH, f"token size {bpt} B is not a multiple of 4")
    return dict(AL_C=a, AL_S=min(a, _pow2_align(d_nope)), AL_R=min(a, _pow2_align(d_nope + 4 * (d_nope // 128))))


def _variant_partials(q, cache, block_table, req_ids, positions, sm_scale, d_nope, d_rope, cfg):
    """Launch 1 of 2 under a variant configuration: the shipped partial kernel, or the pipelined one (PREFETCH)."""
    if not cfg.get("PREFETCH", False):
        return _ts._split_partials(q, cache, block_table, req_ids, positions, sm_scale, d_nope, d_rope, cfg)
    Q, H, _ = q.shape
    K = positions.shape[1]
    nch, pm, pl, pacc = _ts._partial_buffers(q, positions, d_nope, cfg)
    _split_partial_pf_kernel[(triton.cdiv(H, cfg["BLOCK_H"]), nch, Q)](
        q, q.stride(0), q.stride(1), positions, positions.stride(0), req_ids, cache, block_table,
        block_table.stride(0), pm, pl, pacc, H, K, nch, cache.shape[0], block_table.shape[1],
        float(sm_scale) * LOG2E,
        D_V=d_nope, D_R=d_rope, BLOCK_SIZE=cache.shape[1], BPT=cache.shape[2],
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], CHUNK=int(cfg["CHUNK"]), EXACT=zt.EXACT_CASTS,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_pf_alignments(cache, d_nope), **zt.LAUNCH_OPTS,
    )
    return pm, pl, pacc


def _variant_merge(parts, attn_sink, out, lse, cfg):
    """Launch 2 of 2: the column-split merge when MERGE_DV < d_v (the default merge's bits; more programs), else
    the shipped merge."""
    pm, pl, pacc = parts
    Q, nch, H = pm.shape
    d_v = pacc.shape[2]
    mdv = int(cfg.get("MERGE_DV", d_v))
    if mdv >= d_v:
        return _ts._split_merge(parts, attn_sink, out, lse, cfg)
    sink = attn_sink if attn_sink is not None else lse  # dummy pointer when HAS_SINK is false
    _split_merge_v_kernel[(Q, triton.cdiv(H, cfg["MERGE_BH"]), d_v // mdv)](
        pm, pl, pacc, sink, out, out.stride(0), out.stride(1), lse, lse.stride(0), H, nch,
        D_V=d_v, HAS_SINK=attn_sink is not None, BLOCK_H=cfg["MERGE_BH"], MERGE_DV=mdv,
        EXACT=zt.EXACT_CASTS, num_warps=cfg["merge_warps"], **zt.LAUNCH_OPTS,
    )
    return out, lse


def sparse_mla_attention_fp8_split_variant(q, cache, block_table, req_ids, positions, sm_scale: float, *,
                                           attn_sink=None, d_nope: int = 512, d_rope: int = 64, seq_lens=None,
                                           check: bool = True, out=None, variant: str = "default", config=None):
    """The split read under a named variant, or under ``config`` (a full launch configuration; overrides
    ``variant``); see the module docstring."""
    _ts.check_split_call(q, cache, block_table, req_ids, positions, attn_sink, d_nope, d_rope, seq_lens, check, out)
    cfg = dict(config) if config is not None else split_variant_config(variant, d_nope, d_rope)
    mdv = int(cfg.get("MERGE_DV", d_nope))
    if mdv <= 0 or d_nope % mdv or (mdv & (mdv - 1)):
        raise fail(_ts.PATH, f"MERGE_DV={mdv} must be a power of two dividing d_nope={d_nope}")
    return _ts.run_split(q, cache, block_table, req_ids, positions, sm_scale, attn_sink, d_nope, d_rope, out, cfg,
                         partials=_variant_partials, merge=_variant_merge)


def sparse_mla_attention_fp8(q, cache, block_table, req_ids, positions, sm_scale: float, *, attn_sink=None,
                             d_nope: int = 512, d_rope: int = 64, seq_lens=None, check: bool = True, out=None):
    """The workspace path's Triton kernel reading the FP8 paged cache directly (no BF16 workspace round trip).

    Same arguments and result as ``sparse_mla_attention(..., backend="triton")`` (bit for bit in the CPU
    interpreter; on the GPU close, not bitwise: the two compile to different MMA tilings): each index block is
    dequantised in registers with the gather kernel's arithmetic (``bf16(float(code) * scale)``) and fed to the
    same online-softmax code in the same order."""
    zt.require_triton()
    if not zt.triton_usable_for(q.device):
        raise fail("triton_fp8", f"the fused FP8 Triton path cannot run on {q.device} here")
    check_fp8_read_args(q, cache, block_table, req_ids, positions, attn_sink, d_nope, d_rope, "triton_fp8")
    Q, H, _ = q.shape
    check_out(out, (Q, H, d_nope), "triton_fp8", contiguous=False)
    if check:
        _kv._check_gather_values(cache, block_table, req_ids, positions, seq_lens)
    out, lse = read_outputs(q, d_nope, out)
    if Q == 0:
        return out, lse
    q = q if q.stride(2) == 1 else q.contiguous()
    positions = positions if positions.stride(1) == 1 else positions.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    sink = attn_sink if attn_sink is not None else lse
    _tf._sparse_attn_kernel[(Q, triton.cdiv(H, _tf.BLOCK_H), _tf.V_SPLIT)](
        q, q.stride(0), q.stride(1), lse, 0, positions, positions.stride(0), sink,
        out, out.stride(0), out.stride(1), lse, lse.stride(0),
        H, positions.shape[1], 0, float(sm_scale) * LOG2E,
        cache, block_table, block_table.stride(0), req_ids, cache.shape[0], block_table.shape[1],
        D_V=d_nope, D_R=d_rope, HAS_SINK=attn_sink is not None,
        BLOCK_H=_tf.BLOCK_H, BLOCK_N=_tf.BLOCK_N, V_SPLIT=_tf.V_SPLIT, EXACT=zt.EXACT_CASTS, FROM_CACHE=True,
        BLOCK_SIZE=cache.shape[1], BPT=cache.shape[2], num_warps=_tf.NUM_WARPS, **zt.LAUNCH_OPTS,
    )
    return out, lse


def sparse_mla_attention_flashmla_fp8_q_copy(q, cache, block_table, req_ids, positions, sm_scale: float, *,
                                             attn_sink=None, d_nope: int = 512, d_rope: int = 64, seq_lens=None,
                                             check: bool = True, out=None, pieces_per_row: int | None = None):
    """``flashmla_fp8``'s request-local read with q materialised per piece (the shipped read broadcasts it)."""
    return _fm.read_request_local(q, cache, block_table, req_ids, positions, sm_scale, attn_sink=attn_sink,
                                  d_nope=d_nope, d_rope=d_rope, seq_lens=seq_lens, check=check, out=out,
                                  pieces_per_row=pieces_per_row, q_copy=True)
