"""Tests for the offline vLLM runtime (build/vllm_runtime.py, build/wheel_overlay.py, build/vllm-runtime-unpack.sh).

CPU only and fast: packing / splitting / unpacking run on small synthetic trees; the compiled-file selection on a
fake wheel; the overlay on synthetic patches always, and on the real series + the real pinned vLLM files when they
are here (the pristine tree of `make sources`, or the pinned wheel in build/downloads), skipped otherwise.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
sys.path.insert(0, str(BUILD))

import vllm_runtime as vr  # noqa: E402
import wheel_overlay as wo  # noqa: E402
from _buildlib import BuildError, load_pins, sources_dir  # noqa: E402

UNPACK = BUILD / "vllm-runtime-unpack.sh"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------- pack / manifest / unpack
PATCHED = b"# zerodiff: patched\nX = 1\n"


def make_tree(root: Path, noise: int, seed: int) -> None:
    """A small runtime-shaped tree; ``noise`` bytes of incompressible data make xz's output span several parts."""
    (root / "site" / "vllm").mkdir(parents=True)
    (root / "site" / "vllm" / "__init__.py").write_text("__version__ = '0.33.0'\n")
    (root / "site" / "vllm" / "patched.py").write_bytes(PATCHED)
    (root / "site" / "vllm" / "bin.so").write_bytes(os.urandom(8) + bytes(range(256)) * 4)
    (root / "site" / "blob.bin").write_bytes(hashlib.shake_256(str(seed).encode()).digest(noise))
    (root / "build").mkdir()
    (root / "build" / "pins").write_text("VLLM_VERSION=0.33.0\n")


@pytest.fixture
def packed(tmp_path):
    """Two sets (required + optional) packed into small parts, and their manifest."""
    out = tmp_path / "carry"
    out.mkdir()
    sets = []
    for name, required, noise in (("base", True, 300_000), ("dsv4", False, 50_000)):
        root = tmp_path / f"tree-{name}"
        if name == "base":
            make_tree(root, noise, 1)
        else:
            (root / "site" / "tilelang").mkdir(parents=True)
            (root / "site" / "tilelang" / "__init__.py").write_text("v = 1\n")
            (root / "site" / "tl.bin").write_bytes(hashlib.shake_256(b"2").digest(noise))
        info = vr.pack(root, out, f"vllm-runtime-{name}.tar.xz", 100_000, threads="1")
        info.update(name=name, required=required)
        sets.append(info)
    manifest = {
        "vllm_version": "0.33.0", "vllm_wheel_sha256": "0" * 64, "zerodiff_commit": "abc", "zerodiff_dirty": False,
        "patches": [{"name": "0001-x.patch", "sha256": "1" * 64, "files": ["vllm/patched.py"]}],
        "patched_files": {"site/vllm/patched.py": sha(PATCHED)},
        "sets": sets, "env": list(vr.ENV),
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out, manifest, tmp_path


def unpack(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(UNPACK), *args], text=True, capture_output=True, timeout=120,
                          env={**os.environ, "PYTHON": python})


def test_pack_cuts_minimal_parts_whose_concatenation_is_the_archive(packed):
    out, manifest, tmp = packed
    base = manifest["sets"][0]
    assert len(base["parts"]) >= 3  # the noise does not compress: several parts
    assert len(base["parts"]) == math.ceil(base["bytes"] / 100_000)  # the smallest count for that part size
    data = b""
    for i, p in enumerate(base["parts"]):
        blob = (out / p["name"]).read_bytes()
        assert p["name"] == f"vllm-runtime-base.tar.xz.part{i:02d}"
        assert len(blob) == p["bytes"] and sha(blob) == p["sha256"]
        assert len(blob) == 100_000 or i == len(base["parts"]) - 1
        data += blob
    assert sha(data) == base["sha256"] and len(data) == base["bytes"]
    import io
    import lzma
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tf:
        members = {m.name: m for m in tf.getmembers()}
    assert "site/vllm/patched.py" in members and "build/pins" in members
    assert all(m.uid == 0 and m.mtime == vr.TAR_MTIME for m in members.values())  # same tree, same stream


