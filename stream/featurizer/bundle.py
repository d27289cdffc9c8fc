"""Arrow bundles (stream/formats/arrow.py) checked and featurized column-wise.

Faust spends tens of microseconds per record, and JSON parsing alone costs ~7 us per event, so
high volume arrives as bundles. An Arrow bundle has one column per schema field (ints int64,
categories and event id as strings; null = missing value). Validation is vectorized; a row that
fails is rejected with the field named, the rest of the bundle goes on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from stream import rules
from stream.featurizer.featurize import FIELD_SHIFT, features_from_columns, featurize, missing_id, string_id
from stream.records import FeatureBatch, RawRecord, Rejected
from stream.schema import Schema

_HEX_LUT = np.zeros(256, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_SHIFTS = np.arange(28, -1, -4, dtype=np.int64)


def _hex_values(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """string column -> (value int64 (n,), missing bool (n,), bad bool (n,))."""
    column = column if column.offset == 0 else pa.concat_arrays([column])  # buffers from offset 0
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1)
    lengths = np.diff(offsets)
    if column.buffers()[2] is not None and np.all((lengths == 8) | (lengths == 0)):
        # the usual case (Criteo's categories are 8 digits): decode the byte buffer in place
        missing = lengths == 0
        if column.null_count:
            missing |= column.is_null().to_numpy(zero_copy_only=False)
        chars = np.frombuffer(column.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].reshape(-1, 8)
        present = lengths == 8
        nibbles = _HEX_LUT8[chars]  # (m, 8) uint8: pairs of nibbles make the 4 big-endian bytes
        packed = np.ascontiguousarray((nibbles[:, 0::2] << 4) | nibbles[:, 1::2])
        values = np.zeros(len(column), dtype=np.int64)
        values[present] = packed.view(">u4").reshape(-1)
        bad = np.zeros(len(column), dtype=bool)
        bad[present] = _not_all_hex(chars)
        return np.where(missing, 0, values), missing, bad & ~missing
    filled = pc.fill_null(column, "")
    missing = pc.equal(pc.binary_length(filled), 0).to_numpy(zero_copy_only=False)
    valid = pc.match_substring_regex(filled, f"^{rules.HEX32}$").to_numpy(zero_copy_only=False)
    padded = pc.utf8_lpad(pc.if_else(pa.array(valid), filled, "0"), 8, "0")
    padded = pa.array(padded.to_pylist(), pa.string()) if padded.offset else padded
    offsets = np.frombuffer(padded.buffers()[1], dtype=np.int32, count=len(padded) + 1)
    data = np.frombuffer(padded.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].reshape(-1, 8)
    values = (_HEX_LUT[data] << _SHIFTS).sum(axis=1)
    return values, missing, ~valid & ~missing


_HEX_OK = np.zeros(256, dtype=bool)
_HEX_OK[np.frombuffer(b"0123456789abcdefABCDEF", dtype=np.uint8)] = True
_HEX_OK8 = _HEX_OK.astype(np.uint8)
_HEX_LUT8 = _HEX_LUT.astype(np.uint8)
_ALL_HEX = np.frombuffer(bytes([1] * 8), dtype=np.uint64)[0]


def _not_all_hex(chars: np.ndarray) -> np.ndarray:
    """uint8 (m, 8) characters -> bool (m,): not all 8 hex (their 8 flag bytes read as one
    uint64 differ from 0x0101...01)."""
    return np.ascontiguousarray(_HEX_OK8[chars]).view(np.uint64).reshape(-1) != _ALL_HEX


def _hex_check(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """string column -> (missing bool (n,), bad bool (n,)) without decoding: what replay needs."""
    column = column if column.offset == 0 else pa.concat_arrays([column])  # buffers from offset 0
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1)
    lengths = np.diff(offsets)
    if column.null_count:
        lengths = np.where(column.is_null().to_numpy(zero_copy_only=False), 0, lengths)
    if column.buffers()[2] is not None and np.all((lengths == 8) | (lengths == 0)):
        # the usual 8-digit case: one vectorized pass over the byte buffer, nothing decoded
        missing = lengths == 0
        chars = np.frombuffer(column.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].reshape(-1, 8)
        bad = np.zeros(len(column), dtype=bool)
        bad[np.diff(offsets) == 8] = _not_all_hex(chars)
        return missing, bad & ~missing
    data = np.frombuffer(column.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    not_hex = (~_HEX_OK[data]).astype(np.int32)
    starts = offsets[:-1] - offsets[0]
    # non-hex characters per string (empty strings: 0); reduceat needs in-range starts
    counts = np.add.reduceat(not_hex, np.minimum(starts, max(len(data) - 1, 0))) if len(data) else np.zeros(len(starts))
    counts = np.where(lengths > 0, counts, 0)
    missing = lengths == 0
    return missing, ~missing & ((counts > 0) | (lengths > 8))


def _whole(record: RawRecord, schema: Schema, reason: str) -> tuple[FeatureBatch, list[Rejected]]:

    return featurize([], schema), [Rejected(record.partition, record.offset, record.value, reason)]


class _Reasons:
    """The first broken rule of each row (None: the row is good)."""

    def __init__(self, n: int) -> None:
        self.of_row: list[str | None] = [None] * n

    def flag(self, mask: np.ndarray, reason: str) -> None:
        for i in np.nonzero(mask)[0]:
            if self.of_row[i] is None:
                self.of_row[i] = reason

    def good(self) -> np.ndarray:
        return np.array([r is None for r in self.of_row], dtype=bool)


@dataclass(frozen=True, eq=False)
class CheckedTable:
    """A bundle-layout table's columns as numpy (n rows), and each row's first broken rule."""

    event_ids: list[str]
    ts: np.ndarray  # int64 (n,)
    label: np.ndarray  # int64 (n,), 0 where missing
    ints: np.ndarray  # int64 (n, I), 0 where missing
    int_missing: np.ndarray  # bool (n, I)
    floats: np.ndarray  # float64 (n, R), 0 where missing
    float_missing: np.ndarray  # bool (n, R)
    cats: np.ndarray  # int64 (n, C): hex32 values or hashed string ids
    cat_missing: np.ndarray  # bool (n, C)
    reasons: list[str | None]  # None for a good row
    lists: tuple[tuple[np.ndarray, np.ndarray], ...] = ()  # per list field (starts (n + 1,), ids): see FeatureBatch

    def good(self) -> np.ndarray:
        return np.array([r is None for r in self.reasons], dtype=bool)


def take_rows(starts: np.ndarray, ids: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One list field's (starts, ids) restricted to the rows where keep (n,) is True."""
    lengths = np.diff(starts)
    kept = np.concatenate([[0], np.cumsum(lengths[keep])]).astype(np.int64)
    return kept, ids[np.repeat(keep, lengths)]


