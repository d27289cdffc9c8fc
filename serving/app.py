"""The HTTP service (FastAPI). Routes are thin: validation -> predict.predict_events -> JSON.

POST /predict  one event object or a list of them (the Kafka JSON, label absent)
               -> {"model_version", "schema_hash", "predictions": [{"event_id", "ctr"}]}
               422 names the field: {"detail": [{"loc": ["body", index, field], "msg", "type"}]}
               with serving.log_impressions, each scored event is logged as an impression on the
               joiner's topic (serving/impressions.py); "shown": false (or ?shown=false) holds it
               until POST /shown names it
POST /shown    one or many {"impression_id", "propensity"?}: candidates really shown -> impressions
               -> {"shown": n, "unknown": [ids not held: never scored here, expired, already shown]}
POST /click    one or many {"impression_id", "ts"?}: clicks onto the joiner's clicks topic -> {"clicks": n}
GET /healthz   liveness (200 while the process runs)
               (with serving.token set, /predict and /model need "Authorization: Bearer <token>": 401,
               and /docs, /openapi.json are off; a body over serving.max_body_bytes: 413)
GET /model     the served version, its base step and last delta, the newest event time it
               learned, schema hash, step, metrics (503 before the first model)
GET /metrics   Prometheus (requests, latency, swaps, and the served model's progressive AUC,
               logloss and calibration: ECE, predicted vs observed CTR)

A background task polls the registry (serving/follow.py says what comes next): a newer version is
loaded whole and swapped in with one reference assignment, so requests in flight finish on the model
they started with; deltas of the served version are applied in place (serving/loader.py) and the
model is swapped for the one with their dense weights. Request bodies are parsed by
serving/request.py.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import threadpoolctl
import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import Receive, Scope, Send

from serving.batching import Batcher
from serving.errors import ServingError
from serving.follow import Follower
from serving.impressions import PendingShows, ServedAs, impression_record, with_propensity
from serving.loader import ServedModel, apply_delta, load_served_model
from serving.predict import predict_events
from serving.registry import MlflowRegistry
from serving.request import Refusal, Scoring, parse_clicks, parse_predict_body, parse_shown
from serving.settings import ServingSettings
from stream.featurizer.decode import event_from_mapping
from stream.formats.clicks import click_record
from stream.kafka.settings import KafkaSettings
from stream.schema import Schema

log = logging.getLogger("adstream.serving")
TOKEN_DETAIL = "missing or wrong bearer token: send 'Authorization: Bearer <serving.token>'"
SWITCH_INTERVAL_S = 0.0005  # the longest a background thread holds the GIL while requests wait
INLINE_EVENTS = 8  # requests of at most this many events are scored on the event loop itself
REQUESTS = Counter("adstream_serving_requests_total", "prediction requests", ["status"])
LATENCY = Histogram(
    "adstream_serving_predict_seconds", "time in /predict", buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
)
SWAPS = Counter("adstream_serving_model_swaps_total", "models swapped in (a new base, or deltas applied)")
DELTAS = Counter("adstream_serving_deltas_applied_total", "delta publications applied in place")
REFUSED = Counter(
    "adstream_serving_refused_total",
    "publications refused (unreadable, another schema, a bad config): the last model stays",
)
MODEL_METRICS = Gauge(
    "adstream_serving_model_metric",
    "the served snapshot's progressive metrics as its trainer measured them (auc, logloss, ece, mean_ctr...)",
    ["metric"],
    multiprocess_mode="mostrecent",  # with workers (serving/workers.py): the newest value any of them set
)
SERVED = Gauge(
    "adstream_serving_model",
    "the served model: version (its registry number), step, base_step, sequence (deltas applied), "
    "newest_event_seconds (the newest event time it learned, unix seconds)",
    ["field"],
    multiprocess_mode="mostrecent",
)
SHOWN = Counter(
    "adstream_serving_shown_total",
    "POST /shown ids: shown (logged as impressions) or unknown (never scored here, expired, already shown)",
    ["outcome"],
)
CLICKS = Counter("adstream_serving_clicks_total", "clicks taken by POST /click (sent to the clicks topic)")
MODEL_AGE = Gauge(
    "adstream_serving_model_age_seconds",
    "wall-clock time now minus the newest event time the served model learned (its freshness); -1 before a model",
    multiprocess_mode="mostrecent",  # set when /metrics is read
)


def _metrics_registry() -> CollectorRegistry:
    """What /metrics shows: this process's metrics, or with workers (PROMETHEUS_MULTIPROC_DIR set)
    every worker's, summed."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def served_fields(model: ServedModel) -> dict[str, float]:
    """What the adstream_serving_model gauge says of a served model (a non-numeric version: -1)."""
    m = model.manifest
    return {
        "version": float(model.version) if model.version.isdigit() else -1.0,
        "step": m.step,
        "base_step": m.base_step,
        "sequence": m.sequence,
        "newest_event_seconds": m.newest_event_ms / 1000,
    }


