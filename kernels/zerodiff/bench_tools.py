"""Measurement tools of ``zerodiff bench``: the JIT detector, the confidence intervals of the per-step ratio, the
profiler pass's per-kernel / per-op GPU time breakdown, and the rollout concurrency settings.

JIT detector (:class:`JitDetector`)
    Watches every way the harness can compile while it runs: Triton's in-memory kernel-cache misses (a wrapper
    around ``triton.runtime.jit.JITFunction._do_compile``, the function every cache miss goes through in Triton
    3.2-3.8, whether the binary then comes from the disk cache or from a real compilation), CPU time of child
    processes (DeepGEMM's JIT runs nvcc, Triton runs ptxas, both as child processes), new entries in the on-disk
    JIT caches (Triton's cache dir, DeepGEMM's ``DG_JIT_CACHE_DIR`` / ``~/.deep_gemm``, any extra dir; counted
    when the window also shows this process compiling, or always with ``strict``), and CUDA-graph captures
    (``note``). Events are tagged with the window they happened in (``window(label)``);
    :meth:`JitDetector.during` lists the ones of a given label. A DeepGEMM kernel loaded from its disk cache into
    a fresh process leaves no trace in its cache dir: that load is not detected (the exact warm-up runs every
    timed shape first, so it happens before timing).

Confidence intervals (:func:`median_ci_order`, :func:`median_ci_bootstrap`)
    Distribution-free: the order-statistic interval of the median (exact binomial coverage, reported), and the
    percentile bootstrap of the median (seeded, so a JSON is reproducible from its rows).

Profiler breakdown (:func:`annotate_ops`, :func:`breakdown`)
    ``annotate_ops(ops)`` wraps every public method of a rollout ops object in a
    ``torch.profiler.record_function("zerodiff::<method>")`` range for the duration of the context;
    ``breakdown(prof)`` sums the device time of every GPU activity the profiler recorded (kernels, memcpy,
    memset: CUPTI's start-to-end durations, so host work and GPU idle gaps are excluded) per kernel name, and
    per innermost ``zerodiff::`` range of the host call that launched it. On the CPU (no device activity) the
    same tables are built from the CPU self time of the aten ops (a structure check, not a GPU number).

Concurrency (:func:`apply_rollout_settings`)
    ``--prompts``, ``--max-batch``, ``--token-budget``, ``--graph-batch-sizes`` and ``--kv-blocks`` applied to a
    preset, refusing combinations that cannot reach the requested concurrency (``SettingError`` naming the
    setting).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import statistics
import types
from collections import defaultdict


# ---- JIT detector ------------------------------------------------------------------------------------------------
def default_cache_dirs() -> dict:
    """{label: path} of the on-disk JIT caches this process would write to."""
    dirs = {}
    tri = os.environ.get("TRITON_CACHE_DIR")
    if not tri:
        try:
            import triton.knobs as _k

            tri = _k.cache.dir
        except Exception:  # noqa: BLE001 - no Triton, or an older layout
            tri = os.path.join(os.path.expanduser("~"), ".triton", "cache")
    dirs["triton_cache"] = tri
    dg = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")
    dirs["deepgemm_cache"] = dg
    return dirs


def _entries(root: str, depth: int = 2) -> set:
    """Relative paths of the entries under ``root`` down to ``depth`` levels (empty when it does not exist)."""
    out = set()
    if not root or not os.path.isdir(root):
        return out
    stack = [("", 1)]
    while stack:
        rel, d = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel)) as it:
                for e in it:
                    p = os.path.join(rel, e.name)
                    if e.name.endswith((".tmp", ".lock")) or e.name.startswith("tmp"):
                        continue
                    out.add(p)
                    if d < depth and e.is_dir(follow_symlinks=False):
                        stack.append((p, d + 1))
        except OSError:
            continue
    return out


def _children_cpu_s() -> float:
    """CPU seconds of this process's terminated, waited-for child processes (and theirs): nvcc / ptxas runs."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class JitDetector:
    """Record compilations per labelled window; see the module docstring for what is watched.

    ``strict``: every new cache-dir entry found after a window counts as a compilation in it. Otherwise (the
    default) a new entry counts only when the window also shows this process compiling (a Triton cache miss,
    or child-process CPU time: the compilers Triton and DeepGEMM start, ptxas / nvcc); entries without that
    evidence were written by another process sharing the cache dir and are listed in :attr:`foreign`."""

    def __init__(self, cache_dirs: dict | None = None, strict: bool = False):
        self.dirs = dict(default_cache_dirs() if cache_dirs is None else cache_dirs)
        self.events: list = []  # dicts: window, kind, what
        self.foreign: list = []  # new cache entries without in-process evidence (non-strict)
        self.strict = bool(strict)
        self.label = None
        self._restore = None
        self.triton_hook = False

    # Triton in-memory cache misses
    def install(self) -> "JitDetector":
        from .profiling import wrap_triton_compile

        det = self

        def make_wrapper(orig):
            def _do_compile(fn_self, *a, **kw):
                name = getattr(getattr(fn_self, "fn", None), "__name__", None) or str(fn_self)
                det.note("triton_compile", name)
                return orig(fn_self, *a, **kw)
            return _do_compile

        self._restore = wrap_triton_compile(make_wrapper)  # None without Triton: the dir watch still runs
        self.triton_hook = self._restore is not None
        return self

    def uninstall(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()
        return False

    def note(self, kind: str, what: str) -> None:
        """Record one compilation-like event in the current window (outside any window: label None)."""
        self.events.append({"window": self.label, "kind": kind, "what": str(what)[:300]})

    @contextlib.contextmanager
    def window(self, label: str):
        """Events inside the body are tagged ``label``; so are child-process CPU time spent in it and the new
        cache-dir entries found after it (see the class docstring for when an entry counts)."""
        before = {k: _entries(p) for k, p in self.dirs.items()}
        n0 = len(self.events)
        c0 = _children_cpu_s()
        prev, self.label = self.label, label
        try:
            yield self
        finally:
            self.label = prev
            dc = _children_cpu_s() - c0
            if dc > 0:
                self.events.append({"window": label, "kind": "child processes",
                                    "what": f"{dc:.3f} s CPU of child processes (a compiler run: nvcc / ptxas)"})
            ours = self.strict or len(self.events) > n0
            for k, p in self.dirs.items():
                new = sorted(_entries(p) - before[k])
                sink = self.events if ours else self.foreign
                for n in new[:50]:
                    sink.append({"window": label, "kind": f"new {k} entry", "what": os.path.join(p, n)})
                if len(new) > 50:
                    sink.append({"window": label, "kind": f"new {k} entry",
                                 "what": f"... and {len(new) - 50} more under {p}"})

    def during(self, prefix: str) -> list:
        """Events of the windows whose label starts with ``prefix``."""
        return [e for e in self.events if e["window"] is not None and str(e["window"]).startswith(prefix)]

    def summary(self) -> dict:
        per = defaultdict(int)
        for e in self.events:
            per[f"{str(e['window']).split(':')[0]}: {e['kind']}"] += 1
        return {"watched_dirs": self.dirs, "triton_hook": self.triton_hook, "strict_cache_dirs": self.strict,
                "counts": dict(per), "foreign_cache_entries": len(self.foreign),
                "foreign_examples": self.foreign[:10],
                "foreign_note": ("new cache entries seen while no compilation of this process was observed (another "
                                 "process shares the cache dir); not counted unless --strict-cache-dirs")}


# ---- statistics ---------------------------------------------------------------------------------------------------
def _binom_cdf_half(k: int, n: int) -> float:
    """P(Bin(n, 1/2) <= k)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(0, min(k, n) + 1)) / 2.0 ** n


def median_ci_order(xs, level: float = 0.95) -> dict:
    """Distribution-free interval of the median: ``[x_(k), x_(n+1-k)]`` (1-based order statistics) with the
    largest ``k`` whose exact coverage ``1 - 2 P(Bin(n, 1/2) <= k - 1)`` is >= ``level``. With too few values for
    ``level`` (n < 6 at 95%) it returns the min/max with the lower coverage it has. ``coverage`` is exact."""
    s = sorted(float(x) for x in xs)
    n = len(s)
    if n == 0:
        return {"lo": None, "hi": None, "coverage": None, "k": None, "n": 0}
    best = 1
    for k in range(1, n // 2 + 1):
        if 1 - 2 * _binom_cdf_half(k - 1, n) >= level:
            best = k
        else:
            break
    cov = 1 - 2 * _binom_cdf_half(best - 1, n)
    return {"lo": s[best - 1], "hi": s[n - best], "coverage": cov, "k": best, "n": n,
            "method": "order statistics of the median (exact binomial coverage)"}


def median_ci_bootstrap(xs, level: float = 0.95, resamples: int = 10000, seed: int = 0) -> dict:
    """Percentile bootstrap interval of the median (``resamples`` resamples with replacement, seeded)."""
    v = [float(x) for x in xs]
    n = len(v)
    if n == 0:
        return {"lo": None, "hi": None, "n": 0}
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(v, k=n)) for _ in range(resamples))
    a = (1 - level) / 2
    lo = meds[max(0, int(math.floor(a * resamples)))]
    hi = meds[min(resamples - 1, int(math.ceil((1 - a) * resamples)) - 1)]
    return {"lo": lo, "hi": hi, "level": level, "resamples": resamples, "seed": seed, "n": n,
            "method": "percentile bootstrap of the median"}


def ratio_summary(ratios) -> dict:
    r = [float(x) for x in ratios]
    return {"median": statistics.median(r) if r else None, "min": min(r) if r else None,
            "max": max(r) if r else None, "n": len(r), "ci95_order_statistic": median_ci_order(r),
            "ci95_bootstrap": median_ci_bootstrap(r)}


# ---- profiler breakdown ------------------------------------------------------------------------------------------
_SKIP_METHODS = {"graph_of", "master", "tape_graph", "attach"}  # tape helpers of model.ops.ConsistentOps, not ops
OP_PREFIX = "zerodiff::"


@contextlib.contextmanager
def annotate_ops(ops):
    """Wrap every public method of ``ops`` (the instance; its class is untouched) in a
    ``record_function("zerodiff::<name>")`` range; removed on exit."""
    import torch

    names = []
    for name in dir(type(ops)):
        if name.startswith("_") or name in _SKIP_METHODS or name in vars(ops):
            continue
        attr = getattr(type(ops), name, None)
        if not isinstance(attr, types.FunctionType):
            continue
        names.append(name)

    def wrap(name, bound):
        label = OP_PREFIX + name

        def fn(*a, **k):
            with torch.profiler.record_function(label):
                return bound(*a, **k)

        return fn

    for name in names:
        setattr(ops, name, wrap(name, getattr(ops, name)))
    try:
        yield names
    finally:
        for name in names:
            ops.__dict__.pop(name, None)


def _op_of(ev) -> str:
    e = ev
    while e is not None:
        if e.name.startswith(OP_PREFIX):
            return e.name[len(OP_PREFIX):]
        e = e.cpu_parent
    return "(outside any zerodiff op)"


def _annotation(ev) -> bool:
    """A profiler range (host ``record_function`` or its GPU-timeline mirror), not work."""
    return (bool(getattr(ev, "is_user_annotation", False)) or ev.name.startswith(OP_PREFIX)
            or "annotation" in str(getattr(ev, "activity_type", "") or ""))


def _is_device(ev) -> bool:
    dt = getattr(ev, "device_type", None)
    return dt is not None and getattr(dt, "name", str(dt)).upper().endswith(("CUDA", "PRIVATEUSE1", "HIP"))


def breakdown(events, top: int = 20, steps: int = 1, tokens: int | None = None) -> dict:
    """Per-kernel and per-op time of a profiler trace (``prof.events()``).

    With device activity: ``kernels`` sums each GPU activity's duration by name; ``ops`` sums the launching host
    call's kernels per innermost ``zerodiff::`` range (what no range encloses goes to
    ``(outside any zerodiff op)``; device time whose launch could not be linked goes to ``(not linked to a host
    call)``). Without (CPU): the same from the aten ops' CPU self time. ``share`` is percent of ``total_us``."""
    events = list(events)
    dev = [e for e in events if _is_device(e) and not _annotation(e)]
    per_k = defaultdict(lambda: [0.0, 0])
    per_op = defaultdict(float)
    if dev:
        measure = ("GPU activity time: sum of CUPTI kernel / memcpy / memset durations (host work and GPU idle gaps "
                   "excluded; overlapping streams would count twice)")
        total = 0.0
        for e in dev:
            d = e.time_range.elapsed_us()
            per_k[e.name][0] += d
            per_k[e.name][1] += 1
            total += d
        linked = 0.0
        for e in events:
            if _is_device(e) or _annotation(e) or not getattr(e, "kernels", None):
                continue
            d = sum(k.duration for k in e.kernels if not k.name.startswith(OP_PREFIX))
            per_op[_op_of(e)] += d
            linked += d
        if total - linked > 1e-6 * max(1.0, total):
            per_op["(not linked to a host call)"] += total - linked
        source = "device"
    else:
        measure = "CPU self time of the aten ops (no device activity recorded: a structure check, not a GPU number)"
        total = 0.0
        for e in events:
            if _annotation(e):
                continue
            if not e.name.startswith("aten::"):
                continue
            d = float(e.self_cpu_time_total)
            per_k[e.name][0] += d
            per_k[e.name][1] += 1
            per_op[_op_of(e)] += d
            total += d
        source = "cpu"

    def share(x):
        return round(100.0 * x / total, 2) if total > 0 else 0.0

    ks = sorted(per_k.items(), key=lambda kv: -kv[1][0])
    ops = sorted(per_op.items(), key=lambda kv: -kv[1])
    return {
        "source": source, "measure": measure, "total_us": total, "steps": steps, "tokens": tokens,
        "us_per_token": (total / tokens) if tokens else None,
        "kernels_distinct": len(per_k),
        "kernels": [{"name": n, "us": us, "count": c, "share": share(us)} for n, (us, c) in ks[:top]],
        "kernels_rest_us": sum(us for _, (us, _) in ks[top:]),
        "ops": [{"op": n, "us": us, "share": share(us)} for n, us in ops],
    }


