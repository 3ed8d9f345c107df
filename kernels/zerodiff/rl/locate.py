"""Op-level divergence locator: record every op's output on both sides and name the first op whose bits differ.

:class:`OpRecorder` is a :class:`~zerodiff.rl.diverge.Recorder` (it also keeps the per-layer rows) that the
rollout engine and the training forward accept as ``record``: for every model forward they call
``record.ops_for(ops, step)`` and run ``forward_step`` with the returned proxy, which forwards every call to the
real ops object and stores each op's visible output per token, keyed by ``(request, position)``.

Op names follow the model's weight names (``zerodiff.model.weights.param_shapes``): an op that reads a weight is
named after it (``layers.0.wq_a`` is the FP8 linear with that weight, ``layers.0.q_norm`` the RMSNorm,
``layers.1.gate`` the router GEMM, ``lm_head``, ``embed``); ops without a weight are named inside their layer:

=========================== =======================================================================
``layers.L.attn_hc_pre``    mHC pre of the attention sub-layer (outputs ``:post``, ``:comb`` beside it)
``layers.L.q_rope``         RoPE of the query's rope part; ``layers.L.k_rope`` the key's
``layers.L.dsa_topk``       DSA indexer + Top-K selection (request-local positions)
``layers.L.attention``      sparse MLA attention over the selected positions
``layers.L.attn_hc_post``   mHC post of the attention sub-layer (the residual streams after it)
``layers.L.ffn_hc_pre``     mHC pre of the MoE sub-layer (``:post``, ``:comb``)
``layers.L.route``          expert weights of the routing (``:ids`` the expert ids)
``layers.L.moe``            routed experts + shared expert, combined
``layers.L.ffn_hc_post``    mHC post of the MoE sub-layer
``mhc_final``               the streams summed before the final norm
=========================== =======================================================================

:func:`first_op_divergence` walks the ops in model order (the order of the rollout's first forward) and returns
the first whose output differs bitwise for any token both sides computed. Every op earlier in that order was
bitwise equal for EVERY token, including the earlier positions whose K the attention reads from the cache, so
the op named has equal inputs on both sides and is itself the one that depends on the batch or the phase.

:func:`locate` runs one RL step's rollout and the training forward (no update) of an :class:`~zerodiff.rl.loop.
RLRun` with op-level recording and returns a JSON-able report. The rollout runs every step eagerly while
recording (captured CUDA graphs cannot call back into Python); graph == eager is covered by its own tests.
"""

from __future__ import annotations

import torch

from .diverge import Recorder, ops_for, store_rows  # noqa: F401 - ops_for re-exported

#: ops the proxy records (the calls ``forward_step`` makes on its ops object)
RECORDED_OPS = ("embed", "mhc_pre", "rms_norm", "fp8_linear", "bf16_linear", "rope", "indexer_topk", "attention",
                "mhc_post", "router", "route", "moe", "mhc_final", "lm_head")
_ROPE = ("q_rope", "k_rope")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (NaN == NaN when the bits are equal, -0 != +0)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_floating_point():
        return t.view(_INT_VIEW[t.element_size()])
    return t


def layer_of(name: str):
    """Layer index of an op name (``layers.L.x`` -> L), None for ops outside the layers."""
    if name.startswith("layers."):
        return int(name.split(".")[1])
    return None