def _age_s(model: ServedModel | None) -> float:
    return time.time() - model.manifest.newest_event_ms / 1000 if model is not None else -1.0


# fetch(current) -> the model to serve next (a newer base, or current with newer deltas applied),
# or None when there is nothing newer; raises when a publication is refused
Fetch = Callable[[ServedModel | None], ServedModel | None]


class ModelHolder:
    """The served model; replaced by reference (deltas write rows into its tier in place)."""

    def __init__(self) -> None:
        self.current: ServedModel | None = None
        self.last_error: str | None = None

    def swap(self, model: ServedModel) -> None:
        """Serve `model` from now on (one reference assignment: requests in flight keep theirs),
        and say so: the swap and delta counters, the served model's gauges, one line per version."""
        before = self.current
        self.current = model
        self.last_error = None
        SWAPS.inc()
        applied_before = before.sequence if before is not None and before.version == model.version else 0
        DELTAS.inc(model.sequence - applied_before)
        for name, value in model.manifest.metrics.items():
            MODEL_METRICS.labels(name).set(value)
        for name, value in served_fields(model).items():
            SERVED.labels(name).set(value)
        if before is None or before.version != model.version:  # the operator sees what is served
            m = model.manifest
            print(
                f"serving: now serving version {model.version} (step {m.step}, schema {m.schema_name} {m.schema_hash})",
                flush=True,
            )

    def refuse(self, exc: Exception) -> None:
        """A publication refused (or the registry away): the model stays; logged and counted."""
        self.last_error = str(exc)
        REFUSED.inc()
        version = self.current.version if self.current else None
        log.error("model refresh failed, still serving version %s: %s", version, exc)

    def info(self) -> dict[str, Any]:
        """What GET /model says of the served model (it must be loaded)."""
        assert self.current is not None
        m = self.current.manifest
        return {
            "model_version": self.current.version,
            "schema_hash": m.schema_hash,
            "schema_name": m.schema_name,
            "step": m.step,
            "events": m.events,
            # a metric not measured yet is NaN (no final label yet, one class only): JSON has no NaN, so null
            "metrics": {k: (v if math.isfinite(v) else None) for k, v in m.metrics.items()},
            "offsets": m.offsets,
            "kind": m.kind,
            "family": m.model.get("kind"),  # the model family served (trainer.model.kind)
            "champion": m.extra.get("champion", "default"),  # the trainer's member it comes from (trainer.challengers)
            "newest_event_ms": m.newest_event_ms,  # the newest event time the served model learned
            "base_step": m.base_step,  # the step of the base publication served
            "sequence": m.sequence,  # the last delta applied after that base (0: the base alone)
            "last_error": self.last_error,  # the last refused publication, if any
        }


def registry_fetch(tracking_uri: str, model_name: str, settings: ServingSettings, schema: Schema) -> Fetch:
    """serving/follow.py's Follower over the MLflow registry: bases loaded from the download
    cache, the oldest of them closed and deleted once two newer ones are loaded."""

    def load(base_dir: Path, version: str) -> ServedModel:
        # RocksDB allows one writer a folder: each worker (serving/workers.py) loads its own
        rocksdb = base_dir / f"rocksdb-{os.getpid()}" if settings.store == "rocksdb" else None
        return load_served_model(base_dir, version, schema, rocksdb, settings.disk_bytes)

    def drop(old: ServedModel) -> None:
        old.table.tier.close()
        if old.folder is not None:
            shutil.rmtree(old.folder, ignore_errors=True)

    if not settings.alias:
        raise ServingError(
            "config serving.alias is empty: set it, or build the settings with adstream.config (mlflow.alias)"
        )
    registry = MlflowRegistry(tracking_uri, model_name, settings.alias, settings.cache_dir)
    return Follower(registry, load, apply_delta, drop)


