#!/usr/bin/env python3
"""Lay the zerodiff vLLM series over an installed (or unpacked) vLLM wheel's Python tree.

The pinned vLLM wheel ships prebuilt kernels (FlashMLA, DeepGEMM, FlashAttention, vLLM's own ops); the
series changes only Python. So a patched vLLM is the pinned wheel with the series applied to the ``.py``
files it installed. This is the one step that does it, used by `make vllm-runtime` (on the unpacked wheel)
and by the Docker image (on ``site-packages``).

apply   ``--tree DIR``: DIR holds the package folder (``vllm/``) and its ``<pkg>-<version>.dist-info``, as a
        site-packages folder does. Each patch of ``patches/<side>/series`` is applied with the same
        ``git apply`` call build/patches.py uses (``patches.git_apply``), limited to the files under the
        package folder; the series' other files are upstream tests, which a wheel does not ship, and are
        listed as skipped. A patch already applied is skipped (idempotent). Then
        ``<python> -m compileall -q`` compiles the patched files, the dist-info's RECORD gets their new
        sha256 and size, and ``<dist-info>/zerodiff-overlay.json`` records what was done (see below).
status  ``--tree DIR``: for each patch of the record, whether its files still have the sha256 the overlay
        left (exit 1 if any differs or is missing, or there is no record).
plan    Print which files each patch touches, which are applied and which skipped; no tree needed.

Refused (exit 1, ``ERROR: ...``): a series file that is not ``.py`` (the wheel's compiled parts would not
match the patched sources); a tree whose dist-info version is not the pinned ``<SIDE>_VERSION``; a patch that
does not apply (named, with its file and hunk); a patched file that does not compile.

The record (JSON): ``side``, ``package``, ``version``, ``series_sha256``, ``patches`` (``name``, ``sha256``,
``subject``, ``files`` applied, ``skipped`` files), ``files`` (path -> sha256 after the series), ``compiled_with``
(the Python that byte-compiled them, or null).

usage: wheel_overlay.py {apply,status,plan} [--tree DIR] [--side vllm] [--python PY] [--no-compile]
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from _buildlib import BuildError, load_pins, main_wrapper, patches_dir, say, sha256_file
from patches import explain_failure, git_apply, inspect_patch, read_series

RECORD_NAME = "zerodiff-overlay.json"
#: the Python package each side's wheel installs (the only part of the series a wheel tree can take)
PACKAGES = {"vllm": "vllm", "megatron": "megatron"}
#: the distribution name in the dist-info folder name, per side
DISTRIBUTIONS = {"vllm": "vllm", "megatron": "megatron_core"}


@dataclass
class PatchPlan:
    """One patch of the series: the files it touches inside the package (applied) and outside (skipped)."""

    path: Path
    subject: str
    sha256: str
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def plan_series(side: str = "vllm") -> list[PatchPlan]:
    """The series of ``side`` split into applied / skipped files; BuildError if it touches a non-``.py`` file."""
    package = PACKAGES[side]
    out: list[PatchPlan] = []
    bad: list[str] = []
    for p in read_series(side):
        info = inspect_patch(p)
        plan = PatchPlan(p, info.subject, sha256_file(p))
        for f in info.files:
            if not f.endswith(".py"):
                bad.append(f"{p.name}: {f}")
            elif f.startswith(package + "/"):
                plan.files.append(f)
            else:
                plan.skipped.append(f)
        out.append(plan)
    if bad:
        raise BuildError(f"[{side}] the series touches files that are not Python; a wheel overlay cannot carry "
                         f"them (the wheel's compiled parts would not match):\n  " + "\n  ".join(bad))
    return out


def series_sha256(side: str) -> str:
    return sha256_file(patches_dir() / side / "series")


def find_dist_info(tree: Path, side: str) -> Path:
    """The one ``<dist>-<version>.dist-info`` folder of ``side``'s distribution in ``tree``."""
    dist = DISTRIBUTIONS[side]
    found = sorted(p for p in tree.glob("*.dist-info")
                   if p.is_dir() and p.name.split("-")[0].lower().replace("-", "_") == dist)
    if len(found) != 1:
        raise BuildError(f"{tree} should hold exactly one {dist}-<version>.dist-info folder, found "
                         f"{[p.name for p in found] or 'none'}: is --tree a site-packages folder with {dist}?")
    return found[0]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def update_record(tree: Path, dist_info: Path, rel_paths: list[str]) -> None:
    """Rewrite RECORD's hash and size for ``rel_paths`` (relative to ``tree``), adding rows missing from it."""
    rec = dist_info / "RECORD"
    rows = list(csv.reader(io.StringIO(rec.read_text()))) if rec.exists() else []
    index = {r[0]: i for i, r in enumerate(rows) if r}
    for rel in rel_paths:
        data = (tree / rel).read_bytes()
        row = [rel, _record_hash(data), str(len(data))]
        if rel in index:
            rows[index[rel]] = row
        else:  # new rows go before RECORD's own row (which has no hash), or at the end
            own = next((i for i, r in enumerate(rows) if r and r[0] == f"{dist_info.name}/RECORD"), len(rows))
            rows.insert(own, row)
            index = {r[0]: i for i, r in enumerate(rows) if r}
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    rec.write_text(buf.getvalue())


