#!/usr/bin/env python3
"""The zerodiff Docker image: build arguments from build/pins, build, in-image check, manifest, base-digest check.

Subcommands:

args      Print one ``--build-arg K=V`` line per ARG the Dockerfile declares, each value taken from build/pins, or
          computed here for the few that are not pins: ``TORCH_CUDA_ARCH_LIST`` and ``ZERODIFF_ARCH`` (from
          ``--arch``), ``ZERODIFF_COMMIT`` and ``ZERODIFF_DIRTY`` (from git). An ARG that is neither is an error,
          so a version can only enter the build through build/pins. ``make image-args``.
build     Check that the pinned base digest is verified (``CUDA_IMAGE_VERIFIED`` a date, digest not all zeros), find
          the engine (docker or podman, ``--engine`` or ``ZD_IMAGE_ENGINE`` to choose) and run its build of the
          Dockerfile for ``--platform linux/<PLATFORM>`` with those arguments; ``--dry-run`` prints the command
          instead (no engine needed). ``make image ARCH=sm_90a|sm_100a PLATFORM=amd64|arm64``.
check     Run build/image-check.sh inside a built image with every GPU (docker ``--gpus all``, podman
          ``--device nvidia.com/gpu=all``): ``zerodiff doctor``, the imports (vLLM, megatron-core, DeepEP),
          ``gpu/gpu-suite.sh --quick``, ``zerodiff check``, ``zerodiff vllm-check``; results in ``--out`` (default results/image-check-<date>).
          ``make image-check``.
manifest  ``--write FILE`` (inside the image, at build time): the installed versions, refused unless they are the
          pinned ones, the pins, the sha256 of every patch and series file, the overlay records of the patched
          files, the zerodiff commit, arch and platform. ``--image TAG``: print the manifest of a built image.
          Neither: print what the checkout would put in one (pins and patches; no installed versions).
fetch     Put the pinned vLLM and megatron-core wheels of ``--platform`` into build/downloads (``ZD_DOWNLOADS``),
          fetched with pip when missing and sha256-checked: what tests/test_image.py lays the series over (.ci/run).
base      Check ``CUDA_IMAGE_SHA256`` against the registry: the sha256 of the raw index manifest of
          ``CUDA_IMAGE:CUDA_IMAGE_TAG`` (``docker buildx imagetools inspect --raw`` or ``skopeo inspect --raw``)
          must be the pinned one and list linux/amd64 and linux/arm64; ``--record`` then writes today's date into
          ``CUDA_IMAGE_VERIFIED``.

Exit status 0 on success, 1 with ``ERROR: ...`` on a refusal (unverified base, no engine, a version that is not
pinned, ...), otherwise the engine's own status. Standard library only (``manifest --write`` runs in the image).

usage: image.py {args,build,check,manifest,fetch,base} [options]   (image.py SUBCOMMAND --help for each)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata as md
import json
import os
import platform as _platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _buildlib import (REPO, BuildError, downloads_dir, load_pins, main_wrapper, patches_dir, pip_download,  # noqa: E402
                       say, sha256_file, verify_sha256, wheel_platform)

DOCKERFILE = REPO / "Dockerfile"
#: where the image keeps its manifest (the Dockerfile's ZERODIFF_IMAGE_MANIFEST)
MANIFEST_IN_IMAGE = "/opt/zerodiff/manifest.json"
#: the target GPU architectures: ARCH (make) -> TORCH_CUDA_ARCH_LIST (what torch / DeepEP compile for)
ARCHES = {"sm_90a": "9.0a", "sm_100a": "10.0a"}
#: the target platforms (make's PLATFORM, the engine's --platform linux/<p>, Docker's TARGETARCH)
PLATFORMS = ("amd64", "arm64")
DEFAULT_ARCH, DEFAULT_PLATFORM = "sm_90a", "amd64"
#: Dockerfile ARGs whose value is computed here, not read from build/pins
COMPUTED_ARGS = ("TORCH_CUDA_ARCH_LIST", "ZERODIFF_ARCH", "ZERODIFF_COMMIT", "ZERODIFF_DIRTY")
#: ARGs the engine sets itself for the platform being built
PLATFORM_ARGS = ("TARGETPLATFORM", "TARGETOS", "TARGETARCH", "TARGETVARIANT", "BUILDPLATFORM", "BUILDOS",
                 "BUILDARCH", "BUILDVARIANT")
ENGINES = ("docker", "podman")
#: installed distribution -> the pins key of its version, checked by ``manifest --write``
PINNED_DISTS = {
    "torch": "TORCH_IMAGE_VERSION",
    "triton": "TRITON_IMAGE_VERSION",
    "vllm": "VLLM_VERSION",
    "megatron-core": "MEGATRON_VERSION",
    "nvidia-nvshmem-cu13": "NVSHMEM_VERSION",
    "nvidia-nccl-cu13": "NCCL_VERSION",
    "cuda-bindings": "CUDA_BINDINGS_IMAGE_VERSION",
    "setuptools": "SETUPTOOLS_IMAGE_VERSION",
    "pytest": "PYTEST_IMAGE_VERSION",
}
SIDES = {"vllm": ("vllm", "vllm"), "megatron": ("megatron", "megatron_core")}  # side -> (package, distribution)
OVERLAY_RECORD = "zerodiff-overlay.json"
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


# ---------------------------------------------------------------------------------------------- build args
def dockerfile_args(text: str) -> list[tuple[str, str | None]]:
    """(name, default or None) of every ``ARG`` instruction, in order, each name once."""
    out: list[tuple[str, str | None]] = []
    seen: set[str] = set()
    for raw in text.splitlines():
        m = re.match(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?\s*$", raw)
        if not m:
            if re.match(r"^\s*ARG\b", raw):
                raise BuildError(f"Dockerfile: cannot read {raw.strip()!r} (one `ARG NAME` per line)")
            continue
        if m.group(1) not in seen:
            seen.add(m.group(1))
            out.append((m.group(1), m.group(2)))
    return out


def git_state() -> tuple[str, str]:
    """(commit, dirty '0'/'1') of the checkout; BuildError outside a git checkout."""
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True, capture_output=True)
    if r.returncode != 0:
        raise BuildError(f"{REPO} is not a git checkout (ZERODIFF_COMMIT comes from `git rev-parse HEAD`)")
    st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, text=True,
                        capture_output=True).stdout.strip()
    return r.stdout.strip(), "1" if st else "0"


def build_args(pins: dict[str, str], arch: str, dockerfile: Path = DOCKERFILE,
               git: tuple[str, str] | None = None) -> dict[str, str]:
    """The build arguments, in the Dockerfile's ARG order (see the module docstring, ``args``)."""
    if arch not in ARCHES:
        raise BuildError(f"ARCH={arch!r}: expected one of {', '.join(ARCHES)}")
    commit, dirty = git or git_state()
    computed = {"TORCH_CUDA_ARCH_LIST": ARCHES[arch], "ZERODIFF_ARCH": arch, "ZERODIFF_COMMIT": commit,
                "ZERODIFF_DIRTY": dirty}
    out: dict[str, str] = {}
    bad: list[str] = []
    for name, default in dockerfile_args(dockerfile.read_text()):
        if default is not None:
            bad.append(f"ARG {name}={default}: the Dockerfile's ARGs take no default (the value comes from build/pins)")
        if name in PLATFORM_ARGS:
            continue
        if name in computed:
            out[name] = computed[name]
        elif name in pins:
            out[name] = pins[name]
        else:
            bad.append(f"ARG {name} is neither in build/pins nor computed by build/image.py ({', '.join(COMPUTED_ARGS)})")
    if bad:
        raise BuildError(f"{dockerfile}:\n  " + "\n  ".join(bad))
    return out


