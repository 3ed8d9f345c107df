"""Tests for the build tooling (build/pins, build/sources.py, build/patches.py, build/wheel_kernels.py, the CLI).

Everything runs offline on tiny synthetic "upstream" trees in tmp_path: the scripts are pointed at them with
the environment overrides documented in build/_buildlib.py (ZERODIFF_PINS, ZD_DOWNLOADS, ZD_SOURCES,
ZD_PATCHES, VLLM_SRC / MEGATRON_SRC, ZD_OFFLINE).
"""

from __future__ import annotations

import hashlib
import io
import json
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

GIT_ENV = {
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}

# --------------------------------------------------------------------------------------------- helpers
ORIG = {
    "vllm/_version.py": "__version__ = version = '{version}'\n__commit_id__ = commit_id = 'g{commit}'\n",
    "vllm/sampler.py": "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(12)),
    "vllm/attn.py": "import math\n\n\ndef attn(q, k):\n    return q * k\n",
    "vllm/old.py": "# to be deleted\nX = 1\n",
    "csrc/kernel.cu": "__global__ void k() {}\n",
    "README.md": "upstream readme\n",
    ".gitignore": "*.cu\n",  # the pristine commit must still hold csrc/kernel.cu
}


def sh(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=str(cwd), env={**os.environ, **GIT_ENV}, text=True, capture_output=True, **kw)


def git(args: list[str], cwd: Path) -> str:
    p = sh(["git", *args], cwd)
    assert p.returncode == 0, p.stderr
    return p.stdout


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(root).parts}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_sdist(dst: Path, top: str, files: dict[str, str]) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dst, "w:gz") as tf:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return dst


class Env:
    """A sandbox: fake pins, downloads, sources and patches dirs, and runners for the build scripts."""

    def __init__(self, tmp: Path, version: str = "0.33.0", commit: str = "4ba787ec9"):
        self.tmp = tmp
        self.downloads = tmp / "downloads"
        self.sources = tmp / "sources"
        self.patches = tmp / "patches"
        for side in ("vllm", "megatron"):
            (self.patches / side).mkdir(parents=True)
            (self.patches / side / "series").write_text("# empty\n")
        self.files = dict(ORIG)
        self.files["vllm/_version.py"] = ORIG["vllm/_version.py"].format(version=version, commit=commit)
        sdist = make_sdist(self.downloads / "vllm-fake.tar.gz", "vllm-0.33.0", self.files)
        mfiles = {"megatron/core/package_info.py": "MAJOR = 0\nMINOR = 19\nPATCH = 2\nPRE_RELEASE = ''\n",
                  "megatron/core/layer.py": "def layer(x):\n    return x\n"}
        msdist = make_sdist(self.downloads / "megatron-fake.tar.gz", "megatron_core-0.19.2", mfiles)
        real = (REPO / "build" / "pins").read_text()
        real = re.sub(r"^VLLM_SDIST=.*$", "VLLM_SDIST=vllm-fake.tar.gz", real, flags=re.M)
        real = re.sub(r"^VLLM_SDIST_SHA256=.*$", f"VLLM_SDIST_SHA256={sha256(sdist)}", real, flags=re.M)
        real = re.sub(r"^MEGATRON_SDIST=.*$", "MEGATRON_SDIST=megatron-fake.tar.gz", real, flags=re.M)
        real = re.sub(r"^MEGATRON_SDIST_SHA256=.*$", f"MEGATRON_SDIST_SHA256={sha256(msdist)}", real, flags=re.M)
        self.pins = tmp / "pins"
        self.pins.write_text(real)
        self.env = {**os.environ, **GIT_ENV, "ZERODIFF_PINS": str(self.pins), "ZD_DOWNLOADS": str(self.downloads),
                    "ZD_SOURCES": str(self.sources), "ZD_PATCHES": str(self.patches), "ZD_OFFLINE": "1"}
        self.env.pop("VLLM_SRC", None)
        self.env.pop("MEGATRON_SRC", None)

    @property
    def tree(self) -> Path:
        return self.sources / "vllm"

    def run(self, script: str, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(BUILD / script), *args], cwd=str(REPO),
                              env={**self.env, **extra_env}, text=True, capture_output=True, timeout=120)

    def sources_ok(self, side: str = "vllm") -> None:
        r = self.run("sources.py", "--side", side)
        assert r.returncode == 0, r.stderr

    def patch(self, name: str, edits: dict[str, str | None], base: Path | None = None, subject: str = "") -> Path:
        """A git format-patch file made by editing a clone of ``base`` (default: the pristine tree)."""
        base = base or self.tree
        work = self.tmp / f"work-{name}"
        git(["clone", "-q", str(base), str(work)], self.tmp)
        for rel, text in edits.items():
            if text is None:
                (work / rel).unlink()
            else:
                write_files(work, {rel: text})
        git(["add", "-A", "-f", "."], work)
        git(["commit", "-q", "-m", subject or f"zerodiff: {name}"], work)
        out = git(["format-patch", "-1", "--stdout"], work)
        dst = self.patches / "vllm" / name
        dst.write_text(out)
        return dst

    def series(self, *names: str, side: str = "vllm") -> None:
        (self.patches / side / "series").write_text("# test series\n\n" + "".join(n + "\n" for n in names))


