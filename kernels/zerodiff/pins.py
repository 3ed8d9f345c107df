"""The project's pins (versions and sha256 of the upstream sources), read from ``build/pins``.

``build/pins`` is the single source of truth: the Makefile includes it, bash sources it, and everything in
Python reads it through :func:`load`. Nothing else may hardcode a version or a hash.

Format: ``KEY=VALUE`` per line, no spaces around ``=``, no quotes; blank lines and lines starting with
``#`` are ignored. A malformed line, a duplicate key, a missing required key or a malformed sha256 raises
:class:`PinsError` naming the file, line and key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: keys every pins file must define.
REQUIRED_KEYS = (
    "VLLM_VERSION",
    "VLLM_COMMIT",
    "VLLM_SDIST",
    "VLLM_SDIST_SHA256",
    "VLLM_WHEEL",
    "VLLM_WHEEL_SHA256",
    "MEGATRON_VERSION",
    "MEGATRON_BRANCH",
    "MEGATRON_SDIST",
    "MEGATRON_SDIST_SHA256",
    "TORCH_IMAGE_VERSION",
    "TORCH_CPU_VERSION",
    "TRITON_CPU_VERSION",
    "RUNTIME_PYTHON",
    "RUNTIME_PLATFORM",
)

_KEY_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_VALUE_RE = re.compile(r"^[A-Za-z0-9._+/\-]+$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{7,40}$")


class PinsError(ValueError):
    """build/pins is missing or malformed."""


def repo_root() -> Path | None:
    """The zerodiff checkout this package was imported from (the folder holding ``build/pins``), or None.

    None happens for a non-editable install, where the package no longer sits inside the checkout.
    """
    root = Path(__file__).resolve().parents[2]
    return root if (root / "build" / "pins").is_file() else None


def pins_path() -> Path | None:
    """``$ZERODIFF_PINS`` if set, else ``<repo>/build/pins`` if the checkout is found, else None."""
    env = os.environ.get("ZERODIFF_PINS")
    if env:
        return Path(env)
    root = repo_root()
    return root / "build" / "pins" if root else None


def parse(text: str, source: str = "<pins>") -> dict[str, str]:
    """Parse pins text; validate the format of every line and of the sha256 / commit values."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise PinsError(f"{source}:{n}: expected KEY=VALUE, got {raw!r}")
        key, value = line.split("=", 1)
        if not _KEY_RE.match(key):
            raise PinsError(f"{source}:{n}: bad key {key!r} (upper case, digits, '_'; no spaces around '=')")
        if not _VALUE_RE.match(value):
            raise PinsError(f"{source}:{n}: bad value for {key}: {value!r} (no spaces, quotes or comments)")
        if key in out:
            raise PinsError(f"{source}:{n}: duplicate key {key}")
        if key.endswith("_SHA256") and not _SHA_RE.match(value):
            raise PinsError(f"{source}:{n}: {key} must be 64 lower-case hex digits, got {value!r}")
        if key.endswith("_COMMIT") and not _COMMIT_RE.match(value):
            raise PinsError(f"{source}:{n}: {key} must be a 7-40 digit hex commit id, got {value!r}")
        out[key] = value
    missing = [k for k in REQUIRED_KEYS if k not in out]
    if missing:
        raise PinsError(f"{source}: missing required key(s): {', '.join(missing)}")
    return out


def load(path: str | os.PathLike | None = None) -> dict[str, str]:
    """Read and validate the pins file (default: :func:`pins_path`)."""
    p = Path(path) if path is not None else pins_path()
    if p is None:
        raise PinsError(
            "build/pins not found: zerodiff is not imported from a checkout (set ZERODIFF_PINS=<path to pins>)"
        )
    try:
        text = p.read_text()
    except OSError as e:
        raise PinsError(f"cannot read pins file {p}: {e}") from e
    return parse(text, str(p))
