"""Small requests scored together: whatever arrived while the previous ones were scored, never waiting.

    request -> await Batcher.predict(served, events) -> its CTRs
               (queued; one callback on the event loop scores every queued request's events in one
                predict_events call per served model, and hands each request its slice)

A single-event request costs ~0.9 ms of one core on a 2-core machine, two thirds of it in scoring
(featurize, lookup, the network), and most of that is per call rather than per event: DCN's cross
weights (2 x 637 x 637 floats) stream through the cache once per call whatever the batch. So under
load the requests that queued up during one call are scored by the next one together; at low load
the queue holds one request and it is scored at once, as before. Nothing waits for a batch to fill.

Rows do not interact in a prediction, so a request's CTRs do not depend on what it was batched with
(beyond float rounding of a batched product: |diff| ~1e-9 on a CTR; tests/test_serving_batching.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np
from prometheus_client import Histogram

from serving.loader import ServedModel
from stream.records import Event

BATCHED = Histogram(
    "adstream_serving_batch_requests",
    "requests scored together in one call (requests that arrived while the previous call ran)",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
)

Score = Callable[[ServedModel, Sequence[Event]], np.ndarray]  # (model, events) -> CTR (n,)


class Batcher:
    """Queues requests on the event loop and scores each queue in one call per served model."""

    def __init__(self, score: Score) -> None:
        self.score = score
        self.queued: list[tuple[ServedModel, Sequence[Event], asyncio.Future[np.ndarray]]] = []

    async def predict(self, served: ServedModel, events: Sequence[Event]) -> np.ndarray:
        """The CTRs (n,) of `events` on `served`, scored with the other requests queued meanwhile."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        if not self.queued:  # the first of a batch: score once the requests ready now have queued
            loop.call_soon(self._score_queued)
        self.queued.append((served, events, future))
        return await future

    def _score_queued(self) -> None:
        queued, self.queued = self.queued, []
        BATCHED.observe(len(queued))
        by_model: dict[int, list[tuple[ServedModel, Sequence[Event], asyncio.Future[np.ndarray]]]] = {}
        for item in queued:  # a swap between two requests: each scored on the model it read
            by_model.setdefault(id(item[0]), []).append(item)
        for items in by_model.values():
            events = [event for _, request, _ in items for event in request]
            try:
                ctrs = self.score(items[0][0], events)
            except Exception as exc:  # each request's caller sees the error, as if scored alone
                for _, _, future in items:
                    if not future.done():
                        future.set_exception(exc)
                continue
            at = 0
            for _, request, future in items:
                if not future.done():  # (a caller that went away cancelled its future)
                    future.set_result(ctrs[at : at + len(request)])
                at += len(request)
