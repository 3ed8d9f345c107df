"""Batch-invariant block-FP8 GEMM (W8A8 -> BF16): one accumulation order for every M.

Numerical contract (``a_q`` e4m3 [M, K], ``a_scale`` fp32 [M, ceil(K/128)] from ``quant_act``;
``w_q`` e4m3 [N, K], ``w_scale`` fp32 [ceil(N/128), ceil(K/128)] from ``quant_weight``):

* K is walked in 128-wide blocks in ascending order, no split-K. Per block ``kb``::

      partial = dot(a_q[m, blk], w_q[n, blk])          # FP32 result of the tensor-core MMA of this block only
      s       = a_scale[m, kb] * w_scale[n // 128, kb]   # one FP32 multiply (activation scale first)
      acc     = acc + partial * s                        # FP32 multiply then FP32 add (FP fusion pinned off)

  and the output is rounded once (RNE) to ``out_dtype`` (BF16 default, FP32 allowed).
* The tile configuration (BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, warps, stages) is a function of (N, K)
  only (:func:`gemm_config`); M never selects a kernel, a tile size or a split. Rows outside M are masked
  to zero on load and never stored, so a row's value does not depend on M, on its position, or on the
  other rows (``M`` is not specialised by the Triton JIT either).
* On the Triton interpreter (CPU) the block partial is computed in float64 (exact) and rounded once to
  FP32, which is bit for bit :func:`zerodiff.reference.fp8_gemm.fp8_gemm_ref`. On the GPU the block partial
  comes from the FP8 MMA (accumulator narrower than FP32), so GPU results equal the reference only within
  a tolerance but are bitwise invariant to batch composition.

Backends (``backend=``):

* ``"triton"``: the kernel above (SM90 and SM100).
* ``"deepgemm"``: DeepGEMM ``fp8_gemm_nt``, allowed only after :func:`deepgemm_verdict` verified for this
  (N, K, device) that every probed row is bitwise identical alone and inside batches of
  M = 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 1000, 2048, 4096, 8192 at several positions (cached per
  (N, K, device, ue8m0)); otherwise it raises (fail closed, never a silent fallback). On SM100 DeepGEMM casts
  scales to UE8M0, so it is refused unless the weight was quantised with ``ue8m0=True`` (then the cast is
  exact). DeepGEMM's value is *not* the Triton kernel's value: both sides of an RL job must use the same
  backend for a given (N, K).
* ``"reference"``: :func:`zerodiff.reference.fp8_gemm.fp8_gemm_ref` (float64 block partials).
* ``None``: CPU tensors -> reference; CUDA tensors -> ``$ZERODIFF_FP8_GEMM_BACKEND`` if set, else
  ``"deepgemm"`` when verified for (N, K), else ``"triton"``. The choice is per (N, K, device), never per M;
  :func:`selected_backend` reports it so rollout and training can assert they agree. The first call per
  (N, K) runs the probe (tens of GEMMs, DeepGEMM JIT): call ``selected_backend`` for every weight shape at
  model load; inside CUDA graph capture an unprobed shape raises instead of probing.

Public API::

    fp8_linear(x, w: Fp8Weight, *, backend=None) -> bf16 [M, N]       # quant_act + fp8_gemm
    fp8_gemm(a_q, a_scale, w_q, w_scale, *, out_dtype=torch.bfloat16, backend=None) -> [M, N]
    grouped_fp8_gemm(a_q, a_scale, w_q [E,N,K], w_scale [E,Nb,Kb], tile_expert, *, out_dtype, backend=None)
        # MoE: row tile i (BLOCK_M rows) uses expert tile_expert[i]; tiles with -1 are skipped (left as is).
        # Per-row math identical to fp8_gemm's Triton kernel.
    gemm_config(N, K) -> dict;  BLOCK_M (= 64, the row-tile height, a static constant)
    deepgemm_verdict(N, K, device, ue8m0=False) -> (ok: bool, detail: str)
    selected_backend(N, K, device, ue8m0=False) -> str
"""

from __future__ import annotations

import os

import torch

from .. import _triton, backends
from .._triton import EXACT_CASTS, HAVE_TRITON, LAUNCH_OPTS
from ..reference.fp8_gemm import fp8_gemm_ref
from .fp8_quant import FP8_DTYPE, Fp8Weight, quant_act
from ..errors import InputError

