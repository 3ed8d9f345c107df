"""FP8 quantisation by the deployment rule (activations 1x128 per token, weights 128x128 blocks).

Numerical contract (bit for bit the rule of :mod:`zerodiff.reference.fp8_quant`):

* ``amax`` = max |x| over the group (activations: 1 x ``group`` along K per token; weights: ``block`` x
  ``block`` of [N, K]), FP32; a trailing partial group uses its valid elements only.
* ``scale = max(amax, 1e-10) / 448`` as one FP32 division, round-to-nearest-even (``tl.div_rn``).
  ``ue8m0=True`` rounds that FP32 scale *up* to a power of two on the bits (SM100 DeepGEMM variant).
* ``q = e4m3(x_f32 / scale)``: one RNE division, then RNE conversion to e4m3, saturating at +-448.
* Output never depends on the number of rows, the row position or any other group: one program owns whole
  groups, amax is an exact max (order-free).

Scale variants:

* **SM90 (H200, what runs now)**: FP32 scales, ``ue8m0=False`` (the default). DeepGEMM's SM90 FP8 kernels
  consume FP32 scales.
* **SM100 (GB200)**: DeepGEMM wants power-of-two (UE8M0) scales. Use ``ue8m0=True`` *here*, so the value
  is decided by our rule, never by a cast inside DeepGEMM (call it with ``disable_ue8m0_cast`` only after
  our scales are already powers of two, which makes its cast exact). The choice must be the same on the
  rollout and the training side; it is a deployment constant, never chosen per call site.

Layout helper: DeepGEMM's SM90 kernels read activation scales MN-major and TMA-aligned
(:func:`deepgemm_act_scales`); DeepGEMM re-lays plain row-major FP32 scales itself, so passing the
[M, K/128] tensor straight is also valid, the helper only avoids the extra transform in hot paths.

Public API::

    quant_act(x, *, group=128, ue8m0=False, backend=None) -> (q e4m3 [M, K], scale fp32 [M, ceil(K/group)])
    quant_weight(w, *, block=128, ue8m0=False, backend=None) -> (q e4m3 [N, K], scale fp32 [ceil(N/b), ceil(K/b)])
    Fp8Weight(q, scale, ue8m0=False)      # q [N, K] (or stacked [E, N, K]); scale [.., ceil(N/128), ceil(K/128)]
    Fp8Weight.from_master(w_bf16, *, ue8m0=False, backend=None)
    Fp8Weight.requantize_(w_bf16, *, backend=None)   # rewrites q and scale in place (same storage)
    deepgemm_act_scales(scale) -> the MN-major TMA-aligned copy DeepGEMM's SM90 kernels read

``quant_weight`` also accepts stacked expert weights ``[E, N, K]`` with ``N % block == 0`` (scales
``[E, N/block, ceil(K/block)]``); blocks never straddle two experts.

Backends: ``None`` (Triton on CUDA, reference on CPU), ``"triton"``, ``"reference"``.
Bad input (wrong dtype/rank, non-finite-free assumptions aside) raises ``InputError`` (a ValueError) naming the
argument.
NaN inputs are outside the contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _triton
from .._triton import EXACT_CASTS, HAVE_TRITON, LAUNCH_OPTS
from ..reference import fp8_quant as ref
from ..errors import InputError

FP8_DTYPE = torch.float8_e4m3fn
_GROUPS_PER_PROGRAM = 8

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton import cast_e4m3

    @triton.jit
    def _ue8m0_up(scale):
        bits = scale.to(tl.uint32, bitcast=True)
        expo = bits & 0x7F800000
        frac = bits & 0x007FFFFF
        expo = tl.where(frac != 0, expo + 0x00800000, expo)
        return expo.to(tl.float32, bitcast=True)

    @triton.jit(do_not_specialize=["M"])
    def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, G, stride_xm, stride_qm, stride_sm,
                          GROUP: tl.constexpr, GPB: tl.constexpr, UE8M0: tl.constexpr, EXACT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1) * GPB + tl.arange(0, GPB)
        c = tl.arange(0, GROUP)
        cols = g[:, None] * GROUP + c[None, :]
        mask = (cols < K) & (g[:, None] < G)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
        if UE8M0:
            scale = _ue8m0_up(scale)
        q = cast_e4m3(tl.div_rn(x, scale[:, None]), EXACT)
        tl.store(q_ptr + row * stride_qm + cols, q, mask=mask)
        tl.store(s_ptr + row * stride_sm + g, scale, mask=g < G)

    @triton.jit
    def _quant_weight_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_qn, stride_sn,
                             BLOCK: tl.constexpr, UE8M0: tl.constexpr, EXACT: tl.constexpr):
        nb = tl.program_id(0)
        kb = tl.program_id(1)
        rn = nb.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        rk = kb * BLOCK + tl.arange(0, BLOCK)
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
        scale = tl.div_rn(tl.maximum(amax, 1e-10), 448.0)
        if UE8M0:
            scale = _ue8m0_up(scale)
        q = cast_e4m3(tl.div_rn(w, scale), EXACT)
        tl.store(q_ptr + rn[:, None] * stride_qn + rk[None, :], q, mask=mask)
        tl.store(s_ptr + nb * stride_sn + kb, scale)


def _pick(backend, t: torch.Tensor) -> str:
    return _triton.pick_backend("zerodiff.fp8_quant", backend, t.device)


def _check_float(name, t, ndim):
    if not isinstance(t, torch.Tensor) or t.dim() not in ndim:
        raise InputError(f"zerodiff.fp8_quant: {name} must be a tensor of rank {ndim}, got "
                         f"{getattr(t, 'shape', type(t))}")
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"zerodiff.fp8_quant: {name} must be bf16/fp16/fp32, got {t.dtype}")


def quant_act(x: torch.Tensor, *, group: int = 128, ue8m0: bool = False, backend=None, out=None):
    """Per-token-group FP8 quant of ``x [M, K]`` -> ``(q e4m3 [M, K], scale fp32 [M, ceil(K/group)])``.

    ``out=(q, scale)`` writes into existing tensors (same shapes/dtypes, row-contiguous).
    """
    _check_float("x", x, (2,))
    if group not in (32, 64, 128):
        raise InputError(f"zerodiff.fp8_quant: group={group} unsupported (32, 64 or 128)")
    M, K = x.shape
    G = (K + group - 1) // group
    be = _pick(backend, x)
    if be == "reference":
        q, s = ref.quant_per_token_group_ref(x, group, ue8m0)
        if out is not None:
            out[0].copy_(q)
            out[1].copy_(s)
            return out
        return q, s
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
        s = torch.empty((M, G), dtype=torch.float32, device=x.device)
    else:
        q, s = out
        if q.shape != (M, K) or q.dtype != FP8_DTYPE or s.shape != (M, G) or s.dtype != torch.float32:
            raise InputError("zerodiff.fp8_quant: out=(q, scale) has the wrong shape/dtype")
    if M == 0:
        return q, s
    grid = (M, triton.cdiv(G, _GROUPS_PER_PROGRAM))
    _quant_act_kernel[grid](x, q, s, M, K, G, x.stride(0), q.stride(0), s.stride(0),
                            GROUP=group, GPB=_GROUPS_PER_PROGRAM, UE8M0=bool(ue8m0), EXACT=EXACT_CASTS,
                            num_warps=4, **LAUNCH_OPTS)
    return q, s


def _weight_into(w2d, q2d, s2d, block, ue8m0, be):
    N, K = w2d.shape
    if be == "reference":
        q, s = ref.quant_weight_block_ref(w2d, block, ue8m0)
        q2d.copy_(q)
        s2d.copy_(s)
        return
    if w2d.stride(-1) != 1:
        w2d = w2d.contiguous()
    grid = (triton.cdiv(N, block), triton.cdiv(K, block))
    _quant_weight_kernel[grid](w2d, q2d, s2d, N, K, w2d.stride(0), q2d.stride(0), s2d.stride(0),
                               BLOCK=block, UE8M0=bool(ue8m0), EXACT=EXACT_CASTS, num_warps=8, **LAUNCH_OPTS)


def _weight_shapes(w, block):
    if w.dim() == 2:
        N, K = w.shape
        return (N, K), ((N + block - 1) // block, (K + block - 1) // block)
    E, N, K = w.shape
    if N % block:
        raise InputError(f"zerodiff.fp8_quant: stacked expert weights need N % {block} == 0, got N={N}")
    return (E, N, K), (E, N // block, (K + block - 1) // block)


def quant_weight(w: torch.Tensor, *, block: int = 128, ue8m0: bool = False, backend=None, out=None):
    """128x128 block FP8 quant of a BF16 master weight ``[N, K]`` (or stacked ``[E, N, K]``)."""
    _check_float("w", w, (2, 3))
    if block != 128:
        raise InputError(f"zerodiff.fp8_quant: block={block} unsupported (the deployment rule is 128)")
    qshape, sshape = _weight_shapes(w, block)
    be = _pick(backend, w)
    if out is None:
        q = torch.empty(qshape, dtype=FP8_DTYPE, device=w.device)
        s = torch.empty(sshape, dtype=torch.float32, device=w.device)
    else:
        q, s = out
        if tuple(q.shape) != qshape or q.dtype != FP8_DTYPE or tuple(s.shape) != sshape or s.dtype != torch.float32:
            raise InputError(f"zerodiff.fp8_quant: out=(q, scale) must be e4m3 {qshape} and fp32 {sshape}, got "
                             f"{q.dtype} {tuple(q.shape)} and {s.dtype} {tuple(s.shape)}")
        if not (q.is_contiguous() and s.is_contiguous()):
            raise InputError("zerodiff.fp8_quant: out=(q, scale) must be contiguous")
    if w.numel() == 0:
        return q, s
    if w.dim() == 2:
        _weight_into(w, q, s, block, ue8m0, be)
    else:
        E, N, K = w.shape
        _weight_into(w.reshape(E * N, K), q.view(E * N, K), s.view(E * (N // block), sshape[2]), block, ue8m0, be)
    return q, s


@dataclass
class Fp8Weight:
    """A block-FP8 weight: ``q`` e4m3 ``[N, K]`` (or ``[E, N, K]``), ``scale`` fp32 ``[ceil(N/128), ceil(K/128)]``
    (or ``[E, N/128, ceil(K/128)]``), quantised from a BF16 master by the deployment rule."""

    q: torch.Tensor
    scale: torch.Tensor
    ue8m0: bool = False
    block: int = field(default=128)

    @classmethod
    def from_master(cls, w: torch.Tensor, *, ue8m0: bool = False, backend=None) -> "Fp8Weight":
        q, s = quant_weight(w, ue8m0=ue8m0, backend=backend)
        return cls(q, s, ue8m0)

    def requantize_(self, w: torch.Tensor, *, backend=None) -> "Fp8Weight":
        """Requantise from new master weights into the *same* storage (CUDA graphs keep their addresses)."""
        if tuple(w.shape) != tuple(self.q.shape):
            raise InputError(f"zerodiff.fp8_quant: requantize_ got master weight {tuple(w.shape)}, "
                             f"this Fp8Weight holds {tuple(self.q.shape)}")
        if w.device != self.q.device:
            raise InputError(f"zerodiff.fp8_quant: requantize_ master on {w.device}, weight on {self.q.device}")
        quant_weight(w, block=self.block, ue8m0=self.ue8m0, backend=backend, out=(self.q, self.scale))
        return self

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """FP32 dequantised weight (reference path; for checks and the STE backward)."""
        if self.q.dim() == 2:
            return ref.dequant_weight_block_ref(self.q, self.scale, self.block)
        return torch.stack([ref.dequant_weight_block_ref(self.q[e], self.scale[e], self.block)
                            for e in range(self.q.shape[0])])


def deepgemm_act_scales(scale: torch.Tensor) -> torch.Tensor:
    """The MN-major, TMA-aligned FP32 scale layout DeepGEMM's SM90 kernels read (values unchanged)."""
    from .. import backends

    dg = backends.deep_gemm()
    if dg is None:
        raise RuntimeError("zerodiff.fp8_quant: deepgemm_act_scales needs DeepGEMM (zerodiff.backends.deep_gemm() "
                           f"is None: {backends.status()['deepgemm']['detail']})")
    return dg.get_mn_major_tma_aligned_tensor(scale)