def _list_column(
    column: pa.Array, name: str, field: int, schema: Schema, reasons: _Reasons, values_too: bool
) -> tuple[np.ndarray, np.ndarray]:
    """A list<string> column -> (starts (n + 1,), ids) by list_ids' rule (empty strings skipped, an
    event without values gets the missing id), flagging rows with too many or bad values."""
    n = len(column)
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    reasons.flag(lengths > rules.MAX_LIST_VALUES, rules.reason(name, rules.LIST_LONG))
    values = pc.list_flatten(column)  # nulls are no values; flatten keeps the order
    owner = np.repeat(np.arange(n), lengths)
    present = pc.fill_null(pc.not_equal(values, ""), False).to_numpy(zero_copy_only=False)
    hex32 = schema.categorical_encoding == "hex32"
    too_long = pc.fill_null(pc.utf8_length(values), 0).to_numpy(zero_copy_only=False) > rules.MAX_CATEGORY_CHARS
    reasons.flag(np.bincount(owner[too_long], minlength=n) > 0, rules.reason(name, rules.CATEGORY_LONG))
    if hex32:
        ids, _, bad = _hex_values(values) if len(values) else (np.zeros(0, np.int64), None, np.zeros(0, bool))
        reasons.flag(np.bincount(owner[bad], minlength=n) > 0, rules.reason(name, rules.CATEGORY_HEX))
        ids = (field << FIELD_SHIFT) | ids
    elif values_too:
        ids = np.array([string_id(field, v) if v else 0 for v in values.to_pylist()], dtype=np.int64)
    else:
        ids = np.zeros(len(values), np.int64)
    counts = np.bincount(owner[present], minlength=n)
    empty = counts == 0  # no values: the missing id stands in
    owner_all = np.concatenate([owner[present], np.nonzero(empty)[0]])
    ids_all = np.concatenate([ids[present], np.full(int(empty.sum()), missing_id(field), np.int64)])
    order = np.argsort(owner_all, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.maximum(counts, 1))]).astype(np.int64)
    return starts, ids_all[order]


def _column(table: pa.Table, name: str) -> pa.Array:
    return table.column(name).combine_chunks() if table.num_rows else pa.array([], table.schema.field(name).type)


def _number_column(table: pa.Table, name: str, kind: str) -> tuple[np.ndarray, np.ndarray] | str:
    """An integer (kind "int") or numeric (kind "float") column -> (values with 0 for null, null
    bool (n,)), or why the column has the wrong type."""
    column = _column(table, name)
    t = column.type
    ok = pa.types.is_integer(t) or pa.types.is_null(t) or (kind == "float" and pa.types.is_floating(t))
    if not ok:
        return f"{name}: column type {t}, expected {'integers' if kind == 'int' else 'numbers'}"
    # an integer past 2^53 read as a number is rounded, as float() rounds it in decode.py (a safe
    # cast raised: a label of 2^62 took the featurizer down)
    column = column.cast(pa.int64()) if kind == "int" else column.cast(pa.float64(), safe=False)
    if column.null_count == 0:
        return column.to_numpy(zero_copy_only=False), np.zeros(len(column), dtype=bool)
    null = column.is_null().to_numpy(zero_copy_only=False)
    return np.where(null, 0, column.to_numpy(zero_copy_only=False)), null


