"""Deterministic Top-K: reference vs an independent brute force, tie/order rules, bad inputs, the Triton
kernel (interpreter on the CPU, native on the GPU) bitwise equal to the reference, victim-in-batch
invariance, and negative controls showing that stock ``torch.topk`` does not keep the contract."""

import math

import pytest
import torch
from bitwise import assert_bitwise_equal, bits
from topk_cases import adversarial_rows
from topk_cases import gpu_rows as _gpu_rows

from zerodiff import _triton as zt
import zerodiff.ops.topk as topk_mod
from zerodiff.ops.topk import _topk_triton, deterministic_topk, topk_routing
from zerodiff.reference.topk import deterministic_topk_ref, order_preserving_bits

needs_triton = pytest.mark.skipif(not zt.HAVE_TRITON, reason="triton not installed")
# the Triton tests run through the interpreter on CPU tensors here, and natively where CUDA is present
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# parametrize lists
BRUTE_CASES = ((1, 1), (7, 3), (64, 8), (256, 8), (300, 64), (513, 600))
BAD_INPUT_BACKENDS = ("reference", pytest.param("triton", marks=needs_triton))
TRITON_CASES = (
    (200, 1, 32, 8, None), (200, 7, 32, 11, None), (200, 64, 32, 8, False), (200, 64, 32, 11, None),
    (200, 199, 64, 8, None), (200, 260, 32, 11, False),  # multi-chunk rows, both digit widths
    (2048, 8, None, None, None), (2048, 300, None, None, None),  # default config at a routing-like width
    (2304, 700, None, None, None),  # default config of wide rows (11-bit digits)
)
SPLIT_CASES = ((1, 0, None), (7, 1, None), (64, 2, False), (199, 3, None), (260, 0, None), (33, 4, None),
               (70, 5, False), (40, 0, False))
GPU_DSA_WIDTHS = (8192, 16384, 32768, 65536)
GPU_VICTIM_CASES = ((65536, 2048), (8192, 2048), (256, 8))
GPU_SPLIT_WIDTHS = (4096, 8192, 32768, 65536, 163840, 5000)
GPU_SPLIT_VICTIM_CASES = ((65536, 2048), (8192, 2048))


def _dev(t):
    return None if t is None else t.to(DEV)


# ---------------------------------------------------------------------------------------------------
# reference: independent brute force, rules, bad inputs
# ---------------------------------------------------------------------------------------------------
def brute(row, L, k):
    """Independent rule in plain Python floats: (score, position) tuples, -0.0 == 0.0, NaN dropped."""
    vals = row.tolist()
    cands = [(vals[p], p) for p in range(L) if not math.isnan(vals[p])]
    sel = sorted(cands, reverse=True)[:k]
    pos = sorted((p for _, p in sel), reverse=True)
    return pos + [-1] * (k - len(pos))


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("W,k", BRUTE_CASES)
def test_reference_matches_brute_force(seeded, W, k):
    g = seeded(f"{W}-{k}")
    s = torch.cat([adversarial_rows(W, g), torch.randn(3, W, generator=g)])
    R = s.shape[0]
    L = torch.randint(0, W + 1, (R,), generator=g, dtype=torch.int32)
    L[0] = W
    for lengths in (None, L):
        pos, sc = deterministic_topk_ref(s, k, lengths, return_scores=True)
        for r in range(R):
            n = W if lengths is None else int(lengths[r])
            assert pos[r].tolist() == brute(s[r], n, k), f"row {r} length {n}"
            ok = pos[r] >= 0
            assert bits_equal(sc[r][ok], s[r][pos[r][ok].long()])
            assert torch.all(torch.isneginf(sc[r][~ok]))