class _RecordingOps:
    """Proxy over one ops object for one forward: every call in :data:`RECORDED_OPS` goes to the real op, and its
    output is handed to the sink under the op's name. Everything else (``put``, ``g``, ``cfg``, ...) is the real
    object's, so the values and the training graph are exactly those of an unrecorded forward."""

    def __init__(self, ops, step, sink):
        self.__dict__.update(_ops=ops, _step=step, _sink=sink, _scope=None, _hc=None, _rope=0)

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if name in RECORDED_OPS and callable(attr):
            return lambda *a, **k: self._call(name, attr, a, k)
        return attr

    def __setattr__(self, name, value):
        setattr(self._ops, name, value)

    def _name(self, op, args) -> str:
        wname = next((a.name for a in args if hasattr(a, "name") and hasattr(a, "dep")), None)
        if wname is not None and wname.startswith("layers."):
            scope = ".".join(wname.split(".")[:2])
            if scope != self._scope:
                self.__dict__.update(_scope=scope, _rope=0)
        if op == "mhc_pre":
            name = wname[: -len("_fn")] + "_pre" if wname.endswith("_fn") else wname + "_pre"
            self.__dict__["_hc"] = name[: -len("_pre")]
            return name
        if op == "mhc_post":
            return f"{self._hc}_post" if self._hc else f"{self._scope}.hc_post"
        if op in ("attention", "indexer_topk"):
            layer = next(a for a in args if isinstance(a, int) and not isinstance(a, bool))
            return f"layers.{layer}." + ("attention" if op == "attention" else "dsa_topk")
        if op == "rope":
            i = self._rope
            self.__dict__["_rope"] = i + 1
            return f"{self._scope}.{_ROPE[i] if i < len(_ROPE) else f'rope{i}'}"
        if op == "route":
            return f"{self._scope}.route"
        if op == "moe":
            return f"{self._scope}.moe"
        if op == "mhc_final":
            return "mhc_final"
        return wname if wname is not None else f"{self._scope}.{op}"

    def _call(self, op, fn, args, kwargs):
        out = fn(*args, **kwargs)
        name = self._name(op, args)
        step = self._step
        if op == "lm_head":
            keys = [step.keys[i] for i in step.logits_rows.tolist()]
        else:
            keys = step.keys
        outs = out if isinstance(out, tuple) else (out,)
        suffixes = {"mhc_pre": ("", ":post", ":comb"), "route": ("", ":ids")}.get(op, ("",) * len(outs))
        plant = getattr(self._sink, "plant", None)
        if plant is not None and plant in [name + sfx for sfx in suffixes]:
            i = [name + sfx for sfx in suffixes].index(plant)
            outs = outs[:i] + (_one_ulp_up(outs[i]),) + outs[i + 1:]
            out = outs if isinstance(out, tuple) else outs[0]
            self._sink.planted_hits += 1
        for sfx, t in zip(suffixes, outs):
            if torch.is_tensor(t) and t.dim() >= 1 and t.shape[0] == len(keys):
                self._sink.op(name + sfx, keys, t)
        return out


