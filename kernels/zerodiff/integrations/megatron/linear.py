"""Block-FP8 linears: the training forward runs the rollout's FP8 GEMM on a deployment copy of the BF16
master, with a straight-through backward to the master."""

from __future__ import annotations

import torch

from .. import ConfigError
from .common import WeightVersionError, _check_versions, _versions

__all__ = ["fp8_linear", "Fp8Linear", "FP8_ATTR", "mark_fp8_linears", "parallel_linear_fp8"]


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
    """BF16 master ``weight [N, K]`` + its block-FP8 deployment copy, requantised IN PLACE (same storage,
    CUDA-graph safe) by :meth:`refresh` after each optimizer step. Forward refuses a stale deployment."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        from ...ops.fp8_quant import Fp8Weight

        self.weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16).clone())
        self.fp8 = Fp8Weight.from_master(self.weight.detach())
        self._deployed_version = self.weight._version

    @torch.no_grad()
    def refresh(self) -> None:
        self.fp8.requantize_(self.weight.detach())
        self._deployed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight._version != self._deployed_version:
            raise WeightVersionError("zerodiff Fp8Linear: the master weight changed since the last refresh(); "
                                     "call refresh() after the optimizer step")
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
def _deployment(module: torch.nn.Module, weight: torch.Tensor):
    """The module's block-FP8 deployment copy of ``weight``, requantised IN PLACE (same storage: CUDA graphs
    keep their addresses) whenever the master's version changed since the last quantisation."""
    from ...ops.fp8_quant import Fp8Weight

    fp8 = getattr(module, "_zerodiff_fp8_weight", None)
    if fp8 is None or tuple(fp8.q.shape) != tuple(weight.shape) or fp8.q.device != weight.device:
        fp8 = Fp8Weight.from_master(weight.detach())
        module._zerodiff_fp8_weight = fp8
    elif getattr(module, "_zerodiff_fp8_version", None) != weight._version:
        fp8.requantize_(weight.detach())
    module._zerodiff_fp8_version = weight._version
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

