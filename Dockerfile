# The default pipeline in a container (CPU). For a GPU image, build with --build-arg EXTRA=gpu
# on a CUDA base image.
FROM python:3.11-slim
ARG EXTRA=cpu
RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ git libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
RUN make setup EXTRA=${EXTRA}
CMD [".venv/bin/python", "-m", "pipeline", "run", "configs/full.yaml"]
