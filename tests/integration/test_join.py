"""The joiner on the real broker: impressions and delayed clicks replayed as `replay --clicks` sends
them (some on another partition than their id's, as another partitioner puts them), joined by
`adstream join` SIGKILLed 5 times at random points and restarted, and the labelled events compared
one by one with the truth the generator knows: none lost, none twice, every label right; bad
impressions and clicks in the DLQ with their reasons. And a bounded log drained by `--until-idle`
with clicks from confluent-kafka's default partitioner: every window closed, the lag 0."""

from __future__ import annotations

import collections
import os
import random
import signal
import time
from dataclasses import dataclass, replace

import numpy as np
import pytest

from common.checks import with_changes
from stream.formats.arrow import event_table, is_arrow_bundle
from stream.join.outputs import read_events
from stream.join.policy import POLICIES
from stream.kafka.partitioner import murmur2_partition
from stream.kafka.topics import ensure_topics
from stream.produce.clicks import Split, interleave, split_clicks
from stream.produce.replay import ReplayRecord, replay
from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo
from stream.settings import JoinSettings

from .helpers import start_cli

pytestmark = pytest.mark.integration

WINDOW_S, LATENESS_S, RATE = 60, 5, 100  # impressions per event-time second


def _consume(bootstrap: str, topic: str, group: str, done, timeout_s: float) -> list:
    """Every record of `topic` a read_committed consumer sees until done(records) or the timeout."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([topic])
    out: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not done(out):
            out += [m for m in consumer.consume(500, timeout=0.5) if m.error() is None]
    finally:
        consumer.close()
    return out


def _joining(isolated, tmp_path, policy: str, **more):
    """The test's config with a joiner of `policy` at the module's window and allowance."""
    join = JoinSettings(
        policy=policy,
        window_s=WINDOW_S,
        allowed_lateness_s=LATENESS_S,
        state_dir=str(tmp_path / "join"),
        app_id=f"{isolated.stream.app_id}-joiner",
        **more,
    )
    # a trainer reading this config would learn the policy's labels with the loss it needs
    learns = with_changes(isolated.trainer, {"optim.delayed_feedback": POLICIES[policy].delayed_feedback[0]})
    return replace(isolated, stream=replace(isolated.stream, join=join), trainer=learns)


@dataclass(frozen=True)
class LiveLog:
    """Impressions with delayed clicks, generated, and the truth the joiner must find."""

    events: list[dict]  # the labelled events the impressions come from
    split: Split  # the impressions and their clicks (replay --clicks' split)
    imp_ts: dict[str, int]  # impression id -> its time
    in_window: set[str]  # the ids a click came for within the window: the positives
    sentinels: list[dict]  # an impression per partition past every window: event time closes them all


def live_log(
    schema,
    events: int,
    seeds: tuple[int, int],
    rate: float,
    window_s: float,
    lateness_s: float,
    partitions: int = 2,
) -> LiveLog:
    """`events` impressions at `rate` a second of event time, with clicks after them (seeds:
    the generator's, the split's), and their truth under a window of window_s."""
    generated, _ = SyntheticCriteo(schema, SyntheticConfig(seed=seeds[0])).generate(events)
    rng = np.random.default_rng(seeds[1])
    split = split_clicks(event_table(generated, schema), schema, rng, event_rate=rate)
    ids = [str(e["event_id"]) for e in generated]
    imp_ts = dict(zip(ids, split.impressions.column("ts").to_pylist(), strict=True))
    clicks = zip(split.click_ids, split.click_ts.tolist(), strict=True)
    in_window = {k for k, t in clicks if t - imp_ts[k] <= window_s * 1000}
    end = max(imp_ts.values()) + (window_s + lateness_s + 10) * 1000
    sentinels: dict[int, dict] = {}
    for n in range(100 * partitions):
        key = f"sentinel-{n}"
        sentinels.setdefault(murmur2_partition(key.encode(), partitions), {**generated[0], "event_id": key, "ts": end})
    assert len(sentinels) == partitions
    return LiveLog(generated, split, imp_ts, in_window, list(sentinels.values()))


def sentinel_records(log: LiveLog, schema, kafka, partitions: int = 2) -> list:
    """The sentinels' impressions, without clicks, as replay records."""
    tail = split_clicks(event_table(log.sentinels, schema), schema, np.random.default_rng(0))
    tail = replace(tail, click_ids=[], click_ts=np.zeros(0, np.int64))
    return list(interleave([tail], schema, kafka.impressions_topic, kafka.clicks_topic, partitions))


