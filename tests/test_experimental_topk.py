"""Split-design Top-K sweep candidates (zerodiff.experimental.topk_variants): every candidate gives the
reference's positions and score bits (interpreter at a small width, GPU at the DSA widths)."""

import pytest
import torch
from bitwise import assert_bitwise_equal
from topk_cases import adversarial_rows, gpu_rows

from zerodiff import _triton as zt
from zerodiff.experimental import topk_variants as xt
from zerodiff.ops.topk import _split_config, _topk_triton
from zerodiff.reference.topk import deterministic_topk_ref

needs_triton = pytest.mark.skipif(not zt.HAVE_TRITON, reason="triton not installed")

CANDIDATE_NAMES = tuple(c["name"] for c in xt.SPLIT_CANDIDATES)
GPU_WIDTHS = (8192, 16384, 65536)
CPU_WIDTH = 300


def test_candidates_are_functions_of_the_width():
    assert CANDIDATE_NAMES[0] == "default" and len(set(CANDIDATE_NAMES)) == len(CANDIDATE_NAMES)
    assert xt.split_candidate(65536, xt.SPLIT_CANDIDATES[0]) == {}  # "default" = the shipped config
    for W in (300, 8192, 65536, 163840):
        for cand in xt.SPLIT_CANDIDATES:
            cfg = xt.split_candidate(W, cand)
            assert "name" not in cfg and set(cfg) <= set(_split_config(W)), (W, cand)
            assert cfg == xt.split_candidate(W, cand)
            assert cfg.get("SW", 16) <= xt.SPLIT_MAX_CANDIDATE_SW
    sw = _split_config(8192)["SW"]
    byname = {c["name"]: c for c in xt.SPLIT_CANDIDATES}
    assert xt.split_candidate(8192, byname["sw_half"])["SW"] == sw // 2
    assert xt.split_candidate(8192, byname["sw_quad"])["SW"] == min(xt.SPLIT_MAX_CANDIDATE_SW, 4 * sw)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the native test covers the candidates")
def test_candidates_match_reference_on_the_interpreter(seeded):
    g = seeded()
    W = CPU_WIDTH
    s = torch.cat([adversarial_rows(W, g)[[1, 4, 5]], torch.randn(1, W, generator=g)])
    L = torch.tensor([W, 250, 17, W - 1], dtype=torch.int32)
    rpos, rval = deterministic_topk_ref(s, 40, L, return_scores=True)
    for cand in xt.SPLIT_CANDIDATES:
        pos, val = _topk_triton(s, 40, L, True, variant="split", split=xt.split_candidate(W, cand))
        assert_bitwise_equal(pos, rpos, f"split {cand['name']} positions")
        assert_bitwise_equal(val, rval, f"split {cand['name']} scores")


@pytest.mark.gpu
@pytest.mark.parametrize("W", GPU_WIDTHS)
def test_gpu_split_candidates_exact(seeded, W):
    g = seeded(f"split-{W}")
    s = torch.cat([gpu_rows(8, W, g), adversarial_rows(W, g)])
    L = torch.randint(0, W + 1, (s.shape[0],), generator=g, dtype=torch.int32)
    L[:3] = torch.tensor([W, 2048, 2047], dtype=torch.int32)
    sc, Lc = s.cuda(), L.cuda()
    refs = {(k, ln): deterministic_topk_ref(s, k, L if ln else None, return_scores=True)
            for k in (2048, 1, 513) for ln in (False, True)}
    for cand in xt.SPLIT_CANDIDATES:
        cfg = xt.split_candidate(W, cand)
        # the default config on every (k, lengths) case; the others (sweep candidates: compile time) on the
        # DSA case k=2048 with lengths, plus k=513 without (both constexpr flavours of the kernels)
        cases = refs if cand["name"] == "default" else {key: refs[key] for key in ((2048, True), (513, False))}
        for (k, ln), (rpos, rval) in cases.items():
            pos, val = _topk_triton(sc, k, Lc if ln else None, True, variant="split", split=cfg)
            assert_bitwise_equal(pos.cpu(), rpos, f"split {cand['name']} W={W} k={k} lengths={ln}")
            assert_bitwise_equal(val.cpu(), rval, f"split {cand['name']} scores W={W} k={k}")
