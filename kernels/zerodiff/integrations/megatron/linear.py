"""Linears: the training forward runs the rollout's GEMMs (block-FP8 on a deployment copy of the BF16 master,
or the fixed-order BF16 GEMM for the LM head and BF16 layers), with a straight-through backward to the master.

Deployment constants (the same on every Megatron call site, chosen to equal the vLLM side)
---------------------------------------------------------------------------------------
* :data:`FP8_UE8M0` (True): block-FP8 scales are powers of two (UE8M0), weights and activations. DeepSeek's FP8
  checkpoints store power-of-two weight scales, and vLLM's consistent linears and experts quantise their
  activations with UE8M0 scales when ``is_deep_gemm_e8m0_used()`` (its default, ``VLLM_USE_DEEP_GEMM_E8M0=1``,
  wherever DeepGEMM is available: SM90 and SM100). Requantising a master that came from such a checkpoint by
  the UE8M0 rule gives back the checkpoint's values exactly (the scale is a power of two, so every dequantised
  value is representable again); FP32 scales (``amax / 448``) would not.
* :func:`fp8_gemm_backend`: the dense block-FP8 GEMM backend is pinned, never probed: ``reference`` for CPU
  tensors (the vLLM side's choice there), else ``$ZERODIFF_FP8_GEMM_BACKEND`` (``triton`` | ``deepgemm`` |
  ``reference``, the variable the vLLM side reads), ``triton`` when unset (what ``zerodiff vllm-check`` pins on
  the consistent side by default). Run the rollout with the same value: with the variable unset the vLLM side
  picks per weight shape after a probe, which may be ``deepgemm``.
* MoE experts: :func:`moe_backend` = ``triton`` on CUDA, ``reference`` on CPU (what ``zerodiff.ops.moe``
  resolves ``backend=None`` to on the vLLM side).

Routing (the patched ``ColumnParallelLinear.forward`` / ``RowParallelLinear.forward`` call :func:`parallel_linear`)
------------------------------------------------------------------------------------------------------------
Every parallel linear is routed when consistency mode is on:

* the LM head (weight tagged ``is_embedding_or_output_parameter``, Megatron's tag for the output layer and the
  shared embedding it may use): FP32 logits from ``zerodiff.ops.bf16_gemm`` (vLLM's ``lm_head_logits``);
* a module with ``zerodiff_fp8 = False`` (:func:`mark_bf16_linears`: layers the rollout keeps in BF16): BF16
  output from ``zerodiff.ops.bf16_gemm`` (vLLM's ``bf16_linear``);
* every other one: block FP8 (``zerodiff.ops.fp8_gemm.fp8_linear`` on the deployment copy).

Refused (:class:`ConfigError`): a bias, a sharded layer (tensor parallel: partition size != full size, or a TP
group of more than one rank), sequence parallelism, non-BF16 weights.
"""

from __future__ import annotations

import os

import torch

from .. import ConfigError
from .common import _linear_ste_backward, _save_linear_ste

__all__ = ["FP8_UE8M0", "fp8_gemm_backend", "moe_backend", "deploy_fp8", "fp8_linear", "Fp8Linear",
           "bf16_linear", "lm_head_logits", "FP8_ATTR", "mark_fp8_linears", "mark_bf16_linears",
           "parallel_linear", "parallel_linear_fp8"]

#: power-of-two (UE8M0) block-FP8 scales for every deployment copy and activation quant (see module docstring)
FP8_UE8M0 = True

_GEMM_ENV = "ZERODIFF_FP8_GEMM_BACKEND"
_GEMM_BACKENDS = ("triton", "deepgemm", "reference")


def fp8_gemm_backend(device, environ=None) -> str:
    """The dense block-FP8 GEMM backend for tensors on ``device``: ``reference`` on CPU, else
    ``$ZERODIFF_FP8_GEMM_BACKEND`` or ``triton`` (never a probe; see the module docstring)."""
    if torch.device(device).type != "cuda":
        return "reference"
    v = (os.environ if environ is None else environ).get(_GEMM_ENV) or "triton"
    if v not in _GEMM_BACKENDS:
        raise ConfigError(f"{_GEMM_ENV}={v!r}: use one of {_GEMM_BACKENDS} (the same value on the rollout side)")
    return v


