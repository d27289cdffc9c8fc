"""The joiner's two inputs, read into the join's records (stream/join/policy.py). Pure.

impressions topic record --read_impressions--> [Impression] + [Rejected] (+ the Arrow bundle they lie in)
clicks topic record      --read_clicks-------> [Click] + [Rejected]

An impression is an event as `adstream.events` carries it, without its label: one JSON object,
JSON lines (a bundle), or an Arrow bundle. Its impression id is the schema's `event_id`, its time
the schema's `timestamp`. The joiner checks only what the join needs (the id and the time, and that
no label is set: a click sets it); the features are checked by the featurizer downstream, which
dead-letters a bad one as it does today. A JSON impression's payload is its JSON object, which the
joiner emits with the label spliced in; an Arrow bundle's impression is a RowRef into the bundle,
which the joiner stores once and emits rows of as Arrow (stream/join/outputs.py), so nothing but the
label changes on the way, and a bundled impression is never turned into JSON.

A click is a JSON object (or JSON lines) naming the impression (`ClickFields.impression_id`) and
its time (`ClickFields.time`, ms); a click labels its impression 1 (the schema's `label`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from stream import rules
from stream.formats.arrow import is_arrow_bundle
from stream.formats.json_lines import json_lines
from stream.join.policy import Click, Impression, RowRef
from stream.records import RawRecord, Rejected
from stream.schema import Schema

LABEL_SET = "an impression carries no label: the joiner sets it from the clicks"


@dataclass(frozen=True)
class ClickFields:
    """The fields of a click record (the [clicks] names of the schema's docs)."""

    impression_id: str = "impression_id"  # the impression the click is on (its event id)
    time: str = "ts"  # click time, ms since the epoch


def read_impressions(record: RawRecord, schema: Schema) -> tuple[list[Impression], list[Rejected], pa.Table | None]:
    """One impressions-topic record -> its impressions, in order, a Rejected per bad one, and for an
    Arrow bundle the bundle itself (the good impressions' payloads are RowRefs into it; None for JSON)."""
    if is_arrow_bundle(record.value):
        return _arrow_impressions(record, schema)
    good, bad = [], []
    for line in _lines(record.value):
        obj, reason = _object(line)
        if obj is not None:
            reason = _impression_reason(obj, schema)
        if reason is not None:
            bad.append(Rejected(record.partition, record.offset, line, reason))
            continue
        assert obj is not None
        payload = line.strip()
        if schema.label in obj:  # "label": null, allowed; dropped so the splice makes the one label
            del obj[schema.label]
            payload = orjson.dumps(obj)
        good.append(Impression(str(obj[schema.event_id]), obj[schema.timestamp], payload))
    return good, bad, None


def one_impression(value: bytes, schema: Schema) -> Impression | None:
    """The usual impressions record, one good JSON impression, read without the checks' detour (None:
    read it with read_impressions, which says what is wrong; a test pins the two to one answer)."""
    if b"\n" in value:
        return None
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict or schema.label in obj:
        return None
    key, ts = obj.get(schema.event_id), obj.get(schema.timestamp)
    if type(ts) is not int or not 0 <= ts < rules.INT_BOUND:
        return None
    if type(key) is str:
        if not 0 < len(key) <= rules.MAX_EVENT_ID_CHARS:
            return None
    elif type(key) is not int:
        return None
    return Impression(str(key), ts, value.strip())


def read_clicks(record: RawRecord, fields: ClickFields) -> tuple[list[Click], list[Rejected]]:
    """One clicks-topic record -> its clicks, in order, and a Rejected per bad one."""
    one = _one_good_click(record.value, fields)
    if one is not None:
        return [one], []
    good, bad = [], []
    for line in _lines(record.value):
        obj, reason = _object(line)
        if obj is not None:
            key, ts = obj.get(fields.impression_id), obj.get(fields.time)
            broken = (
                (fields.impression_id, rules.check_event_id(key))
                if fields.impression_id in obj
                else (fields.impression_id, rules.MISSING_FIELD)
            )
            if broken[1] is None:
                broken = (fields.time, rules.check_timestamp(ts) if fields.time in obj else rules.MISSING_FIELD)
            reason = rules.reason(*broken) if broken[1] is not None else None  # type: ignore[arg-type]
        if reason is not None:
            bad.append(Rejected(record.partition, record.offset, line, reason))
            continue
        assert obj is not None
        good.append(Click(str(obj[fields.impression_id]), obj[fields.time]))
    return good, bad


def _one_good_click(value: bytes, fields: ClickFields) -> Click | None:
    """The usual record, one good click, read without the checks' detour (None: read it the long way,
    which says what is wrong)."""
    if b"\n" in value:
        return None
    try:
        obj = orjson.loads(value)
        key, ts = obj[fields.impression_id], obj[fields.time]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return None
    if type(key) is str and 0 < len(key) <= rules.MAX_EVENT_ID_CHARS and type(ts) is int and 0 <= ts < rules.INT_BOUND:
        return Click(key, ts)
    return None


def _lines(value: bytes) -> list[bytes]:
    lines = [line for line in value.split(b"\n") if line.strip()]
    return lines or [value]  # an empty record is one bad line


def _object(line: bytes) -> tuple[dict | None, str | None]:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        return None, f"record: not JSON ({str(exc)[:200]})"
    if not isinstance(obj, dict):
        return None, "record: not a JSON object"
    return obj, None


def _impression_reason(obj: dict, schema: Schema) -> str | None:
    for name, check in ((schema.event_id, rules.check_event_id), (schema.timestamp, rules.check_timestamp)):
        broken = check(obj[name]) if name in obj else rules.MISSING_FIELD
        if broken is not None:
            return rules.reason(name, broken)
    return rules.reason(schema.label, LABEL_SET) if obj.get(schema.label) is not None else None


def _arrow_impressions(record: RawRecord, schema: Schema) -> tuple[list[Impression], list[Rejected], pa.Table | None]:
    """An Arrow bundle of impressions: its id and time columns checked a column at a time, each good
    row's payload a RowRef(record.offset, row) into the bundle; a bad row's dead letter its JSON object."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(record.value)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        reason = f"record: not a readable Arrow bundle ({str(exc)[:200]})"
        return [], [Rejected(record.partition, record.offset, record.value, reason)], None
    whole = _arrow_table_reason(table, schema)
    if whole is not None:
        return [], [Rejected(record.partition, record.offset, record.value, whole)], None
    bundle = table
    ids = table.column(schema.event_id).combine_chunks().cast(pa.string())
    ts_col = table.column(schema.timestamp).combine_chunks()
    ts = pc.fill_null(ts_col, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    reasons: list[str | None] = [None] * table.num_rows
    id_len = pc.fill_null(pc.utf8_length(ids), 0).to_numpy(zero_copy_only=False)
    checks = [
        (id_len == 0, rules.reason(schema.event_id, rules.EVENT_ID)),
        (rules.long_event_ids(id_len), rules.reason(schema.event_id, rules.EVENT_ID_LONG)),
        (
            rules.bad_timestamps(ts, ts_col.is_null().to_numpy(zero_copy_only=False)),
            rules.reason(schema.timestamp, rules.TIMESTAMP),
        ),
    ]
    if schema.label in table.column_names:
        label_set = ~table.column(schema.label).is_null().to_numpy(zero_copy_only=False)
        checks.append((label_set, rules.reason(schema.label, LABEL_SET)))
        table = table.drop_columns([schema.label])
    for mask, why in checks:
        for i in np.nonzero(mask)[0].tolist():
            reasons[i] = reasons[i] or why
    id_list, ts_list, offset = ids.to_pylist(), ts.tolist(), record.offset
    good = [
        Impression(id_list[i], ts_list[i], RowRef(offset, i)) for i, reason in enumerate(reasons) if reason is None
    ]  # (a good row's id is a non-empty string)
    bad_rows = [i for i, reason in enumerate(reasons) if reason is not None]
    lines = json_lines(table.take(pa.array(bad_rows, pa.int64()))) if bad_rows else []
    bad = [Rejected(record.partition, offset, line, str(reasons[i])) for i, line in zip(bad_rows, lines, strict=True)]
    return good, bad, bundle if good else None


def _arrow_table_reason(table: pa.Table, schema: Schema) -> str | None:
    for name in (schema.event_id, schema.timestamp):
        if name not in table.column_names:
            return rules.reason(name, f"{rules.MISSING_FIELD} (no such column in the Arrow bundle)")
    kind = table.schema.field(schema.event_id).type
    if not (pa.types.is_string(kind) or pa.types.is_integer(kind)):
        return f"{schema.event_id}: column type {kind}, expected strings or integers"
    if not pa.types.is_integer(table.schema.field(schema.timestamp).type):
        return f"{schema.timestamp}: column type {table.schema.field(schema.timestamp).type}, expected integers"
    return None


class Read(NamedTuple):
    """One input record as read: its impressions or clicks, its bad lines, an Arrow bundle's table."""

    partition: int
    offset: int
    value: bytes
    topic: str
    impressions: bool  # an impressions record (else clicks)
    items: list  # Impression or Click, in order
    bad: list[Rejected]
    bundle: pa.Table | None = None


def read_record(message: Any, impressions_topic: str, schema: Schema, fields: ClickFields) -> Read:
    """One record -> its impressions or clicks, its bad lines and (Arrow) its bundle; the usual
    single JSON impression the short way."""
    topic, p, offset = message.topic(), message.partition(), message.offset()
    value = message.value() or b""
    if topic == impressions_topic:
        one = one_impression(value, schema)
        if one is not None:
            return Read(p, offset, value, topic, True, [one], [])
        items, bad, bundle = read_impressions(RawRecord(p, offset, value), schema)
        return Read(p, offset, value, topic, True, items, bad, bundle)  # type: ignore[arg-type]
    clicks, bad = read_clicks(RawRecord(p, offset, value), fields)
    return Read(p, offset, value, topic, False, clicks, bad)  # type: ignore[arg-type]
