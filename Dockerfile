# syntax=docker/dockerfile:1
# The zerodiff image: one image for the RL rollout (patched vLLM) and for training (patched megatron-core), so both
# sides load the same kernel binaries (vLLM's wheel: FlashMLA, DeepGEMM, vLLM's ops; torch; Triton; DeepEP; zerodiff).
#
# Build it with `make image` (build/image.py build). Every ARG below comes from build/pins through build/image.py
# (`make image-args` prints them); none has a default, and the first RUN of each stage refuses an empty one, so a
# build that bypasses build/image.py stops at once instead of taking some other version.
#
# Stages: base (CUDA devel + the OS Python + torch / Triton / NVSHMEM / NCCL / cuda-bindings, held by a pip
# constraints file), deepep (DeepEP at its pinned commit, compiled for TORCH_CUDA_ARCH_LIST), image (the final one:
# vLLM and megatron-core from their sha256-pinned wheels, the zerodiff series laid over their installed Python,
# DeepEP, zerodiff, a smoke test and /opt/zerodiff/manifest.json).

ARG CUDA_IMAGE
ARG CUDA_IMAGE_TAG
ARG CUDA_IMAGE_SHA256

# ------------------------------------------------------------------------------------------------------ base
FROM ${CUDA_IMAGE}:${CUDA_IMAGE_TAG}@sha256:${CUDA_IMAGE_SHA256} AS base
ARG RUNTIME_PYTHON
ARG TORCH_IMAGE_VERSION
ARG TRITON_IMAGE_VERSION
ARG NVSHMEM_VERSION
ARG NCCL_VERSION
ARG CUDA_BINDINGS_IMAGE_VERSION
ARG SETUPTOOLS_IMAGE_VERSION
ARG TORCH_CUDA_ARCH_LIST
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/zerodiff/venv \
    PATH=/opt/zerodiff/venv/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    PIP_CONSTRAINT=/opt/zerodiff/constraints.txt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# The OS packages come from the Ubuntu archive of the pinned base image's release; the archive drops superseded
# package versions, so exact apt pins would break the build within weeks. What matters for the bits (CUDA, torch,
# Triton, the kernels) is pinned by the base digest and the pip pins.
# hadolint ignore=DL3008
RUN : "${RUNTIME_PYTHON:?}" "${TORCH_IMAGE_VERSION:?}" "${TRITON_IMAGE_VERSION:?}" "${NVSHMEM_VERSION:?}" \
      "${NCCL_VERSION:?}" "${CUDA_BINDINGS_IMAGE_VERSION:?}" "${SETUPTOOLS_IMAGE_VERSION:?}" "${TORCH_CUDA_ARCH_LIST:?}" \
    && apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${RUNTIME_PYTHON}" "python${RUNTIME_PYTHON}-venv" "python${RUNTIME_PYTHON}-dev" \
        build-essential ca-certificates git ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && "python${RUNTIME_PYTHON}" -m venv "${VIRTUAL_ENV}" \
    && printf '%s\n' "torch==${TORCH_IMAGE_VERSION}" "triton==${TRITON_IMAGE_VERSION}" \
        "nvidia-nvshmem-cu13==${NVSHMEM_VERSION}" "nvidia-nccl-cu13==${NCCL_VERSION}" \
        "cuda-bindings==${CUDA_BINDINGS_IMAGE_VERSION}" "setuptools==${SETUPTOOLS_IMAGE_VERSION}" > "${PIP_CONSTRAINT}" \
    && pip install --no-cache-dir "torch==${TORCH_IMAGE_VERSION}" "triton==${TRITON_IMAGE_VERSION}" \
        "nvidia-nvshmem-cu13==${NVSHMEM_VERSION}" "nvidia-nccl-cu13==${NCCL_VERSION}" \
        "cuda-bindings==${CUDA_BINDINGS_IMAGE_VERSION}" "setuptools==${SETUPTOOLS_IMAGE_VERSION}"

# ---------------------------------------------------------------------------------------------------- deepep
FROM base AS deepep
ARG DEEPEP_COMMIT
WORKDIR /src/DeepEP
# The exact commit (full id, checked after the fetch) and the submodule commits it records; build outputs are
# excluded from git status so DeepEP's version string keeps the commit; NVSHMEM and NCCL are found in their wheels.
RUN : "${DEEPEP_COMMIT:?}" \
    && git init -q . \
    && git remote add origin https://github.com/deepseek-ai/DeepEP.git \
    && git fetch -q --depth 1 origin "${DEEPEP_COMMIT}" \
    && git checkout -q FETCH_HEAD \
    && test "$(git rev-parse HEAD)" = "${DEEPEP_COMMIT}" \
    && git submodule update -q --init --recursive --depth 1 \
    && printf '%s\n' build/ dist/ '*.egg-info/' >> .git/info/exclude \
    && pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels . \
    && ls /wheels/deep_ep-*.whl