def replace_line(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


@pytest.fixture
def sandbox(tmp_path) -> Env:
    e = Env(tmp_path)
    e.sources_ok("vllm")
    return e


# ------------------------------------------------------------------------------------------------- pins
def test_real_pins_parse_with_every_key_and_valid_hashes():
    sys.path.insert(0, str(REPO / "kernels"))
    from zerodiff import pins

    p = pins.load(REPO / "build" / "pins")
    assert set(pins.REQUIRED_KEYS) <= set(p)
    for k, v in p.items():
        if k.endswith("_SHA256"):
            assert re.fullmatch(r"[0-9a-f]{64}", v), k
    assert p["VLLM_VERSION"] == "0.33.0" and p["VLLM_COMMIT"] == "4ba787ec9"
    assert p["VLLM_SDIST_SHA256"] == "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
    assert p["MEGATRON_VERSION"] == "0.19.2"
    assert p["MEGATRON_SDIST_SHA256"] == "de643eee32007a7504ad52f061103fe7432503603b6321c16c861eb67dbd3353"
    assert p["TORCH_IMAGE_VERSION"] == "2.14.0" and p["TORCH_CPU_VERSION"] == "2.13.0"
    # bash and make read the same file and see the same values
    r = subprocess.run(["bash", "-c", ". build/pins && echo $VLLM_WHEEL_SHA256 $MEGATRON_BRANCH"], cwd=str(REPO),
                       text=True, capture_output=True)
    assert r.stdout.split() == [p["VLLM_WHEEL_SHA256"], p["MEGATRON_BRANCH"]]
    r = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=str(REPO), text=True, capture_output=True)
    assert r.returncode == 0 and f"vLLM {p['VLLM_VERSION']} @ {p['VLLM_COMMIT']}" in r.stdout


@pytest.mark.parametrize("text,needle", [
    ("VLLM_VERSION=0.33.0\n", "missing required key"),
    ("VLLM_SDIST_SHA256=abc\n", "VLLM_SDIST_SHA256 must be 64"),
    ("VLLM_SDIST_SHA256=" + "F" * 64 + "\n", "VLLM_SDIST_SHA256 must be 64"),
    ("VLLM_COMMIT=xyz\n", "VLLM_COMMIT must be"),
    ("VLLM_VERSION = 0.33.0\n", "bad key"),
    ("VLLM_VERSION=0.33.0 # comment\n", "bad value for VLLM_VERSION"),
    ("VLLM_VERSION=0.33.0\nVLLM_VERSION=0.33.1\n", "duplicate key VLLM_VERSION"),
    ("just words\n", "expected KEY=VALUE"),
])
def test_malformed_pins_are_refused_with_the_line(text, needle):
    sys.path.insert(0, str(REPO / "kernels"))
    from zerodiff import pins

    with pytest.raises(pins.PinsError, match=re.escape(needle)):
        pins.parse(text, "p")


