"""Shared pieces of the Megatron glue: the weight-version check every backward runs first."""

from __future__ import annotations

from ...errors import WeightVersionError

__all__ = ["WeightVersionError"]


def _versions(*ts):
    return tuple(None if t is None else t._version for t in ts)


def _check_versions(ctx, *ts):
    now = _versions(*ts)
    if now != ctx.zd_versions:
        raise WeightVersionError(
            f"zerodiff: a master weight changed in place between forward and backward (versions "
            f"{ctx.zd_versions} -> {now}); the backward would differentiate other weights than the forward "
            "used. Run the optimizer step only after backward.")


def _save_linear_ste(ctx, x2, w) -> None:
    """Keep what :func:`_linear_ste_backward` needs: the input ``x2``, the master ``w`` (off
    ``save_for_backward``, so the version check below names the problem) and its version now."""
    ctx.save_for_backward(x2)
    ctx.zd_weight = w
    ctx.zd_versions = _versions(w)


def _linear_ste_backward(ctx, g):
    """The straight-through backward of ``y = x2 @ w.T`` against the master ``ctx.zd_weight`` (weight-version
    check first), in FP32: ``(grad_x2, grad_w)``, each None where autograd does not need it (``needs_input_grad``
    positions 0 and 1)."""
    w = ctx.zd_weight
    _check_versions(ctx, w)
    (x2,) = ctx.saved_tensors
    g = g.float()
    gx = (g @ w.float()).to(x2.dtype) if ctx.needs_input_grad[0] else None
    gw = (g.t() @ x2.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
    return gx, gw

