# syntax=docker/dockerfile:1
# splitserve worker on an NVIDIA GPU: torch 2.13 (CUDA 13 wheels), triton and flash-attn-4 (CuTe DSL).
# Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t splitserve/worker:0.1.0-cuda .
# Needs an NVIDIA driver that supports CUDA 13 (>= 580) and the NVIDIA container toolkit on the host.
# torch brings the CUDA user-space libraries as wheels, so the smallest CUDA base (driver hooks only)
# is enough. Pinned by tag; for a release pin its digest too (CUDA_IMAGE=nvidia/cuda:...@sha256:...).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
# apt versions follow the pinned base image's Ubuntu archive (exact pins break on security updates).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml constraints.txt deploy/docker/requirements.py deploy/docker/constraints-images.txt ./
# The gpu extra (torch, triton, flash-attn-4) plus flash-attn-4's CUDA 13 CuTe DSL libraries.
RUN python requirements.py pyproject.toml gpu > requirements.txt \
    && echo "flash-attn-4[cu13]" >> requirements.txt \
    && pip install -c constraints.txt -c constraints-images.txt -r requirements.txt setuptools
COPY README.md ./
COPY protos protos
COPY common common
COPY worker_svc worker_svc
COPY client client
RUN pip install --no-deps --no-build-isolation . \
    && python -c "import importlib.metadata as m, torch, triton, worker_svc.runtime.model_runner; m.version('flash-attn-4')"

FROM ${CUDA_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="splitserve-worker" \
      org.opencontainers.image.description="splitserve worker, CUDA 13 build with flash-attn-4" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# Triton (splitserve's kernels) builds its launcher with a C compiler against Python.h
# at run time, so the runtime image keeps gcc and the Python headers.
# apt versions follow the pinned base image's Ubuntu archive (exact pins break on security updates).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 splitserve \
    && useradd --system --uid 10001 --gid splitserve --create-home --home-dir /home/splitserve \
       --shell /usr/sbin/nologin splitserve \
    && install -d -o 10001 -g 10001 /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPLITSERVE_CACHE=/cache \
    SPLITSERVE_KERNEL_CACHE=/cache/kernels \
    SPLITSERVE_ADDRESS=127.0.0.1:50061 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/splitserve
# 50061: gRPC (splitserve.worker.v1.Worker, grpc.health.v1). 9091: Prometheus metrics (with --metrics-port 9091).
EXPOSE 50061 9091
# The port opens only after loading, warm-up (flash-attn-4 and Triton JIT) and CUDA graph capture.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["/bin/sh", "-c", "splitserve health --address \"$SPLITSERVE_ADDRESS\" --service splitserve.worker.v1.Worker --timeout 3 || exit 1"]
ENTRYPOINT ["splitserve-worker"]
CMD ["serve", "--model", "/models/model", "--device", "cuda", "--host", "0.0.0.0", "--port", "50061"]
