"""The loop's serving side on the real broker: what /predict scored comes out as impressions in the
joiner's format and placement, /shown logs held candidates, /click writes clicks, a broker outage
costs no request and no record, held candidates survive a restart, and what the trainer would learn
from a logged impression is what serving scored."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from serving.app import create_app
from serving.impressions import SERVED
from serving.loader import load_served_model
from serving.predict import predict_events
from stream.featurizer.decode import decode_event, event_from_mapping
from stream.featurizer.featurize import featurize
from stream.formats.batch_codec import decode_batch, encode_batch
from stream.join.inputs import ClickFields, read_clicks, read_impressions
from stream.join.outputs import labelled
from stream.kafka.partitioner import murmur2_partition
from stream.kafka.topics import ensure_topics
from stream.records import RawRecord
from tests.helpers import trained_trainer, unlabelled
from tests.integration.helpers import drain, kill_broker, start_broker
from trainer.batch import batch_from_features

pytestmark = pytest.mark.integration


@pytest.fixture
def served(schema, tmp_path):
    return load_served_model(trained_trainer(schema, 3).checkpoints.save(tmp_path / "snap"), "1", schema)


def logging_app(config, schema, served, tmp_path):
    settings = replace(config.serving, log_impressions=True, cache_dir=str(tmp_path / "cache"), poll_s=0.05)
    sent = [served]
    return create_app(settings, schema, lambda current: sent.pop() if sent else None, config.kafka)


def raw(message) -> RawRecord:
    return RawRecord(message.partition(), message.offset(), message.value())


def test_scored_events_become_impressions_and_clicks_in_the_joiners_format(isolated, schema, served, tmp_path):
    kafka = isolated.kafka
    ensure_topics(kafka)
    with TestClient(logging_app(isolated, schema, served, tmp_path)) as client:
        idless = {k: v for k, v in unlabelled(0).items() if k != schema.event_id}
        now = client.post("/predict", json=[idless, unlabelled(1), unlabelled(2)]).json()["predictions"]
        assigned = now[0]["event_id"]
        later = client.post("/predict?shown=false", json=[unlabelled(i) for i in range(3, 7)]).json()["predictions"]
        also = client.post("/predict", json={**unlabelled(7), "shown": False}).json()["predictions"]
        shown = client.post("/shown", json=[{"impression_id": "e3", "propensity": 0.5}, {"impression_id": "e5"}])
        assert shown.json() == {"shown": 2, "unknown": []}
        again = client.post("/shown", json=[{"impression_id": "e3"}, {"impression_id": "nobody"}])
        assert again.json() == {"shown": 0, "unknown": ["e3", "nobody"]}  # shown once; never scored
        assert client.post("/click", json=[{"impression_id": assigned, "ts": 1}, {"impression_id": "e5"}]).json() == {
            "clicks": 2
        }
        bad = client.post("/click", json={"impression_id": 3.5})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "impression_id"]
        bad = client.post("/shown", json=[{"impression_id": "e4", "propensity": 2}])
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", 0, "propensity"]
    ctr = {p["event_id"]: p["ctr"] for p in now + later + also}

    impressions = drain(kafka.bootstrap, kafka.impressions_topic, lambda m: len(m) >= 5, 30, "t-imp")
    time.sleep(1.0)
    assert len(impressions) == 5
    ids = []
    for message in impressions:
        key = message.key()
        assert message.partition() == murmur2_partition(key, kafka.partitions)  # where the joiner looks
        good, bad, _ = read_impressions(raw(message), schema)
        assert not bad and [i.impression_id for i in good] == [key.decode()]
        record = orjson.loads(message.value())
        assert record[SERVED]["ctr"] == ctr[key.decode()] and record[SERVED]["version"] == "1"
        assert record[SERVED]["step"] == served.manifest.step
        ids.append(key.decode())
        if key == b"e3":
            assert record[SERVED]["propensity"] == 0.5
    assert sorted(ids) == sorted([assigned, "e1", "e2", "e3", "e5"])  # e4, e6, e7 were never shown

    clicks = drain(kafka.bootstrap, kafka.clicks_topic, lambda m: len(m) >= 2, 30, "t-clk")
    assert len(clicks) == 2
    for message in clicks:
        assert message.partition() == murmur2_partition(message.key(), kafka.partitions)
        good, bad = read_clicks(raw(message), ClickFields())
        assert not bad and good[0].impression_id == message.key().decode()


def test_what_the_trainer_learns_of_a_logged_impression_is_what_serving_scored(isolated, schema, served, tmp_path):
    """The joiner's output for a logged impression, decoded and featurized as the stream does,
    carries the ids and dense values serving computed; the served version recomputes the logged CTR."""
    kafka = isolated.kafka
    ensure_topics(kafka)
    events = [unlabelled(i) for i in range(40)]
    for i in range(0, 40, 7):  # missing values travel too
        events[i]["I2"] = None
        events[i]["C5"] = ""
    with TestClient(logging_app(isolated, schema, served, tmp_path)) as client:
        assert client.post("/predict", json=events).status_code == 200
    logged = drain(kafka.bootstrap, kafka.impressions_topic, lambda m: len(m) >= 40, 30, "t-same")
    assert len(logged) == 40
    by_id = {e[schema.event_id]: e for e in events}
    values = [m.value() for m in sorted(logged, key=lambda m: int(m.key()[1:]))]
    joined = [decode_event(labelled(v, schema.label, i % 2), schema) for i, v in enumerate(values)]
    scored = [event_from_mapping(by_id[e.event_id], schema, require_label=False) for e in joined]
    learned = batch_from_features([decode_batch(encode_batch(featurize(joined, schema)))])  # as the batches topic

    served_batch = batch_from_features([featurize(scored, schema)])
    assert np.array_equal(learned.ids, served_batch.ids)
    assert np.array_equal(learned.dense.numpy(), served_batch.dense.numpy())
    recomputed = predict_events(served, joined, schema)
    logged_ctr = np.array([orjson.loads(v)[SERVED]["ctr"] for v in values])
    assert np.abs(recomputed - logged_ctr).max() <= 1e-6


def test_a_broker_outage_costs_no_request_and_no_record(isolated, schema, served, tmp_path):
    kafka = isolated.kafka
    ensure_topics(kafka)
    with TestClient(logging_app(isolated, schema, served, tmp_path)) as client:
        assert client.post("/predict", json=unlabelled(0)).status_code == 200
        kill_broker(isolated)
        try:
            answers = [client.post("/predict", json=unlabelled(i)).status_code for i in range(1, 101)]
            assert answers == [200] * 100  # scoring never waits for Kafka
            assert client.post("/click", json={"impression_id": "e1"}).status_code == 200
            waiting = client.get("/model").json()["log"]
            assert waiting["waiting"] >= 100 and waiting["queue_full"] == 0 and waiting["failed"] == 0
        finally:
            start_broker(isolated)
        deadline = time.monotonic() + 60
        while client.get("/model").json()["log"]["delivered"] < 102 and time.monotonic() < deadline:
            time.sleep(0.2)
        log = client.get("/model").json()["log"]
        assert log["delivered"] == 102 and log["waiting"] == 0 and log["failed"] == 0
    impressions = drain(kafka.bootstrap, kafka.impressions_topic, lambda m: len(m) >= 101, 60, "t-out")
    time.sleep(1.0)
    keys = [m.key() for m in impressions]
    assert len(keys) == 101 and len(set(keys)) == 101  # each once: the idempotent producer's retries


def test_held_candidates_survive_a_restart_and_a_full_queue_is_counted(isolated, schema, served, tmp_path):
    kafka = isolated.kafka
    ensure_topics(kafka)
    with TestClient(logging_app(isolated, schema, served, tmp_path)) as client:
        assert client.post("/predict?shown=false", json=[unlabelled(i) for i in range(3)]).status_code == 200
        assert client.get("/model").json()["log"]["pending_shown"] == 3
    with TestClient(logging_app(isolated, schema, served, tmp_path)) as client:  # the same server, started again
        assert client.post("/shown", json=[{"impression_id": "e1"}]).json() == {"shown": 1, "unknown": []}
    logged = drain(kafka.bootstrap, kafka.impressions_topic, lambda m: len(m) >= 1, 30, "t-restart")
    assert [m.key() for m in logged] == [b"e1"]

    small = replace(isolated.serving, log_impressions=True, log_queue=5, log_flush_s=0.5)
    small = replace(small, cache_dir=str(tmp_path / "c2"))
    sent = [served]
    kill_broker(isolated)
    try:
        app = create_app(small, schema, lambda current: sent.pop() if sent else None, kafka)
        with TestClient(app) as client:
            assert client.post("/predict", json=[unlabelled(i) for i in range(8)]).status_code == 200
            log = client.get("/model").json()["log"]
            assert log["queue_full"] == 3 and log["waiting"] == 5
            dropped = [line for line in client.get("/metrics").text.splitlines() if 'reason="queue_full"' in line]
            assert dropped and float(dropped[0].split()[-1]) >= 3
    finally:
        start_broker(isolated)
