#!/usr/bin/env python3
"""The image's patch step: the zerodiff series laid over the installed vLLM and megatron-core Python trees.

The Dockerfile RUNs this once, on the image's site-packages, after pip installed the pinned wheels; CI
(tests/test_image.py) runs the same script on the pinned vLLM wheel unpacked into a temporary folder. For each
side (``--sides``, default ``vllm,megatron``) it

1. applies ``patches/<side>/series`` with build/wheel_overlay.py's ``apply`` (the step `make vllm-runtime` uses:
   ``.py`` files under the package only, version checked against build/pins, RECORD updated, a
   ``zerodiff-overlay.json`` record in the dist-info folder);
2. checks the result with the overlay's ``status`` (every patched file has the sha256 the overlay recorded);
3. byte-compiles the whole patched package (``python -m compileall -q -j N``), not only the touched files, so a
   patched module that breaks an import-time syntax anywhere in the tree stops the build here.

Exit 0 when every side was patched, checked and compiled; 1 with ``ERROR: ...`` otherwise (a patch that does not
apply names the patch, file and hunk). ``--json FILE`` writes what was done (per side: the overlay record's
patches and files, the compile time).

usage: image_patch.py --site DIR [--sides vllm,megatron] [--python PY] [--jobs N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _buildlib import BuildError, main_wrapper, say  # noqa: E402
from wheel_overlay import PACKAGES, apply_overlay, overlay_status  # noqa: E402


def compile_tree(tree: Path, python: str, jobs: int) -> float:
    """``python -m compileall -q -j jobs tree``; BuildError with compileall's output when a file does not compile."""
    t0 = time.monotonic()
    p = subprocess.run([python, "-m", "compileall", "-q", "-j", str(jobs), str(tree)], text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        lines = p.stdout.strip().splitlines()
        raise BuildError(f"{tree} does not byte-compile with {python} after the series:\n  " + "\n  ".join(lines[-30:]))
    return time.monotonic() - t0


def patch_site(site: Path, sides: list[str], python: str, jobs: int) -> dict:
    """Apply, check and compile each side in ``site``; return the summary (see the module docstring)."""
    site = site.resolve()
    if not site.is_dir():
        raise BuildError(f"--site {site} is not a folder")
    out: dict = {"site": str(site), "python": python, "sides": {}}
    for side in sides:
        record = apply_overlay(site, side, python=python)
        bad = [(name, state) for name, state in overlay_status(site, side) if state != "ok"]
        if bad:
            raise BuildError(f"[{side}] after the series: " + "; ".join(f"{n}: {s}" for n, s in bad))
        seconds = compile_tree(site / PACKAGES[side], python, jobs)
        n = sum(1 for _ in (site / PACKAGES[side]).rglob("*.py"))
        say(f"[{side}] {len(record['patches'])} patch(es), {len(record['files'])} patched file(s); the whole "
            f"{PACKAGES[side]}/ tree ({n} .py files) byte-compiles ({seconds:.1f} s)")
        out["sides"][side] = {"version": record["version"], "series_sha256": record["series_sha256"],
                              "patches": [{"name": p["name"], "sha256": p["sha256"]} for p in record["patches"]],
                              "files": record["files"], "py_files": n, "compile_seconds": round(seconds, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", type=Path, required=True,
                    help="the folder holding vllm/, megatron/ and their dist-info folders (site-packages)")
    ap.add_argument("--sides", default="vllm,megatron", help="comma-separated: vllm, megatron (default both)")
    ap.add_argument("--python", default=sys.executable, help="the Python that byte-compiles (default: this one)")
    ap.add_argument("--jobs", type=int, default=0, help="compileall workers (0: one per core)")
    ap.add_argument("--json", type=Path, help="write the summary here")
    a = ap.parse_args(argv)
    sides = [s for s in a.sides.split(",") if s]
    unknown = [s for s in sides if s not in PACKAGES]
    if unknown or not sides:
        ap.error(f"--sides {a.sides!r}: expected a comma-separated subset of {', '.join(PACKAGES)}")

    def run() -> int:
        summary = patch_site(a.site, sides, a.python, a.jobs or (os.cpu_count() or 1))
        if a.json:
            a.json.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        say(f"image patch step: done ({', '.join(sides)} in {summary['site']})")
        return 0

    return main_wrapper(run)


if __name__ == "__main__":
    sys.exit(main())
