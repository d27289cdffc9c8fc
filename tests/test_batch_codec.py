import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.batch_codec import decode_batch, encode_batch
from stream.errors import BatchCodecError
from stream.records import FeatureBatch


def make_batch(n: int, seed: int = 0) -> FeatureBatch:
    rng = np.random.default_rng(seed)
    return FeatureBatch(
        labels=rng.integers(0, 2, n).astype(np.float32),
        dense=rng.normal(size=(n, 13)).astype(np.float32),
        ids=rng.integers(0, 2**63 - 1, size=(n, 39), dtype=np.int64),
        ts=rng.integers(0, 2**40, n),
        event_ids=tuple(f"ev-{i}" for i in range(n)),
        partitions=rng.integers(0, 4, n).astype(np.int32),
        offsets=rng.integers(0, 2**40, n),
        schema_hash="abc123",
    )


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 300), st.integers(0, 10_000))
def test_round_trip(n, seed):
    batch = make_batch(n, seed)
    back = decode_batch(encode_batch(batch))
    assert len(back) == n and back.schema_hash == "abc123"
    for name in ("labels", "dense", "ids", "ts", "partitions", "offsets"):
        np.testing.assert_array_equal(getattr(back, name), getattr(batch, name))
    assert back.event_ids == batch.event_ids
    assert back.ids.shape == (n, 39) and back.dense.shape == (n, 13)


def test_1024_criteo_events_fit_under_one_megabyte():
    assert len(encode_batch(make_batch(1024))) < 1 << 20


def test_garbage_and_foreign_batches_are_refused():
    with pytest.raises(BatchCodecError, match="not an Arrow IPC stream"):
        decode_batch(b"garbage")
    table = pa.table({"x": [1, 2]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(BatchCodecError, match="format"):
        decode_batch(sink.getvalue().to_pybytes())
