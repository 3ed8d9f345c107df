"""PTX identity of the Triton kernels across a refactor: compile ahead of time (no GPU), save, compare.

A refactor that moves kernel code into ``@triton.jit`` helpers must leave every kernel's generated code
unchanged. This script compiles each launched configuration of the zerodiff Triton kernels for sm_90a and
sm_100a with the installed (CPU-side) Triton and compares the PTX text, with debug information, comments and
the kernel's own name taken out, before and after the change.

Which configurations: the ones the CPU tests launch. ``--save`` first runs the chosen test files under the
Triton interpreter with a recorder on every kernel launch (argument types, constexpr values, launch options;
at most ``--per-kernel`` distinct configurations per kernel), writes them to ``DIR/configs.json``, then
compiles each for both targets into ``DIR/*.ptx``. ``--compare DIR`` compiles the same recorded
configurations with the tree as it is now and reports, per kernel and target, whether the PTX is identical.
Arguments are compiled as a launch would specialise them: pointers 16-byte aligned, integers divisible by 16
marked so; the ``EXACT`` cast constexpr is compiled both ways (False is what the GPU runs).

Usage:
  PYTHONPATH=kernels python benchmarks/ptx_identity.py --save /tmp/ptx-before [--tests tests/test_mhc.py ...]
  (change the code)
  PYTHONPATH=kernels python benchmarks/ptx_identity.py --compare /tmp/ptx-before
  PYTHONPATH=kernels python benchmarks/ptx_identity.py --save DIR --configs OLD/configs.json   # reuse a recording

Exit status of ``--compare``: 0 when every kernel compiled and is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the test files whose launches are recorded by default (ops, experimental variants, baselines)
DEFAULT_TESTS = [
    "tests/test_mhc.py", "tests/test_experimental_mhc.py", "tests/test_experimental_attention.py",
    "tests/test_experimental_topk.py", "tests/test_attention_triton_split.py",
    "tests/test_attention_flashmla_fp8.py", "tests/test_attention_slots.py", "tests/test_sparse_attention.py",
    "tests/test_topk.py", "tests/test_moe.py", "tests/test_fp8_gemm.py", "tests/test_bf16_gemm.py",
    "tests/test_router_gemm.py", "tests/test_rmsnorm.py", "tests/test_logprobs.py", "tests/test_fp8_quant.py",
    "tests/test_silu_mul_quant.py", "tests/test_kv_cache.py", "tests/test_indexer.py",
    "tests/test_triton_casts.py",
]
TARGETS = (90, 100)
_ENV_OUT = "ZERODIFF_PTX_RECORD"
_ENV_PER_KERNEL = "ZERODIFF_PTX_PER_KERNEL"


# ---------------------------------------------------------------------------------------------- recording
def _arg_type(v):
    """(signature type, constexpr value or None, divisible-by-16) of one runtime argument."""
    import torch

    if isinstance(v, torch.Tensor):
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
                 torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
        return "*" + names[v.dtype], None, True
    if isinstance(v, bool):
        return "i1", None, False
    if isinstance(v, int):
        return ("i32" if -2**31 <= v < 2**31 else "i64"), None, v % 16 == 0 and v != 0
    if isinstance(v, float):
        return "fp32", None, False
    if v is None:
        return "constexpr", None, False
    raise TypeError(f"unsupported argument {type(v).__name__}")


def _const_value(v):
    import triton.language as tl

    if isinstance(v, tl.dtype):
        return {"dtype": str(v)}
    if isinstance(v, tl.constexpr):
        v = v.value
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_const_value(x) for x in v]
    raise TypeError(f"unsupported constexpr {type(v).__name__}")


def _install_recorder(out_path: str, per_kernel: int):
    """Wrap the interpreter's kernel launch so that each launch's configuration is appended to ``out_path``."""
    import inspect

    from triton.runtime import interpreter

    seen: dict[str, set] = {}
    stock = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            fn = self.fn
            sig = inspect.signature(fn)
            params = sig.parameters
            kernel_kw = {k: v for k, v in kwargs.items() if k in params}
            opts = {k: v for k, v in kwargs.items() if k not in params and isinstance(v, (bool, int, float))}
            bound = sig.bind(*args, **kernel_kw)
            bound.apply_defaults()
            signature, constexprs, aligned = {}, {}, []
            for i, (name, value) in enumerate(bound.arguments.items()):
                ann = params[name].annotation
                if ann is not inspect.Parameter.empty and "constexpr" in str(ann):
                    signature[name] = "constexpr"
                    constexprs[name] = _const_value(value)
                    continue
                ty, _, div16 = _arg_type(value)
                signature[name] = ty
                if ty == "constexpr":
                    constexprs[name] = None
                if div16:
                    aligned.append(i)
            cfg = dict(module=fn.__module__, kernel=fn.__name__, signature=signature, constexprs=constexprs,
                       aligned=aligned, options=opts)
            key = json.dumps(cfg, sort_keys=True)
            mine = seen.setdefault(f"{fn.__module__}.{fn.__name__}", set())
            if key not in mine and len(mine) < per_kernel:
                mine.add(key)
                with open(out_path, "a") as f:
                    f.write(key + "\n")
        except Exception as e:  # noqa: BLE001 - recording never changes what the test sees
            print(f"ptx_identity: not recorded ({type(e).__name__}: {e})", file=sys.stderr)
        return stock(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run


def pytest_configure(config):  # pytest plugin entry: `-p ptx_identity` with the recorder's env set
    if os.environ.get(_ENV_OUT):
        _install_recorder(os.environ[_ENV_OUT], int(os.environ.get(_ENV_PER_KERNEL, "3")))


def record(tests, out: Path, per_kernel: int) -> list[dict]:
    raw = out.with_suffix(".jsonl")
    raw.unlink(missing_ok=True)
    env = dict(os.environ, TRITON_INTERPRET="1", **{_ENV_OUT: str(raw), _ENV_PER_KERNEL: str(per_kernel)})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT / "kernels"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "ptx_identity", "-p", "no:cacheprovider", *tests]
    print("recording:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    configs, keys = [], set()
    for line in raw.read_text().splitlines() if raw.exists() else []:
        if line not in keys and json.loads(line)["module"].startswith("zerodiff."):  # not the tests' own kernels
            keys.add(line)
            configs.append(json.loads(line))
    configs.sort(key=lambda c: (c["module"], c["kernel"]))
    out.write_text(json.dumps(configs, indent=1) + "\n")
    return configs


# -------------------------------------------------------------------------------------------- compiling
def _variants(cfg):
    """The configuration as recorded and, where the kernel has an ``EXACT`` constexpr, with the other value."""
    yield "", cfg["constexprs"]
    if isinstance(cfg["constexprs"].get("EXACT"), bool):
        yield "-exact" if not cfg["constexprs"]["EXACT"] else "-native", dict(
            cfg["constexprs"], EXACT=not cfg["constexprs"]["EXACT"])


def _compile(cfg, constexprs, cc):
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(cfg["module"]), cfg["kernel"])
    const = {k: (getattr(tl, v["dtype"]) if isinstance(v, dict) else v) for k, v in constexprs.items()}
    const = {k: (tuple(v) if isinstance(v, list) else v) for k, v in const.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in cfg["aligned"]}
    src = ASTSource(fn=fn, signature=cfg["signature"], constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(cfg["options"])).asm["ptx"]


def normalize(ptx: str, kernel: str) -> str:
    """PTX without comments, debug sections / locations and the kernel's own name."""
    out = []
    for line in ptx.split(".section\t.debug")[0].split(".section .debug")[0].splitlines():
        s = line.strip()
        if not s or s.startswith("//") or s.startswith(".file") or s.startswith(".loc"):
            continue
        if re.fullmatch(r"\$L__(tmp|func_begin|func_end)\d+:", s):
            continue
        out.append(re.sub(r"//.*$", "", line).rstrip().replace(kernel, "KERNEL"))
    return "\n".join(out) + "\n"


