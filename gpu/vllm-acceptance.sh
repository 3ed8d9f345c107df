#!/usr/bin/env bash
# Engine-level acceptance inside real, patched vLLM on a GPU machine with no network: `zerodiff vllm-check`.
#
# usage: gpu/vllm-acceptance.sh [--stage-only] [--] [zerodiff vllm-check arguments...]
#
# The runtime (`make vllm-runtime DSV4=1`: .carry/vllm-runtime/, parts of at most 60 MiB) may arrive over
# several calls: every call stages the parts it carries in $ZD_STAGE (default /root/zd-parts, a folder that
# outlives the call while the machine stays up) and, once all are there, unpacks them into $ZD_RUNTIME (default
# /root/zd-rt). If .carry/vllm-overlay/ is present (`python3 build/vllm_overlay_files.py`), its patched vLLM
# files are copied over the runtime, so the engine runs the series of this working tree even when the parts
# were built from an earlier one. zerodiff itself is imported from this working tree (kernels/).
# Extra wheels the runtime lacks (e.g. a package tried before it goes into build/vllm-runtime.lock) may come in
# .carry/extra-wheels/ (SHA256SUMS + wheels, a large wheel cut into NAME.partNN): staged in $ZD_EXTRA_STAGE
# (default /root/zd-extra-parts) the same way, checked against SHA256SUMS, installed with pip --no-deps into
# $ZD_EXTRA (default /root/zd-extra) once all are there, and put on PYTHONPATH.
# Then, unless --stage-only or the runtime is incomplete, it runs `zerodiff vllm-check` with the arguments
# given, writing vllm-acceptance.json, vllm-check.log and unpack.log into $OUT (default
# results/vllm-<date>/). DeepGEMM's, Triton's and TileLang's caches live in /root/zd-cache so a later call on the same
# machine starts warm. Exit: vllm-check's status (0 only when the acceptance passed); 0 after staging only.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
stage_only=0
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
if [[ "${1:-}" == "--stage-only" ]]; then stage_only=1; shift; fi
[[ "${1:-}" == "--" ]] && shift
OUT="${OUT:-$ROOT/results/vllm-$(date -u +%Y-%m-%d)}"
STAGE="${ZD_STAGE:-/root/zd-parts}"
DEST="${ZD_RUNTIME:-/root/zd-rt}"
mkdir -p "$OUT"
say() { echo "[vllm-acceptance] $*"; }

build/vllm-runtime-unpack.sh --stage "$STAGE" --no-import-check .carry/vllm-runtime "$DEST" 2>&1 | tee -a "$OUT/unpack.log"
[[ ${PIPESTATUS[0]} == 0 ]] || { say "unpack failed (see $OUT/unpack.log)"; exit 1; }
EXTRA_STAGE="${ZD_EXTRA_STAGE:-/root/zd-extra-parts}" EXTRA="${ZD_EXTRA:-/root/zd-extra}"
extra_ok=1
if [[ -f .carry/extra-wheels/SHA256SUMS ]]; then
    mkdir -p "$EXTRA_STAGE"
    cp .carry/extra-wheels/SHA256SUMS "$EXTRA_STAGE/SHA256SUMS"
    find .carry/extra-wheels -maxdepth 1 -type f ! -name SHA256SUMS -exec mv -f {} "$EXTRA_STAGE/" \;
    while read -r sha name; do
        if [[ ! -f "$EXTRA_STAGE/$name" ]] && compgen -G "$EXTRA_STAGE/$name.part*" >/dev/null; then
            cat "$EXTRA_STAGE/$name".part* > "$EXTRA_STAGE/$name.tmp"
            if [[ "$(sha256sum "$EXTRA_STAGE/$name.tmp" | cut -d' ' -f1)" == "$sha" ]]; then
                mv "$EXTRA_STAGE/$name.tmp" "$EXTRA_STAGE/$name" && rm -f "$EXTRA_STAGE/$name".part*
            else rm -f "$EXTRA_STAGE/$name.tmp"; fi
        fi
        if [[ -f "$EXTRA_STAGE/$name" ]]; then
            [[ "$(sha256sum "$EXTRA_STAGE/$name" | cut -d' ' -f1)" == "$sha" ]] || { say "extra wheel $name is corrupt"; exit 1; }
        else
            say "extra wheel $name: not complete yet"; extra_ok=0
        fi
    done < "$EXTRA_STAGE/SHA256SUMS"
    if [[ $extra_ok == 1 && ! -f "$EXTRA/.installed" ]]; then
        if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$EXTRA" \
                "$EXTRA_STAGE"/*.whl > "$OUT/pip-extra.log" 2>&1; then
            touch "$EXTRA/.installed"
            say "extra wheels installed in $EXTRA: $(ls "$EXTRA_STAGE"/*.whl | wc -l)"
        else
            say "installing the extra wheels failed:"; tail -5 "$OUT/pip-extra.log"; exit 1
        fi
    fi
fi
if [[ ! -f "$DEST/env.sh" || $extra_ok == 0 ]]; then say "parts staged; the runtime is not complete yet"; exit 0; fi
[[ $stage_only == 1 ]] && { say "staged (--stage-only)"; exit 0; }

# shellcheck source=gpu/runtime-env.sh
. "$ROOT/gpu/runtime-env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/device.txt"
python3 -c 'import torch, vllm, zerodiff; print("torch", torch.__version__, "vllm", vllm.__version__, "zerodiff", zerodiff.__file__)' 2>&1 | tee -a "$OUT/device.txt"
python3 -m zerodiff.cli vllm-check --json "$OUT/vllm-acceptance.json" "$@" 2>&1 | tee "$OUT/vllm-check.log"
rc=${PIPESTATUS[0]}
say "vllm-check exited $rc"
exit "$rc"
