"""Shared benchmark plumbing: medians from CUDA events, one JSON row per measured shape.

Every micro-benchmark is a command (``python benchmarks/bench_<op>.py --json out.json``) that times our
op and the stock op it replaces *in the same run* on the same inputs, and reports ours/stock of medians.
No benchmark is ever asserted on in tests.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
from typing import Callable

import torch


def device_name() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)"
    return "cpu"


#: how each median_ms call was timed ("graph" or "eager"), consumed by row()
_MODES: list[str] = []


def capture(fn, warmup: int = 2, report: bool = False):
    """Capture ``fn`` into a CUDA graph (after ``warmup`` side-stream calls), or return None if it can't be captured
    (host syncs, allocations outside the pool, ...); with ``report`` the reason is printed."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        return g
    except Exception as e:
        torch.cuda.synchronize()
        if report:
            print(f"  graph capture failed: {type(e).__name__}: {e}", flush=True)
        return None


def median_ms(fn: Callable[[], object], warmup: int = 10, rep: int = 50, graph: bool | None = None) -> float:
    """Median time of ``fn`` in milliseconds, timed with CUDA events around each call.

    ``graph`` (default: env ``ZD_BENCH_GRAPH``, else True) times CUDA-graph replays of ``fn`` when it can
    be captured, so host launch overhead is out of the number for ours and stock alike (rollout decode
    runs under CUDA graphs); calls that cannot be captured are timed eagerly. The mode used is recorded
    and reported by :func:`row`.
    """
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks need a CUDA device; nothing to measure on the CPU")
    if graph is None:
        graph = os.environ.get("ZD_BENCH_GRAPH", "1") != "0"
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    g = capture(fn) if graph else None
    run = g.replay if g is not None else fn
    _MODES.append("graph" if g is not None else "eager")
    # flush L2 between reps so weights/KV are not served from cache
    flush = torch.empty(int(256e6) // 4, dtype=torch.int32, device="cuda")
    times = []
    for _ in range(rep):
        flush.zero_()
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del g
    return statistics.median(times)


def row(op: str, shape: str, ours_ms: float, stock_ms: float, stock: str, **extra) -> dict:
    r = {
        "op": op,
        "shape": shape,
        "ours_ms": round(ours_ms, 5),
        "stock_ms": round(stock_ms, 5),
        "ratio": round(ours_ms / stock_ms, 4) if stock_ms > 0 else None,
        "stock": stock,
    }
    if _MODES and "timing" not in extra:  # how the measurements since the last row were timed
        r["timing"] = _MODES[0] if len(set(_MODES)) == 1 else "mixed: " + ",".join(_MODES)
    _MODES.clear()
    r.update(extra)
    print(f"{op:28s} {shape:38s} ours {ours_ms:9.4f} ms  stock {stock_ms:9.4f} ms  "
          f"ratio {r['ratio']}  [{stock}]", flush=True)
    return r


def parser(description: str) -> argparse.ArgumentParser:
    """``--json FILE`` and ``--quick``, the options every micro-benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", help="write results to this JSON file")
    p.add_argument("--quick", action="store_true", help="fewer shapes and reps (smoke run)")
    return p


def parse(description: str, quick_rep: int = 20, rep: int = 50) -> tuple[argparse.Namespace, int]:
    """The standard command line (:func:`parser`) parsed, and the timed repetitions per measurement (``quick_rep``
    with ``--quick``, else ``rep``)."""
    args = parser(description).parse_args()
    return args, quick_rep if args.quick else rep


def cuda_generator(seed: int = 0) -> torch.Generator:
    """A CUDA generator seeded with ``seed`` (inputs drawn on the device)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def write(path: str | None, bench: str, rows: list[dict]) -> None:
    doc = {
        "bench": bench,
        "device": device_name(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "rows": rows,
    }
    try:
        import triton

        doc["triton"] = triton.__version__
    except Exception:
        pass
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    else:
        json.dump(doc, sys.stdout, indent=1)


def cubin_usage(kernel) -> str:
    """Registers / stack / shared memory of an ahead-of-time compiled Triton kernel, as the cuobjdump shipped with
    Triton reports them (``-res-usage``): the "REG:.. STACK:.. SHARED:.." line(s), or why it could not run."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
            fh.write(kernel.asm["cubin"])
            fh.flush()
            out = subprocess.run([tool, "-res-usage", fh.name], capture_output=True, text=True).stdout
    except Exception as e:  # noqa: BLE001 - a report line, never a failure
        return f"(no cuobjdump: {e})"
    return " ".join(x.strip() for x in out.splitlines() if "REG:" in x)
