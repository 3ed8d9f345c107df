"""`zerodiff doctor`: what this machine can run.

Reports Python, torch (and the CUDA it was built with), Triton, whether CUDA is available, the device name
and compute capability, which kernel backends are importable (DeepGEMM, FlashMLA, Triton, reference; via
:func:`zerodiff.backends.status`), the pins from ``build/pins``, and a verdict on the consistency mode:

* **yes**: a CUDA device of compute capability >= 9.0 (H200 = SM90, GB200 = SM100) and a compiled Triton;
* **reference kernels only**: no usable GPU; the pure-torch references (and the Triton interpreter) run,
  which is the CPU configuration of ``zerodiff check``;
* **no**: a GPU below SM90, or Triton missing on a GPU machine.

Nothing here raises: every probe that fails is reported with its reason.
"""

from __future__ import annotations

import json
import platform
import sys

MIN_CC = (9, 0)


def _torch_info() -> dict:
    try:
        import torch
    except Exception as e:
        return {"available": False, "detail": f"{type(e).__name__}: {e}"}
    info: dict = {"available": True, "version": torch.__version__, "cuda_build": torch.version.cuda}
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
    except Exception as e:  # a broken driver install
        info["cuda_available"] = False
        info["cuda_detail"] = f"{type(e).__name__}: {e}"
    if info["cuda_available"]:
        try:
            info["device_count"] = torch.cuda.device_count()
            info["device_name"] = torch.cuda.get_device_name(0)
            info["compute_capability"] = list(torch.cuda.get_device_capability(0))
        except Exception as e:
            info["cuda_detail"] = f"{type(e).__name__}: {e}"
    return info


def _triton_info() -> dict:
    try:
        import triton

        return {"available": True, "version": triton.__version__}
    except Exception as e:
        return {"available": False, "detail": f"{type(e).__name__}: {e}"}


def _pins_info() -> dict:
    from . import pins

    path = pins.pins_path()
    try:
        return {"path": str(path), "values": pins.load(path)}
    except pins.PinsError as e:
        return {"path": str(path) if path else None, "error": str(e)}


def verdict(torch_info: dict, triton_info: dict) -> tuple[str, str]:
    """(answer, reason) for "can the consistency mode run here?"; answer is 'yes', 'reference-only' or 'no'."""
    if not torch_info.get("available"):
        return "no", "torch is not importable"
    if not torch_info.get("cuda_available"):
        return "reference-only", "no CUDA device; this is the CPU config of `zerodiff check`"
    cc = tuple(torch_info.get("compute_capability") or (0, 0))
    if cc < MIN_CC:
        return "no", f"compute capability {cc[0]}.{cc[1]} < {MIN_CC[0]}.{MIN_CC[1]} (needs SM90 or newer)"
    if not triton_info.get("available"):
        return "no", "Triton is not importable (the batch-invariant kernels are Triton)"
    return "yes", f"CUDA device with compute capability {cc[0]}.{cc[1]} and Triton {triton_info['version']}"


def _deepgemm_cache_info() -> dict:
    """Where DeepGEMM keeps its JIT-compiled kernels and how many are there (``zerodiff warmup`` fills it)."""
    import os

    path = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")
    cache = os.path.join(path, "cache")
    try:
        n = len([d for d in os.listdir(cache) if os.path.isdir(os.path.join(cache, d))])
    except OSError:
        n = 0
    return {"path": path, "kernels": n, "from_env": bool(os.environ.get("DG_JIT_CACHE_DIR"))}


def _triton_cache_info() -> dict:
    """Where Triton keeps compiled kernels and how many are there (the GPU scripts carry it between machines)."""
    import os

    path = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        n = sum(1 for d in os.scandir(path)
                if d.is_dir() and any(f.endswith((".cubin", ".hsaco")) for f in os.listdir(d.path)))
    except OSError:
        n = 0
    return {"path": path, "kernels": n, "from_env": bool(os.environ.get("TRITON_CACHE_DIR"))}


def _kernel_configuration() -> dict:
    """The shipped kernel choices both sides read (see README "Kernel configurations")."""
    from .ops import attention as sa
    from .ops import mhc, topk
    from .ops.attention import flashmla_fp8 as fd

    return {"mhc": mhc.DEFAULT_VARIANT, "mhc_head": mhc.DEFAULT_HEAD_VARIANT, "topk": topk.VARIANT,
            "attention_read": sa.READ_BACKEND or "flashmla_fp8 where supported, else workspace",
            "attention_pieces": fd.PIECES_PER_ROW}


