#!/usr/bin/env python3
"""`make vllm-runtime`: patched vLLM as files to carry to a GPU machine that has no network and no pip index.

The target machine (the "box") already has Python, a CUDA torch, Triton, transformers, safetensors and numpy;
it lacks vLLM and some of vLLM's pure-Python / small compiled dependencies. This script builds, from pinned
inputs only, a folder tree that makes the patched vLLM importable there with ``PYTHONPATH=<DEST>/site``:

* the whole Python tree of the pinned vLLM wheel (``VLLM_WHEEL`` in build/pins, sha256-checked): every file that
  is not compiled code, dist-info included;
* of the wheel's compiled files only :data:`KEEP_BINARIES` (what DeepSeek-V3.2 / V4 need on SM90); every other
  compiled file must be named in :data:`DROP_BINARIES` with the reason, or the build stops;
* the zerodiff vLLM series laid over the Python tree (build/wheel_overlay.py, the same step the Docker image
  runs), then byte-compiled as a check;
* the dependency wheels of ``build/vllm-runtime.lock`` (exact versions and sha256), unpacked into ``site/``;
* zerodiff itself (``kernels/zerodiff`` -> ``site/zerodiff``) and ``build/pins`` (-> ``build/pins``).

With ``--with-dsv4`` a second, optional set holds the kernel DSLs vLLM's DeepSeek-V4 path imports on CUDA:
TileLang (stock mHC; vLLM's JIT warm-up compiles those kernels on the patched side too), CuTeDSL (the
compressor and the indexer's query quantisation, on both sides) with its CUDA 13 libraries and
``cuda-bindings``, and QuACK (CuTeDSL helpers those kernels import). A DeepSeek-V4 engine does not start
without it; other models do not need it.

Each set is one tar stream compressed with ``xz -9 -T0`` and cut into parts of at most ``--part-mib`` MiB
(the minimal count for that size) in ``--out`` (default ``.carry/vllm-runtime/``), next to ``manifest.json``
(parts with size and sha256, the sha256 of each whole archive, the vLLM version and wheel sha256, the zerodiff
commit, the patches applied with their sha256, the lock file's sha256 and the environment to set).
``build/vllm-runtime-unpack.sh`` checks, assembles and unpacks them on the box.

``--lock`` resolves the dependency list (:data:`BASE_DEPS`, :data:`DSV4_DEPS`) instead: each package at the
newest version that satisfies the pinned vLLM wheel's ``Requires-Dist`` and the ``Requires-Dist`` of the other
listed packages, for CPython ``RUNTIME_PYTHON`` on Linux x86-64 up to ``RUNTIME_PLATFORM`` (build/pins), and
writes the lock file. Requires the ``packaging`` module and PyPI.

Settings: ``ZERODIFF_PINS``, ``ZD_DOWNLOADS``, ``ZD_PATCHES`` (build/_buildlib.py), ``ZD_VLLM_RUNTIME_LOCK``
(the lock file), ``ZD_OFFLINE=1`` (same as ``--offline``).

usage: vllm_runtime.py [--lock] [--with-dsv4] [--part-mib N] [--out DIR] [--work DIR] [--offline]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from _buildlib import (REPO, BuildError, downloads_dir, fetch_pinned_wheel, git, load_pins, main_wrapper,
                       patches_dir, pip_download, say, sha256_file, verify_sha256, warn)
from wheel_overlay import RECORD_NAME, apply_overlay, find_dist_info, plan_series, series_sha256

MIB = 1 << 20
#: what one call may carry to the box, the repository copy included
CALL_LIMIT = 64 * MIB
DEFAULT_PART_MIB = 60

#: compiled files of the vLLM wheel that are carried, and why (DeepSeek-V3.2 / V4 on SM90)
KEEP_BINARIES = {
    "vllm/_C_stable_libtorch.abi3.so":
        "vLLM's core CUDA ops (torch.ops._C: norms, rotary, KV-cache writes, FP8 quant); imported with vllm",
    "vllm/_moe_C_stable_libtorch.abi3.so":
        "the MoE ops (torch.ops._moe_C: top-k, token alignment / sorting) every MoE layer calls",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so":
        "FlashAttention 3 for SM90; the sparse-MLA backend imports vllm_flash_attn when its module loads",
    "vllm/third_party/deep_gemm/_C_extension.abi3.so":
        "DeepGEMM (FP8 dense and grouped MoE GEMMs, indexer logits); JIT-compiles with nvcc from include/",
    "vllm/_flashmla_C.abi3.so":
        "FlashMLA sparse prefill / decode (DeepSeek sparse MLA, the fixed-schedule FP8 decode zerodiff uses)",
    "vllm/_flashmla_extension_C.abi3.so":
        "FlashMLA's companion extension, loaded by vllm.third_party.flashmla with the kernels",
    "vllm/cumem_allocator.abi3.so":
        "the CUDA memory-pool allocator vllm.device_allocator.cumem imports (tiny)",
    "vllm/fs_io_C.abi3.so":
        "file-system KV-offload helpers the offload tiering imports (tiny)",
    "vllm/spinloop.abi3.so":
        "the shared-memory broadcast's polling loop (VLLM_USE_SPINLOOP_EXT; tiny)",
}
#: compiled files of the vLLM wheel that are left out, and why
DROP_BINARIES = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so":
        "FlashAttention 2 for GPUs before SM90 (308 MB); SM90 runs FlashAttention 3",
    "vllm/vllm-rs": "the Rust front-end server executable; offline LLM(...) and the Python server never start it",
    "vllm/_deepselect_C.abi3.so": "DeepSelect top-k, SM100 only; vLLM falls back when the import fails",
    "vllm/_flashkda_C.abi3.so": "FlashKDA linear attention (Kimi / GLM models), not DeepSeek",
    "vllm/_qutlass_C.abi3.so":
        "QuTLASS FP4 kernels; needs torch C symbols the box's torch lacks; vLLM imports it under suppress(ImportError)",
}

#: dependency wheels the box lacks that vLLM needs to import and run offline (cp312 / abi3 / pure, x86-64)
BASE_DEPS = (
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "msgspec", "pyzmq", "cbor2",
    "cachetools", "compressed-tensors", "loguru", "openai", "jiter", "distro", "sniffio", "httpx2", "httpcore2",
    "truststore", "oss-harmony", "partial-json-parser", "pybase64", "xgrammar", "apache-tvm-ffi", "fastapi",
    "starlette", "blake3", "setproctitle", "depyf", "astor", "dill", "llguidance", "outlines-core",
    "lm-format-enforcer", "lark", "interegular", "nvtx", "orjson", "ijson",
)
#: what vLLM's DeepSeek-V4 path imports on CUDA beyond BASE_DEPS and the box (see the module docstring)
DSV4_DEPS = ("tilelang", "z3-solver", "torch-c-dlpack-ext", "ml-dtypes",
             "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
             "nvidia-cutlass-dsl-libs-cu13", "cuda-bindings", "cuda-pathfinder", "quack-kernels")
GROUPS = {"base": BASE_DEPS, "dsv4": DSV4_DEPS}
#: constraints of our own on top of the wheels' Requires-Dist, each with its reason
CONSTRAINTS = {
    "cuda-bindings": ("<13.1", "the box's driver (580) serves CUDA 13.0; 13.0.3 is what ran there"),
}

#: packages the box has (it runs torch 2.11 + CUDA, Triton, transformers, safetensors, numpy); a dependency
#: wheel's requirement on one of these is expected to be met there and is not carried
BOX_HAS = ("torch", "triton", "numpy", "transformers", "safetensors", "huggingface-hub", "tokenizers", "regex",
           "tqdm", "pyyaml", "requests", "filelock", "packaging", "typing-extensions", "jinja2", "sympy",
           "networkx", "fsspec", "psutil", "cloudpickle")

#: the environment the runtime needs; {DEST} is the folder it is unpacked into
ENV = (
    {"name": "PYTHONPATH", "value": "{DEST}/site", "mode": "prepend",
     "why": "vLLM and its dependencies; PYTHONPATH (not only sys.path) because vLLM inspects model classes "
            "in a subprocess"},
    {"name": "VLLM_USE_FLASHINFER_SAMPLER", "value": "0", "mode": "set",
     "why": "the default Model Runner V2 sampler imports FlashInfer otherwise, and FlashInfer is not carried"},
    {"name": "PYTHONPATH", "value": "{DEST}/site/nvidia_cutlass_dsl/dsl_packages", "mode": "prepend",
     "why": "CuTeDSL (dsv4 set) puts its packages on sys.path through a .pth file, which a PYTHONPATH folder "
            "does not run; harmless without the dsv4 set"},
    {"name": "CUDA_HOME", "value": "/usr/local/cuda", "mode": "default",
     "why": "DeepGEMM JIT-compiles its kernels with nvcc from CUDA_HOME"},
    {"name": "ZERODIFF_PINS", "value": "{DEST}/build/pins", "mode": "set",
     "why": "the pins the runtime was built from (zerodiff doctor reports them)"},
)

#: fixed metadata of every archive member, so the same tree always gives the same tar stream
TAR_MTIME = 946684800  # 2000-01-01, the date of the pristine commits


# -------------------------------------------------------------------------------------------- lock file
@dataclass(frozen=True)
class Locked:
    """One dependency wheel of the lock file."""

    group: str
    name: str
    version: str
    filename: str
    sha256: str


@dataclass
class Lock:
    vllm_wheel: str
    vllm_wheel_sha256: str
    python: str
    platform: str
    wheels: list[Locked]

    def group(self, name: str) -> list[Locked]:
        return [w for w in self.wheels if w.group == name]


def lock_path() -> Path:
    v = os.environ.get("ZD_VLLM_RUNTIME_LOCK")
    return Path(v).resolve() if v else REPO / "build" / "vllm-runtime.lock"


def parse_lock(text: str, source: str = "<lock>") -> Lock:
    """Parse the lock file; BuildError naming the line for anything malformed.

    Lines (``#`` starts a comment): ``vllm-wheel FILE SHA256``, ``python X.Y``, ``platform TAG`` once each, then
    ``wheel GROUP NAME VERSION FILE SHA256`` per dependency wheel (GROUP one of :data:`GROUPS`).
    """
    head: dict[str, list[str]] = {}
    wheels: list[Locked] = []
    seen: set[str] = set()
    arity = {"vllm-wheel": 2, "python": 1, "platform": 1, "wheel": 5}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        kind, *rest = line.split()
        if kind not in arity:
            raise BuildError(f"{source}:{n}: unknown record {kind!r} (expected one of {', '.join(arity)})")
        if len(rest) != arity[kind]:
            raise BuildError(f"{source}:{n}: {kind} takes {arity[kind]} field(s), got {len(rest)}: {raw!r}")
        sha = rest[-1] if kind in ("vllm-wheel", "wheel") else None
        if sha is not None and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha)):
            raise BuildError(f"{source}:{n}: {sha!r} is not a sha256 (64 lower-case hex digits)")
        if kind == "wheel":
            group, name, version, filename, _ = rest
            if group not in GROUPS:
                raise BuildError(f"{source}:{n}: unknown group {group!r} (expected {', '.join(GROUPS)})")
            if not filename.endswith(".whl"):
                raise BuildError(f"{source}:{n}: {filename!r} is not a wheel file name")
            if name in seen:
                raise BuildError(f"{source}:{n}: {name} is locked twice")
            seen.add(name)
            wheels.append(Locked(group, name, version, filename, sha))
        else:
            if kind in head:
                raise BuildError(f"{source}:{n}: {kind} given twice")
            head[kind] = rest
    missing = [k for k in ("vllm-wheel", "python", "platform") if k not in head]
    if missing:
        raise BuildError(f"{source}: missing record(s): {', '.join(missing)}")
    return Lock(head["vllm-wheel"][0], head["vllm-wheel"][1], head["python"][0], head["platform"][0], wheels)


def read_lock(pins: dict[str, str]) -> Lock:
    path = lock_path()
    if not path.is_file():
        raise BuildError(f"{path} does not exist: run `build/vllm_runtime.py --lock` (needs PyPI)")
    lock = parse_lock(path.read_text(), str(path))
    if (lock.vllm_wheel, lock.vllm_wheel_sha256) != (pins["VLLM_WHEEL"], pins["VLLM_WHEEL_SHA256"]):
        raise BuildError(f"{path} was resolved for {lock.vllm_wheel} ({lock.vllm_wheel_sha256[:12]}), but build/pins "
                         f"has VLLM_WHEEL={pins['VLLM_WHEEL']} ({pins['VLLM_WHEEL_SHA256'][:12]}): run --lock again")
    if (lock.python, lock.platform) != (pins["RUNTIME_PYTHON"], pins["RUNTIME_PLATFORM"]):
        raise BuildError(f"{path} is for Python {lock.python} / {lock.platform}, build/pins has "
                         f"RUNTIME_PYTHON={pins['RUNTIME_PYTHON']} / RUNTIME_PLATFORM={pins['RUNTIME_PLATFORM']}: "
                         f"run --lock again")
    names = {w.name for w in lock.wheels}
    want = {_canon(n) for deps in GROUPS.values() for n in deps}
    if names != want:
        raise BuildError(f"{path} does not lock exactly the listed dependencies (missing: "
                         f"{sorted(want - names) or 'none'}, extra: {sorted(names - want) or 'none'}): run --lock again")
    return lock


def _canon(name: str) -> str:
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def compatible_platforms(tag: str) -> list[str]:
    """Every manylinux tag a machine whose newest supported tag is ``tag`` (``manylinux_2_X_ARCH``) accepts."""
    parts = tag.split("_")
    if len(parts) < 4 or parts[0] != "manylinux" or not parts[1].isdigit() or not parts[2].isdigit():
        raise BuildError(f"RUNTIME_PLATFORM={tag!r}: expected manylinux_2_<minor>_<arch> (build/pins)")
    major, minor, arch = int(parts[1]), int(parts[2]), "_".join(parts[3:])
    out = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out += [f"{name}_{arch}" for m, name in legacy.items() if major == 2 and m <= minor]
    return out


def wheel_metadata(whl: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel."""
    with zipfile.ZipFile(whl) as zf:
        meta = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(meta) != 1:
            raise BuildError(f"{whl.name} has {len(meta)} METADATA files (expected 1)")
        text = zf.read(meta[0]).decode()
    head = text.split("\n\n", 1)[0]
    fields: dict[str, list[str]] = {}
    for line in head.splitlines():
        if ":" in line and not line[:1].isspace():
            k, v = line.split(":", 1)
            fields.setdefault(k.strip(), []).append(v.strip())
    return fields["Name"][0], fields["Version"][0], fields.get("Requires-Dist", [])


def resolve_lock(pins: dict[str, str], vllm_wheel: Path, cache: Path, max_rounds: int = 8) -> Lock:
    """Pick each listed dependency at the newest version meeting every listed constraint (see module docstring)."""
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError as e:
        raise BuildError("--lock needs the 'packaging' module (pip install packaging)") from e
    python, platform = pins["RUNTIME_PYTHON"], pins["RUNTIME_PLATFORM"]
    platforms = tuple(compatible_platforms(platform))
    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": platform.split("_", 3)[3], "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    group_of = {_canon(n): g for g, deps in GROUPS.items() for n in deps}
    _, _, vllm_requires = wheel_metadata(vllm_wheel)

    def constraints(sources: dict[str, list[str]]) -> tuple[dict, dict, dict]:
        spec = {n: SpecifierSet() for n in group_of}
        why: dict[str, list[str]] = {n: [] for n in group_of}
        outside: dict[str, set[str]] = {}
        extras: dict[str, set[str]] = {}  # extras asked of each package (vLLM: nvidia-cutlass-dsl[cu13])
        for reqs in sources.values():
            for line in reqs:
                r = Requirement(line)
                if r.extras and (r.marker is None or r.marker.evaluate(env)):
                    extras.setdefault(_canon(r.name), set()).update(r.extras)
        for n, (extra_spec, reason) in CONSTRAINTS.items():
            spec[n] &= SpecifierSet(extra_spec)
            why[n].append(f"zerodiff {extra_spec} ({reason})")
        for src, reqs in sources.items():
            asked = [""] + sorted(extras.get(src, ()))
            for line in reqs:
                r = Requirement(line)
                if r.marker is not None and not any(r.marker.evaluate(dict(env, extra=e)) for e in asked):
                    continue
                n = _canon(r.name)
                if n in spec:
                    spec[n] &= r.specifier
                    if str(r.specifier):
                        why[n].append(f"{src} {r.specifier}")
                elif src != "vllm":
                    outside.setdefault(n, set()).add(src)
        return spec, why, outside

    chosen: dict[str, tuple[str, Path, list[str]]] = {}
    for rnd in range(1, max_rounds + 1):
        while True:  # a pick that a later constraint excludes is dropped with the constraints it brought
            sources = {"vllm": vllm_requires, **{n: c[2] for n, c in chosen.items()}}
            spec, why, outside = constraints(sources)
            stale = [n for n in chosen if not spec[n].contains(Version(chosen[n][0]), prereleases=True)]
            if not stale:
                break
            for n in stale:
                del chosen[n]
        todo = [n for n in group_of if n not in chosen]
        if not todo:
            break
        say(f"lock: round {rnd}: picking {len(todo)} package(s)")
        for n in todo:
            req = f"{n}{spec[n]}"
            whl = pip_download(req, cache, platforms=platforms, python_version=python,
                               what=f"{n} (constraints: {'; '.join(why[n]) or 'none'})")
            name, version, requires = wheel_metadata(whl)
            if _canon(name) != n:
                raise BuildError(f"pip returned {whl.name} (distribution {name}) for {req!r}")
            chosen[n] = (version, whl, requires)
            say(f"lock:   {n} {version}  ({whl.name}; {'; '.join(why[n]) or 'no constraint: newest'})")
    else:
        raise BuildError(f"the dependency constraints did not settle in {max_rounds} rounds: {sorted(todo)}")
    not_carried = {n: s for n, s in outside.items() if n not in {_canon(b) for b in BOX_HAS}}
    if not_carried:
        warn("requirements of the carried wheels that are neither carried nor known to be on the box "
             "(vLLM's import on the box did not need them): " +
             ", ".join(f"{n} ({', '.join(sorted(s))})" for n, s in sorted(not_carried.items())))
    wheels = [Locked(group_of[n], n, v, p.name, sha256_file(p)) for n, (v, p, _) in sorted(chosen.items())]
    return Lock(pins["VLLM_WHEEL"], pins["VLLM_WHEEL_SHA256"], python, platform, wheels)


def format_lock(lock: Lock) -> str:
    lines = [
        "# build/vllm-runtime.lock: the dependency wheels `make vllm-runtime` carries to the GPU box.",
        "# Written by `build/vllm_runtime.py --lock`; do not edit by hand. The vLLM / torch pins live in build/pins.",
        "# Each package: the newest version meeting the vLLM wheel's Requires-Dist and those of the other",
        "# packages listed here, for the Python and the newest manylinux platform tag below.",
        f"vllm-wheel {lock.vllm_wheel} {lock.vllm_wheel_sha256}",
        f"python {lock.python}",
        f"platform {lock.platform}",
        "# wheel GROUP NAME VERSION FILE SHA256",
    ]
    for g in GROUPS:
        lines += [f"wheel {w.group} {w.name} {w.version} {w.filename} {w.sha256}" for w in lock.group(g)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ tree building
def is_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF"


def extract_vllm(wheel: Path, site: Path) -> dict:
    """The wheel's non-compiled files plus KEEP_BINARIES into ``site``; returns counts and sizes.

    BuildError if the wheel holds a compiled file named in neither table, or lacks one of KEEP_BINARIES.
    """
    stats = {"python_tree_files": 0, "python_tree_bytes": 0, "binaries": {}, "dropped": {}}
    unknown: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        for info in _members(zf, wheel.name):
            name = info.filename
            with zf.open(info) as f:
                binary = is_elf(f.read(4))
            if binary:
                if name in DROP_BINARIES:
                    stats["dropped"][name] = info.file_size
                    continue
                if name not in KEEP_BINARIES:
                    unknown.append(name)
                    continue
                stats["binaries"][name] = info.file_size
            else:
                stats["python_tree_files"] += 1
                stats["python_tree_bytes"] += info.file_size
            _extract_member(zf, info, site / name)
    if unknown:
        raise BuildError(f"{wheel.name} holds compiled file(s) named neither in KEEP_BINARIES nor in DROP_BINARIES "
                         f"(build/vllm_runtime.py): {', '.join(unknown)}; add each to one of them with the reason")
    absent = sorted(set(KEEP_BINARIES) - set(stats["binaries"]))
    if absent:
        raise BuildError(f"{wheel.name} lacks {', '.join(absent)} (KEEP_BINARIES): is VLLM_WHEEL the right wheel?")
    return stats


def _safe_rel(name: str, where: str) -> None:
    parts = name.split("/")
    if name.startswith("/") or ".." in parts or "\\" in name:
        raise BuildError(f"{where}: refusing member {name!r} (absolute or leaving the tree)")


def _members(zf: zipfile.ZipFile, where: str):
    """The file members of an open wheel (directories skipped), each name checked by ``_safe_rel`` first."""
    for info in zf.infolist():
        if info.is_dir():
            continue
        _safe_rel(info.filename, where)
        yield info


def _extract_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with zf.open(info) as src, open(dst, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    mode = (info.external_attr >> 16) & 0o777
    os.chmod(dst, 0o755 if mode & 0o111 else 0o644)


def install_wheel(whl: Path, site: Path) -> tuple[int, int]:
    """Unpack a dependency wheel into ``site`` as pip would for purelib / platlib; return (files, bytes).

    ``<name>.data/purelib|platlib`` go to ``site``; its scripts / headers / data are not carried. A file another
    wheel already put there with other bytes is an error.
    """
    n = size = 0
    with zipfile.ZipFile(whl) as zf:
        for info in _members(zf, whl.name):
            name = info.filename
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                name = "/".join(parts[2:])
            dst = site / name
            if dst.exists():
                if dst.read_bytes() == zf.read(info):
                    continue
                raise BuildError(f"{whl.name}: {name} is already in the tree from another wheel, with other bytes")
            _extract_member(zf, info, dst)
            n += 1
            size += info.file_size
    return n, size


def fetch_locked(w: Locked, python: str, platform: str, offline: bool) -> Path:
    """The locked wheel in build/downloads/vllm-runtime-wheels/, fetched when missing, sha256-checked."""
    cache = downloads_dir() / "vllm-runtime-wheels"
    path = cache / w.filename
    if not path.exists():
        if offline:
            raise BuildError(f"{path} is missing and ZD_OFFLINE=1 (or --offline) forbids downloading it")
        got = pip_download(f"{w.name}=={w.version}", cache, platforms=tuple(compatible_platforms(platform)),
                           python_version=python, what=f"{w.name} {w.version} (build/vllm-runtime.lock)")
        if got.name != w.filename:
            raise BuildError(f"pip fetched {got.name} for {w.name}=={w.version}, the lock file names {w.filename}: "
                             f"run --lock again")
    verify_sha256(path, w.sha256, f"{w.filename} (build/vllm-runtime.lock)")
    return path


def add_zerodiff(site: Path, root: Path) -> int:
    """``kernels/zerodiff`` into ``site/zerodiff`` (no bytecode) with a minimal dist-info; build/pins too."""
    src = REPO / "kernels" / "zerodiff"
    dst = site / "zerodiff"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    sys.path.insert(0, str(REPO / "kernels"))
    from zerodiff import __version__
    di = site / f"zerodiff-{__version__}.dist-info"
    di.mkdir()
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: zerodiff\nVersion: {__version__}\n")
    (di / "INSTALLER").write_text("zerodiff vllm-runtime\n")
    (di / "top_level.txt").write_text("zerodiff\n")
    (di / "entry_points.txt").write_text("[console_scripts]\nzerodiff = zerodiff.cli:main\n")
    pins = os.environ.get("ZERODIFF_PINS") or str(REPO / "build" / "pins")
    (root / "build").mkdir(parents=True, exist_ok=True)
    shutil.copy2(pins, root / "build" / "pins")
    return sum(1 for p in dst.rglob("*") if p.is_file())


def zerodiff_commit() -> dict:
    r = git(["rev-parse", "HEAD"], REPO, check=False)
    if r.returncode != 0:
        return {"commit": None, "dirty": None}
    st = git(["status", "--porcelain", "--", "kernels", "patches", "build"], REPO, check=False).stdout.strip()
    return {"commit": r.stdout.strip(), "dirty": bool(st)}


def find_python(version: str) -> str | None:
    """A Python ``version`` interpreter here (``ZD_TARGET_PYTHON``, else ``python<version>`` on PATH) that runs
    and reports that version, or None."""
    for cand in (os.environ.get("ZD_TARGET_PYTHON"), shutil.which(f"python{version}")):
        if not cand:
            continue
        r = subprocess.run([cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if r.returncode == 0 and r.stdout.strip() == version:
            return cand
        if cand == os.environ.get("ZD_TARGET_PYTHON"):
            raise BuildError(f"ZD_TARGET_PYTHON={cand} does not run as Python {version}")
    return None


def drop_bytecode(tree: Path) -> int:
    n = 0
    for d in sorted(tree.rglob("__pycache__"), reverse=True):
        n += sum(1 for _ in d.iterdir())
        shutil.rmtree(d)
    return n


def tree_size(tree: Path) -> tuple[int, int]:
    files = [p for p in tree.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


# ------------------------------------------------------------------------------------------------ packing
def _tar_filter(ti: tarfile.TarInfo) -> tarfile.TarInfo:
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.mtime = TAR_MTIME
    ti.mode = 0o755 if ti.isdir() or ti.mode & 0o111 else 0o644
    return ti


def pack(tree: Path, out: Path, archive: str, part_bytes: int, threads: str = "0") -> dict:
    """tar of ``tree``'s contents | xz -9 -T<threads>, cut into ``<archive>.partNN`` files of ``part_bytes``.

    Returns ``{"archive", "bytes", "sha256", "parts": [{"name", "bytes", "sha256"}]}``; every part but the last
    is exactly ``part_bytes`` long, so the part count is the smallest possible for that size.
    """
    xz = shutil.which("xz")
    if not xz:
        raise BuildError("xz is not installed (apt-get install xz-utils)")
    proc = subprocess.Popen([xz, "-9", f"-T{threads}", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    err: list[BaseException] = []

    def write_tar() -> None:
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                for p in sorted(tree.iterdir()):
                    tf.add(p, arcname=p.name, filter=_tar_filter)
        except BaseException as e:  # reported by the main thread
            err.append(e)
        finally:
            proc.stdin.close()

    t = threading.Thread(target=write_tar)
    t.start()
    whole = hashlib.sha256()
    parts: list[dict] = []
    cur = None
    cur_hash = None
    cur_len = 0
    total = 0

    def close_part() -> None:
        cur.close()
        parts[-1].update(bytes=cur_len, sha256=cur_hash.hexdigest())
        say(f"  {parts[-1]['name']}: {cur_len} bytes ({cur_len / MIB:.2f} MiB)")

    while True:
        chunk = proc.stdout.read(1 << 20)
        if not chunk:
            break
        whole.update(chunk)
        total += len(chunk)
        while chunk:
            if cur is None or cur_len == part_bytes:
                if cur is not None:
                    close_part()
                name = f"{archive}.part{len(parts):02d}"
                parts.append({"name": name})
                cur, cur_hash, cur_len = open(out / name, "wb"), hashlib.sha256(), 0
            take = chunk[: part_bytes - cur_len]
            cur.write(take)
            cur_hash.update(take)
            cur_len += len(take)
            chunk = chunk[len(take):]
    if cur is not None:
        close_part()
    t.join()
    rc = proc.wait()
    if err:
        raise BuildError(f"writing the tar stream of {tree} failed: {err[0]}")
    if rc != 0:
        raise BuildError(f"xz exited {rc} while compressing {tree}")
    return {"archive": archive, "bytes": total, "sha256": whole.hexdigest(), "parts": parts}


# ------------------------------------------------------------------------------------------------- build
def build(out: Path, work: Path, part_mib: int, with_dsv4: bool, offline: bool) -> int:
    pins = load_pins()
    lock = read_lock(pins)
    part_bytes = part_mib * MIB
    wheel = fetch_pinned_wheel("VLLM_WHEEL", "VLLM_WHEEL_SHA256", f"vllm=={pins['VLLM_VERSION']}", pins,
                               offline=offline, what="vLLM wheel")
    say(f"vllm-runtime: {wheel.name}: sha256 ok")
    plans = plan_series("vllm")  # refuses a series that touches anything but .py, before any work
    if work.exists():
        shutil.rmtree(work)
    base_root, dsv4_root = work / "base", work / "dsv4"
    site = base_root / "site"
    site.mkdir(parents=True)

    say(f"vllm-runtime: unpacking the wheel's Python tree and {len(KEEP_BINARIES)} compiled file(s) into {site}")
    stats = extract_vllm(wheel, site)
    say(f"  Python tree: {stats['python_tree_files']} files, {stats['python_tree_bytes'] / MIB:.1f} MiB; "
        f"compiled: {', '.join(Path(n).name for n in stats['binaries'])} "
        f"({sum(stats['binaries'].values()) / MIB:.1f} MiB); left out: "
        f"{', '.join(Path(n).name for n in stats['dropped'])} ({sum(stats['dropped'].values()) / MIB:.1f} MiB)")

    target_py = find_python(pins["RUNTIME_PYTHON"])
    record = apply_overlay(site, "vllm", python=target_py or sys.executable)
    n = drop_bytecode(site)
    used = f"Python {pins['RUNTIME_PYTHON']}" if target_py else \
        f"this Python (no python{pins['RUNTIME_PYTHON']} found; ZD_TARGET_PYTHON=PATH names one)"
    say(f"  the patched files compile with {used}; their {n} bytecode file(s) are not carried (the archive's "
        f"fixed mtimes would make them stale; the box writes its own)")

    def add_group(group: str, dst: Path) -> dict:
        files = size = 0
        for w in lock.group(group):
            whl = fetch_locked(w, lock.python, lock.platform, offline)
            f, s = install_wheel(whl, dst)
            files, size = files + f, size + s
        say(f"  {group}: {len(lock.group(group))} dependency wheel(s), {files} files, {size / MIB:.1f} MiB")
        return {"wheels": [f"{w.name}=={w.version}" for w in lock.group(group)], "files": files, "bytes": size}

    say("vllm-runtime: dependency wheels (build/vllm-runtime.lock)")
    base_deps = add_group("base", site)
    nz = add_zerodiff(site, base_root)
    say(f"  zerodiff: {nz} files from kernels/zerodiff; build/pins")
    sets = [("base", base_root, True, {"vllm": stats, "dependencies": base_deps, "zerodiff_files": nz})]
    if with_dsv4:
        (dsv4_root / "site").mkdir(parents=True)
        dsv4 = add_group("dsv4", dsv4_root / "site")
        sets.append(("dsv4", dsv4_root, False, {"dependencies": dsv4}))

    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # only what an earlier build wrote here
        if old.is_file() and (old.name == "manifest.json" or old.name.startswith("vllm-runtime-")):
            old.unlink()
    manifest_sets = []
    for name, root, required, contents in sets:
        nfiles, nbytes = tree_size(root)
        say(f"vllm-runtime: packing set {name!r}: {nfiles} files, {nbytes / MIB:.1f} MiB unpacked "
            f"(xz -9 -T0, parts of {part_mib} MiB)")
        info = pack(root, out, f"vllm-runtime-{name}.tar.xz", part_bytes)
        info.update(name=name, required=required, files=nfiles, unpacked_bytes=nbytes, contents=contents)
        manifest_sets.append(info)
        say(f"  {name}: {info['bytes'] / MIB:.1f} MiB compressed in {len(info['parts'])} part(s)")

    zd = zerodiff_commit()
    dist_info = find_dist_info(site, "vllm")
    manifest = {
        "format": 1,
        "vllm_version": pins["VLLM_VERSION"],
        "vllm_commit": pins["VLLM_COMMIT"],
        "vllm_wheel": pins["VLLM_WHEEL"],
        "vllm_wheel_sha256": pins["VLLM_WHEEL_SHA256"],
        "zerodiff_commit": zd["commit"],
        "zerodiff_dirty": zd["dirty"],
        "series_sha256": series_sha256("vllm"),
        "patches": [{"name": p.path.name, "sha256": p.sha256, "files": p.files} for p in plans],
        "overlay_record": f"site/{dist_info.name}/{RECORD_NAME}",
        "patched_files": {f"site/{k}": v for k, v in record["files"].items()},
        "lock_file": str(lock_path().relative_to(REPO)) if lock_path().is_relative_to(REPO) else str(lock_path()),
        "lock_sha256": sha256_file(lock_path()),
        "target": {"python": lock.python, "platform": lock.platform},
        "part_bytes": part_bytes,
        "binaries": {"kept": KEEP_BINARIES, "dropped": DROP_BINARIES},
        "sets": manifest_sets,
        "env": list(ENV),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    say("vllm-runtime: done")
    worst = 0
    for s in manifest_sets:
        sizes = ", ".join(f"{p['bytes'] / MIB:.2f}" for p in s["parts"])
        say(f"  set {s['name']}{'' if s['required'] else ' (optional)'}: {len(s['parts'])} part(s) of "
            f"[{sizes}] MiB = {s['bytes'] / MIB:.1f} MiB (unpacked {s['unpacked_bytes'] / MIB:.1f} MiB)")
        worst = max([worst] + [p["bytes"] for p in s["parts"]])
    say(f"  {out}/manifest.json; the largest part is {worst / MIB:.2f} MiB (a call carries at most "
        f"{CALL_LIMIT // MIB} MiB, the repository copy included)")
    say(f"  on the box: build/vllm-runtime-unpack.sh [--stage DIR] "
        f"{out.relative_to(REPO) if out.is_relative_to(REPO) else out} DEST, then `. DEST/env.sh`")
    return 0


def lock(offline: bool) -> int:
    if offline:
        raise BuildError("--lock resolves versions on PyPI; it cannot run offline")
    pins = load_pins()
    wheel = fetch_pinned_wheel("VLLM_WHEEL", "VLLM_WHEEL_SHA256", f"vllm=={pins['VLLM_VERSION']}", pins,
                               offline=False, what="vLLM wheel")
    cache = downloads_dir() / "vllm-runtime-wheels"
    lk = resolve_lock(pins, wheel, cache)
    path = lock_path()
    path.write_text(format_lock(lk))
    say(f"wrote {path}: {len(lk.wheels)} wheel(s) "
        f"({', '.join(f'{g}: {len(lk.group(g))}' for g in GROUPS)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lock", action="store_true", help="resolve the dependency wheels and write the lock file")
    ap.add_argument("--with-dsv4", action="store_true",
                    help="also build the optional set DeepSeek-V4 needs on CUDA (TileLang, CuTeDSL, QuACK)")
    ap.add_argument("--part-mib", type=int, default=DEFAULT_PART_MIB,
                    help=f"largest part in MiB (default {DEFAULT_PART_MIB}; a call carries at most 64 MiB)")
    ap.add_argument("--out", type=Path, default=REPO / ".carry" / "vllm-runtime", help="where parts + manifest go")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "vllm-runtime", help="staging tree (rebuilt)")
    ap.add_argument("--offline", action="store_true", help="never download (same as ZD_OFFLINE=1)")
    a = ap.parse_args(argv)
    offline = a.offline or os.environ.get("ZD_OFFLINE") == "1"
    if not 1 <= a.part_mib <= CALL_LIMIT // MIB:
        ap.error(f"--part-mib {a.part_mib}: must be 1..{CALL_LIMIT // MIB}")
    if a.lock:
        return main_wrapper(lambda: lock(offline))
    return main_wrapper(lambda: build(a.out.resolve(), a.work.resolve(), a.part_mib, a.with_dsv4, offline))


if __name__ == "__main__":
    sys.exit(main())
