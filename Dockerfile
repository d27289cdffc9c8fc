# One image for every adstream service (stream, trainer, serving, replay).
FROM python:3.11-slim
WORKDIR /app
COPY requirements.lock pyproject.toml README.md ./
RUN pip install --no-cache-dir -r requirements.lock
COPY common common
COPY stream stream
COPY store store
COPY trainer trainer
COPY serving serving
COPY adstream adstream
COPY bench bench
RUN pip install --no-cache-dir --no-deps -e .
ENTRYPOINT ["adstream", "--config", "/app/docker/adstream.toml"]
COPY docker docker
