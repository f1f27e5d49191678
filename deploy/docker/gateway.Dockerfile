# syntax=docker/dockerfile:1
# splitserve gateway: the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
# /health) in front of a scheduler. CPU only, stateless, no model and no torch: scale it on its own.
# Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t splitserve/gateway:0.1.0 .
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
RUN python requirements.py pyproject.toml gateway > requirements.txt \
    && pip install -c constraints.txt -c constraints-images.txt -r requirements.txt setuptools
COPY README.md ./
COPY protos protos
COPY common common
COPY client client
COPY gateway gateway
RUN pip install --no-deps --no-build-isolation . \
    && python -c "import gateway.app, gateway.cli" \
    && ! python -c "import torch" 2>/dev/null

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="splitserve-gateway" \
      org.opencontainers.image.description="splitserve OpenAI-compatible HTTP gateway, CPU only" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 splitserve \
    && useradd --system --uid 10001 --gid splitserve --create-home --home-dir /home/splitserve \
       --shell /usr/sbin/nologin splitserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPLITSERVE_HEALTH_URL=http://127.0.0.1:8000/health
USER 10001:10001
WORKDIR /home/splitserve
# 8000: HTTP (the OpenAI API and /health).
EXPOSE 8000
# Ready: the scheduler behind it answers SERVING (a worker is connected); 503 otherwise.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["/bin/sh", "-c", "python -c \"import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3)\" \"$SPLITSERVE_HEALTH_URL\" || exit 1"]
ENTRYPOINT ["splitserve-gateway"]
# It needs --scheduler HOST:PORT (and --host 0.0.0.0 to be reachable from outside the container).
CMD ["--help"]
