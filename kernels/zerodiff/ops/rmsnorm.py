"""RMSNorm with a fixed, batch-independent reduction order (optionally fused with the residual add).

Public API::

    rms_norm(x, weight, eps=1e-6, *, residual=None, backend=None)
        -> y bf16 (same shape as x), or (y, new_residual) when residual is given

Numerical contract (bit-exact reference: :func:`zerodiff.reference.rmsnorm.rms_norm_ref`):

* ``x`` BF16 ``[T, H]`` (any leading dims are flattened to rows; the last dim must be contiguous),
  ``weight`` BF16 or FP32 ``[H]``, ``residual`` BF16 with ``x``'s shape. ``eps`` is taken as FP32.
* Residual: ``r = bf16(float(x) + float(residual))`` is returned as the new residual and ``y = norm(r)``.
* One row per program; FP32 math, FMA contraction off: ``sq = v * v``; ``ss = tl.sum(sq)`` over the row
  zero-padded to ``P = next_pow2(H)`` with the launch configuration ``(P, num_warps)`` chosen from H
  alone, so the reduction tree is fixed by H; ``ms = div_rn(ss, H)``; ``den = sqrt_rn(ms + eps)``;
  ``rstd = div_rn(1, den)``; ``y = bf16_rne((v * rstd) * w)``.
* The order is set by H alone (not by T, the row's position or anything else in the batch), so the
  result is batch-invariant by construction, and rollout and training (same kernel, same H) agree bit for
  bit. The CPU reference :func:`zerodiff.reference.rmsnorm.rms_norm_ref` uses a pairwise tree for ``ss``:
  the kernel's tree differs, so kernel and reference agree to 1 bf16 ulp (tested), not bit for bit.
  (An earlier version reproduced the pairwise tree level by level in Triton: bit-exact against the CPU
  but 60-340x slower than ``F.rms_norm`` on the H200.)

Bad inputs raise with the argument named: non-BF16 ``x``/``residual``, weight dtype/shape, residual
shape, non-contiguous last dim, ``H`` above 65536, non-finite or negative ``eps``, unknown backend.
"""

from __future__ import annotations

import math

import torch

from .. import _triton as zt
from ..reference.rmsnorm import rms_norm_ref
from ..errors import InputError

__all__ = ["rms_norm"]

MAX_H = 65536

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    cast_bf16 = zt.cast_bf16

    bf16_to_f32 = zt.bf16_to_f32

    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, ro_ptr, H, eps,
                        sx, sres, sy, sro,
                        HAS_RES: tl.constexpr, W_BF16: tl.constexpr, P: tl.constexpr, EXACT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, P)
        m = cols < H
        v = bf16_to_f32(tl.load(x_ptr + row * sx + cols, mask=m, other=0.0), EXACT)
        if HAS_RES:
            rs = bf16_to_f32(tl.load(res_ptr + row * sres + cols, mask=m, other=0.0), EXACT)
            rb = cast_bf16(v + rs, EXACT)
            tl.store(ro_ptr + row * sro + cols, rb, mask=m)
            v = bf16_to_f32(rb, EXACT)
        ss = tl.sum(v * v, axis=0)
        ms = tl.div_rn(ss, H.to(tl.float32))
        den = tl.sqrt_rn(ms + eps)
        rstd = tl.div_rn(1.0, den)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        if W_BF16:
            w = bf16_to_f32(w, EXACT)
        y = (v * rstd) * w
        tl.store(y_ptr + row * sy + cols, cast_bf16(y, EXACT), mask=m)


def _config(H: int) -> tuple[int, int]:
    """(P, num_warps) from H only: this pins the kernel's reduction tree."""
    P = max(16, 1 << (H - 1).bit_length())
    nw = 4 if P <= 1024 else (8 if P <= 4096 else 16)
    return P, nw


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    t2 = t.reshape(-1, H)
    if t2.shape[0] and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None, backend: str | None = None):
    """RMSNorm of BF16 rows (see the module docstring). Returns ``y`` or ``(y, new_residual)``."""
    name = "rms_norm"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 1:
        raise InputError(f"{name}: x must be a bfloat16 tensor [..., H], got "
                        f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    H = x.shape[-1]
    if H < 1 or H > MAX_H:
        raise InputError(f"{name}: hidden size H={H} must be in [1, {MAX_H}]")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.bfloat16, torch.float32) \
            or tuple(weight.shape) != (H,):
        raise InputError(f"{name}: weight must be bfloat16 or float32 of shape [{H}], got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    if weight.device != x.device:
        raise InputError(f"{name}: weight is on {weight.device} but x is on {x.device}")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise InputError(f"{name}: eps must be a finite non-negative number, got {eps!r}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.bfloat16 \
                or residual.shape != x.shape:
            raise InputError(f"{name}: residual must be bfloat16 with x's shape {tuple(x.shape)}, got "
                             f"{getattr(residual, 'dtype', type(residual))} "
                             f"{tuple(getattr(residual, 'shape', ()))}")
        if residual.device != x.device:
            raise InputError(f"{name}: residual is on {residual.device} but x is on {x.device}")
    if backend is None:
        backend = "triton" if (x.is_cuda and zt.triton_usable_for(x.device)) else "reference"
    if backend == "reference":
        return rms_norm_ref(x, weight, eps, residual)
    if backend != "triton":
        raise InputError(f"{name}: unknown backend {backend!r} (use None, 'triton' or 'reference')")
    zt.require_triton()
    if not zt.triton_usable_for(x.device):
        raise RuntimeError(f"{name}: backend='triton' cannot run on {x.device} here "
                           f"(TRITON_INTERPRET={'1' if zt.INTERPRET else '0'}); use backend='reference' or CUDA")
    x2 = _rows(x, H)
    T = x2.shape[0]
    y = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
    if residual is not None:
        r2 = _rows(residual, H)
        ro = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
    else:
        r2, ro = x2, y
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    if T:
        P, nw = _config(H)
        _rmsnorm_kernel[(T,)](
            x2, r2, w, y, ro, H, eps, x2.stride(0), r2.stride(0), y.stride(0), ro.stride(0),
            HAS_RES=residual is not None, W_BF16=w.dtype == torch.bfloat16, P=P, EXACT=zt.EXACT_CASTS,
            num_warps=nw, **zt.LAUNCH_OPTS)
    y = y.reshape(x.shape)
    if residual is None:
        return y
    return y, ro.reshape(x.shape)
