"""``zerodiff check`` / ``zerodiff bench`` on the CPU config (issue 6): exit codes and JSON."""

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

    orig = zops.ConsistentOps.k_logprobs

    def skewed(self, logits, ids):  # the training side (tape active or not) returns a shifted log-prob
        lp = orig(self, logits, ids)
        return lp if not getattr(self, "_skew", False) else lp + 2.0 ** -20

    monkeypatch.setattr(zops.ConsistentOps, "k_logprobs", skewed)
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
    rc = e2e_cli.main(["bench", "--config", "cpu", "--steps", "1", "--warmup", "0", "--quiet", "--json", str(out),
                       "--png", str(tmp_path / "b.png")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["rows"][0]["consistent_probs_diff_max"] == 0.0
    assert doc["rows"][0]["baseline_tokens_differ"] > 0
    assert doc["ratio"] > 0 and doc["baseline_choice"]
    txt = capsys.readouterr().out
    assert ("wrote" in txt) or ("PNG skipped" in txt)


def test_check_time_budget_stops_cleanly_and_keeps_results(tmp_path, monkeypatch, capsys):
    """--time-budget: the run stops before a step that would end past the budget; the steps that ran are
    reported, written to JSON and decide the verdict (here: 1 step ran, diff = 0 -> exit 0)."""
    calls = []

    def over(args, t0, last_s):
        calls.append(last_s)
        return len(calls) > 1  # the budget "runs out" after the first step

    monkeypatch.setattr(e2e_cli, "_over_budget", over)
    out = tmp_path / "check.json"
    rc = e2e_cli.main(["check", "--config", "cpu", "--steps", "50", "--time-budget", "100", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["steps_run"] == 1 and doc["stopped_by_time_budget"] and doc["passed"] and doc["steps"] == 50
    assert calls[1] > 0  # the estimate uses the last step's duration
    text = capsys.readouterr().out
    assert "stopping cleanly after 1 of 50 steps" in text and "time budget reached: 1 of 50 requested" in text


def test_check_time_budget_exhausted_before_any_step_fails(tmp_path):
    out = tmp_path / "check.json"
    rc = e2e_cli.main(["check", "--config", "cpu", "--steps", "3", "--time-budget", "0", "--quiet",
                       "--json", str(out)])
    assert rc == 1  # nothing was checked: never a pass
    doc = json.loads(out.read_text())
    assert doc["steps_run"] == 0 and doc["stopped_by_time_budget"] and doc["passed"] is False
