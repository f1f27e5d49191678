# syntax=docker/dockerfile:1
# splitserve scheduler: the public gRPC API (splitserve.v1.Generation), tokenizer, KV block accounting.
# CPU only: base dependencies, no torch. Build from the repository root:
#   docker build -f deploy/docker/scheduler.Dockerfile -t splitserve/scheduler:0.1.0 .
# The base image is pinned by tag; for a release pin its digest too (PYTHON_IMAGE=python:3.12.12-slim-trixie@sha256:...).
ARG PYTHON_IMAGE=python:3.12.12-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first, in their own layer: a source change does not reinstall them.
COPY pyproject.toml constraints.txt deploy/docker/requirements.py deploy/docker/constraints-images.txt ./
RUN python requirements.py pyproject.toml > requirements.txt \
    && pip install -c constraints.txt -c constraints-images.txt -r requirements.txt setuptools
COPY README.md ./
COPY protos protos
COPY common common
COPY scheduler_svc scheduler_svc
COPY client client
RUN pip install --no-deps --no-build-isolation . \
    && python -c "import scheduler_svc.server, client.cli" \
    && ! python -c "import torch" 2>/dev/null

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="splitserve-scheduler" \
      org.opencontainers.image.description="splitserve scheduler: public gRPC API, CPU only" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 splitserve \
    && useradd --system --uid 10001 --gid splitserve --create-home --home-dir /home/splitserve \
       --shell /usr/sbin/nologin splitserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPLITSERVE_ADDRESS=127.0.0.1:50051
USER 10001:10001
WORKDIR /home/splitserve
# 50051: gRPC (splitserve.v1.Generation, grpc.health.v1, reflection). 9090: Prometheus metrics (with --metrics-port 9090).
EXPOSE 50051 9090
# Readiness: SERVING once at least one worker is connected; NOT_SERVING while draining.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["/bin/sh", "-c", "splitserve health --address \"$SPLITSERVE_ADDRESS\" --service splitserve.v1.Generation --timeout 3 || exit 1"]
ENTRYPOINT ["splitserve-scheduler"]
CMD ["--help"]