def test_reference_rules():
    inf, nan = float("inf"), float("nan")
    # ties go to the larger position; output sorted by position descending
    s = torch.tensor([[1.0, 2.0, 1.0, 2.0, 1.0]])
    assert deterministic_topk_ref(s, 3).tolist() == [[4, 3, 1]]
    # -0 and +0 are equal: the position decides
    s = torch.tensor([[0.0, -0.0, 0.0, -0.0]])
    assert deterministic_topk_ref(s, 2).tolist() == [[3, 2]]
    s = torch.tensor([[-0.0, 0.0, -1e-45, 1e-45]])
    assert deterministic_topk_ref(s, 2).tolist() == [[3, 1]]
    assert deterministic_topk_ref(s, 3).tolist() == [[3, 1, 0]]
    # -inf is a valid lowest score, NaN is never selected, k > candidates pads with -1
    s = torch.tensor([[-inf, nan, -inf, 5.0, nan]])
    p, v = deterministic_topk_ref(s, 4, return_scores=True)
    assert p.tolist() == [[3, 2, 0, -1]]
    assert v.tolist() == [[5.0, -inf, -inf, -inf]]
    # +inf above everything; denormals ordered by value
    s = torch.tensor([[1e-45, 2e-45, inf, 3e-45, 1e38]])
    assert deterministic_topk_ref(s, 3).tolist() == [[4, 3, 2]]
    # lengths: only positions < length; empty rows and all-NaN rows are all -1
    s = torch.tensor([[9.0, 8.0, 7.0, 100.0], [nan, nan, nan, nan], [1.0, 1.0, 1.0, 1.0]])
    L = torch.tensor([3, 4, 0], dtype=torch.int32)
    assert deterministic_topk_ref(s, 2, L).tolist() == [[1, 0], [-1, -1], [-1, -1]]
    # returned scores keep the input bits (-0.0 stays -0.0)
    s = torch.tensor([[-0.0, 1.0]])
    _, v = deterministic_topk_ref(s, 2, return_scores=True)
    assert bits_equal(v, torch.tensor([[1.0, -0.0]]))
    # the map sorts like the floats
    x = torch.tensor([-inf, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, inf])
    m = order_preserving_bits(x)
    assert torch.all(m[1:] >= m[:-1]) and m[3] == m[4]


@pytest.mark.parametrize("backend", BAD_INPUT_BACKENDS)
def test_bad_inputs(backend):
    s = torch.randn(2, 8)
    cases = [
        (lambda: deterministic_topk(s.double(), 2, backend=backend), "float32"),
        (lambda: deterministic_topk(s[0], 2, backend=backend), "2-D"),
        (lambda: deterministic_topk(s[None], 2, backend=backend), "2-D"),
        (lambda: deterministic_topk(s, 0, backend=backend), "k=0"),
        (lambda: deterministic_topk(s, -3, backend=backend), "k=-3"),
        (lambda: deterministic_topk(s, 10**6, backend=backend), "k=1000000"),
        (lambda: deterministic_topk(s, 2.0, backend=backend), "k must be"),
        (lambda: deterministic_topk(s, 2, torch.tensor([3, 9], dtype=torch.int32), backend=backend), "exceeds"),
        (lambda: deterministic_topk(s, 2, torch.tensor([-1, 3], dtype=torch.int32), backend=backend), "negative"),
        (lambda: deterministic_topk(s, 2, torch.tensor([3.0, 2.0]), backend=backend), "int32"),
        (lambda: deterministic_topk(s, 2, torch.tensor([3], dtype=torch.int32), backend=backend), "shape"),
        (lambda: deterministic_topk(s, 2, backend="cuda-magic"), "unknown backend"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def test_negative_control_torch_topk():
    """Stock torch.topk breaks the contract on ties: picks other positions and returns score order."""
    W, k = 64, 8
    s = torch.full((1, W), 1.0)
    stock = torch.topk(s, k, dim=1).indices.to(torch.int32)
    ours = deterministic_topk_ref(s, k)
    assert ours.tolist() == [list(range(W - 1, W - 1 - k, -1))]
    assert not torch.equal(stock, ours)
    # even sorting torch.topk's indices afterwards does not fix the SET on ties
    s = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0, 1.0, 3.0]])
    stock = torch.sort(torch.topk(s, 3, dim=1).indices, dim=1, descending=True).values.to(torch.int32)
    assert deterministic_topk_ref(s, 3).tolist() == [[7, 5, 3]]
    assert not torch.equal(stock, deterministic_topk_ref(s, 3))
    # and the output order of a plain torch.topk on distinct scores is score order, not position order
    s = torch.tensor([[5.0, 1.0, 4.0, 2.0]])
    assert torch.topk(s, 3).indices.tolist() == [[0, 2, 3]]
    assert deterministic_topk_ref(s, 3).tolist() == [[3, 2, 0]]