def _flashmla_fp8_info() -> dict:
    """Whether the default sparse MLA read path (FlashMLA's FP8 decode kernel under zerodiff's schedule) can run
    here, and why not."""
    try:
        import torch

        from .ops.attention import flashmla_fp8 as fd

        if not torch.cuda.is_available():
            return {"usable": False, "detail": "no CUDA device (the workspace / reference paths run instead)"}
        fd.decode_kernel("cuda")
        return {"usable": True, "detail": "FlashMLA's sparse_decode_fwd importable"}
    except Exception as e:  # report, never fail the doctor
        return {"usable": False, "detail": f"{type(e).__name__}: {e}"[:200]}


def collect() -> dict:
    from . import __version__, backends

    t, tr = _torch_info(), _triton_info()
    try:
        be = backends.status()
    except Exception as e:
        be = {"error": f"{type(e).__name__}: {e}"}
    answer, why = verdict(t, tr)
    return {
        "zerodiff": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": t,
        "triton": tr,
        "backends": be,
        "pins": _pins_info(),
        "deepgemm_jit_cache": _deepgemm_cache_info(),
        "triton_cache": _triton_cache_info(),
        "kernel_configuration": _kernel_configuration(),
        "flashmla_fp8": _flashmla_fp8_info(),
        "consistency_mode": {"can_run": answer, "reason": why},
    }


def render(r: dict) -> str:
    t, tr = r["torch"], r["triton"]
    lines = [f"zerodiff {r['zerodiff']}", f"python      {r['python']['version']} ({r['python']['executable']})"]
    if t["available"]:
        lines.append(f"torch       {t['version']} (CUDA build: {t['cuda_build'] or 'none, CPU-only wheel'})")
        if t["cuda_available"]:
            cc = t.get("compute_capability")
            lines.append(f"cuda        available: {t.get('device_count', '?')} device(s), {t.get('device_name', '?')}, "
                         f"compute capability {cc[0]}.{cc[1]}" if cc else "cuda        available (device query failed)")
        else:
            lines.append("cuda        not available" + (f" ({t['cuda_detail']})" if "cuda_detail" in t else ""))
    else:
        lines.append(f"torch       NOT importable: {t['detail']}")
    lines.append(f"triton      {tr['version']}" if tr["available"] else f"triton      NOT importable: {tr['detail']}")
    lines.append("backends")
    be = r["backends"]
    if "error" in be:
        lines.append(f"  (backend probe failed: {be['error']})")
    else:
        for name in ("triton", "deepgemm", "flashmla", "reference"):
            b = be.get(name, {})
            ok = "yes" if b.get("available") else "no "
            if name == "triton":
                if b.get("interpreter"):
                    extra = "CPU interpreter (TRITON_INTERPRET=1)"
                elif t.get("cuda_available"):
                    extra = "compiled for the GPU"
                else:
                    extra = "importable, but no GPU to launch on (TRITON_INTERPRET=1 runs the CPU interpreter)"
            else:
                extra = b.get("detail", "pure torch" if name == "reference" else "")
            lines.append(f"  {name:<10} {ok} {extra}")
    dg = r.get("deepgemm_jit_cache")
    if dg is not None and be.get("deepgemm", {}).get("available"):
        hint = "" if dg["kernels"] else " (empty: `zerodiff warmup` compiles a preset's kernels ahead)"
        lines.append(f"deepgemm    JIT cache {dg['path']}: {dg['kernels']} compiled kernel(s){hint}")
    tc = r.get("triton_cache")
    if tc is not None and tr["available"]:
        lines.append(f"triton      kernel cache {tc['path']}: {tc['kernels']} compiled kernel(s)")
    kc = r.get("kernel_configuration")
    if kc is not None:
        lines.append(f"kernels     mHC {kc['mhc']} (head {kc['mhc_head']}), DSA Top-K {kc['topk']}, sparse MLA read "
                     f"{kc['attention_read']} ({kc['attention_pieces']} pieces per row)")
    ff = r.get("flashmla_fp8")
    if ff is not None:
        lines.append(f"flashmla_fp8 usable here: {'yes' if ff['usable'] else 'no'} ({ff['detail']})")
    p = r["pins"]
    lines.append(f"pins        {p['path']}")
    if "error" in p:
        lines.append(f"  (not readable: {p['error']})")
    else:
        for k, v in p["values"].items():
            lines.append(f"  {k:<22} {v}")
    c = r["consistency_mode"]
    ans = {"yes": "yes", "no": "no", "reference-only": "reference kernels only"}[c["can_run"]]
    lines.append(f"consistency mode: can run here: {ans} ({c['reason']})")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    r = collect()
    print(json.dumps(r, indent=2) if as_json else render(r))
    return 0