def _one_ulp_up(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the first element of every row moved one ulp (its bit pattern + 1: away from zero): a planted
    divergence."""
    if not t.is_floating_point():
        raise ValueError(f"zerodiff locate: cannot plant a divergence in an op with {t.dtype} output")
    t = t.detach().clone()
    b = t.view(_INT_VIEW[t.element_size()])
    b[(slice(None),) + (0,) * (t.dim() - 1)] += 1
    return t


class OpRecorder(Recorder):
    """Per-layer rows (as :class:`Recorder`) plus every op's output per token (``op_order`` / ``op_rows``).

    ``plant`` (an op name, e.g. ``layers.1.q_norm`` or ``layers.0.attn_hc_pre:post``): on the side recorded with
    it, that op's output is moved one ulp (first element of every token's row) before the model goes on: a
    divergence planted at a known op, for checking the locator itself (no-gradient forwards only)."""

    def __init__(self, plant: str | None = None):
        super().__init__()
        self.op_order: list = []
        self.op_rows: dict = {}
        self.plant = plant
        self.planted_hits = 0

    def ops_for(self, ops, step):
        return _RecordingOps(ops, step, self)

    def op(self, name, keys, t):
        store_rows(self.op_order, self.op_rows, name, keys, t)

    def stacked(self, name: str, key, positions) -> torch.Tensor:
        """Rows of op ``name`` for request ``key`` at ``positions``, stacked."""
        d = self.op_rows[name]
        return torch.stack([d[(key, int(p))] for p in positions])


def first_op_divergence(rollout: OpRecorder, train: OpRecorder) -> dict | None:
    """None if every op's output is bitwise equal on every token both sides computed; else the first op in model
    order whose output differs: its name and layer, the first differing token (lowest position, then request),
    the first differing coordinate inside that token's output with both values, the max |difference| over the op's
    differing tokens, and how many tokens differ / were compared."""
    for name in rollout.op_order:
        a, b = rollout.op_rows.get(name, {}), train.op_rows.get(name, {})
        common = sorted(set(a) & set(b), key=lambda k: (k[1], str(k[0])))
        bad = [k for k in common if a[k].shape != b[k].shape or not torch.equal(bits(a[k]), bits(b[k]))]
        if not bad:
            continue
        k = bad[0]
        ra, rb = a[k], b[k]
        if ra.shape != rb.shape:
            coord, va, vb = None, None, None
        else:
            coord = [int(i) for i in (bits(ra) != bits(rb)).nonzero()[0].tolist()]
            va, vb = ra[tuple(coord)].item(), rb[tuple(coord)].item()
        mx = 0.0
        for kk in bad:
            if a[kk].shape == b[kk].shape:
                d = (a[kk].double() - b[kk].double()).abs()
                d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
                mx = max(mx, float(d.max()))
        return {"op": name, "layer": layer_of(name), "request": k[0], "position": int(k[1]), "coordinate": coord,
                "rollout_value": va, "train_value": vb, "max_abs_diff": mx, "tokens_differ": len(bad),
                "tokens_compared": len(common), "dtype": str(ra.dtype).replace("torch.", ""),
                "ops_before_equal": rollout.op_order.index(name)}
    return None


def locate(run, step: int | None = None, plant: str | None = None) -> dict:
    """One RL step's rollout and training forward of ``run`` (an :class:`~zerodiff.rl.loop.RLRun`; no update)
    with op-level recording on both sides; returns the first differing op (or None) and what was compared.
    ``plant``: an op name whose training-side output is moved one ulp (see :class:`OpRecorder`)."""
    from .loop import _mix
    from .report import diff_report

    step = run.step if step is None else step
    rr, rt = OpRecorder(), OpRecorder(plant=plant)
    _, out = run.rollout(step, record=rr)
    seqs = [(k, o.prompt, o.response) for k, o in sorted(out.items())]
    lp_t = run.trainer.run(seqs, pack_seed=_mix(run.seed, step, 3), grad=False, record=rt)
    rep = diff_report({k: o.logprobs for k, o in out.items()}, lp_t)
    div = first_op_divergence(rr, rt)
    if div is None and not rep["bitwise_equal"]:  # every recorded op equal: the log-softmax itself
        div = {"op": "logprobs", "layer": None, "tokens_differ": rep["tokens_differ"],
               "tokens_compared": rep["tokens"], "max_abs_diff": rep["training/rollout_probs_diff_max"],
               "ops_before_equal": len(rr.op_order)}
    missing = [n for n in rr.op_order if n not in rt.op_rows]
    if plant is not None and plant not in rr.op_order:
        raise ValueError(f"zerodiff locate: no op named {plant!r}; the ops are {rr.op_order}")
    return {"step": step, "mode": run.mode, "divergence": div, "ops_compared": len(rr.op_order),
            "planted": plant, "planted_calls": rt.planted_hits if plant is not None else None,
            "op_names": list(rr.op_order), "ops_missing_on_train_side": missing,
            "tokens": sum(len(o.prompt) + len(o.response) - 1 for o in out.values()),
            "logprobs": {k: rep[k] for k in ("tokens", "tokens_differ", "bitwise_equal",
                                             "training/rollout_probs_diff_max", "rollout_corr/k3_kl")},
            "engine_steps": run.engine.stats["steps"], "batch_sizes": sorted(set(run.engine.stats["batch_sizes"]))}
