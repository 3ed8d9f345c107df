"""Weight mapping, checkpoint files and the refit of the rollout's FP8 deployment for the DeepSeek-V4 actor.

Three names per tensor (``l`` = layer, ``e`` = expert; ``I`` = ``moe_inter``, ``Is`` = ``shared_inter``):

==========================  ===============================================  ==================================================
harness (``zerodiff.model``)  actor module parameter                          checkpoint tensor(s)
==========================  ===============================================  ==================================================
``embed``                   ``embedding.word_embeddings.weight``             ``embed.weight``
``layers.l.attn_hc_fn``     ``decoder.layers.l.attn_hc.fn``                  ``layers.l.hc_attn_fn``
``layers.l.attn_hc_scale``  ``decoder.layers.l.attn_hc.scale``               ``layers.l.hc_attn_scale``
``layers.l.attn_hc_base``   ``decoder.layers.l.attn_hc.base``                ``layers.l.hc_attn_base``
``layers.l.attn_norm``      ``decoder.layers.l.input_layernorm.weight``      ``layers.l.attn_norm.weight``
``layers.l.wq_a``           ``...self_attention.linear_q_down_proj.weight``  ``layers.l.attn.wq_a.weight`` (FP8)
``layers.l.q_norm``         ``...self_attention.q_layernorm.weight``         ``layers.l.attn.q_norm.weight``
``layers.l.wq_b``           ``...self_attention.linear_q_up_proj.weight``    ``layers.l.attn.wq_b.weight`` (FP8)
``layers.l.wkv_a``          ``...self_attention.linear_kv_down_proj.weight`` ``layers.l.attn.wkv.weight`` (FP8)
``layers.l.kv_norm``        ``...self_attention.kv_layernorm.weight``        ``layers.l.attn.kv_norm.weight``
``layers.l.wo``             ``...self_attention.linear_proj.weight``         ``layers.l.attn.wo.weight`` (FP8)
``layers.l.idx_wq``         ``...self_attention.indexer.linear_wq_b.weight`` ``layers.l.attn.indexer.wq_b.weight`` (FP8)
``layers.l.idx_wk``         ``...self_attention.indexer.linear_wk.weight``   ``layers.l.attn.indexer.wk.weight`` (FP8)
``layers.l.idx_ww``         ``...indexer.linear_weights_proj.weight``        ``layers.l.attn.indexer.weights_proj.weight``
``layers.l.ffn_hc_*``       ``decoder.layers.l.mlp_hc.{fn,scale,base}``      ``layers.l.hc_ffn_{fn,scale,base}``
``layers.l.ffn_norm``       ``decoder.layers.l.pre_mlp_layernorm.weight``    ``layers.l.ffn_norm.weight``
``layers.l.gate``           ``decoder.layers.l.mlp.router.weight``           ``layers.l.ffn.gate.weight``
``layers.l.gate_bias``      ``decoder.layers.l.mlp.router.expert_bias``      ``layers.l.ffn.gate.bias``
``layers.l.exp_w13``        ``decoder.layers.l.mlp.experts.weight1``         ``layers.l.ffn.experts.e.w1.weight`` = rows ``[:I]``
                            (``[E, 2I, H]``)                                  and ``...e.w3.weight`` = rows ``[I:]`` (FP8)
``layers.l.exp_w2``         ``decoder.layers.l.mlp.experts.weight2``         ``layers.l.ffn.experts.e.w2.weight`` (FP8)
``layers.l.sh_w13``         ``...mlp.shared_experts.linear_fc1.weight``      ``layers.l.ffn.shared_experts.w1.weight`` = rows
                                                                              ``[:Is]``, ``...w3.weight`` = ``[Is:]`` (FP8)
``layers.l.sh_w2``          ``...mlp.shared_experts.linear_fc2.weight``      ``layers.l.ffn.shared_experts.w2.weight`` (FP8)
``final_norm``              ``decoder.final_layernorm.weight``               ``norm.weight``
``lm_head``                 ``output_layer.weight``                          ``head.weight``
==========================  ===============================================  ==================================================

The checkpoint names are DeepSeek-V4's released names wherever the harness op has a released counterpart;
``attn.wo`` (one output projection instead of the grouped ``wo_a`` / ``wo_b``) and ``attn.indexer.wk`` (index keys
from a linear instead of the indexer's compressor) are the harness's own.

Files (:func:`save_checkpoint`): the layout ``zerodiff make-checkpoint`` writes (``config.json``,
``model-0000i-of-0000n.safetensors`` + index, ``masters/`` with the same names). FP8 linears are
``<x>.weight`` (``float8_e4m3fn``) + ``<x>.scale`` (FP32, one per 128 x 128 block), the bytes of the actor's
deployment (the harness rule: FP32 block scales ``amax / 448``, ``scale_fmt: "fp32"`` in ``config.json``); the
masters are the BF16 / FP32 module parameters bit for bit. The same FP8 + scale dict is what
:func:`export_deployment` hands to :func:`refit_`, which writes it into the rollout engine's deployment in place.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ... import ConfigError
from ....model.config import ModelConfig
from ....model.weights import Deployment, is_fp8, param_shapes
from ....ops.fp8_quant import Fp8Weight
from .config import harness_config_json, model_config_from_checkpoint_config

BLOCK = 128

_LAYER = {  # harness suffix -> (module path under decoder.layers.l, checkpoint name under layers.l)
    "attn_hc_fn": ("attn_hc.fn", "hc_attn_fn"),
    "attn_hc_scale": ("attn_hc.scale", "hc_attn_scale"),
    "attn_hc_base": ("attn_hc.base", "hc_attn_base"),
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "wq_a": ("self_attention.linear_q_down_proj.weight", "attn.wq_a.weight"),
    "q_norm": ("self_attention.q_layernorm.weight", "attn.q_norm.weight"),
    "wq_b": ("self_attention.linear_q_up_proj.weight", "attn.wq_b.weight"),
    "wkv_a": ("self_attention.linear_kv_down_proj.weight", "attn.wkv.weight"),
    "kv_norm": ("self_attention.kv_layernorm.weight", "attn.kv_norm.weight"),
    "wo": ("self_attention.linear_proj.weight", "attn.wo.weight"),
    "idx_wq": ("self_attention.indexer.linear_wq_b.weight", "attn.indexer.wq_b.weight"),
    "idx_wk": ("self_attention.indexer.linear_wk.weight", "attn.indexer.wk.weight"),
    "idx_ww": ("self_attention.indexer.linear_weights_proj.weight", "attn.indexer.weights_proj.weight"),
    "ffn_hc_fn": ("mlp_hc.fn", "hc_ffn_fn"),
    "ffn_hc_scale": ("mlp_hc.scale", "hc_ffn_scale"),
    "ffn_hc_base": ("mlp_hc.base", "hc_ffn_base"),
    "ffn_norm": ("pre_mlp_layernorm.weight", "ffn_norm.weight"),
    "gate": ("mlp.router.weight", "ffn.gate.weight"),
    "gate_bias": ("mlp.router.expert_bias", "ffn.gate.bias"),
    "exp_w13": ("mlp.experts.weight1", None),
    "exp_w2": ("mlp.experts.weight2", None),
    "sh_w13": ("mlp.shared_experts.linear_fc1.weight", None),
    "sh_w2": ("mlp.shared_experts.linear_fc2.weight", None),
}
_GLOBAL = {"embed": ("embedding.word_embeddings.weight", "embed.weight"),
           "final_norm": ("decoder.final_layernorm.weight", "norm.weight"),
           "lm_head": ("output_layer.weight", "head.weight")}


def _split(name: str):
    if name.startswith("layers."):
        _, l, suffix = name.split(".", 2)
        return int(l), suffix
    return None, name


def module_name(harness_name: str) -> str:
    """The actor's parameter name (``named_parameters()``) of a harness master name."""
    l, s = _split(harness_name)
    if l is None:
        return _GLOBAL[s][0]
    return f"decoder.layers.{l}.{_LAYER[s][0]}"


