#!/usr/bin/env bash
# The one command of the end-to-end H200 run. Run from the repository root on the GPU machine:
#
#   gpu/e2e-device.sh [--total SECONDS] [--config h200] [--steps 100] [--skip-tests] [--tests "FILES"]
#                       [--also "SHELL COMMAND"]
#
# Stages, each in its own process with its own timeout (a failing or slow stage never loses the others):
#   0. warm-up                        zerodiff warmup: DeepGEMM's M-dependent kernels compiled in parallel
#   1. GPU end-to-end tests           pytest -m gpu tests/test_e2e_gpu.py                 (one GPU only)
#   2. acceptance run                 zerodiff check --config h200 --steps 100 --time-budget (rest of the time)
#   3. negative control               zerodiff check --config h200 --steps 3 --baseline
#   4. throughput                     zerodiff bench --config h200 --steps 5
#   5. more GPU tests                 --tests "tests/test_a.py ..." (two GPUs only, in the time left)
#   +  --also CMD                     one more command right after the bench, on the bench's GPU (e.g. a
#                                     micro-benchmark sweep; $LOGS is the folder that comes back in logs.tar.gz)
# With two or more GPUs: the warm-up runs on all of them; the check starts at once on GPU 0 (it meets the
# configurations the warm-up is compiling: whoever is first compiles, the cache is shared); GPU 1 waits for the
# warm-up, then runs 3, 4, then test_e2e_gpu.py and the --tests files. With one GPU: the check starts at once
# next to the warm-up, the tests (1, 5) share the GPU with it, 3 and 4 run once the check has ended (the check
# gets --total minus their share). The check's --time-budget makes it stop cleanly, reporting
# how many steps ran; every JSON is rewritten after each step.
#
# Outputs under $OUT (few files on purpose; at most 8 come back from a lent machine):
#   summary.txt  check_h200.json  base_h200.json  bench_h200.json  bench_h200.png  logs.tar.gz
#   triton-cache-h200.tar.gz (the compiled Triton kernels: copy to .carry/ so the next call starts warm)
# logs.tar.gz holds env.txt, every stage's full log, the warm-up log and the GPU tests (pytest log, junit XML).
# Needs: python3 with CUDA torch + Triton + pytest; DeepGEMM/FlashMLA from an installed vLLM or from
# build/wheel-kernels (unpacked from .carry/wheel-kernels.tar.gz when missing). No network, no pip.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/results/e2e-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
TOTAL=470; CONFIG=h200; STEPS=100; SKIP_TESTS=0; MORE_TESTS=""; ALSO=""
source gpu/session-lib.sh
while [ $# -gt 0 ]; do
  case "$1" in
    --total) TOTAL="$2"; shift ;;
    --config) CONFIG="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --skip-tests) SKIP_TESTS=1 ;;
    --tests) MORE_TESTS="$2"; shift ;;
    --also) ALSO="$2"; shift ;;
    *) other_arg "$1" 2,28 ;;
  esac
  shift
done
source gpu/gpu-env.sh
session_start logs

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton missing", e)
from zerodiff import backends
import json; print(json.dumps(backends.status(), indent=1))
EOF
} >"$W/env.txt" 2>&1
note "zerodiff e2e device run: config=$CONFIG steps=$STEPS total=${TOTAL}s out=$OUT"
grep -E "^(date|python|NVIDIA|name)|\"available\"" "$W/env.txt" | head -n 12 | tee -a "$SUM"

# stage NAME TIMEOUT CMD...: run with its own timeout, log to logs/NAME.log, one summary line
stage() {
  local name=$1 t=$2; shift 2
  local s=$(date +%s)
  note "== $name (timeout ${t}s, t=$(elapsed)s): $*"
  timeout -k 10 "$t" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  local why=""
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && why=" (TIMED OUT)"
  note "   $name: rc=$rc$why in $(( $(date +%s) - s ))s"
  return 0
}

