# Shared by the one-call GPU session scripts (e2e-device.sh, perf-session.sh, attention-session.sh). Source it from
# the repository root before the option loop; it only defines functions:
#   other_arg ARG LINES  the option loop's last arm: -h/--help prints the script's header lines LINES (sed range,
#                        "2,14") and exits 0; any other argument is refused (exit 2)
#   session_start [DIR]  once OUT and TOTAL are set and gpu/gpu-env.sh is sourced: START, SUM (the summary file,
#                        emptied) and NGPU; with DIR also W="$OUT/DIR" (created), the folder of the stage logs
#   elapsed, left [RESERVE], note (echo and append to SUM), and timed SECONDS NAME CMD... (runs CMD under a
#   timeout, logs to NAME.log, writes one summary line).
other_arg() {
  case "$1" in
    -h|--help) sed -n "${2}p" "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
}
session_start() {  # session_start [LOGDIR]: also W="$OUT/LOGDIR", created
  START=$(date +%s)
  if [ -n "${1:-}" ]; then W="$OUT/$1"; mkdir -p "$W"; fi
  SUM="$OUT/summary.txt"; : >"$SUM"
  NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
}
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(elapsed) - ${1:-0} )); }
note() { echo "$*" | tee -a "$SUM"; }
timed() {
  local t=$1 name=$2; shift 2
  [ "$t" -lt 20 ] && { note "   $name: skipped (${t}s left)"; return 0; }
  local s=$(date +%s)
  timeout -k 10 "$t" "$@" >"$name.log" 2>&1
  local rc=$?  # before any command substitution resets $?
  local why=""; { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && why=" (timed out)"
  note "   $(basename "$name"): rc=$rc$why in $(( $(date +%s) - s ))s (t=$(elapsed)s)"
}