def checkpoint_parts(harness_name: str, cfg: ModelConfig) -> list:
    """``[(checkpoint name, index)]``: the checkpoint tensor(s) one harness master is stored as; ``index`` is
    the part of the master each holds (``master[index]``)."""
    l, s = _split(harness_name)
    if l is None:
        return [(_GLOBAL[s][1], ())]
    p = f"layers.{l}."
    if s in ("exp_w13", "exp_w2"):
        I = cfg.moe_inter
        out = []
        for e in range(cfg.experts):
            f = p + f"ffn.experts.{e}."
            if s == "exp_w13":
                out += [(f + "w1.weight", (e, slice(0, I))), (f + "w3.weight", (e, slice(I, 2 * I)))]
            else:
                out.append((f + "w2.weight", (e,)))
        return out
    if s == "sh_w13":
        Is = cfg.shared_inter
        return [(p + "ffn.shared_experts.w1.weight", (slice(0, Is),)),
                (p + "ffn.shared_experts.w3.weight", (slice(Is, 2 * Is),))]
    if s == "sh_w2":
        return [(p + "ffn.shared_experts.w2.weight", ())]
    return [(p + _LAYER[s][1], ())]


def mapping(cfg: ModelConfig) -> list:
    """``[(harness name, module parameter name, [checkpoint names])]`` for every master of ``cfg``."""
    return [(n, module_name(n), [c for c, _ in checkpoint_parts(n, cfg)]) for n in param_shapes(cfg)]


