"""bytes -> Event: parse and validate one event against a schema.

Every schema field must be present; JSON null (or "" for a category) marks a missing value.
The rules themselves are in rules.py, shared with Arrow bundles and replay's line parser.
Failures raise DecodeError naming the field, which becomes a DLQ reason or an HTTP 422.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson

from stream import rules
from stream.errors import DecodeError
from stream.records import Event
from stream.schema import Schema


def decode_event(raw: bytes | str, schema: Schema, require_label: bool = True) -> Event:
    """Parse one JSON object into an Event; raises DecodeError."""
    return event_from_mapping(parse_json(raw), schema, require_label)


def parse_json(raw: bytes | str) -> Any:
    """The JSON value of one event's text; raises DecodeError."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DecodeError("", f"not valid JSON ({exc})") from None


def event_from_mapping(obj: Any, schema: Schema, require_label: bool = True) -> Event:
    """Validate an already parsed JSON value into an Event (the rules of rules.py); raises DecodeError."""
    if not isinstance(obj, Mapping):
        raise DecodeError("", f"expected a JSON object, got {type(obj).__name__}")
    event_id = _checked(obj, schema.event_id, rules.check_event_id)
    ts = _checked(obj, schema.timestamp, rules.check_timestamp)
    label = obj.get(schema.label)
    broken = rules.check_label(label, require_label)
    if broken:
        raise DecodeError(schema.label, broken)
    ints = tuple(_checked(obj, name, rules.check_integer) for name in schema.integer_fields)
    floats = tuple(_float(_checked(obj, name, rules.check_float)) for name in schema.float_fields)
    hex32 = schema.categorical_encoding == "hex32"
    cats = tuple(_category(obj, name, hex32) for name in schema.categorical_fields)
    lists = tuple(_values(_checked(obj, name, lambda v: rules.check_list(v, hex32))) for name in schema.list_fields)
    return Event(str(event_id), ts, None if label is None else int(label), ints, cats, floats, lists)


def split_bundle(value: bytes) -> Iterator[bytes]:
    """A record holds one event, or a bundle of newline-separated events (as log shippers send)."""
    for line in value.split(b"\n"):
        if line.strip():
            yield line


def _required(obj: Mapping[str, Any], name: str) -> Any:
    if name not in obj:
        raise DecodeError(name, rules.MISSING_FIELD)
    return obj[name]


def _checked(obj: Mapping[str, Any], name: str, check: Callable[[Any], str | None]) -> Any:
    value = _required(obj, name)
    broken = check(value)
    if broken:
        raise DecodeError(name, broken)
    return value


def _values(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if v) if value else ()


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _category(obj: Mapping[str, Any], name: str, hex32: bool) -> str | None:
    value = _required(obj, name)
    if value is None or value == "":
        return None
    if type(value) is int and not hex32:  # a log's "1005" as JSON gives 1005: the same category
        value = str(value)
    broken = rules.check_category(value, hex32)
    if broken:
        raise DecodeError(name, broken)
    return str(value)
