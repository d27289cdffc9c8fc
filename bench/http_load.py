"""An open-loop HTTP/1.1 load generator light enough to share a small machine with the server it measures.

Each request leaves at its scheduled time whatever the earlier ones do, on an idle keep-alive
connection or a new one, and its latency counts from that scheduled time, so a server that stalls
is charged for the queue it builds (no coordinated omission). Requests are prepared bytes and
responses are read by Content-Length on raw asyncio protocols over uvloop: ~40 us of the
generator's CPU a request, where aiohttp's client took ~300 us, which on a 2-core machine was a
third of a core at 1,000 req/s taken from the server under test.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np


@dataclass(frozen=True)
class Load:
    """What an open-loop run measured."""

    latencies_ms: np.ndarray  # (sent,) from each request's scheduled time to its response; NaN if it failed
    seconds: float  # wall time of the run
    versions: tuple[str, ...]  # model versions answered ("model_version" of a JSON body), in the order first seen
    cpu_s: float = 0.0  # the generator's own CPU time during the run

    def summary(self) -> dict[str, Any]:
        ok = self.latencies_ms[~np.isnan(self.latencies_ms)]
        pick = (lambda q: float(np.percentile(ok, q))) if len(ok) else (lambda q: float("nan"))
        return {
            "sent": len(self.latencies_ms),
            "failed": int(np.isnan(self.latencies_ms).sum()),
            "requests_per_s": len(self.latencies_ms) / self.seconds if self.seconds else 0.0,
            "p50_ms": pick(50),
            "p99_ms": pick(99),
            "max_ms": float(ok.max()) if len(ok) else float("nan"),
            "generator_cpu_us_per_request": 1e6 * self.cpu_s / max(len(self.latencies_ms), 1),
            # the latency CDF: percentile -> ms (bench/plots.py draws it)
            "cdf_ms": {f"{q:g}": pick(q) for q in (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.5, 99.9, 100)},
        }


def open_loop(url: str, bodies: list[bytes], rate: float, seconds: float, timeout_s: float = 5.0) -> Load:
    """POST bodies[i % len(bodies)] to `url` at `rate` requests/s for `seconds`. The generator's
    own garbage collector is off meanwhile (its pauses would be charged to the server)."""
    import uvloop

    gc.collect()
    gc.disable()
    cpu = time.process_time()
    try:
        load = uvloop.run(_open_loop(url, bodies, rate, seconds, timeout_s))
    finally:
        gc.enable()
    return Load(load.latencies_ms, load.seconds, load.versions, time.process_time() - cpu)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request in flight at a time, its answer (status, body) a future."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.waiting: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.waiting = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiting

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiting is None:
            return
        head = self.buffer[:end].lower()
        at = head.find(b"content-length:")
        if at < 0:  # this generator reads Content-Length bodies only: the request fails
            self.waiting.set_exception(ConnectionError("a response without Content-Length"))
            self.close()
            return
        length = int(head[at + 15 : head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
        if len(self.buffer) < end + 4 + length:
            return
        status = int(head[9:12])
        body, self.buffer = self.buffer[end + 4 : end + 4 + length], self.buffer[end + 4 + length :]
        waiting, self.waiting = self.waiting, None
        if not waiting.done():
            waiting.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_exception(exc or ConnectionError("closed by the server"))
        self.transport = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _version(body: bytes) -> str | None:
    """The "model_version" of an adstream /predict answer (its first key), without parsing the rest."""
    prefix = b'{"model_version":"'
    if not body.startswith(prefix):
        return None
    end = body.find(b'"', len(prefix))
    return body[len(prefix) : end].decode() if end > 0 else None


async def _open_loop(url: str, bodies: list[bytes], rate: float, seconds: float, timeout_s: float) -> Load:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    requests = [f"{head}Content-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies]
    loop = asyncio.get_running_loop()
    idle: deque[_Connection] = deque()
    n = int(rate * seconds)
    latencies = np.full(n, np.nan)
    versions: dict[str, None] = {}
    start = time.perf_counter() + 0.05  # not loop.time(): uvloop's clock ticks in whole ms

    async def one(i: int) -> None:
        # from the scheduled time, or from now when the loop's sleep woke a little early (uvloop's
        # timers tick in whole ms): a late send is charged to the server, an early one is not a gift
        scheduled = max(start + i / rate, time.perf_counter())
        reused = idle.pop() if idle else None
        connection = reused if reused is not None and reused.transport is not None else _Connection()
        try:
            if connection is not reused:
                await asyncio.wait_for(loop.create_connection(lambda: connection, host, port), timeout_s)
            status, body = await asyncio.wait_for(connection.send(requests[i % len(requests)]), timeout_s)
        except (OSError, TimeoutError, ConnectionError):
            connection.close()
            return
        idle.append(connection)
        if status != 200:
            return
        latencies[i] = (time.perf_counter() - scheduled) * 1000
        version = _version(body)
        if version is not None and version not in versions:
            versions[version] = None

    tasks = []
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    taken = time.perf_counter() - start
    for connection in idle:
        connection.close()
    return Load(latencies, taken, tuple(versions))
