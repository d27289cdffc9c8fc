"""Arrow bundles, the format: many events in one Kafka record as an Arrow IPC stream.

Faust spends tens of microseconds per record, and JSON parsing alone costs ~7 us per event, so
high volume arrives as bundles. A bundle has one column per schema field, in `bundle_schema`'s
layout (ints int64, floats float64, categories and event id as strings, list fields as lists of
strings; null = missing value). Written by replay and the joiner, read by the joiner and the
featurizer (stream/featurizer/bundle.py checks and featurizes one column-wise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa

from stream.schema import Schema

_ARROW_MAGIC = b"\xff\xff\xff\xff"  # an Arrow IPC stream starts with the continuation marker


def is_arrow_bundle(value: bytes) -> bool:
    return value[:4] == _ARROW_MAGIC


def encode_event_bundle(events: Sequence[dict[str, object]], schema: Schema) -> bytes:
    """Event dicts -> one Arrow IPC record batch (what a log shipper would send)."""
    return encode_table(event_table(events, schema))


def bundle_schema(schema: Schema) -> pa.Schema:
    """The bundle layout, one typed column per field, in this order: the event id (text), time,
    label and integer fields (int64), float fields (float64), categories (text), list fields (lists
    of text). What `event_table`, featurizer/json_batch.py and produce/logs.py build, and what a bundle is read as."""
    kinds = [(schema.event_id, pa.string()), (schema.timestamp, pa.int64()), (schema.label, pa.int64())]
    kinds += [(name, pa.int64()) for name in schema.integer_fields]
    kinds += [(name, pa.float64()) for name in schema.float_fields]
    kinds += [(name, pa.string()) for name in schema.categorical_fields]
    kinds += [(name, pa.list_(pa.string())) for name in schema.list_fields]
    return pa.schema(kinds)


def bundle_table(columns: Mapping[str, Sequence[object]], schema: Schema) -> pa.Table:
    """Python values per field -> a bundle-layout table (event ids of any kind are taken as text)."""
    layout = bundle_schema(schema)
    arrays = [
        pa.array([str(v) for v in columns[f.name]] if f.name == schema.event_id else columns[f.name], f.type)
        for f in layout
    ]
    return pa.Table.from_arrays(arrays, schema=layout)


def event_table(events: Sequence[dict[str, object]], schema: Schema) -> pa.Table:
    """Event dicts -> a bundle-layout table (the label may be absent: null)."""
    names = bundle_schema(schema).names
    return bundle_table({n: [e.get(n) if n == schema.label else e[n] for e in events] for n in names}, schema)


def encode_table(table: pa.Table) -> bytes:
    """A bundle-layout table -> one Arrow IPC stream (a Kafka record's value)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
