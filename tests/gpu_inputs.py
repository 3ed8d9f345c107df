"""Inputs shared by the op test files: the batch sizes of the victim-in-batch sweeps (every dispatch boundary) and
bf16 fillers drawn on the device from a generator seeded by the test's CPU generator."""

from __future__ import annotations

import torch

#: batch sizes the CPU interpreter sweeps (dispatch boundaries up to 65 rows)
CPU_MS = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65)
#: batch sizes the GPU sweeps (the CPU ones plus 128, 1000 and 4096 rows)
GPU_MS = (*CPU_MS, 128, 1000, 4096)


def cuda_gen(g: torch.Generator) -> torch.Generator:
    """A CUDA generator seeded from the test's CPU generator (fillers are drawn on the device: fast)."""
    gc = torch.Generator(device="cuda")
    gc.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
    return gc


def rand_cuda(gc: torch.Generator, shape, scale=1.0) -> torch.Tensor:
    """bf16 normal values times ``scale``, drawn on the device."""
    return (torch.randn(*shape, generator=gc, device="cuda") * scale).to(torch.bfloat16)
