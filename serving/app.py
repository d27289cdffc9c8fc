"""The HTTP service (FastAPI). Routes are thin: validation -> predict.predict_events -> JSON.

POST /predict  one event object or a list of them (the Kafka JSON, label absent)
               -> {"model_version", "schema_hash", "predictions": [{"event_id", "ctr"}]}
               422 names the field: {"detail": [{"loc": ["body", index, field], "msg", "type"}]}
GET /healthz   liveness (200 while the process runs)
GET /model     the served version, schema hash, step, metrics (503 before the first model)
GET /metrics   Prometheus (requests, latency, swaps, and the served model's progressive AUC,
               logloss and calibration: ECE, predicted vs observed CTR)

A background task polls the registry and swaps a newer version in with one reference
assignment, so requests in flight finish on the model they started with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from serving.loader import ServedModel, load_served_model
from serving.predict import predict_events
from serving.registry import download, resolve
from serving.settings import ServingSettings
from stream.decode import event_from_mapping
from stream.errors import DecodeError
from stream.schema import Schema

log = logging.getLogger("adstream.serving")
REQUESTS = Counter("adstream_serving_requests_total", "prediction requests", ["status"])
LATENCY = Histogram(
    "adstream_serving_predict_seconds", "time in /predict", buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
)
SWAPS = Counter("adstream_serving_model_swaps_total", "models swapped in")
REFUSED = Counter(
    "adstream_serving_refused_total",
    "publications refused (unreadable, another schema, a bad config): the last model stays",
)
MODEL_METRICS = Gauge(
    "adstream_serving_model_metric",
    "the served snapshot's progressive metrics as its trainer measured them (auc, logloss, ece, mean_ctr...)",
    ["metric"],
)

# fetch(current_version) -> a newer ServedModel, or None when there is nothing newer
Fetch = Callable[[str | None], ServedModel | None]


class ModelHolder:
    """The served model; replaced by reference, never mutated."""

    def __init__(self) -> None:
        self.current: ServedModel | None = None
        self.last_error: str | None = None


def registry_fetch(tracking_uri: str, model_name: str, settings: ServingSettings, schema: Schema) -> Fetch:
    refused: set[str] = set()  # versions that failed to load: not downloaded again at every poll

    def fetch(current: str | None) -> ServedModel | None:
        ref = resolve(tracking_uri, model_name, settings.alias)
        if ref is None or ref.version == current or ref.version in refused:
            return None
        try:
            path = download(tracking_uri, ref, settings.cache_dir)
            return load_served_model(path, ref.version, schema)
        except Exception:
            refused.add(ref.version)
            raise

    return fetch


def create_app(settings: ServingSettings, schema: Schema, fetch: Fetch) -> FastAPI:
    holder = ModelHolder()

    async def refresh() -> None:
        try:
            model = await asyncio.to_thread(fetch, holder.current.version if holder.current else None)
        except Exception as exc:  # a bad publication or a registry hiccup must not kill the server
            holder.last_error = str(exc)
            REFUSED.inc()
            version = holder.current.version if holder.current else None
            log.error("model refresh failed, still serving version %s: %s", version, exc)
            return
        if model is not None:
            holder.current = model  # the swap: one reference assignment
            holder.last_error = None
            SWAPS.inc()
            for name, value in model.manifest.metrics.items():
                MODEL_METRICS.labels(name).set(value)
            log.info("serving version %s (step %d)", model.version, model.manifest.step)

    async def poll() -> None:
        while True:
            await asyncio.sleep(settings.poll_s)
            await refresh()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        torch.set_num_threads(settings.threads)
        await refresh()
        task = asyncio.create_task(poll())
        yield
        task.cancel()

    app = FastAPI(title="adstream serving", lifespan=lifespan)
    app.state.holder = holder

    def get_holder() -> ModelHolder:
        return holder

    app.state.get_holder = get_holder

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "model_loaded": holder.current is not None}

    @app.get("/model")
    def model_info(h: ModelHolder = Depends(get_holder)) -> Response:
        if h.current is None:
            return JSONResponse({"detail": "no model loaded yet", "last_error": h.last_error}, status_code=503)
        m = h.current.manifest
        return JSONResponse(
            {
                "model_version": h.current.version,
                "schema_hash": m.schema_hash,
                "schema_name": m.schema_name,
                "step": m.step,
                "events": m.events,
                "metrics": m.metrics,
                "offsets": m.offsets,
                "kind": m.kind,
                "newest_event_ms": m.newest_event_ms,  # the newest event time the served model learned
                "last_error": h.last_error,  # the last refused publication, if any
            }
        )

    @app.post("/predict")
    async def predict(request: Request, h: ModelHolder = Depends(get_holder)) -> Response:
        body = await request.body()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            REQUESTS.labels("422").inc()
            return _unprocessable([("body",)], f"request body is not valid JSON ({exc})")
        items = payload if isinstance(payload, list) else [payload]
        if not items or len(items) > settings.max_events:
            REQUESTS.labels("422").inc()
            return _unprocessable([("body",)], f"send 1 to {settings.max_events} events, got {len(items)}")
        events, errors = [], []
        for index, item in enumerate(items):
            try:
                events.append(event_from_mapping(item, schema, require_label=False))
            except DecodeError as exc:
                loc = ("body", index, exc.field) if isinstance(payload, list) else ("body", exc.field)
                errors.append((loc, exc.reason))
        if errors:
            REQUESTS.labels("422").inc()
            return JSONResponse(
                {
                    "detail": [
                        {"loc": [x for x in loc if x != ""], "msg": msg, "type": "value_error"} for loc, msg in errors
                    ]
                },
                status_code=422,
            )
        served = h.current  # read once: a swap during this request does not affect it
        if served is None:
            REQUESTS.labels("503").inc()
            return JSONResponse({"detail": "no model loaded yet; is a trainer publishing?"}, status_code=503)
        with LATENCY.time():
            ctrs = await asyncio.to_thread(predict_events, served, events, schema)
        REQUESTS.labels("200").inc()
        return Response(
            orjson.dumps(
                {
                    "model_version": served.version,
                    "schema_hash": served.manifest.schema_hash,
                    "predictions": [{"event_id": e.event_id, "ctr": float(c)} for e, c in zip(events, ctrs)],
                }
            ),
            media_type="application/json",
        )

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def _unprocessable(locs: list[tuple[Any, ...]], msg: str) -> JSONResponse:
    return JSONResponse(
        {"detail": [{"loc": list(loc), "msg": msg, "type": "value_error"} for loc in locs]}, status_code=422
    )
