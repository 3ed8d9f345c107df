"""The bitwise test kit itself: it must see -0.0 vs +0.0, one-ulp differences and name the coordinate."""

import pytest
import torch

from bitwise import (assert_batch_dependent, assert_bitwise_equal, assert_victim_in_batch, assert_victims_in_batch,
                     bits, placed_rows, spread_positions, victim_batches, victim_runs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn])
def test_signed_zero_and_one_ulp_are_differences(dtype):
    a = torch.tensor([1.0, 0.0, 2.0, 3.0]).to(dtype)
    b = a.clone()
    b[1] = -0.0
    assert torch.equal(a.float(), b.float())  # value comparison hides it
    with pytest.raises(AssertionError, match=r"1 of 4 values differ; first at \(1,\)"):
        assert_bitwise_equal(a, b, "zeros")
    c = a.clone()
    c[3] = torch.nextafter(a[3].double(), torch.tensor(9.0, dtype=torch.float64)).to(dtype) \
        if dtype == torch.float64 else (bits(a)[3:] + 1).view(dtype)[0]
    with pytest.raises(AssertionError, match=r"first at \(3,\)"):
        assert_bitwise_equal(a, c)
    assert_bitwise_equal(a, a.clone())


def test_shape_and_dtype_are_checked():
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match="shape"):
        assert_bitwise_equal(torch.zeros(2), torch.zeros(1, 2))


def test_victim_helpers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 8, generator=g)
    victim = torch.randn(1, 64, generator=g)

    def batches():
        for T, pos in ((3, 0), (17, 9), (65, 64)):
            x = torch.randn(T, 64, generator=g)
            x[pos] = victim[0]
            yield x, pos

    rowwise = lambda x: torch.stack([(r[:, None] * w).sum(0) for r in x])  # noqa: E731 - one row at a time
    assert_victim_in_batch(rowwise(victim), victim_runs(rowwise, victim, batches()))
    with pytest.raises(AssertionError, match="no batch"):
        assert_victim_in_batch(rowwise(victim), [])
    # a batch-coupled computation (adds a tiny batch statistic) is caught by both helpers
    coupled = lambda x: rowwise(x) + x.sum() * 1e-3  # noqa: E731
    runs = list(victim_runs(coupled, victim, batches()))
    with pytest.raises(AssertionError, match="victim at"):
        assert_victim_in_batch(coupled(victim), runs)
    assert assert_batch_dependent(coupled(victim), runs)
    with pytest.raises(AssertionError, match="proves nothing"):
        assert_batch_dependent(rowwise(victim), victim_runs(rowwise, victim, batches()))


def test_several_victims_in_one_batch():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 4, generator=g)
    rowwise = lambda x: torch.stack([(r[:, None] * w).sum(0) for r in x])  # noqa: E731
    v = torch.randn(3, 32, generator=g)
    alone = [rowwise(v[j:j + 1]) for j in range(3)]
    for M in (1, 2, 9):
        pos = sorted({0, M // 2, M - 1})
        b = torch.randn(M, 32, generator=g)
        for j, p in enumerate(pos):
            b[p] = v[j]
        assert_victims_in_batch(rowwise(b), alone, pos, f"M={M}")
        labels = [lab for _, lab, _ in placed_rows(rowwise(b), alone, pos)]
        assert labels == [f"{j} at {p} of {M}" for j, p in enumerate(pos)]
    # a wrong row (victim 1's output where victim 0 was placed) is named by victim and position
    b = torch.randn(9, 32, generator=g)
    b[0], b[4], b[8] = v[1], v[1], v[2]
    with pytest.raises(AssertionError, match=r"victim 0 at 0 of 9, round 3"):
        assert_victims_in_batch(rowwise(b), alone, [0, 4, 8], "round 3")
    with pytest.raises(AssertionError, match="no victim"):
        assert_victims_in_batch(rowwise(b), alone, [])
    with pytest.raises(AssertionError, match="4 positions for 3 victims"):
        assert_victims_in_batch(rowwise(b), alone, [0, 1, 2, 3])


def test_victim_batches_place_every_victim_in_fresh_or_pool_batches():
    v = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-3.0, -3.0]])
    assert [spread_positions(m) for m in (1, 2, 3, 9)] == [[0], [0, 1], [0, 1, 2], [0, 4, 8]]
    calls = []

    def fresh(m, rnd):
        calls.append((m, rnd))
        return torch.full((m, 2), float(rnd))

    seen = []
    for rnd, m, pos, b in victim_batches(v, (1, 5), fresh, rounds=2):
        seen.append((rnd, m, pos))
        assert b.shape == (m, 2) and all(torch.equal(b[p], v[j]) for j, p in enumerate(pos))
        others = [i for i in range(m) if i not in pos]
        assert all(torch.equal(b[i], torch.full((2,), float(rnd))) for i in others)
    assert seen == [(0, 1, [0]), (0, 5, [0, 2, 4]), (1, 1, [0]), (1, 5, [0, 2, 4])] and calls == [(1, 0), (5, 0),
                                                                                                 (1, 1), (5, 1)]
    pool = torch.arange(12.0).reshape(6, 2)
    (_, _, _, b0), (_, _, _, b1) = victim_batches(v, (4,), pool, rounds=2)
    assert torch.equal(b0[1], pool[1]) and torch.equal(b1[1], pool[2])  # round 1: the pool rows reversed
    assert torch.equal(b0[0], v[0]) and torch.equal(b1[3], v[2]) and torch.equal(pool[0], torch.tensor([0.0, 1.0]))
