"""First-diverging-layer finder: compare recorded per-token layer outputs of the rollout and the training
forward (keyed by (request, position)) in layer order and name the first layer where any token differs.
"""

from __future__ import annotations

import torch


class Recorder:
    """``record(name, keys, tensor)`` callback storing per-token rows under (name, key)."""

    def __init__(self):
        self.order: list = []
        self.rows: dict = {}

    def __call__(self, name, keys, t):
        store_rows(self.order, self.rows, name, keys, t)


def store_rows(order: list, rows: dict, name: str, keys, t: torch.Tensor) -> None:
    """Store row ``i`` of ``t`` (on the CPU) as ``rows[name][keys[i]]``; a new ``name`` is appended to ``order``."""
    if name not in rows:
        order.append(name)
        rows[name] = {}
    d = rows[name]
    t = t.detach().cpu()
    for i, k in enumerate(keys):
        d[k] = t[i]


def first_divergence(rollout: Recorder, train: Recorder) -> dict | None:
    """None if every common (layer, token) row is bitwise equal; else the first layer (model order) with a
    difference, the first differing (request, position) in that layer and how many rows differ."""
    for name in rollout.order:
        a, b = rollout.rows.get(name, {}), train.rows.get(name, {})
        common = sorted(set(a) & set(b), key=lambda k: (k[1], str(k[0])))
        bad = [k for k in common if not torch.equal(a[k], b[k])]
        if bad:
            k = bad[0]
            da, db = a[k].float(), b[k].float()
            return {"layer": name, "request": k[0], "position": int(k[1]), "rows_differ": len(bad),
                    "rows_compared": len(common), "max_abs": float((da - db).abs().max())}
    return None


def ops_for(record, ops, step):
    """What the engine and the training forward pass to ``forward_step``: the recording proxy when ``record``
    asks for op-level rows, else ``ops`` itself."""
    wrap = getattr(record, "ops_for", None)
    return ops if wrap is None else wrap(ops, step)
