"""Shared Triton plumbing: availability, launch options and exact-rounding casts.

Two rules every zerodiff Triton kernel follows:

* **FP fusion is pinned off.** FMA contraction changes bits and Triton's default is flipping between
  releases (3.9 warns, 3.10 changes it). Every launch passes ``**LAUNCH_OPTS`` so the value never depends
  on the installed Triton's default. Rollout and training import the same kernels, so both compile with
  the same flags.
* **Casts are round-to-nearest-even, and e4m3 saturates.** On the GPU the native fp32->bf16 and
  fp32->e4m3 casts are RNE (measured on the H200, docs/verification.md); e4m3 overflow is clamped to +-448
  explicitly, because torch's own cast maps |x| >= 464 to NaN in torch 2.11 and saturates in torch 2.13.
  Triton's CPU interpreter truncates instead of rounding, so kernels take an ``EXACT_CASTS`` constexpr:
  when true they round with the integer helpers below, which give the reference bits on every input.
  ``EXACT_CASTS`` defaults to :data:`INTERPRET`: the interpreter runs the emulation, the GPU the native cast.
"""

from __future__ import annotations

import os

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:  # Triton is optional: the reference backend runs without it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAVE_TRITON = False

#: keyword arguments every zerodiff kernel launch passes (see module docstring).
LAUNCH_OPTS = {"enable_fp_fusion": False}

#: whether kernels should emulate RNE casts with integer ops (interpreter) or use native casts (GPU).
EXACT_CASTS: bool = INTERPRET


def require_triton() -> None:
    """Raise a clear error when a Triton backend is requested but unusable here."""
    if not HAVE_TRITON:
        raise RuntimeError(
            "zerodiff: the 'triton' backend was requested but Triton is not importable; "
            "install triton or use backend='reference'"
        )


def pick_backend(op: str, backend, device, *, interpreter_default: bool = False) -> str:
    """The backend an op runs: ``backend`` None -> "triton" on a CUDA device where Triton runs, else "reference"
    (with ``interpreter_default``, also "triton" for CPU tensors under ``TRITON_INTERPRET=1``). An explicit
    "triton" that cannot run here raises RuntimeError; an unknown name raises ValueError. ``op`` names the op in
    the messages (e.g. "zerodiff.kv_cache")."""
    if backend is None:
        cuda = str(device).startswith("cuda")
        return "triton" if triton_usable_for(device) and (cuda or interpreter_default) else "reference"
    if backend not in ("triton", "reference"):
        raise ValueError(f"{op}: unknown backend {backend!r} (use None, 'triton' or 'reference')")
    if backend == "triton":
        require_triton()
        if not triton_usable_for(device):
            raise RuntimeError(f"{op}: backend='triton' cannot run on {device} here (TRITON_INTERPRET="
                               f"{'1' if INTERPRET else '0'}: CUDA tensors need it unset, CPU tensors need it set); "
                               "use backend='reference'")
    return backend


def compiled_binary_count(kernel) -> int | None:
    """How many binaries Triton holds for a ``@triton.jit`` kernel over all devices (None when this Triton keeps
    its cache in a layout not known here). Tests use it to check that ``do_not_specialize`` keeps one binary for
    every row count."""
    caches = getattr(kernel, "device_caches", None)
    if not isinstance(caches, dict):
        return None
    total = 0
    for entry in caches.values():
        first = entry[0] if isinstance(entry, tuple) else entry
        if not isinstance(first, dict):
            return None
        total += len(first)
    return total


def triton_usable_for(device) -> bool:
    """True when a Triton kernel can run on tensors living on ``device``."""
    if not HAVE_TRITON:
        return False
    dev = str(device)
    if dev.startswith("cuda"):
        return not INTERPRET
    return INTERPRET


if HAVE_TRITON:

    @triton.jit
    def f32_to_bf16_rne(x):
        """fp32 -> bf16, round-to-nearest-even via integer ops (exact on the interpreter and the GPU)."""
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, (u >> 16) | 0x40, r)  # NaN stays NaN (quiet bit set)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def f32_to_e4m3_rne_sat_bits(x):
        """fp32 -> float8_e4m3fn code (uint8), RNE, saturating to +-448 (inf too), NaN -> 0x7F|sign.

        Same bits as ``zerodiff.reference.fp8_quant.e4m3_rne_saturate`` on every fp32 input.
        """
        u = x.to(tl.uint32, bitcast=True)
        sign = (u >> 24) & 0x80
        a = u & 0x7FFFFFFF
        is_nan = a > 0x7F800000
        # saturate: anything >= 448 (incl. inf) -> 448 = 0x43E00000
        a = tl.minimum(a, 0x43E00000)
        e = a >> 23
        # normal e4m3 range (|x| >= 2^-6, fp32 biased exponent >= 121): round mantissa at bit 20
        rn = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
        code_normal = rn - (120 << 3)
        # subnormal e4m3 (|x| < 2^-6): m = RNE(|x| * 2^9) = RNE(M >> s), s = 141 - e
        mant = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
        s = tl.minimum(141 - e.to(tl.int32), 31).to(tl.uint32)
        q = mant >> s
        rem = mant - (q << s)
        half = (tl.full(s.shape, 1, tl.uint32) << s) >> 1
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        code_sub = q + up.to(tl.uint32)
        code = tl.where(e >= 121, code_normal, code_sub)
        code = tl.where(is_nan, 0x7F, code)
        return (code | sign).to(tl.uint8)

    @triton.jit
    def bf16_to_f32(x, EXACT: tl.constexpr):
        """bf16 -> fp32, exact widening. The interpreter's native upcast mangles bf16 subnormals
        (1.3775e-39 became 1.0286e-38), so under EXACT the bits are shifted by hand; the GPU uses the
        native conversion."""
        if EXACT:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def cast_bf16(x, EXACT: tl.constexpr):
        """fp32 -> bf16 RNE: integer emulation when EXACT, the native cast otherwise."""
        if EXACT:
            return f32_to_bf16_rne(x)
        else:
            return x.to(tl.bfloat16)

    @triton.jit
    def cast_e4m3(x, EXACT: tl.constexpr):
        """fp32 -> float8_e4m3fn RNE satfinite: emulated when EXACT, native otherwise."""
        if EXACT:
            return f32_to_e4m3_rne_sat_bits(x).to(tl.float8e4nv, bitcast=True)
        else:
            # explicit saturation: the native cast's overflow behaviour is not relied upon
            return tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)

    @triton.jit
    def cache_row_offset(row, BPT: tl.constexpr):
        """``row * BPT`` for gathered cache rows, with its true byte alignment (up to 16) stated.

        Triton's divisibility analysis over-estimates the alignment of products like
        ``(block * BLOCK_SIZE + pos % BLOCK_SIZE) * BPT`` (it keeps the divisibility of the contiguous run
        that ``pos % BLOCK_SIZE`` came from), and then emits 16-byte vector loads at rows that are only
        ``BPT``-aligned: a misaligned-address fault on the H200 for BPT = 132 (docs/verification.md).
        """
        off = row * BPT
        if BPT % 16 == 0:
            off = tl.multiple_of(off, 16)
        elif BPT % 8 == 0:
            off = tl.multiple_of(off, 8)
        elif BPT % 4 == 0:
            off = tl.multiple_of(off, 4)
        elif BPT % 2 == 0:
            off = tl.multiple_of(off, 2)
        else:
            off = tl.multiple_of(off, 1)
        return off

