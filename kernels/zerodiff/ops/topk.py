"""Deterministic Top-K for DSA indexer rows (k up to 2048 of 64K+) and MoE expert routing (k=8 of 256).

Public API::

    deterministic_topk(scores, k, lengths=None, *, return_scores=False, backend=None,
                       check_lengths=None)
        -> positions int32 [R, k]                      (return_scores=False)
        -> (positions int32 [R, k], scores fp32 [R, k]) (return_scores=True)

    topk_routing(scores, k, *, backend=None) -> (scores fp32 [T, k], ids int32 [T, k])
        convenience for expert routing: the same selection, ids sorted by expert id DESCENDING.

``scores`` fp32 [R, W] (2-D, any strides, W <= 2^30); ``lengths`` int32 / int64 [R] on the same device (valid
prefix of each row, 0 <= L <= W) or None (every row full); ``k`` a Python int in [1, 65536].

Numerical contract (identical to ``zerodiff.reference.topk``, which states it in full):

* 64-bit key = (order-preserving map of the fp32 score bits << 32) | request-local position; the
  ``min(k, candidates)`` largest keys are selected, so equal scores go to the LARGER position.
* ``-0.0 == +0.0`` (position decides); ``-inf`` is a valid, lowest score; denormals are ordered values;
  NaN is never selected (treated like a position past the row's length).
* Output positions sorted DESCENDING, ``-1`` padding last (k > candidates, empty rows, all-NaN rows).
  Returned scores are the input's bits at those positions, ``-inf`` on padding.
* Positions never depend on the batch: no float arithmetic at all (integer keys, exact counts, integer
  atomics whose sums are order-free), every program reads one row only (one program per row, or a fixed
  number of slices per row in the split design), and every configuration is chosen from the row width
  W only, never from the number of rows.

Kernel design "single" (rows narrower than ``SPLIT_MIN_W``: routing, short contexts; wide rows too with
``VARIANT = "single"``): one program per row. The k-th largest key is found by radix select on the 32 mapped
score bits: 11-bit digits (10+11+11, at most 3 passes) for rows wider than 2048, 8-bit digits (at most 4
passes) for narrow rows; a pass that already isolates the boundary exactly ends the search early. Each pass
is one ``tl.histogram`` (masked to the candidates that still match the prefix) per fixed-size chunk of the
row. Ties at the threshold score are resolved by position while emitting: the row is scanned from its right
end chunk by chunk and suffix counts (``tl.cumsum``) give each selected element its output slot, which
yields the descending-position order without any sort. Every loop prefetches its next chunk. Rows with
``length <= k`` skip the radix passes (everything valid is selected). Columns past a row's length never
influence it (at most 15 of them are read, never past W).

Kernel design "split" (``VARIANT = "split"``, the default, for rows at least ``SPLIT_MIN_W`` = 4096 wide; same
bits, exact integer logic): the row is cut into NS = ceil(W / SW) slices (SW from W only, about W/2 in
[1024, 8192]). Slices at or past a row's length do nothing. ``LV`` launches of NS programs per row each
histogram one full-row digit (2 levels of 8 bits) of the candidates whose higher digits match the prefix
chosen by the previous levels; slices add their counts into the row's level histogram with integer atomics
(exact, order-free). Every program replays the radix decisions from those histograms (``_split_state``), so
no host sync and no extra launch is needed between levels. A compaction launch (NS programs per row) keeps,
in position order, each slice's candidates that can still be selected (key >= the boundary prefix, or >= T
once T is final) in the slice's own scratch region. One finishing program per row runs the remaining radix
passes (2 x 8 bits) over that kept list only, then emits from its right end exactly like the single kernel.
Scratch: 8 bytes per row element (rows are processed in blocks of at most ``SPLIT_SCRATCH_BYTES``) plus 1 KB
of histograms per row. Launches: 1 memset + LV + 2. The configuration never depends on the number of rows.

Backends: ``None`` -> Triton for CUDA tensors, the reference for CPU tensors; ``"triton"`` (CPU tensors run
through Triton's interpreter: small shapes only); ``"reference"``. The Triton design for wide rows is the
module constant ``VARIANT`` (environment ``ZD_TOPK_VARIANT``, read at every call); both designs give
identical positions, so the choice is about speed only.

Failure modes: bad input raises ``InputError`` (a ValueError) naming the problem (see the reference).
Dtype/shape/k are always checked on the host (no sync). ``lengths`` VALUES (0 <= L <= W) are checked for CPU tensors, and for CUDA
tensors only with ``check_lengths=True`` (a device sync; refused during CUDA-graph capture); the kernel
clamps every length to ``[0, W]`` in any case, so a bad value can never read out of bounds. An unknown
``VARIANT`` fails closed with an InputError. Speed, not bits: in the split design, rows whose scores
concentrate in one 16-bit key prefix (plateaus, heavy quantisation) keep a long list that the one
finishing program per row works through alone.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import _triton as zt
from ..reference.topk import check_inputs, deterministic_topk_ref
from ..errors import InputError

__all__ = ["deterministic_topk", "topk_routing"]

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_length(len_ptr, row, W, HAS_LEN: tl.constexpr):
        """Row ``row``'s valid length as int32: ``lengths[row]`` clamped to [0, W] when HAS_LEN, else W."""
        if HAS_LEN:
            L = tl.load(len_ptr + row).to(tl.int32)
            L = tl.minimum(tl.maximum(L, 0), W)
        else:
            L = W + tl.zeros([], tl.int32)
        return L

    @triton.jit
    def _row_keys(x, inb):
        """Order-preserving uint32 keys of fp32 values and the candidate mask (in bounds and not NaN)."""
        i = x.to(tl.int32, bitcast=True)
        i = tl.where(i == -2147483648, 0, i)  # -0.0 (0x80000000) -> +0.0
        cand = inb & ((i & 0x7FFFFFFF) <= 0x7F800000)  # not NaN
        flip = (i >> 31) | -2147483648  # arithmetic shift: all ones if negative, else the sign bit
        m = (i ^ flip).to(tl.uint32, bitcast=True)  # ~u for negatives, u | 0x80000000 otherwise
        return m, cand

    @triton.jit
    def _emit_chunk(x, pos, inb, T, need, cnt, ties, k, orow, scrow, RET_SCORES: tl.constexpr):
        # the final right-to-left pass over one chunk: keys above the threshold key T, and the rightmost `need`
        # ties at T (counting the `ties` already seen to the right), go to the next output slots from `cnt` on,
        # rightmost first; returns the updated (cnt, ties)
        m, cand = _row_keys(x, inb)
        is_tie = (cand & (m == T)).to(tl.int32)
        n_tie = tl.sum(is_tie, axis=0)
        tie_rank = ties + n_tie - tl.cumsum(is_tie, axis=0) + is_tie  # 1 = rightmost tie
        sel = ((cand & (m > T)) | ((is_tie != 0) & (tie_rank <= need))).to(tl.int32)
        n_sel = tl.sum(sel, axis=0)
        slot = cnt + n_sel - tl.cumsum(sel, axis=0)  # rightmost selected -> slot cnt
        keep = (sel != 0) & (slot < k)
        tl.store(orow + slot, pos, mask=keep)
        if RET_SCORES:
            tl.store(scrow + slot, x, mask=keep)
        return cnt + tl.sum(keep.to(tl.int32), axis=0), ties + n_tie

    @triton.jit
    def _pad_row(orow, scrow, cnt, k, CH: tl.constexpr, RET_SCORES: tl.constexpr):
        # output slots cnt..k-1 of a row with fewer than k valid positions: index -1, score -inf
        ar = tl.arange(0, CH)
        for t in range(0, tl.cdiv(k, CH)):
            o = t * CH + ar
            pm = (o >= cnt) & (o < k)
            tl.store(orow + o, tl.full([CH], -1, tl.int32), mask=pm)
            if RET_SCORES:
                tl.store(scrow + o, tl.full([CH], float("-inf"), tl.float32), mask=pm)

    @triton.jit
    def _topk_kernel(s_ptr, len_ptr, out_ptr, osc_ptr, W, k, stride_r,
                     HAS_LEN: tl.constexpr, RET_SCORES: tl.constexpr, CHUNK: tl.constexpr,
                     DIGIT: tl.constexpr, NPASS: tl.constexpr, NB: tl.constexpr, HIST_MASK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        L = _row_length(len_ptr, row, W, HAS_LEN)
        srow = s_ptr + row * stride_r
        n_chunks = tl.cdiv(L, CHUNK)
        # loads stop at L rounded up to 16 (never past W), so whole 16-column groups share one mask and
        # can be vectorised; columns in [L, LR) are read but masked out of the candidates
        LR = tl.minimum(tl.cdiv(L, 16) * 16, W)
        ar = tl.arange(0, CHUNK)
        bins = tl.arange(0, NB)

        # ---- radix select of the threshold key T (32 bits) and how many ties at T to take (need) ----
        # pass p looks at bits [lo, lo + DIGIT) with lo = (NPASS - 1 - p) * DIGIT (the top pass may be
        # narrower) among the candidates whose bits above lo + DIGIT equal the prefix found so far.
        done = (L <= k).to(tl.int32)  # everything valid is selected: T = 0, need = k
        T = tl.zeros([], tl.uint32)
        need = k + tl.zeros([], tl.int32)
        prefix = tl.zeros([], tl.uint32)
        kk = k + tl.zeros([], tl.int32)  # keys still to select at or below the current prefix
        for p in tl.static_range(NPASS):
            if done == 0:
                h = tl.zeros([NB], tl.int32)
                n_in = tl.zeros([], tl.int32)
                x_next = tl.load(srow + ar, mask=ar < LR, other=0.0)
                for c in range(0, n_chunks):
                    offs = c * CHUNK + ar
                    inb = offs < L
                    x = x_next
                    nxt = offs + CHUNK  # prefetch the next chunk while this one is counted
                    x_next = tl.load(srow + nxt, mask=nxt < LR, other=0.0)
                    m, cand = _row_keys(x, inb)
                    if p > 0:
                        cand = cand & ((m >> ((NPASS - p) * DIGIT)) == prefix)
                    b = ((m >> ((NPASS - 1 - p) * DIGIT)) & (NB - 1)).to(tl.int32)
                    if HIST_MASK:
                        h += tl.histogram(b, NB, mask=cand)
                    else:
                        h += tl.histogram(tl.where(cand, b, 0), NB)
                    if not HIST_MASK:
                        n_in += tl.sum(cand.to(tl.int32), axis=0)
                if HIST_MASK:
                    n_in = tl.sum(h, axis=0)
                else:  # excluded lanes were counted in bin 0: take them out
                    h = h - tl.where(bins == 0, n_chunks * CHUNK - n_in, 0)
                incl = n_in - tl.cumsum(h, axis=0) + h  # candidates in bins >= b
                j = tl.max(tl.where(incl >= kk, bins, -1), axis=0)
                above = tl.sum(tl.where(bins == j, incl - h, 0), axis=0)
                hj = tl.sum(tl.where(bins == j, h, 0), axis=0)
                # no more candidates than k: only a pass-0 question (later passes always hold more
                # candidates than they must select, else the previous pass ended the search)
                if p == 0:
                    all_sel = n_in <= kk
                else:
                    all_sel = n_in < 0
                kk_new = kk - above
                prefix_new = (prefix << DIGIT) | j.to(tl.uint32)
                exact = hj == kk_new  # the whole boundary bin is selected: T = its lowest key
                if p == NPASS - 1:
                    exact = exact | True
                T = tl.where(all_sel, 0, prefix_new << ((NPASS - 1 - p) * DIGIT)).to(tl.uint32)
                need = tl.where(all_sel, k, kk_new)
                done = (all_sel | exact).to(tl.int32)
                prefix = prefix_new
                kk = kk_new

        # ---- emit: scan chunks from the right end; ties at T go to the larger positions ----
        # within a chunk, counts from the right are suffix sums: total - inclusive prefix + own
        cnt = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        c = n_chunks - 1
        orow = out_ptr + row * k
        scrow = osc_ptr + row * k
        offs0 = c * CHUNK + ar
        x_next = tl.load(srow + offs0, mask=(offs0 >= 0) & (offs0 < LR), other=0.0)
        while (c >= 0) & (cnt < k):
            offs = c * CHUNK + ar
            inb = offs < L
            x = x_next
            prv = offs - CHUNK  # prefetch the chunk to the left
            x_next = tl.load(srow + prv, mask=prv >= 0, other=0.0)
            cnt, ties = _emit_chunk(x, offs, inb, T, need, cnt, ties, k, orow, scrow, RET_SCORES)
            c -= 1

        # ---- padding ----
        _pad_row(orow, scrow, cnt, k, CHUNK, RET_SCORES)


    # ---- "split" variant: the row's full scans spread over a fixed number of programs per row ----
    @triton.jit
    def _split_state(tot_ptr, row, k, LEVELS: tl.constexpr, D0: tl.constexpr, LV: tl.constexpr):
        """Replay the radix decisions of the first LEVELS full-row digits from their exact histograms.

        Returns (T, need, done, prefix, kk) like the single kernel's loop: ``done`` = the threshold key T
        and the number of ties at T to take (need) are final; else ``prefix`` holds the top D0*LEVELS bits
        of the k-th largest key and ``kk`` how many keys are still to select within that prefix.
        """
        bins = tl.arange(0, 1 << D0)
        T = tl.zeros([], tl.uint32)
        need = k + tl.zeros([], tl.int32)
        done = tl.zeros([], tl.int32)
        prefix = tl.zeros([], tl.uint32)
        kk = k + tl.zeros([], tl.int32)
        for lv in tl.static_range(LEVELS):
            if done == 0:
                h = tl.load(tot_ptr + (row * LV + lv) * (1 << D0) + bins)
                n_in = tl.sum(h, axis=0)
                incl = n_in - tl.cumsum(h, axis=0) + h  # candidates (within the prefix) in bins >= b
                j = tl.max(tl.where(incl >= kk, bins, -1), axis=0)
                above = tl.sum(tl.where(bins == j, incl - h, 0), axis=0)
                hj = tl.sum(tl.where(bins == j, h, 0), axis=0)
                if lv == 0:  # later levels always hold more candidates than they must select
                    all_sel = n_in <= kk
                else:
                    all_sel = n_in < 0
                kk_new = kk - above
                prefix_new = (prefix << D0) | j.to(tl.uint32)
                exact = hj == kk_new
                if D0 * (lv + 1) == 32:
                    exact = exact | True
                T = tl.where(all_sel, 0, prefix_new << (32 - D0 * (lv + 1))).to(tl.uint32)
                need = tl.where(all_sel, k, kk_new)
                done = (all_sel | exact).to(tl.int32)
                prefix = prefix_new
                kk = kk_new
        return T, need, done, prefix, kk

    @triton.jit
    def _split_hist_kernel(s_ptr, len_ptr, tot_ptr, W, k, stride_r,
                           HAS_LEN: tl.constexpr, SW: tl.constexpr, D0: tl.constexpr, LEVEL: tl.constexpr,
                           LV: tl.constexpr, HIST_MASK: tl.constexpr):
        """Program (row, slice): histogram of full-row digit LEVEL (D0 bits) of the slice's candidates whose
        higher digits match the prefix of the previous levels, added into the row's level histogram with
        integer atomics (exact: the sum does not depend on the order of the adds)."""
        row = tl.program_id(0).to(tl.int64)
        sl = tl.program_id(1)
        L = _row_length(len_ptr, row, W, HAS_LEN)
        if LEVEL > 0:
            T, need, done, prefix, kk = _split_state(tot_ptr, row, k, LEVEL, D0, LV)
        else:
            done = tl.zeros([], tl.int32)
            prefix = tl.zeros([], tl.uint32)
        if (sl * SW < L) & (done == 0):
            LR = tl.minimum(tl.cdiv(L, 16) * 16, W)
            offs = sl * SW + tl.arange(0, SW)
            x = tl.load(s_ptr + row * stride_r + offs, mask=offs < LR, other=0.0)
            m, cand = _row_keys(x, offs < L)
            if LEVEL > 0:
                cand = cand & ((m >> (32 - D0 * LEVEL)) == prefix)
            b = ((m >> (32 - D0 * (LEVEL + 1))) & ((1 << D0) - 1)).to(tl.int32)
            bins = tl.arange(0, 1 << D0)
            if HIST_MASK:
                h = tl.histogram(b, 1 << D0, mask=cand)
            else:
                h = tl.histogram(tl.where(cand, b, 0), 1 << D0)
                h = h - tl.where(bins == 0, SW - tl.sum(cand.to(tl.int32), axis=0), 0)
            tl.atomic_add(tot_ptr + (row * LV + LEVEL) * (1 << D0) + bins, h, mask=h != 0)

    @triton.jit
    def _split_compact_kernel(s_ptr, len_ptr, tot_ptr, bx_ptr, bp_ptr, cnt_ptr, W, k, NS, stride_r,
                              HAS_LEN: tl.constexpr, SW: tl.constexpr, D0: tl.constexpr, LV: tl.constexpr):
        """Program (row, slice): keep the slice's candidates that can still be selected after the LV
        full-row levels (key >= T when T is final, else key prefix >= the boundary prefix), in position
        order, in the slice's own region of the scratch; write how many."""
        row = tl.program_id(0).to(tl.int64)
        sl = tl.program_id(1)
        L = _row_length(len_ptr, row, W, HAS_LEN)
        n = tl.zeros([], tl.int32)
        if sl * SW < L:
            T, need, done, prefix, kk = _split_state(tot_ptr, row, k, LV, D0, LV)
            lowest = tl.where(done != 0, T, prefix << (32 - D0 * LV)).to(tl.uint32)
            LR = tl.minimum(tl.cdiv(L, 16) * 16, W)
            offs = sl * SW + tl.arange(0, SW)
            x = tl.load(s_ptr + row * stride_r + offs, mask=offs < LR, other=0.0)
            m, cand = _row_keys(x, offs < L)
            keep = cand & (m >= lowest)
            ki = keep.to(tl.int32)
            slot = tl.cumsum(ki, axis=0) - ki
            base = row * NS * SW + sl * SW
            tl.store(bx_ptr + base + slot, x, mask=keep)
            tl.store(bp_ptr + base + slot, offs, mask=keep)
            n = tl.sum(ki, axis=0)
        tl.store(cnt_ptr + row * NS + sl, n)

    @triton.jit
    def _split_vload(bx_ptr, bp_ptr, base, i, inb, ends, cnts, SW: tl.constexpr):
        """Element i of the row's kept list (the slices' regions read one after the other)."""
        past = i[:, None] >= ends[None, :]
        reg = tl.sum(past.to(tl.int32), axis=1)
        before = tl.sum(tl.where(past, cnts[None, :], 0), axis=1)
        a = base + reg.to(tl.int64) * SW + (i - before)
        x = tl.load(bx_ptr + a, mask=inb, other=0.0)
        p = tl.load(bp_ptr + a, mask=inb, other=0)
        return x, p

    @triton.jit
    def _split_finish_kernel(bx_ptr, bp_ptr, cnt_ptr, tot_ptr, out_ptr, osc_ptr, k, NS,
                             RET_SCORES: tl.constexpr, SW: tl.constexpr, SP: tl.constexpr, D0: tl.constexpr,
                             LV: tl.constexpr, D: tl.constexpr, NP: tl.constexpr, CH: tl.constexpr,
                             HIST_MASK: tl.constexpr):
        """Program per row: finish the radix select on the kept list (NP passes of D bits below the top
        D0*LV bits), then emit from the list's right end (the list is in position order)."""
        row = tl.program_id(0).to(tl.int64)
        NB: tl.constexpr = 1 << D
        T, need, done, prefix, kk = _split_state(tot_ptr, row, k, LV, D0, LV)
        sidx = tl.arange(0, SP)
        cnts = tl.load(cnt_ptr + row * NS + sidx, mask=sidx < NS, other=0)
        ends = tl.cumsum(cnts, axis=0)
        N = tl.sum(cnts, axis=0)
        base = row * NS * SW
        ar = tl.arange(0, CH)
        bins = tl.arange(0, NB)
        for q in tl.static_range(NP):
            if done == 0:
                h = tl.zeros([NB], tl.int32)
                n_q = tl.zeros([], tl.int32)
                for c in range(0, tl.cdiv(N, CH)):
                    i = c * CH + ar
                    inb = i < N
                    x, p = _split_vload(bx_ptr, bp_ptr, base, i, inb, ends, cnts, SW)
                    m, cand = _row_keys(x, inb)
                    cand = cand & ((m >> ((NP - q) * D)) == prefix)
                    b = ((m >> ((NP - 1 - q) * D)) & (NB - 1)).to(tl.int32)
                    if HIST_MASK:
                        h += tl.histogram(b, NB, mask=cand)
                    else:
                        h += tl.histogram(tl.where(cand, b, 0), NB)
                        n_q += tl.sum(cand.to(tl.int32), axis=0)
                if HIST_MASK:
                    n_q = tl.sum(h, axis=0)
                else:
                    h = h - tl.where(bins == 0, tl.cdiv(N, CH) * CH - n_q, 0)
                incl = n_q - tl.cumsum(h, axis=0) + h
                jq = tl.max(tl.where(incl >= kk, bins, -1), axis=0)
                above_q = tl.sum(tl.where(bins == jq, incl - h, 0), axis=0)
                hq = tl.sum(tl.where(bins == jq, h, 0), axis=0)
                kk = kk - above_q
                prefix = (prefix << D) | jq.to(tl.uint32)
                T = (prefix << ((NP - 1 - q) * D)).to(tl.uint32)
                need = kk
                exact = hq == kk
                if q == NP - 1:
                    exact = exact | True
                done = exact.to(tl.int32)

        cnt = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        c = tl.cdiv(N, CH) - 1
        orow = out_ptr + row * k
        scrow = osc_ptr + row * k
        while (c >= 0) & (cnt < k):
            i = c * CH + ar
            inb = i < N
            x, p = _split_vload(bx_ptr, bp_ptr, base, i, inb, ends, cnts, SW)
            cnt, ties = _emit_chunk(x, p, inb, T, need, cnt, ties, k, orow, scrow, RET_SCORES)
            c -= 1
        _pad_row(orow, scrow, cnt, k, CH, RET_SCORES)


@functools.lru_cache(maxsize=None)
def _config(W: int) -> tuple[int, int, int]:
    """(CHUNK, DIGIT, num_warps) from the row width only (never from the number of rows).

    Narrow rows (routing, short contexts) use 8-bit digits (256 bins, 4 passes at most); wide rows use
    11-bit digits (2048 bins, 3 passes at most: fewer passes over the row, fewer bin collisions in the
    shared-memory histogram). Every configuration computes the same pure function of the row.
    """
    chunk = 256
    while chunk < W and chunk < 4096:
        chunk *= 2
    digit = 8 if W <= 2048 else 11
    warps = 8 if chunk >= 2048 else (4 if chunk >= 1024 else 2)
    return chunk, digit, warps


#: which kernel design the public entry point runs for rows of width >= SPLIT_MIN_W: "split" (the default:
#: LV + 2 launches, see the module docstring) or "single" (one program per row). Both give identical bits
#: (exact integer logic, tested against the reference); the choice is about speed only. Override with the
#: environment variable ZD_TOPK_VARIANT or by assigning ``zerodiff.ops.topk.VARIANT``; it is read at every
#: call and never depends on the number of rows.
VARIANT = os.environ.get("ZD_TOPK_VARIANT", "split")
VARIANTS = ("single", "split")
#: the split variant is used only for rows at least this wide (narrow rows: routing, short contexts)
SPLIT_MIN_W = 4096
#: cap on the split variant's scratch (kept-candidate regions: 8 bytes per row element); more rows are
#: processed in consecutive blocks of rows (each row's result is a function of that row only)
SPLIT_SCRATCH_BYTES = 256 << 20


@functools.lru_cache(maxsize=None)
def _split_config(W: int) -> dict:
    """Split-design configuration from the row width only.

    SW: slice width (one program per slice in the full-row launches), about W/2 within [1024, 8192]
    (rows up to 256K: at most 32 slices); D0, LV: LV full-row levels of D0-bit digits (2 x 8 bits: two
    256-bin histograms over the row); D: digit of the passes over the kept list (32 - D0*LV must be a
    multiple of D: 2 passes of 8 bits); CH: chunk of the finishing program; W1/W2/W3: warps of the
    histogram / compaction / finishing launches.
    """
    sw = 1024
    while sw * 2 < W and sw < 8192:
        sw *= 2
    return dict(SW=sw, D0=8, LV=2, D=8, CH=512, W1=8 if sw >= 4096 else 4, W2=8 if sw >= 4096 else 4, W3=4)


def _check_variant(variant) -> str:
    if variant not in VARIANTS:
        raise InputError(f"deterministic_topk: unknown Top-K variant {variant!r} "
                         f"(zerodiff.ops.topk.VARIANT / ZD_TOPK_VARIANT must be one of {VARIANTS})")
    return variant


def _topk_split(scores, k, lengths, out, osc, return_scores, hmask, cfg):
    """Launch the split variant on ``scores`` [R, W] (W > 0, unit column stride) into out / osc."""
    R, W = scores.shape
    SW, D0, LV, D, CH = cfg["SW"], cfg["D0"], cfg["LV"], cfg["D"], cfg["CH"]
    for name, v in (("SW", SW), ("CH", CH)):
        if v < 16 or v & (v - 1):
            raise InputError(f"deterministic_topk: split {name}={v} must be a power of two >= 16")
    if not (1 <= D0 <= 12 and 1 <= LV and D0 * LV <= 32 and 1 <= D <= 12 and (32 - D0 * LV) % D == 0):
        raise InputError(f"deterministic_topk: split digits D0={D0}, LV={LV}, D={D}: need D0, D in [1, 12], "
                         f"D0*LV <= 32 and 32 - D0*LV to be a multiple of D")
    # no replicated lanes in a histogram: at most one warp per 32 elements of a slice / chunk
    w1, w2 = (max(1, min(cfg[key], SW // 32)) for key in ("W1", "W2"))
    w3 = max(1, min(cfg["W3"], CH // 32))
    NS = triton.cdiv(W, SW)
    SP = triton.next_power_of_2(NS)
    NP = (32 - D0 * LV) // D
    rows_per_block = max(1, SPLIT_SCRATCH_BYTES // (8 * NS * SW))
    has_len = lengths is not None
    lens_all = lengths.to(torch.int32).contiguous() if has_len else None
    for r0 in range(0, R, rows_per_block):
        r1 = min(R, r0 + rows_per_block)
        rb = r1 - r0
        s = scores[r0:r1]
        lens = lens_all[r0:r1] if has_len else out
        o = out[r0:r1]
        oc = osc[r0:r1] if return_scores else o
        tot = torch.zeros((rb, LV, 1 << D0), dtype=torch.int32, device=scores.device)
        bx = torch.empty((rb, NS * SW), dtype=torch.float32, device=scores.device)
        bp = torch.empty((rb, NS * SW), dtype=torch.int32, device=scores.device)
        cnt = torch.empty((rb, NS), dtype=torch.int32, device=scores.device)
        for level in range(LV):
            _split_hist_kernel[(rb, NS)](s, lens, tot, W, k, s.stride(0), HAS_LEN=has_len, SW=SW, D0=D0,
                                         LEVEL=level, LV=LV, HIST_MASK=hmask, num_warps=w1, **zt.LAUNCH_OPTS)
        _split_compact_kernel[(rb, NS)](s, lens, tot, bx, bp, cnt, W, k, NS, s.stride(0), HAS_LEN=has_len,
                                        SW=SW, D0=D0, LV=LV, num_warps=w2, **zt.LAUNCH_OPTS)
        _split_finish_kernel[(rb,)](bx, bp, cnt, tot, o, oc, k, NS, RET_SCORES=return_scores, SW=SW, SP=SP,
                                    D0=D0, LV=LV, D=D, NP=NP, CH=CH, HIST_MASK=hmask, num_warps=w3,
                                    **zt.LAUNCH_OPTS)


def _hist_mask_supported() -> bool:
    import inspect

    try:
        return "mask" in inspect.signature(tl.histogram).parameters
    except Exception:  # pragma: no cover
        return False


_HIST_MASK = zt.HAVE_TRITON and _hist_mask_supported()


def _topk_triton(scores, k, lengths, return_scores, chunk=None, digit=None, hist_mask=None, num_warps=None,
                 variant=None, split=None):
    """Run a Triton design. ``variant`` None = :data:`VARIANT` (for W >= SPLIT_MIN_W; narrower rows always
    run "single"); an explicit "split" runs the split kernels at any width (tests). ``split``: overrides
    of :func:`_split_config` keys; ``chunk`` / ``digit`` / ``hist_mask`` / ``num_warps``: overrides of the
    single design's configuration (tests, benchmark sweeps and ``zerodiff.experimental.topk_variants``)."""
    zt.require_triton()
    if variant is None:
        variant = _check_variant(VARIANT)
        if scores.dim() == 2 and scores.shape[1] < SPLIT_MIN_W:
            variant = "single"
    else:
        _check_variant(variant)
    if not zt.triton_usable_for(scores.device):
        raise RuntimeError(
            f"deterministic_topk: backend='triton' cannot run on {scores.device} here "
            f"(TRITON_INTERPRET={'1' if zt.INTERPRET else '0'}); use backend='reference' or CUDA tensors"
        )
    R, W = scores.shape
    if W > 1 and scores.stride(1) != 1:
        scores = scores.contiguous()  # the kernel reads unit-stride rows (any row stride)
    out = torch.empty((R, k), dtype=torch.int32, device=scores.device)
    osc = torch.empty((R, k), dtype=torch.float32, device=scores.device) if return_scores else out
    if R > 0 and W == 0:  # nothing to select (and no data pointer to hand to a kernel)
        out.fill_(-1)
        if return_scores:
            osc.fill_(float("-inf"))
    elif R > 0 and variant == "split":
        cfg = dict(_split_config(W))
        if split:
            unknown = set(split) - set(cfg)
            if unknown:
                raise InputError(f"deterministic_topk: unknown split config keys {sorted(unknown)}")
            cfg.update(split)
        hmask = _HIST_MASK if hist_mask is None else (hist_mask and _HIST_MASK)
        _topk_split(scores, k, lengths, out, osc, return_scores, hmask, cfg)
    elif R > 0:
        CHUNK, DIGIT, warps = _config(W)
        # overrides are for tests only: small chunks cover the multi-chunk logic at small widths, and
        # both digit widths / histogram variants are checked against the reference
        if chunk is not None:
            if chunk < 16 or chunk & (chunk - 1):
                raise InputError(f"deterministic_topk: chunk={chunk} must be a power of two >= 16")
            CHUNK = chunk
            warps = max(1, min(warps, CHUNK // 32))  # no replicated lanes in the histogram
        if digit is not None:
            if digit not in (8, 11):
                raise InputError(f"deterministic_topk: digit={digit} must be 8 or 11")
            DIGIT = digit
        if num_warps is not None:  # benchmark sweeps only; production picks it from W in _config
            warps = num_warps
        hmask = _HIST_MASK if hist_mask is None else (hist_mask and _HIST_MASK)
        lens = lengths.to(torch.int32).contiguous() if lengths is not None else out
        _topk_kernel[(R,)](
            scores, lens, out, osc, W, k, scores.stride(0),
            HAS_LEN=lengths is not None, RET_SCORES=return_scores, CHUNK=CHUNK,
            DIGIT=DIGIT, NPASS=(32 + DIGIT - 1) // DIGIT, NB=1 << DIGIT, HIST_MASK=hmask,
            num_warps=warps, **zt.LAUNCH_OPTS,
        )
    return (out, osc) if return_scores else out


def deterministic_topk(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, *,
                       return_scores: bool = False, backend: str | None = None,
                       check_lengths: bool | None = None):
    """Positions of the k largest (score, position) keys per row, sorted by position descending.

    See the module docstring for the contract. ``backend``: None | "triton" | "reference".
    ``check_lengths``: validate the VALUES of ``lengths`` (0 <= L <= W) on the
    host. Default None = only for CPU tensors, because on CUDA it costs a device sync per call and is
    impossible inside CUDA-graph capture; the kernel clamps every length to [0, W] regardless.
    """
    if check_lengths is None:
        check_lengths = not scores.is_cuda
    if check_lengths and scores.is_cuda and torch.cuda.is_current_stream_capturing():
        raise InputError("deterministic_topk: check_lengths=True needs a host sync, not allowed while "
                         "capturing a CUDA graph")
    check_inputs(scores, k, lengths, check_values=check_lengths)
    if backend is None:
        backend = "triton" if (scores.is_cuda and zt.triton_usable_for(scores.device)) else "reference"
    if backend == "reference":
        return deterministic_topk_ref(scores, k, lengths, return_scores=return_scores)
    if backend == "triton":
        return _topk_triton(scores, k, lengths, return_scores)
    raise InputError(f"deterministic_topk: unknown backend {backend!r} (use None, 'triton' or 'reference')")


def topk_routing(scores: torch.Tensor, k: int, *, backend: str | None = None):
    """Expert routing: (selected scores fp32 [T, k], expert ids int32 [T, k]), ids sorted descending.

    Same selection and tie rule as :func:`deterministic_topk` (ties -> larger expert id). NaN scores are
    never selected; a row with fewer than k non-NaN scores gets -1 ids / -inf scores in the tail.
    """
    ids, sc = deterministic_topk(scores, k, None, return_scores=True, backend=backend)
    return sc, ids
