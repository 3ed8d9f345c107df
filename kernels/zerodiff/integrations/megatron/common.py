"""Shared pieces of the Megatron glue: the weight-version check every backward runs first."""

from __future__ import annotations

__all__ = ["WeightVersionError"]


class WeightVersionError(RuntimeError):
    """A master weight was modified in place between a zerodiff forward and its backward."""



def _versions(*ts):
    return tuple(None if t is None else t._version for t in ts)


def _check_versions(ctx, *ts):
    now = _versions(*ts)
    if now != ctx.zd_versions:
        raise WeightVersionError(
            f"zerodiff: a master weight changed in place between forward and backward (versions "
            f"{ctx.zd_versions} -> {now}); the backward would differentiate other weights than the forward "
            "used. Run the optimizer step only after backward.")

