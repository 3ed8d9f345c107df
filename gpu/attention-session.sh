#!/usr/bin/env bash
# The sparse-MLA decision call: FlashMLA's FP8 decode kernel under zerodiff's fixed schedule
# (backend "flashmla_fp8") - its GPU tests, its micro-benchmark against the same kernel under its own scheduler,
# and a short end-to-end check and throughput run with it as the read path on both sides. One command:
#
#   gpu/attention-session.sh [--total SECONDS] [--steps N] [--tests "FILES"] [--pieces "1 4 8"] [--check-pieces 4]
#
# Two GPUs: GPU 0 runs the tests (tests/test_attention_flashmla_fp8.py first, then --tests, one pytest process
# per file); GPU 1 runs the micro-benchmark (bench_sparse_attention.py --flashmla-fp8), then the warm-up, then
# `zerodiff check --attn-backend flashmla_fp8 --steps N` (ZD_FLASHMLA_PIECES=--check-pieces) and
# `zerodiff bench --attn-backend flashmla_fp8 --steps 3` once per --pieces value.
# One GPU: all of it in that order, the tests last.
# Outputs under $OUT: summary.txt  bench.json  e2e.tar.gz  tests.tar.gz  triton-cache-h200.tar.gz (to .carry/)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/results/attention-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
TOTAL=540; STEPS=20; PIECES="1 4 8"; CHECK_PIECES=4
MORE="tests/test_sparse_attention.py tests/test_attention_triton_split.py tests/test_experimental_attention.py tests/test_attention_slots.py tests/test_vllm_megatron_parity.py tests/test_vllm_custom_ops.py tests/test_vllm_mhc_adapter.py tests/test_vllm_moe_adapter.py tests/test_vllm_dsv4_attention.py tests/test_megatron_moe.py tests/test_kv_cache.py tests/test_fp8_quant.py tests/test_fp8_gemm.py tests/test_bf16_gemm.py"
source gpu/session-lib.sh
while [ $# -gt 0 ]; do
  case "$1" in
    --total) TOTAL="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --tests) MORE="$2"; shift ;;
    --pieces) PIECES="$2"; shift ;;
    --check-pieces) CHECK_PIECES="$2"; shift ;;
    *) other_arg "$1" 2,14 ;;
  esac
  shift
done
source gpu/gpu-env.sh
session_start
E="$OUT/e2e"; T="$OUT/tests"
mkdir -p "$E" "$T"
note "zerodiff attention session: $(date -u +%Y-%m-%dT%H:%M:%SZ), $NGPU GPU(s), total ${TOTAL}s"
tests() {
  note "== GPU tests on GPU ${CUDA_VISIBLE_DEVICES:-0} (t=$(elapsed)s)"
  [ "$(left 10)" -lt 30 ] && { note "   skipped ($(left)s left)"; return 0; }
  ZD_TEST_FILES="tests/test_attention_flashmla_fp8.py $MORE" ZD_SKIP_UNPACK=1 PYTEST_ADDOPTS="--timeout=200" OUT="$T" \
    timeout -k 10 $(left 10) gpu/gpu-suite.sh --tests-only >"$T/suite.out" 2>&1
  cat "$T/files.txt" 2>/dev/null | tee -a "$SUM"
  grep -E "^(FAILED|ERROR)" "$T/pytest.log" 2>/dev/null | cut -c1-300 | tail -n 25 | tee -a "$SUM"
}
timings() {
  note "== micro-benchmark on GPU ${CUDA_VISIBLE_DEVICES:-0} (t=$(elapsed)s)"
  timed $(( $(left 200) < 220 ? $(left 200) : 220 )) "$E/bench-micro" $PY benchmarks/bench_sparse_attention.py \
    --flashmla-fp8 --json "$OUT/bench.json"
  grep -E "^(decode|prefill)" "$E/bench-micro.log" | awk '{print "   " $0}' | cut -c1-160 | tee -a "$SUM"
  note "== end to end with --attn-backend flashmla_fp8 (t=$(elapsed)s)"
  timed 120 "$E/warmup" $PY -m zerodiff.e2e_cli warmup --config h200
  local tb=$(( $(left 90) < 200 ? $(left 90) : 200 ))
  timed "$tb" "$E/check" env ZD_FLASHMLA_PIECES=$CHECK_PIECES $PY -m zerodiff.e2e_cli check --config h200 \
    --steps "$STEPS" --attn-backend flashmla_fp8 \
    --time-budget $(( tb - 25 )) --json "$E/check.json"
  grep -E "^(PASS|FAIL)|time budget|first diverging|Error" "$E/check.log" | tail -n 6 | cut -c1-300 | tee -a "$SUM"
  for p in $PIECES; do
    timed $(( $(left 5) < 70 ? $(left 5) : 70 )) "$E/bench-p$p" env ZD_FLASHMLA_PIECES=$p $PY -m zerodiff.e2e_cli bench \
      --config h200 --steps 3 --warmup 1 --attn-backend flashmla_fp8 --json "$E/bench-p$p.json"
    [ -f "$E/bench-p$p.json" ] && note "   e2e bench, pieces $p: $($PY -c "import json,sys; d=json.load(open(sys.argv[1])); print('ratio', d.get('ratio'), 'forward GPU-time ratio', d.get('forward_device_ratio'))" "$E/bench-p$p.json" 2>&1)"
  done
}
if [ "$NGPU" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=0; tests ) &
  ( export CUDA_VISIBLE_DEVICES=1; timings ) &
  wait
else
  timings; tests
fi
note "done in $(elapsed)s"
pack_triton_cache "$OUT" 2>&1 | tail -n 1 | tee -a "$SUM"
tar czf "$OUT/e2e.tar.gz" -C "$OUT" e2e && tar czf "$OUT/tests.tar.gz" -C "$OUT" tests && rm -rf "$E" "$T"
ls -la "$OUT"
