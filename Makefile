# zerodiff: `make` = the main job (sources, apply, check, summary, end-to-end check); `make test` = the tests.
# Versions and hashes come only from build/pins. Run `make help` for the targets.

include build/pins

VENV ?= .venv
PY := $(VENV)/bin/python
ZD := $(PY) -m zerodiff.cli
PYTEST_ARGS ?=
# the runtime build needs no torch, only a Python with pip: the venv's when it exists, else python3
BUILD_PY = $(if $(wildcard $(PY)),$(PY),python3)
VLLM_RUNTIME_ARGS ?=
# a user's own checkouts (forks) instead of the pinned trees; passed to the scripts through the environment
export VLLM_SRC MEGATRON_SRC VENV

.DEFAULT_GOAL := all
.PHONY: all help venv sources apply unapply check-patches summary e2e-check kernels-from-wheel doctor \
        vllm-runtime vllm-runtime-lock test test-gpu clean image image-check image-args

all: venv sources apply check-patches summary e2e-check ## the main job: venv, sources, apply, check-patches, summary, end-to-end check

help: ## list the targets
	@echo "zerodiff (vLLM $(VLLM_VERSION) @ $(VLLM_COMMIT), megatron-core $(MEGATRON_VERSION); pins in build/pins)"
	@echo
	@grep -hE '^[a-z-]+:.*## ' Makefile | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 28
	@echo
	@echo "  Variables: VLLM_SRC=/path/to/your/vllm MEGATRON_SRC=/path/to/your/megatron (use your fork, 3-way merge),"
	@echo "             VENV=.venv, TORCH_INDEX_URL=<extra pip index for the CPU torch wheel>, PYTEST_ARGS=...,"
	@echo "             DSV4=1 (vllm-runtime: also the DeepSeek-V4 set: TileLang, CuTeDSL, QuACK), VLLM_RUNTIME_ARGS=... (e.g. --part-mib 50)"
	@echo "             ARCH=sm_90a|sm_100a PLATFORM=amd64|arm64 IMAGE_TAG=... IMAGE_ENGINE=docker|podman (image targets)"

venv: ## create/refresh the virtual environment (.venv); instant when up to date
	@build/venv.sh

sources: venv ## fetch the pinned vLLM / megatron-core sdists (sha256-checked) into build/sources/* as git repos
	@$(PY) build/sources.py

apply: venv ## apply patches/{vllm,megatron}/series to the trees (idempotent; 3-way merge on VLLM_SRC/MEGATRON_SRC)
	@$(PY) build/patches.py apply

unapply: venv ## reverse the applied patches (last first)
	@$(PY) build/patches.py unapply

check-patches: venv ## each patch alone on the pristine tree, the series in order, reversal, patched Python compiles
	@$(PY) build/patches.py check

summary: venv ## what is patched: patch names per side and the files they touch
	@echo "=== zerodiff patch summary ==="
	@$(PY) build/patches.py summary

e2e-check: venv ## the end-to-end consistency check: `zerodiff check` on the default config for this hardware
	@echo "=== zerodiff check ==="
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(ZD) warmup --config h200 || echo "zerodiff warmup incomplete (see above): the check compiles what is missing"; fi
	@$(ZD) check

kernels-from-wheel: venv ## FlashMLA + DeepGEMM out of vLLM's pinned wheel into build/wheel-kernels (+ .carry tarball)
	@$(PY) build/wheel_kernels.py

vllm-runtime: ## patched vLLM + its missing wheels + zerodiff for an offline GPU box: xz parts <= 60 MiB in .carry/vllm-runtime/
	@$(BUILD_PY) build/vllm_runtime.py $(if $(DSV4),--with-dsv4) $(VLLM_RUNTIME_ARGS)

vllm-runtime-lock: ## re-resolve build/vllm-runtime.lock (the exact dependency wheels vllm-runtime carries; needs PyPI)
	@$(BUILD_PY) build/vllm_runtime.py --lock

# the Docker image (build/image.py; versions from build/pins): ARCH=sm_90a|sm_100a PLATFORM=amd64|arm64
ARCH ?= sm_90a
PLATFORM ?= amd64
IMAGE_TAG ?=
IMAGE_ENGINE ?=
IMAGE_OPTS = --arch $(ARCH) --platform $(PLATFORM) $(if $(IMAGE_ENGINE),--engine $(IMAGE_ENGINE))

image: ## build the Docker image for ARCH=sm_90a|sm_100a PLATFORM=amd64|arm64 (docker or podman; IMAGE_TAG=...)
	@$(BUILD_PY) build/image.py build $(IMAGE_OPTS) $(if $(IMAGE_TAG),--tag $(IMAGE_TAG))

image-check: ## in the built image, on every GPU: zerodiff doctor, gpu-suite --quick, zerodiff check, vllm-check
	@$(BUILD_PY) build/image.py check $(IMAGE_OPTS) $(if $(IMAGE_TAG),--tag $(IMAGE_TAG))

image-args: ## print the image's --build-arg lines, all from build/pins (ARCH=..., PLATFORM=...)
	@$(BUILD_PY) build/image.py args --arch $(ARCH) --platform $(PLATFORM)

doctor: venv ## what this machine can run (torch, Triton, CUDA, backends, pins)
	@$(ZD) doctor

test: venv ## the test suite (CPU; tests marked gpu run when CUDA is present, skip otherwise)
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

test-gpu: venv ## GPU tests only (needs CUDA; run `make kernels-from-wheel` first for DeepGEMM/FlashMLA)
	$(PY) -m pytest -q -m gpu tests $(PYTEST_ARGS)

clean: ## remove build outputs (unpacked sources, wheel kernels, vLLM runtime, carried files); keeps downloads and .venv
	rm -rf build/sources build/wheel-kernels .carry/wheel-kernels.tar.gz build/vllm-runtime .carry/vllm-runtime
