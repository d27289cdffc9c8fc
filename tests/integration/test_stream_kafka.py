"""(a) replay -> Faust featurizer -> batches topic holds exactly the events sent; bad lines in the DLQ."""

import subprocess
import sys
import uuid

import orjson
import pytest

from stream.formats.arrow import encode_event_bundle
from stream.formats.batch_codec import decode_batch
from stream.kafka.topics import ensure_topics
from stream.produce.replay import KafkaWriter, log_records, replay
from stream.schema import load_schema
from tests.integration.helpers import drain, start_cli, stop_process

pytestmark = pytest.mark.integration

GOOD_LINE = "0\t1\t2\t\t4\t5\t6\t7\t8\t9\t10\t11\t12\t\t" + "\t".join(f"{i:08x}" for i in range(1, 26)) + "\t"


@pytest.mark.parametrize("workers", [1, 2])
def test_replay_stream_batches_exact_and_dlq(isolated, tmp_path, workers):
    """Batches hold exactly the events sent, once each, with one Faust worker or two sharing the partitions."""
    schema = load_schema()
    kafka = isolated.kafka
    ensure_topics(kafka)
    tsv = tmp_path / "day_0.txt"
    lines = []
    for i in range(3000):
        if i % 500 == 7:
            lines.append("this line is broken")
        else:
            lines.append(GOOD_LINE.replace("\t1\t2\t", f"\t{i}\t2\t", 1))
    tsv.write_text("\n".join(lines) + "\n")
    summary = replay(log_records([tsv], schema), kafka, progress=False)
    assert summary.events == 2994 and summary.rejected == 6
    writer = KafkaWriter(kafka)  # malformed events straight onto the events topic
    writer.send(kafka.events_topic, b"{not json", b"bad-1")
    writer.send(kafka.events_topic, orjson.dumps({"event_id": "bad-2", "ts": 1}), b"bad-2")
    bundle = b"\n".join(
        orjson.dumps(
            {
                "event_id": f"b{i}",
                "ts": 1,
                "label": 0,
                **{f: None for f in schema.integer_fields + schema.categorical_fields},
            }
        )
        for i in range(5)
    )
    writer.send(kafka.events_topic, bundle, b"b0")  # a bundle of 5 good events
    arrow = [{**orjson.loads(bundle.split(b"\n")[0]), "event_id": f"a{i}"} for i in range(10)]
    arrow[3]["C1"] = "not-hex"
    writer.send(kafka.events_topic, encode_event_bundle(arrow, schema), b"a0")  # 9 good + 1 bad row
    writer.flush()
    sent = {f"day_0:{i}" for i in range(3000) if i % 500 != 7} | {f"b{i}" for i in range(5)}
    sent |= {f"a{i}" for i in range(10) if i != 3}

    worker, log = start_cli(isolated, tmp_path, "stream", "--workers", str(workers))
    try:

        def count(messages):
            return sum(len(decode_batch(m.value())) for m in messages)

        batches = drain(
            kafka.bootstrap, kafka.batches_topic, lambda m: count(m) >= len(sent), 120, f"check-{uuid.uuid4().hex[:6]}"
        )
        dlq = drain(kafka.bootstrap, kafka.dlq_topic, lambda m: len(m) >= 9, 60, f"check-{uuid.uuid4().hex[:6]}")
    finally:
        stop_process(worker)
    decoded = [decode_batch(m.value()) for m in batches]
    ids = [e for b in decoded for e in b.event_ids]
    assert len(ids) == len(sent), f"featurizer log:\n{log.read_text()[-3000:]}"
    assert set(ids) == sent
    assert all(b.schema_hash == schema.hash and len(b) <= isolated.stream.batch_events for b in decoded)
    assert all((b.offsets >= 0).all() and (b.partitions >= 0).all() for b in decoded)
    reasons = sorted(dict(m.headers())["reason"].decode() for m in dlq)
    stages = sorted(dict(m.headers())["stage"].decode() for m in dlq)
    assert len(dlq) == 9
    assert stages == ["replay"] * 6 + ["stream"] * 3
    assert sum("expected 40 tsv columns, got 1" in r for r in reasons) == 6
    assert any("not valid JSON" in r for r in reasons) and any("label: missing" in r for r in reasons)
    assert "C1: must be up to 8 hex digits" in reasons


