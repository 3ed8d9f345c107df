"""Test setup shared by every test file.

* Without CUDA, Triton kernels run through Triton's CPU interpreter (``TRITON_INTERPRET=1``), which must be
  set before triton is imported; CPU tests keep interpreter shapes small (about 1 s per 2048-wide row).
* ``@pytest.mark.gpu`` tests run only where CUDA is present and are skipped otherwise.
"""

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def seeded():
    """A fresh, test-specific seed: tests draw new random inputs but stay reproducible per test id."""
    import hashlib

    def make(name: str = "") -> torch.Generator:
        h = int(hashlib.sha256((os.environ.get("PYTEST_CURRENT_TEST", "") + name).encode()).hexdigest(), 16)
        g = torch.Generator()
        g.manual_seed(h % (2**63))
        return g

    return make
