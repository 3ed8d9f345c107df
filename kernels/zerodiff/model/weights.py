"""Deterministic weights of the tiny DeepSeek-V4-shaped model: BF16 masters, FP8 deployment by the rule.

* :func:`init_masters` draws every master from one CPU ``torch.Generator`` seeded with ``seed``, in a fixed
  name order, so the same (config, seed) gives the same bits on every machine. Matrices are BF16, mHC
  parameters FP32 (as in DeepSeek-V4), the MoE router bias FP32.
* :class:`Deployment` is the rollout's (or the training forward's) weight storage: FP8 weights are
  :class:`zerodiff.ops.fp8_quant.Fp8Weight` quantised from the masters by the deployment rule, every other
  tensor is a copy of its master. :meth:`Deployment.update_` rewrites all of them IN PLACE (``copy_`` /
  ``requantize_``), so captured CUDA graphs keep valid addresses after an optimizer step.
* Parameters whose name starts with ``idx_`` (the DSA indexer) and the router bias are not trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .ops import Fp8Weight, _backend_for

#: suffixes of matrices deployed as block FP8 (everything else is deployed as a copy of its master)
FP8_SUFFIXES = ("wq_a", "wq_b", "wkv_a", "wo", "idx_wq", "idx_wk", "exp_w13", "exp_w2", "sh_w13", "sh_w2")


def is_fp8(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in FP8_SUFFIXES


def is_trainable(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return not (last.startswith("idx_") or last == "gate_bias")


def param_shapes(cfg: ModelConfig) -> dict:
    """name -> (shape, dtype, kind) in the fixed generation order."""
    n, H = cfg.hc_mult, cfg.hidden
    nm = n * (n + 2)
    bf, f32 = torch.bfloat16, torch.float32
    s = {"embed": ((cfg.vocab, H), bf, "normal")}
    for l in range(cfg.layers):
        p = f"layers.{l}."
        for sub in ("attn", "ffn"):
            s[p + f"{sub}_hc_fn"] = ((nm, n * H), f32, "normal")
            s[p + f"{sub}_hc_scale"] = ((3,), f32, "hc_scale")
            s[p + f"{sub}_hc_base"] = ((nm,), f32, "hc_base")
            s[p + f"{sub}_norm"] = ((H,), bf, "ones")
        s[p + "wq_a"] = ((cfg.q_lora, H), bf, "normal")
        s[p + "q_norm"] = ((cfg.q_lora,), bf, "ones")
        s[p + "wq_b"] = ((cfg.heads * cfg.d_qk, cfg.q_lora), bf, "normal")
        s[p + "wkv_a"] = ((cfg.d_latent + cfg.d_rope, H), bf, "normal")
        s[p + "kv_norm"] = ((cfg.d_latent,), bf, "ones")
        s[p + "wo"] = ((H, cfg.heads * cfg.d_latent), bf, "normal")
        s[p + "idx_wq"] = ((cfg.idx_heads * cfg.idx_dim, cfg.q_lora), bf, "normal")
        s[p + "idx_wk"] = ((cfg.idx_dim, H), bf, "normal")
        s[p + "idx_ww"] = ((cfg.idx_heads, H), bf, "normal")
        s[p + "gate"] = ((cfg.experts, H), bf, "normal")
        s[p + "gate_bias"] = ((cfg.experts,), f32, "small")
        s[p + "exp_w13"] = ((cfg.experts, 2 * cfg.moe_inter, H), bf, "normal")
        s[p + "exp_w2"] = ((cfg.experts, H, cfg.moe_inter), bf, "normal")
        s[p + "sh_w13"] = ((2 * cfg.shared_inter, H), bf, "normal")
        s[p + "sh_w2"] = ((H, cfg.shared_inter), bf, "normal")
    s["final_norm"] = ((H,), bf, "ones")
    s["lm_head"] = ((cfg.vocab, H), bf, "normal")
    return s


def init_masters(cfg: ModelConfig, seed: int, device="cpu") -> dict:
    """BF16/FP32 master parameters (``torch.nn.Parameter``; trainable ones require grad)."""
    g = torch.Generator().manual_seed(int(seed))
    n = cfg.hc_mult
    out = {}
    for name, (shape, dtype, kind) in param_shapes(cfg).items():
        if kind == "normal":
            fan_in = shape[-1]
            std = cfg.init_std if name != "embed" else 1.0
            if name.endswith("hc_fn"):
                std = 0.5 / math.sqrt(fan_in)
            t = torch.randn(shape, generator=g, dtype=torch.float32) * std
        elif kind == "ones":
            t = torch.ones(shape) + 0.1 * torch.randn(shape, generator=g)
        elif kind == "hc_scale":
            t = torch.tensor([1.0, 1.0, 1.0]) + 0.1 * torch.randn(shape, generator=g)
        elif kind == "hc_base":
            t = torch.zeros(shape)
            t[: n] = -1.0  # pre ~ sigmoid(-1)
            t[2 * n:] = torch.eye(n).flatten() * 2.0 + 0.1 * torch.randn(n * n, generator=g)
        elif kind == "small":
            t = 0.01 * torch.randn(shape, generator=g)
        else:  # pragma: no cover
            raise AssertionError(kind)
        t = t.to(dtype).to(device)
        out[name] = torch.nn.Parameter(t, requires_grad=is_trainable(name))
    return out


@dataclass
class W:
    """One weight as the model sees it: deployed value (Fp8Weight or tensor) + its master (or None)."""

    name: str
    dep: object
    master: torch.Tensor | None


class Deployment:
    """The weight storage a forward reads: FP8 by the deployment rule, copies for the rest."""

    def __init__(self, masters: dict):
        self.tensors: dict = {}
        with torch.no_grad():
            for name, m in masters.items():
                if is_fp8(name):
                    self.tensors[name] = Fp8Weight.from_master(m.detach(), backend=_backend_for(m))
                else:
                    self.tensors[name] = m.detach().clone()

    def update_(self, masters: dict) -> None:
        """Requantise / copy new master values into the SAME storage (addresses kept for CUDA graphs)."""
        with torch.no_grad():
            for name, m in masters.items():
                d = self.tensors[name]
                if isinstance(d, Fp8Weight):
                    d.requantize_(m.detach(), backend=_backend_for(m))
                else:
                    d.copy_(m.detach())

    def data_ptrs(self) -> dict:
        out = {}
        for k, d in self.tensors.items():
            out[k] = (d.q.data_ptr(), d.scale.data_ptr()) if isinstance(d, Fp8Weight) else d.data_ptr()
        return out

    def get(self, name: str, masters: dict | None = None) -> W:
        return W(name, self.tensors[name], None if masters is None else masters[name])
