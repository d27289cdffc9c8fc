"""`adstream serve`: one server (`run_server`), or `serving.workers` processes answering on one port:
more cores for /predict, one table in RAM.

    adstream serve (this supervisor) --binds host:port--> N spawned workers, each one uvicorn
    server on the shared listening socket (the kernel hands each new connection to one of them)

Each worker is the whole server of serving/app.py: it follows the registry itself and loads what
it serves from the shared download cache, where a base's rows are mapped copy-on-write
(serving/loader.py's shared_rows), so N workers hold one copy of the table in the page cache and
answer the same CTRs. Prometheus counters and histograms are summed over the workers
(prometheus_client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR); the served model's gauges are
the most recently set. A worker that dies is started again; SIGTERM or SIGINT stops them all.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from serving.settings import ServingSettings
from stream.kafka.settings import KafkaSettings
from stream.schema import Schema

RESTART_PAUSE_S = 1.0  # between a worker's death and its replacement (a crash loop stays slow)


def run_server(
    settings: ServingSettings, schema: Schema, tracking_uri: str, model_name: str, kafka: KafkaSettings
) -> None:
    """Serve the registry's `model_name` (behind settings.alias) in the foreground until SIGINT/SIGTERM."""
    import uvicorn

    print(
        f"serving: http://{settings.host}:{settings.port} (POST /predict, GET /schema, GET /model); "
        f"model '{model_name}' alias '{settings.alias}' from {tracking_uri}; {settings.workers} worker(s); "
        "waiting for its first version",
        flush=True,
    )
    if settings.workers > 1:
        return serve_workers(settings, schema, tracking_uri, model_name, kafka)
    from serving.app import create_app, registry_fetch

    fetch = registry_fetch(tracking_uri, model_name, settings, schema)
    app = create_app(settings, schema, fetch, kafka)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")


def serve_workers(
    settings: ServingSettings, schema: Schema, tracking_uri: str, model_name: str, kafka: KafkaSettings
) -> None:
    """Run settings.workers servers on settings.host:port until SIGTERM or SIGINT."""
    listener = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((settings.host, settings.port))
    listener.listen(2048)
    Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)
    metrics_dir = tempfile.mkdtemp(prefix="prometheus-", dir=settings.cache_dir)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each worker's prometheus_client import
    context = multiprocessing.get_context("spawn")
    args = (listener, settings, schema, tracking_uri, model_name, kafka)
    workers = [context.Process(target=_worker_main, args=args, name=f"serve-{i}") for i in range(settings.workers)]
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for worker in workers:
            worker.start()
        while not stopping:
            time.sleep(0.2)
            for i, worker in enumerate(workers):
                if not worker.is_alive() and not stopping:
                    print(f"serving: worker {i} exited ({worker.exitcode}); starting it again", flush=True)
                    time.sleep(RESTART_PAUSE_S)
                    _forget(metrics_dir, worker.pid)
                    workers[i] = context.Process(target=_worker_main, args=args, name=f"serve-{i}")
                    workers[i].start()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
        for worker in workers:
            worker.join(30)
        listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _forget(metrics_dir: str, pid: int | None) -> None:
    """A dead worker's live gauges leave the sums (its counters stay counted)."""
    if pid is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, metrics_dir)


def _worker_main(
    listener: socket.socket,
    settings: ServingSettings,
    schema: Schema,
    tracking_uri: str,
    model_name: str,
    kafka: KafkaSettings,
) -> None:
    import uvicorn

    from serving.app import create_app, registry_fetch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops the workers (SIGTERM)
    app = create_app(settings, schema, registry_fetch(tracking_uri, model_name, settings, schema), kafka)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[listener])
