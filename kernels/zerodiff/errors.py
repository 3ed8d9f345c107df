"""The exception types zerodiff's kernels and the end-to-end model raise (one per kind of failure).

* :class:`InputError`: an op refused an argument (dtype, shape, layout, value, backend name). It is both a
  ``ValueError`` and a ``TypeError``, so callers that catch either keep working; the message names the op and
  the bad argument.
* :class:`WeightVersionError`: a master weight was modified in place between a training forward and its
  backward (an optimizer step ran in between); the backward would differentiate other weights than the
  forward used.

Configuration refusals of the vLLM / Megatron glue are ``zerodiff.integrations.ConfigError``.
"""

from __future__ import annotations

__all__ = ["InputError", "WeightVersionError"]


class InputError(TypeError, ValueError):
    """An op refused one of its arguments; the message names the op and the argument."""


class WeightVersionError(RuntimeError):
    """A master weight was modified in place between a zerodiff forward and its backward."""