def _misrouted(records):
    """Every third click record and every fifth impression record on the other partition of two, as a
    producer with another partitioner would put them: the joiner moves them to their own."""
    for n, record in enumerate(records):
        if record.partition is not None and n % (3 if record.topic.endswith("clicks") else 5) == 0:
            record = record._replace(partition=1 - record.partition)
        yield record


@pytest.mark.parametrize(
    "policy,bundle,fmt",
    [("window", 1, "json"), ("fake_negative", 1, "json"), ("window", 40, "arrow"), ("fake_negative", 40, "arrow")],
)
def test_the_joiner_through_five_sigkills_emits_every_impression_once_with_its_true_label(
    isolated, tmp_path, schema, policy, bundle, fmt
):
    config = _joining(isolated, tmp_path, policy, take_records=32)
    kafka = config.kafka
    ensure_topics(kafka)
    # the truth: an impression is a positive iff a click came within the window; one sentinel
    # impression per partition, past every window, so event time closes them all
    log = live_log(schema, 3000, (11, 3), RATE, WINDOW_S, LATENESS_S)
    events, split, imp_ts, in_window, sentinels = log.events, log.split, log.imp_ts, log.in_window, log.sentinels
    bad = [
        ReplayRecord(b"b1", b'{"ts": 5, "I1": 3}', 1, None, kafka.impressions_topic),  # no id
        ReplayRecord(b"b2", b"not json", 1, None, kafka.impressions_topic),
        ReplayRecord(b"b3", b'{"event_id": "x", "ts": 5, "label": 1}', 1, None, kafka.impressions_topic),
        ReplayRecord(b"b4", b'{"impression_id": "x", "ts": "soon"}', 1, None, kafka.clicks_topic),
    ]
    records = [
        *_misrouted(
            interleave([split], schema, kafka.impressions_topic, kafka.clicks_topic, 2, bundle=bundle, fmt=fmt)
        ),
        *bad,
        *sentinel_records(log, schema, kafka),
    ]
    replay(records, kafka, progress=False)

    rng = random.Random(policy)
    for _ in range(5):  # SIGKILL at a random point, restart
        proc, log = start_cli(config, tmp_path, "join")
        time.sleep(rng.uniform(2.5, 5.0))
        assert proc.poll() is None, log.read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc, log = start_cli(config, tmp_path, "join")
    try:
        # fake_negative emits the sentinels too (at once, as negatives)
        expected = len(events) + (len(in_window) + len(sentinels) if policy == "fake_negative" else 0)

        def events(records: list) -> list[dict]:
            return [event for r in records for event in read_events(r.value())]

        _consume(kafka.bootstrap, kafka.events_topic, "check", lambda r: len(events(r)) >= expected, 240)
        time.sleep(3)  # anything emitted twice would be there now: read it all again
        out = _consume(kafka.bootstrap, kafka.events_topic, "check-all", lambda r: False, 8)
        letters = _consume(kafka.bootstrap, kafka.dlq_topic, "check-dlq", lambda r: len(r) >= len(bad), 30)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if fmt == "arrow":  # bundled impressions come out as Arrow bundles, never as JSON (the sentinels are JSON)
        theirs = [r for r in out if not all(e["event_id"].startswith("sentinel-") for e in read_events(r.value()))]
        assert theirs and all(is_arrow_bundle(r.value()) for r in theirs)
    emitted = [e for e in events(out) if not e["event_id"].startswith("sentinel-")]
    first = collections.Counter(e["event_id"] for e in emitted if e["label"] == 0 or policy == "window")
    positives = collections.Counter(e["event_id"] for e in emitted if e["label"] == 1)
    assert set(first) == set(imp_ts), "every impression emitted, nothing else"
    assert max(first.values()) == 1, f"emitted twice: {[k for k, v in first.items() if v > 1][:5]}"
    if policy == "window":
        assert set(positives) == in_window, "a positive iff clicked within the window"
    else:
        assert max(positives.values()) == 1 and in_window <= set(positives)
        assert set(positives) <= set(split.click_ids)  # late clicks may add a correction, never an unclicked one
    assert all(e["ts"] == imp_ts[e["event_id"]] for e in emitted)
    reasons = [dict(m.headers())["reason"].decode() for m in letters if dict(m.headers())["stage"] == b"join"]
    assert {
        "event_id: missing field",
        "ts: must be a non-negative integer (ms) below 2^62",
        "label: an impression carries no label: the joiner sets it from the clicks",
    } <= set(reasons)
    assert any(r.startswith("record: not JSON") for r in reasons)


