"""``zerodiff bench`` measurement tools and the rollout concurrency options (CPU): setting validation, the JIT
detector (a compilation planted inside a timed window fails the run), the confidence-interval math, the profiler
breakdown's structure and the bench JSON keys. No timing assertions."""

from __future__ import annotations

import json
import math
import statistics
import types

import pytest
import torch

from e2e_helpers import cli_json
from zerodiff import bench_tools as bt
from zerodiff import e2e_cli
from zerodiff.model.config import preset

#: a small bench: 4 requests per step, 2..4 running
SMALL = ["--config", "cpu", "--prompts", "2", "--max-batch", "2,4", "--quiet"]


# ---- concurrency settings ----------------------------------------------------------------------------------------
def test_settings_untouched_without_options():
    p = preset("h200")
    assert bt.apply_rollout_settings(p) is p


def test_settings_h200_at_64_concurrent_requests():
    p = bt.apply_rollout_settings(preset("h200"), prompts=32, max_batch="64")
    rc = p.rollout
    assert rc.max_batch == (64, 64) and rc.prompts_per_step == 32
    assert rc.graph_batch_sizes == (1, 2, 4, 8, 16, 32, 64)  # every decode batch of <= 64 rows is captured
    need = bt.kv_blocks_needed(rc, True)
    assert need == 64 * math.ceil((3584 + 48) / 64) + 1 and rc.num_blocks == need  # enlarged to fit
    doc = bt.rollout_settings_doc(p)
    assert doc["requests_per_step"] == 64 and doc["kv_blocks"] >= doc["kv_blocks_needed"]


@pytest.mark.parametrize("kw, names", [
    (dict(max_batch="8,17"), ("--max-batch", "--prompts 9")),  # cpu: 16 requests
    (dict(prompts=2, max_batch="2,8"), ("--max-batch", "--prompts 4")),
    (dict(max_batch="4,30", prompts=16), ("--token-budget",)),  # budget low end 24 < 30
    (dict(max_batch="8", graph_batch_sizes="1,2,4"), ("--graph-batch-sizes",)),
    (dict(max_batch="8", kv_blocks=10), ("--kv-blocks", "blocks")),
    (dict(max_batch="8,2"), ("--max-batch", "LO <= HI")),
    (dict(max_batch="a,b"), ("--max-batch",)),
    (dict(token_budget="0,5"), ("--token-budget",)),
    (dict(prompts=0), ("--prompts",)),
    (dict(graph_batch_sizes="0,4"), ("--graph-batch-sizes",)),
])
def test_settings_refused_with_the_setting_named(kw, names):
    with pytest.raises(bt.SettingError) as ei:
        bt.apply_rollout_settings(preset("cpu"), **kw)
    for n in names:
        assert n in str(ei.value)


def test_settings_other_options_leave_the_preset_concurrency_alone():
    p = bt.apply_rollout_settings(preset("h200"), kv_blocks=2000)  # h200: max_batch (2, 8) over 6 requests
    assert p.rollout.num_blocks == 2000 and p.rollout.max_batch == (2, 8)


def test_cli_refuses_impossible_concurrency(capsys):
    with pytest.raises(SystemExit) as ei:
        e2e_cli.main(["check", "--config", "cpu", "--steps", "1", "--quiet", "--max-batch", "2,20"])
    assert ei.value.code == 2 and "--max-batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e_cli.main(["bench", *SMALL, "--kv-blocks", "3"])
    assert "--kv-blocks" in capsys.readouterr().err


def test_check_at_max_batch_8_keeps_diff_zero(tmp_path):
    rc, doc = cli_json(tmp_path / "c.json", "check", "--config", "cpu", "--steps", "1", "--max-batch", "8,8", "--quiet")
    assert rc == 0
    rep = doc["reports"][0]
    assert rep["bitwise_equal"] and rep["training/rollout_probs_diff_max"] == 0.0
    assert max(rep["batch_sizes"]) == 8  # the concurrency was reached
    assert doc["rollout_settings"]["max_batch"] == [8, 8]


