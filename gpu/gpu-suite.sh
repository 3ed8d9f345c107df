#!/usr/bin/env bash
# Run the whole GPU suite and the micro-benchmarks in one go, writing results under $OUT (default
# ./results/gpu-<date>). Used on the lent H200 and on any user GPU machine:
#
#   gpu/gpu-suite.sh [--tests-only | --bench-only] [--quick] [--budget S] [-k PYTEST_EXPR] [BENCH_NAME ...]
#
# Needs: python3 with CUDA torch, Triton, pytest. DeepGEMM/FlashMLA come from an installed vLLM or from
# build/wheel-kernels (`make kernels-from-wheel`); a packed copy in .carry/wheel-kernels.tar.gz is unpacked
# first when the folder is missing (that is how the tree travels to a machine without vLLM).
# ZD_TEST_FILES="tests/test_a.py ..." restricts the test files; ZD_FILE_TIMEOUT=S ends one file's pytest after S
# seconds (recorded as exit 124); --budget S starts no further test file or benchmark once S seconds have passed
# (the files left are listed as "not run" in files.txt and summary.txt); a file started just before the budget
# runs to its end, so the tests take at most S + ZD_FILE_TIMEOUT seconds.
# Outputs (few files on purpose): summary.txt, env.txt, pytest.log, junit.xml, bench.log, bench-json.tar.gz
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/results/gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
RUN_TESTS=1; RUN_BENCH=1; QUICK=""; KEXPR=""; BENCHES=(); BUDGET=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only) RUN_BENCH=0 ;;
    --bench-only) RUN_TESTS=0 ;;
    --quick) QUICK="--quick" ;;
    -k) KEXPR="$2"; shift ;;
    --budget) BUDGET="$2"; shift
      case "$BUDGET" in ''|*[!0-9]*) echo "gpu-suite.sh: --budget wants whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) BENCHES+=("$1") ;;
  esac
  shift
done

source gpu/gpu-env.sh

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
  $PY - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton missing", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0); print("device", p.name, "cc", p.major, p.minor, "SMs", p.multi_processor_count)
from zerodiff import backends
import json; print(json.dumps(backends.status(), indent=1))
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

t0=$(date +%s)
over_budget() { [ "$BUDGET" -gt 0 ] && [ $(( $(date +%s) - t0 )) -ge "$BUDGET" ]; }
nskipped=0
status_tests="not run"
if [ "$RUN_TESTS" = 1 ]; then
  # one pytest process per test file: a kernel fault (a sticky CUDA error) then fails only its own file
  : >"$OUT/pytest.log"; rc=0; nfiles=0; nbad=0
  for f in ${ZD_TEST_FILES:-tests/test_*.py}; do
    grep -q "pytest.mark.gpu" "$f" || continue
    if over_budget; then
      nskipped=$((nskipped+1)); echo "$f: not run (--budget $BUDGET s spent)" | tee -a "$OUT/files.txt"; continue
    fi
    nfiles=$((nfiles+1))
    echo "=== $f ===" | tee -a "$OUT/pytest.log"
    flog="$OUT/.file.log"
    ${ZD_FILE_TIMEOUT:+timeout "$ZD_FILE_TIMEOUT"} $PY -m pytest -m gpu -q -rfEs -p no:cacheprovider ${KEXPR:+-k "$KEXPR"} "$f" >"$flog" 2>&1
    r=$?
    cat "$flog" >>"$OUT/pytest.log"
    [ $r -eq 5 ] && r=0  # no gpu test selected in this file
    [ $r -ne 0 ] && { rc=$r; nbad=$((nbad+1)); }
    # the outcome line of this file's own log only (a file cut off by its timeout has none)
    line=$(grep -E '(passed|failed|error|skipped|deselected).* in [0-9.]+s' "$flog" | tail -n 1)
    if [ $r -eq 124 ] && [ -n "${ZD_FILE_TIMEOUT:-}" ]; then
      line="timed out after $ZD_FILE_TIMEOUT s (ZD_FILE_TIMEOUT)${line:+; $line}"
    fi
    echo "$f: exit $r: ${line:-no pytest summary line (see pytest.log)}" | tee -a "$OUT/files.txt"
    rm -f "$flog"
  done
  status_tests="exit $rc: $nbad of $nfiles files with failures"
  [ "$nskipped" -gt 0 ] && status_tests="$status_tests, $nskipped not run (budget)"
fi
t1=$(date +%s)

status_bench="not run"
if [ "$RUN_BENCH" = 1 ]; then
  mkdir -p "$OUT/bench"
  if [ ${#BENCHES[@]} -eq 0 ]; then
    for f in benchmarks/bench_*.py; do BENCHES+=("$(basename "$f" .py | sed 's/^bench_//')"); done
  fi
  nok=0; nfail=0
  for b in "${BENCHES[@]}"; do
    if over_budget; then echo "bench $b: not run (--budget $BUDGET s spent)" | tee -a "$OUT/bench.log"; continue; fi
    echo "=== bench $b ===" | tee -a "$OUT/bench.log"
    if timeout 400 $PY "benchmarks/bench_$b.py" $QUICK --json "$OUT/bench/$b.json" >>"$OUT/bench.log" 2>&1; then
      nok=$((nok+1)); tail -n 40 "$OUT/bench.log" | grep -v '^ ' | tail -n 25
    else
      nfail=$((nfail+1)); echo "bench $b FAILED"; tail -n 15 "$OUT/bench.log"
    fi
  done
  tar czf "$OUT/bench-json.tar.gz" -C "$OUT" bench && rm -rf "$OUT/bench"
  status_bench="$nok ok, $nfail failed"
fi
t2=$(date +%s)

{
  echo "gpu suite $(date -u +%Y-%m-%d) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo "tests: $status_tests ($((t1-t0)) s)"
  echo "benchmarks: $status_bench ($((t2-t1)) s)"
} | tee "$OUT/summary.txt"
