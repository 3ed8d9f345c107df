"""Helpers shared by the integration test files (tests/test_vllm_*.py, tests/test_megatron_*.py)."""

from __future__ import annotations

import torch


def cuda_generator(seed: int) -> torch.Generator:
    """A CUDA generator seeded with ``seed`` (GPU tests draw their inputs on the device)."""
    return torch.Generator(device="cuda").manual_seed(seed)
