#!/usr/bin/env python3
"""`make apply` / `make unapply` / `make check-patches` / the patch summary, over patches/<side>/series.

A series file lists ``git format-patch`` files (in ``patches/<side>/``), one per line, applied top to
bottom; blank lines and lines starting with ``#`` are ignored. An empty series is valid.

apply     Applies each patch to the tree's working tree (``build/sources/<side>``, or ``VLLM_SRC`` /
          ``MEGATRON_SRC``). A patch that is already applied is skipped, so apply is idempotent. On the pinned
          tree a patch must apply exactly; on a user's tree it falls back to a 3-way merge. Nothing is committed.
unapply   Reverses the applied patches, last first; the tree returns to its previous bytes.
check     Without touching any working tree (a throw-away index is used):
          (a) each patch alone applies on the pristine base (cherry-pick semantics),
          (b) the whole series applies in order,
          (c) the series reverses cleanly back to the base tree, object for object,
          (d) every .py file the series touches compiles.
          The base is the pinned pristine commit (tag zerodiff-pristine) of build/sources/<side>, or HEAD of
          a user's tree. A failing patch is named with the file and hunk that failed.
summary   Patch names and subjects per side and the files they touch.

usage: patches.py {apply,unapply,check,summary} [--side vllm|megatron|all]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from _buildlib import (PRISTINE_TAG, SIDES, BuildError, git, is_git_toplevel, main_wrapper, patches_dir, say,
                       tree_for)


# ----------------------------------------------------------------------------------------------- series
def read_series(side: str) -> list[Path]:
    """The patch files listed in patches/<side>/series, in order; missing/duplicate entries are errors."""
    d = patches_dir() / side
    sf = d / "series"
    if not sf.exists():
        raise BuildError(f"series file {sf} is missing (an empty file is a valid empty series)")
    out: list[Path] = []
    for n, raw in enumerate(sf.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "/" in line or line in (".", ".."):
            raise BuildError(f"{sf}:{n}: {line!r}: list bare file names of patches in {d}")
        p = d / line
        if not p.is_file():
            raise BuildError(f"{sf}:{n}: patch {line!r} is listed but {p} does not exist")
        if p in out:
            raise BuildError(f"{sf}:{n}: patch {line!r} is listed twice")
        out.append(p)
    return out


# ------------------------------------------------------------------------------------ patch inspection
@dataclass
class Hunk:
    file: str
    index: int  # 1-based within its file
    old_start: int
    header: str


@dataclass
class PatchInfo:
    subject: str
    files: list[str] = field(default_factory=list)
    hunks: list[Hunk] = field(default_factory=list)


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


def inspect_patch(path: Path) -> PatchInfo:
    """Subject, touched files and hunks of a patch (git format-patch or plain ``diff --git`` output)."""
    text = path.read_text(errors="replace")
    m = re.search(r"^Subject:\s*(?:\[PATCH[^\]]*\]\s*)?(.*(?:\n[ \t].*)*)$", text, re.M)  # folded lines too
    info = PatchInfo(subject=" ".join(m.group(1).split()) if m else "(no Subject header)")
    cur_old = cur_new = None
    per_file = 0
    for line in text.splitlines():
        if line.startswith("diff --git "):
            cur_old = cur_new = None
            per_file = 0
        elif line.startswith("--- "):
            cur_old = line[4:].split("\t")[0]
            cur_old = None if cur_old == "/dev/null" else cur_old[2:] if cur_old[:2] == "a/" else cur_old
        elif line.startswith("+++ "):
            cur_new = line[4:].split("\t")[0]
            cur_new = None if cur_new == "/dev/null" else cur_new[2:] if cur_new[:2] == "b/" else cur_new
            name = cur_new or cur_old
            if name and name not in info.files:
                info.files.append(name)
        else:
            hm = _HUNK_RE.match(line)
            if hm and (cur_old or cur_new):
                per_file += 1
                info.hunks.append(Hunk(cur_old or cur_new, per_file, int(hm.group(1)), line.strip()))
    return info


def explain_failure(patch: Path, stderr: str) -> str:
    """Turn git-apply's stderr into 'which file, which hunk' lines."""
    info = inspect_patch(patch)
    lines: list[str] = []
    for m in re.finditer(r"patch failed: (.+):(\d+)$", stderr, re.M):
        f, ln = m.group(1), int(m.group(2))
        cands = [h for h in info.hunks if h.file == f]
        h = next((h for h in cands if h.old_start == ln), None)
        if h is None and cands:  # git reports the hunk's (possibly offset) old start; take the closest
            h = min(cands, key=lambda h: abs(h.old_start - ln))
        if h is not None:
            lines.append(f"  {f}: hunk #{h.index} of {len(cands)} does not apply: {h.header}")
        else:
            lines.append(f"  {f}: hunk at line {ln} does not apply")
    for m in re.finditer(r"^error: (.+?): (already exists in (?:index|working directory)|"
                         r"does not exist in index|No such file or directory|does not match index)$",
                         stderr, re.M):
        lines.append(f"  {m.group(1)}: {m.group(2)}")
    for m in re.finditer(r"^U (.+)$", stderr, re.M):
        lines.append(f"  {m.group(1)}: 3-way merge left conflicts (resolve them, or `make unapply`)")
    if not lines:
        lines.append("  " + (stderr.strip().replace("\n", "\n  ") or "(git gave no reason)"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- tree access
def require_tree(side: str) -> tuple[Path, bool]:
    tree, is_user = tree_for(side)
    if not tree.is_dir():
        if is_user:
            raise BuildError(f"{side.upper()}_SRC={tree} is not a directory")
        raise BuildError(f"[{side}] {tree} does not exist: run `make sources` first")
    return tree, is_user


def git_apply(tree: Path, patch: Path, *extra: str, env: dict | None = None):
    """``git apply EXTRA... PATCH`` run in ``tree``; returns the CompletedProcess (never raises on failure).

    Every way the project applies a patch goes through here (apply, unapply, check, and the wheel overlay of
    build/wheel_overlay.py), so they agree on what "applies" means."""
    return git(["apply", *extra, str(patch)], tree, check=False, env=env)


# ----------------------------------------------------------------------------------------- apply/unapply
# A patch applied exactly is recognised by `git apply -R --check`. A patch applied to a user's fork with a
# 3-way merge cannot be recognised that way (3-way checks succeed in both directions), so those are recorded
# in <git-dir>/zerodiff-3way-applied and reversed with a 3-way merge too. 3-way merges run on a throw-away
# index seeded from HEAD plus the working-tree files the patch touches: the user's own index is never changed.
STATE_FILE = "zerodiff-3way-applied"


def _state_path(tree: Path) -> Path:
    gd = git(["rev-parse", "--absolute-git-dir"], tree).stdout.strip()
    return Path(gd) / STATE_FILE


def _state(tree: Path) -> set[str]:
    p = _state_path(tree)
    return set(p.read_text().split()) if p.exists() else set()


def _set_state(tree: Path, key: str, present: bool) -> None:
    st = _state(tree)
    st = st | {key} if present else st - {key}
    p = _state_path(tree)
    if st:
        p.write_text("".join(k + "\n" for k in sorted(st)))
    elif p.exists():
        p.unlink()


def _three_way(tree: Path, patch: Path, reverse: bool):
    """`git apply --3way [-R]` on a throw-away index; on failure the touched files are restored (atomic)."""
    files = [f for f in inspect_patch(patch).files]
    saved = {f: (tree / f).read_bytes() if (tree / f).is_file() else None for f in files}
    with tempfile.TemporaryDirectory(prefix="zd-3way-") as tmp:
        idx = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(["read-tree", "HEAD"], tree, env=idx)
        tracked = set(git(["ls-files", "--", *files], tree, env=idx).stdout.split())
        sync = [f for f in files if saved[f] is not None or f in tracked]
        if sync:
            git(["update-index", "--add", "--remove", "--", *sync], tree, env=idx)
        r = git_apply(tree, patch, "--3way", *(["-R"] if reverse else []), env=idx)
    if r.returncode != 0:
        for f, data in saved.items():
            if data is None:
                (tree / f).unlink(missing_ok=True)
            else:
                (tree / f).parent.mkdir(parents=True, exist_ok=True)
                (tree / f).write_bytes(data)
    return r


def apply_side(side: str) -> list[str]:
    series = read_series(side)
    tree, is_user = require_tree(side)
    if not series:
        say(f"[{side}] series is empty: nothing to apply")
        return []
    three_way_ok = is_user and is_git_toplevel(tree)
    recorded = _state(tree) if three_way_ok else set()
    done = []
    for p in series:
        key = f"{side}/{p.name}"
        if git_apply(tree, p, "--check", "-R").returncode == 0 or key in recorded:
            say(f"[{side}] {p.name}: already applied")
            done.append(p.name)
            continue
        r = git_apply(tree, p)
        if r.returncode == 0:
            say(f"[{side}] {p.name}: applied")
            done.append(p.name)
            continue
        left = (f"  earlier patches stay applied ({', '.join(done) or 'none'}); `make unapply` reverses them; "
                f"this one changed nothing")
        if three_way_ok:
            r3 = _three_way(tree, p, reverse=False)
            if r3.returncode == 0:
                _set_state(tree, key, True)
                say(f"[{side}] {p.name}: applied with a 3-way merge")
                done.append(p.name)
                continue
            raise BuildError(f"[{side}] patch {p.name} does not apply to {tree}, even with a 3-way merge:\n"
                             f"{explain_failure(p, r.stderr + r3.stderr)}\n{left}")
        raise BuildError(f"[{side}] patch {p.name} does not apply to {tree}:\n{explain_failure(p, r.stderr)}\n{left}")
    return done


def unapply_side(side: str) -> list[str]:
    series = read_series(side)
    tree, is_user = require_tree(side)
    three_way_ok = is_user and is_git_toplevel(tree)
    recorded = _state(tree) if three_way_ok else set()
    undone = []
    for p in reversed(series):
        key = f"{side}/{p.name}"
        if git_apply(tree, p, "-R", "--check").returncode == 0:
            r = git_apply(tree, p, "-R")
            if r.returncode != 0:
                raise BuildError(f"[{side}] could not reverse {p.name}:\n{explain_failure(p, r.stderr)}")
            say(f"[{side}] {p.name}: reversed")
        elif key in recorded:
            r = _three_way(tree, p, reverse=True)
            if r.returncode != 0:
                raise BuildError(f"[{side}] could not reverse {p.name} (applied with a 3-way merge) in {tree}:\n"
                                 f"{explain_failure(p, r.stderr)}")
            say(f"[{side}] {p.name}: reversed with a 3-way merge")
        elif git_apply(tree, p, "--check").returncode == 0:
            say(f"[{side}] {p.name}: not applied, nothing to reverse")
            continue
        elif is_user:  # on a fork a patch that never applied matches neither way
            say(f"[{side}] {p.name}: not recognisably applied to your tree (it does not apply to it either); "
                f"left as is")
            continue
        else:
            r = git_apply(tree, p, "-R", "--check")
            raise BuildError(f"[{side}] {p.name} is neither cleanly applied nor cleanly absent in {tree} "
                             f"(edited by hand?):\n{explain_failure(p, r.stderr)}")
        if key in recorded:
            _set_state(tree, key, False)
        undone.append(p.name)
    if not series:
        say(f"[{side}] series is empty: nothing to reverse")
    return undone


# ------------------------------------------------------------------------------------------------ check
def check_base(side: str, tree: Path, is_user: bool) -> str:
    if not is_git_toplevel(tree):
        raise BuildError(f"[{side}] check-patches needs a git repo at {tree}")
    if is_user:
        return git(["rev-parse", "HEAD"], tree).stdout.strip()
    r = git(["rev-parse", "--verify", "-q", f"{PRISTINE_TAG}^{{commit}}"], tree, check=False)
    if r.returncode != 0:
        raise BuildError(f"[{side}] {tree} has no tag {PRISTINE_TAG}: it was not made by `make sources`; "
                         f"remove it (`make clean`) and run `make sources`")
    return r.stdout.strip()


def check_side(side: str) -> list[str]:
    """Run checks (a)-(d); return the list of problems (empty = all good)."""
    series = read_series(side)
    tree, is_user = require_tree(side)
    base = check_base(side, tree, is_user)
    what = f"HEAD {base[:12]} of your tree {tree}" if is_user else f"the pristine tree {tree} ({PRISTINE_TAG})"
    say(f"[{side}] checking {len(series)} patch(es) against {what}")
    if not series:
        say(f"[{side}] series is empty: OK")
        return []
    problems: list[str] = []
    base_tree = git(["rev-parse", f"{base}^{{tree}}"], tree).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="zd-check-") as tmp:
        idx = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}

        def reset_index():
            git(["read-tree", base], tree, env=idx)

        # (a) each patch alone on the base
        for p in series:
            reset_index()
            r = git_apply(tree, p, "--cached", "--check", env=idx)
            if r.returncode != 0:
                problems.append(f"(a) {p.name} does not apply alone on the base (cherry-pick); "
                                f"does it depend on an earlier patch?\n{explain_failure(p, r.stderr)}")
            else:
                say(f"[{side}] (a) {p.name}: applies alone")
        # (b) the series in order
        reset_index()
        applied: list[Path] = []
        for p in series:
            r = git_apply(tree, p, "--cached", env=idx)
            if r.returncode != 0:
                problems.append(f"(b) {p.name} does not apply in series order after "
                                f"{', '.join(q.name for q in applied) or 'nothing'}:\n{explain_failure(p, r.stderr)}")
                break
            applied.append(p)
        if len(applied) == len(series):
            say(f"[{side}] (b) the series applies in order ({len(series)} patches)")
        patched_tree = git(["write-tree"], tree, env=idx).stdout.strip()
        # (c) reverse what was applied, last first, back to the base tree
        for p in reversed(applied):
            r = git_apply(tree, p, "--cached", "-R", env=idx)
            if r.returncode != 0:
                problems.append(f"(c) {p.name} does not reverse cleanly:\n{explain_failure(p, r.stderr)}")
                break
        else:
            after = git(["write-tree"], tree, env=idx).stdout.strip()
            if after != base_tree:
                problems.append("(c) applying and reversing the series does not give back the base tree "
                                f"({after[:12]} != {base_tree[:12]})")
            elif applied:
                say(f"[{side}] (c) the series reverses cleanly to the base tree")
        # (d) touched Python compiles (on the series-applied tree)
        touched = sorted({f for p in applied for f in inspect_patch(p).files if f.endswith(".py")})
        n_ok = 0
        for f in touched:
            r = git(["cat-file", "-p", f"{patched_tree}:{f}"], tree, check=False)
            if r.returncode != 0:
                continue  # deleted by the series
            try:
                compile(r.stdout, f"{side}/{f}", "exec", dont_inherit=True)
                n_ok += 1
            except SyntaxError as e:
                problems.append(f"(d) {f} does not compile after the series: {e.msg} (line {e.lineno})")
        if touched:
            say(f"[{side}] (d) {n_ok} touched Python file(s) compile with Python "
                f"{sys.version_info.major}.{sys.version_info.minor}")
    return problems