def moe_backend(device) -> str:
    """The routed experts' backend for tensors on ``device``: ``triton`` on CUDA, ``reference`` on CPU."""
    return "triton" if torch.device(device).type == "cuda" else "reference"


# --------------------------------------------------------------------------------------------- FP8 linear
class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, master, fp8_weight):
        from ...ops.fp8_gemm import fp8_linear as zd_fp8_linear

        _save_linear_ste(ctx, x2, master)
        return zd_fp8_linear(x2, fp8_weight, backend=fp8_gemm_backend(x2.device))

    @staticmethod
    def backward(ctx, g):
        return (*_linear_ste_backward(ctx, g), None)


def fp8_linear(x: torch.Tensor, master_weight: torch.Tensor, fp8_weight) -> torch.Tensor:
    """Block-FP8 linear forward (``zerodiff.ops.fp8_gemm.fp8_linear`` on ``fp8_weight``, the deployment bytes
    of ``master_weight``, backend :func:`fp8_gemm_backend`), straight-through backward w.r.t. the BF16 master."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _Fp8Linear.apply(x2, master_weight, fp8_weight)
    return out.view(*lead, out.shape[-1])


@torch.no_grad()
def deploy_fp8(master: torch.Tensor, into=None):
    """The block-FP8 deployment copy of a BF16 ``master`` by the deployment rule (scales :data:`FP8_UE8M0`): a
    new ``Fp8Weight``, or written IN PLACE into ``into`` (same storage: CUDA graphs keep their addresses) when
    it has the master's shape and device.

    The training side calls this on EVERY forward instead of tracking whether the master changed:
    Megatron's optimizers write the masters through ``param.data`` (``Float16OptimizerWithFloat16Params``
    copies its FP32 main params back with ``.data.copy_``) or through the flat param-and-grad buffer the
    params view (distributed optimizer, param all-gather, possibly overlapped with the next forward), and
    neither moves ``param._version``. Requantising from the master at use is correct for every write path;
    it costs one pass over the weight (read BF16, write FP8) per forward."""
    from ...ops.fp8_quant import Fp8Weight

    with torch.inference_mode(False):  # storage reused by later training forwards must not be an inference tensor
        w = master.detach()
        if (into is None or tuple(into.q.shape) != tuple(w.shape) or into.q.device != w.device
                or into.ue8m0 != FP8_UE8M0):
            return Fp8Weight.from_master(w, ue8m0=FP8_UE8M0)
        return into.requantize_(w)


class Fp8Linear(torch.nn.Module):
    """BF16 master ``weight [N, K]`` + its block-FP8 deployment copy. Every forward first requantises the copy
    from the master IN PLACE (same storage, CUDA-graph safe), so the forward always runs the current master's
    deployment bytes however the master was written (see :func:`deploy_fp8`)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16).clone())
        self.fp8 = deploy_fp8(self.weight)

    def refresh(self) -> None:
        """Requantise the deployment copy from the master now (the forward does this itself)."""
        self.fp8 = deploy_fp8(self.weight, self.fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.refresh()
        return fp8_linear(x, self.weight, self.fp8)


# --------------------------------------------------------------------------- BF16 GEMM (LM head, BF16 layers)
class _Bf16Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, fp32_out):
        from ...ops.bf16_gemm import bf16_gemm

        _save_linear_ste(ctx, x2, w)
        return bf16_gemm(x2, w, out_dtype=torch.float32 if fp32_out else torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
        return (*_linear_ste_backward(ctx, g), None)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T`` through ``zerodiff.ops.bf16_gemm`` (the vLLM side's ``bf16_linear``:
    FP32 accumulation, configuration from (N, K) only), rounded once to ``out_dtype`` (bf16 or fp32); FP32
    backward w.r.t. ``x`` and the BF16 weight."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff BF16 linear: input ({x.dtype}) and weight ({weight.dtype}) must be bfloat16")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"zerodiff BF16 linear: out_dtype must be bfloat16 or float32, got {out_dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = _Bf16Linear.apply(x2, w, out_dtype == torch.float32)
    return out.view(*lead, weight.shape[0])


def lm_head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """FP32 logits ``bf16_gemm(x, W, out_dtype=fp32)``: the rollout's LM head (vLLM's ``lm_head_logits``), never
    rounded to BF16, so the log-probs read from them are the rollout's."""
    return bf16_linear(x, weight, out_dtype=torch.float32)


