"""Load a generated checkpoint into vLLM 0.33.0's NVIDIA ``DeepseekV4ForCausalLM`` on a CPU and check every value.

    python -m zerodiff.checkpoint.vllm_check CHECKPOINT_DIR [--json FILE]

Needs vLLM 0.33.0's Python tree importable (no compiled extension is used: only module construction and
weight loading run). What it does, in order:

1. ``EngineArgs(model=DIR, skip_tokenizer_init=True, kv_cache_dtype="fp8", enforce_eager=True, ...)
   .create_engine_config()`` with ``VLLM_TARGET_DEVICE=cpu``: vLLM parses config.json with transformers'
   ``DeepseekV4Config`` and resolves ``quant_method: fp8`` to ``deepseek_v4_fp8``.
2. Builds ``vllm.models.deepseek_v4.nvidia.model.DeepseekV4ForCausalLM`` (the class vLLM instantiates on
   CUDA; imported directly because the CPU platform would pick the CPU variant) under
   ``set_current_vllm_config`` with a 1-rank gloo group, BF16 default dtype, on the CPU. Three stand-ins
   make that possible without a GPU, none of which creates, names or shapes a parameter:
   ``torch.cuda.Stream`` / ``torch.cuda.Event`` (overlap streams), ``fp8.init_fp8_linear_kernel`` (picks the
   GEMM kernel the forward would call) and ``flashmla.compute_fp8_einsum_recipe`` (reads the GPU arch for
   the output projection's GEMM recipe).
3. Streams the shards through vLLM's default loader (``DefaultModelLoader.get_all_weights``: index
   filtering, ``safetensors`` iteration) into ``model.load_weights`` (the weights mapper, stacked / fused
   parameters, the expert mapping, each parameter's ``weight_loader``).
4. Checks: every model parameter was loaded; every checkpoint tensor was consumed; every loaded parameter
   equals the checkpoint tensor(s) it was built from (fused q/kv and compressor kv/gate, merged gate/up of
   the shared expert, stacked experts, FP8 codes bitwise, scales, hash table, norms, mHC, sinks, biases).

Prints one line per failure and a verdict; exits 0 only when every check passed. ``--json`` writes the
report: vLLM's parameter list (name, shape, dtype), the checkpoint's tensor list, failures.
The post-load weight processing (DeepGEMM layouts, UE8M0 requantisation) is not run: it needs the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _str_dtype(d) -> str:
    return str(d).replace("torch.", "")


def build_and_load(ckpt_dir: str, max_model_len: int = 4096):
    """``(model, loaded_param_names, consumed_checkpoint_names)`` after vLLM's load of ``ckpt_dir``."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    args = EngineArgs(model=ckpt_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16",
                      kv_cache_dtype="fp8", enforce_eager=True, max_num_batched_tokens=max_model_len)
    vc = args.create_engine_config()
    if vc.model_config.quantization != "deepseek_v4_fp8":
        raise RuntimeError(f"vLLM resolved quantization {vc.model_config.quantization!r}, not deepseek_v4_fp8")

    class _NoGpuObject:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: None

    torch.cuda.Stream = _NoGpuObject
    torch.cuda.Event = _NoGpuObject
    port = 29500 + os.getpid() % 1000
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        import vllm.model_executor.layers.quantization.fp8 as fp8_mod
        import vllm.models.deepseek_v4.nvidia.flashmla as flashmla_mod

        fp8_mod.init_fp8_linear_kernel = lambda **kw: _NoGpuObject()
        flashmla_mod.compute_fp8_einsum_recipe = lambda: (None, False)
        from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = DeepseekV4ForCausalLM(vllm_config=vc)
        finally:
            torch.set_default_dtype(old)
        loader = get_model_loader(vc.load_config)
        loader._init_ep_weight_filter(vc.model_config)
        loader._init_mm_encoder_only_weight_filter(model, vc.model_config)
        consumed = []

        def stream():
            for name, t in loader.get_all_weights(vc.model_config, model):
                consumed.append(name)
                yield name, t

        loaded = model.load_weights(stream())
    return model, set(loaded), consumed


