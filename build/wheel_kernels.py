#!/usr/bin/env python3
"""`make kernels-from-wheel`: FlashMLA and DeepGEMM out of vLLM's pinned wheel, as a minimal importable package.

The wheel named in build/pins (``build/downloads/<VLLM_WHEEL>``, fetched with pip when missing) is checked
against its pinned sha256, then only these members are extracted into ``build/wheel-kernels/``:

    vllm/_flashmla_C.abi3.so, vllm/_flashmla_extension_C.abi3.so
    vllm/third_party/__init__.py, vllm/third_party/flashmla/**, vllm/third_party/deep_gemm/** (with JIT headers)

plus a stub ``vllm/__init__.py`` (it imports nothing), so ``vllm.third_party.deep_gemm`` and
``vllm.third_party.flashmla`` import where torch exists but vLLM is not installed. ``zerodiff.backends``
finds that folder by itself (or via ``ZERODIFF_WHEEL_KERNELS``). A gzip -9 tarball of the folder is written to
``.carry/wheel-kernels.tar.gz`` and its size printed: it is what gets shipped to a GPU machine whose upload
limit is 64 MiB.

usage: wheel_kernels.py [--out DIR] [--tarball FILE] [--offline]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from _buildlib import REPO, BuildError, fetch_pinned_wheel, load_pins, main_wrapper, say

UPLOAD_LIMIT = 64 * 1024 * 1024

#: members taken from the wheel: exact files, and folder prefixes taken whole
FILES = ("vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so", "vllm/third_party/__init__.py")
PREFIXES = ("vllm/third_party/flashmla/", "vllm/third_party/deep_gemm/")

STUB = '''"""Stub ``vllm`` package made by zerodiff's `make kernels-from-wheel`.

It is NOT vLLM. It holds only FlashMLA (``vllm._flashmla_C``, ``vllm._flashmla_extension_C``,
``vllm.third_party.flashmla``) and DeepGEMM (``vllm.third_party.deep_gemm``, with its JIT headers), copied
unchanged out of the pinned vLLM {version} wheel ({wheel}, sha256 {sha}), so that zerodiff's GPU tests
can use them where vLLM itself is not installed.
"""

__version__ = "{version}+zerodiff-wheel-kernels"
'''


def wheel_path(pins: dict[str, str], offline: bool) -> Path:
    """The pinned vLLM wheel in build/downloads (fetched for its own platform when missing), sha256-checked."""
    return fetch_pinned_wheel("VLLM_WHEEL", "VLLM_WHEEL_SHA256", f"vllm=={pins['VLLM_VERSION']}", pins,
                              offline=offline, what="vLLM wheel")


def wanted(name: str) -> bool:
    return name in FILES or any(name.startswith(p) for p in PREFIXES)


def extract(wheel: Path, out: Path, pins: dict[str, str]) -> int:
    """Extract the kernel members into a fresh ``out``; return the total bytes."""
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".wheel-kernels-"))
    try:
        total = 0
        with zipfile.ZipFile(wheel) as zf:
            names = [i for i in zf.infolist() if wanted(i.filename) and not i.is_dir()]
            missing = [f for f in FILES if f not in {i.filename for i in names}]
            missing += [p for p in PREFIXES if not any(i.filename.startswith(p) for i in names)]
            if missing:
                raise BuildError(f"{wheel.name} lacks {', '.join(missing)}: is build/pins' wheel the right one?")
            for info in names:
                zf.extract(info, tmp)
                total += info.file_size
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(tmp / info.filename, mode)
        (tmp / "vllm" / "__init__.py").write_text(
            STUB.format(version=pins["VLLM_VERSION"], wheel=pins["VLLM_WHEEL"], sha=pins["VLLM_WHEEL_SHA256"]))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return total
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_tarball(src: Path, tarball: Path) -> int:
    tarball.parent.mkdir(parents=True, exist_ok=True)
    part = tarball.with_name(tarball.name + ".part")
    with tarfile.open(part, "w:gz", compresslevel=9) as tf:
        tf.add(src, arcname=src.name)
    part.replace(tarball)
    return tarball.stat().st_size


def run(out: Path, tarball: Path, offline: bool) -> int:
    pins = load_pins()
    wheel = wheel_path(pins, offline or os.environ.get("ZD_OFFLINE") == "1")
    say(f"{wheel.name}: sha256 ok")
    out.parent.mkdir(parents=True, exist_ok=True)
    total = extract(wheel, out, pins)
    n = sum(1 for p in out.rglob("*") if p.is_file())
    say(f"extracted {n} files ({total / 2**20:.1f} MiB) into {out}")
    size = write_tarball(out, tarball)
    say(f"wrote {tarball}: {size} bytes ({size / 2**20:.1f} MiB; upload limit 64 MiB"
        f"{': OVER THE LIMIT' if size > UPLOAD_LIMIT else ''})")
    say(f"use: PYTHONPATH={out} (zerodiff.backends finds {REPO / 'build' / 'wheel-kernels'} by itself; "
        f"DeepGEMM's JIT needs CUDA_HOME, default /usr/local/cuda)")
    return 1 if size > UPLOAD_LIMIT else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "build" / "wheel-kernels")
    ap.add_argument("--tarball", type=Path, default=REPO / ".carry" / "wheel-kernels.tar.gz")
    ap.add_argument("--offline", action="store_true", help="never download (same as ZD_OFFLINE=1)")
    a = ap.parse_args(argv)
    return main_wrapper(lambda: run(a.out.resolve(), a.tarball.resolve(), a.offline))


if __name__ == "__main__":
    sys.exit(main())