def format_breakdown(mode: str, b: dict, top: int = 10) -> list:
    lines = [f"{mode}: {b['total_us'] / 1e3:.2f} ms {b['source']} time over {b['steps']} steps"
             + (f" ({b['us_per_token']:.2f} us/token)" if b.get("us_per_token") else "") + f" [{b['measure']}]"]
    for o in b["ops"][:top]:
        lines.append(f"  op {o['op']:40s} {o['us'] / 1e3:10.3f} ms {o['share']:6.2f}%")
    for k in b["kernels"][:top]:
        lines.append(f"  kernel {k['name'][:70]:70s} {k['us'] / 1e3:10.3f} ms {k['share']:6.2f}% x{k['count']}")
    return lines


# ---- concurrency settings ----------------------------------------------------------------------------------------
class SettingError(ValueError):
    """An impossible rollout setting; the message names the option."""


def parse_range(text, name: str) -> tuple:
    """'LO,HI' or 'N' -> (LO, HI) positive ints with LO <= HI."""
    try:
        parts = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise SettingError(f"zerodiff: {name} {text!r}: expected LO,HI or N (integers)") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] < 1 or parts[0] > parts[1]:
        raise SettingError(f"zerodiff: {name} {text!r}: expected LO,HI with 1 <= LO <= HI")
    return tuple(parts)