# ---------------------------------------------------------------------------------------------- sources
def test_sources_unpack_into_one_commit_git_repo_idempotently(tmp_path):
    e = Env(tmp_path)
    e.sources_ok()
    assert snapshot(e.tree) == {k: v.encode() for k, v in e.files.items()}
    log = git(["log", "--format=%s"], e.tree).splitlines()
    assert log == ["pristine vllm 0.33.0 (4ba787ec9)"]
    assert git(["ls-files"], e.tree).split().count("csrc/kernel.cu") == 1  # ignored by the tree's .gitignore
    assert git(["rev-parse", "zerodiff-pristine"], e.tree) == git(["rev-parse", "HEAD"], e.tree)
    assert git(["status", "--porcelain"], e.tree) == ""
    r = e.run("sources.py", "--side", "vllm")
    assert r.returncode == 0 and "already unpacked" in r.stdout


def test_wrong_sha256_is_refused(tmp_path):
    e = Env(tmp_path)
    make_sdist(e.downloads / "vllm-fake.tar.gz", "vllm-0.33.0", {"evil.py": "x = 1\n"})  # same name, new bytes
    r = e.run("sources.py", "--side", "vllm")
    assert r.returncode == 1
    assert "sha256 mismatch" in r.stderr and "refusing" in r.stderr
    assert not e.tree.exists()


def test_missing_archive_offline_is_an_error(tmp_path):
    e = Env(tmp_path)
    (e.downloads / "vllm-fake.tar.gz").unlink()
    r = e.run("sources.py", "--side", "vllm")
    assert r.returncode == 1 and "ZD_OFFLINE=1" in r.stderr


def _user_tree(tmp: Path, files: dict[str, str]) -> Path:
    t = tmp / "fork"
    write_files(t, files)
    git(["init", "-q"], t)
    git(["add", "-A", "-f", "."], t)
    git(["commit", "-q", "-m", "fork"], t)
    return t


def test_user_tree_at_the_wrong_version_is_reported(tmp_path):
    e = Env(tmp_path)
    old = _user_tree(tmp_path, {"vllm/_version.py": "__version__ = version = '0.32.1'\n"})
    r = e.run("sources.py", "--side", "vllm", VLLM_SRC=str(old))
    assert r.returncode == 0, r.stderr  # proceeds (3-way merge), but says so loudly
    assert "WARNING" in r.stderr and "NOT the pinned vllm 0.33.0" in r.stderr and "0.32.1" in r.stderr
    assert not e.tree.exists()  # nothing downloaded or unpacked for a user's tree

    wrong_commit = tmp_path / "wc"
    write_files(wrong_commit, {"vllm/_version.py": "version = '0.33.0'\ncommit_id = 'gdeadbeef1'\n"})
    r = e.run("sources.py", "--side", "vllm", VLLM_SRC=str(wrong_commit))
    assert "NOT the pinned" in r.stderr and "deadbeef1" in r.stderr and "not the top of a git repo" in r.stderr

    meg = tmp_path / "meg"
    write_files(meg, {"megatron/core/package_info.py": "MAJOR = 0\nMINOR = 18\nPATCH = 0\nPRE_RELEASE = 'rc1'\n"})
    r = e.run("sources.py", "--side", "megatron", MEGATRON_SRC=str(meg))
    assert "NOT the pinned megatron 0.19.2" in r.stderr and "0.18.0rc1" in r.stderr

    good = _user_tree(tmp_path / "g", {"vllm/_version.py": "version = '0.33.0'\ncommit_id = 'g4ba787ec9'\n"})
    r = e.run("sources.py", "--side", "vllm", VLLM_SRC=str(good))
    assert r.returncode == 0 and "matches the pin" in r.stdout and "WARNING" not in r.stderr

    r = e.run("sources.py", "--side", "vllm", VLLM_SRC=str(tmp_path / "nope"))
    assert r.returncode == 1 and "VLLM_SRC=" in r.stderr and "not a directory" in r.stderr


