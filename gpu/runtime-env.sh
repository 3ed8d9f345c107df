# Sourced by the gpu/ scripts once the runtime is unpacked: puts the patched-vLLM runtime ($DEST, default
# /root/zd-rt), the carried extra wheels ($EXTRA), the working tree's patched vLLM files (.carry/vllm-overlay/)
# and this tree's zerodiff (kernels/) on the path, and the JIT caches (DeepGEMM, Triton, TileLang) in
# /root/zd-cache, so a later call on the same warm machine starts from what an earlier one compiled.
# Needs ROOT (the repository root) and `say`; DEST and EXTRA default as in vllm-acceptance.sh.
DEST="${DEST:-${ZD_RUNTIME:-/root/zd-rt}}"
EXTRA="${EXTRA:-${ZD_EXTRA:-/root/zd-extra}}"
# shellcheck disable=SC1091
. "$DEST/env.sh"
if [[ -f .carry/vllm-overlay/overlay.json ]]; then
    cp -r .carry/vllm-overlay/vllm "$DEST/site/"
    say "overlay: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(len(d["files"]), "patched files of", len(d["patches"]), "patches, series", d["series_sha256"][:12])' .carry/vllm-overlay/overlay.json)"
fi
if [[ -f "$EXTRA/.installed" ]]; then
    # PYTHONPATH folders do not run .pth files (CuTeDSL puts its packages on sys.path through one):
    # site.addsitedir runs them; whatever they add goes on PYTHONPATH too
    extra_paths="$(python3 -c 'import site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); print(":".join(p for p in sys.path if p not in before))' "$EXTRA")"
    export PYTHONPATH="${extra_paths:-$EXTRA}:${PYTHONPATH:-}"
    say "extra wheels on PYTHONPATH: ${extra_paths:-$EXTRA}"
fi
export PYTHONPATH="$ROOT/kernels:${PYTHONPATH:-}"
mkdir -p /root/zd-cache/deepgemm /root/zd-cache/triton /root/zd-cache/tilelang
export DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/root/zd-cache/deepgemm}" TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/root/zd-cache/triton}"
export TILELANG_CACHE_DIR="${TILELANG_CACHE_DIR:-/root/zd-cache/tilelang}"
export PYTHONUNBUFFERED=1
