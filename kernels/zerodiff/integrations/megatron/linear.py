"""Block-FP8 linears: the training forward runs the rollout's FP8 GEMM on a deployment copy of the BF16
master, with a straight-through backward to the master."""

from __future__ import annotations

import torch

from .. import ConfigError
from .common import _check_versions, _versions

__all__ = ["fp8_linear", "Fp8Linear", "FP8_ATTR", "mark_fp8_linears", "parallel_linear_fp8", "deploy_fp8"]


# --------------------------------------------------------------------------------------------- FP8 linear
class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, master, fp8_weight):
        from ...ops.fp8_gemm import fp8_linear as zd_fp8_linear

        ctx.save_for_backward(x2)
        ctx.zd_weight = master
        ctx.zd_versions = _versions(master)
        return zd_fp8_linear(x2, fp8_weight)

    @staticmethod
    def backward(ctx, g):
        master = ctx.zd_weight
        _check_versions(ctx, master)
        (x2,) = ctx.saved_tensors
        g = g.float()
        gx = (g @ master.float()).to(x2.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x2.float()).to(master.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def fp8_linear(x: torch.Tensor, master_weight: torch.Tensor, fp8_weight) -> torch.Tensor:
    """Block-FP8 linear forward (``zerodiff.ops.fp8_gemm.fp8_linear`` on ``fp8_weight``, the deployment bytes
    of ``master_weight``), straight-through backward w.r.t. the BF16 master."""
    lead = x.shape[:-1]
    out = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), master_weight, fp8_weight)
    return out.view(*lead, out.shape[-1])


class Fp8Linear(torch.nn.Module):
    """BF16 master ``weight [N, K]`` + its block-FP8 deployment copy. Every forward first requantises the copy
    from the master IN PLACE (same storage, CUDA-graph safe), so the forward always runs the current master's
    deployment bytes however the master was written (an optimizer writing ``weight.data`` or a flat buffer the
    weight views does not move ``weight._version``; see :func:`deploy_fp8`)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16).clone())
        self.fp8 = deploy_fp8(self.weight)

    def refresh(self) -> None:
        """Requantise the deployment copy from the master now (the forward does this itself)."""
        deploy_fp8(self.weight, self.fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.refresh()
        return fp8_linear(x, self.weight, self.fp8)


# ------------------------------------------------------------------------------- parallel linear layers
#: attribute a model builder sets on a ColumnParallelLinear / RowParallelLinear whose rollout twin is a
#: block-FP8 linear (the checkpoint quantised it); see :func:`mark_fp8_linears`.
FP8_ATTR = "zerodiff_fp8"


def mark_fp8_linears(model: torch.nn.Module, predicate) -> list[str]:
    """Set ``zerodiff_fp8 = True`` on every submodule for which ``predicate(name, module)`` is true (pick the
    layers the rollout runs as block-FP8 linears, e.g. from the checkpoint's quantisation config). Returns
    the names marked."""
    names = []
    for name, mod in model.named_modules():
        if hasattr(mod, "weight") and predicate(name, mod):
            setattr(mod, FP8_ATTR, True)
            names.append(name)
    return names


@torch.no_grad()
def deploy_fp8(master: torch.Tensor, into=None):
    """The block-FP8 deployment copy of a BF16 ``master`` by the deployment rule: a new ``Fp8Weight``, or
    written IN PLACE into ``into`` (same storage: CUDA graphs keep their addresses) when it has the master's
    shape and device.

    The training side calls this on EVERY forward instead of tracking whether the master changed:
    Megatron's optimizers write the masters through ``param.data`` (``Float16OptimizerWithFloat16Params``
    copies its FP32 main params back with ``.data.copy_``) or through the flat param-and-grad buffer the
    params view (distributed optimizer, param all-gather, possibly overlapped with the next forward), and
    neither moves ``param._version``. Requantising from the master at use is correct for every write path;
    it costs one pass over the weight (read BF16, write FP8) per forward."""
    from ...ops.fp8_quant import Fp8Weight

    with torch.inference_mode(False):  # storage reused by later training forwards must not be an inference tensor
        w = master.detach()
        if into is None or tuple(into.q.shape) != tuple(w.shape) or into.q.device != w.device:
            return Fp8Weight.from_master(w)
        return into.requantize_(w)


def _deployment(module: torch.nn.Module, weight: torch.Tensor):
    """The module's block-FP8 deployment copy, requantised from ``weight`` on this call (see :func:`deploy_fp8`)."""
    fp8 = deploy_fp8(weight, getattr(module, "_zerodiff_fp8_weight", None))
    module._zerodiff_fp8_weight = fp8
    return fp8


def parallel_linear_fp8(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None):
    """The patched ``ColumnParallelLinear.forward`` / ``RowParallelLinear.forward`` for layers marked
    ``zerodiff_fp8`` (TP = 1): ``(fp8_linear(x, master, deployment), None)`` with the straight-through
    backward of :func:`fp8_linear`. Biases are refused (the guard refuses ``add_bias_linear``)."""
    w = module.weight if weight is None else weight
    if getattr(module, "bias", None) is not None:
        raise ConfigError("zerodiff FP8 linear: a bias is not supported in consistency mode")
    if w.dtype != torch.bfloat16:
        raise ConfigError(f"zerodiff FP8 linear: the master weight must be bfloat16 (Float16Module), got {w.dtype}")
    return fp8_linear(x, w, _deployment(module, w)), None

