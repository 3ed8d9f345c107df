"""The consistency switch (``ZERODIFF_CONSISTENT``, :func:`zerodiff.integrations.enabled`): the values it
accepts, its refusal of unclear ones, and the one way every patch of both series reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerodiff.integrations import ConfigError, enabled

REPO = Path(__file__).resolve().parents[1]


PATCH_SIDES = ["vllm", "megatron"]


def test_switch_values():
    assert enabled({}) is False
    assert enabled({"ZERODIFF_CONSISTENT": "0"}) is False
    assert enabled({"ZERODIFF_CONSISTENT": ""}) is False
    assert enabled({"ZERODIFF_CONSISTENT": "1"}) is True
    for bad in ("true", "yes", "2", "on", " 0", "0 ", " 1", "1\n"):
        with pytest.raises(ConfigError, match="ZERODIFF_CONSISTENT"):
            enabled({"ZERODIFF_CONSISTENT": bad})


SWITCH_HOOK = 'os.environ.get("ZERODIFF_CONSISTENT") == "1"'


SWITCH_GUARD = 'os.environ.get("ZERODIFF_CONSISTENT", "0") not in ("", "0")'


@pytest.mark.parametrize("side", PATCH_SIDES)
def test_patches_read_the_switch_one_way(side):
    """Every added line that reads the switch uses the hook form, except the config guard (0001), which uses
    the guard form: so a value like ' 0' can never turn hooks on while the guard stays silent."""
    seen_guard = 0
    for patch in sorted((REPO / "patches" / side).glob("*.patch")):
        for line in patch.read_text().splitlines():
            if not line.startswith("+") or "environ" not in line or "ZERODIFF_CONSISTENT" not in line:
                continue
            if "setenv" in line or "delenv" in line:
                continue
            if SWITCH_GUARD in line:
                assert patch.name.startswith("0001-"), f"{patch.name}: guard form outside the guard: {line}"
                seen_guard += 1
            else:
                assert SWITCH_HOOK in line, f"{patch.name}: the switch read another way: {line}"
    assert seen_guard == 1
