"""FeatureBatch <-> Arrow IPC stream bytes (one record batch), the value of `adstream.batches`.

Columns: label f32, dense fixed_list<f32>[D], ids fixed_list<i64>[F], ts i64, event_id str,
partition i32, offset i64, then row i32 when the batch has rows (FeatureBatch.rows: written by
the featurizer in source order; a batch without the column has none). Schema metadata carries the
schema hash, a format version and the two widths (Arrow has no fixed list of size 0: a schema
without dense fields sends a null column). List fields follow as list<i64> columns `list0`,
`list1`, ... (their offsets are the starts).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stream.errors import BatchCodecError
from stream.records import FeatureBatch

FORMAT_VERSION = b"1"


def encode_batch(batch: FeatureBatch) -> bytes:
    n = len(batch)
    d = batch.dense.shape[1]
    f = batch.ids.shape[1]
    columns = [
        pa.array(batch.labels, type=pa.float32()),
        _fixed_list(batch.dense, pa.float32()),
        _fixed_list(batch.ids, pa.int64()),
        pa.array(batch.ts, type=pa.int64()),
        pa.array(batch.event_ids, type=pa.string()),
        pa.array(batch.partitions, type=pa.int32()),
        pa.array(batch.offsets, type=pa.int64()),
    ]
    names = ["label", "dense", "ids", "ts", "event_id", "partition", "offset"]
    if batch.rows is not None:
        columns.append(pa.array(batch.rows, type=pa.int32()))
        names.append("row")
    for j, (starts, ids) in enumerate(batch.lists):
        columns.append(pa.ListArray.from_arrays(pa.array(starts, pa.int32()), pa.array(ids, pa.int64())))
        names.append(f"list{j}")
    meta = {
        b"schema_hash": batch.schema_hash.encode(),
        b"schema_name": batch.schema_name.encode(),
        b"format": FORMAT_VERSION,
        b"dense_width": str(d).encode(),
        b"ids_width": str(f).encode(),
    }
    record_batch = pa.RecordBatch.from_arrays(columns, names=names).replace_schema_metadata(meta)
    assert record_batch.num_rows == n
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, record_batch.schema) as writer:
        writer.write_batch(record_batch)
    return sink.getvalue().to_pybytes()


def _fixed_list(values: np.ndarray, kind: pa.DataType) -> pa.Array:
    """(n, w) -> fixed_list<kind>[w]; w = 0 -> a null column (the width travels in the metadata)."""
    if values.shape[1] == 0:
        return pa.nulls(len(values))
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), kind), values.shape[1])


def decode_batch(data: bytes) -> FeatureBatch:
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        table = reader.read_all()
    except pa.ArrowInvalid as exc:
        raise BatchCodecError(f"batch: not an Arrow IPC stream ({exc})") from None
    meta = table.schema.metadata or {}
    if meta.get(b"format") != FORMAT_VERSION:
        raise BatchCodecError(f"batch: format {meta.get(b'format')!r}, this version reads {FORMAT_VERSION!r}")
    table = table.combine_chunks()
    n = table.num_rows

    def fixed(name: str, dtype: type) -> np.ndarray:
        kind = table.schema.field(name).type
        width = int(meta.get(f"{name}_width".encode(), b"-1"))
        if width < 0:  # written before the widths were in the metadata
            width = kind.list_size
        if n == 0 or width == 0 or pa.types.is_null(kind):
            return np.zeros((n, max(width, 0)), dtype=dtype)
        col = table.column(name).chunk(0)
        return col.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(n, width)

    return FeatureBatch(
        labels=table.column("label").to_numpy().astype(np.float32, copy=False),
        dense=fixed("dense", np.float32),
        ids=fixed("ids", np.int64),
        ts=table.column("ts").to_numpy().astype(np.int64, copy=False),
        event_ids=tuple(table.column("event_id").to_pylist()),
        partitions=table.column("partition").to_numpy().astype(np.int32, copy=False),
        offsets=table.column("offset").to_numpy().astype(np.int64, copy=False),
        schema_hash=meta[b"schema_hash"].decode(),
        schema_name=meta.get(b"schema_name", b"").decode(),  # (batches written before it was carried: "")
        lists=tuple(_list(table.column(name)) for name in table.column_names if name.startswith("list")),
        rows=table.column("row").to_numpy().astype(np.int32, copy=False) if "row" in table.column_names else None,
    )


def _list(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    starts = array.offsets.to_numpy().astype(np.int64)
    ids = array.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return starts - starts[0], ids[starts[0] : starts[-1]]
