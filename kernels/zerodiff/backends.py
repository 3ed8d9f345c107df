"""Backend discovery: which kernel libraries are importable here, and where they come from.

zerodiff uses three kinds of backend:

* ``triton``    - our own batch-invariant Triton kernels (SM90 and SM100; CPU through the interpreter).
* ``deepgemm``  - DeepGEMM (block-FP8 GEMMs, grouped MoE GEMMs), used only where verified row-invariant.
* ``flashmla``  - FlashMLA's ``flash_mla_sparse_fwd`` (sparse MLA prefill kernel, reused for decode).
* ``reference`` - the pure-torch references, everywhere (slow; CPU CI and gradient checks).

DeepGEMM and FlashMLA come from an installed vLLM (``vllm.third_party.*``) or, without vLLM, from the
folder ``make kernels-from-wheel`` extracts out of vLLM 0.33.0's wheel (a stub ``vllm`` package holding
only those two libraries). Point ``ZERODIFF_WHEEL_KERNELS`` at that folder, or leave it at the default
``<repo>/build/wheel-kernels``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WHEEL_KERNELS = REPO_ROOT / "build" / "wheel-kernels"


def _wheel_kernels_dir() -> Path:
    return Path(os.environ.get("ZERODIFF_WHEEL_KERNELS", str(DEFAULT_WHEEL_KERNELS)))


def _ensure_vllm_path() -> str:
    """Make ``vllm.third_party`` importable; return where it came from ('vllm' or the extracted folder)."""
    try:
        import vllm  # noqa: F401

        return "vllm"
    except Exception:
        pass
    d = _wheel_kernels_dir()
    if (d / "vllm" / "__init__.py").exists():
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
        os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")  # DeepGEMM's JIT needs it
        return str(d)
    raise ImportError(
        f"neither vLLM nor extracted wheel kernels found (looked for {d}/vllm); run `make kernels-from-wheel`"
    )


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[ModuleType | None, str]:
    try:
        origin = _ensure_vllm_path()
        if name == "deepgemm":
            mod = importlib.import_module("vllm.third_party.deep_gemm")
        elif name == "flashmla":
            mod = importlib.import_module("vllm.third_party.flashmla.flash_mla_interface")
        else:
            raise KeyError(name)
        return mod, origin
    except Exception as e:  # record why, for `zerodiff doctor`
        return None, f"{type(e).__name__}: {e}"


def deep_gemm() -> ModuleType | None:
    """The DeepGEMM module, or None when it cannot be imported here."""
    return _load("deepgemm")[0]


def deep_gemm_on(device) -> tuple[ModuleType | None, str]:
    """(the DeepGEMM module, "") when DeepGEMM is importable and ``device`` (a torch.device) is CUDA, else (None,
    why not): the first test of every DeepGEMM probe."""
    dg = deep_gemm()
    if dg is None:
        return None, f"DeepGEMM not importable: {status()['deepgemm']['detail']}"
    if device.type != "cuda":
        return None, f"DeepGEMM needs a CUDA device, got {device}"
    return dg, ""


def flash_mla() -> ModuleType | None:
    """FlashMLA's Python interface (``flash_mla_sparse_fwd`` etc.), or None."""
    return _load("flashmla")[0]


def cuda_capability() -> tuple[int, int] | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_capability()
    except Exception:
        pass
    return None


def status() -> dict:
    """What is importable here and why not, for ``zerodiff doctor`` and test skips."""
    from . import _triton

    out = {
        "triton": {"available": _triton.HAVE_TRITON, "interpreter": _triton.INTERPRET},
        "reference": {"available": True},
    }
    for name in ("deepgemm", "flashmla"):
        mod, why = _load(name)
        out[name] = {"available": mod is not None, "detail": why}
    return out