def format_args(args: dict[str, str]) -> list[str]:
    return [f"--build-arg {k}={v}" for k, v in args.items()]


# ------------------------------------------------------------------------------------------------- engine
def find_engine(prefer: str | None = None, path: str | None = None) -> tuple[str, str]:
    """(engine name, executable) of docker or podman on PATH (``prefer`` / ``ZD_IMAGE_ENGINE`` first)."""
    want = prefer or os.environ.get("ZD_IMAGE_ENGINE") or None
    if want and want not in ENGINES:
        raise BuildError(f"engine {want!r}: expected one of {', '.join(ENGINES)}")
    for name in ([want] if want else list(ENGINES)):
        exe = shutil.which(name, path=path)
        if exe:
            return name, exe
    raise BuildError(
        (f"{want} is not installed here" if want else "no container engine found (neither docker nor podman is on "
         "PATH)") + ": install Docker (docker-ce with buildx, or docker.io) or Podman; to run the image on a GPU "
        "the NVIDIA Container Toolkit as well. Without an engine `build/image.py build --dry-run` prints the command")


def base_ref(pins: dict[str, str]) -> str:
    return f"{pins['CUDA_IMAGE']}:{pins['CUDA_IMAGE_TAG']}@sha256:{pins['CUDA_IMAGE_SHA256']}"


