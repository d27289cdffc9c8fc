"""10^4 fuzzed events through the Faust featurizer on the real broker: wrong types, missing fields,
huge values, binary garbage, huge records. The worker keeps running; every bad record is in the
DLQ with a reason, every good event in a batch, once. Which events are good is what the stream's
own decoder says of each record, in process."""

from __future__ import annotations

import json
import uuid

import numpy as np
import orjson
import pytest

from stream.batch_codec import decode_batch
from stream.decode import decode_event
from stream.errors import DecodeError
from stream.replay import KafkaWriter
from stream.schema import load_schema
from stream.topics import ensure_topics
from tests.helpers import criteo_event
from tests.integration.helpers import drain, start_cli, stop_process

pytestmark = pytest.mark.integration
EVENTS = 10_000


def fuzzed(i: int, rng: np.random.Generator, fields: list[str]) -> bytes:
    """Record i: a good event half of the time, else one of several kinds of damage."""
    event: dict[str, object] = criteo_event(i)
    event["event_id"] = f"f{i}"
    kind = rng.integers(0, 10)
    field = fields[rng.integers(0, len(fields))]
    if field == "event_id" and kind != 5:
        field = "ts"  # a changed id could repeat another event's: ids stay unique (or absent)
    if kind == 5:
        del event[field]
    elif kind == 6:
        event[field] = [None, True, 1.5, "x" * 3, {"a": 1}, [1, 2]][rng.integers(0, 6)]
    elif kind == 7:
        event[field] = int(rng.choice([2**63, -(2**63) - 1, 10**30]))
    elif kind == 8:
        garbage = rng.integers(0, 256, rng.integers(1, 300), dtype=np.uint8).tobytes()
        return garbage.replace(b"\n", b" ")  # one record, one line: not a bundle
    elif kind == 9:  # a long value; every 500th record a huge one (1 MB, under the message limit)
        event[field] = "f" * (1_000_000 if i % 500 == 9 else int(rng.integers(9, 2_000)))
    return json.dumps(event).encode() if kind == 7 else orjson.dumps(event)  # orjson stops at 64 bits


def good_id(value: bytes, schema) -> str | None:
    """The event id the stream's decoder reads from the record, or None if it rejects it."""
    try:
        return decode_event(value, schema).event_id
    except DecodeError:
        return None


def test_ten_thousand_fuzzed_events_good_ones_in_batches_bad_ones_in_the_dlq(isolated, tmp_path):
    schema = load_schema()
    kafka = isolated.kafka
    ensure_topics(kafka)
    rng = np.random.default_rng(5)
    fields = ["event_id", "label", "ts", *schema.integer_fields, *schema.categorical_fields]
    records = [fuzzed(i, rng, fields) for i in range(EVENTS)]
    decoded = [good_id(value, schema) for value in records]
    good = {event_id for event_id in decoded if event_id is not None}
    assert len(good) == sum(d is not None for d in decoded)  # ids stay unique, so sets can be compared
    bad = EVENTS - len(good)
    assert 0.4 * EVENTS < len(good) < 0.7 * EVENTS  # the mix is what the test means it to be
    writer = KafkaWriter(kafka)
    for i, value in enumerate(records):
        writer.send(kafka.events_topic, value, f"f{i}".encode())
    writer.flush()

    worker, log = start_cli(isolated, tmp_path, "stream")
    try:
        batches = drain(
            kafka.bootstrap,
            kafka.batches_topic,
            lambda m: sum(len(decode_batch(x.value())) for x in m) >= len(good),
            180,
            f"check-{uuid.uuid4().hex[:6]}",
        )
        dlq = drain(kafka.bootstrap, kafka.dlq_topic, lambda m: len(m) >= bad, 120, f"check-{uuid.uuid4().hex[:6]}")
        assert worker.poll() is None, f"the featurizer died:\n{log.read_text()[-3000:]}"
    finally:
        stop_process(worker)
    ids = [e for m in batches for e in decode_batch(m.value()).event_ids]
    assert len(ids) == len(good) and set(ids) == good
    assert len(dlq) == bad
    reasons = [dict(m.headers())["reason"].decode() for m in dlq]
    assert all(reasons) and all(dict(m.headers())["stage"] == b"stream" for m in dlq)
    assert any("not valid JSON" in r for r in reasons) and any("missing" in r for r in reasons)
