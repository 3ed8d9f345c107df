#!/usr/bin/env bash
# One call on a lent GPU machine: the GPU test suite and the benchmarks, in parallel on two GPUs when
# there are two (tests on GPU 0, benchmarks on GPU 1), else one after the other. Everything lands in
# $OUT/results.tar.gz plus $OUT/summary.txt, so a time-limited call still returns what it finished.
#
#   gpu/device-run.sh [--budget SECONDS] [--quick] [-k PYTEST_EXPR] [BENCH_NAME ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/results/device-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
BUDGET=540; ARGS=(); TARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET="$2"; shift ;;
    -k) TARGS+=(-k "$2"); shift ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
# unpack the carried wheel kernels once, before the two halves start (they would race otherwise)
source gpu/gpu-env.sh
export ZD_SKIP_UNPACK=1
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "gpus: $ngpu, budget ${BUDGET}s"
if [ "$ngpu" -ge 2 ]; then
  PYTEST_ADDOPTS="--timeout=240" CUDA_VISIBLE_DEVICES=0 OUT="$OUT/tests" timeout "$BUDGET" gpu/gpu-suite.sh --tests-only "${TARGS[@]}" >"$OUT/tests.out" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 OUT="$OUT/bench" timeout "$BUDGET" gpu/gpu-suite.sh --bench-only "${ARGS[@]}" >"$OUT/bench.out" 2>&1 &
  wait
else
  OUT="$OUT/tests" timeout $((BUDGET / 2)) gpu/gpu-suite.sh --tests-only "${TARGS[@]}" >"$OUT/tests.out" 2>&1
  OUT="$OUT/bench" timeout $((BUDGET / 2)) gpu/gpu-suite.sh --bench-only "${ARGS[@]}" >"$OUT/bench.out" 2>&1
fi
{
  echo "== tests =="; cat "$OUT/tests/summary.txt" 2>/dev/null || echo "(no summary: timed out?)"
  cat "$OUT/tests/files.txt" 2>/dev/null
  grep -E "^(FAILED|ERROR)" "$OUT/tests/pytest.log" 2>/dev/null | cut -c1-200 | tail -n 60
  echo "== benchmarks =="; cat "$OUT/bench/summary.txt" 2>/dev/null || echo "(no summary: timed out?)"
  grep -E "FAILED|Error" "$OUT/bench.out" 2>/dev/null | tail -n 30
} >"$OUT/summary.txt"
tar czf "$OUT/results.tar.gz" -C "$OUT" tests bench tests.out bench.out 2>/dev/null
rm -rf "$OUT/tests" "$OUT/bench" "$OUT/tests.out" "$OUT/bench.out"
cat "$OUT/summary.txt"
