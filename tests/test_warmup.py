"""``zerodiff warmup`` (DeepGEMM JIT cache filling): the plan covers every shape and M exactly once."""

from __future__ import annotations

import torch

from zerodiff import warmup
from zerodiff.model.config import preset


def test_dense_shapes_are_the_models_fp8_matrices():
    # the eight (N, K) that `zerodiff check --config h200 --profile` showed DeepGEMM compiling on the H200
    seen_on_h200 = {(1024, 2048), (36864, 1024), (576, 2048), (8192, 1024), (128, 2048), (2048, 32768),
                    (2048, 2048), (2048, 1024)}
    assert set(warmup.dense_shapes(preset("h200").model)) == seen_on_h200
    assert warmup.grouped_shapes(preset("h200").model) == [(32, 2048, 2048), (32, 2048, 1024)]


def test_split_ranges_partition_contiguously():
    vals = list(range(1, 8193))
    parts = warmup.split_ranges(vals, 24)
    assert sum(len(p) for p in parts) == len(vals) and sorted(v for p in parts for v in p) == vals
    for a, b in zip(parts, parts[1:]):
        assert a[-1] + 1 == b[0]  # contiguous, ascending
    assert len(parts[0]) < len(parts[-1])  # narrower at small M (configurations change fastest there)
    assert warmup.split_ranges([5], 8) == [[5]]


def test_plan_covers_every_shape_and_m_once():
    tasks = warmup.plan([preset("h200"), preset("gpu_small")], None, 16, baseline=True)
    h200 = set(warmup.dense_shapes(preset("h200").model))
    small = set(warmup.dense_shapes(preset("gpu_small").model))
    per = {}
    for t in tasks:
        per.setdefault((t["kind"], tuple(t["shape"])), []).extend(t["ms"])
        assert t["ms"] == list(range(t["ms"][0], t["ms"][-1] + 1, t["ms"][1] - t["ms"][0] if len(t["ms"]) > 1 else 1))
    assert {s for k, s in per if k == "dense"} == h200 | small
    for (kind, shape), ms in per.items():
        assert len(ms) == len(set(ms))  # every M once per shape
        if kind == "dense":
            top = 8192 if shape in h200 else 2048  # max(token budget, micro-batch) of the preset(s) using it
            assert sorted(ms) == list(range(1, top + 1)), shape
        else:
            e = shape[0]
            top = 8192 * 6 + 32 * 128 if e == 32 else 2048 * 2 + 8 * 128
            assert sorted(ms) == list(range(128, top + 1, 128)), shape
    assert len(tasks) >= 3 * 16 * 0.9  # about three tasks per worker
    assert tasks[0]["shape"] != tasks[1]["shape"]  # shapes interleaved
    assert not any(t["kind"] == "grouped" for t in warmup.plan([preset("h200")], 64, 4, baseline=False))