# ---- JIT detector -------------------------------------------------------------------------------------------------
def test_detector_sees_new_cache_entries_only_in_their_window(tmp_path):
    d = tmp_path / "cache"
    (d / "old").mkdir(parents=True)
    det = bt.JitDetector({"x": str(d)}, strict=True)
    with det.window("warm:0:consistent"):
        (d / "a").mkdir()
    with det.window("timed:0:consistent"):
        (d / "b" / "kernel.cubin").parent.mkdir()
        (d / "b" / "kernel.cubin").write_text("x")
    with det.window("timed:1:consistent"):
        pass
    timed = det.during("timed:")
    assert {e["what"].split("cache/")[-1] for e in timed} == {"b", "b/kernel.cubin"}
    assert [e["what"].split("cache/")[-1] for e in det.during("warm")] == ["a"]


def test_detector_attributes_cache_entries_to_this_process_only_with_evidence(tmp_path):
    """Non-strict: a new entry in a window where this process compiled nothing came from another process sharing
    the dir (listed as foreign, not a failure); with a child process run in the window (a compiler), it counts."""
    import subprocess
    import sys

    d = tmp_path / "cache"
    d.mkdir()
    det = bt.JitDetector({"x": str(d)})
    with det.window("timed:0:consistent"):
        (d / "other").mkdir()
    assert det.during("timed:") == [] and [e["what"].split("cache/")[-1] for e in det.foreign] == ["other"]
    with det.window("timed:1:consistent"):
        subprocess.run([sys.executable, "-c", "sum(range(3 * 10 ** 6))"], check=True)
        (d / "mine").mkdir()
    kinds = [e["kind"] for e in det.during("timed:1:")]
    assert kinds == ["child processes", "new x entry"]
    assert det.summary()["foreign_cache_entries"] == 1


def test_detector_hooks_triton_compilation(monkeypatch):
    jit = pytest.importorskip("triton.runtime.jit")
    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda self, *a, **k: "compiled", raising=False)
    fn = types.SimpleNamespace(fn=types.SimpleNamespace(__name__="_planted_kernel"))
    with bt.JitDetector({}) as det:
        assert det.triton_hook
        jit.JITFunction._do_compile(fn, "key")  # outside a window: not timed
        with det.window("timed:3:baseline"):
            assert jit.JITFunction._do_compile(fn, "key") == "compiled"
    assert jit.JITFunction._do_compile(fn) == "compiled"  # unhooked again
    assert det.during("timed:") == [{"window": "timed:3:baseline", "kind": "triton_compile", "what": "_planted_kernel"}]
    assert len(det.events) == 2


def test_bench_fails_when_something_compiles_during_timing(tmp_path, monkeypatch, capsys):
    """A compilation planted inside every rollout (a Triton cache miss and a new JIT cache entry) is seen in the
    timed windows: exit 1, ``compiled_during_timing`` lists both kinds."""
    jit = pytest.importorskip("triton.runtime.jit")
    from zerodiff.rl import loop

    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda self, *a, **k: None, raising=False)
    cache = tmp_path / "jitcache"
    cache.mkdir()
    orig = loop.RLRun.rollout
    n = [0]

    def planted(self, step, record=None):
        n[0] += 1
        (cache / f"kernel{n[0]}").write_text("cubin")
        jit.JITFunction._do_compile(types.SimpleNamespace(fn=types.SimpleNamespace(__name__="_planted")), n[0])
        return orig(self, step, record=record)

    monkeypatch.setattr(loop.RLRun, "rollout", planted)
    rc, doc = cli_json(tmp_path / "b.json", "bench", *SMALL, "--steps", "1", "--profile-steps", "0",
                       "--watch-cache-dir", str(cache))
    assert rc == 1
    assert doc["passed"] is False
    kinds = {e["kind"] for e in doc["compiled_during_timing"]}
    assert "triton_compile" in kinds and any(k.startswith("new extra") for k in kinds)
    assert all(e["window"].startswith("timed:0:") for e in doc["compiled_during_timing"])
    assert doc["rows"][0]["compiled_during_timing"] == len(doc["compiled_during_timing"])
    assert "compilation(s) during timing" in capsys.readouterr().out


