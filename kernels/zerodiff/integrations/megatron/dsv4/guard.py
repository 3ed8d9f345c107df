"""The DeepSeek-V4 actor's guard: one :class:`ConfigError` naming every setting that cannot keep diff = 0.

:func:`actor_problems` collects, for a ``TransformerConfig`` (or look-alike) and the run's settings:

* everything :func:`zerodiff.integrations.megatron.guard.validate_config` refuses (TP / expert TP > 1, EP > 1,
  CP other than all-gather, sequence parallel, ``transformer_impl`` other than ``local`` (the Transformer
  Engine spec), TE FP8 / FP4 recipes, dropout, fused CE, non-FP32 router, ...), including the world sizes
  ``parallel_state`` was initialised with;
* ``context_parallel_size > 1`` even with the all-gather: the actor's attention has no CP split;
* ``pipeline_model_parallel_size > 1`` (and the parallel_state PP world size), virtual pipeline stages, and a
  model built without ``pre_process`` or ``post_process`` (a pipeline stage): the actor is one stage;
* ``mtp_num_layers``: multi-token prediction has no rollout counterpart;
* ``updates_per_rollout_step`` other than 1 (e.g. Megatron-RL's ``grpo_iterations``): every update after the
  first recomputes log-probs with weights the rollout never ran;
* a layer spec / module class from Transformer Engine (``spec``: classes named ``TE*``).

:func:`check_actor` raises; it runs whether or not ``ZERODIFF_CONSISTENT`` is set (the actor exists only for
consistency mode).
"""

from __future__ import annotations

import sys
from typing import Any

from ... import ConfigError, _problems_to_error
from ..guard import config_values, validate_config

__all__ = ["actor_problems", "check_actor"]


def _pp_world_size() -> int | None:
    ps = sys.modules.get("megatron.core.parallel_state")
    try:
        if ps is not None and ps.model_parallel_is_initialized():
            return int(ps.get_pipeline_model_parallel_world_size())
    except Exception:  # pragma: no cover - a fork without the helper
        return None
    return None


def actor_problems(config: Any, *, pre_process: bool = True, post_process: bool = True,
                   updates_per_rollout_step: int = 1, spec: Any = None) -> list:
    """Every refused setting (one line each, naming it); empty when the actor keeps diff = 0."""
    p: list = []
    try:
        validate_config(**config_values(config))
    except ConfigError as e:
        p += [ln[4:] for ln in str(e).splitlines() if ln.startswith("  - ")]
    g = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    cp = int(g("context_parallel_size", 1) or 1)
    if cp > 1 and not any("cp_comm_type" in x for x in p):
        p.append(f"context_parallel_size={cp}: the actor's attention reads each sequence whole (no CP split, not even "
                 "the all-gather); use 1")
    pp = int(g("pipeline_model_parallel_size", 1) or 1)
    if pp > 1:
        p.append(f"pipeline_model_parallel_size={pp}: the actor is one pipeline stage; use 1")
    pp_ws = _pp_world_size()
    if pp_ws is not None and pp_ws > 1:
        p.append(f"parallel_state pipeline-parallel world size {pp_ws}: the actor is one pipeline stage; use 1")
    if g("virtual_pipeline_model_parallel_size"):
        p.append(f"virtual_pipeline_model_parallel_size={g('virtual_pipeline_model_parallel_size')}: no pipeline "
                 "stages; leave it unset")
    if not pre_process or not post_process:
        p.append(f"pre_process={pre_process} / post_process={post_process}: a pipeline stage; the actor runs "
                 "embedding through LM head in one module (both True)")
    if g("mtp_num_layers"):
        p.append(f"mtp_num_layers={g('mtp_num_layers')}: multi-token prediction has no rollout counterpart; leave it "
                 "unset")
    if int(updates_per_rollout_step) != 1:
        p.append(f"updates_per_rollout_step={updates_per_rollout_step} (grpo_iterations): every update after the "
                 "first recomputes log-probs with weights the rollout never ran; use 1")
    if spec is not None:
        for cls in _spec_classes(spec):
            mod, name = getattr(cls, "__module__", "") or "", getattr(cls, "__name__", str(cls))
            if name.startswith("TE"):
                p.append(f"layer spec module {name} ({mod}): Transformer Engine modules are not used by the actor; "
                         "pass no spec / the local spec")
    return p


def _spec_classes(spec, seen=None):
    """Module classes named anywhere in a ModuleSpec tree (or a class / list of them)."""
    seen = set() if seen is None else seen
    if id(spec) in seen:
        return []
    seen.add(id(spec))
    if isinstance(spec, type):
        return [spec]
    if isinstance(spec, (list, tuple)):
        return [c for s in spec for c in _spec_classes(s, seen)]
    out = []
    mod = getattr(spec, "module", None)
    if isinstance(mod, type):
        out.append(mod)
    subs = getattr(spec, "submodules", None)
    if subs is not None:
        if hasattr(subs, "__dict__"):
            vals = subs.__dict__.values()
        else:
            vals = subs if isinstance(subs, (list, tuple)) else []
        for v in vals:
            out += _spec_classes(v, seen)
    return out


def check_actor(config: Any, **kw) -> None:
    """Raise one :class:`ConfigError` listing :func:`actor_problems` (no-op when there are none)."""
    _problems_to_error("DeepSeek-V4 actor", actor_problems(config, **kw))
