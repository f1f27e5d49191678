# syntax=docker/dockerfile:1
# splitserve worker on a CPU (laptops, demos, CI-like runs): CPU torch from the PyTorch CPU index.
# Build from the repository root:
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t splitserve/worker:0.1.0-cpu .
# The base image is pinned by tag; for a release pin its digest too (PYTHON_IMAGE=python:3.12.12-slim-trixie@sha256:...).
ARG PYTHON_IMAGE=python:3.12.12-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN pip install --no-deps --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml constraints.txt deploy/docker/requirements.py deploy/docker/constraints-images.txt ./
# torch is already there (the +cpu build satisfies constraints.txt's torch==2.13.0); this adds its
# dependencies and the worker's from the default index.
RUN python requirements.py pyproject.toml worker > requirements.txt \
    && pip install -c constraints.txt -c constraints-images.txt -r requirements.txt setuptools
COPY README.md ./
COPY protos protos
COPY common common
COPY worker_svc worker_svc
COPY client client
RUN pip install --no-deps --no-build-isolation . \
    && python -c "import torch, worker_svc.runtime.model_runner; assert not torch.cuda.is_available()"

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="splitserve-worker" \
      org.opencontainers.image.description="splitserve worker, CPU build" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 splitserve \
    && useradd --system --uid 10001 --gid splitserve --create-home --home-dir /home/splitserve \
       --shell /usr/sbin/nologin splitserve \
    && install -d -o 10001 -g 10001 /cache
COPY --from=build /opt/venv /opt/venv
# /cache: where `--model PRESET` writes its checkpoint once (a named volume keeps it across restarts).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPLITSERVE_CACHE=/cache \
    SPLITSERVE_ADDRESS=127.0.0.1:50061
USER 10001:10001
WORKDIR /home/splitserve
VOLUME ["/cache"]
# 50061: gRPC (splitserve.worker.v1.Worker, grpc.health.v1). 9091: Prometheus metrics (with --metrics-port 9091).
EXPOSE 50061 9091
# The port opens only once the model is loaded; a first `--model PRESET` run writes the checkpoint first.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["/bin/sh", "-c", "splitserve health --address \"$SPLITSERVE_ADDRESS\" --service splitserve.worker.v1.Worker --timeout 3 || exit 1"]
ENTRYPOINT ["splitserve-worker"]
CMD ["serve", "--model", "qwen3-small", "--device", "cpu", "--host", "0.0.0.0", "--port", "50061"]
