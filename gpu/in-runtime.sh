#!/usr/bin/env bash
# Run one command inside the unpacked patched-vLLM runtime, e.g. the kernel GPU suite or the end-to-end run
# with the runtime's DeepGEMM and FlashMLA (vLLM's wheel) instead of a carried .carry/wheel-kernels.tar.gz:
#
#   gpu/in-runtime.sh gpu/gpu-suite.sh --tests-only
#   gpu/in-runtime.sh gpu/e2e-device.sh --total 400
#
# The runtime must already be unpacked in $ZD_RUNTIME (default /root/zd-rt) by gpu/vllm-acceptance.sh
# (--stage-only is enough once every part has arrived). The environment is gpu/runtime-env.sh's: the runtime,
# its extra wheels, this tree's zerodiff, the JIT caches in /root/zd-cache. Exit: the command's status; 2 when
# there is no runtime or no command.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { echo "[in-runtime] $*" >&2; }
if [[ $# == 0 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    [[ $# == 0 ]] && exit 2 || exit 0
fi
DEST="${ZD_RUNTIME:-/root/zd-rt}"
if [[ ! -f "$DEST/env.sh" ]]; then
    say "no unpacked runtime in $DEST: stage every part first (gpu/vllm-acceptance.sh --stage-only)"
    exit 2
fi
# shellcheck source=gpu/runtime-env.sh
. "$ROOT/gpu/runtime-env.sh"
exec "$@"