# ----------------------------------------------------------------------------------------------------- image
FROM base AS image
# ARGs are per stage: the ones base used are declared again where this stage needs them
ARG CUDA_IMAGE
ARG CUDA_IMAGE_TAG
ARG CUDA_IMAGE_SHA256
ARG RUNTIME_PYTHON
ARG TARGETARCH
ARG VLLM_VERSION
ARG VLLM_WHEEL
ARG VLLM_WHEEL_SHA256
ARG VLLM_WHEEL_ARM64
ARG VLLM_WHEEL_ARM64_SHA256
ARG MEGATRON_VERSION
ARG MEGATRON_WHEEL
ARG MEGATRON_WHEEL_SHA256
ARG MEGATRON_WHEEL_ARM64
ARG MEGATRON_WHEEL_ARM64_SHA256
ARG PYTEST_IMAGE_VERSION
# the base stage's shell (the image config carries it; said again so each stage reads on its own)
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# vLLM and megatron-core from PyPI as the exact wheels build/pins names for this platform, each sha256-checked
# before pip installs it (with vLLM's dependencies, inside the constraints that hold torch and Triton)
RUN : "${TARGETARCH:?}" "${RUNTIME_PYTHON:?}" "${VLLM_VERSION:?}" "${MEGATRON_VERSION:?}" "${PYTEST_IMAGE_VERSION:?}" \
    && case "${TARGETARCH}" in \
        amd64) vw="${VLLM_WHEEL:?}"; vs="${VLLM_WHEEL_SHA256:?}"; mw="${MEGATRON_WHEEL:?}"; ms="${MEGATRON_WHEEL_SHA256:?}" ;; \
        arm64) vw="${VLLM_WHEEL_ARM64:?}"; vs="${VLLM_WHEEL_ARM64_SHA256:?}"; \
               mw="${MEGATRON_WHEEL_ARM64:?}"; ms="${MEGATRON_WHEEL_ARM64_SHA256:?}" ;; \
        *) echo "zerodiff image: no pinned wheels for TARGETARCH=${TARGETARCH} (amd64, arm64)" >&2; exit 1 ;; \
       esac \
    && pip download --no-cache-dir --no-deps --only-binary :all: -d /tmp/wheels \
        "vllm==${VLLM_VERSION}" "megatron-core==${MEGATRON_VERSION}" \
    && for w in "${vw}" "${mw}"; do test -f "/tmp/wheels/${w}" \
        || { echo "zerodiff image: pip fetched $(ls /tmp/wheels), build/pins names ${w}" >&2; exit 1; }; done \
    && printf '%s  %s\n' "${vs}" "/tmp/wheels/${vw}" "${ms}" "/tmp/wheels/${mw}" | sha256sum --check --strict \
    && pip install --no-cache-dir "/tmp/wheels/${vw}" "/tmp/wheels/${mw}" "pytest==${PYTEST_IMAGE_VERSION}" \
    && rm -rf /tmp/wheels

COPY --from=deepep /wheels /tmp/deepep
RUN pip install --no-cache-dir --no-deps /tmp/deepep/deep_ep-*.whl && rm -rf /tmp/deepep

# zerodiff's checkout (what .dockerignore lets through: the package, the patches, build/, tests, benchmarks)
WORKDIR /opt/zerodiff/src
COPY . /opt/zerodiff/src

# The in-image patch step: the vLLM and megatron-core series laid over the installed Python tree (the wheels'
# compiled kernels stay as shipped), checked, and the patched packages byte-compiled. CI runs the same script on
# the pinned vLLM wheel (tests/test_image.py).
RUN python build/image_patch.py --site "${VIRTUAL_ENV}/lib/python${RUNTIME_PYTHON}/site-packages"

ARG ZERODIFF_COMMIT
ARG ZERODIFF_DIRTY
ARG ZERODIFF_ARCH
ENV ZERODIFF_PINS=/opt/zerodiff/src/build/pins \
    ZERODIFF_IMAGE_MANIFEST=/opt/zerodiff/manifest.json
LABEL org.opencontainers.image.title="zerodiff" \
      org.opencontainers.image.revision="${ZERODIFF_COMMIT}" \
      org.opencontainers.image.base.name="${CUDA_IMAGE}:${CUDA_IMAGE_TAG}" \
      org.opencontainers.image.base.digest="sha256:${CUDA_IMAGE_SHA256}"

# zerodiff itself (editable: the package is the checkout's, so the GPU suite and the CLI run the same files), then
# the smoke test and the manifest (which also refuses an installed version that is not the pinned one)
RUN : "${ZERODIFF_COMMIT:?}" "${ZERODIFF_DIRTY:?}" "${ZERODIFF_ARCH:?}" \
    && pip install --no-cache-dir --no-deps --no-build-isolation -e /opt/zerodiff/src \
    && zerodiff doctor \
    && ZERODIFF_CONSISTENT=1 python -c "import vllm, megatron.core" \
    && python build/image.py manifest --write "${ZERODIFF_IMAGE_MANIFEST}" \
        --commit "${ZERODIFF_COMMIT}" --dirty "${ZERODIFF_DIRTY}" --arch "${ZERODIFF_ARCH}"

CMD ["zerodiff", "doctor"]
