"""Test setup shared by every test file.

* Without CUDA, Triton kernels run through Triton's CPU interpreter (``TRITON_INTERPRET=1``), which must be
  set before triton is imported; CPU tests keep interpreter shapes small (about 1 s per 2048-wide row).
* In the interpreter ``tl.dot`` is the host BLAS (``np.matmul``). OpenBLAS's sgemm micro-kernels on some
  CPU cores (its Haswell and Zen kernels; not SkylakeX) give a row bits that depend on where the row sits
  in the micro-tile, so a victim-in-batch test of a Triton GEMM would test the host BLAS, not the kernel.
  The interpreter's dot is therefore replaced by a row-at-a-time product (one identical BLAS call per
  output row): a row's bits depend on that row and the other operand only, on every CPU. The GPU runs the
  real ``tl.dot``; interpreter bits are never GPU bits (tests compare them to references with tolerances).
* ``@pytest.mark.gpu`` tests run only where CUDA is present and are skipped otherwise.
* ``one_thread``: one intra-op thread for the test, restored after it (the end-to-end files use it for every
  test: ``pytestmark = pytest.mark.usefixtures("one_thread")``).
"""

import os
import sys
import warnings
from pathlib import Path

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _row_at_a_time_interpreter_dot():
    """Replace the Triton interpreter's ``create_dot`` with a row-independent product (see above)."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except Exception:  # pragma: no cover - no Triton: nothing to patch
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    stock = getattr(builder, "create_dot", None)
    if stock is None or getattr(stock, "_zerodiff_rows", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = stock(self, a, b, d, input_precision, max_num_imprecise_acc)  # dtype handling stays Triton's
        a_data, b_data = a.data, b.data
        if a_data.dtype.itemsize == 1 or b_data.dtype.itemsize == 1:
            return out  # fp8 operands: Triton widens them to fp16 itself; keep its product
        acc = d.data
        rows = np.empty(acc.shape, dtype=acc.dtype)
        for idx in np.ndindex(*a_data.shape[:-1]):
            bm = b_data[idx[:-1]] if b_data.ndim > 2 else b_data
            rows[idx] = np.matmul(a_data[idx], bm, dtype=acc.dtype)
        out.data = rows + acc
        return out

    create_dot._zerodiff_rows = True
    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_at_a_time_interpreter_dot()


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


@pytest.fixture
def one_thread():
    """One intra-op torch thread during the test; the previous count is restored after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


#: the pinned megatron-core source tree (`make sources apply`)
MEGATRON_TREE = Path(__file__).resolve().parents[1] / "build" / "sources" / "megatron"


@pytest.fixture
def megatron():
    """megatron-core 0.19.2 from the pinned source tree (skip when it was not fetched)."""
    if not (MEGATRON_TREE / "megatron" / "core" / "package_info.py").exists():
        pytest.skip("build/sources/megatron absent (run `make sources apply`)")
    if str(MEGATRON_TREE) not in sys.path:
        sys.path.insert(0, str(MEGATRON_TREE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401
    return sys.modules["megatron"]