def test_unpack_round_trip_env_and_patch_report(packed):
    out, manifest, tmp = packed
    dest = tmp / "dest"
    r = unpack("--no-import-check", str(out), str(dest))
    assert r.returncode == 0, r.stderr
    want = snapshot(tmp / "tree-base")
    want.update(snapshot(tmp / "tree-dsv4"))
    got = snapshot(dest)
    for extra in ("env.sh", "manifest.json", ".vllm-runtime-build"):
        got.pop(extra)
    assert got == want
    env = (dest / "env.sh").read_text()
    assert f'export PYTHONPATH={dest}/site"${{PYTHONPATH:+:$PYTHONPATH}}"' in env
    assert "export VLLM_USE_FLASHINFER_SAMPLER=0" in env
    assert 'export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"' in env
    assert "FlashInfer" in env and "subprocess" in env  # each setting says why
    assert "0001-x.patch: in the tree (1 file(s) as the series left them, zerodiff marker found)" in r.stdout
    r = subprocess.run(["bash", "-c", f". {dest}/env.sh && echo $PYTHONPATH"], text=True, capture_output=True,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    # CuTeDSL's .pth-made path first (prepended after the site folder), then the site folder
    assert r.stdout.strip() == f"{dest}/site/nvidia_cutlass_dsl/dsl_packages:{dest}/site"
    # again: the same runtime is recognised and left alone; an edited patched file is reported
    (dest / "site" / "vllm" / "patched.py").write_text("X = 2\n")
    r = unpack("--no-import-check", str(out), str(dest))
    assert r.returncode == 1 and "already holds this runtime" in r.stdout
    assert "0001-x.patch: vllm/patched.py differs" in r.stdout


def test_a_corrupt_or_missing_part_is_named(packed):
    out, manifest, tmp = packed
    p1 = manifest["sets"][0]["parts"][1]["name"]
    blob = bytearray((out / p1).read_bytes())
    blob[500] ^= 1
    (out / p1).write_bytes(bytes(blob))
    r = unpack("--no-import-check", str(out), str(tmp / "dest"))
    assert r.returncode == 1 and f"part {p1} is corrupt: sha256" in r.stderr
    assert not (tmp / "dest" / "site").exists()
    (out / p1).write_bytes(bytes(blob[:-1]))
    r = unpack("--no-import-check", str(out), str(tmp / "dest"))
    assert r.returncode == 1 and f"part {p1} is corrupt: {len(blob) - 1} bytes" in r.stderr
    (out / p1).unlink()
    r = unpack("--no-import-check", str(out), str(tmp / "dest"))
    assert r.returncode == 1 and f"missing part(s) in {out}: {p1}" in r.stderr
    # the optional set alone missing is fine: the required one is unpacked
    (out / p1).write_bytes(bytes(blob[:500]) + bytes([blob[500] ^ 1]) + bytes(blob[501:]))
    for p in manifest["sets"][1]["parts"]:
        (out / p["name"]).unlink()
    r = unpack("--no-import-check", str(out), str(tmp / "dest"))
    assert r.returncode == 0, r.stderr
    assert (tmp / "dest" / "site" / "blob.bin").exists() and not (tmp / "dest" / "site" / "tilelang").exists()


def test_an_archive_whose_whole_sha256_differs_is_refused(packed):
    out, manifest, tmp = packed
    manifest["sets"][0]["sha256"] = "e" * 64  # parts fine, but not the archive the manifest describes
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = unpack("--no-import-check", str(out), str(tmp / "dest"))
    assert r.returncode == 1 and "the assembled archive of set base has sha256" in r.stderr


def test_staging_over_several_calls(packed):
    out, manifest, tmp = packed
    stage, dest = tmp / "stage", tmp / "dest"
    names = [p["name"] for s in manifest["sets"] for p in s["parts"]]
    calls = [names[:1], names[1:2], names[2:]]
    for i, batch in enumerate(calls):
        call = tmp / f"call{i}"
        call.mkdir()
        (call / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
        for n in batch:
            (call / n).write_bytes((out / n).read_bytes())
        r = unpack("--stage", str(stage), "--no-import-check", str(call), str(dest))
        assert r.returncode == 0, r.stderr
        for n in batch:
            assert f"staged {n}" in r.stdout and not (call / n).exists() and (stage / n).is_file()
        if i < len(calls) - 1:
            assert "STAGED, NOT COMPLETE: still missing" in r.stdout and names[i + 1] in r.stdout
            assert not dest.exists()
    assert "unpacking set base" in r.stdout and "unpacking set dsv4" in r.stdout
    assert (dest / "site" / "tilelang" / "__init__.py").exists()
    # a corrupt part arriving in a later call is refused by name and not staged
    call = tmp / "bad"
    call.mkdir()
    (call / names[0]).write_bytes(b"junk")
    r = unpack("--stage", str(stage), "--no-import-check", str(call), str(tmp / "dest2"))
    assert r.returncode == 1 and f"part {names[0]} is corrupt" in r.stderr


def test_import_check_runs_and_a_failure_is_explained(packed):
    out, manifest, tmp = packed
    r = unpack(str(out), str(tmp / "dest"))  # the synthetic vllm imports (no torch needed beyond this venv's)
    assert r.returncode == 0, r.stderr
    assert "vllm 0.33.0 from" in r.stdout and "torch " in r.stdout
    (tmp / "dest" / "site" / "vllm" / "__init__.py").write_text("raise ImportError('no CUDA here')\n")
    r = unpack(str(out), str(tmp / "dest"))
    assert r.returncode == 3 and "IMPORT CHECK FAILED" in r.stderr and "--no-import-check" in r.stderr


def test_unpack_refuses_a_foreign_dest_and_has_help(packed, tmp_path):
    out, _, tmp = packed
    (tmp / "dest").mkdir()
    (tmp / "dest" / "mine.txt").write_text("x")
    r = unpack("--no-import-check", str(out), str(tmp / "dest"))
    assert r.returncode == 1 and "not empty and was not made by this script" in r.stderr
    r = unpack("--help")
    assert r.returncode == 0 and "--stage DIR" in r.stdout and "PYTHONPATH" in r.stdout


# --------------------------------------------------------------------------------- compiled-file selection
ELF = b"\x7fELF\x02\x01\x01" + b"\0" * 57


def fake_wheel(path: Path, extra: dict[str, bytes] | None = None, drop: tuple[str, ...] = ()) -> Path:
    members = {
        "vllm/__init__.py": b"__version__ = '0.33.0'\n",
        "vllm/model_executor/layers/fused_moe/configs/README": b"plain text without a suffix\n",
        "vllm/third_party/deep_gemm/include/dg/x.cuh": b"// header\n",
        "vllm-0.33.0.dist-info/METADATA": b"Name: vllm\nVersion: 0.33.0\n",
        "vllm-0.33.0.dist-info/RECORD": b"",
        **{n: ELF + n.encode() for n in (*vr.KEEP_BINARIES, *vr.DROP_BINARIES)},
        **(extra or {}),
    }
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in members.items():
            if n not in drop:
                zf.writestr(n, data)
    return path


def test_only_the_listed_compiled_files_are_kept(tmp_path):
    w = fake_wheel(tmp_path / "v.whl")
    site = tmp_path / "site"
    st = vr.extract_vllm(w, site)
    files = {str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()}
    elf = {f for f in files if (site / f).read_bytes()[:4] == b"\x7fELF"}
    assert elf == set(vr.KEEP_BINARIES)
    assert not files & set(vr.DROP_BINARIES)
    assert {"vllm/__init__.py", "vllm/model_executor/layers/fused_moe/configs/README",
            "vllm/third_party/deep_gemm/include/dg/x.cuh", "vllm-0.33.0.dist-info/METADATA"} <= files
    assert set(st["dropped"]) == set(vr.DROP_BINARIES) and st["python_tree_files"] == 5
    # the brief's exclusions, by name
    for gone in ("_vllm_fa2_C", "vllm-rs", "_deepselect_C", "_flashkda_C", "_qutlass_C"):
        assert not any(gone in f for f in files), gone
        assert any(gone in d for d in vr.DROP_BINARIES), gone
    assert all(why.strip() for why in {**vr.KEEP_BINARIES, **vr.DROP_BINARIES}.values())


def test_an_unlisted_compiled_file_or_a_missing_kept_one_stops_the_build(tmp_path):
    w = fake_wheel(tmp_path / "a.whl", extra={"vllm/_new_kernel_C.abi3.so": ELF})
    with pytest.raises(BuildError, match=r"neither in KEEP_BINARIES nor in DROP_BINARIES.*_new_kernel_C"):
        vr.extract_vllm(w, tmp_path / "s1")
    w = fake_wheel(tmp_path / "b.whl", drop=("vllm/_flashmla_C.abi3.so",))
    with pytest.raises(BuildError, match=r"lacks vllm/_flashmla_C.abi3.so"):
        vr.extract_vllm(w, tmp_path / "s2")


def test_dependency_wheels_install_like_pip_and_collisions_are_refused(tmp_path):
    a = tmp_path / "a-1.0-py3-none-any.whl"
    with zipfile.ZipFile(a, "w") as zf:
        zf.writestr("a/__init__.py", "A = 1\n")
        zf.writestr("a-1.0.data/purelib/a_extra.py", "E = 1\n")
        zf.writestr("a-1.0.data/scripts/a-cli", "#!/bin/sh\n")
        zf.writestr("a-1.0.dist-info/METADATA", "Name: a\nVersion: 1.0\n")
    site = tmp_path / "site"
    assert vr.install_wheel(a, site)[0] == 3
    assert {str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()} == \
        {"a/__init__.py", "a_extra.py", "a-1.0.dist-info/METADATA"}
    b = tmp_path / "b-1.0-py3-none-any.whl"
    with zipfile.ZipFile(b, "w") as zf:
        zf.writestr("a/__init__.py", "A = 2\n")
    with pytest.raises(BuildError, match="a/__init__.py is already in the tree"):
        vr.install_wheel(b, site)
    evil = tmp_path / "e-1.0-py3-none-any.whl"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../escape.py", "x\n")
    with pytest.raises(BuildError, match="leaving the tree"):
        vr.install_wheel(evil, site)


# ------------------------------------------------------------------------------------------------ lock file
def test_the_real_lock_file_parses_and_covers_the_listed_dependencies():
    pins = load_pins()
    lock = vr.read_lock(pins)  # also: resolved for the pinned wheel, Python and platform
    assert {w.name for w in lock.group("base")} == {vr._canon(n) for n in vr.BASE_DEPS}
    assert {w.name for w in lock.group("dsv4")} == {vr._canon(n) for n in vr.DSV4_DEPS}
    by = {w.name: w for w in lock.wheels}
    assert by["tilelang"].version == "0.1.12"
    # what vLLM 0.33.0 pins for DeepSeek-V4 on CUDA, and the CuTeDSL CUDA 13 libraries its [cu13] extra asks
    assert by["nvidia-cutlass-dsl"].version == by["nvidia-cutlass-dsl-libs-cu13"].version == "4.8.0"
    assert by["nvidia-cutlass-dsl-libs-base"].version == "4.8.0" and by["quack-kernels"].version == "0.6.5"
    assert by["cuda-bindings"].version.startswith("13.0.")
    text = vr.lock_path().read_text()
    assert vr.format_lock(vr.parse_lock(text)) == text  # the writer and the parser agree
    for w in lock.wheels:  # every wheel is for CPython 3.12 (or abi3 / pure) on x86-64 Linux
        tags = w.filename[:-4].split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "py37") or tags[0].startswith("cp3"), w.filename
        assert tags[2] == "any" or "x86_64" in tags[2], w.filename
    for flashinfer in ("flashinfer-python", "flashinfer"):
        assert flashinfer not in by  # not carried: the env turns FlashInfer's sampler off


@pytest.mark.parametrize("text,needle", [
    ("python 3.12\nplatform manylinux_2_31_x86_64\n", "missing record(s): vllm-wheel"),
    ("bogus 1\n", "unknown record 'bogus'"),
    ("python 3.12 3.13\n", "python takes 1 field(s)"),
    ("vllm-wheel v.whl abc\n", "is not a sha256"),
    ("wheel extra a 1 a-1-py3-none-any.whl " + "a" * 64 + "\n", "unknown group 'extra'"),
    ("wheel base a 1 a.tar.gz " + "a" * 64 + "\n", "is not a wheel file name"),
    (("wheel base a 1 a-1-py3-none-any.whl " + "a" * 64 + "\n") * 2, "a is locked twice"),
    ("python 3.12\npython 3.12\n", "python given twice"),
])
def test_a_malformed_lock_file_is_refused_with_the_line(text, needle):
    with pytest.raises(BuildError, match=re.escape(needle)):
        vr.parse_lock(text, "lock")


def test_a_stale_lock_file_is_refused(tmp_path, monkeypatch):
    pins = load_pins()
    text = vr.lock_path().read_text().replace(pins["VLLM_WHEEL_SHA256"], "f" * 64)
    (tmp_path / "lock").write_text(text)
    monkeypatch.setenv("ZD_VLLM_RUNTIME_LOCK", str(tmp_path / "lock"))
    with pytest.raises(BuildError, match="run --lock again"):
        vr.read_lock(pins)


def test_compatible_platforms():
    got = vr.compatible_platforms("manylinux_2_31_x86_64")
    assert got[0] == "manylinux_2_31_x86_64" and "manylinux_2_17_x86_64" in got and "manylinux2014_x86_64" in got
    assert "manylinux_2_32_x86_64" not in got and "manylinux1_x86_64" in got
    with pytest.raises(BuildError, match="RUNTIME_PLATFORM"):
        vr.compatible_platforms("linux_x86_64")


# ------------------------------------------------------------------------------------------------- overlay
def _git(args, cwd):
    p = subprocess.run(["git", *args], cwd=str(cwd), text=True, capture_output=True, env={**os.environ, **GIT_ENV})
    assert p.returncode == 0, p.stderr
    return p.stdout


def make_patch(tmp: Path, name: str, before: dict[str, str], after: dict[str, str]) -> Path:
    """A git format-patch file turning ``before`` into ``after`` (paths relative to an upstream root)."""
    work = tmp / f"up-{name}"
    work.mkdir()
    _git(["init", "-q"], work)
    for rel, text in before.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    _git(["add", "-A"], work)
    _git(["commit", "-q", "-m", "base"], work)
    for rel, text in after.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    _git(["add", "-A"], work)
    _git(["commit", "-q", "-m", f"zerodiff: {name}"], work)
    return Path(_git(["format-patch", "-1", "-o", str(tmp / "patches" / "vllm"), "HEAD"], work).strip())


@pytest.fixture
def synthetic_series(tmp_path, monkeypatch):
    (tmp_path / "patches" / "vllm").mkdir(parents=True)
    orig = {"vllm/a.py": "def a():\n    return 1\n", "vllm/sub/b.py": "B = 1\n"}
    p = make_patch(tmp_path, "one", orig, {"vllm/a.py": "def a():\n    return 1  # zerodiff\n",
                                           "tests/test_a.py": "def test_a():\n    pass\n"})
    q = make_patch(tmp_path, "two", orig, {"vllm/sub/b.py": "B = 2  # zerodiff\n"})
    (tmp_path / "patches" / "vllm" / "series").write_text(f"# s\n{p.name}\n{q.name}\n")
    monkeypatch.setenv("ZD_PATCHES", str(tmp_path / "patches"))
    # the tree sits inside a git repository of its own, as build/vllm-runtime/ sits inside the checkout
    outer = tmp_path / "outer"
    outer.mkdir()
    _git(["init", "-q"], outer)
    tree = outer / "site"
    for rel, text in orig.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    di = tree / f"vllm-{load_pins()['VLLM_VERSION']}.dist-info"
    di.mkdir()
    (di / "RECORD").write_text(f"vllm/a.py,sha256=old,1\nvllm/sub/b.py,sha256=old,1\n{di.name}/RECORD,,\n")
    return tree, p, q


def test_overlay_applies_the_package_part_records_it_and_is_idempotent(synthetic_series, capsys):
    tree, p, q = synthetic_series
    rec = wo.apply_overlay(tree, "vllm", python=sys.executable)
    assert (tree / "vllm/a.py").read_text().endswith("return 1  # zerodiff\n")
    assert (tree / "vllm/sub/b.py").read_text() == "B = 2  # zerodiff\n"
    assert not (tree / "tests").exists()  # upstream tests are not part of a wheel
    assert rec["patches"][0]["skipped"] == ["tests/test_a.py"] and rec["patches"][0]["files"] == ["vllm/a.py"]
    assert rec["files"]["vllm/sub/b.py"] == sha((tree / "vllm/sub/b.py").read_bytes())
    assert list((tree / "vllm" / "sub" / "__pycache__").glob("b.*.pyc"))  # byte-compiled
    di = wo.find_dist_info(tree, "vllm")
    assert json.loads((di / wo.RECORD_NAME).read_text()) == rec
    record = (di / "RECORD").read_text().splitlines()
    assert not any("sha256=old" in r for r in record) and record[-1] == f"{di.name}/RECORD,,"
    assert any(r.startswith(f"{di.name}/{wo.RECORD_NAME},sha256=") for r in record)
    assert all(s == "ok" for _, s in wo.overlay_status(tree))
    before = snapshot(tree)
    wo.apply_overlay(tree, "vllm", python=sys.executable)
    assert capsys.readouterr().out.count("already applied") == 2
    assert snapshot(tree) == before
    (tree / "vllm/a.py").write_text("edited\n")
    assert dict(wo.overlay_status(tree))[p.name] == "changed: vllm/a.py"


def test_overlay_refuses_non_python_a_wrong_version_and_a_failing_patch(synthetic_series, tmp_path):
    tree, p, q = synthetic_series
    di = wo.find_dist_info(tree, "vllm")
    di.rename(tree / "vllm-0.32.0.dist-info")
    with pytest.raises(BuildError, match=r"holds vllm 0.32.0, but the series is for VLLM_VERSION="):
        wo.apply_overlay(tree, "vllm", python=None)
    (tree / "vllm-0.32.0.dist-info").rename(di)
    (tree / "vllm/sub/b.py").write_text("B = 'drifted'\n")
    with pytest.raises(BuildError, match=rf"(?s)patch {re.escape(q.name)} does not apply.*vllm/sub/b.py: hunk #1 of 1"):
        wo.apply_overlay(tree, "vllm", python=None)
    r = make_patch(tmp_path, "cuda", {"csrc/k.cu": "x\n"}, {"csrc/k.cu": "y\n"})
    (tmp_path / "patches" / "vllm" / "series").write_text(f"{p.name}\n{r.name}\n")
    with pytest.raises(BuildError, match=r"(?s)not Python.*csrc/k.cu"):
        wo.plan_series("vllm")


def test_overlay_cli_plan_and_help():
    r = subprocess.run([sys.executable, str(BUILD / "wheel_overlay.py"), "plan"], text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    assert "apply  vllm/v1/sample/sampler.py" in r.stdout and "skip   tests/" in r.stdout
    for script in ("wheel_overlay.py", "vllm_runtime.py", "vllm_runtime_smoke.py"):
        r = subprocess.run([sys.executable, str(BUILD / script), "--help"], text=True, capture_output=True)
        assert r.returncode == 0 and "usage:" in r.stdout, script


def _series_vllm_files() -> list[str]:
    return sorted({f for pl in wo.plan_series("vllm") for f in pl.files})


PRISTINE = sources_dir() / "vllm"


@pytest.mark.skipif(not (PRISTINE / ".git").exists(), reason="the pinned vLLM tree is absent (`make sources`; "
                    "ZD_SOURCES=DIR points elsewhere); CI does not fetch it")
def test_overlay_of_the_real_series_on_the_pinned_vllm_files(tmp_path):
    files = _series_vllm_files()
    tree, ref = tmp_path / "site", tmp_path / "ref"
    for f in files:
        data = subprocess.run(["git", "show", f"zerodiff-pristine:{f}"], cwd=PRISTINE, capture_output=True,
                              check=True).stdout
        for root in (tree, ref):
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).write_bytes(data)
    (tree / "vllm-0.33.0.dist-info").mkdir()
    (tree / "vllm-0.33.0.dist-info" / "RECORD").write_text("")
    wo.apply_overlay(tree, "vllm", python=sys.executable)
    # the reference: each whole patch with plain `git apply` in a folder of its own (tests/ files land there too)
    for pl in wo.plan_series("vllm"):
        r = subprocess.run(["git", "apply", str(pl.path)], cwd=ref, capture_output=True, text=True,
                           env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
        assert r.returncode == 0, r.stderr
    for f in files:
        assert (tree / f).read_bytes() == (ref / f).read_bytes(), f
        assert b"zerodiff" in (tree / f).read_bytes().lower(), f


def _wheel() -> Path:
    return Path(os.environ.get("ZD_DOWNLOADS", BUILD / "downloads")) / load_pins()["VLLM_WHEEL"]


@pytest.mark.skipif(not _wheel().exists(), reason="the pinned vLLM wheel is not in build/downloads "
                    "(`make kernels-from-wheel` or .ci/run fetch it)")
def test_overlay_of_the_real_series_on_the_pinned_wheel(tmp_path):
    """The image's step on the real wheel: only the touched files and the dist-info are read from the zip."""
    files = _series_vllm_files()
    with zipfile.ZipFile(_wheel()) as zf:
        names = set(zf.namelist())
        take = [n for n in names if n in files or n.startswith("vllm-0.33.0.dist-info/")]
        assert set(files) <= names
        for n in take:
            zf.extract(n, tmp_path / "site")
    orig = snapshot(tmp_path / "site")
    rec = wo.apply_overlay(tmp_path / "site", "vllm", python=sys.executable)
    assert sorted(rec["files"]) == files
    assert all(s == "ok" for _, s in wo.overlay_status(tmp_path / "site"))
    # reversing the series (last first) gives back the wheel's bytes exactly
    for pl in reversed(wo.plan_series("vllm")):
        r = subprocess.run(["git", "apply", "-R", "--include=vllm/*", str(pl.path)], cwd=tmp_path / "site",
                           capture_output=True, text=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
        assert r.returncode == 0, r.stderr
    for f in files:
        assert (tmp_path / "site" / f).read_bytes() == orig[f], f


def test_the_resolver_follows_extras_and_drops_picks_a_later_constraint_excludes(tmp_path, monkeypatch):
    """vLLM asks ``a[x]==1.0``; a 1.0 needs b==1.0 and, under its extra x, c==1.0. Round 1 knows only vLLM's
    constraint and picks the newest b and c (2.0; c 2.0 needs b==2.0). Round 2 must drop both picks with the
    constraint c 2.0 brought, and settle on b 1.0, c 1.0; without the extra, c 1.0 would never be asked."""
    import zipfile

    from packaging.requirements import Requirement
    from packaging.version import Version

    index = {"a": {"1.0": ["b==1.0", 'c==1.0; extra == "x"']}, "b": {"1.0": [], "2.0": []},
             "c": {"1.0": [], "2.0": ["b==2.0"]}}

    def wheel(name, version, requires):
        p = tmp_path / f"{name}-{version}-py3-none-any.whl"
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        with zipfile.ZipFile(p, "w") as zf:
            zf.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")
        return p

    def fake_download(req, cache, **kw):
        r = Requirement(req)
        best = max((v for v in index[r.name] if r.specifier.contains(v)), key=Version)
        return wheel(r.name, best, index[r.name][best])

    vllm_whl = wheel("vllm", "0.33.0", ["a[x]==1.0"])
    monkeypatch.setattr(vr, "GROUPS", {"base": ("a", "b", "c")})
    monkeypatch.setattr(vr, "CONSTRAINTS", {})
    monkeypatch.setattr(vr, "pip_download", fake_download)
    pins = {"RUNTIME_PYTHON": "3.12", "RUNTIME_PLATFORM": "manylinux_2_31_x86_64", "VLLM_WHEEL": vllm_whl.name,
            "VLLM_WHEEL_SHA256": "0" * 64}
    lock = vr.resolve_lock(pins, vllm_whl, tmp_path)
    assert {w.name: w.version for w in lock.wheels} == {"a": "1.0", "b": "1.0", "c": "1.0"}
