"""Runtime glue between the upstream trees (vLLM 0.33.0, megatron-core 0.19.2) and the zerodiff ops.

The patch series in ``patches/vllm`` and ``patches/megatron`` stays thin: each patched call site asks
this package whether consistency mode is on and, if so, calls one adapter here. All logic (config
validation, layout conversion, autograd wrappers) lives in :mod:`zerodiff.integrations.vllm` and
:mod:`zerodiff.integrations.megatron` (one module per concern in each).

The switch
----------
Consistency mode is ON exactly when the environment variable ``ZERODIFF_CONSISTENT`` is the string
``"1"`` (:func:`enabled`); unset, ``""`` or ``"0"`` is OFF; every other value (``true``, ``" 0"``,
``"1 "``, ...) is refused with a :class:`ConfigError` at engine start, so a typo never leaves a mix of
patched and stock call sites running. There is one parser, an exact string comparison, written the same
way in every patched call site (``os.environ.get("ZERODIFF_CONSISTENT") == "1"``); the config guards run
whenever the value is set to anything but ``""``/``"0"`` and refuse what is not ``"1"``
(``tests/test_integration_switch.py`` checks every patch for exactly these two forms).

``VLLM_BATCH_INVARIANT`` neither implies nor is required by consistency mode. Reasons: (a) it changes the
stock path, which is the frozen throughput baseline, so coupling the two would move the baseline;
(b) vLLM's batch-invariant mode refuses MoE experts that do not declare batch invariance (DeepGEMM
experts included), while the consistent path routes the expert activation through zerodiff instead.
Setting both is allowed: our patched call sites take the zerodiff path whenever ``ZERODIFF_CONSISTENT=1``.

With the switch off, every patched call site runs the upstream code byte for byte: the patches read the
variable once (at import or construction time) and only import :mod:`zerodiff` when it is ``"1"``, so a
deployment without zerodiff installed is unaffected.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "ConfigError", "enabled"]

#: the one switch (see module docstring)
ENV = "ZERODIFF_CONSISTENT"


class ConfigError(ValueError):
    """A configuration that cannot keep diff = 0 in consistency mode; the message names each setting."""


def enabled(environ=None) -> bool:
    """True when consistency mode is on (``ZERODIFF_CONSISTENT=1``); refuses values other than 0/1/unset."""
    env = os.environ if environ is None else environ
    v = env.get(ENV)
    if v is None or v in ("", "0"):
        return False
    if v == "1":
        return True
    raise ConfigError(f"{ENV}={v!r}: expected '1' (consistency mode on) or '0'/unset (off)")


def _problems_to_error(side: str, problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(
            f"zerodiff consistency mode ({ENV}=1) cannot keep rollout/training log-probs bit-identical with "
            f"this {side} configuration:\n{lines}\nFix the settings above, or unset {ENV} to run the stock path."
        )
