"""The patch series themselves: every listed patch exists, is ``git format-patch`` output behind the switch and
has a row in docs/patch-catalog.md; the real patch tooling applies the series (skipped when ``build/sources``
is absent, e.g. in CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _series(side):
    lines = (REPO / "patches" / side / "series").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def test_series_lists_existing_patches_and_catalog_covers_them():
    catalog = (REPO / "docs" / "patch-catalog.md").read_text()
    for side in ("vllm", "megatron"):
        names = _series(side)
        assert names, side
        for n in names:
            p = REPO / "patches" / side / n
            assert p.is_file(), p
            text = p.read_text()
            assert text.startswith("From ") and "Subject: [PATCH]" in text, n  # git format-patch output
            assert "ZERODIFF_CONSISTENT" in text, n  # every hunk is behind the switch
            assert n in catalog, f"docs/patch-catalog.md has no row for {side}/{n}"


@pytest.mark.skipif(not all((REPO / "build" / "sources" / s / ".git").exists() for s in ("vllm", "megatron")),
                    reason="pristine trees absent (run `make sources`); CI does not fetch them")
def test_check_patches_tooling():
    r = subprocess.run([sys.executable, str(REPO / "build" / "patches.py"), "check"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check-patches: OK" in r.stdout