def check_base_pinned(pins: dict[str, str]) -> None:
    """Refuse a placeholder digest or one nobody has checked against the registry."""
    for k in ("CUDA_IMAGE", "CUDA_IMAGE_TAG", "CUDA_IMAGE_SHA256", "CUDA_IMAGE_VERIFIED"):
        if k not in pins:
            raise BuildError(f"build/pins has no {k} (the image's base)")
    ref = f"{pins['CUDA_IMAGE']}:{pins['CUDA_IMAGE_TAG']}"
    if set(pins["CUDA_IMAGE_SHA256"]) == {"0"}:
        raise BuildError(f"CUDA_IMAGE_SHA256 in build/pins is the all-zero placeholder: put the index digest of {ref} "
                         f"there (`docker buildx imagetools inspect {ref}`), then run `build/image.py base --record`")
    if not _DATE_RE.match(pins["CUDA_IMAGE_VERIFIED"]):
        raise BuildError(
            f"the base image digest in build/pins is not verified (CUDA_IMAGE_VERIFIED={pins['CUDA_IMAGE_VERIFIED']}): "
            f"sha256:{pins['CUDA_IMAGE_SHA256']} was not checked against the registry for {ref}. Run "
            f"`build/image.py base` (it runs `docker buildx imagetools inspect --raw {ref}`, or skopeo) on a machine "
            f"that reaches the registry; when it matches, `build/image.py base --record` sets CUDA_IMAGE_VERIFIED to "
            f"today's date and `make image` builds. If it does not match, review the registry's digest and put it in "
            f"CUDA_IMAGE_SHA256 first")


def default_tag(arch: str, plat: str, commit: str) -> str:
    return f"zerodiff:{commit[:12]}-{arch}-{plat}"


def build_command(engine: str, exe: str, pins: dict[str, str], arch: str, plat: str, tag: str,
                  extra: list[str], git: tuple[str, str] | None = None) -> list[str]:
    if plat not in PLATFORMS:
        raise BuildError(f"PLATFORM={plat!r}: expected one of {', '.join(PLATFORMS)}")
    args = build_args(pins, arch, git=git)
    cmd = [exe, "build", "--platform", f"linux/{plat}", "-f", str(DOCKERFILE), "-t", tag]
    if engine == "podman":
        cmd += ["--format", "docker"]  # the OCI format drops SHELL, which every stage uses
    for k, v in args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    return cmd + list(extra) + [str(REPO)]


def gpu_flags(engine: str) -> list[str]:
    return ["--gpus", "all"] if engine == "docker" else ["--device", "nvidia.com/gpu=all"]


