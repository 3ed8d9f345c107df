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
