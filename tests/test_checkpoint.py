"""zerodiff.checkpoint: seeded DeepSeek-V4 checkpoints in the released FP8 layout, the safetensors reader and
writer, and ``zerodiff make-checkpoint``.

What the recorded layout ``tests/data/checkpoint_vllm_layout.json`` is and what it was checked against
-------------------------------------------------------------------------------------------------------
It was written once from ``checkpoint_layout(config_dict(preset))`` and ``config_dict(preset)`` for the
``tiny`` and ``mini`` presets (every tensor name, shape and dtype in file order, and the config.json), plus
``vllm_params``: the parameters of vLLM 0.33.0's ``DeepseekV4ForCausalLM`` each tensor is loaded into, as
``zerodiff.checkpoint.vllm_check.expected_params`` derives them, and the sha256 of the four files of
``tiny`` seed 0. Before it was recorded:

* the names, shapes and dtypes were loaded into vLLM 0.33.0's real NVIDIA ``DeepseekV4ForCausalLM`` on a
  CPU by ``python -m zerodiff.checkpoint.vllm_check`` (vLLM's config parsing, its default safetensors
  loader and ``load_weights``): every vLLM parameter loaded, every checkpoint tensor consumed, every loaded
  value equal to the checkpoint's;
* the names were cross-checked by reading vLLM 0.33.0's sdist (``make sources``,
  ``vllm/models/deepseek_v4/nvidia/model.py``, ``attention.py``, ``compressor.py``, ``quant_config.py``):
  the weights mapper for ``expert_dtype != "fp4"`` (prefixes ``layers.`` / ``embed.`` / ``norm.`` /
  ``hc_head`` -> ``model.``, ``.scale`` -> ``.weight_scale_inv``, ``head.weight`` -> ``lm_head.weight``,
  ``embed.weight`` -> ``embed_tokens.weight``, ``.ffn.gate.bias`` -> ``.ffn.gate.e_score_correction_bias``,
  ``.shared_experts.w2`` -> ``.shared_experts.down_proj``), the stacked parameters (``attn.wq_a`` +
  ``attn.wkv`` -> ``attn.fused_wqa_wkv``, ``compressor.wkv`` + ``compressor.wgate`` ->
  ``compressor.fused_wkv_wgate``, shared ``w1`` + ``w3`` -> ``gate_up_proj``), routed experts
  ``experts.{e}.w{1,2,3}`` -> stacked ``w13_`` / ``w2_``, which modules exist per layer (compressor iff the
  compress ratio ``max(1, compress_rates.get(layer_type, 0))`` is > 1, indexer iff it is 4, ``tid2eid`` iff
  the layer index is below ``mlp_layer_types.count("hash_moe")``, the router bias iff not hash-routed and
  ``topk_method == "noaux_tc"``), which linears are quantised (compressor ``fused_wkv_wgate``, indexer
  ``weights_proj``, the router gate, embedding and LM head are built without a quant config: BF16), and the
  shapes of the mHC, sink, compressor ``ape`` and projection parameters. :func:`test_names_follow_vllms_mapper`
  re-derives the vLLM names from those rules, independently of ``expected_params``.

A change to the layout must be a deliberate one: re-run the vLLM load check, then regenerate the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zerodiff.checkpoint import dsv4
from zerodiff.checkpoint import safetensors_io as st
from zerodiff.checkpoint.cli import main as cli_main
from zerodiff.checkpoint.vllm_check import expected_params

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((Path(__file__).parent / "data" / "checkpoint_vllm_layout.json").read_text())
FP8 = torch.float8_e4m3fn

# a small preset of the same kinds, for the tests that write several checkpoints (about 7 M parameters)
MICRO = dsv4.MINI.replace(name="micro", description="test-only: 2 layers, hidden 256, 8 heads, 4 experts",
                          vocab_size=256, hidden_size=256, num_attention_heads=8, index_n_heads=8,
                          n_routed_experts=4, num_experts_per_tok=2)


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _files(d: Path) -> dict:
    """relative path -> bytes of every file under d."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset, seed 0, with masters: (dir, config, checkpoint tensors, masters). Written once."""
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    summary = dsv4.make_checkpoint(d, "tiny", 0, masters=True)
    cfg, tensors = dsv4.read_checkpoint(d)
    return d, summary, cfg, tensors, dsv4.read_masters(d)


# ------------------------------------------------------------------------------------------------ determinism


