"""zerodiff vllm-check: the plan, the comparisons and the orchestration (engine subprocesses), on CPU with a
fake engine that keeps (or breaks) batch invariance on purpose."""

import json
import os
import struct
import sys

import pytest

from zerodiff import vllm_check as vc

FAKE = "fake_vllm_engine:FakeEngine"


def _ckpt(tmp_path, vocab=4096):
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return str(d)


def test_plan_is_deterministic_and_places_the_victim():
    a = vc.make_victim_plan(4096, seed=3, concurrency=[1, 2, 7])
    b = vc.make_victim_plan(4096, seed=3, concurrency=[1, 2, 7])
    assert a["victim"] == b["victim"] and [c["requests"] for c in a["cases"]] == [c["requests"] for c in b["cases"]]
    assert a["cases"][0]["name"] == "alone"
    for c in a["cases"]:
        assert len(c["requests"]) == c["others"] + 1
        assert c["requests"][c["victim_index"]] == a["victim"]
    idx = {c["victim_index"] for c in a["cases"] if c["others"] == 7}
    assert idx == {0, 4, 7}  # first, middle, last
    assert vc.make_victim_plan(4096, seed=4, concurrency=[1])["victim"] != a["victim"]
    with pytest.raises(ValueError, match="concurrency 0"):
        vc.make_victim_plan(4096, concurrency=[0])


def _next_f32(x):
    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] + 1))[0]


def test_count_mismatch_counts_bits_and_divergence():
    ref_t, ref_l = [5, 6, 7, 8], [-1.5, -2.25, -0.125, -3.0]
    assert vc.count_mismatch(ref_t, ref_l, ref_t, list(ref_l)) == 0
    assert vc.count_mismatch(ref_t, ref_l, ref_t, [-1.5, _next_f32(-2.25), -0.125, -3.0]) == 1  # one ulp
    assert vc.count_mismatch(ref_t, ref_l, [5, 9, 7, 8], ref_l) == 3                       # divergence at 1
    assert vc.count_mismatch(ref_t, ref_l, [5, 6], ref_l[:2]) == 2                           # missing tokens
    assert vc.count_mismatch(ref_t, ref_l, ref_t, [-1.5, -2.25, -0.0 + -0.125, -3.0]) == 0


def test_prefill_decode_mismatch_reads_the_tail():
    dec = {"tokens": [3, 4], "logprobs": [-1.0, -2.0]}
    good = {"name": "r", "prompt_logprobs": [None, -9.0, -1.0, -2.0]}
    bad = {"name": "r", "prompt_logprobs": [None, -9.0, -1.0, _next_f32(-2.0)]}
    assert vc.prefill_decode_mismatch(dec, [good])[0] == 0
    assert vc.prefill_decode_mismatch(dec, [bad])[0] == 1


def test_verdict_needs_zero_and_a_differing_control():
    base = dict(victim_mismatch=0, prefill_decode_mismatch=0, graph_eager_mismatch=0,
                stock_victim_mismatch=5, stock_prefill_decode_mismatch=2)
    assert vc.acceptance_verdict(base) == (True, [])
    assert not vc.acceptance_verdict(dict(base, victim_mismatch=1))[0]
    assert not vc.acceptance_verdict(dict(base, stock_victim_mismatch=0))[0]
    missing = dict(base)
    del missing["graph_eager_mismatch"]
    ok, why = vc.acceptance_verdict(missing)
    assert not ok and "graph_eager_mismatch: not measured" in why[0]


