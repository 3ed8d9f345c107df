# Shared by the one-call GPU session scripts (perf-session.sh, attention-session.sh); source it after OUT and TOTAL
# are set and gpu/gpu-env.sh is sourced. Defines: START, elapsed, left [RESERVE], SUM + note (the summary file),
# NGPU, and timed SECONDS NAME CMD... (runs CMD under a timeout, logs to NAME.log, writes one summary line).
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(elapsed) - ${1:-0} )); }
SUM="$OUT/summary.txt"; : >"$SUM"
note() { echo "$*" | tee -a "$SUM"; }
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
timed() {
  local t=$1 name=$2; shift 2
  [ "$t" -lt 20 ] && { note "   $name: skipped (${t}s left)"; return 0; }
  local s=$(date +%s)
  timeout -k 10 "$t" "$@" >"$name.log" 2>&1
  local rc=$?  # before any command substitution resets $?
  local why=""; { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && why=" (timed out)"
  note "   $(basename "$name"): rc=$rc$why in $(( $(date +%s) - s ))s (t=$(elapsed)s)"
}
