"""``zerodiff warmup``: fill DeepGEMM's JIT cache for a preset before a run, in parallel.

DeepGEMM picks its kernel configuration (block sizes, clusters, stages) from M as well as (N, K) and compiles
each new configuration with NVCC the first time it is met (about 3 s each). A run whose token counts vary from
step to step (continuous batching, packed training micro-batches) meets a new configuration every few steps:
on the H200 the first 8 steps of ``zerodiff check --config h200`` spent 388 of 466 s inside
``fp8_gemm_nt`` compiling 113 configurations (``--profile``; docs/results.md). Those compilations are one-off per
machine (DeepGEMM caches the cubins on disk, ``DG_JIT_CACHE_DIR``, default ``~/.deep_gemm``), so this command
calls every dense FP8 weight shape of the preset for every M in ``1..max_m`` (and, for the baseline, the
contiguous grouped expert GEMMs at every aligned row count) from a pool of ``--jobs`` worker processes over the
visible GPUs. A task is one shape over one contiguous M range, so a configuration (which belongs to one shape and
one M interval) is compiled by about one worker.

Values are not checked (random operands): this only compiles. Bitwise row invariance across DeepGEMM's
M-dependent configurations is what ``zerodiff.ops.fp8_gemm.deepgemm_verdict`` probes (M from 1 to 8192). Measured on
the H200: 66,368 calls for the h200 shapes in 70 s with 14 workers.

    zerodiff warmup --config h200 [--config gpu_small] [--jobs 24] [--max-m 8192] [--no-baseline]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def dense_shapes(cfg) -> list[tuple[int, int]]:
    """(N, K) of every 2-D block-FP8 weight of the model (the dense ``fp8_gemm_nt`` calls)."""
    from .model.weights import is_fp8, param_shapes

    out = []
    for name, (shape, _dt, _k) in param_shapes(cfg).items():
        if is_fp8(name) and len(shape) == 2 and tuple(shape) not in out:
            out.append(tuple(shape))
    return out


def grouped_shapes(cfg) -> list[tuple[int, int, int]]:
    """(E, N, K) of the routed expert weights (the baseline's grouped DeepGEMM calls)."""
    return [(cfg.experts, 2 * cfg.moe_inter, cfg.hidden), (cfg.experts, cfg.hidden, cfg.moe_inter)]


def default_max_m(preset) -> int:
    """Largest token count one forward sees: the rollout's token budget or a training micro-batch."""
    return max(preset.rollout.token_budget[1], preset.train.micro_tokens)


def split_ranges(values: list[int], parts: int) -> list[list[int]]:
    """Contiguous chunks, narrower where M is small (configurations change fastest there): equal steps in sqrt(M)."""
    values = sorted(set(values))
    parts = max(1, min(parts, len(values)))
    lo, hi = math.sqrt(values[0]), math.sqrt(values[-1])
    out = [[] for _ in range(parts)]
    for v in values:
        i = min(parts - 1, int((math.sqrt(v) - lo) / max(hi - lo, 1e-9) * parts))
        out[i].append(v)
    return [c for c in out if c]


def run_task(task: dict) -> dict:
    """Compile (by calling) one shape's DeepGEMM kernels for the task's M values; never raises."""
    import torch

    from .backends import deep_gemm
    from .model.baseline_cuda import _BlockMCap
    from .ops.fp8_gemm import _deepgemm_call

    t0 = time.perf_counter()
    dg = deep_gemm()
    if dg is None:
        return {"task": task["name"], "calls": 0, "errors": ["DeepGEMM is not importable"], "seconds": 0.0}
    dev = torch.device(task.get("device", "cuda"))
    f8 = torch.float8_e4m3fn
    ms = task["ms"]
    mmax = max(ms)
    done, errors = 0, []
    try:
        if task["kind"] == "dense":
            N, K = task["shape"]
            w = torch.randn((N, K), device=dev).to(f8)
            w_s = torch.rand((-(-N // 128), K // 128), device=dev) + 0.5
            idx = None
        else:
            E, N, K = task["shape"]
            w = torch.randn((E, N, K), device=dev).to(f8)
            w_s = torch.rand((E, -(-N // 128), K // 128), device=dev) + 0.5
            idx = torch.zeros((mmax,), dtype=torch.int32, device=dev)
        a = torch.randn((mmax, K), device=dev).to(f8)
        a_s = torch.rand((mmax, K // 128), device=dev) + 0.5
        out = torch.empty((mmax, N), dtype=torch.bfloat16, device=dev)
        for M in ms:
            if idx is None:
                _deepgemm_call(dg, a[:M], a_s[:M], w, w_s, out[:M], False)
            else:
                with _BlockMCap(dg, task["align"]):
                    dg.m_grouped_fp8_gemm_nt_contiguous((a[:M], a_s[:M]), (w, w_s), out[:M], idx[:M],
                                                        disable_ue8m0_cast=True)
            done += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - report and go on: a warm-up never fails a run
        errors.append(f"{task['name']} at call {done}: {type(e).__name__}: {str(e)[:200]}")
    return {"task": task["name"], "calls": done, "errors": errors, "seconds": round(time.perf_counter() - t0, 1)}


def plan(presets: list, max_m: int | None, jobs: int, baseline: bool, align: int = 128) -> list[dict]:
    """Tasks (one shape, one contiguous M range each): every FP8 weight shape of the presets up to its own largest
    M, each shape's range cut into enough pieces for about three tasks per worker; shapes interleaved so workers
    running side by side compile different shapes (a configuration belongs to one shape)."""
    dense, grouped = {}, {}
    for p in presets:
        mm = max_m or default_max_m(p)
        for s in dense_shapes(p.model):
            dense[s] = max(dense.get(s, 0), mm)
        if baseline:
            for s in grouped_shapes(p.model):
                grouped[s] = max(grouped.get(s, 0), mm * p.model.top_experts + p.model.experts * align)
    nshapes = len(dense) + len(grouped)
    pieces = max(1, -(-3 * jobs // nshapes))
    per_shape = []
    for (n, k), top in dense.items():
        per_shape.append([{"kind": "dense", "shape": [n, k], "ms": ms, "name": f"dense N={n} K={k} M={ms[0]}..{ms[-1]}"}
                          for ms in split_ranges(list(range(1, top + 1)), pieces)])
    for (e, n, k), top in grouped.items():
        per_shape.append([{"kind": "grouped", "shape": [e, n, k], "ms": ms, "align": align,
                           "name": f"grouped E={e} N={n} K={k} M={ms[0]}..{ms[-1]}"}
                          for ms in split_ranges(list(range(align, top + 1, align)), pieces)])
    tasks = []
    for i in range(max(len(x) for x in per_shape)):
        tasks += [x[i] for x in per_shape if i < len(x)]
    return tasks


def _init_worker(visible: list, counter) -> None:
    """Pool initializer: pin this worker to one GPU (round robin) before CUDA initialises."""
    with counter.get_lock():
        i = counter.value
        counter.value += 1
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[i % len(visible)]


def run(args) -> int:
    import concurrent.futures as cf
    import multiprocessing as mp

    from .model.config import preset

    names = args.config or ["h200"]
    presets = [preset(n) for n in names]
    try:
        import torch

        ngpu = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        ngpu = 0
    if ngpu == 0:
        print("zerodiff warmup: no CUDA device; nothing to compile (DeepGEMM JIT is GPU-only)", file=sys.stderr)
        return 2
    env_vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = env_vis.split(",")[:ngpu] if env_vis else [str(i) for i in range(ngpu)]
    jobs = args.jobs or max(1, min(32, (os.cpu_count() or 2) - 2))
    tasks = plan(presets, args.max_m, jobs, not args.no_baseline)
    cache = os.environ.get("DG_JIT_CACHE_DIR", "~/.deep_gemm (DeepGEMM's default)")
    print(f"zerodiff warmup: configs {names}, {len(tasks)} tasks on {jobs} workers over {ngpu} GPU(s); "
          f"DeepGEMM cache {cache}", flush=True)
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    counter = ctx.Value("i", 0)
    problems, calls, n = 0, 0, 0
    pool = cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(visible, counter))
    futs = [pool.submit(run_task, t) for t in tasks]
    try:
        for n, f in enumerate(cf.as_completed(futs, timeout=args.timeout), 1):
            r = f.result()
            calls += r["calls"]
            if r["errors"]:
                problems += 1
                print(f"  {r['task']}: {r['errors'][0]}", flush=True)
            if n % max(1, len(tasks) // 20) == 0 or n == len(tasks):
                print(f"  {n}/{len(tasks)} tasks, {calls} calls (t={time.perf_counter() - t0:.0f} s)", flush=True)
    except cf.TimeoutError:
        print(f"zerodiff warmup: --timeout {args.timeout:.0f} s reached after {n} of {len(tasks)} tasks", flush=True)
        problems += 1
    except Exception as e:  # noqa: BLE001 - a worker died (BrokenProcessPool): say so, never hang
        print(f"zerodiff warmup: workers failed: {type(e).__name__}: {e}", flush=True)
        problems += 1
    finally:
        for p in list(getattr(pool, "_processes", {}).values()):
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)
    print(f"zerodiff warmup: done in {time.perf_counter() - t0:.0f} s, {calls} calls, {problems} problem(s)",
          flush=True)
    return 0 if problems == 0 else 1


def add_parser(subparsers) -> None:
    w = subparsers.add_parser(
        "warmup", help="compile DeepGEMM's M-dependent kernels for a preset's shapes ahead of a run (parallel)",
        description=__doc__.split("\n\n")[1] + " " + __doc__.split("\n\n")[2])
    w.add_argument("--config", action="append", choices=["gpu_small", "h200"],
                   help="preset whose shapes to compile (repeatable; default h200)")
    w.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPU count - 2, at most 32)")
    w.add_argument("--max-m", type=int, default=None,
                   help="largest M (default: the preset's max(token budget, training micro-batch))")
    w.add_argument("--no-baseline", action="store_true", help="skip the baseline's grouped expert GEMMs")
    w.add_argument("--timeout", type=float, default=600.0, help="give up on workers after this many seconds")
    w.set_defaults(func=run)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="zerodiff")
    add_parser(ap.add_subparsers(dest="command", required=True))
    a = ap.parse_args()
    sys.exit(a.func(a))