def test_warmup_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        return
    from zerodiff import e2e_cli

    assert e2e_cli.main(["warmup", "--config", "h200"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_task_calls_every_m_and_reports_errors(monkeypatch):
    """A task with a stand-in DeepGEMM on the CPU: one call per M, operand shapes as DeepGEMM takes them; a
    failing call is reported (not raised)."""
    calls = []

    class FakeDG:
        def fp8_gemm_nt(self, a, w, out, disable_ue8m0_cast):
            (aq, as_), (wq, ws) = a, w
            assert aq.dtype == torch.float8_e4m3fn and aq.shape[0] == out.shape[0]
            assert as_.shape == (aq.shape[0], aq.shape[1] // 128)
            assert ws.shape == (-(-wq.shape[0] // 128), wq.shape[1] // 128) and out.shape[1] == wq.shape[0]
            if wq.shape[0] == 384 and aq.shape[0] == 2:
                raise RuntimeError("unsupported")
            calls.append(("dense", wq.shape[0], aq.shape[0]))

        def m_grouped_fp8_gemm_nt_contiguous(self, a, w, out, idx, disable_ue8m0_cast):
            assert idx.shape[0] == a[0].shape[0] == out.shape[0] and w[1].shape == (4, 2, 1)
            calls.append(("grouped", w[0].shape[1], a[0].shape[0]))

    import zerodiff.backends as be

    monkeypatch.setattr(be, "deep_gemm", lambda: FakeDG())
    ok = warmup.run_task({"kind": "dense", "shape": [256, 128], "ms": [1, 2, 3], "name": "d", "device": "cpu"})
    assert ok["calls"] == 3 and not ok["errors"]
    bad = warmup.run_task({"kind": "dense", "shape": [384, 256], "ms": [1, 2, 3], "name": "b", "device": "cpu"})
    assert bad["calls"] == 1 and "unsupported" in bad["errors"][0]
    g = warmup.run_task({"kind": "grouped", "shape": [4, 256, 128], "ms": [128, 256], "align": 128, "name": "g",
                         "device": "cpu"})
    assert g["calls"] == 2 and not g["errors"]
    assert calls == [("dense", 256, 1), ("dense", 256, 2), ("dense", 256, 3), ("dense", 384, 1),
                     ("grouped", 256, 128), ("grouped", 256, 256)]


def test_pool_reports_every_task_and_never_hangs(monkeypatch, capsys):
    """The process pool end to end on a machine without DeepGEMM: every task comes back with its problem
    (exit 1), within the timeout."""
    import argparse

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = argparse.Namespace(config=["gpu_small"], jobs=2, max_m=32, no_baseline=True, timeout=120)
    assert warmup.run(args) == 1
    out = capsys.readouterr().out
    n = len(warmup.plan([preset("gpu_small")], 32, 2, baseline=False))
    assert f"{n}/{n} tasks" in out and f"{n} problem(s)" in out and "DeepGEMM is not importable" in out


def test_doctor_reports_the_deepgemm_jit_cache(tmp_path, monkeypatch):
    from zerodiff import doctor

    for i in range(3):
        (tmp_path / "cache" / f"kernel{i}").mkdir(parents=True)
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    info = doctor.collect()["deepgemm_jit_cache"]
    assert info == {"path": str(tmp_path), "kernels": 3, "from_env": True}
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "missing"))
    assert doctor.collect()["deepgemm_jit_cache"]["kernels"] == 0
    r = doctor.collect()
    r["backends"] = dict(r["backends"], deepgemm={"available": True, "detail": "test"})
    assert "JIT cache" in doctor.render(r) and "zerodiff warmup" in doctor.render(r)


def test_doctor_reports_the_triton_cache_and_kernel_configuration(tmp_path, monkeypatch):
    from zerodiff import doctor
    from zerodiff.ops import mhc, topk

    for i, files in enumerate((["k.cubin", "k.json"], ["k.json"], ["k.cubin"])):
        d = tmp_path / f"key{i}"
        d.mkdir()
        for f in files:
            (d / f).write_text("x")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    r = doctor.collect()
    assert r["triton_cache"] == {"path": str(tmp_path), "kernels": 2, "from_env": True}  # entries with a binary
    from zerodiff.ops.attention import flashmla_fp8 as fd

    assert r["kernel_configuration"] == {"mhc": mhc.DEFAULT_VARIANT, "mhc_head": mhc.DEFAULT_HEAD_VARIANT,
                                         "topk": topk.VARIANT,
                                         "attention_read": "flashmla_fp8 where supported, else workspace",
                                         "attention_pieces": fd.PIECES_PER_ROW}
    text = doctor.render(r)
    assert f"mHC {mhc.DEFAULT_VARIANT}" in text and f"DSA Top-K {topk.VARIANT}" in text
    import torch

    if not torch.cuda.is_available():  # the read path says why it cannot run on a CPU machine
        assert r["flashmla_fp8"]["usable"] is False and "no CUDA device" in r["flashmla_fp8"]["detail"]
        assert "flashmla_fp8 usable here: no" in text
    if r["triton"]["available"]:
        assert "2 compiled kernel(s)" in text