def test_tiny_seed0_files_match_the_recorded_digests(tiny):
    """Same (preset, seed) -> the same bytes on every machine: tiny seed 0 is the checkpoint the recorded
    layout was checked with. A deliberate change to any value must bump GENERATOR_VERSION and re-record."""
    d, summary, *_ = tiny
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}
    assert got == RECORDED["presets"]["tiny"]["seed0_sha256"], (
        f"tiny seed 0 changed (GENERATOR_VERSION {dsv4.GENERATOR_VERSION}); if on purpose, re-run the vLLM "
        "load check and re-record tests/data/checkpoint_vllm_layout.json")
    assert summary.preset == "tiny" and summary.seed == 0
    assert summary.tensors == len(RECORDED["presets"]["tiny"]["tensors"])
    assert summary.checkpoint_bytes == sum(p.stat().st_size for p in d.glob("model-*.safetensors"))
    assert set(summary.files) == {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = dsv4.make_checkpoint(tmp_path / "a", MICRO, 7, masters=True, shard_bytes=2_000_000)
    dsv4.make_checkpoint(tmp_path / "b", MICRO, 7, masters=True, shard_bytes=2_000_000)
    dsv4.make_checkpoint(tmp_path / "c", MICRO, 8, masters=True, shard_bytes=2_000_000)
    fa, fb, fc = (_files(tmp_path / x) for x in "abc")
    assert len([k for k in fa if k.startswith("model-")]) > 1  # several shards
    assert fa == fb
    assert set(fa) == set(fc) and fa["config.json"] == fc["config.json"]
    assert all(fa[k] != fc[k] for k in fa if k.endswith(".safetensors"))
    # every tensor draws from the seed (hc_base's fixed pre/post parts aside, none is constant); power-of-two
    # scales of equally drawn blocks may well coincide
    _, ta = dsv4.read_checkpoint(tmp_path / "a")
    _, tc = dsv4.read_checkpoint(tmp_path / "c")
    for name, t in ta.items():
        if name.endswith(".scale"):
            continue
        assert not torch.equal(t.view(torch.uint8) if t.dtype == FP8 else t,
                               tc[name].view(torch.uint8) if t.dtype == FP8 else tc[name]), name
    assert a.parameters == sum(math.prod(m.shape) for m in dsv4.master_layout(dsv4.config_dict(MICRO)))


def test_masters_depend_on_seed_and_name_only(tiny):
    """No tensor depends on another tensor or on the generation order: a master of the same name and shape
    has the same bits in a different preset."""
    *_, masters = tiny
    micro = dsv4.generate_masters(MICRO, 0)
    same = [n for n, t in micro.items() if n in masters and masters[n].shape == t.shape]
    assert len(same) >= 8, same
    for n in same:
        assert torch.equal(masters[n], micro[n]), n
    again = dsv4.generate_masters(MICRO, 0)
    assert all(torch.equal(again[n], micro[n]) for n in micro)


# ------------------------------------------------------------------------------------------------ layout


@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_layout_and_config_equal_the_recorded_layout(name):
    rec = RECORDED["presets"][name]
    cfg = dsv4.config_dict(dsv4.preset(name))
    assert cfg == rec["config"]
    rows = dsv4.checkpoint_layout(cfg)
    assert [[n, list(s), _dt(d)] for n, s, d in rows] == rec["tensors"]
    meta = {n: torch.empty(s, dtype=d, device="meta") for n, s, d in rows}
    vp = expected_params(cfg, meta)
    assert [[n, list(t.shape), _dt(t.dtype)] for n, t in sorted(vp.items())] == rec["vllm_params"]


def test_files_hold_exactly_the_recorded_layout(tiny):
    d, _, cfg, tensors, _ = tiny
    rec = RECORDED["presets"]["tiny"]
    assert json.loads((d / "config.json").read_text()) == rec["config"] == cfg
    assert list(json.loads((d / "config.json").read_text())) == list(rec["config"])  # key order too
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    rows = []
    for s in shards:
        header, meta, _ = st.read_header(d / s)
        assert meta == {"format": "pt"}
        for n, e in header.items():
            assert index["weight_map"][n] == s
            rows.append([n, e["shape"], _dt(st._NAME_TO_DTYPE[e["dtype"]])])
    assert rows == rec["tensors"]
    assert list(index["weight_map"]) == [r[0] for r in rec["tensors"]]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert [[n, list(t.shape), _dt(t.dtype)] for n, t in tensors.items()] == rec["tensors"]


def _vllm_name(name: str) -> str:
    """Checkpoint name -> vLLM parameter name by the rules read from vLLM 0.33.0 (module docstring)."""
    for old, new in (("layers.", "model.layers."), ("embed.", "model.embed."), ("norm.", "model.norm."),
                     ("hc_head", "model.hc_head")):
        if name.startswith(old):
            name = new + name[len(old):]
            break
    name = re.sub(r"\.scale$", ".weight_scale_inv", name)
    for old, new in (("head.weight", "lm_head.weight"), ("embed.weight", "embed_tokens.weight"),
                     (".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")):
        if name.endswith(old):
            name = name[: -len(old)] + new
    name = name.replace(".shared_experts.w2", ".shared_experts.down_proj")
    m = re.fullmatch(r"(.*\.ffn\.experts)\.\d+\.w([123])\.(weight|weight_scale_inv)", name)
    if m:
        return f"{m[1]}.routed_experts.{'w2' if m[2] == '2' else 'w13'}_{m[3]}"
    for old, new in ((".shared_experts.w1.", ".shared_experts.gate_up_proj."),
                     (".shared_experts.w3.", ".shared_experts.gate_up_proj."),
                     ("attn.wq_a.", "attn.fused_wqa_wkv."), ("attn.wkv.", "attn.fused_wqa_wkv."),
                     ("compressor.wkv.", "compressor.fused_wkv_wgate."),
                     ("compressor.wgate.", "compressor.fused_wkv_wgate.")):
        if old in name:
            return name.replace(old, new)
    return name


@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_names_follow_vllms_mapper(name):
    rec = RECORDED["presets"][name]
    cfg = rec["config"]
    shapes = {n: (s, d) for n, s, d in rec["tensors"]}
    targets: dict = {}
    for n in shapes:
        targets.setdefault(_vllm_name(n), []).append(n)
    assert set(targets) == {n for n, _, _ in rec["vllm_params"]}
    for parts in targets.values():  # merged / stacked parts: same dtype and K; FP8 row counts block-aligned
        assert len({shapes[p][1] for p in parts}) == 1
        assert len({tuple(shapes[p][0][1:]) for p in parts}) == 1, parts
        if shapes[parts[0]][1] == "float8_e4m3fn" and len(parts) > 1 and ".experts." not in parts[0]:
            assert all(shapes[p][0][0] % dsv4.BLOCK == 0 for p in parts), parts
    # which modules exist, per layer, by vLLM's rules
    n_hash = cfg["mlp_layer_types"].count("hash_moe")
    for i, lt in enumerate(cfg["layer_types"]):
        ratio = max(1, cfg["compress_rates"].get(lt, 0))
        p = f"layers.{i}"
        assert (f"{p}.attn.compressor.ape" in shapes) == (ratio > 1)
        if ratio > 1:
            coff = 2 if ratio == 4 else 1
            assert shapes[f"{p}.attn.compressor.ape"] == ([ratio, coff * cfg["head_dim"]], "float32")
            assert shapes[f"{p}.attn.compressor.wkv.weight"] == ([coff * cfg["head_dim"], cfg["hidden_size"]],
                                                                 "bfloat16")
        assert (f"{p}.attn.indexer.wq_b.weight" in shapes) == (ratio == 4)
        if ratio == 4:
            assert shapes[f"{p}.attn.indexer.weights_proj.weight"][1] == "bfloat16"
            assert shapes[f"{p}.attn.indexer.compressor.ape"][0] == [4, 2 * cfg["index_head_dim"]]
        assert (f"{p}.ffn.gate.tid2eid" in shapes) == (i < n_hash)
        assert (f"{p}.ffn.gate.bias" in shapes) == (i >= n_hash and cfg["topk_method"] == "noaux_tc")
        assert shapes[f"{p}.ffn.gate.weight"][1] == "bfloat16"
        mix = (2 + cfg["hc_mult"]) * cfg["hc_mult"]
        assert shapes[f"{p}.hc_attn_fn"] == ([mix, cfg["hc_mult"] * cfg["hidden_size"]], "float32")
        assert shapes[f"{p}.attn.attn_sink"] == ([cfg["num_attention_heads"]], "float32")
        heads_dim = cfg["num_attention_heads"] * cfg["head_dim"]
        og = cfg["o_groups"]
        assert shapes[f"{p}.attn.wo_a.weight"][0] == [og * cfg["o_lora_rank"], heads_dim // og]
    for n in ("embed.weight", "head.weight"):
        assert shapes[n] == ([cfg["vocab_size"], cfg["hidden_size"]], "bfloat16")


# ------------------------------------------------------------------------------------------------ config.json


@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_config_has_what_vllm_reads(name):
    cfg = dsv4.config_dict(dsv4.preset(name))
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["model_type"] == "deepseek_v4"
    q = cfg["quantization_config"]
    assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3" and q["scale_fmt"] == "ue8m0"
    assert q["weight_block_size"] == [128, 128] and q["activation_scheme"] == "dynamic"
    assert cfg["expert_dtype"] == "fp8"  # block-FP8 experts with FP32 scales (not the MXFP4 release)
    n = cfg["num_hidden_layers"]
    assert len(cfg["layer_types"]) == len(cfg["mlp_layer_types"]) == n
    assert cfg["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    ratios = [cfg["compress_rates"].get(t, 0) for t in cfg["layer_types"]]
    assert set(cfg["layer_types"]) <= {"sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention"}
    n_hash = cfg["mlp_layer_types"].count("hash_moe")  # vLLM's num_hash_layers
    assert cfg["mlp_layer_types"] == ["hash_moe"] * n_hash + ["moe"] * (n - n_hash)
    assert 1 <= n_hash < n  # both MoE kinds
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sqrtsoftplus"
    assert cfg["num_nextn_predict_layers"] == 0 and cfg["tie_word_embeddings"] is False
    assert cfg["index_topk"] == 512 and cfg["num_key_value_heads"] == 1
    assert 0 < cfg["num_experts_per_tok"] <= cfg["n_routed_experts"]
    if name == "tiny":
        assert sorted(set(ratios)) == [0, 4, 128] and n_hash == 2
        assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"],
                cfg["qk_rope_head_dim"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]) == \
            (1024, 4096, 64, 512, 64, 16, 6)


def test_bad_presets_are_refused():
    with pytest.raises(dsv4.CheckpointError, match="unknown checkpoint preset 'huge'.*mini.*tiny"):
        dsv4.preset("huge")
    with pytest.raises(dsv4.CheckpointError, match="hash_moe layers must come first"):
        dsv4.config_dict(MICRO.replace(mlp_layer_types=("moe", "hash_moe")))
    with pytest.raises(dsv4.CheckpointError, match="hidden_size=200 must be a multiple of 128"):
        dsv4.config_dict(MICRO.replace(hidden_size=200))
    with pytest.raises(dsv4.CheckpointError, match="num_experts_per_tok"):
        dsv4.config_dict(MICRO.replace(num_experts_per_tok=9))


# ------------------------------------------------------------------------------------------------ FP8


def _pow2_ceil_scale(amax: np.ndarray) -> np.ndarray:
    """2**ceil(log2(fp32(amax / 448))), computed in float64 / frexp, independently of zerodiff."""
    s32 = (np.maximum(amax.astype(np.float64), 1e-10) / 448.0).astype(np.float32).astype(np.float64)
    m, e = np.frexp(s32)  # s32 = m * 2**e, m in [0.5, 1)
    return np.where(m == 0.5, s32, np.ldexp(1.0, e))


def test_fp8_weights_follow_the_deployment_rule(tiny):
    _, _, cfg, tensors, masters = tiny
    fp8 = [m for m in dsv4.master_layout(cfg) if m.fp8]
    assert {n for n, t in tensors.items() if t.dtype == FP8} == {m.name for m in fp8}
    for m in fp8:
        q, s, w = tensors[m.name], tensors[m.scale_name], masters[m.name]
        N, K = m.shape
        assert w.dtype == torch.bfloat16 and q.shape == (N, K) and s.dtype == torch.float32
        assert tuple(s.shape) == (-(-N // 128), -(-K // 128)) == m.scale_shape
        bits = s.view(torch.int32)
        assert bool((s > 0).all()) and bool(torch.isfinite(s).all()), m.name
        assert bool(((bits & 0x007FFFFF) == 0).all()), f"{m.name}: a scale is not a power of two"
        wb = w.float().view(N // 128, 128, K // 128, 128)
        amax = wb.abs().amax(dim=(1, 3))
        assert np.array_equal(s.double().numpy(), _pow2_ceil_scale(amax.numpy())), m.name
        # power-of-two scale: w / scale is exact in FP32, so e4m3(w / scale) is the code by the rule
        v = wb / s[:, None, :, None]
        assert float(v.abs().max()) <= 448.0
        assert torch.equal(q.view(torch.uint8), v.to(FP8).reshape(N, K).view(torch.uint8)), m.name
        # the largest code of every block lies in [224, 448] (the scale was rounded up, never down)
        qmax = q.float().view(N // 128, 128, K // 128, 128).abs().amax(dim=(1, 3))
        assert bool((qmax >= 224).all()) and bool((qmax <= 448).all()), m.name


def _one_of_each_kind(layout) -> list:
    """The first FP8 master of every kind (layer and expert indices ignored)."""
    seen, out = set(), []
    for m in layout:
        kind = re.sub(r"^layers\.\d+\.|\.\d+\.", ".", m.name)
        if m.fp8 and kind not in seen:
            seen.add(kind)
            out.append(m)
    return out


def test_dequantize_is_exact_and_close_to_the_master(tiny):
    """dequantize(q, scale) = FP32 e4m3 * scale, exact (4 significant bits times a power of two), within half
    an e4m3 step of the BF16 master (at most 16 * scale: the step is 32 for codes in [256, 448])."""
    _, _, cfg, tensors, masters = tiny
    for m in _one_of_each_kind(dsv4.master_layout(cfg)):
        q, s, w = tensors[m.name], tensors[m.scale_name], masters[m.name]
        N, K = m.shape
        wb = w.float().view(N // 128, 128, K // 128, 128)
        deq = dsv4.dequantize(q, s)
        assert deq.dtype == torch.float32
        exact = (q.double().view(N // 128, 128, K // 128, 128) * s.double()[:, None, :, None]).reshape(N, K)
        assert torch.equal(deq.double(), exact), m.name
        err = (deq.view(N // 128, 128, K // 128, 128) - wb).abs() / s[:, None, :, None]
        assert float(err.max()) <= 16.0, m.name


def test_fp8_matches_quant_weight_ue8m0(tiny):
    """The checkpoint's codes and scales are zerodiff.ops.fp8_quant.quant_weight(ue8m0=True)'s, bit for bit
    (one tensor of every kind; the rule itself is checked on every tensor above)."""
    from zerodiff.ops.fp8_quant import quant_weight

    _, _, cfg, tensors, masters = tiny
    kinds = _one_of_each_kind(dsv4.master_layout(cfg))
    for m in kinds:
        q, s = quant_weight(masters[m.name], block=128, ue8m0=True, backend="reference")
        assert torch.equal(q.view(torch.uint8), tensors[m.name].view(torch.uint8)), m.name
        assert torch.equal(s, tensors[m.scale_name]), m.name
    assert len(kinds) == 12, kinds  # wq_a wq_b wkv wo_a wo_b indexer.wq_b experts.w1-3 shared w1-3
    assert dsv4.SCALE_UE8M0 is True and dsv4.BLOCK == 128
    from zerodiff._triton import HAVE_TRITON

    if HAVE_TRITON:  # the Triton kernel (the GPU's requantisation path) too, on one small weight (interpreter)
        name = "layers.0.ffn.shared_experts.w2.weight"
        q, s = quant_weight(masters[name], block=128, ue8m0=True, backend="triton")
        assert torch.equal(q.view(torch.uint8), tensors[name].view(torch.uint8))
        assert torch.equal(s, tensors[name[: -len("weight")] + "scale"])


def test_everything_else_is_stored_as_its_master(tiny):
    _, _, cfg, tensors, masters = tiny
    layout = dsv4.master_layout(cfg)
    assert list(masters) == [m.name for m in layout]
    for m in layout:
        assert masters[m.name].dtype == m.dtype and tuple(masters[m.name].shape) == m.shape, m.name
        if not m.fp8:
            assert torch.equal(tensors[m.name], masters[m.name]), m.name
    kinds = {m.name.rsplit(".", 1)[-1] if "." in m.name else m.name: m.dtype for m in layout}
    assert kinds["tid2eid"] == torch.int64 and kinds["attn_sink"] == torch.float32 and kinds["ape"] == torch.float32
    assert kinds["bias"] == torch.float32 and kinds["hc_head_fn"] == torch.float32
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    for i in range(cfg["mlp_layer_types"].count("hash_moe")):
        t = tensors[f"layers.{i}.ffn.gate.tid2eid"]
        assert t.shape == (cfg["vocab_size"], k) and int(t.min()) >= 0 and int(t.max()) < E
        assert bool((t.sort(dim=1).values.diff(dim=1) > 0).all())  # distinct experts per token
    for n, t in tensors.items():
        if n.endswith("norm.weight"):
            assert 0.9 - 2**-8 <= float(t.float().min()) and float(t.float().max()) <= 1.1 + 2**-7, n  # BF16


# ------------------------------------------------------------------------------------------------ atomic write


def _leftovers(parent: Path, name: str) -> list:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def _fail_on_second_shard(monkeypatch, exc=OSError("disk full (injected)")):
    real = st.write_file
    calls = []

    def write_file(path, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise exc
        return real(path, tensors, metadata)

    monkeypatch.setattr(st, "write_file", write_file)
    return calls


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    calls = _fail_on_second_shard(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="injected"):
        dsv4.make_checkpoint(out, MICRO, 0, shard_bytes=2_000_000)
    assert len(calls) == 2 and calls[0].exists() is False  # the first shard was written, then removed
    assert not out.exists() and _leftovers(tmp_path, "out") == []


def test_failure_with_force_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    _fail_on_second_shard(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        dsv4.make_checkpoint(out, MICRO, 0, force=True, shard_bytes=2_000_000)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and _leftovers(tmp_path, "out") == []


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dsv4.make_checkpoint(out, MICRO, 0)  # an empty directory is fine
    before = _files(out)
    with pytest.raises(dsv4.CheckpointError, match="not empty; pass --force"):
        dsv4.make_checkpoint(out, MICRO, 1)
    assert _files(out) == before
    (out / "stray.txt").write_text("x")
    dsv4.make_checkpoint(out, MICRO, 1, force=True)
    assert "stray.txt" not in _files(out) and _files(out) != before
    assert _leftovers(tmp_path, "out") == []
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(dsv4.CheckpointError, match="not a directory"):
        dsv4.make_checkpoint(f, MICRO, 0, force=True)
    with pytest.raises(dsv4.CheckpointError, match="shard size must be positive"):
        dsv4.make_checkpoint(tmp_path / "new", MICRO, 0, shard_bytes=0)
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------------------------ safetensors


SPEC_DTYPES = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32", "F64",
               "F8_E4M3", "F8_E5M2", "F8_E8M0"}


def _all_dtypes() -> dict:
    g = torch.Generator().manual_seed(5)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    t = {
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "f32": torch.tensor([0.0, -0.0, 1e-45, float("inf"), -float("inf"), 3.25]),
        "f16": torch.randn(4, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "e4m3": codes.view(FP8).reshape(16, 16),  # every bit pattern, NaN codes included
        "e5m2": codes.view(torch.float8_e5m2),
        "i64": torch.tensor([[-(2**63), 2**63 - 1], [0, -1]], dtype=torch.int64),
        "i32": torch.tensor([-(2**31), 7], dtype=torch.int32),
        "i16": torch.tensor([-5], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": codes[:7].clone(),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # written as its values
    }
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_safetensors_round_trip_every_dtype(tmp_path):
    t = _all_dtypes()
    p = tmp_path / "x.safetensors"
    n = st.write_file(p, t, {"format": "pt", "note": "ünïcode"})
    assert n == p.stat().st_size
    back = st.read_file(p)
    assert list(back) == list(t)
    for k in t:
        assert _same(t[k], back[k]), k
    _, meta, _ = st.read_header(p)
    assert meta == {"format": "pt", "note": "ünïcode"}
    q = tmp_path / "y.safetensors"
    st.write_file(q, dict(t), {"format": "pt", "note": "ünïcode"})
    assert p.read_bytes() == q.read_bytes()  # nothing depends on time or process


def test_safetensors_header_follows_the_format(tmp_path):
    """Parse the file by the format alone: 8-byte little-endian header length N, N bytes of a UTF-8 JSON
    object (padded with spaces), ``__metadata__`` of strings, per tensor dtype / shape / data_offsets relative
    to the data area, contiguous, covering it exactly; data little-endian, row-major."""
    t = _all_dtypes()
    p = tmp_path / "x.safetensors"
    st.write_file(p, t, {"format": "pt"})
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = raw[8:8 + n]
    assert (8 + n) % 8 == 0 and head.rstrip(b" ") == head.rstrip() and head.startswith(b"{")
    header = json.loads(head.decode("utf-8"))
    assert list(header)[0] == "__metadata__" and header.pop("__metadata__") == {"format": "pt"}
    data = raw[8 + n:]
    pos = 0
    for name, e in header.items():
        assert set(e) == {"dtype", "shape", "data_offsets"} and e["dtype"] in SPEC_DTYPES
        assert e["shape"] == list(t[name].shape)
        b, end = e["data_offsets"]
        assert b == pos and end - b == t[name].numel() * t[name].element_size()
        pos = end
    assert pos == len(data)
    b, end = header["i64"]["data_offsets"]
    assert data[b:end] == struct.pack("<4q", -(2**63), 2**63 - 1, 0, -1)
    b, end = header["strided"]["data_offsets"]
    assert data[b:end] == struct.pack("<12q", 0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11)
    b, end = header["f32"]["data_offsets"]
    assert data[b:end] == struct.pack("<6f", 0.0, -0.0, 1e-45, float("inf"), -float("inf"), 3.25)
    assert header["e4m3"]["dtype"] == "F8_E4M3" and header["bf16"]["dtype"] == "BF16"
    assert header["bool"]["dtype"] == "BOOL" and header["i64"]["dtype"] == "I64"


def test_safetensors_known_bytes_both_ways(tmp_path):
    """A file built byte by byte from the format reads back; our writer produces exactly those bytes."""
    hdr = b'{"__metadata__":{"format":"pt"},"a":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},' \
          b'"b":{"dtype":"BF16","shape":[1],"data_offsets":[16,18]}}'
    hdr += b" " * (-len(hdr) % 8)
    blob = struct.pack("<Q", len(hdr)) + hdr + struct.pack("<2q", 3, -4) + bytes([0x80, 0x3F])
    p = tmp_path / "hand.safetensors"
    p.write_bytes(blob)
    got = st.read_file(p)
    assert got["a"].tolist() == [3, -4] and got["b"].dtype == torch.bfloat16 and got["b"].tolist() == [1.0]
    q = tmp_path / "ours.safetensors"
    st.write_file(q, {"a": torch.tensor([3, -4]), "b": torch.tensor([1.0], dtype=torch.bfloat16)}, {"format": "pt"})
    assert q.read_bytes() == blob
    # entries in another order than their data, no metadata, extra padding: still a valid file
    hdr2 = b'{"b":{"dtype":"BF16","shape":[1],"data_offsets":[16,18]},"a":{"dtype":"I64","shape":[2],' \
           b'"data_offsets":[0,16]}}' + b" " * 13
    p.write_bytes(struct.pack("<Q", len(hdr2)) + hdr2 + struct.pack("<2q", 3, -4) + bytes([0x80, 0x3F]))
    got = st.read_file(p)
    assert list(got) == ["b", "a"] and got["a"].tolist() == [3, -4]


def _file(tmp_path, entries: dict, data: bytes, raw_header: bytes | None = None) -> Path:
    hdr = raw_header if raw_header is not None else json.dumps(entries).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + data)
    return p


@pytest.mark.parametrize("case, match", [
    ("short", "truncated"), ("huge_n", "does not fit"), ("not_json", "not valid JSON"),
    ("array", "not a JSON object"), ("dtype", "malformed or unknown"), ("size", "needs 8"),
    ("outside", "outside the data"), ("gap", "gap or overlap"), ("overlap", "gap or overlap"),
    ("trailing", "trailing bytes"),
])
def test_safetensors_reader_rejects_broken_files(tmp_path, case, match):
    e = lambda d, s, o: {"dtype": d, "shape": s, "data_offsets": o}  # noqa: E731
    if case == "short":
        p = tmp_path / "bad.safetensors"
        p.write_bytes(b"\x01\x00")
    elif case == "huge_n":
        p = tmp_path / "bad.safetensors"
        p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "not_json":
        p = _file(tmp_path, {}, b"", raw_header=b"{nope")
    elif case == "array":
        p = _file(tmp_path, {}, b"", raw_header=b"[1, 2]")
    elif case == "dtype":
        p = _file(tmp_path, {"a": e("C64", [1], [0, 8])}, bytes(8))
    elif case == "size":
        p = _file(tmp_path, {"a": e("F32", [2], [0, 4])}, bytes(4))
    elif case == "outside":
        p = _file(tmp_path, {"a": e("F32", [1], [4, 8])}, bytes(4))
    elif case == "gap":
        p = _file(tmp_path, {"a": e("F32", [1], [0, 4]), "b": e("F32", [1], [8, 12])}, bytes(12))
    elif case == "overlap":
        p = _file(tmp_path, {"a": e("F32", [2], [0, 8]), "b": e("F32", [1], [4, 8])}, bytes(8))
    else:
        p = _file(tmp_path, {"a": e("F32", [1], [0, 4])}, bytes(6))
    with pytest.raises(ValueError, match=match) as err:
        st.read_file(p)
    assert str(p) in str(err.value)


def test_safetensors_writer_rejects_bad_input(tmp_path):
    p = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="str -> str"):
        st.write_file(p, {"a": torch.zeros(1)}, {"n": 1})
    with pytest.raises(ValueError, match="reserved"):
        st.write_file(p, {"__metadata__": torch.zeros(1)})
    with pytest.raises(ValueError, match="cannot store"):
        st.write_file(p, {"c": torch.zeros(2, dtype=torch.complex64)})
    assert st.tensor_nbytes((3, 4), torch.bfloat16) == 24 and st.DTYPE_NAMES[FP8] == "F8_E4M3"


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def with_micro(monkeypatch):
    monkeypatch.setitem(dsv4.PRESETS, "micro", MICRO)


def test_cli_writes_the_same_bytes_as_the_api(tmp_path, capsys, with_micro):
    out = tmp_path / "cli"
    rc = cli_main(["--preset", "micro", "--out", str(out), "--seed", "3", "--masters", "--shard-bytes", "2000000"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert f"wrote {out.absolute()}: preset micro, seed 3" in cap.out and "parameters:" in cap.out
    assert "[make-checkpoint] drawing" in cap.err and "[make-checkpoint] quantising" in cap.err
    assert "[make-checkpoint] wrote masters/model-00001-of-" in cap.err
    dsv4.make_checkpoint(tmp_path / "api", MICRO, 3, masters=True, shard_bytes=2_000_000)
    assert _files(out) == _files(tmp_path / "api")
    assert (out / "masters" / "model.safetensors.index.json").is_file()
    masters = dsv4.read_masters(out)
    assert all(torch.equal(masters[n], t) for n, t in dsv4.generate_masters(MICRO, 3).items())
    # --force replaces it; without --force it is refused
    assert cli_main(["--preset", "micro", "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err
    assert cli_main(["--preset", "micro", "--out", str(out), "--force"]) == 0
    assert not (out / "masters").exists()


@pytest.mark.parametrize("argv, match", [
    (["--preset", "huge"], "--preset huge: unknown preset; choose one of"),
    (["--preset", "micro", "--shard-bytes", "0"], "--shard-bytes 0: must be a positive"),
    (["--preset", "micro", "--seed", "-1"], "--seed -1: must be >= 0"),
])
def test_cli_bad_settings_are_named(tmp_path, capsys, with_micro, argv, match):
    out = tmp_path / "out"
    assert cli_main([*argv, "--out", str(out)]) == 2
    assert match in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_refuses_a_file_and_a_full_directory(tmp_path, capsys, with_micro):
    f = tmp_path / "f"
    f.write_text("x")
    assert cli_main(["--preset", "micro", "--out", str(f)]) == 2
    assert f"--out {f}: exists and is not a directory" in capsys.readouterr().err
    assert cli_main(["--preset", "micro", "--out", str(f / "sub")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    d = tmp_path / "d"
    d.mkdir()
    (d / "x").write_text("x")
    assert cli_main(["--preset", "micro", "--out", str(d)]) == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert f.read_text() == "x" and [p.name for p in d.iterdir()] == ["x"]


def test_cli_failure_mid_write_leaves_nothing(tmp_path, capsys, monkeypatch, with_micro):
    _fail_on_second_shard(monkeypatch)
    out = tmp_path / "out"
    assert cli_main(["--preset", "micro", "--out", str(out), "--shard-bytes", "2000000"]) == 1
    err = capsys.readouterr().err
    assert "disk full (injected)" in err and "nothing was left at --out" in err
    assert not out.exists() and _leftovers(tmp_path, "out") == []


def test_cli_is_registered_with_help():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "zerodiff.cli", "make-checkpoint", "--help"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    for s in ("--preset NAME", "--out DIR", "--seed N", "--force", "--masters", "--shard-bytes N", "tiny",
              "mini", "expert_dtype fp8", "byte-identical"):
        assert s in r.stdout, s
    from zerodiff.cli import build_parser

    assert "make-checkpoint" in build_parser().format_help()