def expected_params(cfg: dict, tensors: dict) -> dict:
    """vLLM parameter name -> the tensor it must hold after loading, built from the checkpoint tensors by
    the mapping read from ``DeepseekV4ForCausalLM`` (prefixes, ``.scale`` -> ``.weight_scale_inv``, fused
    and stacked parameters, experts stacked on dim 0)."""
    import torch

    def pfx(name: str) -> str:
        if name.startswith(("layers.", "norm.", "hc_head")):
            return "model." + name
        if name == "embed.weight":
            return "model.embed_tokens.weight"
        if name == "head.weight":
            return "lm_head.weight"
        raise KeyError(name)

    def sfx(leaf: str) -> str:
        return "weight_scale_inv" if leaf == "scale" else leaf

    out, used = {}, set()
    n = int(cfg["num_hidden_layers"])
    E = int(cfg["n_routed_experts"])
    for i in range(n):
        p = f"layers.{i}"
        pairs = [(f"{p}.attn.fused_wqa_wkv", [f"{p}.attn.wq_a", f"{p}.attn.wkv"]),
                 (f"{p}.attn.compressor.fused_wkv_wgate", [f"{p}.attn.compressor.wkv", f"{p}.attn.compressor.wgate"]),
                 (f"{p}.attn.indexer.compressor.fused_wkv_wgate",
                  [f"{p}.attn.indexer.compressor.wkv", f"{p}.attn.indexer.compressor.wgate"]),
                 (f"{p}.ffn.shared_experts.gate_up_proj", [f"{p}.ffn.shared_experts.w1", f"{p}.ffn.shared_experts.w3"])]
        for fused, parts in pairs:
            for leaf in ("weight", "scale"):
                names = [f"{x}.{leaf}" for x in parts]
                if all(k in tensors for k in names):
                    out[pfx(f"{fused}.{sfx(leaf)}")] = torch.cat([tensors[k] for k in names], 0)
                    used.update(names)
        for leaf in ("weight", "scale"):
            k = f"{p}.ffn.shared_experts.w2.{leaf}"
            if k in tensors:
                out[pfx(f"{p}.ffn.shared_experts.down_proj.{sfx(leaf)}")] = tensors[k]
                used.add(k)
            w1 = [f"{p}.ffn.experts.{e}.w1.{leaf}" for e in range(E)]
            w3 = [f"{p}.ffn.experts.{e}.w3.{leaf}" for e in range(E)]
            w2 = [f"{p}.ffn.experts.{e}.w2.{leaf}" for e in range(E)]
            if all(k in tensors for k in w1 + w2 + w3):
                base = pfx(f"{p}.ffn.experts.routed_experts")
                out[f"{base}.w13_{sfx(leaf)}"] = torch.stack(
                    [torch.cat([tensors[a], tensors[b]], 0) for a, b in zip(w1, w3)])
                out[f"{base}.w2_{sfx(leaf)}"] = torch.stack([tensors[k] for k in w2])
                used.update(w1 + w2 + w3)
    for name, t in tensors.items():
        if name in used:
            continue
        head, _, leaf = name.rpartition(".")
        if name.endswith(".ffn.gate.bias"):
            out[pfx(head + ".e_score_correction_bias")] = t
        elif leaf == "scale":
            out[pfx(head + ".weight_scale_inv")] = t
        else:
            out[pfx(name)] = t
    return out


def check(ckpt_dir: str, json_path: str | None = None) -> int:
    import torch

    from .dsv4 import read_checkpoint

    t0 = time.time()
    cfg, tensors = read_checkpoint(ckpt_dir)
    model, loaded, consumed = build_and_load(ckpt_dir)
    params = dict(model.named_parameters())
    failures = []
    for name in sorted(set(params) - loaded):
        failures.append(f"not loaded: {name}")
    for name in sorted(set(tensors) - set(consumed)):
        failures.append(f"checkpoint tensor never reached load_weights: {name}")
    want = expected_params(cfg, tensors)
    for name in sorted(set(want) - set(params)):
        failures.append(f"expected vLLM parameter missing: {name}")
    for name in sorted(set(params) - set(want)):
        failures.append(f"vLLM parameter with no checkpoint source: {name}")
    for name in sorted(set(want) & set(params)):
        got, exp = params[name].data, want[name]
        if tuple(got.shape) != tuple(exp.shape):
            failures.append(f"{name}: shape {tuple(got.shape)} != checkpoint {tuple(exp.shape)}")
            continue
        if got.dtype == exp.dtype:
            same = torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got, exp.view(torch.uint8)
                               if exp.dtype.itemsize == 1 else exp)
        else:
            same = torch.equal(got.to(torch.float64), exp.to(torch.float64))
        if not same:
            failures.append(f"{name}: loaded value differs from the checkpoint ({got.dtype} vs {exp.dtype})")
    report = {
        "checkpoint": os.path.abspath(ckpt_dir),
        "vllm_params": [[n, list(p.shape), _str_dtype(p.dtype)] for n, p in params.items()],
        "checkpoint_tensors": [[n, list(t.shape), _str_dtype(t.dtype)] for n, t in tensors.items()],
        "loaded": len(loaded),
        "consumed": len(consumed),
        "failures": failures,
        "seconds": round(time.time() - t0, 1),
    }
    for f in failures:
        print("FAIL", f)
    verdict = "OK" if not failures else f"{len(failures)} FAILURES"
    print(f"vllm_check {verdict}: {len(params)} vLLM parameters loaded from {len(consumed)} checkpoint tensors "
          f"({report['seconds']} s)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0 if not failures else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerodiff.checkpoint.vllm_check", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--json", default=None, help="write the report (parameter lists, failures) to this file")
    a = ap.parse_args(argv)
    return check(a.checkpoint, a.json)


if __name__ == "__main__":
    sys.exit(main())
