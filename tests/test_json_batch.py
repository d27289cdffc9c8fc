"""The column path for JSON events (stream/featurizer/json_batch.py) == decode.py's event-at-a-time path: the
same batch (ids, dense, labels, times, event ids, sources, lists) and the same rejects (source, the
event's bytes, the reason, in order), whatever mix of good and bad events arrives."""

from __future__ import annotations

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream.errors import DecodeError
from stream.featurizer.decode import decode_event
from stream.featurizer.featurize import featurize
from stream.featurizer.ingest import featurize_records
from stream.featurizer.json_batch import featurize_json_events
from stream.records import RawRecord, Rejected
from stream.schema import load_schema, schema_from_dict
from tests.helpers import criteo_event

CRITEO, TAGS, AVAZU = load_schema("criteo"), load_schema("criteo_tags"), load_schema("avazu")
PRICED = schema_from_dict(
    {
        "name": "priced",
        "label": "y",
        "event_id": "id",
        "timestamp": "t",
        "categorical_encoding": "string",
        "integer_fields": ["n", "views"],
        "float_fields": ["price", "bid"],
        "categorical_fields": ["ad", "site"],
    }
)

# values a field can hold on the wire, good and bad (JSON types only: what orjson gives back)
ODD = st.sampled_from([None, "", True, False, 1.5, -3, 0, 1, 2, 1 << 62, -(1 << 62), 1 << 63, "zz", "a" * 300])
HEX = st.integers(0, 0xFFFFFFFF).map(lambda v: f"{v:08x}") | st.sampled_from(["123456789", "0", "fFfF", "g1"])
TEXT = st.text("abcxyz", max_size=4)
TAG_LISTS = st.none() | st.lists(HEX | st.just("") | st.just(7), max_size=4)


def good_event(schema, i: int) -> dict[str, object]:
    event: dict[str, object] = {schema.event_id: f"e{i}", schema.timestamp: 1_700_000_000_000 + i, schema.label: i % 2}
    event.update({name: i % 7 for name in schema.integer_fields})
    event.update({name: 0.25 * i for name in schema.float_fields})
    hex32 = schema.categorical_encoding == "hex32"
    event.update({name: f"{i:08x}" if hex32 else f"v{i}" for name in schema.categorical_fields})
    event.update({name: [f"{i:08x}"] for name in schema.list_fields})
    return event


@st.composite
def events(draw, schema):
    """A good event with a few fields changed (to anything: good, bad, absent), or not an object."""
    i = draw(st.integers(0, 10_000))
    if draw(st.integers(0, 30)) == 0:
        return draw(st.sampled_from([[1, 2], 5, "text", None]))
    event = good_event(schema, i)
    names = [schema.event_id, schema.timestamp, schema.label, *schema.dense_fields, *schema.categorical_fields]
    for name in draw(st.lists(st.sampled_from(names + list(schema.list_fields)), max_size=3)):
        if draw(st.integers(0, 9)) == 0:
            event.pop(name, None)
        elif name in schema.list_fields:
            event[name] = draw(TAG_LISTS)
        elif name in schema.categorical_fields:
            values = HEX if schema.categorical_encoding == "hex32" else TEXT
            event[name] = draw(values) if draw(st.booleans()) else draw(ODD)
        else:
            event[name] = draw(ODD | st.integers(-5, 50))
    return event


def decoded(line: bytes, schema):
    """decode.py's verdict on one event: the Event, or the reason it is refused."""
    try:
        return decode_event(line, schema)
    except DecodeError as exc:
        return str(exc)


def one_by_one(objs, lines, partitions, offsets, schema):
    """The reference: decode.py per event (from its bytes), then featurize the good ones."""
    verdicts = [decoded(line, schema) for line in lines]
    keep = [i for i, v in enumerate(verdicts) if not isinstance(v, str)]
    rejected = [Rejected(partitions[i], offsets[i], lines[i], v) for i, v in enumerate(verdicts) if isinstance(v, str)]
    batch = featurize([verdicts[i] for i in keep], schema, [partitions[i] for i in keep], [offsets[i] for i in keep])
    return batch, rejected