T_WARM=200
WARM_CFG=(--config "$CONFIG")
[ "$SKIP_TESTS" = 1 ] || [ "$CONFIG" = gpu_small ] || WARM_CFG+=(--config gpu_small)
check_stage() {  # $1: seconds available
  local t=$1
  [ "$t" -lt 60 ] && t=60
  stage check "$t" $PY -m zerodiff.e2e_cli check --config "$CONFIG" --steps "$STEPS" \
    --time-budget $(( t - 25 )) --json "$OUT/check_$CONFIG.json"
  grep -E "^\[|^(PASS|FAIL)|time budget|zerodiff: step|first diverging|Error|error" "$W/check.log" | tail -n 8 | cut -c1-300 | tee -a "$SUM"
}
baseline_stage() {
  stage baseline "$T_BASE" $PY -m zerodiff.e2e_cli check --config "$CONFIG" --steps 3 --baseline \
    --time-budget $(( T_BASE - 15 )) --json "$OUT/base_$CONFIG.json"
  grep -E "^\[|^(PASS|FAIL)|^control:|baseline kernel|Error|error" "$W/baseline.log" | tail -n 18 | cut -c1-300 | tee -a "$SUM"
}
bench_stage() {  # $1: seconds available
  local t=$1
  [ "$t" -gt "$T_BENCH" ] && t=$T_BENCH
  [ "$t" -lt 45 ] && t=45
  stage bench "$t" $PY -m zerodiff.e2e_cli bench --config "$CONFIG" --steps 5 --warmup 1 \
    --time-budget $(( t - 15 )) --json "$OUT/bench_$CONFIG.json" --png "$OUT/bench_$CONFIG.png"
  grep -E "^step|rollout output tokens|baseline kernel|captured|Error|error" "$W/bench.log" | tail -n 16 | cut -c1-300 | tee -a "$SUM"
}
also_stage() {  # $1: seconds available: the --also command, if any
  [ -z "$ALSO" ] && return 0
  local t=$1
  [ "$t" -gt 200 ] && t=200
  [ "$t" -lt 20 ] && { note "== also skipped: ${t}s left"; return 0; }
  LOGS="$W" stage also "$t" bash -c "$ALSO"
  tail -n 5 "$W/also.log" | cut -c1-300 | tee -a "$SUM"
}
tests_stage() {  # $1: seconds available, $2: test files
  local t=$1
  [ "$t" -lt 30 ] && { note "== gpu tests skipped: ${t}s left"; return 0; }
  note "== gpu tests (timeout ${t}s, t=$(elapsed)s): $2"
  ZD_TEST_FILES="$2" ZD_SKIP_UNPACK=1 PYTEST_ADDOPTS="--timeout=150" OUT="$W/tests" \
    timeout -k 10 "$t" gpu/gpu-suite.sh --tests-only >"$W/gpu_tests.log" 2>&1
  cat "$W/tests/files.txt" 2>/dev/null | tee -a "$SUM"
  grep -E "^(FAILED|ERROR)|E2E_GRAD_ERRORS" "$W/tests/pytest.log" 2>/dev/null | cut -c1-300 | tail -n 20 | tee -a "$SUM"
}

if [ "$NGPU" -ge 2 ]; then
  T_BASE=70; T_BENCH=130
  note "== warmup (background, timeout ${T_WARM}s, t=$(elapsed)s): zerodiff warmup ${WARM_CFG[*]}"
  timeout -k 10 "$T_WARM" $PY -m zerodiff.e2e_cli warmup "${WARM_CFG[@]}" >"$W/warmup.log" 2>&1 &
  WPID=$!
  ( export CUDA_VISIBLE_DEVICES=0; check_stage $(( TOTAL - $(elapsed) - 10 )) ) &
  CPID=$!
  wait $WPID; note "   warmup: rc=$? at t=$(elapsed)s: $(tail -n 1 "$W/warmup.log")"
  (
    export CUDA_VISIBLE_DEVICES=1
    baseline_stage
    bench_stage $(( TOTAL - $(elapsed) - 40 ))
    also_stage $(( TOTAL - $(elapsed) - 60 ))
    files="$MORE_TESTS"
    [ "$SKIP_TESTS" = 1 ] || files="tests/test_e2e_gpu.py $files"
    [ -n "$files" ] && tests_stage $(( TOTAL - $(elapsed) - 15 )) "$files"
  ) &
  wait
else
  # one GPU: the check starts at once next to the warm-up; the GPU tests share the GPU with it (kernel bits do
  # not depend on a neighbour process; their timings are not reported); the negative control and the throughput
  # bench run after the check (the check's training graph holds most of the GPU memory: a baseline run next to
  # it ran out of memory on the H200), the bench alone on the GPU.
  T_BASE=50; T_BENCH=100
  CHECK_END=$(( TOTAL - T_BENCH - T_BASE - 15 ))
  note "== warmup (background, timeout ${T_WARM}s, t=$(elapsed)s): zerodiff warmup ${WARM_CFG[*]}"
  timeout -k 10 "$T_WARM" $PY -m zerodiff.e2e_cli warmup "${WARM_CFG[@]}" >"$W/warmup.log" 2>&1 &
  WPID=$!
  check_stage $(( CHECK_END - $(elapsed) )) &
  CPID=$!
  wait $WPID; note "   warmup: rc=$? at t=$(elapsed)s: $(tail -n 1 "$W/warmup.log")"
  files="$MORE_TESTS"
  [ "$SKIP_TESTS" = 1 ] || files="tests/test_e2e_gpu.py $files"
  [ -n "$files" ] && tests_stage $(( CHECK_END - $(elapsed) )) "$files"
  wait $CPID
  baseline_stage
  bench_stage $(( TOTAL - $(elapsed) - 5 ))
  also_stage $(( TOTAL - $(elapsed) - 5 ))
fi

note "done in $(elapsed)s"
pack_triton_cache "$OUT" 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs 2>/dev/null && rm -rf "$W"
ls -la "$OUT"