# ------------------------------------------------------------------------------- parallel linear layers
#: attribute on a ColumnParallelLinear / RowParallelLinear: absent or True = block FP8 (the default), False = the
#: rollout keeps this layer in BF16 (:func:`mark_bf16_linears`).
FP8_ATTR = "zerodiff_fp8"


def _mark(model: torch.nn.Module, predicate, value: bool) -> list[str]:
    names = []
    for name, mod in model.named_modules():
        if hasattr(mod, "weight") and predicate(name, mod):
            setattr(mod, FP8_ATTR, value)
            names.append(name)
    return names


def mark_fp8_linears(model: torch.nn.Module, predicate) -> list[str]:
    """Set ``zerodiff_fp8 = True`` on every submodule with a weight for which ``predicate(name, module)`` is
    true (FP8 is already the default; this undoes :func:`mark_bf16_linears`). Returns the names marked."""
    return _mark(model, predicate, True)


def mark_bf16_linears(model: torch.nn.Module, predicate) -> list[str]:
    """Set ``zerodiff_fp8 = False`` on every submodule with a weight for which ``predicate(name, module)`` is
    true: the layers the rollout runs as unquantised BF16 GEMMs (the checkpoint did not quantise them). They go
    through ``zerodiff.ops.bf16_gemm``. Returns the names marked."""
    return _mark(model, predicate, False)


def _group_size(group) -> int:
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return int(torch.distributed.get_world_size(group))


def _refuse_unroutable(module: torch.nn.Module, w: torch.Tensor) -> None:
    name = type(module).__name__
    problems = []
    if getattr(module, "bias", None) is not None:
        problems.append("a bias (add_bias_linear=False)")
    for part, full in (("output_size_per_partition", "output_size"), ("input_size_per_partition", "input_size")):
        p, f = getattr(module, part, None), getattr(module, full, None)
        if p is not None and f is not None and int(p) != int(f):
            problems.append(f"a tensor-parallel shard ({part}={p} of {full}={f}; tensor_model_parallel_size must be 1)")
    tp = _group_size(getattr(module, "tp_group", None))
    if tp > 1:
        problems.append(f"a tensor-parallel group of {tp} ranks (tensor_model_parallel_size must be 1)")
    if getattr(module, "sequence_parallel", False):
        problems.append("sequence_parallel=True")
    if w.dtype != torch.bfloat16:
        problems.append(f"a {w.dtype} master weight (bfloat16 expected: Float16Module with bf16=True)")
    if problems:
        raise ConfigError(f"zerodiff linear ({name}) cannot run in consistency mode with " + "; ".join(problems))


def _deployment(module: torch.nn.Module, weight: torch.Tensor):
    """The module's block-FP8 deployment copy, requantised from ``weight`` on this call (see :func:`deploy_fp8`)."""
    fp8 = deploy_fp8(weight, getattr(module, "_zerodiff_fp8_weight", None))
    module._zerodiff_fp8_weight = fp8
    return fp8


def parallel_linear(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None):
    """The patched ``ColumnParallelLinear.forward`` / ``RowParallelLinear.forward`` (every instance, TP = 1):
    ``(output, None)`` by the routing rules of the module docstring: FP32 logits for the LM head, BF16
    ``bf16_gemm`` for layers marked ``zerodiff_fp8 = False``, block FP8 otherwise."""
    w = module.weight if weight is None else weight
    if w is None:
        raise ConfigError(f"zerodiff linear ({type(module).__name__}): no weight (skip_weight_param_allocation "
                          "without a weight passed to forward)")
    _refuse_unroutable(module, w)
    if getattr(w, "is_embedding_or_output_parameter", False):
        return lm_head_logits(x, w), None
    if getattr(module, FP8_ATTR, True) is False:
        return bf16_linear(x, w), None
    return fp8_linear(x, w, _deployment(module, w)), None


def parallel_linear_fp8(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None):
    """``(fp8_linear(x, master, deployment), None)`` for one parallel linear whatever its marks (the FP8 branch
    of :func:`parallel_linear`, with the same refusals)."""
    w = module.weight if weight is None else weight
    _refuse_unroutable(module, w)
    return fp8_linear(x, w, _deployment(module, w)), None
