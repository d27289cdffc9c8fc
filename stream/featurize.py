"""Event -> feature ids and floats. Pure; serving calls exactly these functions.

Feature ids are 64-bit and need no vocabulary:
  hex32 categories:   id = field << 33 | value           (collision-free: value < 2^32)
  integer buckets:    id = field << 33 | bucket          (bucket < 2^32)
  missing value:      id = field << 33 | 1 << 32         (outside any real value; 0xffffffff is real)
  string categories:  id = 1 << 62 | blake2b-62(field, value)   (stable hash, for other schemas)
field = position in schema.sparse_fields (integer fields first). Ids stay below 2^63, so they fit
torch's int64.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from stream.records import Event, FeatureBatch, RawRecord, Rejected
from stream.schema import Schema

FIELD_SHIFT = 33
MISSING = 1 << 32
STRING_TAG = 1 << 62
_BUCKET_BIAS = 1 << 31


def integer_bucket(value: int) -> int:
    """Log-square bucket of a count (small values kept exact); negative counts keep their value."""
    if value <= 2:
        code = value
    else:
        code = 3 + int(math.log(value) ** 2)
    return (code + _BUCKET_BIAS) & 0xFFFFFFFF


def signed_log1p(value: int | None) -> float:
    """The dense form of an integer feature: sign(v) * log(1 + |v|), 0 when missing."""
    if value is None:
        return 0.0
    return math.copysign(math.log1p(abs(value)), value)


def string_id(field: int, value: str) -> int:
    digest = hashlib.blake2b(f"{field}\x1f{value}".encode(), digest_size=8).digest()
    return STRING_TAG | (int.from_bytes(digest, "little") & (STRING_TAG - 1))


def missing_id(field: int) -> int:
    return (field << FIELD_SHIFT) | MISSING


def event_ids(event: Event, schema: Schema) -> list[int]:
    """The sparse ids of one event, one per schema.sparse_fields entry."""
    ids = []
    for field, value in enumerate(event.ints):
        base = field << FIELD_SHIFT
        ids.append(base | MISSING if value is None else base | integer_bucket(value))
    hex32 = schema.categorical_encoding == "hex32"
    for offset, cat in enumerate(event.cats):
        field = schema.num_dense + offset
        if cat is None:
            ids.append((field << FIELD_SHIFT) | MISSING)
        elif hex32:
            ids.append((field << FIELD_SHIFT) | int(cat, 16))
        else:
            ids.append(string_id(field, cat))
    return ids


def featurize(
    events: Sequence[Event],
    schema: Schema,
    partitions: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
) -> FeatureBatch:
    """Featurize events into one FeatureBatch (see records.FeatureBatch for shapes)."""
    n = len(events)
    ids = np.fromiter(
        (i for event in events for i in event_ids(event, schema)), dtype=np.int64, count=n * schema.num_sparse
    ).reshape(n, schema.num_sparse)
    dense = np.fromiter(
        (signed_log1p(v) for event in events for v in event.ints), dtype=np.float32, count=n * schema.num_dense
    ).reshape(n, schema.num_dense)
    labels = np.array([np.nan if e.label is None else e.label for e in events], dtype=np.float32)
    return FeatureBatch(
        labels=labels,
        dense=dense,
        ids=ids,
        ts=np.array([e.ts for e in events], dtype=np.int64),
        event_ids=tuple(e.event_id for e in events),
        partitions=np.asarray(partitions if partitions is not None else [-1] * n, dtype=np.int32),
        offsets=np.asarray(offsets if offsets is not None else [-1] * n, dtype=np.int64),
        schema_hash=schema.hash,
    )


def featurize_records(
    records: Sequence[RawRecord], schema: Schema
) -> tuple[FeatureBatch, list[Rejected]]:
    """Kafka records (single events or bundles) -> one batch of the good events + the rejects.

    The Faust agent is a thin shell around this; every bad line becomes a Rejected with a reason.
    """
    from stream.decode import decode_event, split_bundle
    from stream.errors import DecodeError

    good: list[Event] = []
    parts: list[int] = []
    offs: list[int] = []
    rejected: list[Rejected] = []
    for record in records:
        for line in split_bundle(record.value):
            try:
                good.append(decode_event(line, schema))
            except DecodeError as exc:
                rejected.append(Rejected(record.partition, record.offset, line, str(exc)))
                continue
            parts.append(record.partition)
            offs.append(record.offset)
        if not record.value.strip():
            rejected.append(Rejected(record.partition, record.offset, record.value, "record: empty"))
    return featurize(good, schema, parts, offs), rejected