# ---------------------------------------------------------------------------------------------- summary
def summary_side(side: str) -> None:
    series = read_series(side)
    tree, is_user = tree_for(side)
    src = f"{side.upper()}_SRC={tree}" if is_user else str(tree)
    say(f"{side}: {len(series)} patch(es) in {patches_dir() / side / 'series'}  (tree: {src})")
    recorded = _state(tree) if tree.is_dir() and is_git_toplevel(tree) else set()
    for p in series:
        info = inspect_patch(p)
        applied = tree.is_dir() and (git_apply(tree, p, "-R", "--check").returncode == 0
                                     or f"{side}/{p.name}" in recorded)
        say(f"  {p.name}  [{'applied' if applied else 'NOT applied'}]  {info.subject}")
        for f in info.files:
            say(f"      {f}")


# ------------------------------------------------------------------------------------------------- main
def run(action: str, sides: list[str]) -> int:
    if action == "apply":
        for s in sides:
            apply_side(s)
    elif action == "unapply":
        for s in sides:
            unapply_side(s)
    elif action == "summary":
        for s in sides:
            summary_side(s)
    elif action == "check":
        bad = {}
        for s in sides:
            probs = check_side(s)
            if probs:
                bad[s] = probs
        if bad:
            msg = "\n".join(f"[{s}] {p}" for s, ps in bad.items() for p in ps)
            raise BuildError(f"check-patches failed:\n{msg}")
        say(f"check-patches: OK ({', '.join(sides)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="apply / reverse / check the zerodiff patch series",
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["apply", "unapply", "check", "summary"])
    ap.add_argument("--side", choices=[*SIDES, "all"], default="all")
    a = ap.parse_args(argv)
    sides = list(SIDES) if a.side == "all" else [a.side]
    return main_wrapper(lambda: run(a.action, sides))


if __name__ == "__main__":
    sys.exit(main())
