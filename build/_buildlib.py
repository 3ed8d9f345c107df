"""Shared helpers for the build scripts (sources.py, patches.py, wheel_kernels.py, wheel_overlay.py,
vllm_runtime.py). Standard library only.

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
import tempfile
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


def wheel_platform(filename: str) -> str:
    """The platform tag of a wheel file name (the last of its dash-separated fields before ``.whl``)."""
    if not filename.endswith(".whl") or filename.count("-") < 4:
        raise BuildError(f"{filename!r} is not a wheel file name (name-version-python-abi-platform.whl)")
    return filename[: -len(".whl")].rsplit("-", 1)[1]


def pip_download(requirement: str, dest: Path, *, platforms: tuple[str, ...] = (),
                 python_version: str | None = None, what: str | None = None) -> Path:
    """Download the one wheel pip picks for ``requirement`` (no dependencies, binary only) into ``dest``.

    ``platforms`` / ``python_version`` select wheels for another machine (pip's ``--platform``,
    ``--python-version``, CPython). pip writes into a fresh temporary folder first, so the file it chose is
    known exactly; it is then moved into ``dest`` (replacing a file of the same name). Returns its path.
    Raises BuildError with pip's last lines when pip fails or yields anything but exactly one wheel.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
               "--only-binary", ":all:", "-d", tmp]
        for plat in platforms:
            cmd += ["--platform", plat]
        if python_version:
            cmd += ["--python-version", python_version, "--implementation", "cp"]
        cmd.append(requirement)
        p = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        got = sorted(Path(tmp).iterdir())
        if p.returncode != 0 or len(got) != 1 or not got[0].name.endswith(".whl"):
            tail = "\n".join(l for l in p.stdout.strip().splitlines() if "is ignored" not in l)
            tail = "\n".join(tail.splitlines()[-12:])
            raise BuildError(f"pip could not fetch {what or requirement} ({requirement!r}, rc {p.returncode}, "
                             f"files {[f.name for f in got]}):\n{tail}")
        target = dest / got[0].name
        got[0].replace(target)
    return target


def fetch_pinned_wheel(name_key: str, sha_key: str, requirement: str, pins: dict[str, str], *,
                       offline: bool, python_version: str | None = None, what: str = "wheel") -> Path:
    """``build/downloads/<pins[name_key]>``, fetched with pip for the wheel's own platform when missing,
    then checked against ``pins[sha_key]`` (a mismatch is refused). ``offline``: never download."""
    path = downloads_dir() / pins[name_key]
    if not path.exists():
        if offline:
            raise BuildError(f"{path} is missing and ZD_OFFLINE=1 (or --offline) forbids downloading it")
        say(f"fetching {pins[name_key]} with pip")
        got = pip_download(requirement, path.parent, platforms=(wheel_platform(pins[name_key]),),
                           python_version=python_version, what=what)
        if got.name != path.name:
            raise BuildError(f"pip fetched {got.name} for {requirement!r}, but build/pins' {name_key} is "
                             f"{path.name}: fix {name_key} in build/pins")
    verify_sha256(path, pins[sha_key], what)
    return path


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