def test_our_partitions_are_librdkafkas_murmur2(isolated):
    """replay --clicks places records itself; a producer keying by impression id with Java's
    partitioner (librdkafka's murmur2_random) must put each key where the joiner looks for it."""
    from confluent_kafka import Producer

    ensure_topics(isolated.kafka)
    rng = random.Random(5)
    keys = [bytes(rng.choices(range(32, 127), k=rng.randint(1, 40))) for _ in range(200)]
    placed: dict[bytes, int] = {}
    producer = Producer({"bootstrap.servers": isolated.kafka.bootstrap, "partitioner": "murmur2_random"})
    for key in keys:
        producer.produce(
            isolated.kafka.clicks_topic, b"{}", key, on_delivery=lambda e, m: placed.update({m.key(): m.partition()})
        )
    producer.flush(30)
    assert placed == {k: murmur2_partition(k, 2) for k in keys}


def test_with_no_click_at_all_every_window_closes_as_a_negative(isolated, tmp_path, schema):
    """An empty clicks partition holds no window open: the joiner is caught up with it from the start
    (its next offset is 'none read yet', not a number to compare with the end)."""
    join = JoinSettings(
        window_s=1, allowed_lateness_s=0, state_dir=str(tmp_path / "join"), app_id=f"{isolated.stream.app_id}-j"
    )
    config = replace(isolated, stream=replace(isolated.stream, join=join))
    kafka = config.kafka
    ensure_topics(kafka)
    events, _ = SyntheticCriteo(schema, SyntheticConfig(seed=5)).generate(200)
    split = split_clicks(event_table(events, schema), schema, np.random.default_rng(0), event_rate=10)
    split = replace(split, click_ids=[], click_ts=np.zeros(0, np.int64))  # no click at all
    replay(list(interleave([split], schema, kafka.impressions_topic, kafka.clicks_topic, 2, 20, "arrow")), kafka)
    ids, ts = split.impressions.column("event_id").to_pylist(), split.impressions.column("ts").to_pylist()
    newest = collections.defaultdict(int)
    for key, t in zip(ids, ts, strict=True):
        newest[murmur2_partition(key.encode(), 2)] = max(newest[murmur2_partition(key.encode(), 2)], t)
    closed = {k for k, t in zip(ids, ts, strict=True) if t + 1000 <= newest[murmur2_partition(k.encode(), 2)]}
    proc, log = start_cli(config, tmp_path, "join")
    try:
        done = lambda records: sum(len(read_events(r.value())) for r in records) >= len(closed)  # noqa: E731
        _consume(kafka.bootstrap, kafka.events_topic, "check", done, 120)
        time.sleep(2)
        out = [
            e
            for r in _consume(kafka.bootstrap, kafka.events_topic, "all", lambda r: False, 5)
            for e in read_events(r.value())
        ]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert sorted(e["event_id"] for e in out) == sorted(closed), log.read_text()[-2000:]
    assert {e["label"] for e in out} == {0}


