"""JSON events many at a time: records of one JSON event each, checked and featurized by column.

decode.py checks a JSON event value by value in Python, ~25 us an event; with one event per Kafka
record that was half of the Faust worker's time. Here the events whose values all have a JSON type
their field allows (the usual case) are laid out as one bundle-layout Arrow table and go through
the Arrow bundles' column-at-a-time checks and featurization (bundle.check_table: the same rules,
the same reasons). An event with a value of another type, a missing field, a value past int64 or
that is not an object goes through decode.py alone, as before. Events keep their order.
tests/test_json_batch.py pins this path to decode.py's, event by event and reason by reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from stream.errors import DecodeError
from stream.featurizer.bundle import check_table, checked_features
from stream.featurizer.decode import event_from_mapping
from stream.featurizer.featurize import featurize
from stream.formats.arrow import bundle_table
from stream.records import FeatureBatch, Rejected
from stream.schema import Schema

_ABSENT = object()  # a field the event lacks: its type is in no allowed set
_NONE: type = type(None)


def _allowed_types(schema: Schema) -> list[tuple[str, frozenset[type]]]:
    """(field, the Python types of a JSON value the column path takes for it), in schema order.
    bool is not int here (a JSON true is a wrong type), so such an event takes decode.py's path."""
    return [
        (schema.event_id, frozenset({str, int})),
        (schema.timestamp, frozenset({int})),
        (schema.label, frozenset({int, _NONE})),
        *((name, frozenset({int, _NONE})) for name in schema.integer_fields),
        *((name, frozenset({int, float, _NONE})) for name in schema.float_fields),
        *((name, frozenset({str, _NONE})) for name in schema.categorical_fields),
        *((name, frozenset({list, _NONE})) for name in schema.list_fields),
    ]


def _columns(objs: Sequence[Any], schema: Schema) -> tuple[dict[str, list[Any]], np.ndarray]:
    """Each field's values (one list per field, _ABSENT where an event lacks it) and which events
    can take the column path: objects whose every value has an allowed type (checked a column at a
    time: one C-level pass per field while every value fits, the usual case)."""
    n = len(objs)
    columnar = np.fromiter((type(o) is dict for o in objs), dtype=bool, count=n)
    rows = objs if columnar.all() else [o if type(o) is dict else {} for o in objs]
    columns = {}
    for name, types in _allowed_types(schema):
        values = columns[name] = [o.get(name, _ABSENT) for o in rows]
        if not set(map(type, values)) <= types:
            columnar &= np.fromiter((type(v) in types for v in values), dtype=bool, count=n)
    for name in schema.list_fields:  # and a list's values are strings
        columnar &= np.fromiter(
            (type(v) is not list or all(type(x) is str for x in v) for v in columns[name]), dtype=bool, count=n
        )
    return columns, columnar


def _by_column(
    columns: dict[str, list[Any]],
    start: int,
    end: int,
    lines: Sequence[bytes],
    parts: np.ndarray,
    offs: np.ndarray,
    schema: Schema,
) -> tuple[FeatureBatch, list[Rejected]] | None:
    """Events [start, end) of the columns, all columnar, featurized together (lines, parts, offs:
    theirs alone); None when Arrow refuses a value (one past int64)."""
    try:
        table = bundle_table({name: values[start:end] for name, values in columns.items()}, schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        return None
    checked = check_table(table, schema)
    if isinstance(checked, str):  # cannot happen for a table built here; decode.py knows the reasons
        return None
    ok = checked.good()
    rejected = [
        Rejected(int(parts[i]), int(offs[i]), lines[i], str(checked.reasons[i])) for i in np.nonzero(~ok)[0].tolist()
    ]
    return checked_features(checked, ok, parts, offs, schema), rejected


def _one_by_one(
    objs: Sequence[Any], lines: Sequence[bytes], parts: np.ndarray, offs: np.ndarray, schema: Schema
) -> tuple[FeatureBatch, list[Rejected]]:
    """decode.py's path, an event at a time."""

    good, keep, rejected = [], [], []
    for i, obj in enumerate(objs):
        try:
            good.append(event_from_mapping(obj, schema))
            keep.append(i)
        except DecodeError as exc:
            rejected.append(Rejected(int(parts[i]), int(offs[i]), lines[i], str(exc)))
    return featurize(good, schema, parts[keep].tolist(), offs[keep].tolist()), rejected


def featurize_json_events(
    objs: Sequence[Any], lines: Sequence[bytes], partitions: Sequence[int], offsets: Sequence[int], schema: Schema
) -> tuple[FeatureBatch, list[Rejected]]:
    """Parsed JSON events (objs) with their bytes (lines) and source records -> the batch of the
    good ones, in order, and a Rejected (the line, its reason) for each bad one."""
    n = len(objs)
    parts, offs = np.asarray(partitions, dtype=np.int32), np.asarray(offsets, dtype=np.int64)
    columns, columnar = _columns(objs, schema)
    # runs of events that take the same path, so the batch keeps the events' order
    edges = [0, *(np.nonzero(columnar[1:] != columnar[:-1])[0] + 1).tolist(), n] if n else [0]
    batches, rejected = [], []
    for start, end in zip(edges[:-1], edges[1:]):
        sources = (lines[start:end], parts[start:end], offs[start:end], schema)
        done = _by_column(columns, start, end, *sources) if columnar[start] else None
        batch, bad = done if done is not None else _one_by_one(objs[start:end], *sources)
        batches.append(batch)
        rejected += bad
    if not batches:
        return FeatureBatch.empty(
            schema.num_dense, schema.num_sparse, schema.hash, len(schema.list_fields), schema.name
        ), []
    return FeatureBatch.concat(batches), rejected