def _scale_index(index: tuple) -> tuple:
    out = []
    for i in index:
        if isinstance(i, slice):
            if i.start % BLOCK or i.stop % BLOCK:
                raise ValueError(f"zerodiff: split {i} is not aligned to the {BLOCK}-row FP8 blocks")
            out.append(slice(i.start // BLOCK, i.stop // BLOCK))
        else:
            out.append(i)
    return tuple(out)


def _scale_name(ckpt_name: str) -> str:
    return ckpt_name[: -len(".weight")] + ".scale"


# ------------------------------------------------------------------------------ deployment export / refit
def export_deployment(deployment: Deployment, cfg: ModelConfig) -> dict:
    """The deployment as checkpoint tensors (names above): FP8 linears as ``.weight`` e4m3 + ``.scale`` FP32
    views of the deployment's own storage, the rest as the deployed tensors. No copy is made."""
    out = {}
    for name, d in deployment.tensors.items():
        for ck, idx in checkpoint_parts(name, cfg):
            if isinstance(d, Fp8Weight):
                out[ck] = d.q[idx]
                out[_scale_name(ck)] = d.scale[_scale_index(idx)]
            else:
                out[ck] = d[idx]
    return out


def refit_(deployment: Deployment, exported: dict, cfg: ModelConfig) -> int:
    """Write ``exported`` (checkpoint tensors, e.g. :func:`export_deployment` of the actor) into ``deployment``
    IN PLACE: the same storage, so captured CUDA graphs keep their addresses. Returns the number of tensors
    written. Raises :class:`ConfigError` for a missing name, a shape / dtype mismatch or a moved storage."""
    before = deployment.data_ptrs()
    n = 0
    with torch.no_grad():
        for name, d in deployment.tensors.items():
            for ck, idx in checkpoint_parts(name, cfg):
                pairs = [(d.q[idx], ck), (d.scale[_scale_index(idx)], _scale_name(ck))] if isinstance(d, Fp8Weight) \
                    else [(d[idx], ck)]
                for dst, key in pairs:
                    src = exported.get(key)
                    if src is None:
                        raise ConfigError(f"zerodiff refit: {key} missing from the exported weights")
                    if src.shape != dst.shape or src.dtype != dst.dtype:
                        raise ConfigError(f"zerodiff refit: {key} is {tuple(src.shape)} {src.dtype}, the rollout "
                                          f"holds {tuple(dst.shape)} {dst.dtype}")
                    dst.copy_(src)
                    n += 1
    if deployment.data_ptrs() != before:  # pragma: no cover - copy_ never moves storage
        raise ConfigError("zerodiff refit: a deployment tensor moved; captured CUDA graphs would read stale memory")
    return n


def masters_as_checkpoint(masters: dict, cfg: ModelConfig) -> dict:
    """Masters under their checkpoint names (views, no copy)."""
    out = {}
    for name, m in masters.items():
        for ck, idx in checkpoint_parts(name, cfg):
            out[ck] = m.detach()[idx]
    return out


def masters_from_checkpoint(tensors: dict, cfg: ModelConfig) -> dict:
    """Harness masters (new CPU tensors) from checkpoint-named masters; :class:`ConfigError` for a missing or
    mis-shaped tensor."""
    out = {}
    for name, (shape, dtype, _) in param_shapes(cfg).items():
        t = torch.empty(shape, dtype=dtype)
        for ck, idx in checkpoint_parts(name, cfg):
            src = tensors.get(ck)
            if src is None:
                raise ConfigError(f"zerodiff actor checkpoint: masters/ has no {ck}")
            dst = t[idx]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ConfigError(f"zerodiff actor checkpoint: {ck} is {tuple(src.shape)} {src.dtype}, expected "
                                  f"{tuple(dst.shape)} {dst.dtype}")
            dst.copy_(src)
        out[name] = t
    return out


def dequantized_masters(tensors: dict, cfg: ModelConfig) -> dict:
    """Masters rebuilt from the deployment tensors alone: FP8 linears as ``bf16(e4m3 * scale)`` (FP32 product,
    one rounding to BF16), the rest as stored. NOT the original masters (FP32 block scales are not powers of
    two, so the product is rounded), so a model built from them computes other values."""
    from ....reference.fp8_quant import dequant_weight_block_ref

    deq = {}
    for ck, t in tensors.items():
        sname = _scale_name(ck) if ck.endswith(".weight") else None
        if t.dtype == torch.float8_e4m3fn:
            deq[ck] = dequant_weight_block_ref(t, tensors[sname], BLOCK).to(torch.bfloat16)
        elif not ck.endswith(".scale"):
            deq[ck] = t
    return masters_from_checkpoint(deq, cfg)


# ------------------------------------------------------------------------------ files
def save_checkpoint(model, out, *, force: bool = False) -> dict:
    """Write the actor's checkpoint (``config.json``, FP8 deployment shards, ``masters/``) to ``out``; the
    deployment is requantised from the current masters first. A non-empty ``out`` is refused unless ``force``
    (then it is replaced). Returns ``{relative file: bytes}``."""
    from ....checkpoint.dsv4 import DEFAULT_SHARD_BYTES, _check_out, _write_sharded

    import shutil

    out = Path(out)
    _check_out(out, force)
    if out.is_dir() and force:
        shutil.rmtree(out)  # no file of an older checkpoint may survive next to the new one
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.model_cfg
    model.refresh_deployment()
    (out / "config.json").write_text(json.dumps(harness_config_json(cfg), indent=2) + "\n")
    files = {"config.json": (out / "config.json").stat().st_size}
    dep = {k: v.contiguous() for k, v in export_deployment(model.deployment, cfg).items()}
    files.update(_write_sharded(out, dep, DEFAULT_SHARD_BYTES))
    (out / "masters").mkdir(exist_ok=True)
    mas = {k: v.contiguous() for k, v in masters_as_checkpoint(model.masters, cfg).items()}
    mf = _write_sharded(out / "masters", mas, DEFAULT_SHARD_BYTES)
    files.update({f"masters/{k}": v for k, v in mf.items()})
    return files


def read_actor_checkpoint(d, *, dequantize: bool = False) -> tuple:
    """``(ModelConfig, masters, how)`` of a checkpoint directory. ``how`` is ``"masters"`` (bit-exact, from
    ``masters/``) or ``"dequantized"`` (no ``masters/`` and ``dequantize=True``: see
    :func:`dequantized_masters`). Without ``masters/`` and without ``dequantize`` it refuses
    (:class:`ConfigError`), because the FP8 tensors alone do not determine the masters. A DeepSeek-V4
    checkpoint from ``zerodiff make-checkpoint`` is refused by its ``config.json`` (see
    :func:`.config.model_config_from_checkpoint_config`)."""
    from ....checkpoint.dsv4 import read_checkpoint, read_masters

    d = Path(d)
    if not (d / "config.json").is_file():
        raise ConfigError(f"zerodiff actor checkpoint: {d} has no config.json")
    cfg = model_config_from_checkpoint_config(json.loads((d / "config.json").read_text()))
    if (d / "masters").is_dir():
        return cfg, masters_from_checkpoint(read_masters(d), cfg), "masters"
    if not dequantize:
        raise ConfigError(f"zerodiff actor checkpoint: {d} has no masters/ (write it with masters); the FP8 "
                          "weights alone do not give the BF16 masters bit for bit. Pass dequantize=True "
                          "(--dequantize) to start from bf16(e4m3 * scale) instead")
    _, tensors = read_checkpoint(d)
    return cfg, dequantized_masters(tensors, cfg), "dequantized"


def is_fp8_master(name: str) -> bool:
    return is_fp8(name)


# ------------------------------------------------------------------------------ DeepSeek-V4 checkpoints
_NO_COUNTERPART = (  # (substring of a released tensor name, why the actor has no parameter for it)
    (".compressor.", "compressed attention (C4A / C128A compressor)"),
    (".attn_sink", "attention sinks"),
    (".wo_a.", "grouped output LoRA (wo_a / wo_b)"),
    (".wo_b.", "grouped output LoRA (wo_a / wo_b)"),
    (".tid2eid", "hash-routed MoE (token-id table)"),
    ("hc_head_", "the final mHC head (hc_head)"),
)


def checkpoint_coverage(cj: dict) -> list:
    """For a DeepSeek-V4 ``config.json`` (``zerodiff make-checkpoint``): ``[(checkpoint tensor, actor parameter
    or None, note)]`` for every tensor the checkpoint holds, in file order. A tensor whose name the actor maps
    gets its parameter (shapes may still differ: the harness model is smaller); the others name the feature
    the actor lacks. What it shows is why such a checkpoint is refused, not a way to load it."""
    from ....checkpoint.dsv4 import checkpoint_layout

    pseudo = ModelConfig(layers=int(cj["num_hidden_layers"]), experts=int(cj["n_routed_experts"]))
    by_ck = {}
    for h, mod, cks in mapping(pseudo):
        for ck in cks:
            by_ck[ck] = mod
            by_ck[_scale_name(ck)] = mod + " (scale)"
    rows = []
    for name, _, _ in checkpoint_layout(cj):
        if name in by_ck:
            rows.append((name, by_ck[name], "mapped by name"))
            continue
        why = next((w for pat, w in _NO_COUNTERPART if pat in name), "no counterpart")
        rows.append((name, None, why))
    return rows
