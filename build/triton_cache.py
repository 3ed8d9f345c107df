"""Carry Triton's kernel cache between lent GPU machines (a fresh machine compiles every kernel again).

    python build/triton_cache.py pack CACHE_DIR OUT.tar.gz [--max-mib 15] [--max-parts 2]
    python build/triton_cache.py unpack CACHE_DIR ARCHIVE.tar.gz [ARCHIVE ...]

``pack`` keeps what a cache hit reads (each kernel's metadata JSON, its group file and the binary), not
the PTX or the intermediate IRs. A lent machine sends back at most 16 MiB per file, so an archive over
``--max-mib`` is written as parts ``OUT.part1.tar.gz`` ... (whole kernels per part); when even
``--max-parts`` parts would not do, nothing is written (exit 3). ``unpack`` extracts into CACHE_DIR and
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

KEEP_SUFFIXES = (".json", ".cubin", ".hsaco")


def _archive(cache: Path, keys: list[Path]) -> tuple[bytes, int]:
    buf = io.BytesIO()
    n = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for key in keys:
            for f in sorted(key.iterdir()):
                if f.is_file() and f.suffix in KEEP_SUFFIXES:
                    t.add(f, arcname=str(Path("triton-cache") / f.relative_to(cache)))
                    n += 1
    return buf.getvalue(), n


def pack(cache: Path, out: Path, max_mib: float, max_parts: int = 2) -> int:
    if not cache.is_dir():
        print(f"triton_cache: no cache at {cache}", file=sys.stderr)
        return 2
    keys = sorted(d for d in cache.iterdir() if d.is_dir())
    limit = max_mib * (1 << 20)
    for parts in range(1, max(1, max_parts) + 1):
        groups = [keys[i::parts] for i in range(parts)]  # whole kernels per part
        blobs = [_archive(cache, g) for g in groups]
        if all(len(b) <= limit for b, _ in blobs):
            break
    else:
        total = sum(len(b) for b, _ in blobs)
        print(f"triton_cache: {total / (1 << 20):.1f} MiB does not fit {max_parts} part(s) of {max_mib} MiB: "
              "not packed", file=sys.stderr)
        return 3
    stem = out.name[:-len(".tar.gz")] if out.name.endswith(".tar.gz") else out.name
    for i, (blob, n) in enumerate(blobs, 1):
        dest = out if parts == 1 else out.with_name(f"{stem}.part{i}.tar.gz")
        dest.write_bytes(blob)
        print(f"triton_cache: packed {n} files, {len(blob) / (1 << 20):.1f} MiB -> {dest}")
    return 0


def unpack(cache: Path, archives: list[Path]) -> int:
    cache.mkdir(parents=True, exist_ok=True)
    for archive in archives:
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
    a.add_argument("--max-parts", type=int, default=2)
    b = sub.add_parser("unpack", help="extract archives into a cache directory, paths rewritten")
    b.add_argument("cache", type=Path)
    b.add_argument("archives", type=Path, nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        return pack(args.cache, args.out, args.max_mib, args.max_parts)
    return unpack(args.cache.resolve(), args.archives)


if __name__ == "__main__":
    sys.exit(main())