def _run(tmp_path, monkeypatch, *extra):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    out = tmp_path / "acc.json"
    rc = vc.main(["--checkpoint", _ckpt(tmp_path), "--concurrency", "1,2,7", "--victim-tokens", "6",
                  "--engine-factory", FAKE, "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_orchestration_passes_with_an_invariant_engine(tmp_path, monkeypatch):
    monkeypatch.delenv("FAKE_VLLM_LEAK", raising=False)
    rc, doc = _run(tmp_path, monkeypatch)
    assert rc == 0, doc.get("why")
    for k in ("engine", "vllm_version", "torch", "device", "date", "checkpoint_preset", "concurrency",
              "requests", "victim_tokens", "victim_mismatch", "prefill_decode_mismatch", "graph_eager_mismatch",
              "stock_victim_mismatch", "stock_prefill_decode_mismatch"):
        assert k in doc, k
    assert doc["victim_mismatch"] == doc["prefill_decode_mismatch"] == doc["graph_eager_mismatch"] == 0
    assert doc["stock_victim_mismatch"] > 0 and doc["stock_prefill_decode_mismatch"] > 0
    assert doc["concurrency"] == [1, 2, 7] and doc["victim_tokens"] == 6
    assert doc["consistent_config"]["consistent"] is True and doc["stock_config"]["consistent"] is False


@pytest.mark.parametrize("leak,field", [("prefill", "prefill_decode_mismatch"), ("eager", "graph_eager_mismatch")])
def test_orchestration_catches_a_leak(tmp_path, monkeypatch, leak, field):
    monkeypatch.setenv("FAKE_VLLM_LEAK", leak)
    rc, doc = _run(tmp_path, monkeypatch)
    assert rc == 1 and doc[field] > 0 and not doc["passed"]


def test_orchestration_bench_and_failed_engine(tmp_path, monkeypatch):
    monkeypatch.delenv("FAKE_VLLM_LEAK", raising=False)
    rc, doc = _run(tmp_path, monkeypatch, "--sides", "consistent", "--bench", "--bench-concurrency", "2,3",
                   "--bench-prompt", "4,8", "--bench-output", "2,4", "--bench-repeats", "2")
    assert rc == 1  # stock control not run
    rows = doc["bench"]["rows"]
    assert [r["concurrency"] for r in rows] == [2, 3]
    assert rows[0]["ratio"]["n"] == 2 and "top_kernels" in doc["bench"]
    rc = vc.main(["--checkpoint", str(tmp_path / "ckpt"),
                  "--sides", "stock", "--engine-factory", "no_such_module:Engine", "--concurrency", "1",
                  "--json", str(tmp_path / "f.json")])
    doc = json.loads((tmp_path / "f.json").read_text())
    assert rc == 1 and "stock" in doc["errors"] and "failed to start" in doc["errors"]["stock"]


def test_bad_arguments_are_named(tmp_path, capsys):
    assert vc.main(["--checkpoint", str(tmp_path), "--concurrency", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert vc.main(["--checkpoint", _ckpt(tmp_path), "--sides", "consistent,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vc.main(["--concurrency", "1,x"])


def test_results_are_written_before_the_engine_is_stopped(tmp_path, monkeypatch):
    """A run cut off while an engine shuts down (a killed job, a stuck teardown) keeps that engine's results."""
    monkeypatch.delenv("FAKE_VLLM_LEAK", raising=False)
    seen, real_stop = {}, vc.Worker.stop

    def stuck_stop(self):
        seen[self.name] = json.loads((tmp_path / "acc.json").read_text())
        real_stop(self)
        raise RuntimeError(f"{self.name}: teardown stuck")

    monkeypatch.setattr(vc.Worker, "stop", stuck_stop)
    rc, doc = _run(tmp_path, monkeypatch, "--sides", "consistent,stock")
    assert rc == 1
    assert seen["consistent"]["victim_mismatch"] == 0 and "prefill_decode_mismatch" in seen["consistent"]
    assert seen["stock"]["stock_victim_mismatch"] > 0
    assert "teardown stuck" in doc["errors"]["consistent"]


def test_resume_runs_only_the_missing_engines_and_merges(tmp_path, monkeypatch):
    """A run split over two commands (consistent + stock, then eager) gives the verdict of one run."""
    monkeypatch.delenv("FAKE_VLLM_LEAK", raising=False)
    started = []
    real_init = vc.Worker.__init__

    def counting_init(self, name, *a, **kw):
        started.append(name)
        real_init(self, name, *a, **kw)

    monkeypatch.setattr(vc.Worker, "__init__", counting_init)
    rc, first = _run(tmp_path, monkeypatch, "--sides", "consistent,stock")
    assert rc == 1 and "graph_eager_mismatch" not in first and set(first["side_results"]) == {"consistent", "stock"}
    first_path = tmp_path / "first.json"
    first_path.write_text(json.dumps(first))
    started.clear()
    rc, doc = _run(tmp_path, monkeypatch, "--resume", str(first_path))
    assert started == ["consistent_eager"]
    assert rc == 0, doc.get("why")
    assert doc["graph_eager_mismatch"] == 0 and doc["victim_mismatch"] == 0 and doc["stock_victim_mismatch"] > 0
    assert doc["resumed_from"]["sides"] == ["consistent", "stock"]


def test_resume_refuses_another_plan_and_a_bad_file(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FAKE_VLLM_LEAK", raising=False)
    rc, first = _run(tmp_path, monkeypatch, "--sides", "consistent")
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps(first))
    rc = vc.main(["--checkpoint", _ckpt(tmp_path), "--concurrency", "1,2", "--victim-tokens", "6",
                  "--engine-factory", FAKE, "--resume", str(prev)])
    assert rc == 2 and "other requests" in capsys.readouterr().err
    prev.write_text("{not json")
    rc = vc.main(["--checkpoint", _ckpt(tmp_path), "--concurrency", "1,2,7", "--victim-tokens", "6",
                  "--engine-factory", FAKE, "--resume", str(prev)])
    assert rc == 2 and "cannot read" in capsys.readouterr().err


def test_main_with_an_empty_argument_list_does_not_read_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["zerodiff", "--sides", "bogus"])
    monkeypatch.setattr(vc, "cmd_vllm_check", lambda args: 7)
    assert vc.main([]) == 7  # the defaults, not sys.argv's bad --sides (which would return 2)


def test_a_bench_stream_longer_than_max_model_len_is_refused(tmp_path, capsys):
    rc = vc.main(["--checkpoint", _ckpt(tmp_path), "--bench", "--bench-prompt", "1024,2048",
                  "--bench-output", "512,1024", "--max-model-len", "2048"])
    err = capsys.readouterr().err
    assert rc == 2 and "--max-model-len 2048" in err and "3070 tokens" in err


@pytest.mark.parametrize("choice,expected", [(None, "skip"), ("full", "full"), ("vllm", None)])
def test_the_stock_deep_gemm_warmup_is_set_and_recorded(tmp_path, monkeypatch, choice, expected):
    monkeypatch.delenv("FAKE_VLLM_LEAK", raising=False)
    extra = ["--sides", "stock"] + (["--stock-deep-gemm-warmup", choice] if choice else [])
    _, doc = _run(tmp_path, monkeypatch, *extra)
    assert doc["stock_config"]["env"].get("VLLM_DEEP_GEMM_WARMUP") == expected
    assert vc.side_env(True, "triton", "full")["VLLM_DEEP_GEMM_WARMUP"] == "skip"  # consistent side: always skip


def _vllm_on_gpu() -> str | None:
    """Why the engine-level test cannot run here, or None."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM 0.33.0 with the zerodiff series applied (or gpu/in-runtime.sh)"
    if os.environ.get("ZERODIFF_SKIP_ENGINE_TESTS") == "1":
        return "ZERODIFF_SKIP_ENGINE_TESTS=1"
    return None


@pytest.mark.gpu
def test_gpu_engine_level_acceptance_in_real_vllm(tmp_path):
    """The engine-level acceptance on a real patched vLLM: victim in batch, prefill == decode, graphs == eager all
    0, the stock engine differing. Three engine starts: about 12 minutes from cold JIT caches on an H200."""
    why = _vllm_on_gpu()
    if why:
        pytest.skip(why)
    out = tmp_path / "vllm-acceptance.json"
    rc = vc.main(["--workdir", str(tmp_path / "work"), "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, doc.get("why")
    assert doc["victim_mismatch"] == doc["prefill_decode_mismatch"] == doc["graph_eager_mismatch"] == 0
    assert doc["stock_victim_mismatch"] > 0 and doc["stock_prefill_decode_mismatch"] > 0