# ---------------------------------------------------------------------------------------------- patches
def test_empty_series_is_valid(sandbox):
    sandbox.sources_ok("megatron")
    for action in ("apply", "check", "unapply", "summary"):
        r = sandbox.run("patches.py", action)
        assert r.returncode == 0, (action, r.stderr)
    assert "series is empty" in sandbox.run("patches.py", "check").stdout


def test_apply_unapply_round_trip_restores_the_tree_byte_for_byte(sandbox):
    e = sandbox
    f = e.files
    e.patch("0001-sampler.patch", {"vllm/sampler.py": replace_line(f["vllm/sampler.py"], "x + 3", "x + 3  # zd")})
    e.patch("0002-new-and-delete.patch", {"vllm/zd_new.py": "Y = 2\n", "vllm/old.py": None,
                                         "vllm/attn.py": f["vllm/attn.py"] + "\n\ndef extra():\n    pass\n"},
            subject="zerodiff: a deliberately long subject line that git format-patch folds onto a second line")
    e.series("0001-sampler.patch", "0002-new-and-delete.patch")
    before = snapshot(e.tree)
    r = e.run("patches.py", "apply", "--side", "vllm")
    assert r.returncode == 0, r.stderr
    after = snapshot(e.tree)
    assert "x + 3  # zd" in after["vllm/sampler.py"].decode()
    assert "vllm/zd_new.py" in after and "vllm/old.py" not in after
    r = e.run("patches.py", "apply", "--side", "vllm")  # idempotent
    assert r.returncode == 0 and r.stdout.count("already applied") == 2
    assert snapshot(e.tree) == after
    r = e.run("patches.py", "summary", "--side", "vllm")
    assert "0001-sampler.patch  [applied]" in r.stdout and "vllm/zd_new.py" in r.stdout
    assert "format-patch folds onto a second line\n" in r.stdout  # folded Subject read whole
    r = e.run("patches.py", "unapply", "--side", "vllm")
    assert r.returncode == 0, r.stderr
    assert snapshot(e.tree) == before
    assert git(["status", "--porcelain"], e.tree) == ""
    r = e.run("patches.py", "unapply", "--side", "vllm")  # nothing left to reverse
    assert r.returncode == 0 and r.stdout.count("not applied") == 2
    r = e.run("patches.py", "check", "--side", "vllm")
    assert r.returncode == 0 and "check-patches: OK" in r.stdout


def test_check_catches_a_patch_that_only_applies_after_another(sandbox):
    e = sandbox
    f = e.files
    a_text = replace_line(f["vllm/sampler.py"], "x + 5", "x + 50")
    e.patch("0001-a.patch", {"vllm/sampler.py": a_text})
    # 0002 is made on top of 0001: it edits the line 0001 introduced, so it cannot apply alone
    git(["clone", "-q", str(e.tree), str(e.tmp / "stacked")], e.tmp)
    write_files(e.tmp / "stacked", {"vllm/sampler.py": a_text})
    git(["commit", "-q", "-am", "a"], e.tmp / "stacked")
    e.patch("0002-b.patch", {"vllm/sampler.py": replace_line(a_text, "x + 50", "x + 51")}, base=e.tmp / "stacked")
    e.series("0001-a.patch", "0002-b.patch")
    before = snapshot(e.tree)
    r = e.run("patches.py", "check", "--side", "vllm")
    assert r.returncode == 1
    assert "(a) 0002-b.patch does not apply alone" in r.stderr
    assert "vllm/sampler.py: hunk #1 of 1 does not apply: @@ -" in r.stderr
    assert "0001-a.patch does not apply" not in r.stderr  # 0001 is fine
    assert "(b)" not in r.stderr and "(c)" not in r.stderr  # in order, the series is fine
    assert "(b) the series applies in order (2 patches)" in r.stdout
    assert snapshot(e.tree) == before  # the check never touches the working tree
    # the same series applied for real works, in order
    assert e.run("patches.py", "apply", "--side", "vllm").returncode == 0
    assert e.run("patches.py", "unapply", "--side", "vllm").returncode == 0
    assert snapshot(e.tree) == before