# ---------------------------------------------------------------------------------------------------
# Triton kernel through the interpreter (small shapes), bitwise equal to the reference
# ---------------------------------------------------------------------------------------------------
def _check_triton(s, k, lengths, chunk=None, digit=None, hist_mask=None, variant=None, split=None, both=True):
    if DEV == "cuda" and chunk is not None:
        chunk = max(chunk, 32)  # at least one warp's worth of lanes per chunk on the GPU
    kw = dict(chunk=chunk, digit=digit, hist_mask=hist_mask, variant=variant, split=split)
    pos, sc = _topk_triton(_dev(s), k, _dev(lengths), True, **kw)
    rpos, rsc = deterministic_topk_ref(s, k, lengths, return_scores=True)
    assert torch.equal(pos.cpu(), rpos.cpu()), f"positions differ (k={k}, {kw})"
    assert bits_equal(sc.cpu(), rsc.cpu()), f"scores differ (k={k}, {kw})"
    if not both:  # positions-only launch skipped (interpreter time); covered by other cases
        return
    only = _topk_triton(_dev(s), k, _dev(lengths), False, **kw)
    assert torch.equal(only.cpu(), rpos.cpu())


@needs_triton
@pytest.mark.parametrize("W,k,chunk,digit,hist_mask", TRITON_CASES)
def test_triton_matches_reference(seeded, W, k, chunk, digit, hist_mask):
    g = seeded(f"{W}-{k}-{chunk}-{digit}")
    s = torch.cat([adversarial_rows(W, g), torch.randn(1, W, generator=g) * 1e-3])
    if W > 1000:
        s = s[[0, 1, 4, 5, 8]]  # keep the interpreter cheap at the wide shape
    R = s.shape[0]
    L = torch.randint(0, W + 1, (R,), generator=g, dtype=torch.int32)
    L[0], L[-1] = W, min(k, W)
    _check_triton(s, k, None, chunk, digit, hist_mask)
    _check_triton(s, k, L, chunk, digit, hist_mask)


@needs_triton
def test_triton_edge_cases(seeded):
    g = seeded()
    s = torch.randn(3, 40, generator=g)
    _check_triton(s, 5, torch.tensor([0, 40, 1], dtype=torch.int32), 16)  # empty, full, single
    _check_triton(torch.empty(0, 40), 5, None, 16)  # no rows
    _check_triton(torch.empty(2, 0), 3, None, 16)  # zero width
    # strided (non-contiguous) rows and columns
    big = torch.randn(40, 6, generator=g)
    _check_triton(big.t(), 9, None, 16)
    _check_triton(big[::2].t()[:, ::3], 4, None, 16)
    # whatever lies past a row's length (+inf, NaN, huge) never matters, at lengths off the 16 grid
    t = torch.randn(3, 100, generator=g)
    t[0, 37:] = float("inf")
    t[1, 50:] = float("nan")
    t[2, 3:] = 3e38
    _check_triton(t, 8, torch.tensor([37, 50, 3], dtype=torch.int32), 32)
    # a row that is all ties at a radix boundary: 0x..FF / 0x..00 low bytes
    b = torch.tensor([0x3F800000, 0x3F8000FF, 0x3F800100, 0x3F80FF00] * 8, dtype=torch.int32)
    b = b.view(torch.float32)[None].clone()
    for k in (1, 7, 8, 9, 16, 17, 31):
        _check_triton(b, k, None, 16, 8)
        _check_triton(b, k, None, 16, 11)


@needs_triton
def test_triton_routing_shape(seeded):
    g = seeded()
    logits = torch.randn(5, 256, generator=g)
    logits[1] = torch.round(logits[1])  # heavy ties between experts
    logits[2, 100:] = logits[2, 0]  # a plateau that straddles the top-8 boundary
    logits[3] = torch.sigmoid(logits[3] * 40)  # saturated sigmoid scores: many exact 1.0 ties
    sc, ids = topk_routing(_dev(logits), 8, backend="triton")
    rids, rsc = deterministic_topk_ref(logits, 8, return_scores=True)
    assert torch.equal(ids.cpu(), rids) and bits_equal(sc.cpu(), rsc)
    assert torch.equal(topk_routing(logits, 8, backend="reference")[1], rids)