def check_command(engine: str, exe: str, tag: str, out: Path, extra: list[str]) -> list[str]:
    return [exe, "run", "--rm", *gpu_flags(engine), "--ipc=host", "-v", f"{out}:/out", "-e", "OUT=/out", *extra,
            tag, "/opt/zerodiff/src/build/image-check.sh", "/out"]


def run_or_print(cmd: list[str], dry_run: bool) -> int:
    say(("would run: " if dry_run else "+ ") + shlex.join(cmd))
    if dry_run:
        return 0
    return subprocess.run(cmd).returncode


# ----------------------------------------------------------------------------------------------- manifest
def patch_entries(side: str) -> dict:
    """The series file and each patch it lists, with their sha256."""
    sdir = patches_dir() / side
    series = sdir / "series"
    names = [l.strip() for l in series.read_text().splitlines() if l.strip() and not l.strip().startswith("#")]
    return {"series": {"file": f"patches/{side}/series", "sha256": sha256_file(series)},
            "patches": [{"name": n, "sha256": sha256_file(sdir / n)} for n in names]}


def overlay_record(site: Path, side: str) -> dict | None:
    pkg, dist = SIDES[side]
    found = [p for p in site.glob("*.dist-info") if p.name.split("-")[0].lower() == dist]
    if len(found) != 1 or not (found[0] / OVERLAY_RECORD).is_file():
        return None
    return json.loads((found[0] / OVERLAY_RECORD).read_text())


def check_versions(pins: dict[str, str], versions: dict[str, str | None], python: str) -> list[str]:
    """What differs from the pins among the installed versions (empty: all as pinned)."""
    bad: list[str] = []
    for dist, key in PINNED_DISTS.items():
        have = versions.get(dist)
        if have is None:
            bad.append(f"{dist} is not installed ({key}={pins[key]})")
        elif have.split("+", 1)[0] != pins[key]:
            bad.append(f"{dist} {have} is installed, build/pins has {key}={pins[key]}")
    de = versions.get("deep-ep")
    if de is None:
        bad.append(f"deep_ep is not installed (DEEPEP_COMMIT={pins['DEEPEP_COMMIT']})")
    else:
        local = de.split("+", 1)[1] if "+" in de else ""
        if len(local) < 7 or not pins["DEEPEP_COMMIT"].startswith(local):
            bad.append(f"deep_ep {de} does not carry the pinned commit DEEPEP_COMMIT={pins['DEEPEP_COMMIT']}")
    if python != pins["RUNTIME_PYTHON"]:
        bad.append(f"Python {python} runs the image, build/pins has RUNTIME_PYTHON={pins['RUNTIME_PYTHON']}")
    return bad


def installed_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for d in md.distributions():
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if name:
            out[name] = d.version
    return dict(sorted(out.items()))


def make_manifest(pins: dict[str, str], *, site: Path | None, versions: dict[str, str] | None, commit: str | None,
                  dirty: str | None, arch: str | None, python: str, machine: str) -> dict:
    """The manifest (see the module docstring); ``versions`` None: the checkout's view, nothing installed."""
    pins_file = Path(os.environ.get("ZERODIFF_PINS") or REPO / "build" / "pins")
    m: dict = {
        "format": 1,
        "zerodiff_commit": commit,
        "zerodiff_dirty": None if dirty is None else dirty == "1",
        "arch": arch,
        "torch_cuda_arch_list": ARCHES.get(arch) if arch else None,
        "platform": machine,
        "python": python,
        "base_image": base_ref(pins),
        "base_image_verified": pins.get("CUDA_IMAGE_VERIFIED"),
        "pins_sha256": sha256_file(pins_file),
        "pins": pins,
        "pinned": {dist: pins[key] for dist, key in PINNED_DISTS.items()} | {"deep_ep": pins["DEEPEP_COMMIT"]},
        "patches": {side: patch_entries(side) for side in SIDES},
    }
    if site is not None:
        m["site"] = str(site)
        m["overlay"] = {side: overlay_record(site, side) for side in SIDES}
    if versions is not None:
        m["versions"] = {k: versions.get(k) for k in [*PINNED_DISTS, "deep-ep", "zerodiff"]}
        m["packages"] = versions
    return m