def test_a_failing_patch_is_named_with_its_file_and_hunk(sandbox):
    e = sandbox
    f = e.files
    # made against a base whose f9 differs from the pinned one: hunk 1 (f1) applies, hunk 2 (f9) does not
    other = e.tmp / "other"
    git(["clone", "-q", str(e.tree), str(other)], e.tmp)
    drifted = replace_line(f["vllm/sampler.py"], "x + 9\n", "x + 99\n")
    write_files(other, {"vllm/sampler.py": drifted})
    git(["commit", "-q", "-am", "drift"], other)
    new = replace_line(replace_line(drifted, "x + 1\n", "x + 1  # one\n"), "x + 99\n", "x + 999\n")
    e.patch("0001-drifted.patch", {"vllm/sampler.py": new}, base=other)
    e.series("0001-drifted.patch")
    before = snapshot(e.tree)
    r = e.run("patches.py", "apply", "--side", "vllm")
    assert r.returncode == 1
    assert "patch 0001-drifted.patch does not apply" in r.stderr
    assert "vllm/sampler.py: hunk #2 of 2 does not apply: @@ -" in r.stderr
    assert snapshot(e.tree) == before  # git apply is atomic: nothing half-applied
    r = e.run("patches.py", "check", "--side", "vllm")
    assert r.returncode == 1 and "0001-drifted.patch" in r.stderr and "hunk #2 of 2" in r.stderr


def test_check_catches_python_that_no_longer_compiles(sandbox):
    e = sandbox
    e.patch("0001-broken.patch", {"vllm/attn.py": "def attn(q, k:\n    return q\n"})
    e.series("0001-broken.patch")
    r = e.run("patches.py", "check", "--side", "vllm")
    assert r.returncode == 1 and "(d) vllm/attn.py does not compile" in r.stderr


def test_series_listing_a_missing_patch_names_the_line(sandbox):
    sandbox.series("0001-nowhere.patch")
    r = sandbox.run("patches.py", "apply", "--side", "vllm")
    assert r.returncode == 1 and "series:3: patch '0001-nowhere.patch' is listed but" in r.stderr


def test_check_needs_sources(tmp_path):
    e = Env(tmp_path)
    r = e.run("patches.py", "check", "--side", "vllm")
    assert r.returncode == 1 and "run `make sources` first" in r.stderr


def test_user_fork_gets_a_three_way_merge_and_a_clean_unapply(sandbox):
    e = sandbox
    f = e.files
    e.patch("0001-sampler.patch", {"vllm/sampler.py": replace_line(f["vllm/sampler.py"], "x + 4\n", "x + 4  # zd\n")})
    e.series("0001-sampler.patch")
    # the fork edited a context line of the hunk, so a plain apply fails and a 3-way merge is needed
    fork = e.tmp / "fork"
    git(["clone", "-q", str(e.tree), str(fork)], e.tmp)
    write_files(fork, {"vllm/sampler.py": replace_line(f["vllm/sampler.py"], "def f5(x):\n", "def f5(x):  # fork\n")})
    git(["commit", "-q", "-am", "fork change"], fork)
    assert sh(["git", "apply", "--check", str(e.patches / "vllm" / "0001-sampler.patch")], fork).returncode != 0
    before = snapshot(fork)
    r = e.run("patches.py", "apply", "--side", "vllm", VLLM_SRC=str(fork))
    assert r.returncode == 0, r.stderr
    assert "applied with a 3-way merge" in r.stdout
    text = (fork / "vllm/sampler.py").read_text()
    assert "x + 4  # zd" in text and "def f5(x):  # fork" in text
    assert git(["diff", "--cached", "--name-only"], fork) == ""  # the user's index is left alone
    r = e.run("patches.py", "apply", "--side", "vllm", VLLM_SRC=str(fork))  # idempotent on a fork too
    assert r.returncode == 0 and "already applied" in r.stdout
    assert "[applied]" in e.run("patches.py", "summary", "--side", "vllm", VLLM_SRC=str(fork)).stdout
    r = e.run("patches.py", "check", "--side", "vllm", VLLM_SRC=str(fork))
    assert "your tree" in r.stdout  # checked against the fork's HEAD, reported as such
    r = e.run("patches.py", "unapply", "--side", "vllm", VLLM_SRC=str(fork))
    assert r.returncode == 0, r.stderr
    assert snapshot(fork) == before