BLOCK_M = 64
BLOCK_K = 128
PROBE_MS = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 1000, 2048, 4096, 8192)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton import cast_bf16

    @triton.jit(do_not_specialize=["M"])
    def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, te_ptr, M, N, K,
                         stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
                         GROUPED: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        n_kb = tl.cdiv(K, BLOCK_K)
        e = pid_m * 0
        if GROUPED:
            e = tl.load(te_ptr + pid_m)
        valid = e >= 0
        n_iter = tl.where(valid, n_kb, 0)
        e64 = tl.maximum(e, 0).to(tl.int64)
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        as_ptrs = as_ptr + offs_m * stride_asm
        ws_ptrs = ws_ptr + e64 * stride_wse + (offs_n // 128) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, n_iter):
            k_mask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if EXACT:
                partial = tl.dot(a.to(tl.float32).to(tl.float64), w.to(tl.float32).to(tl.float64)).to(tl.float32)
            else:
                partial = tl.dot(a, w, out_dtype=tl.float32)
            a_s = tl.load(as_ptrs + kb, mask=m_mask, other=0.0)
            w_s = tl.load(ws_ptrs + kb, mask=n_mask, other=0.0)
            s = a_s[:, None] * w_s[None, :]
            acc = acc + partial * s
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        c_mask = m_mask[:, None] & n_mask[None, :] & valid
        if OUT_BF16:
            tl.store(c_ptrs, cast_bf16(acc, EXACT), mask=c_mask)
        else:
            tl.store(c_ptrs, acc, mask=c_mask)


def gemm_config(N: int, K: int) -> dict:
    """The one tile configuration for an (N, K) weight. Never depends on M."""
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=128, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)


def _check_operands(a_q, a_scale, w_q, w_scale, grouped=False):
    if a_q.dtype != FP8_DTYPE or w_q.dtype != FP8_DTYPE:
        raise InputError(f"zerodiff.fp8_gemm: a_q and w_q must be float8_e4m3fn, got {a_q.dtype}, {w_q.dtype}")
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise InputError(f"zerodiff.fp8_gemm: scales must be fp32, got {a_scale.dtype}, {w_scale.dtype}")
    if a_q.dim() != 2 or w_q.dim() != (3 if grouped else 2):
        raise InputError(f"zerodiff.fp8_gemm: bad ranks a_q {tuple(a_q.shape)}, w_q {tuple(w_q.shape)}")
    M, K = a_q.shape
    N = w_q.shape[-2]
    if w_q.shape[-1] != K:
        raise InputError(f"zerodiff.fp8_gemm: K mismatch: a_q has K={K}, w_q has K={w_q.shape[-1]}")
    Kb = (K + 127) // 128
    if tuple(a_scale.shape) != (M, Kb):
        raise InputError(f"zerodiff.fp8_gemm: a_scale must be [{M}, {Kb}] (1x128 groups), got {tuple(a_scale.shape)}")
    if tuple(w_scale.shape[-2:]) != ((N + 127) // 128, Kb):
        raise InputError(f"zerodiff.fp8_gemm: w_scale must be [..., {(N + 127) // 128}, {Kb}] (128x128 blocks), "
                         f"got {tuple(w_scale.shape)}")
    return M, N, K


def _launch(a_q, a_scale, w_q, w_scale, out, tile_expert=None):
    M, K = a_q.shape
    N = w_q.shape[-2]
    cfg = gemm_config(N, K)
    if a_q.stride(1) != 1:
        a_q = a_q.contiguous()
    if a_scale.stride(1) != 1:
        a_scale = a_scale.contiguous()
    w_q = w_q.contiguous()
    w_scale = w_scale.contiguous()
    grouped = tile_expert is not None
    if grouped:
        n_tiles = tile_expert.numel()
        if n_tiles * BLOCK_M < M:
            raise InputError(f"zerodiff.fp8_gemm: tile_expert has {n_tiles} tiles of {BLOCK_M} rows, fewer than M={M}")
        se, sse = w_q.stride(0), w_scale.stride(0)
    else:
        n_tiles = triton.cdiv(M, cfg["BLOCK_M"])
        se, sse = 0, 0
    if M == 0 or N == 0:
        return out
    grid = (n_tiles, triton.cdiv(N, cfg["BLOCK_N"]))
    _fp8_gemm_kernel[grid](
        a_q, a_scale, w_q, w_scale, out, tile_expert if grouped else a_scale, M, N, K,
        a_q.stride(0), a_scale.stride(0), se, w_q.stride(-2), sse, w_scale.stride(-2), out.stride(0),
        GROUPED=grouped, OUT_BF16=out.dtype == torch.bfloat16, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], EXACT=EXACT_CASTS, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **LAUNCH_OPTS)
    return out


# ----------------------------------------------------------------------------------------------- DeepGEMM
_VERDICTS: dict = {}


def _deepgemm_call(dg, a_q, a_scale, w_q, w_scale, out, ue8m0):
    dg.fp8_gemm_nt((a_q, a_scale), (w_q, w_scale), out, disable_ue8m0_cast=not ue8m0)
    return out


