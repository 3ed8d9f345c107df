"""Token log-probabilities with a fixed, batch-independent reduction order.

Public API::

    token_logprobs(logits, token_ids, *, temperature=1.0, backend=None, check_ids=True) -> fp32 [T]

``logits`` BF16 or FP32 ``[T, V]`` (last dim contiguous, any row stride), ``token_ids`` int64 ``[T]``,
``temperature`` a positive Python float, or an FP32 tensor ``[T]`` of per-row temperatures (for batches
that mix sampling temperatures). ``check_ids``: validate the ids
on the host (one device sync); skipped automatically while a CUDA graph is being captured.

Numerical contract (full statement and references in :mod:`zerodiff.reference.logprobs`):
one program per row; the vocabulary is streamed in chunks of ``CHUNK = 8192`` columns (a constant,
never derived from T); an exact running max and 8192 per-lane FP32 sums are updated chunk by chunk in
order (``s = s * exp(m - m') + exp(zs - m')``, FMA contraction off); the lanes are summed by a pairwise
tree; ``logp = (zs[id] - m) - log(S)``. ``zs = div_rn(float(z), temperature)`` when a temperature is
applied. A row's result therefore depends only on that row's logits, id and temperature: never on T,
on the row's position, or on the other rows. GPU ``exp``/``log`` are approximate: results match the
float64 math within a small tolerance, and are bit-identical between any two calls on the same device
and Triton version.

Bad inputs raise with the argument named: logits dtype/rank/non-contiguous last dim, ids dtype/shape or
out of range (``0 <= id < V``), non-positive/non-finite temperature, temperature tensor shape/dtype.
Out-of-range ids that reach the kernel (``check_ids=False`` or graph capture) give NaN, never an
out-of-bounds read.
"""

from __future__ import annotations

import math
import warnings

import torch

from .. import _triton as zt
from ..reference.logprobs import CHUNK, token_logprobs_ref
from ..errors import InputError

__all__ = ["token_logprobs", "CHUNK"]

