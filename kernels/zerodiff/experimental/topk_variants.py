"""Split-design Top-K configurations that did not ship: the candidates the benchmark sweep times.

Every candidate overrides some keys of ``zerodiff.ops.topk._split_config(W)`` (slice width SW, full-row
levels LV of D0-bit digits, kept-list digit D, finishing chunk CH, warps W1/W2/W3) and runs the shipped split
kernels through ``zerodiff.ops.topk._topk_triton(..., variant="split", split=cfg)``. The split design is exact
integer logic, so every candidate gives the reference's positions bit for bit (``tests/test_experimental_topk.py``
checks that); only the speed differs. Each configuration is a function of the row width W only.

API: :data:`SPLIT_CANDIDATES` (key ``name`` is a label; ``SW`` may be "half" / "double" / "quad" of the
shipped slice width), :func:`split_candidate` ``(W, cand) -> override dict``.
"""

from __future__ import annotations

from zerodiff.ops.topk import _split_config

__all__ = ["SPLIT_CANDIDATES", "SPLIT_MAX_CANDIDATE_SW", "split_candidate"]

#: split-config overrides the benchmark sweep times and the GPU tests check (each one exact by construction;
#: only the speed differs)
SPLIT_CANDIDATES = (
    dict(name="default"),  # 2 full-row levels of 8 bits, 2 passes of 8 bits over the kept list
    dict(name="lv1-d0_8", LV=1, D0=8, D=8),  # 1 full-row level: large kept list (whole octave pairs)
    dict(name="lv1-d0_10-d11", LV=1, D0=10, D=11),  # 1 level of 1024 bins (4.5x the cost per element)
    dict(name="lv3-d0_8", LV=3, D0=8, D=8),  # 3 full-row levels: tiny kept list, one more row read
    dict(name="lv2-d0_6-d10", LV=2, D0=6, D=10),  # cheaper row histograms, 1024-bin finish passes
    dict(name="ch1024", CH=1024),
    dict(name="ch256", CH=256),
    dict(name="sw_half", SW="half"),  # twice as many slices (more programs for few rows)
    dict(name="sw_double", SW="double"),  # half as many slices (fewer, longer programs)
    dict(name="sw_quad", SW="quad"),  # a quarter of the slices
    dict(name="lv3_sw_double", LV=3, SW="double"),  # tiny kept list, fewer programs
    dict(name="w1_4", W1=4, W2=4),
    dict(name="w3_8", W3=8),
)

#: the widest slice a candidate asks for (one program holds SW keys in registers: 16K at 8 warps is 64 per
#: thread)
SPLIT_MAX_CANDIDATE_SW = 16384


def split_candidate(W: int, cand: dict) -> dict:
    """The overrides of a :data:`SPLIT_CANDIDATES` entry at width W (``split=`` of ``_topk_triton``)."""
    cfg = {key: v for key, v in cand.items() if key != "name"}
    if cfg.get("SW") == "half":
        cfg["SW"] = max(16, _split_config(W)["SW"] // 2)
    elif cfg.get("SW") == "double":
        cfg["SW"] = min(SPLIT_MAX_CANDIDATE_SW, _split_config(W)["SW"] * 2)
    elif cfg.get("SW") == "quad":
        cfg["SW"] = min(SPLIT_MAX_CANDIDATE_SW, _split_config(W)["SW"] * 4)
    return cfg
