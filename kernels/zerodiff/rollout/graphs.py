"""CUDA graphs for pure-decode rollout steps (static workspaces; graph == eager by construction).

For each padded batch size ``S`` in ``rollout.graph_batch_sizes`` one graph of ``forward_step`` is captured
lazily on first use. Static inputs: tokens / slot / pos / block table (``ceil(max_pos / block_size)``
columns, the model limit) / cached lengths; static output: FP32 logits ``[S, vocab]``. A step of ``B <= S``
decode tokens copies its inputs into rows ``0..B-1`` and fills rows ``B..S-1`` with padding requests that
write and read only a reserved scratch KV block at position 0, so they never touch real requests.

Why graph == eager bit for bit: every op is per row (a row's value does not depend on the batch size or
on the other rows), the indexer width is the static model limit, the MoE dispatches in the masked layout
with the static capacity S (``ops.graph_safe``: no host sync, no data-dependent shapes; a token's value is
the same as in the contiguous layout of eager steps and training, by ``moe_experts``' contract), and value
checks that would sync with the host are off during capture (``cache.check = False``; the kernels' NaN
poisoning remains). Weights are read from the deployment's storage, which ``Deployment.update_`` rewrites
in place, so captured graphs stay valid across RL steps.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from ..model.forward import StepInputs, forward_step

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the harness's own code that runs inside the captured decode step (exact_ops.py is the CPU-only stand-in)
GUARD_ROOTS = tuple(os.path.join(_PKG, d) + os.sep for d in ("model", "rollout", "training", "rl"))
GUARD_EXEMPT = (os.path.join(_PKG, "model", "exact_ops.py"),)


class HostSyncError(RuntimeError):
    """A host<->device transfer, host sync or value-dependent shape issued inside the captured region."""


def _bool_index(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def host_sync_guard(roots=GUARD_ROOTS, exempt=GUARD_EXEMPT):
    """Inside this context, any call issued from a file under ``roots`` (not in ``exempt``) that would copy
    between host and device, synchronise with the host or make a shape depend on device values raises
    :class:`HostSyncError` naming the call and ``file:line``: ``Tensor.item/tolist/cpu/numpy``,
    ``bool()/int()/float()`` of a tensor, ``nonzero``/``unique``/``masked_select``, boolean-mask indexing,
    ``torch.tensor``/``torch.as_tensor`` (Python data -> device), ``Tensor.to`` onto another device,
    ``repeat_interleave`` without ``output_size``, ``torch.cuda.synchronize``. Calls made by zerodiff's ops
    (``zerodiff.ops``) are not inspected here (their own tests and the GPU capture check them).

    Used by the CPU emulation of the captured decode step (``DecodeGraphs(guard=True)``)."""

    def ours(depth=2):
        f = sys._getframe(depth)
        fn = f.f_code.co_filename
        if fn.startswith(roots) and fn not in exempt:
            return f"{os.path.relpath(fn, _PKG)}:{f.f_lineno}"
        return None

    patches = []

    def wrap(owner, name, pred=None, what=None):
        orig = getattr(owner, name)

        def fn(*a, **k):
            where = ours()
            if where and (pred is None or pred(*a, **k)):
                raise HostSyncError(f"zerodiff: {what or name} inside the captured decode step at {where} "
                                    "(host<->device copy / host sync / value-dependent shape breaks CUDA-graph capture)")
            return orig(*a, **k)

        patches.append((owner, name, orig))
        setattr(owner, name, fn)

    T = torch.Tensor
    for n in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero", "unique",
              "masked_select"):
        wrap(T, n, what=f"Tensor.{n}")
    for n in ("tensor", "as_tensor", "nonzero", "unique", "masked_select"):
        wrap(torch, n, what=f"torch.{n}")
    wrap(torch.cuda, "synchronize", what="torch.cuda.synchronize")
    wrap(torch, "repeat_interleave", lambda *a, **k: k.get("output_size") is None and len(a) > 1 and torch.is_tensor(a[1]),
         "torch.repeat_interleave with tensor repeats and no output_size")

    def other_device(self, *a, **k):
        dev = k.get("device")
        for x in a:
            if isinstance(x, (str, torch.device)):
                dev = x
        return dev is not None and torch.device(dev).type != self.device.type

    wrap(T, "to", other_device, "Tensor.to(another device)")
    wrap(T, "__getitem__", lambda self, idx: _bool_index(idx), "boolean-mask indexing")
    wrap(T, "__setitem__", lambda self, idx, v: _bool_index(idx), "boolean-mask assignment")
    try:
        yield
    finally:
        for owner, name, orig in reversed(patches):
            setattr(owner, name, orig)


class DecodeGraphs:
    def __init__(self, engine, guard: bool = False):
        self.engine = engine
        self.guard = guard  # run the (emulated) captured step under host_sync_guard
        cfg, rc = engine.cfg, engine.rcfg
        self.sizes = sorted(rc.graph_batch_sizes)
        self.max_blocks = (cfg.max_pos + rc.block_size - 1) // rc.block_size
        self.scratch = engine.cache.allocator.alloc(1)[0]  # padding rows live here
        self.graphs: dict = {}
        self.pool = None
        self.disabled: str | None = None  # why capture failed (then decode steps run eagerly; reported)

    def _static_step(self, S: int) -> StepInputs:
        dev = self.engine.device
        st = StepInputs(
            tokens=torch.zeros(S, dtype=torch.int64, device=dev),
            slot=torch.arange(S, dtype=torch.int32, device=dev),
            pos=torch.zeros(S, dtype=torch.int32, device=dev),
            block_table=torch.full((S, self.max_blocks), -1, dtype=torch.int32, device=dev),
            ctx_before=torch.ones(S, dtype=torch.int64, device=dev),
            n_tok=torch.ones(S, dtype=torch.int64, device=dev),
            q_start=torch.arange(S, dtype=torch.int64, device=dev),
            logits_rows=torch.arange(S, dtype=torch.int64, device=dev),
            max_pos=self.engine.cfg.max_pos - 1,  # static: the indexer width is the model limit
            pure_decode=True,
        )
        st.block_table[:, 0] = self.scratch
        return st

    def _fill(self, st: StepInputs, step: StepInputs) -> None:
        B = step.T
        st.tokens[:B].copy_(step.tokens)
        st.pos[:B].copy_(step.pos)
        st.ctx_before[:B].copy_(step.ctx_before)
        st.block_table.fill_(-1)
        mb = step.block_table.shape[1]
        st.block_table[:B, :mb].copy_(step.block_table)
        # padding rows: token 0 at position 0 of the scratch block
        st.tokens[B:].zero_()
        st.pos[B:].zero_()
        st.ctx_before[B:].fill_(1)
        st.block_table[B:, 0] = self.scratch

    def _run_eager_static(self, st, guard: bool = False):
        with host_sync_guard() if guard else contextlib.nullcontext():
            return forward_step(self.engine.dep, st, self.engine.cache, self.engine.ops)

    def _capture(self, S: int):
        eng = self.engine
        st = self._static_step(S)
        old_check, old_safe = eng.cache.check, eng.ops.graph_safe
        eng.cache.check, eng.ops.graph_safe = False, True
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):  # warm-up: JIT compiles, backend probes, lazy tables
                    self._run_eager_static(st)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._run_eager_static(st)
            if self.pool is None:
                self.pool = g.pool()
        finally:
            eng.cache.check, eng.ops.graph_safe = old_check, old_safe
        self.graphs[S] = (g, st, out)
        return self.graphs[S]

    def capture_all(self) -> dict:
        """Capture every padded batch size now (all rows are padding on the scratch block: no request is
        touched), so no capture happens inside a timed rollout. Returns {size: None | failure text}."""
        out = {}
        for S in self.sizes:
            if S in self.graphs or self.disabled is not None:
                out[S] = self.disabled
                continue
            try:
                self._capture(S)
                out[S] = None
            except Exception as e:  # same policy as run(): report, decode steps then run eagerly
                self.disabled = f"CUDA graph capture failed for batch {S}: {type(e).__name__}: {str(e)[:400]}"
                out[S] = self.disabled
                torch.cuda.synchronize()
        return out

    def supports(self, step: StepInputs) -> bool:
        return self.disabled is None and step.T <= self.sizes[-1] and step.block_table.shape[1] <= self.max_blocks

    def run(self, step: StepInputs, *, eager: bool = False) -> torch.Tensor:
        """Logits [B, vocab] for a pure-decode step (replay; ``eager=True`` runs the same padded static step
        eagerly, for graph == eager tests)."""
        if not self.supports(step):
            return forward_step(self.engine.dep, step, self.engine.cache, self.engine.ops)
        B = step.T
        S = next(x for x in self.sizes if x >= B)
        if eager:
            st = self._static_step(S)
            self._fill(st, step)
            st.pure_decode = True
            eng = self.engine
            old_check, old_safe = eng.cache.check, eng.ops.graph_safe
            eng.cache.check, eng.ops.graph_safe = False, True  # exactly the capture's settings
            try:
                return self._run_eager_static(st, guard=self.guard)[:B].clone()
            finally:
                eng.cache.check, eng.ops.graph_safe = old_check, old_safe
        entry = self.graphs.get(S)
        if entry is None:
            try:
                entry = self._capture(S)
            except Exception as e:  # fail loudly but keep the rollout running eagerly (graph_steps stays 0)
                import warnings

                import traceback

                frames = [f"{os.path.relpath(fr.filename, _PKG)}:{fr.lineno}" for fr in traceback.extract_tb(e.__traceback__)
                          if fr.filename.startswith(_PKG)][-4:]
                self.disabled = (f"CUDA graph capture failed for batch {S}: {type(e).__name__}: {str(e)[:400]} "
                                 f"(at {' <- '.join(reversed(frames))})")
                warnings.warn("zerodiff: " + self.disabled + "; pure-decode steps run eagerly")
                torch.cuda.synchronize()
                return forward_step(self.engine.dep, step, self.engine.cache, self.engine.ops)
        g, st, out = entry
        self._fill(st, step)
        g.replay()
        return out[:B].clone()
