# Sourced by the GPU scripts (gpu-suite.sh, device-run.sh, e2e-device.sh, perf-session.sh) from the repository
# root: the Python to use, the zerodiff package on PYTHONPATH, CUDA_HOME for DeepGEMM's JIT, and the wheel's
# FlashMLA / DeepGEMM unpacked from .carry/wheel-kernels.tar.gz (`make kernels-from-wheel`) when
# build/wheel-kernels is missing and ZD_SKIP_UNPACK is unset (a parent script already unpacked them). A carried
# DeepGEMM JIT cache (.carry/dgcache-h200.tar.gz: the kernels an earlier H200 run compiled, holding `dgcache/`)
# is unpacked to build/dgcache and used when DG_JIT_CACHE_DIR is not set: no NVCC time for what it holds.
# Triton's kernel cache likewise: TRITON_CACHE_DIR defaults to build/triton-cache, seeded from a carried
# .carry/triton-cache-h200*.tar.gz (one or more parts, written by `pack_triton_cache OUT` at the end of a run: build/triton_cache.py).
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ -z "${ZD_SKIP_UNPACK:-}" ] && [ ! -f build/wheel-kernels/vllm/__init__.py ] && [ -f .carry/wheel-kernels.tar.gz ]; then
  mkdir -p build && tar xzf .carry/wheel-kernels.tar.gz -C build
fi
if [ -z "${DG_JIT_CACHE_DIR:-}" ] && [ -f .carry/dgcache-h200.tar.gz ]; then
  [ -d build/dgcache ] || { mkdir -p build && tar xzf .carry/dgcache-h200.tar.gz -C build; }
  export DG_JIT_CACHE_DIR="$PWD/build/dgcache"
fi
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton-cache}
TC_PARTS=$(ls .carry/triton-cache-h200*.tar.gz 2>/dev/null)
if [ ! -d "$TRITON_CACHE_DIR" ] && [ -n "$TC_PARTS" ]; then
  $PY build/triton_cache.py unpack "$TRITON_CACHE_DIR" $TC_PARTS || true
fi
pack_triton_cache() {  # pack_triton_cache OUTDIR: the run's Triton cache for the next call (skipped if > 15 MiB)
  [ -d "$TRITON_CACHE_DIR" ] && $PY build/triton_cache.py pack "$TRITON_CACHE_DIR" "$1/triton-cache-h200.tar.gz" || true
}
