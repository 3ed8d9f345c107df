"""The GPU-machine scripts' orchestration, on the CPU with stand-ins for nvidia-smi and the GPU programs.

A broken stage order, a missing output file or a timeout sum that overruns costs a lent machine's device time;
these tests run ``gpu/e2e-device.sh`` and ``gpu/perf-session.sh`` end to end with a fake ``nvidia-smi`` (one
or two GPUs) and a fake interpreter that records every call it gets (with its CUDA_VISIBLE_DEVICES) and writes
the JSON each stage is asked for, then check what ran, where, in which order, and what came back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_PY = r'''#!/bin/bash
echo "$CUDA_VISIBLE_DEVICES|$*" >> "$FAKE_LOG"
json_out() { local prev=""; for a in "$@"; do [ "$prev" = "--json" ] && echo "$1" > "$a"; prev="$a"; done; }
case "$*" in
  -|-c*) exec REALPY "$@" ;;
  *"zerodiff.e2e_cli warmup"*) sleep 1; echo "$CUDA_VISIBLE_DEVICES|WARMUP-DONE" >> "$FAKE_LOG"
                               echo "zerodiff warmup: done in 1 s, 0 calls, 0 problem(s)" ;;
  *"zerodiff.e2e_cli check"*) json_out '{"passed": true}' "$@"; echo "PASS: diff = 0 on 1/1 steps run" ;;
  *"zerodiff.e2e_cli bench"*) json_out '{"ratio": 0.9, "consistent_tok_per_s": 1.0}' "$@"; echo "step 0" ;;
  *"-m pytest"*) echo "1 passed in 0.01s" ;;
  *benchmarks/bench_*) json_out '{}' "$@" ;;
  *) exec REALPY "$@" ;;
esac
'''


def _fakes(tmp_path: Path, ngpu: int) -> dict:
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    smi = bin_ / "nvidia-smi"
    lines = "".join(f'echo "GPU {i}: NVIDIA H200 (fake)"; ' for i in range(ngpu))
    smi.write_text(f'#!/bin/bash\nif [ "$1" = "-L" ]; then {lines}else echo "NVIDIA H200, 0, 143771 MiB"; fi\n')
    py = bin_ / "py"
    py.write_text(FAKE_PY.replace("REALPY", sys.executable))
    for f in (smi, py):
        f.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", PYTHON=str(py), FAKE_LOG=str(log),
               OUT=str(tmp_path / "out"), ZD_SKIP_UNPACK="1", DG_JIT_CACHE_DIR=str(tmp_path / "dg"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _calls(tmp_path: Path) -> list[tuple[str, str]]:
    out = []
    for line in (tmp_path / "calls.log").read_text().splitlines():
        dev, _, args = line.partition("|")
        out.append((dev, args))
    return out


def _first(calls, needle):
    return next(i for i, (_, a) in enumerate(calls) if needle in a)


@pytest.mark.parametrize("ngpu", [1, 2])
def test_e2e_device_runs_every_stage_on_the_right_gpu(tmp_path, ngpu):
    env = _fakes(tmp_path, ngpu)
    r = subprocess.run(["bash", str(REPO / "gpu/e2e-device.sh"), "--total", "300", "--tests", "tests/test_mhc.py",
                        "--also", 'echo "$CUDA_VISIBLE_DEVICES|ALSO-RAN" >> "$FAKE_LOG"; echo swept > "$LOGS/sweep.txt"'],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out"
    # the Triton cache comes back when anything in the run compiled (the env report's backend probe may)
    names = sorted(p.name for p in out.iterdir() if p.name != "triton-cache-h200.tar.gz")
    assert names == ["base_h200.json", "bench_h200.json", "check_h200.json", "logs.tar.gz", "summary.txt"]
    assert len(names) <= 8  # what a lent machine sends back
    calls = _calls(tmp_path)
    check = [c for c in calls if "e2e_cli check" in c[1] and "--baseline" not in c[1]]
    base = [c for c in calls if "--baseline" in c[1]]
    bench = [c for c in calls if "e2e_cli bench" in c[1]]
    assert len(check) == len(base) == len(bench) == 1
    assert "--steps 100" in check[0][1] and "--time-budget" in check[0][1]
    assert any("warmup --config h200 --config gpu_small" in a for _, a in calls)
    assert _first(calls, "ALSO-RAN") > _first(calls, "e2e_cli bench")  # --also after the bench, on its GPU
    if ngpu == 2:  # the check on GPU 0; negative control, bench and --also on GPU 1, tests after them
        assert check[0][0] == "0" and base[0][0] == bench[0][0] == "1"
        assert calls[_first(calls, "ALSO-RAN")][0] == "1" and _first(calls, "-m pytest") > _first(calls, "ALSO-RAN")
    else:  # baseline and bench only after the check (memory), the bench last
        assert _first(calls, "--baseline") > _first(calls, "e2e_cli check --config h200 --steps 100")
        assert _first(calls, "e2e_cli bench") > _first(calls, "--baseline")
    with tarfile.open(out / "logs.tar.gz") as t:
        assert "logs/tests/files.txt" in t.getnames() and "logs/sweep.txt" in t.getnames()
    assert "tests/test_mhc.py: exit 0" in (out / "summary.txt").read_text()


@pytest.mark.parametrize("ngpu", [1, 2])
def test_perf_session_times_every_variant_and_never_shares_a_timed_gpu(tmp_path, ngpu):
    env = _fakes(tmp_path, ngpu)
    _fake_triton_cache(tmp_path / "triton")  # a run that compiled something packs its cache for the next call
    r = subprocess.run(["bash", str(REPO / "gpu/perf-session.sh"), "--total", "400",
                        "--variants", "ieee_s112 bf16x3_s32"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["e2e.tar.gz", "summary.txt", "sweeps.tar.gz", "tests.tar.gz",
                                                     "triton-cache-h200.tar.gz"]
    calls = _calls(tmp_path)
    bench = [c for c in calls if "e2e_cli bench" in c[1]]
    assert len(bench) == 4  # shipped, two mHC variants, the other Top-K design
    assert sum("--mhc-variant ieee_s112" in a for _, a in bench) == 1
    assert sum("--mhc-variant bf16x3_s32" in a for _, a in bench) == 1
    sweeps = [c for c in calls if "benchmarks/bench_" in c[1]]
    assert {a.split()[0] for _, a in sweeps} == {"benchmarks/bench_mhc.py", "benchmarks/bench_topk.py",
                                                 "benchmarks/bench_sparse_attention.py"}
    assert any("--hidden 2048" in a for _, a in sweeps)
    with tarfile.open(out / "e2e.tar.gz") as t:
        topk = json.load(t.extractfile("e2e/topk-single.json"))
    assert topk["ratio"] == 0.9
    warm = [c for c in calls if "e2e_cli warmup" in c[1]]
    timed = sweeps + bench
    tests = [(i, c) for i, c in enumerate(calls) if "-m pytest" in c[1]]
    assert {a.split()[-1] for _, (_, a) in tests} >= {"tests/test_mhc.py", "tests/test_logprobs.py"}
    last_bench = max(i for i, c in enumerate(calls) if "e2e_cli bench" in c[1])
    last_sweep = max(i for i, c in enumerate(calls) if "benchmarks/bench_" in c[1])
    if ngpu == 2:  # end to end on GPU 0 after the warm-up, sweeps on GPU 1; each GPU's tests after its timings
        assert {d for d, _ in warm} == {"0"} and {d for d, _ in bench} == {"0"} and {d for d, _ in sweeps} == {"1"}
        assert _first(calls, "WARMUP-DONE") < _first(calls, "e2e_cli bench")
        assert {d for _, (d, _) in tests} == {"0", "1"}
        assert all(i > (last_bench if d == "0" else last_sweep) for i, (d, _) in tests)
    else:  # nothing is timed before the warm-up has finished, tests last
        assert _first(calls, "WARMUP-DONE") < _first(calls, "benchmarks/bench_")
        assert min(i for i, _ in tests) > max(last_bench, last_sweep)
    text = (out / "summary.txt").read_text()
    assert "mhc-ieee_s112: ratio 0.9" in text and "topk-single: ratio 0.9" in text


@pytest.mark.parametrize("ngpu", [1, 2])
def test_attention_session_runs_bench_check_and_one_bench_per_piece_count(tmp_path, ngpu):
    env = _fakes(tmp_path, ngpu)
    r = subprocess.run(["bash", str(REPO / "gpu/attention-session.sh"), "--total", "400", "--pieces", "1 2",
                        "--check-pieces", "2", "--tests", ""],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out"
    assert {"e2e.tar.gz", "summary.txt", "tests.tar.gz", "bench.json"} <= {p.name for p in out.iterdir()}
    calls = _calls(tmp_path)
    micro = [c for c in calls if "bench_sparse_attention.py" in c[1]]
    assert len(micro) == 1 and "--flashmla-fp8" in micro[0][1]
    check = [c for c in calls if "e2e_cli check" in c[1]]
    assert len(check) == 1 and "--attn-backend flashmla_fp8" in check[0][1]
    bench = [c for c in calls if "e2e_cli bench" in c[1]]
    assert len(bench) == 2 and all("--attn-backend flashmla_fp8" in a for _, a in bench)
    tests = [(i, c) for i, c in enumerate(calls) if "-m pytest" in c[1]]
    assert {a.split()[-1] for _, (_, a) in tests} == {"tests/test_attention_flashmla_fp8.py"}
    if ngpu == 2:  # tests on GPU 0, every timing on GPU 1
        assert {d for _, (d, _) in tests} == {"0"}
        assert {d for d, _ in micro + check + bench} == {"1"}
    else:  # tests after every timing
        assert min(i for i, _ in tests) > max(i for i, c in enumerate(calls) if "e2e_cli bench" in c[1])
    text = (out / "summary.txt").read_text()
    assert "e2e bench, pieces 2: ratio 0.9" in text and "check: rc=0" in text


def _fake_triton_cache(cache: Path) -> None:
    """Two cache entries laid out like Triton 3.x's: files per key, a group file with absolute paths."""
    for key, name in (("AAA", "_topk_kernel"), ("BBB", "_mhc_epilogue")):
        d = cache / key
        d.mkdir(parents=True)
        files = {}
        for suffix, data in ((".json", '{"name": "%s"}' % name), (".cubin", "\x7fELF"), (".ptx", "// ptx"),
                             (".llir", "; llir"), (".ttir", "// ttir")):
            (d / f"{name}{suffix}").write_text(data)
            files[f"{name}{suffix}"] = str(d / f"{name}{suffix}")
        (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": files}))


def test_triton_cache_pack_unpack_rewrites_paths(tmp_path):
    src = tmp_path / "machine-a" / "cache"
    _fake_triton_cache(src)
    tool = [sys.executable, str(REPO / "build/triton_cache.py")]
    arc = tmp_path / "tc.tar.gz"
    r = subprocess.run(tool + ["pack", str(src), str(arc)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with tarfile.open(arc) as t:
        names = t.getnames()
    assert "triton-cache/AAA/_topk_kernel.cubin" in names and "triton-cache/AAA/__grp___topk_kernel.json" in names
    assert not any(n.endswith((".llir", ".ttir", ".ptx")) for n in names)  # what a cache hit never reads
    dst = tmp_path / "machine-b" / "cache"
    r = subprocess.run(tool + ["unpack", str(dst), str(arc)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    grp = json.loads((dst / "AAA" / "__grp___topk_kernel.json").read_text())["child_paths"]
    # every path of the group points into the new cache and exists there (what a Triton cache hit needs)
    kept = {c: p for c, p in grp.items() if not c.endswith((".llir", ".ttir", ".ptx"))}
    assert all(p.startswith(str(dst)) for p in grp.values())
    assert all(Path(p).is_file() for p in kept.values())
    assert (dst / "AAA" / "_topk_kernel.cubin").read_text() == "\x7fELF"
    # over the size limit: whole kernels per part, and the parts unpack to the same cache
    one = len(arc.read_bytes()) / (1 << 20)
    r = subprocess.run(tool + ["pack", str(src), str(tmp_path / "p.tar.gz"), "--max-mib", str(one * 0.8)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    parts = sorted(tmp_path.glob("p.part*.tar.gz"))
    assert [q.name for q in parts] == ["p.part1.tar.gz", "p.part2.tar.gz"] and not (tmp_path / "p.tar.gz").exists()
    dst2 = tmp_path / "machine-c" / "cache"
    r = subprocess.run(tool + ["unpack", str(dst2)] + [str(q) for q in parts], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(q.relative_to(dst2) for q in dst2.rglob("*")) == sorted(q.relative_to(dst) for q in dst.rglob("*"))
    # not even in --max-parts parts: refused, nothing written
    r = subprocess.run(tool + ["pack", str(src), str(tmp_path / "big.tar.gz"), "--max-mib", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 3 and not list(tmp_path.glob("big*"))
    # no cache: a clear message, no file
    r = subprocess.run(tool + ["pack", str(tmp_path / "none"), str(tmp_path / "x.tar.gz")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no cache" in r.stderr


SUITE_PY = r'''#!/bin/bash
case "$*" in
  -|-c*) exec REALPY "$@" ;;
  *"-m pytest"*tests/test_slow.py*) echo "tests/test_slow.py ."; sleep 30 ;;
  *"-m pytest"*) echo "3 passed, 2 deselected in 0.50s" ;;
  *) exec REALPY "$@" ;;
esac
'''


def test_gpu_suite_reports_each_file_from_its_own_log(tmp_path):
    """A file cut off by ZD_FILE_TIMEOUT is reported as timed out, never with the previous file's outcome line;
    files past --budget are listed as not run."""
    env = _fakes(tmp_path, 1)
    py = tmp_path / "bin" / "py"
    py.write_text(SUITE_PY.replace("REALPY", sys.executable))
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("test_fast.py", "test_slow.py", "test_late.py"):
        (tests / name).write_text("import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    files = " ".join(str(tests / n) for n in ("test_fast.py", "test_slow.py", "test_late.py"))
    env.update(ZD_TEST_FILES=files, ZD_FILE_TIMEOUT="2")
    r = subprocess.run(["bash", str(REPO / "gpu/gpu-suite.sh"), "--tests-only", "--budget", "2"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = (tmp_path / "out" / "files.txt").read_text().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].endswith("test_fast.py: exit 0: 3 passed, 2 deselected in 0.50s"), lines[0]
    assert "test_slow.py: exit 124: timed out after 2 s" in lines[1] and "passed" not in lines[1], lines[1]
    assert "test_late.py: not run (--budget 2 s spent)" in lines[2], lines[2]
    assert r.returncode != 0 or "exit 124" in (tmp_path / "out" / "summary.txt").read_text()


EP_PY = r'''#!/bin/bash
echo "$CUDA_VISIBLE_DEVICES|$*" >> "$FAKE_LOG"
json_out() { local prev=""; for a in "$@"; do [ "$prev" = "--json" ] && echo "$1" > "$a"; prev="$a"; done; }
case "$*" in
  -|-c*) exec REALPY "$@" ;;
  *"-m pytest"*) echo 'EP2_MODEL_RESULT [{"rank": 0}]'; echo "======== 40 passed in 9.00s ========" ;;
  *"zerodiff.e2e_cli check"*) json_out '{"passed": true}' "$@"; echo "PASS: diff = 0 on 3/3 steps" ;;
  *) exec REALPY "$@" ;;
esac
'''


@pytest.mark.parametrize("ngpu", [1, 2])
def test_ep_session_runs_the_tests_then_the_check_on_two_gpus(tmp_path, ngpu):
    env = _fakes(tmp_path, ngpu)
    (tmp_path / "bin" / "py").write_text(EP_PY.replace("REALPY", sys.executable))
    r = subprocess.run(["bash", str(REPO / "gpu/ep-session.sh"), "--total", "300", "--steps", "3"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = tmp_path / "out"
    if ngpu == 1:  # refused, nothing run
        assert r.returncode == 2 and "needs 2 GPUs" in (out / "summary.txt").read_text()
        assert not _calls(tmp_path)
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["ep2-check-graphs.json", "ep2-check.json", "ep2-model.json",
                                                     "logs.tar.gz", "summary.txt"]
    assert json.loads((out / "ep2-model.json").read_text()) == [{"rank": 0}]
    calls = [a for _, a in _calls(tmp_path)]
    tests = _first(_calls(tmp_path), "tests/test_expert_parallel.py")
    check = _first(_calls(tmp_path), "--rollout-ep 2 --steps 3")
    graphs = _first(_calls(tmp_path), "--ep-graphs")
    assert tests < check < graphs and "-m gpu" in calls[tests] and "--config gpu_small" in calls[check]
    assert "--ep-graphs" not in calls[check]
    summary = (out / "summary.txt").read_text()
    assert "40 passed" in summary and "PASS: diff = 0" in summary
