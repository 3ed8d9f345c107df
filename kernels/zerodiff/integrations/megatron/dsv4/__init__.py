"""DeepSeek-V4 training actor inside megatron-core 0.19.2, built from zerodiff's training forward.

Modules: ``config`` (the ``TransformerConfig`` translation, checkpoint ``config.json``), ``model`` (the
``MegatronModule``, ``model_provider``), ``weights`` (name mapping, checkpoint files, deployment export and
in-place refit), ``functions`` (log-probs where Megatron-RL reads them), ``guard`` (refusals), ``optimizer``
(megatron-core's mixed-precision optimizer over the actor), ``acceptance`` (``zerodiff megatron-check``).

``model`` imports megatron-core on first use (see :mod:`.mcore`); the other names are importable without it.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "DSV4Model": "model", "build_model": "model", "model_provider": "model",
    "transformer_config": "config", "dsv4_fields": "config", "model_config": "config", "DSV4Fields": "config",
    "model_config_from_checkpoint_config": "config",
    "save_checkpoint": "weights", "read_actor_checkpoint": "weights", "export_deployment": "weights",
    "refit_": "weights", "mapping": "weights",
    "selective_log_softmax": "functions", "cross_entropy": "functions", "token_logprobs": "functions",
    "check_actor": "guard", "actor_problems": "guard",
    "build_optimizer": "optimizer",
    "run_check": "acceptance",
}

__all__ = sorted(_LAZY) + ["build_from_checkpoint"]


def build_from_checkpoint(d, *, device="cpu", dequantize: bool = False, **config_overrides):
    """``(model, how)``: an actor built from checkpoint ``d``'s ``config.json`` and loaded with its masters
    (``how`` = ``"masters"``, bit-exact) or, with ``dequantize``, from its FP8 tensors (``"dequantized"``)."""
    from .model import build_model
    from .weights import read_actor_checkpoint

    cfg, masters, how = read_actor_checkpoint(d, dequantize=dequantize)
    m = build_model(cfg, device=device, **config_overrides)
    m.load_masters(masters)
    return m, how


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