# ------------------------------------------------------------------------------------------ wheel kernels
def _fake_wheel(e: Env) -> Path:
    w = e.downloads / "vllm-fake.whl"
    with zipfile.ZipFile(w, "w") as zf:
        for name in ("vllm/__init__.py", "vllm/_C.abi3.so", "vllm/_flashmla_C.abi3.so",
                     "vllm/_flashmla_extension_C.abi3.so", "vllm/third_party/__init__.py",
                     "vllm/third_party/flashmla/__init__.py", "vllm/third_party/flashmla/flash_mla_interface.py",
                     "vllm/third_party/deep_gemm/__init__.py", "vllm/third_party/deep_gemm/include/dg/x.cuh",
                     "vllm/third_party/fmha_sm100/big.cu", "vllm/model_executor/layers/linear.py"):
            zf.writestr(name, f"# {name}\n")
    return w


def test_kernels_from_wheel_extracts_only_the_kernels_and_refuses_a_wrong_sha(tmp_path):
    e = Env(tmp_path)
    w = _fake_wheel(e)
    pins = e.pins.read_text()
    pins = re.sub(r"^VLLM_WHEEL=.*$", "VLLM_WHEEL=vllm-fake.whl", pins, flags=re.M)
    e.pins.write_text(re.sub(r"^VLLM_WHEEL_SHA256=.*$", f"VLLM_WHEEL_SHA256={sha256(w)}", pins, flags=re.M))
    out, tgz = tmp_path / "wk", tmp_path / "carry" / "wk.tar.gz"
    r = e.run("wheel_kernels.py", "--out", str(out), "--tarball", str(tgz))
    assert r.returncode == 0, r.stderr
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted(["vllm/__init__.py", "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so",
                          "vllm/third_party/__init__.py", "vllm/third_party/flashmla/__init__.py",
                          "vllm/third_party/flashmla/flash_mla_interface.py", "vllm/third_party/deep_gemm/__init__.py",
                          "vllm/third_party/deep_gemm/include/dg/x.cuh"])
    stub = (out / "vllm/__init__.py").read_text()
    assert "stub" in stub.lower() and "FlashMLA" in stub and "DeepGEMM" in stub and "import" not in stub.split('"""')[2]
    with tarfile.open(tgz) as tf:
        assert "wk/vllm/third_party/deep_gemm/include/dg/x.cuh" in tf.getnames()
    assert "upload limit 64 MiB" in r.stdout
    # the same wheel name with other bytes is refused
    with zipfile.ZipFile(w, "a") as zf:
        zf.writestr("vllm/extra.py", "evil = 1\n")
    r = e.run("wheel_kernels.py", "--out", str(tmp_path / "wk2"), "--tarball", str(tgz))
    assert r.returncode == 1 and "sha256 mismatch for vLLM wheel" in r.stderr
    assert not (tmp_path / "wk2").exists()


# ------------------------------------------------------------------------------------------------- CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerodiff.cli", *args], cwd=str(REPO), text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO / "kernels")}, timeout=120)


