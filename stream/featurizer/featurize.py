"""Events -> feature ids and floats. Pure; serving calls exactly these functions.

Feature ids are 64-bit and need no vocabulary:
  hex32 categories:   id = field << 33 | value           (collision-free: value < 2^32)
  integer buckets:    id = field << 33 | bucket          (bucket < 2^32)
  missing value:      id = field << 33 | 1 << 32         (outside any real value; 0xffffffff is real)
  shared (rare) row:  id = field << 33 | 1 << 32 | 1     (the field's row for ids not yet admitted)
  string categories:  id = 1 << 62 | blake2b-62(field, value)   (stable hash, for other schemas)
field = position in schema.sparse_fields (integer fields first), then the list fields after them
(schema.num_fields in all). A list field gives an id per value by the categories' rule, and its
missing id for an event without values (`list_ids`). Ids stay below 2^63, so they fit torch's int64.

Every path (Event objects from JSON, Arrow bundles) ends in `features_from_columns` and `list_ids`
(bundles: their vectorized twin), so stream-time and serve-time features cannot drift apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from stream.records import Event, FeatureBatch
from stream.schema import Schema

FIELD_SHIFT = 33
MISSING = 1 << 32
STRING_TAG = 1 << 62
_BUCKET_BIAS = 1 << 31


def integer_buckets(values: np.ndarray) -> np.ndarray:
    """Log-square buckets of counts, int64 -> int64 in [0, 2^32): small values (<= 2, negatives
    included) keep their own bucket; larger ones share floor(ln(v)^2)."""
    v = values.astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        large = 3 + np.floor(np.log(np.maximum(v, 1).astype(np.float64)) ** 2).astype(np.int64)
    code = np.where(v <= 2, v, large)
    return (code + _BUCKET_BIAS) & 0xFFFFFFFF


def integer_bucket(value: int) -> int:
    return int(integer_buckets(np.array([value]))[0])


def signed_log1p_array(values: np.ndarray) -> np.ndarray:
    """The dense form of integer features: sign(v) * log(1 + |v|), float32."""
    v = values.astype(np.float64)
    return (np.sign(v) * np.log1p(np.abs(v))).astype(np.float32)


def signed_log1p(value: int | None) -> float:
    return 0.0 if value is None else float(signed_log1p_array(np.array([value]))[0])


def string_id(field: int, value: str) -> int:
    digest = hashlib.blake2b(f"{field}\x1f{value}".encode(), digest_size=8).digest()
    return STRING_TAG | (int.from_bytes(digest, "little") & (STRING_TAG - 1))


def missing_id(field: int) -> int:
    return (field << FIELD_SHIFT) | MISSING


def shared_id(field: int) -> int:
    """The id of the field's shared row, read and trained by values seen too rarely to have their
    own (frequency admission, store/table.py); outside every real value and the missing id."""
    return (field << FIELD_SHIFT) | MISSING | 1


def shared_ids(schema: Schema) -> np.ndarray:
    """int64 (F + L,): shared_id of every field the model sees (single-id fields, then list fields)."""
    return np.array([shared_id(f) for f in range(schema.num_fields)], dtype=np.int64)


def features_from_columns(
    ints: np.ndarray,
    int_missing: np.ndarray,
    cats: np.ndarray,
    cat_missing: np.ndarray,
    schema: Schema,
    floats: np.ndarray | None = None,
    float_missing: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The one featurization core.

    ints int64 (n, I) + int_missing bool (n, I); cats int64 (n, C) + cat_missing bool (n, C), where
    cats hold the 32-bit value (hex32) or an already hashed string id (string encoding); floats
    float64 (n, R) + float_missing (n, R) for the schema's float fields (R = 0: None).
    Returns ids int64 (n, I + C) and dense float32 (n, I + R).
    """
    n, d = ints.shape
    fields = np.arange(schema.num_sparse, dtype=np.int64) << FIELD_SHIFT
    int_ids = fields[:d] | np.where(int_missing, MISSING, integer_buckets(ints))
    if schema.categorical_encoding == "hex32":
        cat_ids = fields[d:] | np.where(cat_missing, MISSING, cats)
    else:
        cat_ids = np.where(cat_missing, fields[d:] | MISSING, cats)
    dense = np.where(int_missing, np.float32(0.0), signed_log1p_array(np.where(int_missing, 0, ints)))
    if floats is not None and float_missing is not None and floats.shape[1]:
        dense = np.concatenate([dense, np.where(float_missing, 0.0, floats).astype(np.float32)], axis=1)
    return np.concatenate([int_ids, cat_ids], axis=1).astype(np.int64), dense.astype(np.float32)


def list_ids(values: Sequence[Sequence[str]], field: int, hex32: bool) -> tuple[np.ndarray, np.ndarray]:
    """One list field of n events -> (starts int64 (n + 1,), ids int64): an id per value, by the
    categories' rule (hex32: field << 33 | value; strings: hashed), the field's missing id for an
    event without values."""
    lengths = np.array([max(len(v), 1) for v in values], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat: list[int] = []
    for event_values in values:
        if not event_values:
            flat.append(missing_id(field))
        elif hex32:
            flat.extend((field << FIELD_SHIFT) | int(v, 16) for v in event_values)
        else:
            flat.extend(string_id(field, v) for v in event_values)
    return starts, np.array(flat, dtype=np.int64)


def event_ids(event: Event, schema: Schema) -> list[int]:
    """The sparse ids of one event, one per schema.sparse_fields entry."""
    return featurize([event], schema).ids[0].tolist()


def featurize(
    events: Sequence[Event],
    schema: Schema,
    partitions: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
) -> FeatureBatch:
    """Featurize decoded events into one FeatureBatch (see records.FeatureBatch for shapes)."""
    n, d, c, r = len(events), len(schema.integer_fields), len(schema.categorical_fields), len(schema.float_fields)
    raw_ints = [v for e in events for v in e.ints]
    int_missing = np.fromiter((v is None for v in raw_ints), dtype=bool, count=n * d).reshape(n, d)
    ints = np.fromiter((0 if v is None else v for v in raw_ints), dtype=np.int64, count=n * d).reshape(n, d)
    raw_cats = [v for e in events for v in e.cats]
    cat_missing = np.fromiter((v is None for v in raw_cats), dtype=bool, count=n * c).reshape(n, c)
    if schema.categorical_encoding == "hex32":
        values = (0 if v is None else int(v, 16) for v in raw_cats)
    else:
        values = (0 if v is None else string_id(d + i % c, v) for i, v in enumerate(raw_cats))
    cats = np.fromiter(values, dtype=np.int64, count=n * c).reshape(n, c)
    raw_floats = [v for e in events for v in e.floats]
    float_missing = np.fromiter((v is None for v in raw_floats), dtype=bool, count=n * r).reshape(n, r)
    floats = np.fromiter((0.0 if v is None else v for v in raw_floats), dtype=np.float64, count=n * r).reshape(n, r)
    ids, dense = features_from_columns(ints, int_missing, cats, cat_missing, schema, floats, float_missing)
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
        schema_name=schema.name,
        lists=tuple(
            list_ids([e.lists[j] for e in events], schema.num_sparse + j, schema.categorical_encoding == "hex32")
            for j in range(len(schema.list_fields))
        ),
    )