def _units(configs, only=None):
    for i, cfg in enumerate(configs):
        if not cfg["module"].startswith("zerodiff.") or (only and only not in f"{cfg['module']}.{cfg['kernel']}"):
            continue
        for tag, const in _variants(cfg):
            for cc in TARGETS:
                yield f"{i:03d}-{cfg['kernel']}{tag}-sm{cc}.ptx", cfg, const, cc


def compile_all(configs, into: Path | None, against: Path | None, only: str | None = None) -> int:
    import triton

    bad = 0
    results: dict[str, list] = {}
    t0 = time.time()
    for fname, cfg, const, cc in _units(configs, only):
        name = f"{cfg['module']}.{cfg['kernel']}"
        try:
            ptx = normalize(_compile(cfg, const, cc), cfg["kernel"])
        except Exception as e:  # noqa: BLE001 - reported, the rest goes on
            print(f"FAILED {fname}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            results.setdefault(name, []).append(False)
            bad += 1
            continue
        if into is not None:
            (into / fname).write_text(ptx)
            results.setdefault(name, []).append(True)
        if against is not None:
            old = against / fname
            same = old.exists() and old.read_text() == ptx
            if not same:
                print(f"DIFFERS {fname}", flush=True)
                bad += 1
            results.setdefault(name, []).append(same)
    print(f"triton {triton.__version__}, {sum(map(len, results.values()))} compiles in {time.time() - t0:.0f} s")
    if against is not None:
        for name, oks in sorted(results.items()):
            print(f"{'identical' if all(oks) else 'DIFFERENT'}  {name}  ({len(oks)} compiles)")
    return bad


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path, help="record (or reuse --configs), compile and store the PTX in DIR")
    g.add_argument("--compare", type=Path, help="compile DIR's recorded configurations and compare with DIR")
    p.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="pytest arguments whose launches are recorded")
    p.add_argument("--configs", type=Path, help="with --save: reuse this configs.json instead of recording")
    p.add_argument("--per-kernel", type=int, default=3, help="distinct configurations kept per kernel")
    p.add_argument("--only", help="with --compare: only the kernels whose module.name contains this")
    p.add_argument("--reuse-cache", action="store_true",
                   help="compile through the user's Triton cache (default: a fresh temporary cache every run)")
    a = p.parse_args(argv)
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    os.environ.pop("TRITON_INTERPRET", None)
    if not a.reuse_cache:
        import tempfile

        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ptx_identity_")
    if a.save:
        a.save.mkdir(parents=True, exist_ok=True)
        if a.configs:
            configs = json.loads(a.configs.read_text())
            (a.save / "configs.json").write_text(json.dumps(configs, indent=1) + "\n")
        else:
            configs = record(a.tests, a.save / "configs.json", a.per_kernel)
        print(f"{len(configs)} configurations of {len({(c['module'], c['kernel']) for c in configs})} kernels")
        return 1 if compile_all(configs, a.save, None) else 0
    configs = json.loads((a.compare / "configs.json").read_text())
    return 1 if compile_all(configs, None, a.compare, a.only) else 0


if __name__ == "__main__":
    sys.exit(main())