def parse_sizes(text, name: str) -> tuple:
    try:
        v = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise SettingError(f"zerodiff: {name} {text!r}: expected a comma-separated list of integers") from None
    if not v or v[0] < 1:
        raise SettingError(f"zerodiff: {name} {text!r}: sizes must be >= 1")
    return tuple(v)


def kv_blocks_needed(rc, graphs: bool) -> int:
    """Worst-case KV blocks of one rollout: max_batch[1] running requests of the longest length each, plus the
    CUDA graphs' scratch block."""
    longest = rc.prompt_len[1] + rc.response_len[1]
    return rc.max_batch[1] * -(-longest // rc.block_size) + (1 if graphs else 0)


def apply_rollout_settings(preset, *, prompts=None, max_batch=None, token_budget=None, graph_batch_sizes=None,
                           kv_blocks=None):
    """The preset with the given rollout settings (strings as on the command line, or None = the preset's).

    When any is given the combination is validated (:class:`SettingError` names the setting): the highest
    concurrency must not exceed the requests per step (``prompts x responses_per_prompt``; checked when
    ``max_batch`` or ``prompts`` is given) nor the token budget's low end (a decode step of HI requests must fit
    any drawn budget; checked when ``max_batch`` or ``token_budget`` is given); the CUDA-graph sizes must cover it (by
    default they are extended with powers of two up to the first >= HI); the KV cache must hold HI requests of
    the longest length (by default it is enlarged to that; an explicit ``kv_blocks`` below it is refused). The
    returned preset records nothing else: the caller reports the settings."""
    given = any(v is not None for v in (prompts, max_batch, token_budget, graph_batch_sizes, kv_blocks))
    if not given:
        return preset
    rc = preset.rollout
    ch = {}
    if prompts is not None:
        p = int(prompts)
        if p < 1:
            raise SettingError(f"zerodiff: --prompts {prompts}: must be >= 1")
        ch["prompts_per_step"] = p
    if max_batch is not None:
        ch["max_batch"] = parse_range(max_batch, "--max-batch")
    if token_budget is not None:
        ch["token_budget"] = parse_range(token_budget, "--token-budget")
    rc = dataclasses.replace(rc, **ch)
    hi = rc.max_batch[1]
    nreq = rc.prompts_per_step * rc.responses_per_prompt
    if (max_batch is not None or prompts is not None) and hi > nreq:
        raise SettingError(
            f"zerodiff: --max-batch {rc.max_batch[0]},{hi}: a step has only {nreq} requests (--prompts "
            f"{rc.prompts_per_step} x {rc.responses_per_prompt} responses per prompt), so {hi} concurrent requests "
            f"are never reached; use --prompts {-(-hi // rc.responses_per_prompt)} or more")
    if (max_batch is not None or token_budget is not None) and rc.token_budget[0] < hi:
        raise SettingError(
            f"zerodiff: --token-budget {rc.token_budget[0]},{rc.token_budget[1]}: its low end is below --max-batch "
            f"{hi}, so a decode step of {hi} requests may not be scheduled whole; raise --token-budget to >= {hi}")
    if rc.prompt_len[1] + rc.response_len[1] > preset.model.max_pos:
        raise SettingError(f"zerodiff: the preset's longest request ({rc.prompt_len[1]} + {rc.response_len[1]}) "
                           f"exceeds the model's max_pos {preset.model.max_pos}")
    if graph_batch_sizes is not None:
        sizes = parse_sizes(graph_batch_sizes, "--graph-batch-sizes")
        if rc.cuda_graphs and sizes[-1] < hi:
            raise SettingError(
                f"zerodiff: --graph-batch-sizes {','.join(map(str, sizes))}: the largest ({sizes[-1]}) is below "
                f"--max-batch {hi}; decode steps of more requests would run eagerly: add a size >= {hi}")
    else:
        sizes = tuple(sorted(rc.graph_batch_sizes))
        if sizes[-1] < hi:
            p = sizes[-1]
            extra = []
            while p < hi:
                p *= 2
                extra.append(p)
            sizes = tuple(sorted(set(sizes) | set(extra)))
    rc = dataclasses.replace(rc, graph_batch_sizes=sizes)
    need = kv_blocks_needed(rc, rc.cuda_graphs)
    if kv_blocks is not None:
        nb = int(kv_blocks)
        if nb < need:
            raise SettingError(
                f"zerodiff: --kv-blocks {nb}: {hi} concurrent requests of up to {rc.prompt_len[1] + rc.response_len[1]} "
                f"tokens need {need} blocks of {rc.block_size} tokens (incl. the graphs' scratch block); use "
                f"--kv-blocks {need} or more, or lower --max-batch")
        rc = dataclasses.replace(rc, num_blocks=nb)
    elif rc.num_blocks < need:
        rc = dataclasses.replace(rc, num_blocks=need)
    return preset.replace(rollout=rc)


def rollout_settings_doc(preset) -> dict:
    rc = preset.rollout
    return {"prompts_per_step": rc.prompts_per_step, "responses_per_prompt": rc.responses_per_prompt,
            "requests_per_step": rc.prompts_per_step * rc.responses_per_prompt, "max_batch": list(rc.max_batch),
            "token_budget": list(rc.token_budget), "graph_batch_sizes": list(rc.graph_batch_sizes),
            "kv_blocks": rc.num_blocks, "block_size": rc.block_size,
            "kv_blocks_needed": kv_blocks_needed(rc, rc.cuda_graphs)}

