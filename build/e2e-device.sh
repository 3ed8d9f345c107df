#!/usr/bin/env bash
# The one command of the end-to-end H200 run (issue 6). Run from the repository root on the GPU machine:
#
#   build/e2e-device.sh [--total SECONDS] [--config h200] [--steps 100] [--skip-tests]
#
# Stages, each in its own process with its own timeout (a failing or slow stage never loses the others):
#   1. GPU end-to-end tests           pytest -m gpu tests/test_e2e_gpu.py                 (timeout 80 s)
#   2. acceptance run                 zerodiff check --config h200 --steps 100 --time-budget (rest of the time)
#   3. negative control               zerodiff check --config h200 --steps 3 --baseline   (timeout 55 s)
#   4. throughput                     zerodiff bench --config h200 --steps 5              (timeout 105 s)
# The check gets whatever stages 1, 3 and 4 leave of --total (default 470 s, i.e. one ~8-minute call); its
# --time-budget makes it stop cleanly, reporting how many steps ran. Every JSON is rewritten after each step.
# If fewer than --steps fit: raise --total up to the call's limit (600 s max per device call), or --skip-tests.
#
# Outputs under $OUT (few files on purpose; at most 8 come back from a lent machine):
#   summary.txt  check_h200.json  base_h200.json  bench_h200.json  bench_h200.png  logs.tar.gz
# logs.tar.gz holds env.txt, every stage's full log and the pytest junit XML.
# Needs: python3 with CUDA torch + Triton + pytest; DeepGEMM/FlashMLA from an installed vLLM or from
# build/wheel-kernels (unpacked from .carry/wheel-kernels.tar.gz when missing). No network, no pip.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/results/e2e-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
TOTAL=470; CONFIG=h200; STEPS=100; SKIP_TESTS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --total) TOTAL="$2"; shift ;;
    --config) CONFIG="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --skip-tests) SKIP_TESTS=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
T_TESTS=80; T_BASE=55; T_BENCH=105
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/kernels${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f build/wheel-kernels/vllm/__init__.py ] && [ -f .carry/wheel-kernels.tar.gz ]; then
  mkdir -p build && tar xzf .carry/wheel-kernels.tar.gz -C build
fi
W="$OUT/logs"
mkdir -p "$W"
START=$(date +%s)
SUM="$OUT/summary.txt"
: >"$SUM"
note() { echo "$*" | tee -a "$SUM"; }
elapsed() { echo $(( $(date +%s) - START )); }

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

# 1. GPU end-to-end tests
if [ "$SKIP_TESTS" = 1 ]; then note "== gpu_tests skipped (--skip-tests)"; else
stage gpu_tests "$T_TESTS" $PY -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_e2e_gpu.py \
  --junitxml="$W/junit-e2e-gpu.xml"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|E2E_GRAD_ERRORS" "$W/gpu_tests.log" | cut -c1-400 | tail -n 12 | tee -a "$SUM"
fi

# 2. acceptance: as many of the requested steps as the time left allows (stops cleanly)
LEFT=$(( TOTAL - $(elapsed) - T_BASE - T_BENCH - 10 ))
[ $LEFT -lt 60 ] && LEFT=60
stage check "$LEFT" $PY -m zerodiff.e2e_cli check --config "$CONFIG" --steps "$STEPS" \
  --time-budget $(( LEFT - 25 )) --json "$OUT/check_$CONFIG.json"
grep -E "^\[|^(PASS|FAIL)|time budget|zerodiff: step|first diverging|Error|error" "$W/check.log" | tail -n 8 | cut -c1-300 | tee -a "$SUM"

# 3. negative control: the stock baseline on both sides must show diff > 0
stage baseline "$T_BASE" $PY -m zerodiff.e2e_cli check --config "$CONFIG" --steps 3 --baseline \
  --time-budget $(( T_BASE - 15 )) --json "$OUT/base_$CONFIG.json"
grep -E "^\[|^(PASS|FAIL)|baseline kernel|Error|error" "$W/baseline.log" | tail -n 14 | cut -c1-300 | tee -a "$SUM"

# 4. throughput, consistent vs baseline on the same requests
LEFT=$(( TOTAL - $(elapsed) - 5 ))
[ $LEFT -gt $T_BENCH ] && LEFT=$T_BENCH
[ $LEFT -lt 45 ] && LEFT=45
stage bench "$LEFT" $PY -m zerodiff.e2e_cli bench --config "$CONFIG" --steps 5 --warmup 1 \
  --time-budget $(( LEFT - 15 )) --json "$OUT/bench_$CONFIG.json" --png "$OUT/bench_$CONFIG.png"
grep -E "^step|rollout output tokens|baseline kernel|captured|Error|error" "$W/bench.log" | tail -n 16 | cut -c1-300 | tee -a "$SUM"

note "done in $(elapsed)s"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs 2>/dev/null && rm -rf "$W"
ls -la "$OUT"