def assert_same(got, want):
    (batch, rejected), (ref, ref_rejected) = got, want
    assert batch.event_ids == ref.event_ids
    for name in ("labels", "dense", "ids", "ts", "partitions", "offsets"):
        np.testing.assert_array_equal(getattr(batch, name), getattr(ref, name), err_msg=name)
    assert len(batch.lists) == len(ref.lists)
    for (starts, ids), (ref_starts, ref_ids) in zip(batch.lists, ref.lists):
        np.testing.assert_array_equal(starts, ref_starts)
        np.testing.assert_array_equal(ids, ref_ids)
    assert [(r.partition, r.offset, r.value, r.reason) for r in rejected] == [
        (r.partition, r.offset, r.value, r.reason) for r in ref_rejected
    ]


def check(schema, objs):
    lines = [orjson.dumps(o) for o in objs]
    partitions = [i % 3 for i in range(len(objs))]
    offsets = list(range(100, 100 + len(objs)))
    assert_same(
        featurize_json_events(objs, lines, partitions, offsets, schema),
        one_by_one(objs, lines, partitions, offsets, schema),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_column_path_equals_decoding_one_event_at_a_time(data):
    for schema in (CRITEO, TAGS, AVAZU, PRICED):
        check(schema, data.draw(st.lists(events(schema), max_size=40), label=schema.name))


def test_good_events_take_the_column_path_and_bad_ones_keep_their_order(schema, monkeypatch):
    """All-good events are featurized in one column pass (decode.py is never called); one with a
    wrong type in the middle goes alone through decode.py, and the batch keeps the events' order."""
    import stream.featurizer.json_batch

    decoded = []
    real = stream.featurizer.json_batch.event_from_mapping  # decode.py's, as json_batch.py calls it
    monkeypatch.setattr(
        stream.featurizer.json_batch, "event_from_mapping", lambda obj, *a: decoded.append(obj) or real(obj, *a)
    )
    objs = [criteo_event(i) for i in range(6)]
    check(schema, objs)
    assert decoded == [] or len(decoded) == len(objs)  # the reference decodes every event itself
    decoded.clear()
    featurize_json_events(objs, [orjson.dumps(o) for o in objs], [0] * 6, list(range(6)), schema)
    assert decoded == []
    objs[3] = {**objs[3], "I2": True}  # a wrong type: this event takes decode.py's path (and is rejected)
    objs[4] = {**objs[4], "C3": None}  # good, with a missing value
    batch, rejected = featurize_json_events(objs, [orjson.dumps(o) for o in objs], [0] * 6, list(range(6)), schema)
    assert decoded == [objs[3]]
    assert batch.event_ids == ("e0", "e1", "e2", "e4", "e5")
    assert [(r.offset, r.reason) for r in rejected] == [(3, "I2: must be an integer or null")]


def test_records_of_one_event_and_bundles_of_json_lines_mix():
    """featurize_records: single JSON events, newline bundles, unparsable lines and empty records."""
    objs = [criteo_event(i) for i in range(5)]
    records = [
        RawRecord(0, 0, orjson.dumps(objs[0])),
        RawRecord(0, 1, orjson.dumps(objs[1]) + b"\n{broken\n" + orjson.dumps(objs[2])),
        RawRecord(1, 0, b""),
        RawRecord(1, 1, orjson.dumps({**objs[3], "label": 7})),
        RawRecord(1, 2, orjson.dumps(objs[4])),
    ]
    batch, rejected = featurize_records(records, CRITEO)
    assert batch.event_ids == ("e0", "e1", "e2", "e4")
    assert batch.offsets.tolist() == [0, 1, 1, 2] and batch.partitions.tolist() == [0, 0, 0, 1]
    reasons = sorted((r.partition, r.offset, r.reason.split(" (")[0]) for r in rejected)
    assert reasons == [(0, 1, "record: not valid JSON"), (1, 0, "record: empty"), (1, 1, "label: must be 0 or 1")]


def test_a_number_past_2_to_the_53_is_rejected_or_rounded_not_raised():
    """A label of 2^62 in a column of integers: Arrow's safe cast to float64 raised, and the raise
    took the featurizer down (found by the property test above)."""
    events = [{**criteo_event(0), "label": 1 << 62}, criteo_event(1)]
    lines = [orjson.dumps(e) for e in events]
    batch, rejected = featurize_json_events(events, lines, [0, 0], [0, 1], CRITEO)
    assert len(batch) == 1 and len(rejected) == 1 and "label" in rejected[0].reason