def apply_overlay(tree: Path, side: str = "vllm", python: str | None = sys.executable) -> dict:
    """Apply ``side``'s series to the wheel tree ``tree``; compile with ``python`` (None: skip); return the record.

    The contract is the module docstring's ``apply``; the record is also written to the dist-info folder.
    """
    tree = tree.resolve()
    package = PACKAGES[side]
    if not (tree / package).is_dir():
        raise BuildError(f"--tree {tree} has no {package}/ folder: point it at the folder that holds {package}/ "
                         f"(a site-packages folder or an unpacked wheel)")
    pins = load_pins()
    want = pins[f"{side.upper()}_VERSION"]
    dist_info = find_dist_info(tree, side)
    have = dist_info.name[: -len(".dist-info")].split("-", 1)[1]
    if have != want:
        raise BuildError(f"{tree} holds {DISTRIBUTIONS[side]} {have}, but the series is for "
                         f"{side.upper()}_VERSION={want} (build/pins)")
    plans = plan_series(side)
    # git apply outside a repository: never let git find a repository above the tree (it would then apply
    # paths relative to that repository's root and skip the tree's files)
    env = {"GIT_CEILING_DIRECTORIES": str(tree.parent)}
    include = f"--include={package}/*"
    done: list[str] = []
    for pl in plans:
        if not pl.files:
            say(f"[{side} overlay] {pl.path.name}: touches nothing in {package}/ (skipped: {', '.join(pl.skipped)})")
            continue
        if git_apply(tree, pl.path, include, "-R", "--check", env=env).returncode == 0:
            say(f"[{side} overlay] {pl.path.name}: already applied")
            done.append(pl.path.name)
            continue
        r = git_apply(tree, pl.path, include, env=env)
        if r.returncode != 0:
            raise BuildError(f"[{side} overlay] patch {pl.path.name} does not apply to {tree}:\n"
                             f"{explain_failure(pl.path, r.stderr)}\n"
                             f"  patches applied before it stay applied ({', '.join(done) or 'none'}); "
                             f"start again from a fresh copy of the wheel's tree")
        extra = f"; skipped (not in the wheel): {', '.join(pl.skipped)}" if pl.skipped else ""
        say(f"[{side} overlay] {pl.path.name}: applied to {len(pl.files)} file(s){extra}")
        done.append(pl.path.name)
    touched = sorted({f for pl in plans for f in pl.files})
    missing = [f for f in touched if not (tree / f).is_file()]
    if missing:  # a patch that deletes a file leaves none: the series never does that for a wheel overlay
        raise BuildError(f"[{side} overlay] after the series these files are missing: {', '.join(missing)}")
    compiled_with = None
    if python and touched:
        p = subprocess.run([python, "-m", "compileall", "-q", *[str(tree / f) for f in touched]], text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if p.returncode != 0:
            raise BuildError(f"[{side} overlay] the patched files do not compile with {python}:\n{p.stdout.strip()}")
        ver = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], text=True,
                             stdout=subprocess.PIPE).stdout.strip()
        compiled_with = f"python {ver}"
        say(f"[{side} overlay] {len(touched)} patched file(s) byte-compiled with {python} (Python {ver})")
    files = {f: sha256_file(tree / f) for f in touched}
    record = {
        "side": side,
        "package": package,
        "version": have,
        "series_sha256": series_sha256(side),
        "patches": [{"name": pl.path.name, "sha256": pl.sha256, "subject": pl.subject, "files": pl.files,
                     "skipped": pl.skipped} for pl in plans],
        "files": files,
        "compiled_with": compiled_with,
    }
    rec_path = dist_info / RECORD_NAME
    rec_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    update_record(tree, dist_info, touched + [str(rec_path.relative_to(tree))])
    say(f"[{side} overlay] {len(done)} patch(es) in {tree}; record: {rec_path.relative_to(tree)}")
    return record


def overlay_status(tree: Path, side: str = "vllm") -> list[tuple[str, str]]:
    """(patch name, 'ok' | 'changed: FILES' | 'missing: FILES') per patch of the tree's overlay record."""
    dist_info = find_dist_info(tree, side)
    rec_path = dist_info / RECORD_NAME
    if not rec_path.is_file():
        raise BuildError(f"{rec_path} does not exist: the series was never laid over this tree "
                         f"(`wheel_overlay.py apply --tree {tree}`)")
    rec = json.loads(rec_path.read_text())
    out = []
    for p in rec["patches"]:
        missing = [f for f in p["files"] if not (tree / f).is_file()]
        changed = [f for f in p["files"] if f not in missing and sha256_file(tree / f) != rec["files"][f]]
        out.append((p["name"], f"missing: {', '.join(missing)}" if missing else
                    f"changed: {', '.join(changed)}" if changed else "ok"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["apply", "status", "plan"])
    ap.add_argument("--tree", type=Path, help="folder holding the package and its dist-info (apply, status)")
    ap.add_argument("--side", choices=sorted(PACKAGES), default="vllm")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python that byte-compiles the patched files (default: this one)")
    ap.add_argument("--no-compile", action="store_true", help="do not byte-compile the patched files")
    a = ap.parse_args(argv)

    def run() -> int:
        if a.action == "plan":
            for pl in plan_series(a.side):
                say(f"{pl.path.name}  {pl.sha256[:16]}  {pl.subject}")
                for f in pl.files:
                    say(f"    apply  {f}")
                for f in pl.skipped:
                    say(f"    skip   {f}")
            return 0
        if a.tree is None:
            raise BuildError(f"{a.action} needs --tree DIR (the folder holding {PACKAGES[a.side]}/)")
        if a.action == "apply":
            apply_overlay(a.tree, a.side, None if a.no_compile else a.python)
            return 0
        rows = overlay_status(a.tree.resolve(), a.side)
        for name, state in rows:
            say(f"{name}: {state}")
        return 0 if all(s == "ok" for _, s in rows) else 1

    return main_wrapper(run)


if __name__ == "__main__":
    sys.exit(main())
