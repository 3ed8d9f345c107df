"""Carry Triton's kernel cache between lent GPU machines (a fresh machine compiles every kernel again).

    python build/triton_cache.py pack CACHE_DIR OUT.tar.gz [--max-mib 15]
    python build/triton_cache.py unpack ARCHIVE.tar.gz CACHE_DIR

``pack`` keeps what a cache hit reads (each kernel's metadata JSON, its group file and the binary, plus
the PTX), not the intermediate IRs, and refuses (exit 3, nothing written) when the archive would exceed
``--max-mib`` (a lent machine sends back at most 16 MiB per file). ``unpack`` extracts into CACHE_DIR and
rewrites the absolute paths inside Triton's ``__grp__*.json`` group files to CACHE_DIR, so the cache hits
wherever the repository sits. A stale cache is harmless: Triton keys each entry by the kernel source, its
specialisation, the compiler version and the target, so an entry is only ever reused for the same kernel.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path

KEEP_SUFFIXES = (".json", ".cubin", ".ptx", ".hsaco")


def pack(cache: Path, out: Path, max_mib: float) -> int:
    if not cache.is_dir():
        print(f"triton_cache: no cache at {cache}", file=sys.stderr)
        return 2
    buf = io.BytesIO()
    n = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for f in sorted(cache.rglob("*")):
            if f.is_file() and f.suffix in KEEP_SUFFIXES:
                t.add(f, arcname=str(Path("triton-cache") / f.relative_to(cache)))
                n += 1
    size = buf.tell()
    if size > max_mib * (1 << 20):
        print(f"triton_cache: {n} files, {size / (1 << 20):.1f} MiB > {max_mib} MiB: not packed", file=sys.stderr)
        return 3
    out.write_bytes(buf.getvalue())
    print(f"triton_cache: packed {n} files, {size / (1 << 20):.1f} MiB -> {out}")
    return 0


def unpack(archive: Path, cache: Path) -> int:
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as t:
        for m in t.getmembers():
            parts = Path(m.name).parts
            if not m.isfile() or len(parts) != 3 or parts[0] != "triton-cache" or ".." in parts:
                continue  # only triton-cache/<key>/<file>
            dest = cache / parts[1] / parts[2]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(t.extractfile(m).read())
    fixed = 0
    for grp in cache.glob("*/__grp__*.json"):
        data = json.loads(grp.read_text())
        paths = data.get("child_paths") or {}
        data["child_paths"] = {c: str(cache / Path(p).parent.name / Path(p).name) for c, p in paths.items()}
        grp.write_text(json.dumps(data))
        fixed += 1
    print(f"triton_cache: unpacked into {cache} ({fixed} kernels)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="archive a cache directory")
    a.add_argument("cache", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--max-mib", type=float, default=15.0)
    b = sub.add_parser("unpack", help="extract an archive into a cache directory, paths rewritten")
    b.add_argument("archive", type=Path)
    b.add_argument("cache", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "pack":
        return pack(args.cache, args.out, args.max_mib)
    return unpack(args.archive, args.cache.resolve())


if __name__ == "__main__":
    sys.exit(main())
