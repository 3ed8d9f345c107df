"""Shared helpers for the build scripts (sources.py, patches.py, wheel_kernels.py). Standard library only.

Every path the scripts use can be redirected by an environment variable, so tests point them at tmp dirs:

| variable | default | meaning |
|---|---|---|
| ``ZERODIFF_PINS`` | ``build/pins`` | the pins file |
| ``ZD_DOWNLOADS`` | ``build/downloads`` | cache of downloaded archives |
| ``ZD_SOURCES`` | ``build/sources`` | where the pristine upstream trees are unpacked (``vllm``, ``megatron``) |
| ``ZD_PATCHES`` | ``patches`` | the patch series (``vllm/series``, ``megatron/series``) |
| ``VLLM_SRC`` / ``MEGATRON_SRC`` | unset | a user's own checkout (a fork) used instead of the pinned tree |
| ``ZD_OFFLINE`` | unset | ``1``: never download; a missing archive is an error |
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = ("vllm", "megatron")

# the pins parser lives in the zerodiff package; import it by path so the scripts work before installing
sys.path.insert(0, str(REPO / "kernels"))
from zerodiff import pins as _pins  # noqa: E402

PinsError = _pins.PinsError

#: fixed identity and dates for the commits the scripts make (reproducible pristine commits)
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "zerodiff",
    "GIT_AUTHOR_EMAIL": "zerodiff@localhost",
    "GIT_COMMITTER_NAME": "zerodiff",
    "GIT_COMMITTER_EMAIL": "zerodiff@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
PRISTINE_TAG = "zerodiff-pristine"


class BuildError(RuntimeError):
    """A failure the user must act on; the scripts print it as ``ERROR: ...`` and exit 1."""


def load_pins() -> dict[str, str]:
    path = os.environ.get("ZERODIFF_PINS") or str(REPO / "build" / "pins")
    return _pins.load(path)


def env_path(var: str, default: Path) -> Path:
    v = os.environ.get(var)
    return Path(v).resolve() if v else default


def downloads_dir() -> Path:
    return env_path("ZD_DOWNLOADS", REPO / "build" / "downloads")


def sources_dir() -> Path:
    return env_path("ZD_SOURCES", REPO / "build" / "sources")


def patches_dir() -> Path:
    return env_path("ZD_PATCHES", REPO / "patches")


def user_tree(side: str) -> Path | None:
    """The user's own checkout for ``side`` (``VLLM_SRC`` / ``MEGATRON_SRC``), or None."""
    v = os.environ.get(f"{side.upper()}_SRC")
    return Path(v).expanduser().resolve() if v else None


def tree_for(side: str) -> tuple[Path, bool]:
    """(tree, is_user_tree): the user's checkout if given, else the pinned tree under the sources dir."""
    u = user_tree(side)
    return (u, True) if u else (sources_dir() / side, False)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str, what: str) -> None:
    """Refuse a file whose sha256 is not the pinned one."""
    got = sha256_file(path)
    if got != expected:
        raise BuildError(
            f"sha256 mismatch for {what} ({path}):\n"
            f"  expected {expected} (build/pins)\n"
            f"  got      {got}\n"
            f"  refusing to use it; delete the file to download it again, or fix build/pins if the pin moved"
        )


def git(args: list[str], cwd: Path, *, check: bool = True, env: dict | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **GIT_IDENTITY, **(env or {})}
    p = subprocess.run(["git", *args], cwd=str(cwd), env=full_env, text=True, input=input,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and p.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {cwd} (rc {p.returncode}):\n{p.stderr.strip()}")
    return p


def is_git_toplevel(path: Path) -> bool:
    p = git(["rev-parse", "--show-toplevel"], path, check=False)
    return p.returncode == 0 and Path(p.stdout.strip()).resolve() == path.resolve()


def say(msg: str) -> None:
    print(msg, flush=True)


def warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)


def main_wrapper(fn) -> int:
    """Run ``fn()``; print BuildError / PinsError as one clear ERROR and return 1."""
    try:
        return fn() or 0
    except (BuildError, PinsError) as e:
        print(f"ERROR: {e}", file=sys.stderr, flush=True)
        return 1
