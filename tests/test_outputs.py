"""What the featurizer writes: every output under the message limit, every event in exactly one of
the two outputs; the shapes of the fault probe (oversize ids, near-limit and Arrow-marker garbage,
a megabyte of garbage lines, float labels in a bundle) each with one clear dead letter."""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa
import pytest

from stream import rules
from stream.featurizer.ingest import featurize_isolating, featurize_records
from stream.featurizer.outputs import plan_outputs
from stream.formats.arrow import encode_event_bundle, encode_table, event_table
from stream.formats.batch_codec import decode_batch
from stream.formats.dead_letter import BATCHES, DLQ, RECORD_OVERHEAD, dead_letter
from stream.records import RawRecord
from stream.schema import load_schema
from tests.helpers import criteo_event

SCHEMA = load_schema()
LIMIT = 64 << 10  # a small message limit: a 1024-event Criteo batch is ~280 KB


def outputs_of(records: list[RawRecord], batch_events: int = 1024, limit: int = LIMIT):
    batch, rejected = featurize_isolating(records, SCHEMA)
    return plan_outputs(batch, rejected, batch_events, limit, batch_partitions=4)


def test_batches_are_cut_by_bytes_and_keep_every_event_once_in_order():
    records = [RawRecord(0, i, orjson.dumps(criteo_event(i))) for i in range(1500)]
    outputs = outputs_of(records)
    assert all(o.topic == BATCHES for o in outputs) and len(outputs) > 2  # 1024 events do not fit 64 KiB
    assert all(o.size <= LIMIT for o in outputs)
    ids = [e for o in outputs for e in decode_batch(o.value).event_ids]
    assert ids == [f"e{i}" for i in range(1500)]
    assert sum(o.events for o in outputs) == 1500
    assert all(o.key == decode_batch(o.value).event_ids[0].encode() for o in outputs)


def test_an_event_too_large_for_any_batch_is_a_dead_letter_naming_the_limit():
    records = [RawRecord(0, i, orjson.dumps(criteo_event(i))) for i in range(3)]
    outputs = outputs_of(records, limit=RECORD_OVERHEAD + 600)  # no batch of one event fits
    assert [o.topic for o in outputs] == [DLQ] * 3
    assert all("kafka.max_message_bytes" in o.headers["reason"].decode() for o in outputs)
    assert [o.headers["source"] for o in outputs] == [b"0:0", b"0:1", b"0:2"]


def test_a_dead_letter_over_the_limit_keeps_the_first_bytes_and_says_where_the_rest_is():
    value = b"x" * (LIMIT + 5000)
    letter = dead_letter(value, "record: not valid JSON", "1:42", LIMIT)
    assert letter.size <= LIMIT
    assert letter.headers["truncated"] == str(len(value)).encode() and letter.headers["source"] == b"1:42"
    assert value.startswith(letter.value) and len(letter.value) > LIMIT - 1000
    small = dead_letter(b"abc", "r" * 5000, "1:43", LIMIT)
    assert small.value == b"abc" and "truncated" not in small.headers
    assert len(small.headers["reason"]) == 1000  # a reason is cut, never the reason for a lost record


def test_event_ids_are_capped_on_every_path():
    long_id = "i" * (rules.MAX_EVENT_ID_CHARS + 1)
    ok_id = "i" * rules.MAX_EVENT_ID_CHARS
    json_records = [RawRecord(0, 0, orjson.dumps(criteo_event(0, event_id=long_id)))]
    json_records.append(RawRecord(0, 1, orjson.dumps(criteo_event(1, event_id=ok_id))))
    bundle = encode_event_bundle([criteo_event(2, event_id=long_id), criteo_event(3)], SCHEMA)
    batch, rejected = featurize_records([*json_records, RawRecord(1, 0, bundle)], SCHEMA)
    assert batch.event_ids == (ok_id, "e3")
    assert [r.reason for r in rejected] == [f"event_id: {rules.EVENT_ID_LONG}"] * 2


def test_a_megabyte_of_garbage_lines_is_one_dead_letter():
    rng = np.random.default_rng(1)
    garbage = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes().replace(b"{", b"(")
    garbage = b"\xfe" + garbage  # not the Arrow marker
    batch, rejected = featurize_records([RawRecord(0, 7, garbage)], SCHEMA)
    assert len(batch) == 0 and len(rejected) == 1
    assert rejected[0].value == garbage
    assert " lines are not JSON objects (first, line 1:" in rejected[0].reason


def test_bad_lines_of_a_bundle_are_one_dead_letter_and_its_good_events_go_on():
    good = [orjson.dumps(criteo_event(i)) for i in range(3)]
    value = b"\n".join([good[0], b"{broken", good[1], b"nope", good[2]])
    batch, rejected = featurize_records([RawRecord(0, 3, value)], SCHEMA)
    assert batch.event_ids == ("e0", "e1", "e2")
    assert len(rejected) == 1 and rejected[0].value == b"{broken\nnope"
    assert rejected[0].reason.startswith("record: 2 of 5 lines are not JSON objects (first, line 2:")


@pytest.mark.parametrize("size", [5, 300, 1 << 20])
def test_garbage_after_the_arrow_marker_is_one_dead_letter_not_a_crash(size):
    rng = np.random.default_rng(size)
    value = b"\xff\xff\xff\xff" + rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    batch, rejected = featurize_records([RawRecord(0, 1, value)], SCHEMA)  # not isolating: it must not raise
    assert len(batch) == 0 and len(rejected) == 1
    assert rejected[0].reason.startswith("record: not a readable Arrow bundle")
    assert "crashed" not in rejected[0].reason


def test_a_truncated_arrow_bundle_is_one_dead_letter():
    bundle = encode_event_bundle([criteo_event(i) for i in range(50)], SCHEMA)
    batch, rejected = featurize_records([RawRecord(0, 1, bundle[: len(bundle) // 2])], SCHEMA)
    assert len(batch) == 0 and len(rejected) == 1 and "Arrow bundle" in rejected[0].reason


def test_a_float_label_means_the_same_in_json_and_in_an_arrow_bundle():
    labels = [1.0, -0.0, 0.0, 0.5, float("nan"), 1]
    events = [criteo_event(i, label=label) for i, label in enumerate(labels)]
    json_batch, json_rejected = featurize_records(
        [RawRecord(0, i, orjson.dumps(e)) for i, e in enumerate(events[:4])], SCHEMA
    )  # NaN is not JSON (orjson writes null): the JSON path sees the first four
    table = event_table([criteo_event(i) for i in range(6)], SCHEMA)
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.float64()))
    arrow_batch, arrow_rejected = featurize_records([RawRecord(1, 0, encode_table(table))], SCHEMA)
    assert json_batch.event_ids == ("e0", "e1", "e2") and json_batch.labels.tolist() == [1.0, 0.0, 0.0]
    assert arrow_batch.event_ids == ("e0", "e1", "e2", "e5") and arrow_batch.labels.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert [r.reason for r in json_rejected] == ["label: must be 0 or 1"]
    assert [r.reason for r in arrow_rejected] == ["label: must be 0 or 1"] * 2


def test_deep_nesting_is_a_dead_letter():
    value = b"[" * 5000 + b"]" * 5000
    batch, rejected = featurize_records([RawRecord(0, 0, value)], SCHEMA)
    assert len(batch) == 0 and len(rejected) == 1 and "record:" in rejected[0].reason
