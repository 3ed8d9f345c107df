#!/usr/bin/env bash
# The performance-decision call: time the prepared kernel variants against the stock kernels,
# in micro-benchmarks and end to end, and re-run the GPU tests that guard them. One command on a lent machine:
#
#   gpu/perf-session.sh [--total SECONDS] [--skip-tests] [--variants "ieee_s112 bf16x3_s32 ..."]
#
# Stages (each with its own timeout; results are written as they come, so a cut-off call keeps what finished):
#   0. zerodiff warmup --config h200 --config gpu_small        (background: DeepGEMM's M-dependent kernels)
#   1. GPU tests in two halves (a: logprobs, the integration files with gpu tests, sparse_attention,
#      attention_triton_split, experimental_attention, e2e_gpu; b: mhc, experimental_mhc, topk, experimental_topk,
#      rmsnorm, silu_mul_quant, moe, router_gemm, triton_casts, indexer), one pytest process per file
#   2. micro-benchmark sweeps: bench_mhc --quick --sweep at H 2048 (the end-to-end model) and 7168,
#      bench_topk --quick --sweep, bench_sparse_attention --quick --sweep
#   3. end to end: zerodiff bench --config h200 --steps 3 with the shipped kernels, with each mHC variant in
#      --variants (default: the runners-up bf16x3_s32 tf32_s112_e1 ieee_s112 of
#      zerodiff.experimental.mhc_variants), and with the other Top-K design (ZD_TOPK_VARIANT=single) as a control
# Two GPUs: GPU 0 runs 0, 3, then tests a; GPU 1 runs 2, then tests b (a timing never overlaps a test or the
# warm-up on its GPU). One GPU: 0, 2, 3, then tests a and b.
# Outputs under $OUT (at most 8 files come back from a lent machine):
#   summary.txt  sweeps.tar.gz  e2e.tar.gz  tests.tar.gz  triton-cache-h200.tar.gz (copy to .carry/)
# Read them with: python benchmarks/report.py (sweeps), the JSON "ratio" fields (e2e), tests/files.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/results/perf-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
TOTAL=560; SKIP_TESTS=0; VARIANTS="bf16x3_s32 tf32_s112_e1 ieee_s112"
source gpu/session-lib.sh
while [ $# -gt 0 ]; do
  case "$1" in
    --total) TOTAL="$2"; shift ;;
    --skip-tests) SKIP_TESTS=1 ;;
    --variants) VARIANTS="$2"; shift ;;
    *) other_arg "$1" 2,21 ;;
  esac
  shift
done
source gpu/gpu-env.sh
session_start
S="$OUT/sweeps"; E="$OUT/e2e"; T="$OUT/tests"
mkdir -p "$S" "$E" "$T"
note "zerodiff perf session: $(date -u +%Y-%m-%dT%H:%M:%SZ), $NGPU GPU(s), total ${TOTAL}s, mHC variants: $VARIANTS"

sweeps() {
  note "== sweeps (t=$(elapsed)s)"
  timed $(( $(left 200) < 150 ? $(left 200) : 150 )) "$S/mhc" $PY benchmarks/bench_mhc.py --quick --sweep \
    --hidden 2048 --hidden 7168 --json "$S/mhc.json"
  timed $(( $(left 180) < 100 ? $(left 180) : 100 )) "$S/topk" $PY benchmarks/bench_topk.py --quick --sweep \
    --json "$S/topk.json"
  timed $(( $(left 160) < 100 ? $(left 160) : 100 )) "$S/sparse_attention" $PY benchmarks/bench_sparse_attention.py \
    --quick --sweep --json "$S/sparse_attention.json"
}

