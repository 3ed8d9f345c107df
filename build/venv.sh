#!/usr/bin/env bash
# `make venv`: the project's virtual environment, idempotent (a stamp file makes the second run instant).
#
#   VENV=.venv  PYTHON=python3  TORCH_INDEX_URL=<extra pip index for torch, e.g. https://download.pytorch.org/whl/cpu>
#
# * If a CUDA-enabled torch is already importable by $PYTHON (a GPU machine), the venv is created with
#   --system-site-packages and that torch (and its Triton) are used as they are.
# * Otherwise torch==$TORCH_CPU_VERSION and triton==$TRITON_CPU_VERSION from build/pins are installed
#   (on a stock PyPI setup pass TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get the small CPU wheel).
# * Always: numpy, pytest, the sdist build helpers `make sources` needs (setuptools-rust, setuptools-scm, wheel),
#   and zerodiff itself in editable mode.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
# shellcheck disable=SC1091
. "$ROOT/build/pins"
STAMP="$VENV/.zerodiff-venv-stamp"
want="$(cat "$ROOT/build/pins" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $ROOT"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
    echo "venv: $VENV is up to date"
    exit 0
fi

sys_cuda_torch=0
if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)' 2>/dev/null; then
    sys_cuda_torch=1
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    if [[ $sys_cuda_torch == 1 ]]; then
        echo "venv: creating $VENV with --system-site-packages (a CUDA torch is importable by $PYTHON)"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        echo "venv: creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
pip_install() { echo "venv: pip install $*"; "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if "$PY" - "$TORCH_CPU_VERSION" "$TRITON_CPU_VERSION" <<'PYEOF' 2>/dev/null
import sys, torch, triton
cuda = bool(torch.version.cuda) and torch.cuda.is_available()
ok_torch = cuda or torch.__version__.split("+")[0] == sys.argv[1]
ok_triton = cuda or triton.__version__ == sys.argv[2]
sys.exit(0 if ok_torch and ok_triton else 1)
PYEOF
then
    echo "venv: torch $("$PY" -c 'import torch; print(torch.__version__)') / triton $("$PY" -c 'import triton; print(triton.__version__)') already present"
else
    extra=()
    [[ -n "${TORCH_INDEX_URL:-}" ]] && extra=(--extra-index-url "$TORCH_INDEX_URL")
    pip_install "${extra[@]}" "torch==$TORCH_CPU_VERSION" "triton==$TRITON_CPU_VERSION"
fi
if ! "$PY" -c 'import numpy, pytest' 2>/dev/null; then
    pip_install numpy pytest
fi
# only `make sources` needs these (vLLM's setup.py imports them); an offline GPU box may lack them: warn, go on
if ! "$PY" -c 'import setuptools_rust, setuptools_scm, wheel' 2>/dev/null; then
    pip_install setuptools-rust setuptools-scm wheel || \
        echo "venv: WARNING: could not install setuptools-rust/setuptools-scm/wheel: \`make sources\` cannot fetch vLLM here" >&2
fi
if ! "$PY" - "$ROOT" <<'PYEOF' 2>/dev/null
import pathlib, sys, zerodiff
sys.exit(0 if pathlib.Path(zerodiff.__file__).resolve().parents[2] == pathlib.Path(sys.argv[1]).resolve() else 1)
PYEOF
then
    if ! pip_install --no-build-isolation --no-deps -e "$ROOT"; then
        # offline machine without a usable setuptools: a .pth file makes the package importable all the same
        site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        echo "$ROOT/kernels" > "$site/zerodiff-checkout.pth"
        echo "venv: WARNING: editable install failed; added $site/zerodiff-checkout.pth (use \`python -m zerodiff.cli\`)" >&2
    fi
fi
"$PY" -c 'import torch, triton, numpy, pytest, zerodiff; print(f"venv: ready: torch {torch.__version__}, triton {triton.__version__}, zerodiff {zerodiff.__version__}")'
echo "$want" > "$STAMP"