def write_manifest(path: Path, commit: str, dirty: str, arch: str, site: Path | None) -> dict:
    pins = load_pins()
    site = site or Path(sysconfig.get_paths()["purelib"])
    versions = installed_versions()
    python = "%d.%d" % sys.version_info[:2]
    bad = check_versions(pins, versions, python)
    missing = [side for side in SIDES if overlay_record(site, side) is None]
    if missing:
        bad.append(f"no zerodiff overlay record for {', '.join(missing)} in {site} (the patch step did not run)")
    if bad:
        raise BuildError("the image does not hold what build/pins says:\n  " + "\n  ".join(bad))
    m = make_manifest(pins, site=site, versions=versions, commit=commit, dirty=dirty, arch=arch, python=python,
                      machine=_platform.machine())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    say(f"wrote {path}: zerodiff {commit[:12]}{' (dirty)' if dirty == '1' else ''}, {arch}, {m['platform']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    return m


# -------------------------------------------------------------------------------------------------- fetch
def pinned_wheels(pins: dict[str, str], plat: str) -> list[tuple[str, str, str]]:
    """(file name, sha256, requirement) of the vLLM and megatron-core wheels build/pins names for ``plat``."""
    sfx = "" if plat == "amd64" else "_" + plat.upper()
    return [(pins[f"VLLM_WHEEL{sfx}"], pins[f"VLLM_WHEEL{sfx}_SHA256"], f"vllm=={pins['VLLM_VERSION']}"),
            (pins[f"MEGATRON_WHEEL{sfx}"], pins[f"MEGATRON_WHEEL{sfx}_SHA256"],
             f"megatron-core=={pins['MEGATRON_VERSION']}")]


def fetch_wheels(pins: dict[str, str], plat: str, offline: bool) -> list[Path]:
    """build/downloads/<wheel> for each of :func:`pinned_wheels`, fetched when missing, sha256-checked."""
    out = []
    for name, sha, req in pinned_wheels(pins, plat):
        path = downloads_dir() / name
        if not path.exists():
            if offline:
                raise BuildError(f"{path} is missing and ZD_OFFLINE=1 forbids downloading it")
            abi = name[: -len(".whl")].split("-")[-2]
            py = pins["RUNTIME_PYTHON"] if abi.startswith("cp") else None  # a CPython-specific wheel
            say(f"fetching {name} with pip")
            got = pip_download(req, path.parent, platforms=tuple(wheel_platform(name).split(".")),
                               python_version=py, what=name)
            if got.name != name:
                raise BuildError(f"pip fetched {got.name} for {req!r}, build/pins names {name}: fix build/pins")
        verify_sha256(path, sha, name)
        say(f"{path}: sha256 ok")
        out.append(path)
    return out


# --------------------------------------------------------------------------------------------------- base
def raw_manifest(ref: str, engine: str | None) -> tuple[bytes, str]:
    """The registry's raw manifest bytes for ``ref`` and the command that read them."""
    tries: list[list[str]] = []
    if engine in (None, "docker") and shutil.which("docker"):
        tries.append(["docker", "buildx", "imagetools", "inspect", "--raw", ref])
    if shutil.which("skopeo"):
        tries.append(["skopeo", "inspect", "--raw", f"docker://{ref}"])
    if not tries:
        raise BuildError("checking the base digest needs `docker buildx` or `skopeo` (podman's manifest inspect "
                         "does not give the raw bytes the digest is taken over); install one of them")
    errors = []
    for cmd in tries:
        p = subprocess.run(cmd, capture_output=True)
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout, shlex.join(cmd)
        errors.append(f"{shlex.join(cmd)}: rc {p.returncode}: {p.stderr.decode(errors='replace').strip()[-300:]}")
    raise BuildError("could not read the registry's manifest:\n  " + "\n  ".join(errors))


def manifest_platforms(raw: bytes) -> list[str]:
    doc = json.loads(raw)
    return sorted(f"{m['platform']['os']}/{m['platform']['architecture']}" for m in doc.get("manifests", [])
                  if m.get("platform", {}).get("os") not in (None, "unknown"))


def record_verified(pins_file: Path, date: str) -> None:
    text = pins_file.read_text()
    new, n = re.subn(r"(?m)^CUDA_IMAGE_VERIFIED=.*$", f"CUDA_IMAGE_VERIFIED={date}", text)
    if n != 1:
        raise BuildError(f"{pins_file} should hold exactly one CUDA_IMAGE_VERIFIED= line, found {n}")
    pins_file.write_text(new)


def verify_base(engine: str | None, record: bool) -> int:
    pins = load_pins()
    ref = f"{pins['CUDA_IMAGE']}:{pins['CUDA_IMAGE_TAG']}"
    raw, how = raw_manifest(ref, engine)
    digest = hashlib.sha256(raw).hexdigest()
    plats = manifest_platforms(raw)
    say(f"{ref}: registry digest sha256:{digest} ({how}); platforms: {', '.join(plats) or 'a single-platform manifest'}")
    if digest != pins["CUDA_IMAGE_SHA256"]:
        raise BuildError(f"build/pins has CUDA_IMAGE_SHA256={pins['CUDA_IMAGE_SHA256']}, the registry serves "
                         f"{digest} for {ref}: review it, put it in CUDA_IMAGE_SHA256, and run this again")
    need = [f"linux/{p}" for p in PLATFORMS if f"linux/{p}" not in plats]
    if need:
        raise BuildError(f"sha256:{digest} is not an index listing {', '.join(need)}: pin the multi-platform digest")
    say("the pinned digest is the registry's multi-platform index for the tag")
    if record:
        pins_file = Path(os.environ.get("ZERODIFF_PINS") or REPO / "build" / "pins")
        today = datetime.date.today().isoformat()
        record_verified(pins_file, today)
        say(f"{pins_file}: CUDA_IMAGE_VERIFIED={today}")
    elif not _DATE_RE.match(pins["CUDA_IMAGE_VERIFIED"]):
        say("run with --record to set CUDA_IMAGE_VERIFIED in build/pins")
    return 0


# ---------------------------------------------------------------------------------------------------- cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="image.py", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="SUBCOMMAND", required=True)

    def target(p: argparse.ArgumentParser) -> None:
        p.add_argument("--arch", default=os.environ.get("ARCH") or DEFAULT_ARCH, choices=sorted(ARCHES),
                       help=f"GPU architecture (default {DEFAULT_ARCH})")
        p.add_argument("--platform", default=os.environ.get("PLATFORM") or DEFAULT_PLATFORM, choices=PLATFORMS,
                       help=f"image platform linux/<p> (default {DEFAULT_PLATFORM})")

    p = sub.add_parser("args", help="print the --build-arg lines (from build/pins)")
    target(p)
    p = sub.add_parser("build", help="build the image (refuses an unverified base digest)")
    target(p)
    p.add_argument("--tag", help="image tag (default zerodiff:<commit>-<arch>-<platform>)")
    p.add_argument("--engine", choices=ENGINES, help="docker or podman (default: the one found, docker first)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the engine's build (repeatable), e.g. --engine-arg=--no-cache")
    p.add_argument("--dry-run", action="store_true", help="print the command; needs no engine")
    p = sub.add_parser("check", help="run zerodiff doctor, the GPU suite, zerodiff check and vllm-check in the image")
    target(p)
    p.add_argument("--tag", help="image tag (default: the one `build` gives this checkout)")
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG", help="extra argument for `run`")
    p.add_argument("--out", type=Path, help="results folder on this machine (default results/image-check-<date>)")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("manifest", help="write (in the image) or print an image manifest")
    p.add_argument("--write", type=Path, metavar="FILE", help="inside the image: check the versions, write FILE")
    p.add_argument("--commit", help="with --write: the zerodiff commit (the ZERODIFF_COMMIT build arg)")
    p.add_argument("--dirty", choices=["0", "1"], help="with --write: uncommitted changes at build time")
    p.add_argument("--arch", choices=sorted(ARCHES), help="with --write: the ZERODIFF_ARCH build arg")
    p.add_argument("--site", type=Path, help="with --write: site-packages (default: this Python's)")
    p.add_argument("--image", metavar="TAG", help="print the manifest of this built image")
    p.add_argument("--engine", choices=ENGINES)
    p = sub.add_parser("fetch", help="the pinned vLLM and megatron-core wheels into build/downloads (sha256-checked)")
    target(p)
    p.add_argument("--offline", action="store_true", help="never download (same as ZD_OFFLINE=1)")
    p = sub.add_parser("base", help="check the pinned base digest against the registry")
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("--record", action="store_true", help="on a match, set CUDA_IMAGE_VERIFIED to today's date")
    a = ap.parse_args(argv)

    def run() -> int:
        pins = load_pins()
        if a.cmd == "args":
            for line in format_args(build_args(pins, a.arch)):
                print(line)
            return 0
        if a.cmd == "build":
            check_base_pinned(pins)
            git = git_state()
            if a.dry_run:
                try:
                    engine, exe = find_engine(a.engine)
                except BuildError:
                    engine, exe = a.engine or "docker", a.engine or "docker"
            else:
                engine, exe = find_engine(a.engine)
            tag = a.tag or default_tag(a.arch, a.platform, git[0])
            if git[1] == "1":
                say("note: the checkout has uncommitted changes; the manifest records zerodiff_dirty=true")
            rc = run_or_print(build_command(engine, exe, pins, a.arch, a.platform, tag, a.engine_arg, git), a.dry_run)
            if rc == 0 and not a.dry_run:
                say(f"built {tag}; check it on a GPU machine with `make image-check IMAGE_TAG={tag}`")
            return rc
        if a.cmd == "check":
            engine, exe = (a.engine or "docker", a.engine or "docker") if a.dry_run else find_engine(a.engine)
            tag = a.tag or default_tag(a.arch, a.platform, git_state()[0])
            out = (a.out or REPO / "results" / f"image-check-{datetime.datetime.now():%Y%m%d-%H%M%S}").resolve()
            if not a.dry_run:
                out.mkdir(parents=True, exist_ok=True)
            rc = run_or_print(check_command(engine, exe, tag, out, a.engine_arg), a.dry_run)
            if not a.dry_run:
                say(f"image-check {'passed' if rc == 0 else f'FAILED (rc {rc})'}; results in {out}")
            return rc
        if a.cmd == "manifest":
            if a.write:
                if not (a.commit and a.dirty and a.arch):
                    raise BuildError("manifest --write needs --commit, --dirty and --arch (the build args)")
                write_manifest(a.write, a.commit, a.dirty, a.arch, a.site)
                return 0
            if a.image:
                _, exe = find_engine(a.engine)
                return subprocess.run([exe, "run", "--rm", a.image, "cat", MANIFEST_IN_IMAGE]).returncode
            commit, dirty = git_state()
            m = make_manifest(pins, site=None, versions=None, commit=commit, dirty=dirty, arch=None,
                              python=pins["RUNTIME_PYTHON"], machine="linux/" + "|".join(PLATFORMS))
            print(json.dumps(m, indent=1, sort_keys=True))
            return 0
        if a.cmd == "fetch":
            fetch_wheels(pins, a.platform, a.offline or os.environ.get("ZD_OFFLINE") == "1")
            return 0
        return verify_base(a.engine, a.record)

    return main_wrapper(run)


if __name__ == "__main__":
    sys.exit(main())