def test_cli_version_help_and_doctor_json(capsys):
    sys.path.insert(0, str(REPO / "kernels"))
    import zerodiff
    from zerodiff import cli

    r = _cli("--version")  # the real entry point, once, in a fresh interpreter
    assert r.returncode == 0 and r.stdout.strip() == f"zerodiff {zerodiff.__version__}"
    with pytest.raises(SystemExit) as ex:
        cli.main(["--help"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    assert "doctor" in out and "diff = 0" in out
    assert cli.main(["doctor", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"python", "torch", "triton", "backends", "pins", "consistency_mode"} <= set(d)
    assert {"deepgemm", "flashmla", "triton", "reference"} <= set(d["backends"])
    assert d["pins"]["values"]["VLLM_COMMIT"] == "4ba787ec9"
    assert d["consistency_mode"]["can_run"] in ("yes", "no", "reference-only")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "consistency mode: can run here:" in out and "VLLM_SDIST_SHA256" in out


def test_doctor_verdict_rules():
    sys.path.insert(0, str(REPO / "kernels"))
    from zerodiff.doctor import verdict

    tr = {"available": True, "version": "3.8.0"}
    assert verdict({"available": True, "cuda_available": True, "compute_capability": [9, 0]}, tr)[0] == "yes"
    assert verdict({"available": True, "cuda_available": True, "compute_capability": [10, 0]}, tr)[0] == "yes"
    ans, why = verdict({"available": True, "cuda_available": True, "compute_capability": [8, 0]}, tr)
    assert ans == "no" and "8.0" in why
    assert verdict({"available": True, "cuda_available": True, "compute_capability": [9, 0]},
                   {"available": False})[0] == "no"
    ans, why = verdict({"available": True, "cuda_available": False}, tr)
    assert ans == "reference-only" and "zerodiff check" in why
    assert verdict({"available": False}, tr)[0] == "no"


def test_cli_registers_e2e_subcommands_when_the_module_exists(monkeypatch):
    sys.path.insert(0, str(REPO / "kernels"))
    import types

    from zerodiff import cli

    calls = []
    fake = types.ModuleType("zerodiff.e2e_cli")

    def register(sub):
        p = sub.add_parser("check", help="end-to-end check")
        p.set_defaults(func=lambda a: calls.append("check") or 0)

    fake.register = register
    monkeypatch.setitem(sys.modules, "zerodiff.e2e_cli", fake)
    assert cli.main(["check"]) == 0 and calls == ["check"]


def test_user_fork_conflict_names_the_patch_and_file_and_changes_nothing(sandbox):
    e = sandbox
    f = e.files
    e.patch("0001-ok.patch", {"vllm/attn.py": replace_line(f["vllm/attn.py"], "q * k", "q * k  # zd")})
    e.patch("0002-conflict.patch", {"vllm/sampler.py": replace_line(f["vllm/sampler.py"], "x + 7\n", "x + 70\n")})
    e.series("0001-ok.patch", "0002-conflict.patch")
    fork = e.tmp / "fork"
    git(["clone", "-q", str(e.tree), str(fork)], e.tmp)
    write_files(fork, {"vllm/sampler.py": replace_line(f["vllm/sampler.py"], "x + 7\n", "x + 77\n")})
    git(["commit", "-q", "-am", "fork edits the same line"], fork)
    before = snapshot(fork)
    r = e.run("patches.py", "apply", "--side", "vllm", VLLM_SRC=str(fork))
    assert r.returncode == 1
    assert "patch 0002-conflict.patch does not apply" in r.stderr and "even with a 3-way merge" in r.stderr
    assert "vllm/sampler.py" in r.stderr and "0001-ok.patch" in r.stderr  # says what stays applied
    after = snapshot(fork)
    assert after["vllm/sampler.py"] == before["vllm/sampler.py"]  # no conflict markers left behind
    assert "q * k  # zd" in after["vllm/attn.py"].decode()
    r = e.run("patches.py", "unapply", "--side", "vllm", VLLM_SRC=str(fork))
    assert r.returncode == 0, r.stderr
    assert snapshot(fork) == before


def test_no_tracked_symlinks_or_ignored_build_outputs():
    """A checkout must hold plain files only: a committed link (for instance a worktree's ``build/downloads``
    pointing at another checkout) breaks the fetch steps on every other machine."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in out.splitlines() if line.startswith("120000 ")]
    assert not links, f"symlinks are tracked: {links}"
    tracked = subprocess.run(["git", "ls-files", "build/downloads", "build/sources", ".carry", ".venv"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert not tracked, f"build outputs are tracked: {tracked[:5]}"
