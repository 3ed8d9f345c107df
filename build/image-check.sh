#!/usr/bin/env bash
# The in-image acceptance that `make image-check` (build/image.py check) runs inside a built zerodiff image with
# every GPU of the machine:
#
#   build/image-check.sh [OUTDIR]        (default $OUT, else results/image-check in the checkout)
#
# Steps, each one run even when an earlier one failed, each with its own log in OUTDIR:
#   manifest     the image's manifest (/opt/zerodiff/manifest.json) copied to OUTDIR
#   doctor       zerodiff doctor --json (torch, Triton, CUDA, compute capability, backends, pins)
#   imports      vLLM, megatron-core and DeepEP import with ZERODIFF_CONSISTENT=1 on the GPU machine (DeepEP needs the
#                driver's libcuda, which the build had not)
#   gpu-suite    gpu/gpu-suite.sh --quick (every gpu test file in its own pytest process, then the benchmarks)
#   warmup       zerodiff warmup (DeepGEMM's kernels compiled ahead; its failure alone does not fail the check,
#                as in `make e2e-check`: the check compiles what is missing)
#   check        zerodiff check --json OUTDIR/check.json (diff = 0 through RL steps, default config for the GPU)
#   vllm-check   zerodiff vllm-check --json OUTDIR/vllm-check.json (the patched vLLM engine: victim in batch,
#                prefill == decode, graphs == eager, stock control)
# OUTDIR/summary.txt lists each step's exit status. Exit 0 only when every step but warmup exited 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-$PWD/results/image-check}}
mkdir -p "$OUTDIR"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
summary="$OUTDIR/summary.txt"
: > "$summary"
failed=0

step() {  # step NAME [--advisory] CMD...: run CMD, log to OUTDIR/NAME.log, record its status
  local name=$1 advisory=0 rc start
  shift
  if [ "${1:-}" = "--advisory" ]; then advisory=1; shift; fi
  echo "=== $name: $*"
  start=$(date +%s)
  "$@" > >(tee "$OUTDIR/$name.log") 2>&1
  rc=$?
  printf '%-11s rc=%-3s %5ss%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" \
    "$([ "$advisory" = 1 ] && echo '  (advisory)')" | tee -a "$summary"
  if [ "$rc" -ne 0 ] && [ "$advisory" = 0 ]; then failed=1; fi
}

manifest=${ZERODIFF_IMAGE_MANIFEST:-/opt/zerodiff/manifest.json}
step manifest cp "$manifest" "$OUTDIR/manifest.json"
step doctor zerodiff doctor --json
step imports env ZERODIFF_CONSISTENT=1 python -c "import vllm, megatron.core, deep_ep; print('vllm', vllm.__version__)"
step gpu-suite env OUT="$OUTDIR/gpu-suite" gpu/gpu-suite.sh --quick
step warmup --advisory zerodiff warmup
step check zerodiff check --json "$OUTDIR/check.json"
step vllm-check zerodiff vllm-check --json "$OUTDIR/vllm-check.json"

echo "=== image-check: $([ "$failed" = 0 ] && echo PASSED || echo FAILED) (summary: $summary)"
cat "$summary"
exit "$failed"
