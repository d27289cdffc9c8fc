import math

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream.errors import StreamError
from stream.featurizer.decode import event_from_mapping
from stream.featurizer.featurize import (
    FIELD_SHIFT,
    MISSING,
    event_ids,
    featurize,
    integer_bucket,
    missing_id,
    signed_log1p,
    string_id,
)
from stream.featurizer.ingest import featurize_records
from stream.records import FeatureBatch, RawRecord
from stream.schema import schema_from_dict
from tests.helpers import criteo_event


def test_hex_ids_are_field_and_value(schema):
    event = event_from_mapping(criteo_event(0, C1="ffffffff", C2="00000000"), schema)
    ids = event_ids(event, schema)
    assert ids[13] == (13 << FIELD_SHIFT) | 0xFFFFFFFF
    assert ids[14] == 14 << FIELD_SHIFT
    assert len(ids) == 39 and all(0 <= i < 2**63 for i in ids)


def test_missing_has_its_own_id_outside_real_values(schema):
    event = event_from_mapping(criteo_event(0, C1=None, I1=None), schema)
    ids = event_ids(event, schema)
    assert ids[13] == missing_id(13) and ids[0] == missing_id(0)
    real = event_ids(event_from_mapping(criteo_event(0, C1="ffffffff"), schema), schema)[13]
    assert real != ids[13]
    assert ids[13] & MISSING and not real & MISSING


@given(st.lists(st.tuples(st.integers(13, 38), st.integers(0, 2**32 - 1)), min_size=2, max_size=50, unique=True))
def test_category_ids_collision_free(pairs):
    ids = {(f << FIELD_SHIFT) | v for f, v in pairs}
    assert len(ids) == len(pairs)


@given(st.integers(-1000, 10**12), st.integers(-1000, 10**12))
def test_integer_buckets_are_monotone(a, b):
    lo, hi = min(a, b), max(a, b)
    assert integer_bucket(lo) - 2**31 <= integer_bucket(hi) - 2**31  # the bucket code keeps the order


def test_small_counts_keep_exact_buckets():
    assert len({integer_bucket(v) for v in (-1, 0, 1, 2, 3)}) == 5
    assert integer_bucket(1000) == integer_bucket(1001)  # same log bucket


def test_dense_is_signed_log1p(schema):
    batch = featurize([event_from_mapping(criteo_event(0, I1=-3, I2=None, I3=100), schema)], schema)
    assert batch.dense.shape == (1, 13) and batch.ids.shape == (1, 39)
    assert math.isclose(batch.dense[0, 0], -math.log(4), rel_tol=1e-6)
    assert batch.dense[0, 1] == 0.0
    assert math.isclose(batch.dense[0, 2], signed_log1p(100), rel_tol=1e-6)


def test_string_encoding_hashes_stably():
    schema = schema_from_dict(
        {
            "name": "s",
            "label": "y",
            "event_id": "id",
            "timestamp": "t",
            "categorical_encoding": "string",
            "integer_fields": [],
            "categorical_fields": ["site", "app"],
        }
    )
    event = event_from_mapping({"id": "a", "t": 1, "y": 0, "site": "news.com", "app": None}, schema)
    ids = event_ids(event, schema)
    assert ids[0] == string_id(0, "news.com") and ids[0] >= 1 << 62
    assert string_id(0, "news.com") != string_id(1, "news.com")
    assert ids[1] == missing_id(1)


def test_featurize_records_splits_good_and_bad(schema):
    good = orjson.dumps(criteo_event(1))
    bundle = b"\n".join([orjson.dumps(criteo_event(2)), b"{bad json", orjson.dumps(criteo_event(3))])
    records = [RawRecord(0, 10, good), RawRecord(1, 20, bundle), RawRecord(1, 21, orjson.dumps({"x": 1}))]
    batch, rejected = featurize_records(records, schema)
    assert batch.event_ids == ("e1", "e2", "e3")
    assert batch.partitions.tolist() == [0, 1, 1] and batch.offsets.tolist() == [10, 20, 20]
    assert [(r.partition, r.offset) for r in rejected] == [(1, 20), (1, 21)]
    assert "not valid JSON" in rejected[0].reason and "event_id: missing field" in rejected[1].reason
    assert np.isfinite(batch.labels).all()


def test_split_batch_keeps_every_event(schema):
    events = [event_from_mapping(criteo_event(i), schema) for i in range(10)]
    batch = featurize(events, schema, [0] * 10, list(range(10)))
    parts = batch.split(4)
    assert [len(p) for p in parts] == [4, 4, 2]
    assert sum((p.event_ids for p in parts), ()) == batch.event_ids
    np.testing.assert_array_equal(np.concatenate([p.ids for p in parts]), batch.ids)
    assert featurize([], schema).split(4) == []


def test_concat_of_the_split_is_the_batch_and_empty_has_the_widths(schema):
    events = [event_from_mapping(criteo_event(i), schema) for i in range(7)]
    batch = featurize(events, schema, [1] * 7, list(range(7)))
    again = FeatureBatch.concat(batch.split(3))
    for name in ("labels", "dense", "ids", "ts", "partitions", "offsets"):
        np.testing.assert_array_equal(getattr(again, name), getattr(batch, name))
    assert again.event_ids == batch.event_ids and again.schema_hash == batch.schema_hash
    empty = FeatureBatch.empty(schema.num_dense, schema.num_sparse, schema.hash)
    assert len(empty) == 0 and empty.ids.shape == (0, schema.num_sparse) and empty.dense.shape == (0, schema.num_dense)
    assert len(FeatureBatch.concat([empty, batch])) == 7
    with pytest.raises(StreamError, match="schemas"):
        FeatureBatch.concat([batch, FeatureBatch.empty(1, 1, "other")])


def test_a_record_that_crashes_featurize_costs_only_itself(schema, monkeypatch):
    """A bug a check missed (injected here) rejects the one record it hits; its neighbours still
    reach the batch."""
    import orjson

    import stream.featurizer.json_batch as json_batch_module
    from stream.featurizer.ingest import featurize_isolating
    from stream.records import RawRecord
    from tests.helpers import criteo_event

    real = json_batch_module.checked_features  # where JSON events are featurized

    def fragile(checked, *args, **kwargs):
        if "e3" in checked.event_ids:
            raise OverflowError("a value no rule caught")
        return real(checked, *args, **kwargs)

    monkeypatch.setattr(json_batch_module, "checked_features", fragile)
    records = [RawRecord(0, i, orjson.dumps(criteo_event(i))) for i in range(6)]
    batch, rejected = featurize_isolating(records, schema)
    assert list(batch.event_ids) == ["e0", "e1", "e2", "e4", "e5"]
    assert [(r.offset, r.reason) for r in rejected] == [(3, "record: featurizer crashed (OverflowError)")]


def test_a_timestamp_past_the_int64_range_is_a_reason_not_a_crash(schema):
    import orjson

    from stream.featurizer.ingest import featurize_records
    from stream.records import RawRecord
    from tests.helpers import criteo_event

    value = orjson.dumps(criteo_event(0)).replace(b'"ts":1700000000000', b'"ts":' + str(2**63).encode())
    batch, rejected = featurize_records([RawRecord(0, 0, value)], schema)
    assert len(batch) == 0 and rejected[0].reason == "ts: must be a non-negative integer (ms) below 2^62"