def _string_columns(table: pa.Table, names: Sequence[str]) -> list[pa.Array] | str:
    columns = []
    for name in names:
        column = _column(table, name)
        kind = column.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
            return f"{name}: column type {kind}, expected strings"
        columns.append(column.cast(pa.string()))
    return columns


def _categories(
    columns: list[pa.Array], n: int, schema: Schema, reasons: _Reasons, values_too: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Category columns -> (values int64 (n, C), missing bool (n, C)), flagging the rows that break a
    rule. values_too=False checks only (values come back as zeros): replay needs no ids."""
    c = len(columns)
    if not c:
        return np.zeros((n, 0), np.int64), np.zeros((n, 0), bool)
    joined = pa.concat_arrays(columns)  # all columns in one pass: pyarrow's per-call overhead dominates otherwise
    too_long = pc.fill_null(pc.utf8_length(joined), 0).to_numpy(zero_copy_only=False).reshape(c, n).T
    too_long = too_long > rules.MAX_CATEGORY_CHARS
    if schema.categorical_encoding == "hex32" and not values_too:
        missing, bad = (a.reshape(c, n).T for a in _hex_check(joined))
        values = np.zeros((n, c), np.int64)
    elif schema.categorical_encoding == "hex32":
        values, missing, bad = (a.reshape(c, n).T for a in _hex_values(joined))
    elif not values_too:
        missing = pc.fill_null(pc.equal(joined, ""), True).to_numpy(zero_copy_only=False).reshape(c, n).T
        values, bad = np.zeros((n, c), np.int64), np.zeros((n, c), dtype=bool)
    else:
        first = len(schema.integer_fields)
        raw = [column.to_pylist() for column in columns]
        missing = np.array([[not v for v in col] for col in raw], dtype=bool).T.reshape(n, c)
        values = np.array(
            [[string_id(first + f, v) if v else 0 for v in col] for f, col in enumerate(raw)], dtype=np.int64
        ).T.reshape(n, c)
        bad = np.zeros((n, c), dtype=bool)
    for f, name in enumerate(schema.categorical_fields):
        reasons.flag(too_long[:, f], rules.reason(name, rules.CATEGORY_LONG))
        reasons.flag(bad[:, f], rules.reason(name, rules.CATEGORY_HEX))
    return values, missing


def check_table(
    table: pa.Table,
    schema: Schema,
    unparsed: Mapping[str, tuple[np.ndarray, str]] | None = None,
    values_too: bool = True,
) -> CheckedTable | str:
    """Check every row of a bundle-layout table against rules.py, in the order decode.py checks a
    JSON event (a row's reason is its first broken rule). `unparsed`: per field, the rows whose text
    could not be parsed and the rule that says so (replay reads text); values_too=False skips
    decoding category ids (replay only checks). Returns why the whole table is unusable instead (a
    missing column or a column of the wrong type)."""
    unparsed = unparsed or {}
    for name in (schema.event_id, schema.timestamp, schema.label, *schema.dense_fields, *schema.categorical_fields):
        if name not in table.column_names:
            return rules.reason(name, f"{rules.MISSING_FIELD} (no such column in the Arrow bundle)")
    n = table.num_rows
    numbers = {}
    # the label may come as integers or floats (1.0, -0.0), as JSON allows: its rule checks the values
    for name, kind in [(schema.timestamp, "int"), (schema.label, "float")] + [
        (f, "int") for f in schema.integer_fields
    ]:
        numbers[name] = _number_column(table, name, kind)
    for name in schema.float_fields:
        numbers[name] = _number_column(table, name, "float")
    ids_col = _column(table, schema.event_id)
    if not (pa.types.is_integer(ids_col.type) or pa.types.is_string(ids_col.type) or pa.types.is_null(ids_col.type)):
        return f"{schema.event_id}: column type {ids_col.type}, expected strings or integers"
    columns = _string_columns(table, schema.categorical_fields)
    for name in schema.list_fields:
        if name not in table.column_names:
            return rules.reason(name, f"{rules.MISSING_FIELD} (no such column in the Arrow bundle)")
        kind = table.schema.field(name).type
        if not (pa.types.is_null(kind) or (pa.types.is_list(kind) and pa.types.is_string(kind.value_type))):
            return f"{name}: column type {kind}, expected lists of strings"
    for result in (*numbers.values(), columns):
        if isinstance(result, str):
            return result
    parsed = {k: v for k, v in numbers.items() if not isinstance(v, str)}

    reasons = _Reasons(n)

    def flag(name: str, mask: np.ndarray, rule: str) -> None:
        """The field's turn: first its unparsed text, then its own rule."""
        if name in unparsed:
            text_mask, text_rule = unparsed[name]
            reasons.flag(text_mask, rules.reason(name, text_rule))
        reasons.flag(mask, rules.reason(name, rule))

    id_strings = ids_col.cast(pa.string())
    event_ids = id_strings.to_pylist()
    flag(schema.event_id, np.array([not e for e in event_ids], dtype=bool), rules.EVENT_ID)
    id_lengths = pc.fill_null(pc.utf8_length(id_strings), 0).to_numpy(zero_copy_only=False)
    reasons.flag(rules.long_event_ids(id_lengths), rules.reason(schema.event_id, rules.EVENT_ID_LONG))
    ts, ts_null = parsed[schema.timestamp]
    flag(schema.timestamp, rules.bad_timestamps(ts, ts_null), rules.TIMESTAMP)
    label_values, label_null = parsed[schema.label]
    flag(schema.label, label_null, rules.LABEL_MISSING)
    bad_label = rules.bad_labels(label_values)
    reasons.flag(bad_label, rules.reason(schema.label, rules.LABEL))
    label = np.where(bad_label, 0, label_values).astype(np.int64)
    for name in schema.integer_fields:
        values, null = parsed[name]
        flag(name, ~null & rules.integers_out_of_range(values), rules.INTEGER_RANGE)
    for name in schema.float_fields:
        values, null = parsed[name]
        flag(name, rules.bad_floats(values, null), rules.FLOAT)
    cats, cat_missing = _categories(columns, n, schema, reasons, values_too)  # type: ignore[arg-type]
    lists = []
    for j, name in enumerate(schema.list_fields):
        column = _column(table, name)
        column = column.cast(pa.list_(pa.string())) if pa.types.is_null(column.type) else column
        lists.append(_list_column(column, name, schema.num_sparse + j, schema, reasons, values_too))

    def stack(names: Sequence[str], i: int, dtype: type) -> np.ndarray:
        return np.stack([parsed[f][i] for f in names], axis=1) if names else np.zeros((n, 0), dtype)

    return CheckedTable(
        event_ids=event_ids,
        ts=ts,
        label=label,
        ints=stack(schema.integer_fields, 0, np.int64),
        int_missing=stack(schema.integer_fields, 1, bool),
        floats=stack(schema.float_fields, 0, np.float64),
        float_missing=stack(schema.float_fields, 1, bool),
        cats=cats,
        cat_missing=cat_missing,
        reasons=reasons.of_row,
        lists=tuple(lists),
    )


def featurize_arrow_bundle(record: RawRecord, schema: Schema) -> tuple[FeatureBatch, list[Rejected]]:
    """One Arrow bundle -> its good rows featurized + a Rejected per bad row (or one for a bad bundle)."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(record.value)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:  # a truncated stream raises OSError, not ArrowInvalid
        return _whole(record, schema, f"record: not a readable Arrow bundle ({str(exc)[:200]})")
    checked = check_table(table, schema)
    if isinstance(checked, str):
        return _whole(record, schema, checked)
    ok = checked.good()
    rejected = []
    if not ok.all():
        rows = table.to_pylist()
        for i in np.nonzero(~ok)[0]:
            rejected.append(Rejected(record.partition, record.offset, orjson.dumps(rows[i]), str(checked.reasons[i])))
    n = len(ok)
    partitions, offsets = np.full(n, record.partition, dtype=np.int32), np.full(n, record.offset, dtype=np.int64)
    return checked_features(checked, ok, partitions, offsets, schema), rejected


def checked_features(
    c: CheckedTable, ok: np.ndarray, partitions: np.ndarray, offsets: np.ndarray, schema: Schema
) -> FeatureBatch:
    """The rows kept by ok bool (n,) of a checked table, featurized; partitions int32 (n,) and
    offsets int64 (n,) are each row's source record."""
    ids, dense = features_from_columns(
        c.ints[ok], c.int_missing[ok], c.cats[ok], c.cat_missing[ok], schema, c.floats[ok], c.float_missing[ok]
    )
    return FeatureBatch(
        labels=c.label[ok].astype(np.float32),
        dense=dense,
        ids=ids,
        ts=c.ts[ok].astype(np.int64),
        event_ids=tuple(e for e, keep in zip(c.event_ids, ok) if keep),
        partitions=partitions[ok].astype(np.int32),
        offsets=offsets[ok].astype(np.int64),
        schema_hash=schema.hash,
        schema_name=schema.name,
        lists=tuple(take_rows(starts, ids, ok) for starts, ids in c.lists),
    )
