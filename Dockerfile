# pagewire: one image for the three services; the pod's args pick one of
#   block_service | gpu_runner | gateway        (ENTRYPOINT ["python", "-m"], default gateway)
#
# CPU (default), `make image`:
#   docker build -t pagewire:cpu .
# CUDA, `make image-cuda` (torch from PyPI brings its own CUDA libraries; the base adds Python):
#   docker build -t pagewire:cuda --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_SPEC=torch --build-arg TORCH_INDEX_URL= .
#
# The install steps are scripts/setup.sh, the script `make setup` runs, in its image mode:
# `pip install .` without the dev tools and without a model. The image holds no model: an
# initContainer of this image places the default one in a volume,
#   python -m common.model_store install-default /models/default
# and the services load it from there (their model option set to /models/default).
#
# The CPU kernel is built here, into TORCH_EXTENSIONS_DIR inside the image, for the portable
# target CPU_KERNEL_MARCH (x86-64-v3: AVX2 and FMA, any x86 server since 2013; on arm64 pass
# e.g. armv8.2-a, or `native` for an image that runs only on CPUs like the builder's). The
# services then load it without writing, so the pod can run with readOnlyRootFilesystem; it
# needs writable volumes at /cache (PAGEWIRE_CACHE_DIR, HOME) and /tmp.

ARG BASE=python:3.11-slim

# --- build: toolchain, venv, project, kernel ---------------------------------------------
FROM ${BASE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG CPU_KERNEL_MARCH=x86-64-v3
# A C++ toolchain for the kernel; Python, venv and headers where the base has none (CUDA).
RUN set -eux; \
    packages="build-essential"; \
    if ! command -v python3 >/dev/null; then packages="$packages python3 python3-venv python3-dev"; fi; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pagewire/src
COPY . .
ENV TORCH_EXTENSIONS_DIR=/opt/pagewire/torch_extensions \
    PAGEWIRE_CPU_KERNEL_MARCH=${CPU_KERNEL_MARCH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN PAGEWIRE_SETUP_MODE=image TORCH_SPEC="${TORCH_SPEC}" TORCH_INDEX_URL="${TORCH_INDEX_URL}" \
    bash scripts/setup.sh /opt/pagewire/venv

# --- runtime: the venv and the built kernel, no compiler, no source tree -------------------
FROM ${BASE}
ARG CPU_KERNEL_MARCH=x86-64-v3
# libgomp: the kernel's OpenMP runtime (build-essential brought it in the build stage).
RUN set -eux; \
    packages="libgomp1"; \
    if ! command -v python3 >/dev/null; then packages="$packages python3"; fi; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*; \
    groupadd --gid 10001 pagewire; \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /cache \
        --shell /usr/sbin/nologin pagewire
# Same paths as in the build stage: the venv's scripts and the kernel's name refer to them.
COPY --from=build /opt/pagewire/venv /opt/pagewire/venv
COPY --from=build /opt/pagewire/torch_extensions /opt/pagewire/torch_extensions
WORKDIR /opt/pagewire
ENV PATH=/opt/pagewire/venv/bin:${PATH} \
    VIRTUAL_ENV=/opt/pagewire/venv \
    PAGEWIRE_CACHE_DIR=/cache \
    HOME=/cache \
    HF_HOME=/cache/huggingface \
    TORCH_EXTENSIONS_DIR=/opt/pagewire/torch_extensions \
    PAGEWIRE_CPU_KERNEL_MARCH=${CPU_KERNEL_MARCH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
ENTRYPOINT ["python", "-m"]
CMD ["gateway"]
