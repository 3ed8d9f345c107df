"""Seeded DeepSeek-V4 checkpoints in the released FP8 layout, for vLLM 0.33.0's ``DeepseekV4ForCausalLM``.

A checkpoint is a Hugging Face-layout directory: ``config.json`` (what transformers' ``DeepseekV4Config``
parses and vLLM reads), safetensors shards named ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``. Tensor names, shapes and dtypes are those of the released FP8 base
checkpoint (``expert_dtype: "fp8"``: block-FP8 routed experts); vLLM's weights mapper translates them on load.
``docs/checkpoint.md`` has the per-layer tables and what was verified how.

Contract
--------
* **Masters.** Every tensor has a master drawn from ``seed`` alone: BF16 for matrices, norms and the router,
  FP32 for mHC, attention sinks, compressor position biases and the router bias, int64 for the hash-routing
  table. Each tensor's values come from its own counter-based stream keyed by ``sha256(seed, name)``
  (splitmix64 in numpy), are formed in float64 and rounded once to FP32 (RNE) and, for BF16, once more to
  BF16 (RNE on the bits): the same (preset, seed) gives the same bits on every machine, Python, numpy and
  torch version, and no tensor depends on another tensor or on the generation order.
* **Deployment.** Linears the released checkpoint keeps in FP8 are stored as ``<x>.weight``
  (``float8_e4m3fn``) plus ``<x>.scale`` (FP32, one per 128 x 128 block, ``[ceil(N/128), ceil(K/128)]``),
  quantised from the BF16 master by :func:`zerodiff.ops.fp8_quant.quant_weight` with ``ue8m0=True``:
  ``scale = 2**ceil(log2(amax / 448))`` (the FP32 quotient rounded up to a power of two on the bits),
  ``q = e4m3_rne_saturating(w / scale)``. Everything else is stored as its master.
* **Why power-of-two scales.** ``scale_fmt: "ue8m0"`` is what vLLM 0.33.0 reads as "UE8M0 scales": it sets
  ``VLLM_USE_DEEP_GEMM_E8M0=1`` (also its default), and with DeepGEMM the FP8 linear and MoE loaders then
  requantise FP32 weight scales to powers of two. For scales that already are powers of two that
  requantisation keeps every dequantised weight value exactly (at most it halves a scale and doubles the
  codes of a block whose largest code is 224), so what vLLM multiplies is ``e4m3 * scale`` as written here.
* **Output.** :func:`make_checkpoint` writes into a temporary sibling directory and renames it into place
  only when complete: a failure leaves nothing at ``out``. An existing non-empty ``out`` is refused unless
  ``force``. The files carry no time stamps: same (preset, seed, shard size) -> byte-identical files.

Master scales (so activations stay O(1) through the layers): matrices ``U(-a, a)`` with standard deviation
``1/sqrt(fan_in)`` (``a = sqrt(3/fan_in)``), the embedding standard deviation 1, norm weights ``1 + 0.1 u``,
mHC ``fn`` ``0.5/sqrt(fan_in)``, ``scale`` ``1 + 0.1 u``, ``base`` pre -1 / post 0 / comb ``2 I + 0.1 u``,
attention sinks ``0.5 u``, compressor position biases ``0.25 u``, router bias ``0.05 u``
(``u`` uniform on [-1, 1)); ``tid2eid`` rows are ``num_experts_per_tok`` distinct experts.

Public API::

    PRESETS, preset(name) -> CheckpointPreset
    config_dict(preset) -> dict                                   the config.json contents
    master_layout(config) -> list[MasterSpec]                     every master, in file order
    checkpoint_layout(config) -> list[(name, shape, dtype)]       every tensor the checkpoint holds
    generate_masters(preset_or_config, seed) -> dict name -> tensor
    deploy(masters, config) -> dict name -> tensor                FP8 weights + scales, the rest as is
    make_checkpoint(out, preset, seed=0, *, masters=False, force=False, shard_bytes=..., progress=None) -> Summary
    read_checkpoint(dir) -> (config dict, dict name -> tensor)
    read_masters(dir) -> dict name -> tensor                      what ``masters=True`` wrote
    dequantize(q, scale) -> FP32 tensor
    CheckpointError
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from . import safetensors_io as st

#: weight block of the deployment rule (rows x columns of one scale)
BLOCK = 128
#: the deployment rule rounds scales up to powers of two (see the module docstring)
SCALE_UE8M0 = True
#: default largest shard (tensors are never split; a tensor larger than this gets a shard of its own)
DEFAULT_SHARD_BYTES = 64 * 1024 * 1024
#: bump when any master value or file byte produced for a given (preset, seed) changes
GENERATOR_VERSION = 1

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
COMPRESS_RATES = {CSA: 4, HCA: 128}
HASH_MOE, MOE = "hash_moe", "moe"
_ATTN_KINDS = {SLIDING: "sliding window only", CSA: "C4A (ratio 4, indexer)", HCA: "C128A (ratio 128)"}

_QUANT_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [BLOCK, BLOCK],
}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written (bad preset, refused output directory) or read (missing files)."""