e2e() {
  note "== end to end, zerodiff bench --config h200 --steps 3 (t=$(elapsed)s)"
  wait_warmup
  timed $(( $(left 5) < 60 ? $(left 5) : 60 )) "$E/shipped" $PY -m zerodiff.e2e_cli bench --config h200 --steps 3 \
    --warmup 1 --json "$E/shipped.json"
  for v in $VARIANTS; do
    timed $(( $(left 5) < 60 ? $(left 5) : 60 )) "$E/mhc-$v" $PY -m zerodiff.e2e_cli bench --config h200 --steps 3 \
      --warmup 1 --mhc-variant "$v" --json "$E/mhc-$v.json"
  done
  timed $(( $(left 5) < 60 ? $(left 5) : 60 )) "$E/topk-single" env ZD_TOPK_VARIANT=single $PY -m zerodiff.e2e_cli \
    bench --config h200 --steps 3 --warmup 1 --json "$E/topk-single.json"
  for f in "$E"/*.json; do
    [ -f "$f" ] && note "   $(basename "$f" .json): $($PY -c "import json,sys; d=json.load(open(sys.argv[1])); print('ratio', round(d['ratio'], 3) if d.get('ratio') else None, 'forward GPU-time ratio', round(d['forward_device_ratio'], 3) if d.get('forward_device_ratio') else None, 'consistent tok/s', d.get('consistent_tok_per_s'))" "$f" 2>&1)"
  done
}

TESTS_A="tests/test_logprobs.py tests/test_vllm_megatron_parity.py tests/test_vllm_custom_ops.py tests/test_vllm_mhc_adapter.py tests/test_vllm_moe_adapter.py tests/test_vllm_dsv4_attention.py tests/test_megatron_moe.py tests/test_sparse_attention.py tests/test_attention_triton_split.py tests/test_experimental_attention.py tests/test_e2e_gpu.py"
TESTS_B="tests/test_mhc.py tests/test_experimental_mhc.py tests/test_topk.py tests/test_experimental_topk.py tests/test_rmsnorm.py tests/test_silu_mul_quant.py tests/test_moe.py tests/test_router_gemm.py tests/test_triton_casts.py tests/test_indexer.py"
tests() {  # tests SUBDIR FILES: one pytest process per file, results under $T/SUBDIR
  [ "$SKIP_TESTS" = 1 ] && { note "== tests skipped"; return 0; }
  local d="$T/$1"; mkdir -p "$d"
  note "== GPU tests $1 on GPU ${CUDA_VISIBLE_DEVICES:-0} (t=$(elapsed)s)"
  [ "$(left 10)" -lt 30 ] && { note "   skipped ($(left)s left)"; return 0; }
  ZD_TEST_FILES="$2" ZD_SKIP_UNPACK=1 PYTEST_ADDOPTS="--timeout=150" OUT="$d" timeout -k 10 $(left 10) \
    gpu/gpu-suite.sh --tests-only >"$d/suite.out" 2>&1
  cat "$d/files.txt" 2>/dev/null | tee -a "$SUM"
  grep -E "^(FAILED|ERROR)" "$d/pytest.log" 2>/dev/null | cut -c1-250 | tail -n 20 | tee -a "$SUM"
}

# the warm-up's GEMMs must not overlap a timing: on two GPUs the end-to-end benches wait for it on GPU 0 while
# GPU 1 sweeps; each GPU then runs half of the tests after its timings (DeepGEMM's cache is per machine)
if [ "$NGPU" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 $PY -m zerodiff.e2e_cli warmup --config h200 --config gpu_small >"$OUT/warmup.log" 2>&1 &
else
  $PY -m zerodiff.e2e_cli warmup --config h200 --config gpu_small >"$OUT/warmup.log" 2>&1 &
fi
WPID=$!
wait_warmup() { while kill -0 $WPID 2>/dev/null; do sleep 2; done; }

if [ "$NGPU" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=0; e2e; tests a "$TESTS_A" ) &
  ( export CUDA_VISIBLE_DEVICES=1; sweeps; tests b "$TESTS_B" ) &
  wait
else
  wait_warmup; sweeps; e2e; tests a "$TESTS_A"; tests b "$TESTS_B"
fi
note "warmup: $(tail -n 1 "$OUT/warmup.log")"
note "done in $(elapsed)s"
pack_triton_cache "$OUT" 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"
tar czf "$OUT/sweeps.tar.gz" -C "$OUT" sweeps && tar czf "$OUT/e2e.tar.gz" -C "$OUT" e2e && \
  tar czf "$OUT/tests.tar.gz" -C "$OUT" tests warmup.log && rm -rf "$S" "$E" "$T" "$OUT/warmup.log"
ls -la "$OUT"
