"""Request bodies -> what to do, or the 422 that names what is wrong. Pure.

    /predict body --parse_predict_body--> Scoring: [Event] (serve-time decode: stream/featurizer/decode.py's,
                                          label absent), their JSON objects, which are shown
    /click body   --parse_clicks--------> [(impression id, ms)]
    /shown body   --parse_shown---------> [(impression id, propensity or None)]
    any of them   --------------------->  Refusal(422, [{"loc": ["body", index, field], "msg", "type"}])

/predict takes one event object or a list of 1..max_events of them; an event without a time is
scored at `now_ms`, one without an id gets one (returned in the response, and the id its impression
is logged under). `"shown": false` in an event (or `?shown=false` for the whole request) scores a
candidate without logging it as an impression until POST /shown names it (serving/impressions.py).
The HTTP routes (serving/app.py) only read the body, call these and act.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from stream import rules
from stream.errors import DecodeError
from stream.featurizer.decode import event_from_mapping
from stream.records import Event
from stream.schema import Schema


@dataclass(frozen=True)
class Refusal:
    """What the response says instead of predictions."""

    status: int  # the HTTP status (422)
    detail: list[dict[str, Any]]  # FastAPI's shape: [{"loc": [...], "msg": ..., "type": "value_error"}]


SHOWN = "shown"  # an event's flag: false scores a candidate that POST /shown may log later


@dataclass(frozen=True)
class Scoring:
    """A /predict request, understood."""

    events: list[Event]  # to score, in order
    items: list[dict[str, Any]]  # their JSON objects (id and time filled in, "shown" taken out): what is logged
    shown: list[bool]  # per event: an impression now (True), or a candidate waiting for POST /shown


def parse_predict_body(
    body: bytes, schema: Schema, max_events: int, now_ms: int, shown: bool = True
) -> Scoring | Refusal:
    """The events of a request body, in order, or a Refusal naming each bad field by its place.
    `shown`: the request's default for events without their own "shown"."""
    payload = _json_items(body, max_events, "events")
    if isinstance(payload, Refusal):
        return payload
    items = payload if isinstance(payload, list) else [payload]
    events, objects, flags, errors = [], [], [], []
    for index, item in enumerate(items):
        if isinstance(item, dict):
            item = dict(item)
            flags.append(item.pop(SHOWN, shown))
            if type(flags[-1]) is not bool:
                errors.append((_loc(payload, index, SHOWN), "must be true or false"))
            item.setdefault(schema.timestamp, now_ms)  # a request's time: now
            item.setdefault(schema.event_id, uuid.uuid4().hex)  # an id to log it under and return
        try:
            events.append(event_from_mapping(item, schema, require_label=False))
            objects.append(item)
        except DecodeError as exc:
            errors.append((_loc(payload, index, exc.field), exc.reason))
    if errors:
        return Refusal(422, [{"loc": list(loc), "msg": msg, "type": "value_error"} for loc, msg in errors])
    return Scoring(events, objects, flags)


def parse_clicks(body: bytes, now_ms: int, most: int) -> list[tuple[str, int]] | Refusal:
    """POST /click: one or many `{"impression_id", "ts"}` (ts: ms, now when absent)."""
    pairs = _feedback(body, most, "ts", rules.check_timestamp, now_ms)
    return pairs if isinstance(pairs, Refusal) else [(i, int(ts)) for i, ts in pairs]


def parse_shown(body: bytes, most: int) -> list[tuple[str, float | None]] | Refusal:
    """POST /shown: one or many `{"impression_id", "propensity"}` (the chance the shown ad had of being
    chosen, in (0, 1]; absent when the choice was not random)."""
    return _feedback(body, most, "propensity", _check_propensity, None)


def _check_propensity(value: object) -> str | None:
    ok = type(value) in (int, float) and 0 < value <= 1  # type: ignore[operator]
    return None if ok else "must be a number in (0, 1]"


def _feedback(body: bytes, most: int, second: str, check: Any, default: Any) -> list[tuple[str, Any]] | Refusal:
    """One or many objects naming an impression id and an optional second field."""
    payload = _json_items(body, most, "objects")
    if isinstance(payload, Refusal):
        return payload
    items = payload if isinstance(payload, list) else [payload]
    pairs, errors = [], []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            errors.append((_loc(payload, index, ""), 'expected a JSON object {"impression_id": ...}'))
            continue
        key = item.get("impression_id")
        broken = rules.check_event_id(key) if "impression_id" in item else rules.MISSING_FIELD
        if broken:
            errors.append((_loc(payload, index, "impression_id"), broken))
        value = item.get(second, default)
        if second in item and (broken := check(value)):
            errors.append((_loc(payload, index, second), broken))
        unknown = sorted(set(item) - {"impression_id", second})
        if unknown:
            errors.append((_loc(payload, index, unknown[0]), f"unknown field; send impression_id and {second}"))
        pairs.append((str(key), value))
    if errors:
        return Refusal(422, [{"loc": list(loc), "msg": msg, "type": "value_error"} for loc, msg in errors])
    return pairs


def _json_items(body: bytes, most: int, what: str) -> Any:
    """The body's JSON value (an object or a list of 1..most), or the Refusal of the whole body."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return refusal([("body",)], f"request body is not valid JSON ({exc})")
    n = len(payload) if isinstance(payload, list) else 1
    if not 1 <= n <= most:
        return refusal([("body",)], f"send 1 to {most} {what}, got {n}")
    return payload


def _loc(payload: Any, index: int, name: str) -> tuple[Any, ...]:
    loc = ("body", index, name) if isinstance(payload, list) else ("body", name)
    return tuple(x for x in loc if x != "")


def refusal(locs: list[tuple[Any, ...]], msg: str) -> Refusal:
    """One message for the places `locs`."""
    return Refusal(422, [{"loc": list(loc), "msg": msg, "type": "value_error"} for loc in locs])