@dataclass(frozen=True)
class CheckpointPreset:
    """The shape of a generated checkpoint. Fields are the config.json fields of the same name; the fixed
    DeepSeek-V4-Flash values (scoring, routed scale, mHC, rope, eps, ...) come from :func:`config_dict`."""

    name: str
    description: str
    layer_types: tuple
    mlp_layer_types: tuple
    vocab_size: int = 4096
    hidden_size: int = 1024
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 128
    o_lora_rank: int = 128
    o_groups: int = 8
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 16
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 128
    sliding_window: int = 128
    hc_mult: int = 4
    extra: dict = field(default_factory=dict)  # further config.json overrides

    def replace(self, **kw) -> "CheckpointPreset":
        return replace(self, **kw)


TINY = CheckpointPreset(
    "tiny",
    "4 layers: every attention kind (C128A, C4A with indexer, sliding window only) and both MoE kinds (hash-routed, "
    "scored); 64 heads x 512 (rope 64), indexer 64 x 128 top-512, hidden 1024, 16 experts top-6 + 1 shared",
    layer_types=(HCA, CSA, SLIDING, CSA),
    mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE),
)
MINI = CheckpointPreset(
    "mini",
    "2 layers (C4A + hash MoE, C128A + scored MoE) with the tiny per-head shapes; vocab 1024, 8 experts top-2",
    layer_types=(CSA, HCA),
    mlp_layer_types=(HASH_MOE, MOE),
    vocab_size=1024,
    n_routed_experts=8,
    num_experts_per_tok=2,
)
PRESETS = {p.name: p for p in (TINY, MINI)}


def preset(name: str) -> CheckpointPreset:
    """The named preset; ``CheckpointError`` naming the valid ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise CheckpointError(f"unknown checkpoint preset {name!r}; choose one of {sorted(PRESETS)}") from None


def _check_preset(p: CheckpointPreset) -> None:
    n = len(p.layer_types)
    errors = []
    if n == 0 or len(p.mlp_layer_types) != n:
        errors.append(f"layer_types ({n}) and mlp_layer_types ({len(p.mlp_layer_types)}) must be equally long, >= 1")
    bad = [t for t in p.layer_types if t not in _ATTN_KINDS] + [t for t in p.mlp_layer_types if t not in (HASH_MOE, MOE)]
    if bad:
        errors.append(f"unknown layer kinds {bad}")
    n_hash = list(p.mlp_layer_types).count(HASH_MOE)
    if list(p.mlp_layer_types[:n_hash]) != [HASH_MOE] * n_hash:
        errors.append("hash_moe layers must come first (vLLM routes layer i by hash iff i < their count)")
    for f in ("hidden_size", "q_lora_rank", "o_lora_rank", "moe_intermediate_size", "head_dim", "index_head_dim"):
        if getattr(p, f) % BLOCK:
            errors.append(f"{f}={getattr(p, f)} must be a multiple of {BLOCK} (FP8 blocks)")
    if (p.num_attention_heads * p.head_dim) % (p.o_groups * BLOCK):
        errors.append("num_attention_heads * head_dim must split into o_groups multiples of 128")
    if not 0 < p.num_experts_per_tok <= p.n_routed_experts:
        errors.append("need 0 < num_experts_per_tok <= n_routed_experts")
    if errors:
        raise CheckpointError(f"checkpoint preset {p.name!r}: " + "; ".join(errors))


def config_dict(p: CheckpointPreset) -> dict:
    """The ``config.json`` of preset ``p`` (a fresh dict; key order is the file's order)."""
    _check_preset(p)
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": len(p.layer_types),
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": p.head_dim,
        "qk_rope_head_dim": p.qk_rope_head_dim,
        "q_lora_rank": p.q_lora_rank,
        "o_lora_rank": p.o_lora_rank,
        "o_groups": p.o_groups,
        "layer_types": list(p.layer_types),
        "compress_rates": dict(COMPRESS_RATES),
        "mlp_layer_types": list(p.mlp_layer_types),
        "sliding_window": p.sliding_window,
        "index_n_heads": p.index_n_heads,
        "index_head_dim": p.index_head_dim,
        "index_topk": p.index_topk,
        "n_routed_experts": p.n_routed_experts,
        "num_experts_per_tok": p.num_experts_per_tok,
        "n_shared_experts": p.n_shared_experts,
        "moe_intermediate_size": p.moe_intermediate_size,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "hc_mult": p.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "expert_dtype": "fp8",
        "quantization_config": dict(_QUANT_CONFIG, weight_block_size=[BLOCK, BLOCK]),
    }
    cfg.update(p.extra)
    return cfg


