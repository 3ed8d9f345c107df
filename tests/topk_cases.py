"""Score rows shared by the Top-K tests (tests/test_topk.py, tests/test_experimental_topk.py)."""

from __future__ import annotations

import torch

NAN_BITS = [0x7FC00000, -0x400000, 0x7F800001, -0x7FFFFF]  # +qNaN, -qNaN, +sNaN payload, -NaN payload


# ---------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------
def from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def adversarial_rows(W, g, nan=True):
    """Rows full of ties and special values; every row also has ordinary random values somewhere."""
    rows = []
    r = torch.randn(W, generator=g)
    rows.append(torch.full((W,), 1.0))  # all equal: pure position order
    rows.append(torch.tensor([-1.0, 0.0, 0.5, 1.0])[torch.randint(0, 4, (W,), generator=g)])  # plateaus
    z = torch.where(torch.rand(W, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
    z[torch.randint(0, W, (max(1, W // 16),), generator=g)] = -1e-45  # -0/+0 mix around tiny negatives
    rows.append(z)
    den = torch.randint(1, 2**23, (W,), generator=g, dtype=torch.int64)
    den = den | (torch.randint(0, 2, (W,), generator=g, dtype=torch.int64) << 31)
    den = den.to(torch.int32).view(torch.float32).clone()  # fp32 denormals of both signs
    den[::7] = 0.0
    den[3::11] = -0.0
    rows.append(den)
    q = torch.round(r * 4) / 4  # quantised random: many ties, many distinct values
    q[torch.randint(0, W, (max(1, W // 8),), generator=g)] = float("-inf")
    q[torch.randint(0, W, (max(1, W // 32),), generator=g)] = float("inf")
    rows.append(q)
    if nan:
        n = r.clone()
        idx = torch.randint(0, W, (max(1, W // 4),), generator=g)
        n[idx] = from_bits([NAN_BITS[i % 4] for i in range(idx.numel())])
        rows.append(n)
        allnan = from_bits([NAN_BITS[i % 4] for i in range(W)])
        rows.append(allnan)
        ninf = torch.full((W,), float("-inf"))
        ninf[::5] = from_bits([0x7FC00000])
        rows.append(ninf)
    rows.append(r)
    return torch.stack(rows)


def gpu_rows(R, W, g):
    """Random rows plus tie-heavy rows (what an indexer produces after FP8 / BF16 rounding)."""
    s = torch.randn(R, W, generator=g)
    s[1::4] = torch.round(s[1::4] * 8) / 8
    s[2::4] = s[2::4].to(torch.bfloat16).float()
    if R > 3:
        s[3] = 1.0
    return s