@needs_triton
def test_triton_victim_in_batch(seeded):
    """The victim's positions are the same alone and at several slots of batches of several sizes."""
    g = seeded()
    W, k = 96, 24
    victim = adversarial_rows(W, g)[4]  # quantised scores with +-inf: ties at the k boundary
    vlen = 90
    alone = _topk_triton(_dev(victim[None]), k, _dev(torch.tensor([vlen], dtype=torch.int32)), False,
                         chunk=32).cpu()
    assert torch.equal(alone, deterministic_topk_ref(victim[None], k, torch.tensor([vlen])))
    for B in (2, 3, 5):
        for slot in sorted({0, B // 2, B - 1}):
            fill = torch.round(torch.randn(B, W, generator=g) * 2) / 2
            L = torch.randint(0, W + 1, (B,), generator=g, dtype=torch.int32)
            fill[slot], L[slot] = victim, vlen
            got = _topk_triton(_dev(fill), k, _dev(L), False, chunk=32).cpu()
            assert torch.equal(got[slot], alone[0]), f"victim changed at B={B} slot={slot}"


# ---------------------------------------------------------------------------------------------------
# "split" variant (row histogram and compaction over fixed slices, then one finishing program per row):
# same bits as the reference, tiny slices so that every row spans many slices
# ---------------------------------------------------------------------------------------------------
SPLIT_SMALL = [dict(SW=32, CH=32), dict(SW=32, CH=32, LV=1, D0=8, D=8), dict(SW=64, CH=64, LV=1, D0=12, D=10),
               dict(SW=32, CH=32, LV=1, D0=11, D=7), dict(SW=32, CH=32, LV=3, D0=6, D=7),
               dict(SW=64, CH=32, LV=4, D0=8, D=8)]


@needs_triton
@pytest.mark.parametrize("k,cfg,hist_mask", SPLIT_CASES)
def test_split_matches_reference(seeded, k, cfg, hist_mask):
    g = seeded(f"split-{k}-{cfg}")
    W = 200
    rows = [[0, 2, 4, 5, 9], [1, 3, 6, 8, 9], [0, 3, 4, 7, 9]][k % 3]  # rotate the adversarial rows
    s = torch.cat([adversarial_rows(W, g), torch.randn(1, W, generator=g) * 1e-3])[rows]
    L = torch.randint(0, W + 1, (s.shape[0],), generator=g, dtype=torch.int32)
    L[0], L[-1] = W, min(k, W)
    split = dict(SPLIT_SMALL[cfg])
    if DEV == "cuda":
        split["SW"], split["CH"] = max(split["SW"], 32), max(split["CH"], 32)
    _check_triton(s, k, None, hist_mask=hist_mask, variant="split", split=split, both=False)
    _check_triton(s, k, L, hist_mask=hist_mask, variant="split", split=split, both=(k == 40))


@needs_triton
def test_split_edge_cases(seeded, monkeypatch):
    g = seeded()
    sp = dict(SW=16, CH=16) if DEV == "cpu" else dict(SW=32, CH=32)
    s = torch.randn(3, 40, generator=g)
    _check_triton(s, 5, torch.tensor([0, 40, 1], dtype=torch.int32), variant="split", split=sp)
    _check_triton(torch.empty(0, 40), 5, None, variant="split", split=sp)
    _check_triton(torch.empty(2, 0), 3, None, variant="split", split=sp)
    big = torch.randn(40, 6, generator=g)
    _check_triton(big.t(), 9, None, variant="split", split=sp)  # strided rows
    t = torch.randn(3, 100, generator=g)
    t[0, 37:] = float("inf")
    t[1, 50:] = float("nan")
    t[2, 3:] = 3e38
    _check_triton(t, 8, torch.tensor([37, 50, 3], dtype=torch.int32), variant="split", split=sp)
    # all ties at radix boundaries (the kept list is the whole row), every k around the slice size
    b = torch.tensor([0x3F800000, 0x3F8000FF, 0x3F800100, 0x3F80FF00] * 12, dtype=torch.int32)
    b = b.view(torch.float32)[None].clone()
    for k in (1, 12, 13, 16, 17, 47, 48, 60):
        _check_triton(b, k, None, variant="split", split=sp)
    # rows processed in several scratch blocks give the same rows
    monkeypatch.setattr(topk_mod, "SPLIT_SCRATCH_BYTES", 8 * 64 * 2)  # 2 rows of width 64 per block
    q = torch.round(torch.randn(5, 64, generator=g) * 2) / 2
    _check_triton(q, 10, torch.tensor([64, 3, 0, 50, 64], dtype=torch.int32), variant="split", split=sp)


@needs_triton
def test_split_bad_config():
    s = torch.randn(2, 64)
    with pytest.raises(ValueError, match="power of two"):
        _topk_triton(_dev(s), 4, None, False, variant="split", split=dict(SW=24))
    with pytest.raises(ValueError, match="multiple of D"):
        _topk_triton(_dev(s), 4, None, False, variant="split", split=dict(D0=10, D=8))
    with pytest.raises(ValueError, match="unknown split config"):
        _topk_triton(_dev(s), 4, None, False, variant="split", split=dict(BOGUS=1))
    with pytest.raises(ValueError, match="unknown Top-K variant"):
        _topk_triton(_dev(s), 4, None, False, variant="fast")


@needs_triton
def test_variant_selection(seeded, monkeypatch):
    """VARIANT picks the design from the width only; a bad VARIANT fails closed with a clear message."""
    g = seeded()
    s = torch.round(torch.randn(3, 96, generator=g) * 3) / 3
    L = torch.tensor([96, 40, 7], dtype=torch.int32)
    ref = deterministic_topk_ref(s, 9, L)
    calls = []
    real = topk_mod._topk_split

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(topk_mod, "_topk_split", spy)
    monkeypatch.setattr(topk_mod, "VARIANT", "split")
    monkeypatch.setattr(topk_mod, "SPLIT_MIN_W", 64)
    assert torch.equal(deterministic_topk(_dev(s), 9, _dev(L), backend="triton").cpu(), ref)
    assert len(calls) == 1
    assert torch.equal(deterministic_topk(_dev(s[:, :60]), 9, None, backend="triton").cpu(),
                       deterministic_topk_ref(s[:, :60], 9))  # narrower than SPLIT_MIN_W: "single"
    assert len(calls) == 1
    monkeypatch.setattr(topk_mod, "VARIANT", "turbo")
    with pytest.raises(ValueError, match="ZD_TOPK_VARIANT"):
        deterministic_topk(_dev(s), 9, _dev(L), backend="triton")


@needs_triton
def test_split_victim_in_batch(seeded):
    """Split variant: the victim's positions are the same alone and at several slots of several batches."""
    g = seeded()
    W, k = 96, 24
    sp = dict(SW=16, CH=16) if DEV == "cpu" else dict(SW=32, CH=32)
    victim = adversarial_rows(W, g)[4]
    vlen = 90
    vl = torch.tensor([vlen], dtype=torch.int32)
    alone = _topk_triton(_dev(victim[None]), k, _dev(vl), False, variant="split", split=sp).cpu()
    assert torch.equal(alone, deterministic_topk_ref(victim[None], k, vl))
    for B in (2, 5):
        for slot in sorted({0, B // 2, B - 1}):
            fill = torch.round(torch.randn(B, W, generator=g) * 2) / 2
            L = torch.randint(0, W + 1, (B,), generator=g, dtype=torch.int32)
            fill[slot], L[slot] = victim, vlen
            got = _topk_triton(_dev(fill), k, _dev(L), False, variant="split", split=sp).cpu()
            assert torch.equal(got[slot], alone[0]), f"victim changed at B={B} slot={slot}"


_AOT_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zerodiff.ops.topk import _topk_kernel
sig = {"s_ptr": "*fp32", "len_ptr": "*i32", "out_ptr": "*i32", "osc_ptr": "*fp32", "W": "i32", "k": "i32",
       "stride_r": "i64", "HAS_LEN": "constexpr", "RET_SCORES": "constexpr", "CHUNK": "constexpr",
       "DIGIT": "constexpr", "NPASS": "constexpr", "NB": "constexpr", "HIST_MASK": "constexpr"}
for arch, has_len, ret, chunk, digit, warps in ((90, True, True, 4096, 11, 8), (100, False, True, 256, 8, 2)):
    cx = {"HAS_LEN": has_len, "RET_SCORES": ret, "CHUNK": chunk, "DIGIT": digit,
          "NPASS": (32 + digit - 1) // digit, "NB": 1 << digit, "HIST_MASK": True}
    try:
        k = triton.compile(ASTSource(fn=_topk_kernel, signature=sig, constexprs=cx),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "enable_fp_fusion": False})
    except Exception as e:
        if "ptxas" in str(e).lower() or isinstance(e, FileNotFoundError):
            print("SKIP", type(e).__name__, e)
            sys.exit(0)
        raise
    assert "cubin" in k.asm, sorted(k.asm)
# the split variant's three kernels at the default config of 64K-wide rows
import zerodiff.ops.topk as T
cfg = T._split_config(65536)
parts = (
    (T._split_hist_kernel, {"s_ptr": "*fp32", "len_ptr": "*i32", "tot_ptr": "*i32", "W": "i32", "k": "i32",
                            "stride_r": "i64"},
     dict(HAS_LEN=True, SW=cfg["SW"], D0=cfg["D0"], LEVEL=1, LV=cfg["LV"], HIST_MASK=True), cfg["W1"]),
    (T._split_compact_kernel, {"s_ptr": "*fp32", "len_ptr": "*i32", "tot_ptr": "*i32", "bx_ptr": "*fp32",
                               "bp_ptr": "*i32", "cnt_ptr": "*i32", "W": "i32", "k": "i32", "NS": "i32",
                               "stride_r": "i64"},
     dict(HAS_LEN=True, SW=cfg["SW"], D0=cfg["D0"], LV=cfg["LV"]), cfg["W2"]),
    (T._split_finish_kernel, {"bx_ptr": "*fp32", "bp_ptr": "*i32", "cnt_ptr": "*i32", "tot_ptr": "*i32",
                              "out_ptr": "*i32", "osc_ptr": "*fp32", "k": "i32", "NS": "i32"},
     dict(RET_SCORES=True, SW=cfg["SW"], SP=16, D0=cfg["D0"], LV=cfg["LV"], D=cfg["D"],
          NP=(32 - cfg["D0"] * cfg["LV"]) // cfg["D"], CH=cfg["CH"], HIST_MASK=True), cfg["W3"]),
)
for arch in (90, 100):
    for fn, sg, cx, warps in parts:
        sg = dict(sg, **{key: "constexpr" for key in cx})
        k = triton.compile(ASTSource(fn=fn, signature=sg, constexprs=cx), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps, "enable_fp_fusion": False})
        assert "cubin" in k.asm, sorted(k.asm)
print("OK")
"""


@needs_triton
@pytest.mark.skipif(DEV == "cuda", reason="with a GPU the native tests compile and run the kernel")
def test_kernel_compiles_for_sm90_and_sm100():
    """The interpreter does not compile anything: check the real Hopper/Blackwell build here (no GPU needed),
    for the single kernel and the split variant's three kernels."""
    import os
    import subprocess
    import sys

    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    try:
        import triton.compiler  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:  # pragma: no cover
        pytest.skip(f"this Triton has no AOT compile API: {e}")
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout.strip())
    assert "OK" in r.stdout


# ---------------------------------------------------------------------------------------------------
# GPU: exact equality at DSA widths, victim-in-batch on every dispatch boundary, negative control
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("W", GPU_DSA_WIDTHS)
def test_gpu_dsa_widths_exact(seeded, W):
    g = seeded(str(W))
    s = _gpu_rows(12, W, g)
    adv = adversarial_rows(W, g)
    s = torch.cat([s, adv])
    L = torch.randint(0, W + 1, (s.shape[0],), generator=g, dtype=torch.int32)
    L[:3] = torch.tensor([W, 2048, 2047], dtype=torch.int32)
    sc = s.cuda()
    for k in (2048, 1, 513):
        for lengths in (None, L):
            pos, val = deterministic_topk(sc, k, None if lengths is None else lengths.cuda(), return_scores=True)
            rpos, rval = deterministic_topk_ref(s, k, lengths, return_scores=True)
            assert torch.equal(pos.cpu(), rpos), f"W={W} k={k} lengths={'yes' if lengths is not None else 'no'}"
            assert bits_equal(val.cpu(), rval)


@pytest.mark.gpu
def test_gpu_routing_exact(seeded):
    g = seeded()
    for T in (1, 7, 64, 1000, 8192):
        lg = torch.randn(T, 256, generator=g)
        lg[::3] = torch.round(lg[::3] * 2) / 2
        lg[1::5] = torch.sigmoid(lg[1::5] * 30)
        sc, ids = topk_routing(lg.cuda(), 8)
        rids, rsc = deterministic_topk_ref(lg, 8, return_scores=True)
        assert torch.equal(ids.cpu(), rids) and bits_equal(sc.cpu(), rsc), f"T={T}"


def _gpu_victim_sweep(g, victim, vlen, k, alone, sizes, rounds=3):
    """The victim row (length ``vlen``) at the first, a third and the last slot of fresh GPU batches of every size
    (other rows with random lengths), several rounds: its top-k is always ``alone[0]``."""
    W = victim.shape[0]
    for rnd in range(rounds):
        for B in sizes:
            fill = _gpu_rows(B, W, g).cuda()
            L = torch.randint(0, W + 1, (B,), generator=g, dtype=torch.int32).cuda()
            for slot in sorted({0, B // 3, B - 1}):
                f = fill.clone()
                f[slot] = victim.cuda()
                Ls = L.clone()
                Ls[slot] = vlen
                got = deterministic_topk(f, k, Ls)
                assert torch.equal(got[slot].cpu(), alone[0].cpu()), f"round {rnd} B={B} slot={slot}"


def _gpu_graph_check(g, replays, W=16384, k=2048, B=8):
    """deterministic_topk captured in a CUDA graph: every replay equals eager, and a replay on new inputs written
    into the same storage equals the reference on them."""
    s = _gpu_rows(B, W, g).cuda()
    L = torch.randint(1, W + 1, (B,), generator=g, dtype=torch.int32).cuda()
    eager = deterministic_topk(s, k, L)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = deterministic_topk(s, k, L)
    for rnd in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {rnd}"
    s.copy_(_gpu_rows(B, W, g).cuda())  # new inputs in the same storage
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), deterministic_topk_ref(s.cpu(), k, L.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("W,k", GPU_VICTIM_CASES)
def test_gpu_victim_in_batch(seeded, W, k):
    g = seeded(f"{W}-{k}")
    victim = torch.round(torch.randn(W, generator=g) * 4) / 4  # ties straddle the k boundary
    vlen = W - 3
    vl = torch.tensor([vlen], dtype=torch.int32)
    alone = deterministic_topk(victim[None].cuda(), k, vl.cuda())
    ref = deterministic_topk_ref(victim[None], k, vl)
    assert torch.equal(alone.cpu(), ref)
    sizes = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 1000)
    if W > 8192:
        sizes = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 300)
    _gpu_victim_sweep(g, victim, vlen, k, alone, sizes)


@pytest.mark.gpu
def test_gpu_negative_control_torch_topk(seeded):
    """On the same tie-heavy rows torch.topk's index set (even re-sorted) differs from the contract."""
    g = seeded()
    W, k = 65536, 2048
    s = (torch.round(torch.randn(4, W, generator=g) * 4) / 4).cuda()
    ours = deterministic_topk(s, k)
    stock = torch.topk(s, k, dim=1).indices
    assert not torch.equal(stock.to(torch.int32), ours)
    stock_sorted = torch.sort(stock, dim=1, descending=True).values.to(torch.int32)
    assert not torch.equal(stock_sorted, ours), "torch.topk picked the same tie set: redesign the control"


@pytest.mark.gpu
def test_gpu_lengths_checks_and_clamp(seeded):
    g = seeded()
    s = torch.randn(2, 4096, generator=g).cuda()
    bad = torch.tensor([5000, -3], dtype=torch.int32).cuda()
    with pytest.raises(ValueError, match="negative length"):
        deterministic_topk(s, 16, bad, check_lengths=True)
    with pytest.raises(ValueError, match="exceeds"):
        deterministic_topk(s, 16, bad.abs(), check_lengths=True)
    # without the (syncing) check, lengths are clamped to [0, W]: never an out-of-bounds read
    got = deterministic_topk(s, 16, bad)
    ref = deterministic_topk_ref(s.cpu(), 16, torch.tensor([4096, 0], dtype=torch.int32))
    assert torch.equal(got.cpu(), ref)


@pytest.mark.gpu
def test_gpu_cuda_graph_equals_eager(seeded):
    _gpu_graph_check(seeded(), replays=1)


# ---------------------------------------------------------------------------------------------------
# GPU: the split design bitwise equal to the reference at the DSA shapes, victim-in-batch and CUDA graphs
# (the single design is covered by the tests above; the split sweep candidates by test_experimental_topk.py)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("W", GPU_SPLIT_WIDTHS)
def test_gpu_split_default_exact_many_rows(seeded, monkeypatch, W):
    """The public entry point under VARIANT='split' on many rows (row blocks of the scratch included)."""
    g = seeded(f"split-many-{W}")
    monkeypatch.setattr(topk_mod, "VARIANT", "split")
    monkeypatch.setattr(topk_mod, "SPLIT_SCRATCH_BYTES", 8 * W * 50)  # ~50 rows per scratch block
    R = 130 if W <= 65536 else 40
    s = _gpu_rows(R, W, g)
    L = torch.randint(0, W + 1, (R,), generator=g, dtype=torch.int32)
    L[::7] = W
    pos = deterministic_topk(s.cuda(), 2048, L.cuda())
    assert torch.equal(pos.cpu(), deterministic_topk_ref(s, 2048, L))
    pos = deterministic_topk(s.cuda(), 2048)
    assert torch.equal(pos.cpu(), deterministic_topk_ref(s, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("W,k", GPU_SPLIT_VICTIM_CASES)
def test_gpu_split_victim_in_batch(seeded, monkeypatch, W, k):
    g = seeded(f"split-victim-{W}-{k}")
    monkeypatch.setattr(topk_mod, "VARIANT", "split")
    victim = torch.round(torch.randn(W, generator=g) * 4) / 4  # ties straddle the k boundary
    vlen = W - 3
    vl = torch.tensor([vlen], dtype=torch.int32)
    alone = deterministic_topk(victim[None].cuda(), k, vl.cuda())
    assert torch.equal(alone.cpu(), deterministic_topk_ref(victim[None], k, vl))
    single = _topk_triton(victim[None].cuda(), k, vl.cuda(), False, variant="single")
    assert torch.equal(alone, single)
    _gpu_victim_sweep(g, victim, vlen, k, alone, (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 300))


@pytest.mark.gpu
def test_gpu_split_negative_control(seeded):
    """On the same tie-heavy rows the split variant keeps the contract and torch.topk does not."""
    g = seeded()
    W, k = 65536, 2048
    s = (torch.round(torch.randn(4, W, generator=g) * 4) / 4).cuda()
    ours = _topk_triton(s, k, None, False, variant="split")
    assert torch.equal(ours.cpu(), deterministic_topk_ref(s.cpu(), k))
    stock = torch.sort(torch.topk(s, k, dim=1).indices, dim=1, descending=True).values.to(torch.int32)
    assert not torch.equal(stock, ours), "torch.topk picked the same tie set: redesign the control"


@pytest.mark.gpu
def test_gpu_split_cuda_graph_equals_eager(seeded, monkeypatch):
    g = seeded()
    monkeypatch.setattr(topk_mod, "VARIANT", "split")
    _gpu_graph_check(g, replays=3)
