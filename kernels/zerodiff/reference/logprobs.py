"""Reference for token log-probabilities: ``log_softmax(logits / temperature)[t, id_t]``.

Contract (``logits`` BF16 or FP32 ``[T, V]``, ``token_ids`` int64 ``[T]``, ``temperature`` a positive
float or an FP32 tensor ``[T]`` of per-row temperatures):

1. ``z = float(logits)`` (exact widening); when a temperature is applied, ``zs = z / temperature`` as one
   FP32 division (RNE). With ``temperature == 1.0`` (a Python float) the division is skipped (it is exact
   anyway).
2. One row at a time, the vocabulary is read in chunks of ``CHUNK = 8192`` columns (a constant: it never
   depends on T, V or the row's position). A running row max ``m`` (exact) and ``CHUNK`` per-lane sums
   ``s[j]`` are updated chunk by chunk in order: ``m' = max(m, max(chunk))``;
   ``s[j] = s[j] * exp(m - m') + exp(zs[c*CHUNK + j] - m')`` (FP32, two roundings, no FMA; ``m'`` is
   replaced by 0 in the subtractions while it is still -inf). Columns past V count as ``-inf``.
3. ``S`` = sum of the lanes by the pairwise tree ``a'[i] = a[2i] + a[2i+1]``.
4. ``logp = (zs[id] - m) - log(S)`` (FP32).

``exp``/``log`` are the device's (the GPU's are approximate), so GPU results are compared to the float64
math (:func:`token_logprobs_ref`) with a tolerance, while the invariance claims are bitwise.
:func:`token_logprobs_mirror` replays steps 1-4 with numpy's float32 ``exp``/``log`` (what Triton's CPU
interpreter runs), so the interpreted kernel must match it bit for bit.

Logits must be finite or -inf, with at least one finite value per row; +inf/NaN give NaN.
Out-of-range ids are an error (the op validates them on the host; the kernel writes NaN for them).
"""

from __future__ import annotations

import numpy as np
import torch

CHUNK = 8192

__all__ = ["CHUNK", "token_logprobs_ref", "token_logprobs_mirror"]


def _temps(temperature, T: int) -> torch.Tensor | None:
    if isinstance(temperature, torch.Tensor):
        return temperature.detach().to(torch.float32).cpu().reshape(T)
    if float(temperature) == 1.0:
        return None
    return torch.full((T,), float(temperature), dtype=torch.float32)


def _scaled_fp32(logits: torch.Tensor, temperature) -> torch.Tensor:
    z = logits.detach().cpu().to(torch.float32)
    t = _temps(temperature, z.shape[0])
    return z if t is None else z / t[:, None]


def token_logprobs_ref(logits: torch.Tensor, token_ids: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """float64 math on the FP32-scaled logits of step 1; returns FP32 ``[T]`` on the logits' device."""
    zs = _scaled_fp32(logits, temperature).to(torch.float64)
    ids = token_ids.detach().cpu().long()
    lse = torch.logsumexp(zs, dim=-1)
    out = zs.gather(1, ids[:, None])[:, 0] - lse
    return out.to(torch.float32).to(logits.device)


def _tree(a: np.ndarray) -> np.float32:
    while a.shape[0] > 1:
        a = (a[0::2] + a[1::2]).astype(np.float32)
    return a[0]


def token_logprobs_mirror(logits: torch.Tensor, token_ids: torch.Tensor, temperature=1.0, chunk: int = CHUNK,
                          exp=np.exp, log=np.log) -> torch.Tensor:
    """Steps 1-4 replayed in numpy float32, row by row (see the module docstring)."""
    zs = _scaled_fp32(logits, temperature).numpy()
    T, V = zs.shape
    ids = token_ids.detach().cpu().long().numpy()
    out = np.empty(T, dtype=np.float32)
    ninf = np.float32(-np.inf)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for t in range(T):
            m = np.array(ninf, dtype=np.float32)
            s = np.zeros(chunk, dtype=np.float32)
            for c0 in range(0, V, chunk):
                zc = np.full(chunk, ninf, dtype=np.float32)
                w = min(chunk, V - c0)
                zc[:w] = zs[t, c0:c0 + w]
                m_new = np.maximum(m, zc.max())
                m_sub = np.where(m_new == ninf, np.float32(0), m_new).astype(np.float32)
                alpha = exp(np.array(m - m_sub, dtype=np.float32))
                s = (s * alpha).astype(np.float32) + exp((zc - m_sub).astype(np.float32))
                s = s.astype(np.float32)
                m = m_new
            S = _tree(s)
            out[t] = np.float32(np.float32(zs[t, ids[t]] - m) - np.float32(log(np.array(S, dtype=np.float32))))
    return torch.from_numpy(out).to(logits.device)
