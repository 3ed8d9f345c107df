"""Position-independent elementwise math and fixed-order reductions in plain torch.

Why this exists: the exact-structure pure-torch ops of :mod:`zerodiff.model.ops` (:mod:`zerodiff.model.exact_ops`)
must give a token the same bits whatever batch it sits in. Two stock torch behaviours break that on the CPU:

* transcendental functions (``exp``, ``log``, ``sqrt``, ``sigmoid``) take a vectorised path for the bulk of a
  tensor and a scalar path for the tail, and the two may differ in the last ulp, so an element's value can
  depend on its flat position (i.e. on the batch);
* reductions (``sum``, ``matmul``) choose their blocking/threading from the tensor shape.

Everything here uses only IEEE basic operations (``+ - * /``, comparisons, bit manipulation, ``round``), which
are correctly rounded in every code path, so the value of an element depends only on its own inputs:

* ``det_exp`` / ``det_log`` / ``det_rsqrt`` compute in float64 by range reduction + polynomial (or Newton) and
  are accurate to a few float64 ulp (far below the float32/bf16 rounding applied afterwards);
* ``tree_sum`` reduces the last dimension by pairwise halving after zero-padding to a power of two: the
  summation tree depends only on the reduced length, never on the other dimensions.
"""

from __future__ import annotations

import math

import torch

_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.0 / math.log(2.0)


def _pow2_int(n: torch.Tensor) -> torch.Tensor:
    """2**n as float64 for integer-valued float64 n in [-1022, 1023], built from the bits (exact)."""
    e = (n.to(torch.int64) + 1023) << 52
    return e.view(torch.float64)


def det_exp(x: torch.Tensor) -> torch.Tensor:
    """exp in float64 using only basic ops. Input any float dtype; output float64. -inf -> 0, large -> inf."""
    x = x.to(torch.float64)
    xc = x.clamp(-745.0, 709.0)
    n = torch.round(xc * _INV_LN2)
    r = (xc - n * _LN2_HI) - n * _LN2_LO  # |r| <= ~0.347
    # Taylor series to degree 14 (error < 1e-17 on |r| < 0.35), Horner form.
    p = torch.full_like(r, 1.0 / math.factorial(14))
    for k in range(13, -1, -1):
        p = p * r + 1.0 / math.factorial(k)
    # split the scale so 2**n never leaves the normal range
    n1 = torch.floor(n * 0.5)
    out = p * _pow2_int(n1) * _pow2_int(n - n1)
    out = torch.where(x < -745.0, torch.zeros_like(out), out)
    out = torch.where(x > 709.0, torch.full_like(out, math.inf), out)
    return torch.where(x != x, x, out)


def det_log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in float64 using only basic ops, for finite x > 0 (0 -> -inf; negative/NaN -> NaN)."""
    x = x.to(torch.float64)
    tiny = x < 2.2250738585072014e-308
    xs = torch.where(tiny, x * 2.0**64, x)
    bits = xs.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0x000FFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)  # in [1, 2)
    big = m > math.sqrt(2.0)
    m = torch.where(big, m * 0.5, m)
    e = torch.where(big, e + 1, e).to(torch.float64)
    e = torch.where(tiny, e - 64.0, e)
    s = (m - 1.0) / (m + 1.0)  # |s| <= 0.1716
    s2 = s * s
    p = torch.full_like(s, 1.0 / 41.0)
    for k in range(39, 0, -2):
        p = p * s2 + 1.0 / k
    lg = 2.0 * s * p + e * _LN2_HI + e * _LN2_LO
    lg = torch.where(x == 0, torch.full_like(lg, -math.inf), lg)
    lg = torch.where(x == math.inf, x, lg)
    return torch.where((x < 0) | (x != x), torch.full_like(lg, math.nan), lg)


def det_rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1/sqrt(x) in float64 for x > 0 by bit-trick start + Newton iterations (basic ops only)."""
    x = x.to(torch.float64)
    i = x.view(torch.int64)
    y = (0x5FE6EB50C7B537A9 - (i >> 1)).view(torch.float64)
    for _ in range(6):
        y = y * (1.5 - 0.5 * x * y * y)
    return y


def det_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid in float64 (basic ops + det_exp)."""
    return 1.0 / (1.0 + det_exp(-x.to(torch.float64)))


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by pairwise halving after zero-padding to a power of two (fixed tree per length)."""
    if dim != -1 and dim != x.dim() - 1:
        x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    p = 1 << (n - 1).bit_length()
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def seq_sum(terms):
    """Left-to-right sum of a Python sequence of tensors (fixed order)."""
    acc = terms[0]
    for t in terms[1:]:
        acc = acc + t
    return acc
