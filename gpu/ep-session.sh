#!/usr/bin/env bash
# The expert-parallel acceptance in one call, on a host with two GPUs. Run from the repository root:
#
#   gpu/ep-session.sh [--total SECONDS] [--config gpu_small] [--steps 3]
#
# Stages, each in its own process with its own timeout:
#   1. GPU tests     pytest -m gpu tests/test_expert_parallel.py: the MoE dispatch/combine at EP = 2 over NCCL
#                    equals EP = 1, and the harness model's logits / log-probs at EP = 2 equal EP = 1 with the
#                    EP-degree control differing (its summary, EP2_MODEL_RESULT, is written to ep2-model.json)
#   2. RL check      zerodiff check --rollout-ep 2 --steps N: EP = 2 rollout (GPU 0 and GPU 1, NCCL) vs the
#                    EP = 1 training forward, diff = 0 through RL steps (ep2-check.json)
#   3. with graphs   the same with --ep-graphs: decode graphs captured on both ranks, NCCL inside the graphs
#                    (ep2-check-graphs.json; its own timeout, so a hang there costs only this stage)
# Fewer than two GPUs: nothing runs, exit 2. NVLink multicast stays as the machine's environment sets it.
# Outputs under $OUT: summary.txt, ep2-model.json, ep2-check.json, ep2-check-graphs.json, logs.tar.gz (env.txt,
# every stage's log). Exit: 0 when the tests and both checks passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/results/ep-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
TOTAL=540; CONFIG=gpu_small; STEPS=3
source gpu/session-lib.sh
while [ $# -gt 0 ]; do
  case "$1" in
    --total) TOTAL="$2"; shift ;;
    --config) CONFIG="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    *) other_arg "$1" 2,18 ;;
  esac
  shift
done
source gpu/gpu-env.sh
session_start logs
if [ "$NGPU" -lt 2 ]; then
  note "ep-session: needs 2 GPUs, found $NGPU: nothing run"
  exit 2
fi
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -n 8
  env | grep -E '^(NCCL_|CUDA_VISIBLE)' | sort
} >"$W/env.txt" 2>&1
note "ep-session $(date -u +%Y-%m-%d) on $NGPU GPUs: config $CONFIG, $STEPS RL steps"
timed $(( $(left 30) / 2 )) "$W/ep-tests" $PY -m pytest -m gpu -rA -p no:cacheprovider tests/test_expert_parallel.py
tests_line=$(grep -E '^=+ .* in [0-9.]+s' "$W/ep-tests.log" 2>/dev/null | tail -n 1)
tests_ok=0
case "$tests_line" in *failed*|*error*|"") ;; *passed*) tests_ok=1 ;; esac
grep -m1 '^EP2_MODEL_RESULT ' "$W/ep-tests.log" | sed 's/^EP2_MODEL_RESULT //' >"$OUT/ep2-model.json"
[ -s "$OUT/ep2-model.json" ] || { rm -f "$OUT/ep2-model.json"; note "   no EP2_MODEL_RESULT line (see logs/ep-tests.log)"; }
timed $(( $(left 20) / 2 )) "$W/ep2-check" $PY -m zerodiff.e2e_cli check --config "$CONFIG" --rollout-ep 2 \
  --steps "$STEPS" --json "$OUT/ep2-check.json"
timed "$(left 20)" "$W/ep2-check-graphs" $PY -m zerodiff.e2e_cli check --config "$CONFIG" --rollout-ep 2 --ep-graphs \
  --steps "$STEPS" --json "$OUT/ep2-check-graphs.json"
check_ok=$(cat "$W/ep2-check.log" "$W/ep2-check-graphs.log" 2>/dev/null | grep -c '^PASS: diff = 0')
note "   tests: ${tests_line:-no pytest summary line (cut off?)}"
note "   check: $(grep -E '^(PASS|FAIL)' "$W/ep2-check.log" | tail -n 1)"
note "   check with graphs: $(grep -E '^(PASS|FAIL)' "$W/ep2-check-graphs.log" | tail -n 1)"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$W"
[ "$tests_ok" = 1 ] && [ "$check_ok" = 2 ] && exit 0
exit 1
