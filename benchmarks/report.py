"""Turn benchmark JSON files (from ``benchmarks/bench_<op>.py --json``) into the markdown tables of
docs/benchmarks.md.

    python benchmarks/report.py RESULTS_DIR_OR_TARBALL [--out docs/benchmarks.md] [--title TEXT]

Every row is ours/stock of medians measured in the same run on the same device; the device, date and
versions come from the JSON files themselves.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path


def load(src: Path) -> list[dict]:
    docs = []
    if src.is_file() and src.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(src) as tf:
            for m in sorted(tf.getmembers(), key=lambda m: m.name):
                if m.isfile() and m.name.endswith(".json"):
                    docs.append(json.load(io.TextIOWrapper(tf.extractfile(m))))
    elif src.is_dir():
        for p in sorted(src.rglob("*.json")):
            docs.append(json.loads(p.read_text()))
    else:
        docs.append(json.loads(src.read_text()))
    return docs


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if v < 10 else f"{v:.1f}"
    return str(v)


def render(docs: list[dict], title: str) -> str:
    out = [f"# {title}", ""]
    if docs:
        d0 = docs[0]
        out += [f"Device: {d0.get('device')}; date {d0.get('date')}; torch {d0.get('torch')}, "
                f"triton {d0.get('triton', '?')}. Ratio = ours / stock, medians of CUDA-event timings with an "
                "L2 flush between repetitions, both measured in the same run on the same inputs.", ""]
    for d in docs:
        rows = d.get("rows", [])
        out += [f"## {d.get('bench')}", ""]
        if not rows:
            out += ["(no rows)", ""]
            continue
        extra = [k for k in rows[0] if k not in ("op", "shape", "ours_ms", "stock_ms", "ratio", "stock")]
        cols = ["op", "shape", "ours_ms", "stock_ms", "ratio", "stock"] + extra
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for r in rows:
            out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="a results folder, a bench-json.tar.gz, or one JSON file")
    p.add_argument("--out", type=Path, help="markdown file to write (default: stdout)")
    p.add_argument("--title", default="Micro-benchmarks")
    a = p.parse_args(argv)
    docs = load(a.src)
    if not docs:
        print(f"no benchmark JSON found in {a.src}", file=sys.stderr)
        return 1
    text = render(docs, a.title)
    if a.out:
        a.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
