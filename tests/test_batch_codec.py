import dataclasses

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.errors import BatchCodecError
from stream.formats.batch_codec import decode_batch, encode_batch
from tests.helpers import random_feature_batch


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 300), st.integers(0, 10_000))
def test_round_trip(n, seed):
    batch = random_feature_batch(n, seed)
    back = decode_batch(encode_batch(batch))
    assert len(back) == n and back.schema_hash == "abc123"
    for name in ("labels", "dense", "ids", "ts", "partitions", "offsets"):
        np.testing.assert_array_equal(getattr(back, name), getattr(batch, name))
    assert back.event_ids == batch.event_ids
    assert back.ids.shape == (n, 39) and back.dense.shape == (n, 13)


def test_1024_criteo_events_fit_under_one_megabyte():
    assert len(encode_batch(random_feature_batch(1024))) < 1 << 20


def test_garbage_and_foreign_batches_are_refused():
    with pytest.raises(BatchCodecError, match="not an Arrow IPC stream"):
        decode_batch(b"garbage")
    table = pa.table({"x": [1, 2]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(BatchCodecError, match="format"):
        decode_batch(sink.getvalue().to_pybytes())


def test_a_schema_without_dense_fields_round_trips():
    batch = random_feature_batch(5)
    no_dense = dataclasses.replace(batch, dense=np.zeros((5, 0), np.float32))
    back = decode_batch(encode_batch(no_dense))
    assert back.dense.shape == (5, 0) and np.array_equal(back.ids, batch.ids)
    empty = decode_batch(encode_batch(no_dense.slice(0, 0)))
    assert empty.dense.shape == (0, 0) and empty.ids.shape == (0, batch.ids.shape[1])


def test_a_batch_carries_its_schemas_name_so_a_trainer_of_another_can_say_which(schema):
    """#29 item 1: batches carried the hash alone; a schema not bundled was '(not a bundled schema) <hash>'."""
    from stream.featurizer.decode import event_from_mapping
    from stream.featurizer.featurize import featurize
    from stream.records import FeatureBatch
    from tests.helpers import criteo_event
    from trainer.source import schema_label

    batch = featurize([event_from_mapping(criteo_event(i), schema) for i in range(4)], schema)
    back = decode_batch(encode_batch(batch))
    assert back.schema_name == schema.name == "criteo" and back.slice(0, 2).schema_name == "criteo"
    assert FeatureBatch.concat([back, back]).schema_name == "criteo"
    assert decode_batch(encode_batch(random_feature_batch(3))).schema_name == ""  # written without one
    mine = dataclasses.replace(schema, name="mylog", hash="0123456789abcdef")  # a schema of the user's own
    assert schema_label(mine.hash, "mylog") == f"mylog ({mine.hash})"
    assert schema_label(mine.hash) == f"(not a bundled schema) {mine.hash}"
