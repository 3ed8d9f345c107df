"""vLLM 0.33.0's own compiled CUDA ops for the harness baseline, loaded without importing vLLM.

vLLM registers its ops in two stable-ABI libraries: ``vllm/_C_stable_libtorch.abi3.so`` (``torch.ops._C``:
RMSNorm, SiLU·mul, FP8 quant, the DSA per-row Top-K) and ``vllm/_moe_C_stable_libtorch.abi3.so``
(``torch.ops._moe_C``: the fused top-k routers). :func:`library` finds one by, in order: the op already being
registered (vLLM imported), ``ZERODIFF_VLLM_C_DIR`` (a folder holding the files), and ``vllm/<file>`` under every
``sys.path`` entry (the patched-vLLM runtime unpacked by ``build/vllm-runtime-unpack.sh`` puts its ``site`` there;
an installed vLLM too), then ``torch.ops.load_library``. The two files are 90 MB and 44 MB (64 MB and 37 MB
compressed), so they do not fit in the 64 MiB wheel-kernels tarball next to DeepGEMM and FlashMLA; they come
from the vLLM runtime.

Policy (``ZERODIFF_BASELINE_VLLM_OPS``): ``auto`` (default) uses an op where its library loads and its first call
passed the probe (:func:`probe_once`: the op's output against the torch path on the same input), otherwise the
present path runs and the reason is recorded in :data:`STATUS` (which ``zerodiff bench`` writes into its JSON);
``require`` raises :class:`~zerodiff.model.baseline_cuda.BaselineUnavailable` instead of running anything else;
``off`` never loads them (the present paths, recorded as such).

vLLM's mHC kernels are TileLang code inside its Python package, not compiled ops: :func:`tilelang_mhc_kernels`
imports ``vllm.model_executor.kernels.mhc.tilelang_kernels`` (vLLM and ``tilelang`` must both be importable; the
staged vLLM runtime does not ship ``tilelang``) under the same policy, the outcome in ``STATUS["tilelang mhc"]``.
"""

from __future__ import annotations

import os
import sys

import torch

LIBS = {"_C": "_C_stable_libtorch.abi3.so", "_moe_C": "_moe_C_stable_libtorch.abi3.so"}
#: one op of each library that tells whether it is registered
MARKER = {"_C": "rms_norm", "_moe_C": "topk_sigmoid"}
#: per library: "loaded from PATH" / "registered (vLLM imported)" / why not; per op: probe outcome
STATUS: dict = {}
_LOADED: dict = {}
_PROBED: dict = {}


def policy() -> str:
    p = os.environ.get("ZERODIFF_BASELINE_VLLM_OPS", "auto").strip().lower() or "auto"
    if p not in ("auto", "require", "off"):
        raise ValueError(f"zerodiff: ZERODIFF_BASELINE_VLLM_OPS={p!r} is not one of auto, require, off")
    return p


def _registered(ns: str) -> bool:
    try:
        getattr(getattr(torch.ops, ns), MARKER[ns])
        return True
    except (AttributeError, RuntimeError):
        return False


def candidates(ns: str) -> list:
    name = LIBS[ns]
    out = []
    d = os.environ.get("ZERODIFF_VLLM_C_DIR")
    if d:
        out.append(os.path.join(d, name))
    for entry in sys.path:
        if entry and os.path.isdir(os.path.join(entry, "vllm")):
            out.append(os.path.join(entry, "vllm", name))
    seen, res = set(), []
    for p in out:
        if p not in seen and os.path.isfile(p):
            seen.add(p)
            res.append(p)
    return res


def library(ns: str):
    """``torch.ops.<ns>`` when vLLM's library for it is registered or loadable here, else None (reason in
    STATUS). Never raises (the caller applies the policy)."""
    if ns in _LOADED:
        return _LOADED[ns]
    mod = None
    if policy() == "off":
        STATUS[ns] = "not loaded: ZERODIFF_BASELINE_VLLM_OPS=off"
    elif not torch.cuda.is_available():
        STATUS[ns] = "not loaded: no CUDA"
    elif _registered(ns):
        STATUS[ns] = "registered already (vLLM imported in this process)"
        mod = getattr(torch.ops, ns)
    else:
        paths = candidates(ns)
        errs = []
        for p in paths:
            try:
                torch.ops.load_library(p)
            except Exception as e:  # noqa: BLE001 - recorded; the next candidate may load
                errs.append(f"{p}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if _registered(ns):
                STATUS[ns] = f"loaded from {p}"
                mod = getattr(torch.ops, ns)
                break
            errs.append(f"{p}: loaded but torch.ops.{ns}.{MARKER[ns]} is not registered")
        if mod is None:
            STATUS[ns] = ("not loadable: " + "; ".join(errs)) if errs else (
                f"not found: no {LIBS[ns]} under ZERODIFF_VLLM_C_DIR or any sys.path entry's vllm/ (unpack the "
                "patched-vLLM runtime and put its site on PYTHONPATH, or point ZERODIFF_VLLM_C_DIR at its vllm/)")
    _LOADED[ns] = mod
    return mod


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def probe_once(op: str, run, reference, same) -> bool:
    """Whether ``op``'s vLLM kernel may be used: on its first call (outside any CUDA-graph capture) ``run()``
    and ``reference()`` are compared with ``same(a, b) -> (ok, detail)``; the outcome is kept for the process and
    written into STATUS. A first call inside a capture is not probed (the warm-up before capture makes the first
    call eager; recorded if it ever happens)."""
    if op in _PROBED:
        return _PROBED[op]
    if _capturing():
        STATUS[op] = "used without probe (first call inside a CUDA-graph capture)"
        return True
    try:
        a = run()
        b = reference()
        ok, detail = same(a, b)
    except Exception as e:  # noqa: BLE001 - a schema / launch error is a failed probe
        ok, detail = False, f"{type(e).__name__}: {str(e)[:300]}"
    _PROBED[op] = bool(ok)
    STATUS[op] = ("probe passed: " if ok else "probe FAILED: ") + detail
    return _PROBED[op]


def tilelang_mhc_kernels():
    """vLLM's TileLang mHC kernel module, or None (reason in ``STATUS["tilelang mhc"]``). Never raises.

    Imported only where ``tilelang`` and ``vllm`` are both importable and CUDA is present; importing it
    imports vLLM (seconds) and JIT-compiles each kernel at its first call for a shape (the bench's warm-up
    covers that)."""
    key = "tilelang mhc"
    if key in _LOADED:
        return _LOADED[key]
    import importlib
    import importlib.util

    mod = None
    if policy() == "off":
        STATUS[key] = "not loaded: ZERODIFF_BASELINE_VLLM_OPS=off"
    elif not torch.cuda.is_available():
        STATUS[key] = "not loaded: no CUDA"
    else:
        missing = [m for m in ("tilelang", "vllm") if importlib.util.find_spec(m) is None]
        if missing:
            STATUS[key] = f"not importable: no {' / '.join(missing)} module here (vLLM's CUDA mHC path needs both)"
        else:
            try:
                mod = importlib.import_module("vllm.model_executor.kernels.mhc.tilelang_kernels")
                STATUS[key] = f"imported from {mod.__file__}"
            except Exception as e:  # noqa: BLE001 - recorded; the caller applies the policy
                STATUS[key] = f"import failed: {type(e).__name__}: {str(e)[:300]}"
    _LOADED[key] = mod
    return mod
