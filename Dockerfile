# One image for every adstream service (stream, joiner, trainer, serving, replay, MLflow).
# BASE: python:3.11-slim where a registry is reachable (`docker compose build`); `make images`
# builds it offline FROM adstream-base (Debian bookworm from debootstrap, docker/images.sh).
ARG BASE=python:3.11-slim
FROM ${BASE}
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /app
COPY requirements.lock ./
# PIP_WHEELS: `make images` mounts a folder holding every pinned wheel there (docker/images.sh) and
# installs offline from it; elsewhere (empty) pip fetches them from PyPI
ARG PIP_WHEELS=
RUN if [ -n "$PIP_WHEELS" ]; then pip install -q --no-index --find-links "$PIP_WHEELS" -r requirements.lock; \
    else pip install -q --no-cache-dir -r requirements.lock; fi
COPY common common
COPY stream stream
COPY store store
COPY trainer trainer
COPY serving serving
COPY adstream adstream
COPY bench bench
COPY pyproject.toml README.md ./
RUN pip install -q --no-cache-dir --no-deps -e .
COPY docker docker
ENTRYPOINT ["adstream", "--config", "/app/docker/adstream.toml"]
