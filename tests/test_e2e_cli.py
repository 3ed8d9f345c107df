"""``zerodiff check`` / ``zerodiff bench`` on the CPU config: exit codes and JSON."""

from __future__ import annotations

import json

import torch

from zerodiff import e2e_cli


def test_check_cpu_two_steps_exits_zero(tmp_path):
    out = tmp_path / "check.json"
    rc = e2e_cli.main(["check", "--config", "cpu", "--steps", "2", "--quiet", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["config"] == "cpu" and len(doc["reports"]) == 2
    for rep in doc["reports"]:
        assert rep["bitwise_equal"] and rep["training/rollout_probs_diff_max"] == 0.0
        assert rep["rollout_corr/k3_kl"] == 0.0


def test_check_baseline_is_a_negative_control(tmp_path):
    out = tmp_path / "base.json"
    rc = e2e_cli.main(["check", "--config", "cpu", "--steps", "1", "--baseline", "--quiet", "--json", str(out)])
    assert rc == 0  # with --baseline, success means: a difference WAS observed
    doc = json.loads(out.read_text())
    assert doc["mode"] == "baseline" and doc["reports"][0]["tokens_differ"] > 0
    assert doc["baseline_choice"]


def test_check_fails_closed_when_a_step_differs(tmp_path, monkeypatch):
    from zerodiff.model import ops as zops

    orig = zops.ConsistentOps.kernel_logprobs

    def skewed(self, logits, ids):  # the training side (tape active or not) returns a shifted log-prob
        lp = orig(self, logits, ids)
        return lp if not getattr(self, "_skew", False) else lp + 2.0 ** -20

    monkeypatch.setattr(zops.ConsistentOps, "kernel_logprobs", skewed)
    from zerodiff.training import forward as tfwd

    orig_init = tfwd.TrainingForward.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        self.ops._skew = True

    monkeypatch.setattr(tfwd.TrainingForward, "__init__", init)
    out = tmp_path / "fail.json"
    rc = e2e_cli.main(["check", "--config", "cpu", "--steps", "2", "--quiet", "--json", str(out)])
    assert rc == 1
    doc = json.loads(out.read_text())
    assert not doc["passed"] and doc["failure"] and "differ" in doc["failure"]["message"]


def test_cli_restores_thread_count():
    n = torch.get_num_threads()
    e2e_cli.main(["check", "--config", "cpu", "--steps", "1", "--quiet"])
    assert torch.get_num_threads() == n


def test_bench_cpu_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = e2e_cli.main(["bench", "--config", "cpu", "--prompts", "3", "--max-batch", "2,6", "--steps", "3",
                       "--warmup", "0", "--profile-steps", "0", "--quiet", "--json", str(out),
                       "--png", str(tmp_path / "b.png")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 3
    for r in doc["rows"]:
        assert r["consistent_probs_diff_max"] == 0.0 and r["baseline_tokens_differ"] > 0
    # the verdict is the median of the per-step ratios (a one-off compile in one step must not decide it)
    import statistics

    assert doc["ratio"] == statistics.median(r["ratio"] for r in doc["rows"]) and doc["baseline_choice"]
    assert doc["consistent_tok_per_s"] == statistics.median(r["consistent_tok_per_s"] for r in doc["rows"])
    assert set(doc["pooled_tok_per_s"]) == {"consistent", "baseline"} and "median" in doc["statistic"]
    # the GPU-side split needs CUDA events: absent on the CPU, never a crash
    assert doc["forward_device_ratio"] is None and "consistent_forward_device_s" not in doc["rows"][0]
    txt = capsys.readouterr().out
    assert ("wrote" in txt) or ("PNG skipped" in txt)


def test_check_time_budget_stops_cleanly_and_keeps_results(tmp_path, monkeypatch, capsys):
    """--time-budget: the run stops before a step that would end past the budget; the steps that ran are
    reported, written to JSON and decide the verdict (here: 2 steps ran, diff = 0 -> exit 0)."""
    calls = []

    def over(args, t0, last_s):
        calls.append(last_s)
        return len(calls) > 2  # the budget "runs out" after the second step

    monkeypatch.setattr(e2e_cli, "_over_budget", over)
    out = tmp_path / "check.json"
    rc = e2e_cli.main(["check", "--config", "cpu", "--steps", "50", "--time-budget", "100", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["steps_run"] == 2 and doc["stopped_by_time_budget"] and doc["passed"] and doc["steps"] == 50
    assert calls[1] == 0  # step 0 (JIT compilations) does not predict the next step
    assert calls[2] > 0  # later estimates use the last step's duration
    text = capsys.readouterr().out
    assert "stopping cleanly after 2 of 50 steps" in text and "time budget reached: 2 of 50 requested" in text


def test_check_time_budget_exhausted_before_any_step_fails(tmp_path):
    out = tmp_path / "check.json"
    rc = e2e_cli.main(["check", "--config", "cpu", "--steps", "3", "--time-budget", "0", "--quiet",
                       "--json", str(out)])
    assert rc == 1  # nothing was checked: never a pass
    doc = json.loads(out.read_text())
    assert doc["steps_run"] == 0 and doc["stopped_by_time_budget"] and doc["passed"] is False


def test_profile_compile_log_counts_per_kernel(monkeypatch):
    """The compile log wraps JITFunction._do_compile: each call is logged under the kernel's name, and a kernel
    compiled more than twice has its keys listed (the symptom of a per-shape recompilation)."""
    import types

    import pytest

    jit = pytest.importorskip("triton.runtime.jit")
    from zerodiff import profiling

    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda self, key, sig, dev, cx, *a, **k: "kernel", raising=False)

    class _Fn:
        def __init__(self, name):
            self.fn = types.SimpleNamespace(__name__=name)

    log = profiling._CompileLog()
    assert log.install()
    for i in range(3):
        assert jit.JITFunction._do_compile(_Fn("_k_rows"), i, None, 0, {"BLOCK": i}) == "kernel"
    jit.JITFunction._do_compile(_Fn("_k_once"), 0, None, 0, {})
    log.uninstall()
    rep = log.report()
    assert "Triton compilations: 4" in rep and "_k_rows" in rep and "{'BLOCK': 2}" in rep


def test_profile_flag_writes_report(tmp_path):
    prof = tmp_path / "prof.txt"
    rc = e2e_cli.main(["check", "--config", "cpu", "--steps", "1", "--quiet", "--profile", str(prof)])
    assert rc == 0
    text = prof.read_text()
    assert "Triton compilations" in text and "cProfile, top" in text and "forward_step" in text


def test_mhc_variant_option_is_validated_and_recorded(tmp_path, monkeypatch):
    from zerodiff.model import ops as model_ops
    from zerodiff.ops import mhc

    shipped = model_ops.mhc_pre
    monkeypatch.setattr(model_ops, "mhc_pre", shipped)  # the option rebinds it for the process: undone after
    import pytest

    with pytest.raises(SystemExit, match="not one of"):
        e2e_cli.main(["check", "--config", "cpu", "--steps", "1", "--quiet", "--mhc-variant", "fp32_s7"])
    assert model_ops.mhc_pre is shipped is mhc.mhc_pre
    out = tmp_path / "c.json"
    assert e2e_cli.main(["check", "--config", "cpu", "--steps", "1", "--quiet", "--mhc-variant", "ieee_s112",
                         "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kernel_variants"]["mhc"] == "ieee_s112"
    assert doc["kernel_variants"]["mhc_head"] == mhc.DEFAULT_HEAD_VARIANT  # the model has no hc_head call
    assert model_ops.mhc_pre.keywords == {"variant": "ieee_s112"}  # both sides run the variant's mhc_pre
    assert mhc.mhc_pre is not model_ops.mhc_pre  # the shipped module itself is left alone
    assert doc["reports"][0]["bitwise_equal"]
