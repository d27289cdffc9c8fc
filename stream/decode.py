"""bytes -> Event: parse and validate one event against a schema.

Every schema field must be present; JSON null (or "" for a category) marks a missing value.
Failures raise DecodeError naming the field, which becomes a DLQ reason or an HTTP 422.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from stream.errors import DecodeError
from stream.records import Event
from stream.schema import Schema

_HEX32 = re.compile(r"[0-9a-fA-F]{1,8}")
MAX_CATEGORY_CHARS = 256


def decode_event(raw: bytes | str, schema: Schema, require_label: bool = True) -> Event:
    """Parse one JSON object into an Event; raises DecodeError."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DecodeError("", f"not valid JSON ({exc})") from None
    return event_from_mapping(obj, schema, require_label)


def event_from_mapping(obj: Any, schema: Schema, require_label: bool = True) -> Event:
    """Validate an already parsed JSON value into an Event; raises DecodeError."""
    if not isinstance(obj, Mapping):
        raise DecodeError("", f"expected a JSON object, got {type(obj).__name__}")
    event_id = _required(obj, schema.event_id)
    if isinstance(event_id, bool) or not isinstance(event_id, (str, int)) or event_id == "":
        raise DecodeError(schema.event_id, "must be a non-empty string or an integer")
    ts = _required(obj, schema.timestamp)
    if isinstance(ts, bool) or not isinstance(ts, int) or ts < 0:
        raise DecodeError(schema.timestamp, f"must be a non-negative integer (ms), got {ts!r}")
    label = obj.get(schema.label)
    if label is None:
        if require_label:
            raise DecodeError(schema.label, "missing; a training event needs a 0/1 label")
    elif isinstance(label, bool) or label not in (0, 1):
        raise DecodeError(schema.label, f"must be 0 or 1, got {label!r}")
    ints = tuple(_integer(obj, name) for name in schema.integer_fields)
    hex32 = schema.categorical_encoding == "hex32"
    cats = tuple(_category(obj, name, hex32) for name in schema.categorical_fields)
    return Event(str(event_id), ts, None if label is None else int(label), ints, cats)


def split_bundle(value: bytes) -> Iterator[bytes]:
    """A record holds one event, or a bundle of newline-separated events (as log shippers send)."""
    for line in value.split(b"\n"):
        if line.strip():
            yield line


def _required(obj: Mapping[str, Any], name: str) -> Any:
    if name not in obj:
        raise DecodeError(name, "missing field")
    return obj[name]


def _integer(obj: Mapping[str, Any], name: str) -> int | None:
    value = _required(obj, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(name, f"must be an integer or null, got {value!r}")
    if not -(1 << 62) < value < 1 << 62:
        raise DecodeError(name, f"integer out of range: {value}")
    return value


def _category(obj: Mapping[str, Any], name: str, hex32: bool) -> str | None:
    value = _required(obj, name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise DecodeError(name, f"must be a string or null, got {value!r}")
    if hex32 and not _HEX32.fullmatch(value):
        raise DecodeError(name, f"must be up to 8 hex digits, got {value[:20]!r}")
    if len(value) > MAX_CATEGORY_CHARS:
        raise DecodeError(name, f"longer than {MAX_CATEGORY_CHARS} characters")
    return value