def test_replay_sends_a_record_over_the_message_limit_to_the_dlq_naming_the_fix(isolated):
    """A bundle over kafka.max_message_bytes is not produced (Kafka would refuse it): it goes to the
    DLQ, cut to fit, with the reason and the fix; a bad log line over the limit is cut to fit too."""
    from dataclasses import replace

    from stream.produce.replay import synthetic_records
    from stream.produce.synthetic import SyntheticCriteo

    schema = load_schema()
    kafka = replace(isolated.kafka, max_message_bytes=64 << 10)
    ensure_topics(kafka)
    events, _ = SyntheticCriteo(schema).generate(2048)
    big = replay(synthetic_records(events, schema, bundle=1024), kafka, progress=False)  # ~400 KB each
    assert big.events == 0 and big.rejected == 2
    fits = replay(synthetic_records(events, schema, bundle=64), kafka, progress=False)
    assert fits.events == 2048 and fits.rejected == 0
    dlq = drain(kafka.bootstrap, kafka.dlq_topic, lambda m: len(m) >= 2, 60, f"d-{uuid.uuid4().hex[:6]}")
    assert len(dlq) == 2
    for message in dlq:
        headers = dict(message.headers())
        assert "replay with a smaller --bundle" in headers["reason"].decode() and headers["stage"] == b"replay"
        assert int(headers["truncated"]) > kafka.max_message_bytes >= len(message.value())


def test_a_trainer_fed_batches_of_another_schema_stops_naming_both_and_the_fix(isolated):
    """Featurized as avazu, trained as criteo: it used to skip every batch, one log line each, and
    exit 0 with an AUC of NaN."""
    from dataclasses import replace

    from stream.formats.batch_codec import encode_batch
    from tests.helpers import random_feature_batch
    from trainer.errors import TrainerError
    from trainer.source import FOREIGN_STOP, BatchSource

    kafka = isolated.kafka
    ensure_topics(kafka)
    avazu, criteo = load_schema("avazu"), load_schema("criteo")
    writer = KafkaWriter(kafka)
    for i in range(FOREIGN_STOP):
        writer.send(kafka.batches_topic, encode_batch(replace(random_feature_batch(8, seed=i), schema_hash=avazu.hash)))
    writer.flush()
    source = BatchSource(kafka, f"{isolated.trainer.group_id}-foreign", criteo.hash)
    with pytest.raises(TrainerError) as caught:
        for _ in source.batches(256, idle_s=0.5, first_wait_s=30):
            pass
    message = str(caught.value)
    assert f"avazu ({avazu.hash})" in message and f"criteo ({criteo.hash})" in message
    assert "--set stream.schema=avazu" in message


def test_a_trainer_with_a_backlog_learns_its_partitions_in_step_in_event_time(isolated):
    """Partition 1's hour written before partition 0's: read as fetched, a catching-up trainer
    learned one partition's events before the other's; it learns them merged by event time, and
    each batch's offsets cover only what it handed out (a snapshot never skips a record)."""
    from dataclasses import replace

    import numpy as np

    from stream.formats.batch_codec import encode_batch
    from tests.helpers import random_feature_batch
    from trainer.source import BatchSource

    kafka = isolated.kafka
    ensure_topics(kafka)
    schema = load_schema()
    writer = KafkaWriter(kafka)
    times = {1: [0, 10, 20, 30, 40, 50], 0: [5, 15, 25, 35, 45, 55]}
    for partition in (1, 0):  # all of partition 1 first
        for i, t in enumerate(times[partition]):
            part = random_feature_batch(8, seed=100 * partition + i)
            part = replace(part, ts=np.full(8, t, dtype=np.int64), schema_hash=schema.hash)
            writer.send(kafka.batches_topic, encode_batch(part), partition=partition)
    writer.flush()
    source = BatchSource(kafka, f"{isolated.trainer.group_id}-in-step", schema.hash)
    learned: list[int] = []
    offsets: list[dict[int, int]] = []
    try:
        for batch in source.batches(1, idle_s=2.0, first_wait_s=30):
            if batch is None:
                break
            learned.append(batch.newest_ms)
            offsets.append(batch.source_offsets)
    finally:
        source.close()
    assert learned == sorted(times[0] + times[1])
    assert offsets[0] == {1: 1} and offsets[1] == {0: 1, 1: 1} and offsets[-1] == {0: 6, 1: 6}