_NUM_WARPS = 8
# the chunk loop prefetches the next chunks into shared memory (cp.async) with this many stages: a load
# schedule only, the arithmetic and its order are unchanged (3 x 16 KB for BF16, 2 x 32 KB for FP32)

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    bf16_to_f32 = zt.bf16_to_f32

    @triton.jit
    def _widen(x, IS_BF16: tl.constexpr, EXACT: tl.constexpr):
        if IS_BF16:
            return bf16_to_f32(x, EXACT)
        else:
            return x

    @triton.jit
    def pairwise_tree_sum(a, LOG2P: tl.constexpr):
        """Sum of a 1-D power-of-two-long tensor by the pairwise tree ``a'[i] = a[2i] + a[2i+1]``.

        Each level is a row sum of ``a`` viewed ``[n/2, 2]``: one FP32 addition per pair, so the same bits as
        ``lo + hi`` of a ``tl.split`` (IEEE addition is commutative). Written this way because Triton 3.6 took
        ~26 s on the H200's host (371 s on a 2-core CPU) to compile the 13 ``tl.split`` levels of an
        8192-lane tree, and under 1 s for this form (docs/verification.md)."""
        for _ in tl.static_range(LOG2P):
            a = tl.sum(tl.reshape(a, [a.shape[0] // 2, 2]), axis=1)
        return tl.sum(a, axis=0)  # one element left: exact

    @triton.jit
    def _logprobs_kernel(l_ptr, id_ptr, t_ptr, out_ptr, V, stride_l, temp,
                         SCALE: tl.constexpr, TEMP_TENSOR: tl.constexpr, IS_BF16: tl.constexpr,
                         CHUNK_: tl.constexpr, LOG2C: tl.constexpr, NUM_STAGES: tl.constexpr,
                         EXACT: tl.constexpr):
        pid = tl.program_id(0)
        base = l_ptr + pid.to(tl.int64) * stride_l
        if TEMP_TENSOR:
            temp = tl.load(t_ptr + pid)
        lanes = tl.arange(0, CHUNK_)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([CHUNK_], dtype=tl.float32)
        for start in tl.range(0, V, CHUNK_, num_stages=NUM_STAGES):
            cols = start + lanes
            z = _widen(tl.load(base + cols, mask=cols < V, other=float("-inf")), IS_BF16, EXACT)
            if SCALE:
                z = tl.div_rn(z, temp)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_sub)
            s = s * alpha + tl.exp(z - m_sub)
            m = m_new
        S = pairwise_tree_sum(s, LOG2C)
        tid = tl.load(id_ptr + pid)
        ok = (tid >= 0) & (tid < V)
        zt_ = _widen(tl.load(base + tl.where(ok, tid, 0)), IS_BF16, EXACT)
        if SCALE:
            zt_ = tl.div_rn(zt_, temp)
        lp = (zt_ - m) - tl.log(S)
        lp = tl.where(ok, lp, float("nan"))
        tl.store(out_ptr + pid, lp)


_NO_PIPELINE: set = set()


def _stages_for(dtype: torch.dtype) -> int:
    """Prefetch depth (a load schedule only). Falls back to 1 if this Triton failed to pipeline the loop."""
    if dtype in _NO_PIPELINE:
        return 1
    return 3 if dtype == torch.bfloat16 else 2


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *, temperature=1.0,
                   backend: str | None = None, check_ids: bool = True) -> torch.Tensor:
    """``log_softmax(logits / temperature)[t, token_ids[t]]`` in FP32 (see the module docstring)."""
    name = "token_logprobs"
    if not isinstance(logits, torch.Tensor) or logits.dtype not in (torch.bfloat16, torch.float32) \
            or logits.dim() != 2:
        raise InputError(f"{name}: logits must be a bfloat16 or float32 tensor [T, V], got "
                        f"{getattr(logits, 'dtype', type(logits))} {tuple(getattr(logits, 'shape', ()))}")
    T, V = logits.shape
    if V < 1:
        raise InputError(f"{name}: empty vocabulary (V=0)")
    if V > 1 and logits.stride(1) != 1:
        raise InputError(f"{name}: the vocabulary dim of logits must be contiguous (stride 1), "
                         f"got stride {logits.stride(1)}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype != torch.int64 \
            or tuple(token_ids.shape) != (T,):
        raise InputError(f"{name}: token_ids must be int64 of shape [{T}], got "
                         f"{getattr(token_ids, 'dtype', type(token_ids))} "
                         f"{tuple(getattr(token_ids, 'shape', ()))}")
    if token_ids.device != logits.device:
        raise InputError(f"{name}: token_ids is on {token_ids.device} but logits is on {logits.device}")
    temp_tensor = isinstance(temperature, torch.Tensor)
    if temp_tensor:
        if temperature.dtype != torch.float32 or tuple(temperature.shape) != (T,) \
                or temperature.device != logits.device:
            raise InputError(f"{name}: a temperature tensor must be float32 [{T}] on {logits.device}, got "
                             f"{temperature.dtype} {tuple(temperature.shape)} on {temperature.device}")
    else:
        tv = float(temperature)
        if not (math.isfinite(tv) and tv > 0):
            raise InputError(f"{name}: temperature must be a positive finite number, got {temperature!r}")
    if check_ids and T and not _capturing(logits):
        lo, hi = torch.stack(torch.aminmax(token_ids)).tolist()  # one small kernel, one sync
        if lo < 0 or hi >= V:
            i = int(((token_ids < 0) | (token_ids >= V)).nonzero()[0, 0])
            raise InputError(f"{name}: token_ids[{i}] = {int(token_ids[i])} is outside [0, V={V})")
        if temp_tensor:
            tb = ~(torch.isfinite(temperature) & (temperature > 0))
            if bool(tb.any()):
                i = int(tb.nonzero()[0, 0])
                raise InputError(f"{name}: temperature[{i}] = {float(temperature[i])} is not positive finite")
    if backend is None:
        backend = "triton" if (logits.is_cuda and zt.triton_usable_for(logits.device)) else "reference"
    if backend == "reference":
        return token_logprobs_ref(logits, token_ids, temperature)
    if backend != "triton":
        raise InputError(f"{name}: unknown backend {backend!r} (use None, 'triton' or 'reference')")
    zt.require_triton()
    if not zt.triton_usable_for(logits.device):
        raise RuntimeError(f"{name}: backend='triton' cannot run on {logits.device} here "
                           f"(TRITON_INTERPRET={'1' if zt.INTERPRET else '0'}); use backend='reference' or CUDA")
    out = torch.empty(T, dtype=torch.float32, device=logits.device)
    if T == 0:
        return out
    ids = token_ids if token_ids.stride(0) == 1 else token_ids.contiguous()
    scale = temp_tensor or float(temperature) != 1.0
    tptr = temperature.contiguous() if temp_tensor else out
    args = (logits, ids, tptr, out, V, logits.stride(0), 1.0 if temp_tensor else float(temperature))
    meta = dict(SCALE=scale, TEMP_TENSOR=temp_tensor, IS_BF16=logits.dtype == torch.bfloat16,
                CHUNK_=CHUNK, LOG2C=CHUNK.bit_length() - 1, EXACT=zt.EXACT_CASTS,
                num_warps=_NUM_WARPS, **zt.LAUNCH_OPTS)
    stages = _stages_for(logits.dtype)
    try:
        _logprobs_kernel[(T,)](*args, NUM_STAGES=stages, **meta)
    except Exception as ex:  # noqa: BLE001 - retried once without the prefetch; a real error fails again
        if stages == 1:
            raise
        warnings.warn(f"token_logprobs: the pipelined kernel failed ({type(ex).__name__}: {str(ex)[:200]}); "
                      "using the unpipelined one (same arithmetic, no prefetch)")
        _NO_PIPELINE.add(logits.dtype)
        _logprobs_kernel[(T,)](*args, NUM_STAGES=1, **meta)
    return out
