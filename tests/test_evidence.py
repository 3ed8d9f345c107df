"""The evidence commands on the CPU config: the confound-free negative control (``check --baseline``), several
seeds (``check --seeds``), real packing on the training side (``check --train-packing``) and the op-level
divergence locator (``zerodiff locate``)."""

from __future__ import annotations

import json

import pytest

from e2e_helpers import cli_json
from zerodiff import e2e_cli
from zerodiff.model import ops as zops
from zerodiff.model.weights import param_shapes
from zerodiff.rl.control import control_probe
from zerodiff.rl.locate import locate
from zerodiff.rl.loop import RLRun
from zerodiff.training.forward import pack


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- negative control -------------------------------------------------------------------------------------------
def test_check_baseline_runs_the_same_stock_ops_on_both_sides(tmp_path):
    rc, doc = cli_json(tmp_path / "base.json", "check", "--config", "cpu", "--steps", "1", "--baseline", "--quiet")
    assert rc == 0
    assert doc["ops"] == {"rollout": "BaselineRolloutOps", "train": "BaselineRolloutOps"}
    (probe,) = doc["control_probe"]
    assert probe["weights_bitwise_equal"] and probe["same_inputs"]["equal"]  # no precision / weight confound
    assert not (probe["batch"]["equal"] and probe["phase"]["equal"])  # the stock kernels' batch / phase dependence
    assert doc["reports"][0]["tokens_differ"] > 0


def test_the_probe_separates_the_control_from_the_mixed_pairing():
    """The stock inference ops paired with training-style ones differ even on equal inputs (precision, not batch):
    that pairing is confounded; the consistent ops are equal in all three probes."""
    mixed = control_probe(RLRun("cpu", 0, "baseline_mixed"))
    assert not mixed["same_inputs"]["equal"]
    cons = control_probe(RLRun("cpu", 0, "consistent"))
    assert cons["same_inputs"]["equal"] and cons["batch"]["equal"] and cons["phase"]["equal"], cons


def test_check_baseline_fails_closed_when_the_sides_are_confounded(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(zops.MODES, "baseline", (zops.BaselineRolloutOps, zops.BaselineTrainOps))
    rc, doc = cli_json(tmp_path / "conf.json", "check", "--config", "cpu", "--steps", "1", "--baseline", "--quiet")
    assert rc == 1 and "CONFOUNDED" in capsys.readouterr().out
    assert not doc["passed"]


# ---- seeds and packing ------------------------------------------------------------------------------------------
def test_check_several_seeds(tmp_path):
    rc, doc = cli_json(tmp_path / "seeds.json", "check", "--config", "cpu", "--steps", "1", "--seeds", "2",
                       "--seed", "4", "--quiet")
    assert rc == 0
    assert doc["seeds"] == [4, 5] and [s["seed"] for s in doc["per_seed"]] == [4, 5]
    assert [r["seed"] for r in doc["reports"]] == [4, 5] and all(r["bitwise_equal"] for r in doc["reports"])
    assert all(s["steps_diff_zero"] == 1 and s["tokens"] > 0 for s in doc["per_seed"])


def test_check_train_packing_all_sequences_in_one_micro_batch(tmp_path):
    rc, doc = cli_json(tmp_path / "pack.json", "check", "--config", "cpu", "--steps", "1", "--train-packing", "all",
                       "--quiet")
    assert rc == 0
    (rep,) = doc["reports"]
    assert doc["train_packing"]["mode"] == "all" and rep["bitwise_equal"]
    n_seqs = 8 * 2  # prompts_per_step x responses_per_prompt of the cpu preset
    assert rep["train_micro_batches"] == 1 and rep["train_seqs_per_micro"] == [n_seqs]
    assert rep["train_tokens_per_micro"][0] > 8 * doc["reports"][0]["tokens"] // n_seqs  # prompts + responses


def test_packing_modes():
    p = e2e_cli._packed_preset("cpu", "none")
    seqs = [(i, [1] * 10, [2] * 5) for i in range(5)]
    assert [len(m) for m in pack(seqs, p.train.micro_tokens, 0)] == [1] * 5
    q = e2e_cli._packed_preset("cpu", "greedy", micro_tokens=30)
    assert [len(m) for m in pack(seqs, q.train.micro_tokens, 0)] == [2, 2, 1]
    with pytest.raises(SystemExit):
        e2e_cli._packed_preset("cpu", "bogus")


# ---- locate -----------------------------------------------------------------------------------------------------
def test_locate_on_consistent_kernels_reports_none_and_names_ops_after_the_model():
    res = locate(RLRun("cpu", 0, "consistent"))
    assert res["divergence"] is None and res["logprobs"]["bitwise_equal"] and not res["ops_missing_on_train_side"]
    names = set(res["op_names"])
    # every op reading one weight is named after it; the MoE block (4 expert weights) is `moe`, the routing `route`
    weights = {k for k in param_shapes(RLRun("cpu", 0).cfg)
               if not k.endswith(("_hc_scale", "_hc_base", "gate_bias", "exp_w13", "exp_w2", "sh_w13", "sh_w2"))}
    hc = {k for k in weights if k.endswith("_hc_fn")}
    assert weights - hc <= names
    assert {k[: -len("_fn")] + "_pre" for k in hc} <= names  # ... mHC pre after its parameters
    for l in range(2):
        assert {f"layers.{l}.{n}" for n in ("q_rope", "k_rope", "dsa_topk", "attention", "attn_hc_post", "route",
                                            "route:ids", "moe", "ffn_hc_post")} <= names


def test_locate_reports_exactly_a_monkeypatched_op():
    run = RLRun("cpu", 0, "consistent")
    tops = run.trainer.ops
    orig = tops.rms_norm

    def skewed(x, w):  # the training side's RMSNorm of layer 1's KV latent, one element nudged
        v = orig(x, w)
        if w.name == "layers.1.kv_norm":
            v = v.clone()
            v[:, 3] = (v[:, 3].float() * (1 + 2 ** -7)).to(v.dtype)
        return v

    tops.rms_norm = skewed
    div = locate(run)["divergence"]
    assert div["op"] == "layers.1.kv_norm" and div["layer"] == 1 and div["coordinate"] == [3], div
    assert div["max_abs_diff"] > 0 and div["tokens_differ"] > 0
    # a kernel-level patch (the router GEMM of every layer) is found where it first acts
    del tops.rms_norm
    k_orig = tops.kernel_router
    tops.kernel_router = lambda x, w: k_orig(x, w) * (1 + 2 ** -20)
    div = locate(run)["divergence"]
    assert div["op"] == "layers.0.gate" and div["layer"] == 0, div


def test_locate_cli_plant_and_baseline(tmp_path, capsys):
    out = tmp_path / "plant.json"
    rc, doc = cli_json(out, "locate", "--config", "cpu", "--plant-divergence", "layers.0.attn_hc_pre:comb")
    assert rc == 0 and doc["planted_found"] and doc["divergence"]["op"] == "layers.0.attn_hc_pre:comb"
    assert json.loads(capsys.readouterr().out)["divergence"]["op"] == "layers.0.attn_hc_pre:comb"  # JSON on stdout
    rc, doc = cli_json(out, "locate", "--config", "cpu", "--baseline", "--prompts", "4")
    assert rc == 1 and doc["mode"] == "baseline" and doc["divergence"]["op"] in doc["op_names"]
    assert doc["divergence"]["ops_before_equal"] == doc["op_names"].index(doc["divergence"]["op"])
    assert e2e_cli.main(["locate", "--config", "cpu", "--plant-divergence", "no.such.op"]) == 2