def _norm_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def deepgemm_verdict(N: int, K: int, device, ue8m0: bool = False) -> tuple[bool, str]:
    """Probe DeepGEMM ``fp8_gemm_nt`` for row invariance at (N, K) on ``device``; cached.

    Three victim rows are computed alone (M=1), then placed at positions 0, M//2 and M-1 among random filler
    rows for every M in :data:`PROBE_MS`, twice; every victim row must be bitwise equal to its M=1 result.
    """
    device = _norm_device(device)
    key = (int(N), int(K), str(device), bool(ue8m0))
    if key in _VERDICTS:
        return _VERDICTS[key]
    verdict = _probe(N, K, device, ue8m0)
    _VERDICTS[key] = verdict
    return verdict


def _probe(N, K, device, ue8m0):
    dg, why = backends.deep_gemm_on(device)
    if dg is None:
        return False, why
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"zerodiff.fp8_gemm: the DeepGEMM probe for (N={N}, K={K}) cannot run inside CUDA graph "
                           "capture; call fp8_gemm.selected_backend(N, K, device) for every weight shape at model "
                           "load, before capturing")
    cap = torch.cuda.get_device_capability(device)
    if cap[0] >= 10 and not ue8m0:
        return False, (f"sm_{cap[0]}{cap[1]}: DeepGEMM rounds FP32 scales to UE8M0; quantise with ue8m0=True "
                       "so the scale rule stays ours")
    try:
        g = torch.Generator(device=device)
        g.manual_seed(20261130 + N * 7 + K)
        w = (torch.randn((N, K), generator=g, device=device) * 0.05).to(torch.bfloat16)
        fw = Fp8Weight.from_master(w, ue8m0=ue8m0, backend="triton")
        maxm = max(PROBE_MS)
        pool = (torch.randn((maxm + 3, K), generator=g, device=device) * 2.0).to(torch.bfloat16)
        qa, sa = quant_act(pool, ue8m0=ue8m0, backend="triton")
        victims = [maxm, maxm + 1, maxm + 2]
        alone = []
        for v in victims:
            o = torch.empty((1, N), dtype=torch.bfloat16, device=device)
            alone.append(_deepgemm_call(dg, qa[v : v + 1].contiguous(), sa[v : v + 1].contiguous(), fw.q, fw.scale,
                                        o, ue8m0).clone())
        for rnd in range(2):
            for M in PROBE_MS:
                pos = sorted({0, M // 2, M - 1})
                idx = torch.arange(M, device=device)
                for j, p in enumerate(pos):
                    idx[p] = victims[j]
                a = qa.view(torch.uint8)[idx].view(FP8_DTYPE).contiguous()
                s = sa[idx].contiguous()
                o = torch.empty((M, N), dtype=torch.bfloat16, device=device)
                _deepgemm_call(dg, a, s, fw.q, fw.scale, o, ue8m0)
                for j, p in enumerate(pos):
                    if not torch.equal(o[p : p + 1], alone[j]):
                        nd = int((o[p : p + 1] != alone[j]).sum())
                        return False, (f"row at position {p} of M={M} differs from the same row alone in {nd} of {N} "
                                       f"values (round {rnd})")
        torch.cuda.synchronize(device)
    except Exception as ex:  # an exception means: not usable for this shape
        return False, f"DeepGEMM fp8_gemm_nt failed on the probe: {type(ex).__name__}: {ex}"
    return True, f"verified row-invariant for M in {PROBE_MS} at positions 0, M//2, M-1 (2 rounds)"


def _require_deepgemm(N, K, device, ue8m0):
    ok, detail = deepgemm_verdict(N, K, device, ue8m0)
    if not ok:
        raise RuntimeError(f"zerodiff.fp8_gemm: backend='deepgemm' refused for (N={N}, K={K}) on {device}: {detail}. "
                           "Use backend='triton' on both the rollout and the training side.")
    return backends.deep_gemm()


def selected_backend(N: int, K: int, device, ue8m0: bool = False) -> str:
    """What ``backend=None`` runs for an (N, K) weight on ``device`` (never depends on M)."""
    device = _norm_device(device)
    if device.type != "cuda":
        return "reference"
    env = os.environ.get("ZERODIFF_FP8_GEMM_BACKEND")
    if env:
        if env not in ("triton", "deepgemm", "reference"):
            raise InputError(f"zerodiff.fp8_gemm: ZERODIFF_FP8_GEMM_BACKEND={env!r} (use triton|deepgemm|reference)")
        return env
    return "deepgemm" if deepgemm_verdict(N, K, device, ue8m0)[0] else "triton"


def _resolve(backend, device, N, K, ue8m0):
    if backend is None:
        return selected_backend(N, K, device, ue8m0)
    if backend not in ("triton", "deepgemm", "reference"):
        raise InputError(f"zerodiff.fp8_gemm: unknown backend={backend!r} (None, 'triton', 'deepgemm', 'reference')")
    if backend == "triton":
        _triton.require_triton()
        if not _triton.triton_usable_for(device):
            raise RuntimeError(f"zerodiff.fp8_gemm: backend='triton' cannot run on {device} here")
    return backend


def fp8_gemm(a_q, a_scale, w_q, w_scale, *, out_dtype=torch.bfloat16, backend=None, ue8m0: bool = False,
             out=None):
    """Block-FP8 GEMM ``a_q [M, K] x w_q [N, K]^T -> [M, N]`` (see the module contract)."""
    M, N, K = _check_operands(a_q, a_scale, w_q, w_scale)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise InputError(f"zerodiff.fp8_gemm: out_dtype must be bf16 or fp32, got {out_dtype}")
    be = _resolve(backend, a_q.device, N, K, ue8m0)
    if be == "reference":
        r = fp8_gemm_ref(a_q, a_scale, w_q, w_scale, out_dtype)
        if out is not None:
            out.copy_(r)
            return out
        return r
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    if be == "deepgemm":
        if out_dtype != torch.bfloat16:
            raise InputError("zerodiff.fp8_gemm: backend='deepgemm' produces bf16 only")
        dg = _require_deepgemm(N, K, a_q.device, ue8m0)
        if M == 0:
            return out
        return _deepgemm_call(dg, a_q.contiguous(), a_scale.contiguous(), w_q, w_scale, out, ue8m0)
    return _launch(a_q, a_scale, w_q, w_scale, out)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, *, backend=None) -> torch.Tensor:
    """``quant_act(x)`` (1x128 groups, the weight's scale variant) then :func:`fp8_gemm` -> bf16 [M, N]."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise InputError(f"zerodiff.fp8_gemm: x must be bf16 [M, K], got {x.dtype} {tuple(x.shape)}")
    if not isinstance(w, Fp8Weight) or w.q.dim() != 2:
        raise InputError("zerodiff.fp8_gemm: w must be a 2-D Fp8Weight")
    N, K = w.q.shape
    be = _resolve(backend, x.device, N, K, w.ue8m0)
    qbe = "reference" if be == "reference" else "triton"
    q, s = quant_act(x, ue8m0=w.ue8m0, backend=qbe)
    return fp8_gemm(q, s, w.q, w.scale, backend=be, ue8m0=w.ue8m0)


def grouped_fp8_gemm(a_q, a_scale, w_q, w_scale, tile_expert, *, out_dtype=torch.bfloat16, backend=None,
                     out=None):
    """Grouped block-FP8 GEMM for MoE: rows ``[i*BLOCK_M, (i+1)*BLOCK_M)`` use expert ``tile_expert[i]``.

    ``w_q [E, N, K]``, ``w_scale [E, ceil(N/128), ceil(K/128)]``, ``tile_expert`` int32 [ceil(M/BLOCK_M)]
    (-1: tile skipped, its output rows are left untouched). Per-row math is that of :func:`fp8_gemm`'s
    Triton kernel, so a row's result is the same in any layout that gives it the same expert.
    """
    M, N, K = _check_operands(a_q, a_scale, w_q, w_scale, grouped=True)
    if tile_expert.dtype != torch.int32:
        raise InputError(f"zerodiff.fp8_gemm: tile_expert must be int32, got {tile_expert.dtype}")
    if backend not in (None, "triton", "reference"):
        raise InputError(f"zerodiff.fp8_gemm: grouped_fp8_gemm backend={backend!r} unsupported (triton|reference); "
                         "DeepGEMM grouped kernels are not verified row- and layout-invariant")
    if out is None:
        out = torch.zeros((M, N), dtype=out_dtype, device=a_q.device)
    be = backend or ("triton" if _triton.triton_usable_for(a_q.device) and a_q.is_cuda else "reference")
    if be == "reference":
        te = tile_expert.to(torch.int64).repeat_interleave(BLOCK_M)[:M]
        for e in torch.unique(te).tolist():
            if e < 0:
                continue
            rows = (te == e).nonzero().flatten()
            out[rows] = fp8_gemm_ref(a_q.view(torch.uint8)[rows].view(a_q.dtype), a_scale[rows], w_q[e], w_scale[e], out_dtype)
        return out
    _triton.require_triton()
    return _launch(a_q, a_scale, w_q, w_scale, out, tile_expert=tile_expert.contiguous())
