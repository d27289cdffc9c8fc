"""10^4 fuzzed events through the Faust featurizer on the real broker: wrong types, missing fields,
huge values, binary garbage, huge records. The worker keeps running; every bad record is in the
DLQ with a reason, every good event in a batch, once. Which events are good is what the stream's
own decoder says of each record, in process."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import orjson
import pytest

from stream.errors import DecodeError
from stream.featurizer.decode import decode_event
from stream.formats.arrow import encode_event_bundle
from stream.formats.batch_codec import decode_batch
from stream.kafka.topics import ensure_topics
from stream.produce.replay import KafkaWriter
from stream.schema import load_schema
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


def featurized(config, tmp_path, events: int, letters: int) -> tuple[list, list]:
    """Run the featurizer (`adstream stream`) until the batches topic holds `events` events and the
    DLQ `letters` records (or the timeouts); the messages of both. The worker must still be running."""
    worker, log = start_cli(config, tmp_path, "stream")
    kafka = config.kafka
    try:
        batches = drain(
            kafka.bootstrap,
            kafka.batches_topic,
            lambda m: sum(len(decode_batch(x.value())) for x in m) >= events,
            180,
            f"check-{uuid.uuid4().hex[:6]}",
        )
        dlq = drain(kafka.bootstrap, kafka.dlq_topic, lambda m: len(m) >= letters, 120, f"d-{uuid.uuid4().hex[:6]}")
        time.sleep(1)  # and a moment later the worker is still up
        assert worker.poll() is None, f"the featurizer died:\n{log.read_text()[-3000:]}"
    finally:
        stop_process(worker)
    return batches, dlq


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

    batches, dlq = featurized(isolated, tmp_path, len(good), bad)
    ids = [e for m in batches for e in decode_batch(m.value()).event_ids]
    assert len(ids) == len(good) and set(ids) == good
    assert len(dlq) == bad
    reasons = [dict(m.headers())["reason"].decode() for m in dlq]
    assert all(reasons) and all(dict(m.headers())["stage"] == b"stream" for m in dlq)
    assert any("not valid JSON" in r for r in reasons) and any("missing" in r for r in reasons)


def probe_records(schema, limit: int) -> tuple[list[tuple[bytes, bytes]], dict[bytes, set[str]], dict[bytes, int]]:
    """The fault probe's shapes, each a record keyed by its name: (key, value) in order, the event
    ids each record should bring to the batches topic, and the dead letters each should bring."""
    rng = np.random.default_rng(11)
    # valid events with 200-character ids and no categories: a bundle of 8,000 is under the message
    # limit, its featurized batch (8 bytes per missing category's id) over it
    no_categories = {f"C{k}": None for k in range(1, 27)}
    long_ids = [criteo_event(i, event_id=f"long{i}-" + "x" * 190, **no_categories) for i in range(16_000)]
    records: list[tuple[bytes, bytes]] = []
    good: dict[bytes, set[str]] = {}
    letters: dict[bytes, int] = {}

    def add(key: str, value: bytes, ids: set[str], dead: int) -> None:
        records.append((key.encode(), value))
        good[key.encode()], letters[key.encode()] = ids, dead

    for b in range(2):  # bundles whose featurized batches are over the limit unless cut by bytes
        rows = long_ids[b * 8000 : (b + 1) * 8000]
        add(f"bundle{b}", encode_event_bundle(rows, schema), {str(r["event_id"]) for r in rows}, 0)
    mixed = [criteo_event(9000 + i, event_id=f"m{i}") for i in range(100)]
    mixed[50]["event_id"] = "y" * 900_000  # an id far over the cap, among good rows
    add("mixed", encode_event_bundle(mixed, schema), {f"m{i}" for i in range(100) if i != 50}, 1)
    add("json-long-id", orjson.dumps(criteo_event(1, event_id="z" * 900_000)), set(), 1)
    for i in range(3):  # near the limit: the dead letter's copy must be cut to fit
        add(f"near{i}", b"#" + rng.integers(0, 256, limit - 400, dtype=np.uint8).tobytes(), set(), 1)
    add("arrow-marker", b"\xff\xff\xff\xff" + rng.integers(0, 256, 300, dtype=np.uint8).tobytes(), set(), 1)
    add("arrow-marker-1mib", b"\xff\xff\xff\xff" + rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes(), set(), 1)
    add("garbage-1mib", b"#" + rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes(), set(), 1)
    add("deep", b"[" * 100_000 + b"]" * 100_000, set(), 1)
    add("deep-object", b'{"a":' * 5_000 + b"1" + b"}" * 5_000, set(), 1)
    for i in range(200):
        add(f"plain{i}", orjson.dumps(criteo_event(20_000 + i, event_id=f"p{i}")), {f"p{i}"}, 0)
    return records, good, letters


def test_the_probes_shapes_each_end_in_exactly_one_of_the_two_topics(isolated, tmp_path):
    """Oversize ids, bundles whose batches are over the message limit, near-limit garbage, Arrow-marker
    garbage, a megabyte of garbage, deep nesting: every good event reaches the batches topic once,
    every bad record (or bundle row) is one dead letter pointing at its source, nothing over the
    limit is written, and the featurizer is still running."""
    from dataclasses import replace

    schema = load_schema()
    config = replace(isolated, stream=replace(isolated.stream, batch_events=16_384, take_records=64))
    kafka = config.kafka
    ensure_topics(kafka)
    records, good, letters = probe_records(schema, kafka.max_message_bytes)
    writer = KafkaWriter(kafka)
    for key, value in records:
        writer.send(kafka.events_topic, value, key)
    writer.flush()
    sources = {  # partition:offset -> key, as the events topic holds them
        f"{m.partition()}:{m.offset()}": m.key()
        for m in drain(
            kafka.bootstrap, kafka.events_topic, lambda m: len(m) >= len(records), 60, "k-" + uuid.uuid4().hex[:6]
        )
    }
    wanted_ids = set().union(*good.values())
    batches, dlq = featurized(config, tmp_path, len(wanted_ids), sum(letters.values()))
    ids = [e for m in batches for e in decode_batch(m.value()).event_ids]
    assert len(ids) == len(set(ids)) == len(wanted_ids) and set(ids) == wanted_ids
    assert max(len(m.value()) for m in batches) <= kafka.max_message_bytes
    assert any(len(m.value()) > kafka.max_message_bytes // 3 for m in batches)  # large batches, cut to fit
    per_record: dict[bytes, int] = {}
    for m in dlq:
        headers = dict(m.headers())
        key = sources[headers["source"].decode()]
        per_record[key] = per_record.get(key, 0) + 1
        assert headers["reason"] and headers["stage"] == b"stream"
        if key.startswith(b"near"):
            assert int(headers["truncated"]) == kafka.max_message_bytes - 400 + 1
    assert per_record == {k: n for k, n in letters.items() if n}
    reasons = {sources[dict(m.headers())["source"].decode()]: dict(m.headers())["reason"].decode() for m in dlq}
    assert reasons[b"mixed"] == reasons[b"json-long-id"] == "event_id: longer than 256 characters"
    assert reasons[b"arrow-marker"].startswith("record: not a readable Arrow bundle")
    assert "crashed" not in " ".join(reasons.values())