# --------------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class MasterSpec:
    """One master tensor: its checkpoint name, shape, master dtype, how it is drawn, and whether the
    checkpoint stores it block-FP8 (``<x>.weight`` e4m3 + ``<x>.scale`` FP32) instead of as is."""

    name: str
    shape: tuple
    dtype: torch.dtype
    init: str
    fp8: bool = False

    @property
    def scale_name(self) -> str:
        assert self.fp8 and self.name.endswith(".weight")
        return self.name[: -len(".weight")] + ".scale"

    @property
    def scale_shape(self) -> tuple:
        return tuple(-(-d // BLOCK) for d in self.shape)


def _compress_ratio(cfg: dict, layer: int) -> int:
    return int(cfg["compress_rates"].get(cfg["layer_types"][layer], 0))


def master_layout(cfg: dict) -> list:
    """Every master of a DeepSeek-V4 FP8-expert checkpoint described by the config dict ``cfg``, in file order.

    Per layer: mHC (``hc_{attn,ffn}_{fn,base,scale}``), the two block norms, the attention (sink, q/kv
    low-rank projections and norms, grouped output projection; plus the compressor for ratio > 1 and the
    indexer with its own compressor for ratio 4), the MoE (router weight; ``tid2eid`` on hash layers, the
    router ``bias`` elsewhere; routed experts ``w1/w2/w3``; the shared expert). Then the embedding, final
    norm, LM head and the mHC head."""
    bf, f32, i64 = torch.bfloat16, torch.float32, torch.int64
    H, hc = int(cfg["hidden_size"]), int(cfg["hc_mult"])
    heads, hd = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    ql, ol, og = int(cfg["q_lora_rank"]), int(cfg["o_lora_rank"]), int(cfg["o_groups"])
    E, k, inter = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"])
    n_shared = cfg.get("n_shared_experts")
    ih, idim = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
    V = int(cfg["vocab_size"])
    mix = (2 + hc) * hc
    n_hash = list(cfg["mlp_layer_types"]).count(HASH_MOE)
    scored_bias = cfg.get("topk_method") == "noaux_tc"
    out: list = []

    def add(name, shape, dtype, init, fp8=False):
        out.append(MasterSpec(name, tuple(int(d) for d in shape), dtype, init, fp8))

    def compressor(prefix, ratio, dim):
        coff = 2 if ratio == 4 else 1  # ratio-4 compressors overlap two windows
        add(f"{prefix}.ape", (ratio, coff * dim), f32, "ape")
        add(f"{prefix}.wkv.weight", (coff * dim, H), bf, "linear")
        add(f"{prefix}.wgate.weight", (coff * dim, H), bf, "linear")
        add(f"{prefix}.norm.weight", (dim,), bf, "norm")

    for i in range(int(cfg["num_hidden_layers"])):
        p = f"layers.{i}"
        for sub in ("attn", "ffn"):
            add(f"{p}.hc_{sub}_fn", (mix, hc * H), f32, "hc_fn")
            add(f"{p}.hc_{sub}_base", (mix,), f32, "hc_base")
            add(f"{p}.hc_{sub}_scale", (3,), f32, "hc_scale")
        add(f"{p}.attn_norm.weight", (H,), bf, "norm")
        add(f"{p}.ffn_norm.weight", (H,), bf, "norm")
        a = f"{p}.attn"
        add(f"{a}.attn_sink", (heads,), f32, "sink")
        add(f"{a}.wq_a.weight", (ql, H), bf, "linear", True)
        add(f"{a}.q_norm.weight", (ql,), bf, "norm")
        add(f"{a}.wq_b.weight", (heads * hd, ql), bf, "linear", True)
        add(f"{a}.wkv.weight", (hd, H), bf, "linear", True)
        add(f"{a}.kv_norm.weight", (hd,), bf, "norm")
        add(f"{a}.wo_a.weight", (og * ol, heads * hd // og), bf, "linear", True)
        add(f"{a}.wo_b.weight", (H, og * ol), bf, "linear", True)
        ratio = _compress_ratio(cfg, i)
        if ratio > 1:
            compressor(f"{a}.compressor", ratio, hd)
        if ratio == 4:
            add(f"{a}.indexer.wq_b.weight", (ih * idim, ql), bf, "linear", True)
            add(f"{a}.indexer.weights_proj.weight", (ih, H), bf, "linear")
            compressor(f"{a}.indexer.compressor", ratio, idim)
        f = f"{p}.ffn"
        add(f"{f}.gate.weight", (E, H), bf, "linear")
        if i < n_hash:
            add(f"{f}.gate.tid2eid", (V, k), i64, "tid2eid")
        elif scored_bias:
            add(f"{f}.gate.bias", (E,), f32, "bias")
        for e in range(E):
            add(f"{f}.experts.{e}.w1.weight", (inter, H), bf, "linear", True)
            add(f"{f}.experts.{e}.w2.weight", (H, inter), bf, "linear", True)
            add(f"{f}.experts.{e}.w3.weight", (inter, H), bf, "linear", True)
        if n_shared is not None:
            si = inter * int(n_shared)
            add(f"{f}.shared_experts.w1.weight", (si, H), bf, "linear", True)
            add(f"{f}.shared_experts.w2.weight", (H, si), bf, "linear", True)
            add(f"{f}.shared_experts.w3.weight", (si, H), bf, "linear", True)
    add("embed.weight", (V, H), bf, "embed")
    add("norm.weight", (H,), bf, "norm")
    add("head.weight", (V, H), bf, "linear")
    add("hc_head_fn", (hc, hc * H), f32, "hc_fn")
    add("hc_head_base", (hc,), f32, "hc_head_base")
    add("hc_head_scale", (1,), f32, "hc_scale")
    return out


def checkpoint_layout(cfg: dict) -> list:
    """``[(name, shape, dtype)]`` of every tensor the checkpoint holds, in file order."""
    rows = []
    for m in master_layout(cfg):
        if m.fp8:
            rows.append((m.name, m.shape, torch.float8_e4m3fn))
            rows.append((m.scale_name, m.scale_shape, torch.float32))
        else:
            rows.append((m.name, m.shape, m.dtype))
    return rows


# --------------------------------------------------------------------------------------------------- masters

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _stream_key(seed: int, name: str) -> np.uint64:
    digest = hashlib.sha256(f"zerodiff-dsv4/{GENERATOR_VERSION}/{int(seed)}/{name}".encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def _raw64(seed: int, name: str, n: int) -> np.ndarray:
    """``n`` uint64 words of the counter-based stream of (seed, name): splitmix64(key + (i+1) * golden)."""
    with np.errstate(over="ignore"):
        z = _stream_key(seed, name) + (np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z


def _uniform(seed: int, name: str, shape) -> np.ndarray:
    """float64 uniform on [-1, 1), exact multiples of 2**-52."""
    n = math.prod(shape)
    u = (_raw64(seed, name, n) >> np.uint64(11)).astype(np.float64) * (2.0 ** -53)
    return (2.0 * u - 1.0).reshape(shape)


def _to_bf16(x32: np.ndarray) -> torch.Tensor:
    """FP32 (finite) -> BF16, round to nearest even on the bits."""
    bits = np.ascontiguousarray(x32, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    return torch.from_numpy(rounded.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16)


def _master_values(m: MasterSpec, cfg: dict, seed: int) -> torch.Tensor:
    shape = m.shape
    if m.init == "tid2eid":
        keys = _raw64(seed, m.name, shape[0] * int(cfg["n_routed_experts"]))
        order = np.argsort(keys.reshape(shape[0], -1), axis=1, kind="stable")[:, : shape[1]]
        return torch.from_numpy(np.ascontiguousarray(order.astype(np.int64)))
    u = _uniform(seed, m.name, shape)
    hc = int(cfg["hc_mult"])
    if m.init == "linear":
        x = u * math.sqrt(3.0 / shape[-1])
    elif m.init == "embed":
        x = u * math.sqrt(3.0)
    elif m.init == "hc_fn":
        x = u * (0.5 * math.sqrt(3.0 / shape[-1]))
    elif m.init == "norm" or m.init == "hc_scale":
        x = 1.0 + 0.1 * u
    elif m.init == "hc_base":
        x = np.zeros(shape)
        x[:hc] = -1.0
        x[2 * hc:] = 2.0 * np.eye(hc).reshape(-1) + 0.1 * u[2 * hc:]
    elif m.init == "hc_head_base":
        x = 0.1 * u
    elif m.init == "sink":
        x = 0.5 * u
    elif m.init == "ape":
        x = 0.25 * u
    elif m.init == "bias":
        x = 0.05 * u
    else:  # pragma: no cover - master_layout only emits the kinds above
        raise AssertionError(m.init)
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if m.dtype == torch.bfloat16:
        return _to_bf16(x32).reshape(shape)
    return torch.from_numpy(x32.copy())


def _as_config(preset_or_config) -> dict:
    if isinstance(preset_or_config, CheckpointPreset):
        return config_dict(preset_or_config)
    if isinstance(preset_or_config, str):
        return config_dict(preset(preset_or_config))
    return dict(preset_or_config)


def generate_masters(preset_or_config, seed: int = 0) -> dict:
    """The masters of a preset (object or name) or config dict: checkpoint name -> CPU tensor, in file order.
    FP8-stored linears appear under their ``.weight`` name as the BF16 master the checkpoint was quantised
    from. Deterministic in (layout, seed) only (see the module docstring)."""
    cfg = _as_config(preset_or_config)
    return {m.name: _master_values(m, cfg, seed) for m in master_layout(cfg)}


def quantize_master(w: torch.Tensor, *, backend=None):
    """``(q e4m3, scale fp32)`` of a BF16 master by the checkpoint's deployment rule (128 x 128, UE8M0)."""
    from ..ops.fp8_quant import quant_weight

    return quant_weight(w, block=BLOCK, ue8m0=SCALE_UE8M0, backend=backend)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP32 ``e4m3 * scale`` with each scale broadcast over its 128 x 128 block."""
    from ..reference.fp8_quant import dequant_weight_block_ref

    return dequant_weight_block_ref(q, scale, BLOCK)


def deploy(masters: dict, cfg: dict, *, backend=None) -> dict:
    """Checkpoint tensors from masters: FP8-stored linears become ``.weight`` (e4m3) + ``.scale`` (FP32),
    everything else is passed through. Names and order follow :func:`master_layout`; ``KeyError`` if a
    master is missing."""
    out = {}
    for m in master_layout(cfg):
        t = masters[m.name]
        if m.fp8:
            q, s = quantize_master(t, backend=backend)
            out[m.name] = q
            out[m.scale_name] = s
        else:
            out[m.name] = t
    return out


# --------------------------------------------------------------------------------------------------- files


@dataclass
class Summary:
    """What :func:`make_checkpoint` wrote."""

    out: str
    preset: str
    seed: int
    layers: list  # [(index, attention kind, mlp kind)]
    parameters: int  # elements of all masters (= model parameters, hash table included)
    tensors: int  # tensors in the checkpoint
    checkpoint_bytes: int  # sum of the safetensors shard sizes
    files: dict  # relative path -> bytes
    masters_bytes: int = 0

    def text(self) -> str:
        rows = [f"wrote {self.out}: preset {self.preset}, seed {self.seed}"]
        for i, at, mt in self.layers:
            rows.append(f"  layer {i}: {at:<28} {_ATTN_KINDS[at]:<24} {mt}")
        rows.append(f"  parameters: {self.parameters:,} in {self.tensors} tensors; shards "
                    f"{self.checkpoint_bytes:,} bytes ({self.checkpoint_bytes / 2**20:.1f} MiB)")
        for rel, n in self.files.items():
            rows.append(f"  {rel}: {n:,} bytes")
        if self.masters_bytes:
            rows.append(f"  masters: {self.masters_bytes:,} bytes ({self.masters_bytes / 2**20:.1f} MiB)")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["layers"] = [list(x) for x in self.layers]
        return d


def _write_sharded(dirpath: Path, tensors: dict, shard_bytes: int, stem: str = "model", progress=None,
                   label: str = "") -> dict:
    """Write ``tensors`` as ``<stem>-0000i-of-0000n.safetensors`` + ``<stem>.safetensors.index.json``;
    returns relative file name -> size. ``progress(message)`` is called after each shard (named ``label + file``)."""
    shards: list = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    count = len(shards)
    files, weight_map = {}, {}
    for i, names in enumerate(shards, 1):
        fname = f"{stem}-{i:05d}-of-{count:05d}.safetensors"
        files[fname] = st.write_file(dirpath / fname, {k: tensors[k] for k in names}, {"format": "pt"})
        if progress is not None:
            progress(f"wrote {label}{fname}: {len(names)} tensors, {files[fname]:,} bytes")
        weight_map.update({k: fname for k in names})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    iname = f"{stem}.safetensors.index.json"
    (dirpath / iname).write_text(json.dumps(index, indent=2) + "\n")
    files[iname] = (dirpath / iname).stat().st_size
    return files


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CheckpointError(f"{out} exists and is not empty; pass --force (force=True) to replace it")


def make_checkpoint(out, p="tiny", seed: int = 0, *, masters: bool = False, force: bool = False,
                    shard_bytes: int = DEFAULT_SHARD_BYTES, backend=None, progress=None) -> Summary:
    """Generate preset ``p`` (name or :class:`CheckpointPreset`) from ``seed`` and write it to ``out``.

    ``masters=True`` also writes the BF16/FP32 masters (same names; FP8-stored linears as their BF16
    ``.weight``) under ``out/masters/`` (sharded the same way, a directory vLLM never reads). Writes to a
    temporary sibling of ``out`` and renames it into place at the end; on any failure nothing is left at
    ``out`` (an existing ``out`` replaced with ``force`` is removed only after the new one is complete).
    Raises :class:`CheckpointError` for a bad preset or a refused ``out``. ``progress(message)``, when given,
    is called at each stage (masters, quantisation, every shard written)."""
    pr = preset(p) if isinstance(p, str) else p
    cfg = config_dict(pr)
    out = Path(out).absolute()
    _check_out(out, force)
    if shard_bytes < 1:
        raise CheckpointError(f"shard size must be positive, got {shard_bytes}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    say = progress if progress is not None else (lambda msg: None)
    try:
        layout = master_layout(cfg)
        say(f"drawing {len(layout)} masters ({sum(math.prod(x.shape) for x in layout):,} parameters) "
            f"from seed {int(seed)}")
        m = generate_masters(cfg, seed)
        say(f"quantising {sum(x.fp8 for x in layout)} linears to block FP8 (128 x 128, power-of-two scales)")
        tensors = deploy(m, cfg, backend=backend)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        files = {"config.json": (tmp / "config.json").stat().st_size}
        files.update(_write_sharded(tmp, tensors, shard_bytes, progress=progress))
        masters_bytes = 0
        if masters:
            (tmp / "masters").mkdir()
            mfiles = _write_sharded(tmp / "masters", m, shard_bytes, progress=progress, label="masters/")
            masters_bytes = sum(mfiles.values())
            files.update({f"masters/{k}": v for k, v in mfiles.items()})
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "replaced")
        try:
            os.replace(tmp, out)
        except BaseException:
            if old is not None:
                os.replace(old / "replaced", out)
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    layers = [(i, a, b) for i, (a, b) in enumerate(zip(pr.layer_types, pr.mlp_layer_types))]
    shard_total = sum(v for k, v in files.items() if k.startswith("model-"))
    return Summary(str(out), pr.name, int(seed), layers, sum(t.numel() for t in m.values()), len(tensors),
                   shard_total, files, masters_bytes)


def _read_index_dir(d: Path, stem: str) -> dict:
    index = d / f"{stem}.safetensors.index.json"
    if not index.is_file():
        raise CheckpointError(f"{d}: no {index.name}")
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for fname in dict.fromkeys(weight_map.values()):
        out.update(st.read_file(d / fname))
    missing = set(weight_map) - set(out)
    if missing:
        raise CheckpointError(f"{d}: index names tensors no shard holds: {sorted(missing)[:5]}")
    return out


def read_checkpoint(d) -> tuple:
    """``(config dict, tensors)`` of a checkpoint directory (tensors: name -> CPU tensor, index order)."""
    d = Path(d)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d}: no config.json")
    return json.loads((d / "config.json").read_text()), _read_index_dir(d, "model")


def read_masters(d) -> dict:
    """The masters written by ``make_checkpoint(..., masters=True)`` (name -> CPU tensor)."""
    return _read_index_dir(Path(d) / "masters", "model")