@pytest.mark.parametrize("policy,bundle,fmt", [("window", 1, "json"), ("fake_negative", 20, "arrow")])
def test_a_bounded_log_from_another_partitioner_drains_with_true_labels_and_lag_0(
    isolated, tmp_path, schema, policy, bundle, fmt
):
    """Clicks produced as a Python user first writes them (confluent-kafka's default partitioner,
    CRC32, keyed by impression id), impressions by murmur2: `adstream join --until-idle` moves each
    click to its impression's partition, closes every window once the log is read, and exits;
    the group's lag is then 0 (transaction markers are not records), every label is the truth, and
    a positive copy shares its negative's partition, after it."""
    from confluent_kafka import Producer

    from adstream.running import consumer_lags

    config = _joining(isolated, tmp_path, policy)
    join = config.stream.join
    kafka = config.kafka
    ensure_topics(kafka)
    events, _ = SyntheticCriteo(schema, SyntheticConfig(seed=23)).generate(1500)
    split = split_clicks(event_table(events, schema), schema, np.random.default_rng(8), event_rate=RATE)
    imp_ts = dict(zip([str(e["event_id"]) for e in events], split.impressions.column("ts").to_pylist(), strict=True))
    in_window = {k for k, t in zip(split.click_ids, split.click_ts.tolist(), strict=True) if t - imp_ts[k] <= 60_000}
    records = list(interleave([split], schema, kafka.impressions_topic, kafka.clicks_topic, 2, bundle, fmt))
    producer = Producer({"bootstrap.servers": kafka.bootstrap})  # the default partitioner
    clicks_moved = 0
    for r in records:
        if r.topic == kafka.clicks_topic:
            producer.produce(r.topic, r.value, r.key)
            clicks_moved += crc_partition(r.key) != r.partition
        else:
            producer.produce(r.topic, r.value, r.key, r.partition)
    assert producer.flush(30) == 0
    assert clicks_moved > len(split.click_ids) // 4  # the default partitioner puts many elsewhere

    proc, log = start_cli(config, tmp_path, "join", "--until-idle", "3")
    try:
        assert proc.wait(180) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "moved there, exactly once" in log.read_text()
    out = _consume(kafka.bootstrap, kafka.events_topic, "check", lambda r: False, 8)
    emitted = [(m.partition(), (m.offset(), i), e) for m in out for i, e in enumerate(read_events(m.value()))]
    first = collections.Counter(e["event_id"] for _, _, e in emitted if e["label"] == 0 or policy == "window")
    positives = {e["event_id"] for _, _, e in emitted if e["label"] == 1}
    assert set(first) == set(imp_ts) and max(first.values()) == 1, "every impression once, the tail's too"
    if policy == "window":
        assert positives == in_window, "a positive iff clicked within the window"
    else:
        assert in_window <= positives <= set(split.click_ids)
        negative = {e["event_id"]: (p, o) for p, o, e in emitted if e["label"] == 0}
        copies = [(p, o, negative[e["event_id"]]) for p, o, e in emitted if e["label"] == 1]
        assert all(p == q and o > at for p, o, (q, at) in copies), "a copy beside its negative, after it"
    letters = _consume(kafka.bootstrap, kafka.dlq_topic, "check-dlq", lambda r: False, 3)
    assert not letters, [dict(m.headers())["reason"] for m in letters][:3]
    lags = consumer_lags(kafka.bootstrap, {join.app_id: [kafka.impressions_topic, kafka.clicks_topic]})
    assert lags[join.app_id]["lag"] == {kafka.impressions_topic: 0, kafka.clicks_topic: 0}


def crc_partition(key: bytes, partitions: int = 2) -> int:
    """librdkafka's default partitioner for a keyed record: CRC32 of the key."""
    import zlib

    return zlib.crc32(key) % partitions
