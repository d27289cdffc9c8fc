"""Arrow bundles featurize exactly like the same events sent one JSON object at a time."""

import numpy as np
import orjson
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.featurizer.bundle import featurize_arrow_bundle
from stream.featurizer.ingest import featurize_records
from stream.formats.arrow import encode_event_bundle
from stream.records import RawRecord
from stream.schema import load_schema

SCHEMA = load_schema()
hex_values = st.one_of(
    st.none(),
    st.just(""),
    st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"),
    st.integers(0, 4095).map(lambda v: f"{v:X}"),
)
int_values = st.one_of(st.none(), st.integers(-5, 10**9))


@st.composite
def events(draw, i):
    event = {"event_id": f"h{i}", "ts": draw(st.integers(0, 2**40)), "label": draw(st.integers(0, 1))}
    event.update({f: draw(int_values) for f in SCHEMA.integer_fields})
    event.update({f: draw(hex_values) for f in SCHEMA.categorical_fields})
    return event


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(*[events(i) for i in range(n)])))
def test_arrow_bundle_equals_json_events(batch):
    batch = list(batch)
    json_records = [RawRecord(0, i, orjson.dumps(e)) for i, e in enumerate(batch)]
    from_json, rejected = featurize_records(json_records, SCHEMA)
    assert not rejected
    from_arrow, rejected = featurize_records([RawRecord(1, 9, encode_event_bundle(batch, SCHEMA))], SCHEMA)
    assert not rejected
    np.testing.assert_array_equal(from_arrow.ids, from_json.ids)
    np.testing.assert_array_equal(from_arrow.dense, from_json.dense)
    np.testing.assert_array_equal(from_arrow.labels, from_json.labels)
    np.testing.assert_array_equal(from_arrow.ts, from_json.ts)
    assert from_arrow.event_ids == from_json.event_ids
    assert set(from_arrow.offsets.tolist()) == {9}


def good(i):
    event = {"event_id": f"g{i}", "ts": i, "label": 0}
    event.update({f: i for f in SCHEMA.integer_fields})
    event.update({f: "0a0b0c0d" for f in SCHEMA.categorical_fields})
    return event


def test_bad_rows_are_rejected_by_field_and_the_rest_kept():
    rows = [good(0), {**good(1), "C5": "zz"}, {**good(2), "label": 3}, {**good(3), "event_id": ""}, good(4)]
    batch, rejected = featurize_arrow_bundle(RawRecord(2, 7, encode_event_bundle(rows, SCHEMA)), SCHEMA)
    assert batch.event_ids == ("g0", "g4")
    reasons = [r.reason for r in rejected]
    assert reasons[0].startswith("C5:") and reasons[1].startswith("label:") and reasons[2].startswith("event_id:")
    assert orjson.loads(rejected[0].value)["event_id"] == "g1"  # the DLQ gets the row itself


def test_unreadable_or_incomplete_bundles_are_rejected_whole():
    batch, rejected = featurize_arrow_bundle(RawRecord(0, 1, b"\xff\xff\xff\xffjunk"), SCHEMA)
    assert len(batch) == 0 and "not a readable Arrow bundle" in rejected[0].reason
    table = pa.RecordBatch.from_pydict({"event_id": ["a"], "ts": [1]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_batch(table)
    _, rejected = featurize_arrow_bundle(RawRecord(0, 2, sink.getvalue().to_pybytes()), SCHEMA)
    assert rejected[0].reason == "label: missing field (no such column in the Arrow bundle)"
    wrong = [{**good(0), "I1": None}]
    value = encode_event_bundle(wrong, SCHEMA)
    assert featurize_arrow_bundle(RawRecord(0, 3, value), SCHEMA)[0].event_ids == ("g0",)