def test_adstream_dlq_counts_by_reason_and_shows_the_newest_letters(isolated, tmp_path):
    """`adstream dlq`: a user used to write a consumer to see why records were rejected (#29 item 9)."""
    import json

    from stream.formats.dead_letter import dead_letter
    from stream.kafka.dead_letters import read_dead_letters
    from tests.integration.helpers import start_cli

    kafka = isolated.kafka
    ensure_topics(kafka)
    writer = KafkaWriter(kafka)
    letters = [
        (b'{"event_id": "a", "label": 7}', "label: must be 0 or 1", "events:0:1", "stream"),
        (b"this line is broken", "record: not JSON", "events:1:4", "stream"),
        (b'{"event_id": "b", "label": 2}', "label: must be 0 or 1", "events:0:9", "stream"),
        (b"x" * 5000, "record: too large", "day_0.txt:12", "replay"),
    ]
    for value, reason, source, stage in letters:
        letter = dead_letter(value, reason, source, 2048, stage)
        writer.send(kafka.dlq_topic, letter.value, headers=letter.headers)
        writer.flush()
    found = read_dead_letters(kafka, reason="LABEL", limit=5)
    assert found.total == 4 and found.by_reason["label: must be 0 or 1"] == 2
    assert [x.value for x in found.newest] == [letters[0][0], letters[2][0]]  # oldest first
    assert {x.source for x in found.newest} == {"events:0:1", "events:0:9"}
    newest = read_dead_letters(kafka, limit=1).newest
    assert len(newest) == 1 and newest[0].truncated == 5000 and newest[0].stage == "replay"

    proc, log = start_cli(isolated, tmp_path, "dlq", "--json", "--reason", "not json")
    assert proc.wait(60) == 0, log.read_text()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert [(x["reason"], x["value"], x["source"]) for x in lines] == [
        ("record: not JSON", "this line is broken", "events:1:4")
    ]
    proc, log = start_cli(isolated, tmp_path, "dlq")
    assert proc.wait(60) == 0, log.read_text()
    assert "4 dead letters" in log.read_text() and "       2  label: must be 0 or 1" in log.read_text()


def test_adstream_status_shows_the_processes_groups_dead_letters_and_serving(isolated, tmp_path):
    """#29 item 8: status listed Kafka and MLflow only."""
    import time

    from stream.formats.dead_letter import dead_letter
    from tests.integration.helpers import free_port, start_cli

    config = replace_serving_port(isolated, free_port())
    kafka = config.kafka
    ensure_topics(kafka)
    writer = KafkaWriter(kafka)
    letter = dead_letter(b"broken", "record: not JSON", "events:0:3", 4096)
    writer.send(kafka.dlq_topic, letter.value, headers=letter.headers)
    writer.flush()
    replay(synthetic_records_of(100), kafka, progress=False)
    stream, stream_log = start_cli(config, tmp_path, "stream")
    try:
        deadline = time.monotonic() + 90
        text = ""
        while time.monotonic() < deadline:
            done = subprocess.run(
                [sys.executable, "-m", "adstream.cli", "--config", str(tmp_path / "stream.toml"), "status"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            text = done.stdout
            if f"{config.stream.app_id}" in text and f"{kafka.events_topic} 0" in text:
                break  # the featurizer committed every event
            time.sleep(2)
        assert f"stream  pid {stream.pid}" in text and "running" in text, text
        assert f"{kafka.events_topic} 0" in text, text + stream_log.read_text()[-2000:]
        assert f"{config.trainer.group_id}" in text and "(nothing committed yet)" in text
        assert "dead letters: 1 in" in text and "       1  record: not JSON" in text
        assert f"serving: no server at http://127.0.0.1:{config.serving.port}" in text
    finally:
        stop_process(stream)
    done = subprocess.run(
        [sys.executable, "-m", "adstream.cli", "--config", str(tmp_path / "stream.toml"), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"pid {stream.pid}" not in done.stdout  # gone with the process


def replace_serving_port(config, port):
    from dataclasses import replace

    return replace(config, serving=replace(config.serving, port=port))


def synthetic_records_of(n: int):
    from stream.produce.replay import synthetic_records
    from stream.produce.synthetic import SyntheticCriteo

    schema = load_schema()
    events, _ = SyntheticCriteo(schema).generate(n)
    return synthetic_records(events, schema)


def test_a_featurizer_given_events_of_another_schema_says_so_once(isolated, tmp_path):
    """#29 item 1: `stream` sent everything to the DLQ and printed nothing."""
    import time

    from tests.integration.helpers import start_cli

    kafka = isolated.kafka
    ensure_topics(kafka)
    writer = KafkaWriter(kafka)
    avazu = load_schema("avazu")
    for i in range(50):
        writer.send(kafka.events_topic, orjson.dumps({**avazu.request_example(), "id": f"a{i}", "click": 0}))
    writer.flush()
    proc, log = start_cli(isolated, tmp_path, "stream")
    try:
        deadline = time.monotonic() + 90
        while "every event so far was rejected" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(1)
        writer.send(kafka.events_topic, orjson.dumps({**avazu.request_example(), "id": "later", "click": 0}))
        writer.flush()
        time.sleep(3)
    finally:
        stop_process(proc)
    text = log.read_text()
    assert text.count("every event so far was rejected under schema criteo") == 1, text[-3000:]
    assert "--set stream.schema=NAME" in text and "adstream dlq" in text
    assert "\x1b[" not in text  # no terminal cursor codes in a log file (#29 item 3)