class ImpressionLog:
    """The loop's side of serving (serving.log_impressions): scored events out as impressions,
    candidates held for POST /shown, clicks out; all through one KafkaOutbox (serving/outbox.py)."""

    def __init__(self, settings: ServingSettings, kafka: KafkaSettings, schema: Schema) -> None:
        from serving.outbox import KafkaOutbox

        self.kafka, self.label = kafka, schema.label
        self.outbox = KafkaOutbox(kafka.bootstrap, settings.log_queue, kafka.max_message_bytes)
        self.pending = PendingShows(settings.max_pending, round(settings.shown_wait_s * 1000))
        self.saved = Path(settings.cache_dir) / f"pending-{settings.port}"  # held candidates across a restart

    def scored(self, served: ServedModel, scoring: Scoring, ctrs: list[float], now_ms: int) -> None:
        how = ServedAs(served.version, served.manifest.step, served.manifest.sequence)
        for item, shown, ctr, event in zip(scoring.items, scoring.shown, ctrs, scoring.events):
            record = impression_record(item, self.label, how, ctr, now_ms)
            if shown:
                self.outbox.send(self.kafka.impressions_topic, event.event_id, record)
            else:
                self.pending.hold(event.event_id, record, now_ms)

    def shown(self, ids: list[tuple[str, float | None]], now_ms: int) -> list[str]:
        """Log the held candidates named; returns the ids not held."""
        unknown = []
        for impression_id, propensity in ids:
            record = self.pending.take(impression_id, now_ms)
            if record is None:
                unknown.append(impression_id)
                continue
            if propensity is not None:
                record = with_propensity(record, propensity)
            self.outbox.send(self.kafka.impressions_topic, impression_id, record)
        SHOWN.labels("shown").inc(len(ids) - len(unknown))
        SHOWN.labels("unknown").inc(len(unknown))
        return unknown

    def clicked(self, clicks: list[tuple[str, int]]) -> None:
        for impression_id, ts in clicks:
            self.outbox.send(self.kafka.clicks_topic, impression_id, click_record(impression_id, ts))
        CLICKS.inc(len(clicks))

    def info(self) -> dict[str, Any]:
        """What /model and `adstream status` say of the log."""
        return {**self.outbox.stats(), "pending_shown": len(self.pending), "expired_unshown": self.pending.expired}

    def restore(self, now_ms: int) -> None:
        """Take back the candidates a stopped server held (every worker's: one claims each file)."""
        for path in self.saved.parent.glob(f"{self.saved.name}-*.jsonl"):
            mine = path.with_suffix(f".{os.getpid()}.claimed")
            try:
                path.rename(mine)
            except OSError:  # another worker took it
                continue
            for line in mine.read_bytes().splitlines():
                impression_id, deadline, record = orjson.loads(line)
                self.pending.hold(impression_id, record.encode(), now_ms, deadline)
            mine.unlink()

    def close(self, flush_s: float) -> None:
        """SIGTERM: deliver what waits for Kafka, keep the held candidates for the next start."""
        held = self.pending.items()
        if held:
            self.saved.parent.mkdir(parents=True, exist_ok=True)
            lines = [orjson.dumps([i, deadline, record.decode()]) for i, deadline, record in held]
            path = self.saved.parent / f"{self.saved.name}-{os.getpid()}.jsonl"
            path.write_bytes(b"\n".join(lines))
        self.outbox.close(flush_s)


