"""``--profile FILE`` for the end-to-end commands: where a run's wall time goes.

Writes one plain-text report with
* every Triton JIT compilation of the run (kernel name, seconds, the constexpr values that keyed it), counted
  per kernel, so a kernel that recompiles per batch shape shows up at once;
* Python's cProfile of the whole command: top functions by cumulative and by own time.

Host-side only: GPU time shows up as the host waits (``synchronize``, ``item``, ``tolist``) that follow it.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import time
from collections import defaultdict


def wrap_triton_compile(make_wrapper):
    """Replace ``triton.runtime.jit.JITFunction._do_compile`` (present in Triton 3.2-3.8) by
    ``make_wrapper(original)``. Returns a function that puts the original back, or None when Triton or that
    hook point is absent (nothing is changed then)."""
    try:
        from triton.runtime.jit import JITFunction
    except Exception:  # noqa: BLE001 - no Triton here
        return None
    orig = getattr(JITFunction, "_do_compile", None)
    if orig is None:
        return None
    JITFunction._do_compile = make_wrapper(orig)

    def restore() -> None:
        JITFunction._do_compile = orig

    return restore


class _CompileLog:
    """Logs every Triton compilation (kernel, seconds, constexpr key) through :func:`wrap_triton_compile`."""

    def __init__(self):
        self.events: list[tuple[str, float, str]] = []
        self._restore = None

    def install(self) -> bool:
        log = self.events

        def make_wrapper(orig):
            def _do_compile(fn_self, key, signature, device, constexprs, *a, **kw):
                t = time.perf_counter()
                try:
                    return orig(fn_self, key, signature, device, constexprs, *a, **kw)
                finally:
                    name = getattr(getattr(fn_self, "fn", None), "__name__", str(fn_self))
                    log.append((name, time.perf_counter() - t, repr(constexprs)[:300]))
            return _do_compile

        self._restore = wrap_triton_compile(make_wrapper)
        return self._restore is not None

    def uninstall(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def report(self) -> str:
        if not self.events:
            return "Triton compilations: none logged (all cached, no Triton, or the hook is unavailable)\n"
        per = defaultdict(lambda: [0, 0.0])
        for name, dt, _ in self.events:
            per[name][0] += 1
            per[name][1] += dt
        lines = [f"Triton compilations: {len(self.events)}, {sum(e[1] for e in self.events):.1f} s in all",
                 f"{'kernel':48s} {'count':>6s} {'seconds':>8s}"]
        for name, (n, s) in sorted(per.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"{name:48s} {n:6d} {s:8.1f}")
        lines.append("\nkeys of kernels compiled more than twice:")
        for name, (n, _) in per.items():
            if n > 2:
                for nm, dt, key in self.events:
                    if nm == name:
                        lines.append(f"  {name} {dt:.2f}s {key}")
        return "\n".join(lines) + "\n"


@contextlib.contextmanager
def profiled(path: str | None, top: int = 60):
    """Profile the body when ``path`` is given (else a no-op) and write the report there."""
    if not path:
        yield
        return
    comp = _CompileLog()
    comp.install()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        comp.uninstall()
        wall = time.perf_counter() - t0
        buf = io.StringIO()
        buf.write(f"zerodiff profile: {wall:.1f} s wall\n\n")
        buf.write(comp.report())
        for key in ("cumulative", "tottime"):
            buf.write(f"\n==== cProfile, top {top} by {key} ====\n")
            st = pstats.Stats(prof, stream=buf)
            st.sort_stats(key).print_stats(top)
        with open(path, "w") as f:
            f.write(buf.getvalue())
        print(f"wrote profile {path}", flush=True)
