#!/usr/bin/env python3
"""The patched vLLM Python files of the current series, as plain files to copy over a runtime's ``site/``.

`make vllm-runtime` bakes the series into its (large) parts. When only the series changes, the parts need not
travel again: this script writes, from the pristine pinned tree (``build/sources/vllm``, tag
``zerodiff-pristine``) and ``patches/vllm/series``, every ``vllm/**.py`` file the series touches, patched, into
``--out`` (default ``.carry/vllm-overlay/``) with ``overlay.json`` (series sha256, each file's sha256).
``gpu/vllm-acceptance.sh`` copies them over ``DEST/site`` on the GPU machine, so the engine runs exactly the
series in the working tree. Files outside ``vllm/`` (upstream tests) are not written: a wheel has none.

usage: vllm_overlay_files.py [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _buildlib import REPO, BuildError, main_wrapper, patches_dir, say
from patches import read_series
from wheel_overlay import series_sha256

PRISTINE_TAG = "zerodiff-pristine"


def touched_files(patch: Path) -> list[str]:
    """Paths a patch touches (``git apply --numstat``), new files included."""
    r = subprocess.run(["git", "apply", "--numstat", str(patch)], capture_output=True, text=True, check=True)
    return [line.split("\t", 2)[2] for line in r.stdout.splitlines() if line.count("\t") >= 2]


def build(out: Path, src: Path) -> dict:
    if not (src / ".git").exists():
        raise BuildError(f"{src} is not the pristine vLLM git tree: run `make sources` first")
    series = read_series("vllm")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        wanted: set[str] = set()
        for p in series:
            wanted.update(f for f in touched_files(p) if f.startswith("vllm/") and f.endswith(".py"))
        for f in sorted(wanted):
            r = subprocess.run(["git", "-C", str(src), "show", f"{PRISTINE_TAG}:{f}"], capture_output=True)
            if r.returncode == 0:  # absent: a file the series creates
                (work / f).parent.mkdir(parents=True, exist_ok=True)
                (work / f).write_bytes(r.stdout)
        for p in series:
            r = subprocess.run(["git", "apply", "--include=vllm/*", str(p)], cwd=work, capture_output=True, text=True)
            if r.returncode != 0:
                raise BuildError(f"{p.name} does not apply to the pristine files: {r.stderr.strip()}")
        if out.exists():
            shutil.rmtree(out)
        files = {}
        for f in sorted(wanted):
            dst = out / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work / f, dst)
            files[f] = hashlib.sha256(dst.read_bytes()).hexdigest()
    doc = {"series_sha256": series_sha256("vllm"), "patches": [p.name for p in series], "files": files}
    (out / "overlay.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / ".carry" / "vllm-overlay")
    ap.add_argument("--src", type=Path, default=REPO / "build" / "sources" / "vllm",
                    help="the pristine vLLM git tree (default build/sources/vllm)")
    args = ap.parse_args(argv)
    doc = build(args.out, args.src)
    say(f"vllm overlay: {len(doc['files'])} patched file(s) of {len(doc['patches'])} patch(es) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main_wrapper(main))