# ---- confidence intervals -----------------------------------------------------------------------------------------
def _coverage(n, k):  # independent: exact binomial probabilities by Pascal's triangle in fractions
    from fractions import Fraction

    row = [Fraction(1)]
    for _ in range(n):
        row = [a + b for a, b in zip([Fraction(0)] + row, row + [Fraction(0)])]
    tail = sum(row[:k]) / 2 ** n
    return float(1 - 2 * tail)


@pytest.mark.parametrize("n", [1, 2, 5, 6, 9, 20, 21, 40])
def test_order_statistic_ci(n):
    xs = [((i * 7919) % 101) / 10 for i in range(n)]
    ci = bt.median_ci_order(xs)
    s = sorted(xs)
    k = ci["k"]
    assert ci["lo"] == s[k - 1] and ci["hi"] == s[n - k]
    assert ci["coverage"] == pytest.approx(_coverage(n, k), abs=1e-12)
    if n >= 6:  # the largest k that still reaches 95%
        assert ci["coverage"] >= 0.95 and (k + 1 > n // 2 or _coverage(n, k + 1) < 0.95)
    else:
        assert k == 1
    assert ci["lo"] <= statistics.median(xs) <= ci["hi"]


def test_order_statistic_ci_n20_known_value():
    ci = bt.median_ci_order(list(range(20)))
    assert ci["k"] == 6 and (ci["lo"], ci["hi"]) == (5, 14) and ci["coverage"] == pytest.approx(0.9586105, abs=1e-6)


def test_bootstrap_ci_is_seeded_and_brackets_the_median():
    xs = [1.0, 0.98, 1.02, 0.97, 1.05, 0.99, 1.01, 1.0, 0.96, 1.03]
    a, b = bt.median_ci_bootstrap(xs), bt.median_ci_bootstrap(xs)
    assert a == b and min(xs) <= a["lo"] <= statistics.median(xs) <= a["hi"] <= max(xs)
    s = bt.ratio_summary(xs)
    assert s["median"] == statistics.median(xs) and (s["min"], s["max"]) == (min(xs), max(xs))
    assert set(s) >= {"ci95_order_statistic", "ci95_bootstrap", "n"}


# ---- profiler breakdown -------------------------------------------------------------------------------------------
class _Ops:
    graph_safe = False

    def k_mm(self, a, b):
        return a @ b

    def outer(self, a, b):
        return self.k_mm(a, b).relu() + 1

    def graph_of(self, x):  # tape helper: not annotated
        return x


def test_annotate_ops_and_cpu_breakdown():
    from torch.profiler import ProfilerActivity, profile

    ops = _Ops()
    a = torch.randn(64, 64)
    with bt.annotate_ops(ops) as names:
        assert set(names) == {"k_mm", "outer"}
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                ops.outer(a, a)
    assert "k_mm" not in vars(ops) and "outer" not in vars(ops)  # the instance is restored
    b = bt.breakdown(prof.events(), steps=3, tokens=6)
    assert b["source"] == "cpu" and "structure check" in b["measure"]
    per_op = {o["op"]: o for o in b["ops"]}
    assert "k_mm" in per_op and "outer" in per_op  # aten::mm under k_mm, relu/add under outer
    assert any(k["name"] == "aten::mm" for k in b["kernels"])
    assert sum(o["share"] for o in b["ops"]) == pytest.approx(100.0, abs=0.1)
    assert b["us_per_token"] == pytest.approx(b["total_us"] / 6)
    assert bt.format_breakdown("consistent", b)[0].startswith("consistent:")


def test_breakdown_device_path_attributes_kernels_to_ops():
    """The GPU branch on synthetic events: kernel time from the device events, op time from the launching host
    call's kernels under its innermost zerodiff:: range, the unlinked remainder reported."""
    from torch.autograd import DeviceType

    def ev(name, parent=None, kernels=(), dev=False, us=0.0):
        return types.SimpleNamespace(name=name, cpu_parent=parent, kernels=list(kernels),
                                     device_type=DeviceType.CUDA if dev else DeviceType.CPU,
                                     time_range=types.SimpleNamespace(elapsed_us=lambda: us),
                                     is_user_annotation=False, self_cpu_time_total=0.0)

    K = types.SimpleNamespace
    outer = ev("zerodiff::moe")
    inner = ev("zerodiff::k_swiglu_quant", parent=outer)
    l1 = ev("cudaLaunchKernel", parent=inner, kernels=[K(name="silu_k", device=0, duration=30.0)])
    l2 = ev("cudaLaunchKernel", parent=outer, kernels=[K(name="gemm_k", device=0, duration=60.0)])
    l3 = ev("cudaLaunchKernel", parent=None, kernels=[K(name="sample_k", device=0, duration=5.0)])
    outer.kernels = [K(name="zerodiff::moe", device=0, duration=95.0)]  # the range's GPU-timeline mirror
    devs = [ev("silu_k", dev=True, us=30.0), ev("gemm_k", dev=True, us=60.0), ev("gemm_k", dev=True, us=0.0),
            ev("sample_k", dev=True, us=5.0), ev("memcpy", dev=True, us=5.0)]
    mirror = ev("zerodiff::moe", dev=True, us=95.0)
    mirror.is_user_annotation = True
    b = bt.breakdown([outer, inner, l1, l2, l3, *devs, mirror], top=2)
    assert b["source"] == "device" and b["total_us"] == 100.0 and "idle gaps excluded" in b["measure"]
    assert [(k["name"], k["us"], k["count"], k["share"]) for k in b["kernels"]] == [("gemm_k", 60.0, 2, 60.0),
                                                                                   ("silu_k", 30.0, 1, 30.0)]
    assert b["kernels_rest_us"] == 10.0 and b["kernels_distinct"] == 4
    ops = {o["op"]: o["us"] for o in b["ops"]}
    assert ops == {"moe": 60.0, "k_swiglu_quant": 30.0, "(outside any zerodiff op)": 5.0,
                   "(not linked to a host call)": 5.0}


# ---- the bench JSON ---------------------------------------------------------------------------------------------
def test_bench_json_keys_and_profile(tmp_path, capsys):
    rc, doc = cli_json(tmp_path / "bench.json", "bench", *SMALL, "--steps", "2", "--profile-steps", "1",
                       "--png", str(tmp_path / "b.png"))
    assert rc == 0
    for k in ("rows", "ratio", "ratio_ci95", "ratio_min", "ratio_max", "compiled_during_timing", "jit_detector",
              "warmup", "profile", "rollout_settings", "baseline_vs_vllm", "timing", "forward_device_measure",
              "passed", "baseline_choice"):
        assert k in doc, k
    assert doc["passed"] is True and doc["compiled_during_timing"] == [] and doc["warmup"]["exact"]
    assert [r["first"] for r in doc["rows"]] == ["consistent", "baseline"]  # the order alternates
    assert doc["ratio"] == statistics.median(r["ratio"] for r in doc["rows"])
    assert doc["ratio_min"] <= doc["ratio"] <= doc["ratio_max"]
    assert set(doc["ratio_ci95"]) == {"order_statistic", "bootstrap"}
    assert doc["rollout_settings"]["max_batch"] == [2, 4] and doc["rollout_settings"]["requests_per_step"] == 4
    for r in doc["rows"]:
        assert r["consistent_probs_diff_max"] == 0.0 and r["consistent_max_batch_seen"] <= 4
    prof = doc["profile"]
    assert prof["steps"] == [0] and prof["kernel_time_ratio"] > 0
    for m in ("consistent", "baseline"):
        assert prof[m]["source"] == "cpu" and prof[m]["kernels"] and prof[m]["ops"]
        assert any(o["op"].startswith("kernel_") for o in prof[m]["ops"])
    assert doc["forward_device_ratio"] is None
    text = capsys.readouterr().out
    assert "95% CI" in text and "op kernel_" in text


# ---- the baseline's vLLM ops (CPU: the recorded fallback and the probe logic) ------------------------------------
@pytest.fixture
def fresh_vllm_ops(monkeypatch):
    from zerodiff.baselines import vllm_ops as V
    from zerodiff.model import baseline_cuda as BC

    monkeypatch.setattr(V, "STATUS", {})
    monkeypatch.setattr(V, "_LOADED", {})
    monkeypatch.setattr(V, "_PROBED", {})
    monkeypatch.setattr(BC, "CHOICES", {})
    return V, BC


def test_vllm_ops_policy_and_cpu_status(fresh_vllm_ops, monkeypatch):
    V, BC = fresh_vllm_ops
    monkeypatch.setenv("ZERODIFF_BASELINE_VLLM_OPS", "bogus")
    with pytest.raises(ValueError, match="ZERODIFF_BASELINE_VLLM_OPS"):
        V.policy()
    monkeypatch.setenv("ZERODIFF_BASELINE_VLLM_OPS", "auto")
    if not torch.cuda.is_available():
        assert V.library("_C") is None and "no CUDA" in V.STATUS["_C"]
    monkeypatch.setenv("ZERODIFF_BASELINE_VLLM_OPS", "off")
    V._LOADED.clear()
    assert V.library("_moe_C") is None and "off" in V.STATUS["_moe_C"]


def test_baseline_vllm_op_fallback_is_recorded_and_require_fails_closed(fresh_vllm_ops, monkeypatch):
    V, BC = fresh_vllm_ops
    monkeypatch.setattr(V, "library", lambda ns: None)
    V.STATUS["_C"] = "not found: test"
    s = torch.randn(3, 40)
    lens = torch.tensor([40, 5, 17])
    idx = BC.topk_rows(s, 8, lens)
    assert idx.dtype == torch.int32 and idx.shape == (3, 8)
    assert (idx[1, 5:] == -1).all() and (idx[1, :5] >= 0).all() and (idx[1, :5] < 5).all()
    assert torch.equal(idx[0].sort().values.long(), torch.topk(s[0], 8).indices.sort().values)
    assert "torch.topk" in BC.CHOICES[("dsa top-k",)] and "not found: test" in BC.CHOICES[("dsa top-k",)]
    monkeypatch.setenv("ZERODIFF_BASELINE_VLLM_OPS", "require")
    with pytest.raises(BC.BaselineUnavailable, match="require"):
        BC.route_sigmoid(torch.randn(4, 8), torch.zeros(8), 2, 2.5)


def test_baseline_vllm_op_probe_failure_falls_back(fresh_vllm_ops, monkeypatch):
    V, BC = fresh_vllm_ops
    monkeypatch.setattr(V, "library", lambda ns: object())  # "loaded", but the op call below fails
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.rand(16, dtype=torch.bfloat16) + 0.5
    y = BC.rms_norm(x, w, 1e-6)  # torch.ops._C.rms_norm is not registered on this machine -> probe fails
    ref = torch.nn.functional.rms_norm(x.float(), (16,), w.float(), 1e-6).to(torch.bfloat16)
    assert torch.equal(y, ref)
    assert V.STATUS["rms norm"].startswith("probe FAILED") and "probe" in BC.CHOICES[("rms norm",)]
    assert V.probe_once("rms norm", None, None, None) is False  # decided once per process
    ok = V.probe_once("toy", lambda: torch.ones(2), lambda: torch.ones(2), BC._close(1e-3))
    assert ok and V.STATUS["toy"].startswith("probe passed")
    w_, ids = BC.route_sigmoid(torch.randn(5, 8), torch.randn(8), 2, 2.5)  # torch path after a failed probe
    assert ids.dtype == torch.int32 and torch.allclose(w_.sum(1), torch.full((5,), 2.5))


def test_split_rows_and_vs_vllm():
    from zerodiff.model import baseline_cuda as BC

    d, p = BC.split_rows([4, 1], 6, "cpu")
    assert d.tolist() == [4, 1] and p.tolist() == [0, 2, 3, 5]
    rows = BC.vs_vllm()
    ops = {r["op"] for r in rows}
    assert {"rms norm", "silu*mul -> fp8", "dsa top-k", "expert routing", "mhc pre", "attention"} <= ops
    assert all(set(r) == {"op", "harness", "vllm", "note"} for r in rows)


def test_bench_time_budget_stops_and_skips_the_profiler(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_cli, "_over_budget", lambda args, t0, last_s: True)
    rc, doc = cli_json(tmp_path / "b.json", "bench", *SMALL, "--steps", "5", "--time-budget", "1")
    assert rc == 0
    assert doc["steps_run"] == 1 and doc["stopped_by_time_budget"] and "skipped" in doc["profile"]


def _post_inputs(T=5, n=4, H=256, seed=3):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T, H, generator=g).to(torch.bfloat16)
    X = torch.randn(T, n, H, generator=g).to(torch.bfloat16)
    post = torch.rand(T, n, generator=g) * 2
    comb = torch.rand(T, n, n, generator=g)
    return y, X, post, comb


