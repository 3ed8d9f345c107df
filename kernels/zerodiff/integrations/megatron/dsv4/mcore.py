"""Import megatron-core for the DeepSeek-V4 actor.

``import_megatron()`` returns the ``megatron.core`` package. When it is not importable as installed, the
pinned source tree is put on ``sys.path`` first: ``$MEGATRON_SRC`` when set, else ``build/sources/megatron``
of the repository (``make sources``; ``make apply`` lays the zerodiff series over it). Raises
:class:`ImportError` naming both places when neither holds megatron-core.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path

_REPO = Path(__file__).resolve().parents[5]


def source_tree() -> Path:
    """Where a megatron-core source tree is looked for when the package is not installed."""
    env = os.environ.get("MEGATRON_SRC")
    return Path(env) if env else _REPO / "build" / "sources" / "megatron"


def import_megatron():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module("megatron.core")
    except ImportError:
        pass
    tree = source_tree()
    if not (tree / "megatron" / "core" / "package_info.py").exists():
        raise ImportError(f"zerodiff DeepSeek-V4 actor: megatron-core is not installed and {tree} holds no source "
                          "tree (run `make sources apply`, set MEGATRON_SRC, or pip install megatron-core==0.19.2)")
    if str(tree) not in sys.path:
        sys.path.insert(0, str(tree))
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]  # a failed partial import must not shadow the tree
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module("megatron.core")


def megatron_version() -> str:
    mc = import_megatron()
    from megatron.core import package_info

    return getattr(package_info, "__version__", getattr(mc, "__version__", "unknown"))
