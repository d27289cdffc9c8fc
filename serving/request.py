"""A /predict request's body -> the events to score, or the 422 that names what is wrong. Pure.

    body bytes --parse_predict_body--> [Event] (serve-time decode: stream/decode.py's, label absent)
                                   or  Refusal(422, [{"loc": ["body", index, field], "msg", "type"}])

One event object or a list of 1..max_events of them; an event without a time is scored at `now_ms`.
The HTTP route (serving/app.py) only reads the body, calls this and predicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from stream.decode import event_from_mapping
from stream.errors import DecodeError
from stream.records import Event
from stream.schema import Schema


@dataclass(frozen=True)
class Refusal:
    """What the response says instead of predictions."""

    status: int  # the HTTP status (422)
    detail: list[dict[str, Any]]  # FastAPI's shape: [{"loc": [...], "msg": ..., "type": "value_error"}]


def parse_predict_body(body: bytes, schema: Schema, max_events: int, now_ms: int) -> list[Event] | Refusal:
    """The events of a request body, in order, or a Refusal naming each bad field by its place."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return refusal([("body",)], f"request body is not valid JSON ({exc})")
    items = payload if isinstance(payload, list) else [payload]
    if not items or len(items) > max_events:
        return refusal([("body",)], f"send 1 to {max_events} events, got {len(items)}")
    events, errors = [], []
    for index, item in enumerate(items):
        if isinstance(item, dict) and schema.timestamp not in item:  # a request's time: now
            item = {**item, schema.timestamp: now_ms}
        try:
            events.append(event_from_mapping(item, schema, require_label=False))
        except DecodeError as exc:
            loc = ("body", index, exc.field) if isinstance(payload, list) else ("body", exc.field)
            errors.append((tuple(x for x in loc if x != ""), exc.reason))
    if errors:
        return Refusal(422, [{"loc": list(loc), "msg": msg, "type": "value_error"} for loc, msg in errors])
    return events


def refusal(locs: list[tuple[Any, ...]], msg: str) -> Refusal:
    """One message for the places `locs`."""
    return Refusal(422, [{"loc": list(loc), "msg": msg, "type": "value_error"} for loc in locs])