def test_baseline_mhc_post_without_tilelang_runs_the_fused_kernel_and_says_why(fresh_vllm_ops, monkeypatch):
    V, BC = fresh_vllm_ops
    from zerodiff.ops.mhc import mhc_post

    y, X, post, comb = _post_inputs()
    out = BC.mhc_post(y, X, post, comb)
    assert torch.equal(out, mhc_post(y, X, post, comb))
    expect = (post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("tij,tih->tjh", comb, X.float()))
    assert (out.float() - expect).abs().max() <= 1e-2 * expect.abs().max()
    why = BC.CHOICES[("mhc post",)]
    assert why.startswith("one fused kernel") and V.STATUS["tilelang mhc"] in why
    monkeypatch.setenv("ZERODIFF_BASELINE_VLLM_OPS", "require")
    with pytest.raises(BC.BaselineUnavailable, match="TileLang"):
        BC.mhc_post(y, X, post, comb)


def test_baseline_mhc_post_uses_tilelang_when_its_probe_passes(fresh_vllm_ops, monkeypatch):
    V, BC = fresh_vllm_ops
    calls = []

    class FakeTileLang:  # the TileLang kernel's call convention: (comb, residual, post[T, n], x, out, n, H)
        @staticmethod
        def _MHC_POST_TILELANG_KERNEL(comb, residual, post, x, out, n, H):
            calls.append((n, H))
            out.copy_((post.unsqueeze(-1) * x.float().unsqueeze(1)
                       + torch.einsum("tij,tih->tjh", comb, residual.float())).to(out.dtype))

    monkeypatch.setattr(V, "tilelang_mhc_kernels", lambda: FakeTileLang)
    y, X, post, comb = _post_inputs()
    out = BC.mhc_post(y, X, post, comb)
    assert calls and calls[0] == (4, 256) and BC.CHOICES[("mhc post",)] == "vLLM TileLang fused mHC post"
    assert V.STATUS["mhc post"].startswith("probe passed") and out.dtype == torch.bfloat16

    class WrongTileLang(FakeTileLang):  # transposed comb: the probe must reject it
        @staticmethod
        def _MHC_POST_TILELANG_KERNEL(comb, residual, post, x, out, n, H):
            FakeTileLang._MHC_POST_TILELANG_KERNEL(comb.transpose(1, 2), residual, post, x, out, n, H)

    monkeypatch.setattr(V, "_PROBED", {})
    monkeypatch.setattr(BC, "CHOICES", {})
    monkeypatch.setattr(V, "tilelang_mhc_kernels", lambda: WrongTileLang)
    BC.mhc_post(y, X, post, comb)
    assert V.STATUS["mhc post"].startswith("probe FAILED") and "probe FAILED" in BC.CHOICES[("mhc post",)]


def test_tilelang_loader_reports_why_not_on_cpu(fresh_vllm_ops, monkeypatch):
    V, _ = fresh_vllm_ops
    assert V.tilelang_mhc_kernels() is None
    assert ("no CUDA" in V.STATUS["tilelang mhc"]) or ("not importable" in V.STATUS["tilelang mhc"])
