"""bench/http_load.py's open loop against a real HTTP server (uvicorn in a thread): latencies count
from each request's scheduled time, a server's stall shows in the tail, a non-200 answer or a
refused connection is a failure, the model versions answered are read."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import uvicorn

from bench.http_load import open_loop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(answer):  # type: ignore[no-untyped-def]
    """A uvicorn server of one ASGI function in a thread: (url, stop)."""
    served = [0]

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        served[0] += 1
        status, body, delay = answer(served[0])
        if delay:
            await asyncio.sleep(delay)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}/predict", stop


def test_the_tail_shows_a_stalling_server_and_versions_are_read():
    def answer(i):  # every 20th request takes 30 ms; the version moves halfway
        version = "1" if i <= 100 else "2"
        return 200, b'{"model_version":"' + version.encode() + b'","predictions":[]}', 0.03 if i % 20 == 0 else 0

    url, stop = start_server(answer)
    try:
        load = open_loop(url, [b"{}"], rate=200, seconds=1.0)
    finally:
        stop()
    summary = load.summary()
    assert summary["sent"] == 200 and summary["failed"] == 0
    assert summary["p50_ms"] < 15 < 25 <= summary["max_ms"]  # the stalls are in the tail, not the median
    assert 0.04 <= float(np.mean(load.latencies_ms >= 25)) <= 0.2  # 10 of 200 (timers round to ms)
    assert load.versions == ("1", "2") and load.cpu_s > 0


def test_errors_and_a_closed_port_are_failures():
    url, stop = start_server(lambda i: (500 if i % 2 else 200, b"{}", 0))
    try:
        half = open_loop(url, [b"{}"], rate=100, seconds=0.5).summary()
    finally:
        stop()
    assert half["sent"] == 50 and half["failed"] == 25
    gone = open_loop(url, [b"{}"], rate=100, seconds=0.2, timeout_s=1).summary()
    assert gone["failed"] == gone["sent"] == 20
