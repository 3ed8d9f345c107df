#!/usr/bin/env python3
"""`make sources`: the pinned vLLM and megatron-core source trees, as plain git repos.

For each side (vllm, megatron):

1. the sdist named in build/pins is taken from the downloads cache, or fetched with pip when missing
   (cached when present and its sha256 matches);
2. its sha256 is checked against build/pins: a mismatch is refused (exit 1, both hashes printed);
3. it is unpacked into ``build/sources/<side>``, which becomes a git repo with exactly one commit
   ("pristine vllm 0.33.0 (4ba787ec9)", tag ``zerodiff-pristine``), so patches are made, applied and checked
   with plain git.

``VLLM_SRC=`` / ``MEGATRON_SRC=`` point at your own checkout (an internal fork) instead: nothing is
downloaded for that side; its version is detected and a WARNING is printed when it is not the pinned one
(apply still proceeds with a 3-way merge). Paths are overridable for tests (see _buildlib.py).

usage: sources.py [--side vllm|megatron|all] [--offline]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from _buildlib import (PRISTINE_TAG, SIDES, BuildError, downloads_dir, git, is_git_toplevel, load_pins,
                       main_wrapper, say, sha256_file, sources_dir, user_tree, verify_sha256, warn)

MARKER = "zerodiff-source"  # file inside .git recording which archive a pristine tree came from


# ----------------------------------------------------------------------------------------------- fetch
def pip_download_cmd(side: str, pins: dict[str, str], dest: Path) -> tuple[list[str], dict[str, str]]:
    """The pip command that fetches the pinned sdist (commands measured in cpu-feasibility.md, section 2)."""
    py = sys.executable
    if side == "vllm":
        # setup.py imports torch and setuptools_rust at top level: no build isolation, version forced
        cmd = [py, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
               f"vllm=={pins['VLLM_VERSION']}", "-d", str(dest)]
        return cmd, {"VLLM_VERSION_OVERRIDE": pins["VLLM_VERSION"]}
    # megatron-core >= 0.17 declares Requires-Python >= 3.12; the sources are fine to fetch on 3.10/3.11
    cmd = [py, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--ignore-requires-python",
           f"megatron-core=={pins['MEGATRON_VERSION']}", "-d", str(dest)]
    return cmd, {}


def fetch(side: str, pins: dict[str, str], offline: bool) -> Path:
    """Return the verified sdist for ``side``, downloading it only when the cache lacks a good copy."""
    key = side.upper()
    name, sha = pins[f"{key}_SDIST"], pins[f"{key}_SDIST_SHA256"]
    ddir = downloads_dir()
    path = ddir / name
    if path.exists():
        if sha256_file(path) == sha:
            say(f"[{side}] cached {path} (sha256 ok)")
            return path
        if offline:
            verify_sha256(path, sha, f"{side} sdist")  # raises with both hashes
        warn(f"[{side}] cached {path} has the wrong sha256; downloading it again")
        path.unlink()
    if offline:
        raise BuildError(f"[{side}] {path} is missing and ZD_OFFLINE=1 forbids downloading it")
    ddir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ddir, prefix=".fetch-") as tmp:
        cmd, extra = pip_download_cmd(side, pins, Path(tmp))
        say(f"[{side}] fetching: {' '.join(cmd)}")
        p = subprocess.run(cmd, env={**os.environ, **extra}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        got = Path(tmp) / name
        if p.returncode != 0 or not got.exists():
            tail = "\n".join(p.stdout.strip().splitlines()[-15:])
            raise BuildError(f"[{side}] pip could not fetch {name} (rc {p.returncode}):\n{tail}")
        verify_sha256(got, sha, f"{side} sdist")
        shutil.move(str(got), str(path))
    say(f"[{side}] downloaded {path} (sha256 ok)")
    return path


# ---------------------------------------------------------------------------------------------- unpack
def unpack(side: str, archive: Path, pins: dict[str, str], dest: Path) -> None:
    """Unpack ``archive`` into ``dest`` and make it a one-commit git repo tagged ``zerodiff-pristine``."""
    sha = pins[f"{side.upper()}_SDIST_SHA256"]
    marker = dest / ".git" / MARKER
    stamp = f"archive={archive.name} sha256={sha}\n"
    if dest.exists():
        if marker.exists() and marker.read_text() == stamp:
            say(f"[{side}] {dest} already unpacked (pristine commit tagged {PRISTINE_TAG}; `make unapply` removes applied patches)")
            return
        raise BuildError(
            f"[{side}] {dest} exists but was not made from {archive.name} (sha256 {sha[:12]}...); "
            f"remove it (`make clean`) and run `make sources` again"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{side}-unpack-"))
    try:
        with tarfile.open(archive) as tf:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(tmp, **kw)
        tops = [p for p in tmp.iterdir()]
        if len(tops) != 1 or not tops[0].is_dir():
            raise BuildError(f"[{side}] {archive} does not hold exactly one top-level folder: {tops}")
        tops[0].rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    version = pins[f"{side.upper()}_VERSION"]
    extra = pins["VLLM_COMMIT"] if side == "vllm" else pins["MEGATRON_BRANCH"]
    git(["init", "-q"], dest)
    git(["config", "core.autocrlf", "false"], dest)
    git(["add", "-A", "-f", "."], dest)  # -f: the archive's own .gitignore must not drop files
    # no signing, no hooks: a user's global git config must not change or block the pristine commit
    git(["-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m", f"pristine {side} {version} ({extra})"],
        dest)
    git(["-c", "tag.gpgsign=false", "tag", PRISTINE_TAG], dest)
    marker.write_text(stamp)
    n = len(git(["ls-files"], dest).stdout.splitlines())
    say(f"[{side}] unpacked {archive.name} into {dest}: {n} files, one commit, tag {PRISTINE_TAG}")


# ------------------------------------------------------------------------------------ version detection
_PY_STR = r"""['"]([^'"]+)['"]"""


def detect_vllm_version(tree: Path) -> tuple[str | None, str | None, str]:
    """(version, commit, where it was found) for a vLLM tree."""
    vf = tree / "vllm" / "_version.py"
    if vf.exists():
        t = vf.read_text(errors="replace")
        m = re.search(r"^(?:__version__\s*=\s*)?version\s*=\s*" + _PY_STR, t, re.M) or \
            re.search(r"__version__\s*=\s*" + _PY_STR, t)
        c = re.search(r"commit_id\s*=\s*" + _PY_STR, t)
        if m:
            commit = c.group(1).lstrip("g") if c else None
            return m.group(1), commit, str(vf.relative_to(tree))
    pk = tree / "PKG-INFO"
    if pk.exists():
        m = re.search(r"^Version:\s*(\S+)", pk.read_text(errors="replace"), re.M)
        if m:
            return m.group(1), None, "PKG-INFO"
    if (tree / ".git").exists():
        p = git(["describe", "--tags", "--always"], tree, check=False)
        if p.returncode == 0 and p.stdout.strip():
            d = p.stdout.strip()
            m = re.match(r"v?(\d+\.\d+\.\d+\S*?)(?:-\d+-g([0-9a-f]+))?$", d)
            if m:
                return m.group(1), m.group(2), "git describe"
            return None, d, "git describe"
    return None, None, "no vllm/_version.py, PKG-INFO or git tags found"


def detect_megatron_version(tree: Path) -> tuple[str | None, str | None, str]:
    """(version, commit, where it was found) for a megatron-core / Megatron-LM tree."""
    pi = tree / "megatron" / "core" / "package_info.py"
    if pi.exists():
        t = pi.read_text(errors="replace")
        parts = {}
        for k in ("MAJOR", "MINOR", "PATCH"):
            m = re.search(rf"^{k}\s*=\s*(\d+)", t, re.M)
            if m:
                parts[k] = m.group(1)
        if len(parts) == 3:
            pre = re.search(r"^PRE_RELEASE\s*=\s*" + _PY_STR, t, re.M)
            v = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}" + (pre.group(1) if pre else "")
            return v, None, "megatron/core/package_info.py"
    pk = tree / "PKG-INFO"
    if pk.exists():
        m = re.search(r"^Version:\s*(\S+)", pk.read_text(errors="replace"), re.M)
        if m:
            return m.group(1), None, "PKG-INFO"
    return None, None, "no megatron/core/package_info.py or PKG-INFO found"


def check_user_tree(side: str, tree: Path, pins: dict[str, str]) -> bool:
    """Report a user's checkout; WARN (and return False) when it is not at the pinned version."""
    var = f"{side.upper()}_SRC"
    if not tree.is_dir():
        raise BuildError(f"{var}={tree} is not a directory")
    detect = detect_vllm_version if side == "vllm" else detect_megatron_version
    version, commit, where = detect(tree)
    pinned = pins[f"{side.upper()}_VERSION"]
    ok = version == pinned
    desc = f"version {version or 'unknown'}" + (f", commit {commit}" if commit else "") + f" (from {where})"
    if side == "vllm" and ok and commit:
        pc = pins["VLLM_COMMIT"]
        if not (commit.startswith(pc) or pc.startswith(commit)):
            ok = False
            desc += f"; the pinned commit is {pc}"
    if ok:
        say(f"[{side}] using your tree {var}={tree}: {desc}: matches the pin")
    else:
        warn(f"[{side}] {var}={tree} is NOT the pinned {side} {pinned}: {desc}. "
             f"Proceeding: patches are applied with a 3-way merge and may conflict; "
             f"`make check-patches` checks them against this tree's HEAD.")
    if not is_git_toplevel(tree):
        warn(f"[{side}] {tree} is not the top of a git repo: apply works without 3-way merge, "
             f"and check-patches needs a git repo")
    return ok


# ------------------------------------------------------------------------------------------------ main
def run(sides: list[str], offline: bool) -> int:
    pins = load_pins()
    offline = offline or os.environ.get("ZD_OFFLINE") == "1"
    for side in sides:
        u = user_tree(side)
        if u is not None:
            check_user_tree(side, u, pins)
            continue
        archive = fetch(side, pins, offline)
        unpack(side, archive, pins, sources_dir() / side)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=[*SIDES, "all"], default="all")
    ap.add_argument("--offline", action="store_true", help="never download (same as ZD_OFFLINE=1)")
    a = ap.parse_args(argv)
    sides = list(SIDES) if a.side == "all" else [a.side]
    return main_wrapper(lambda: run(sides, a.offline))


if __name__ == "__main__":
    sys.exit(main())