def create_app(
    settings: ServingSettings, schema: Schema, fetch: Fetch, kafka: KafkaSettings | None = None
) -> PredictLane:
    """The server; with settings.log_impressions, `kafka` says where impressions and clicks go."""
    holder = ModelHolder()
    token = settings.token or os.environ.get("ADSTREAM_SERVING_TOKEN", "")
    if settings.log_impressions and kafka is None:
        raise ServingError("serving.log_impressions is on but no [kafka] settings were given to the server")
    loop: list[ImpressionLog] = []  # the log, made at startup (each worker its own producer)

    def bearer_ok(authorization: str) -> bool:
        """No token set, or the Authorization header carries it (compared in constant time)."""
        return not token or hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())

    # the dependencies are `async def`: FastAPI runs a plain `def` dependency on its thread pool,
    # two thread hops per request that cost more than the prediction itself
    async def authorized(request: Request) -> None:
        """With a token set: 401 unless the request carries it (compared in constant time)."""
        if not bearer_ok(request.headers.get("authorization", "")):
            REQUESTS.labels("401").inc()
            raise HTTPException(
                status_code=401,
                detail=TOKEN_DETAIL,
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def refresh() -> None:
        try:
            model = await asyncio.to_thread(fetch, holder.current)
            if model is not None:  # warmed beside the served one: the first request on it is no slower
                await asyncio.to_thread(warm, model)
        except Exception as exc:  # a bad publication or a registry hiccup must not kill the server
            holder.refuse(exc)
            return
        if model is not None:
            holder.swap(model)

    example = [event_from_mapping(schema.request_example(), schema, require_label=False)]

    def warm(model: ServedModel) -> None:
        """Score the schema's example event on a model about to be served: what a first request
        would pay (pages of its mapped rows and weights faulted in, lazy setup) is paid here."""
        predict_events(model, example, schema)

    async def poll() -> None:
        while True:
            await asyncio.sleep(settings.poll_s)
            await refresh()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        torch.set_num_threads(settings.threads)
        # the registry poll and a model's load run on a thread: Python hands the GIL back to the
        # requests' event loop every 5 ms by default, a stall a request pays in full; 0.5 ms bounds it
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        # numpy's BLAS (the scorer's products) too: its default thread per core spins between the
        # products of a 64-event request, ~25 ms of CPU a request taken from the other requests
        threadpoolctl.threadpool_limits(settings.threads, user_api="blas")
        if settings.log_impressions:
            assert kafka is not None
            loop.append(ImpressionLog(settings, kafka, schema))
            loop[0].restore(int(time.time() * 1000))
        await refresh()
        gc.freeze()  # what startup built (imports, the first model) is never scanned again: shorter GC pauses
        task = asyncio.create_task(poll())
        yield
        task.cancel()
        if loop:
            loop[0].close(settings.log_flush_s)

    # with a token, the API's description is not published either (a browser's docs page could not send the token)
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if token else {}
    app = FastAPI(title="adstream serving", lifespan=lifespan, **docs)  # type: ignore[arg-type]
    app.state.holder = holder

    async def get_holder() -> ModelHolder:
        return holder

    app.state.get_holder = get_holder

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        # the worker's pid: with serving.workers > 1, which process answers on this connection
        return {"status": "ok", "model_loaded": holder.current is not None, "worker": os.getpid()}

    @app.get("/schema")
    def schema_info() -> dict[str, Any]:
        """What a request looks like for the served schema: its fields and an example event."""
        return {
            "name": schema.name,
            "hash": schema.hash,
            "fields": schema.field_kinds(),
            "example": schema.request_example(),
        }

    @app.get("/model", dependencies=[Depends(authorized)])
    def model_info(h: ModelHolder = Depends(get_holder)) -> Response:
        if h.current is None:
            return JSONResponse({"detail": "no model loaded yet", "last_error": h.last_error}, status_code=503)
        return JSONResponse({**h.info(), "log": loop[0].info() if loop else None})

    batcher = Batcher(lambda served, events: predict_events(served, events, schema))

    async def answer_predict(body: bytes | None, authorization: str, shown: bool = True) -> Answer:
        """What POST /predict answers for a body (None: over max_body_bytes) and an Authorization
        header: the one function behind the lane and the route."""
        if not bearer_ok(authorization):
            return _refused(401, TOKEN_DETAIL, [(b"www-authenticate", b"Bearer")])
        if body is None:
            return _refused(
                413,
                f"request body over serving.max_body_bytes={settings.max_body_bytes}; "
                f"send fewer events per request (at most serving.max_events={settings.max_events})",
            )
        now_ms = int(time.time() * 1000)
        scoring = parse_predict_body(body, schema, settings.max_events, now_ms, shown)
        if isinstance(scoring, Refusal):
            return _refused(scoring.status, scoring.detail)
        parsed = scoring.events
        served = holder.current  # read once: a swap during this request does not affect it
        if served is None:
            return _refused(503, "no model loaded yet; is a trainer publishing?")
        started = time.perf_counter()
        if len(parsed) <= INLINE_EVENTS:  # well under a millisecond: a thread hop would cost more
            ctrs = await batcher.predict(served, parsed)
        else:
            ctrs = await asyncio.to_thread(predict_events, served, parsed, schema)
        returned = ctrs.tolist()  # the CTRs as the response says them: what is logged
        if loop:
            loop[0].scored(served, scoring, returned, now_ms)
        LATENCY.observe(time.perf_counter() - started)
        REQUESTS.labels("200").inc()
        return Answer(
            200,
            orjson.dumps(
                {
                    "model_version": served.version,
                    "schema_hash": served.manifest.schema_hash,
                    "predictions": [{"event_id": e.event_id, "ctr": c} for e, c in zip(parsed, returned)],
                }
            ),
        )

    # the route is what /docs shows; PredictLane takes every POST /predict before it reaches here,
    # with the same answer_predict
    @app.post("/predict")
    async def predict(request: Request) -> Response:
        answer = await answer_predict(
            await _body_within(request.receive, request.headers.get("content-length", ""), settings.max_body_bytes),
            request.headers.get("authorization", ""),
            request.query_params.get("shown", "true") != "false",
        )
        headers = {name.decode(): value.decode() for name, value in answer.headers}
        return Response(answer.body, answer.status, headers, media_type="application/json")

    def log_or_409() -> ImpressionLog:
        if not loop:
            raise HTTPException(409, "serving.log_impressions is off: this server logs no impressions or clicks")
        return loop[0]

    @app.post("/shown", dependencies=[Depends(authorized)])
    async def shown(request: Request) -> Response:
        """Candidates scored with "shown": false that were shown: each logged as an impression."""
        log_to = log_or_409()
        ids = parse_shown(await request.body(), settings.max_events)
        if isinstance(ids, Refusal):
            return JSONResponse({"detail": ids.detail}, status_code=ids.status)
        unknown = log_to.shown(ids, int(time.time() * 1000))
        return JSONResponse({"shown": len(ids) - len(unknown), "unknown": unknown})

    @app.post("/click", dependencies=[Depends(authorized)])
    async def click(request: Request) -> Response:
        """Clicks on impressions, onto the clicks topic the joiner reads (it counts a duplicate once)."""
        log_to = log_or_409()
        clicks = parse_clicks(await request.body(), int(time.time() * 1000), settings.max_events)
        if isinstance(clicks, Refusal):
            return JSONResponse({"detail": clicks.detail}, status_code=clicks.status)
        log_to.clicked(clicks)
        return JSONResponse({"clicks": len(clicks)})

    @app.get("/metrics")
    def metrics() -> Response:
        MODEL_AGE.set(_age_s(holder.current))
        return Response(generate_latest(_metrics_registry()), media_type=CONTENT_TYPE_LATEST)

    return PredictLane(app, answer_predict, settings.max_body_bytes)


async def _body_within(receive: Receive, declared: str, limit: int) -> bytes | None:
    """The request body, or None as soon as it is known to be over `limit` bytes (by its declared
    Content-Length, or while it streams in), before it is all read."""
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return bytes(body)
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


@dataclass(frozen=True)
class Answer:
    """A /predict response: status, JSON body, extra headers."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def _refused(status: int, detail: Any, headers: list[tuple[bytes, bytes]] | None = None) -> Answer:
    REQUESTS.labels(str(status)).inc()
    return Answer(status, orjson.dumps({"detail": detail}), headers or [])


class PredictLane:
    """The served ASGI app: POST /predict answered right here, everything else (and the lifespan)
    by the FastAPI app. FastAPI's middleware, routing and dependency layers cost ~0.2 ms a request
    (py-spy, 500 req/s), as much as scoring one event; the lane calls the route's own
    `answer_predict`, so the two cannot answer differently."""

    def __init__(
        self, app: FastAPI, answer: Callable[[bytes | None, str, bool], Awaitable[Answer]], limit: int
    ) -> None:
        self.app, self.answer, self.limit = app, answer, limit
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/predict" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        body = await _body_within(receive, headers.get(b"content-length", b"").decode(), self.limit)
        shown = b"shown=false" not in scope.get("query_string", b"")
        answer = await self.answer(body, headers.get(b"authorization", b"").decode("latin-1"), shown)
        length = str(len(answer.body)).encode()
        start = [(b"content-type", b"application/json"), (b"content-length", length), *answer.headers]
        await send({"type": "http.response.start", "status": answer.status, "headers": start})
        await send({"type": "http.response.body", "body": answer.body})
