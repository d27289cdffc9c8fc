"""Faults on the real broker, MLflow and processes: the broker SIGKILLed in the middle of a replay,
for a moment and for over a minute (the replay finishes by itself and every event is on the topic
exactly once), and a replay resumed after it stopped early (`--resume`: nothing twice); the broker
SIGKILLed and restarted under a running featurizer and trainer (both carry on by themselves, the
trainer's commit riding out NOT_COORDINATOR, and every event is learned); the publishing trainer
SIGKILLed in the middle of a delta (serving never sees a torn one)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from stream.formats.batch_codec import decode_batch
from stream.kafka.topics import ensure_topics
from stream.produce.replay import replay, synthetic_records
from stream.produce.synthetic import SyntheticCriteo
from stream.schema import load_schema
from tests.integration.helpers import drain, restart_broker, start_cli, stop_process

pytestmark = pytest.mark.integration
EVENTS = 60_000
HALF = 10_000  # events replayed before the broker kill, and again after it


@pytest.mark.parametrize(
    "events, rate, down_s",
    [(EVENTS, 10_000, 1.0), (20_000, 8_000, 65.0)],
    ids=["a-3s-outage", "an-outage-longer-than-a-minute"],
)
def test_replay_waits_out_a_broker_outage_with_every_event_once(isolated, tmp_path, events, rate, down_s):
    """The broker SIGKILLed in the middle of a replay and started again after down_s: the replay
    waits (as long as the producer's own delivery timeout, 300 s, so past a minute too) and ends
    with every event on the topic exactly once (the idempotent producer retries what was in flight
    and the broker drops the duplicates)."""
    schema = load_schema()
    kafka = isolated.kafka
    ensure_topics(kafka)
    generated, _ = SyntheticCriteo(schema).generate(events)
    done: dict[str, object] = {}

    def run() -> None:
        try:
            done["summary"] = replay(synthetic_records(generated, schema), kafka, rate=rate, progress=False)
        except Exception as exc:  # reported below
            done["error"] = exc

    producer = threading.Thread(target=run)
    producer.start()
    time.sleep(1.0)  # a part of the events is on the broker, the rest to come
    restart_broker(isolated, down_s=down_s)
    producer.join(300)
    assert not producer.is_alive() and "error" not in done, done.get("error")
    assert done["summary"].events == events  # type: ignore[attr-defined]

    group = f"c-{uuid.uuid4().hex[:6]}"
    ids = [m.key() for m in drain(kafka.bootstrap, kafka.events_topic, lambda m: len(m) >= events, 120, group)]
    assert len(set(ids)) == events  # every event
    assert topic_size(kafka) == events  # and nothing twice: the log holds exactly that many records


def test_replay_resume_sends_only_what_the_topics_lack(isolated, tmp_path):
    """`adstream replay --resume` after a replay that stopped part way: the topic ends with every
    event once, and the resumed run says how many it skipped."""
    import json

    kafka = isolated.kafka
    ensure_topics(kafka)
    first, log = start_cli(isolated, tmp_path, "replay", "--synthetic", "6000", "--limit", "2500")
    assert first.wait(120) == 0, log.read_text()[-2000:]
    assert topic_size(kafka) == 2500
    (tmp_path / "again").mkdir()
    again, log = start_cli(isolated, tmp_path / "again", "replay", "--synthetic", "6000", "--resume")
    assert again.wait(120) == 0, log.read_text()[-2000:]
    summary = json.loads(next(line for line in reversed(log.read_text().splitlines()) if line.startswith("{")))
    assert summary["events"] == 3500 and summary["skipped"] == 2500
    group = f"c-{uuid.uuid4().hex[:6]}"
    ids = [m.key() for m in drain(kafka.bootstrap, kafka.events_topic, lambda m: len(m) >= 6000, 60, group)]
    assert len(set(ids)) == 6000 and topic_size(kafka) == 6000


def test_featurizer_and_trainer_carry_on_through_a_broker_kill(isolated, tmp_path):
    """The featurizer (its own process) and the trainer keep running while the broker is killed and
    restarted; the events replayed before and after all reach the batches topic and the trainer
    learns every batch record on it, each once (its offsets), without being restarted."""
    from trainer.loop import run_training

    schema = load_schema()
    kafka = isolated.kafka
    ensure_topics(kafka)
    events, _ = SyntheticCriteo(schema).generate(2 * HALF)
    config = replace(isolated, trainer=replace(isolated.trainer, group_id=f"t-{uuid.uuid4().hex[:6]}"))
    worker, log = start_cli(config, tmp_path, "stream")
    learned: dict[str, object] = {}

    def train() -> None:
        try:
            learned["summary"] = run_training(
                schema, kafka, config.trainer, config.mlflow, idle_exit_s=45, progress=False
            )
        except Exception as exc:  # reported below
            learned["error"] = exc

    trainer = threading.Thread(target=train)
    try:
        assert replay(synthetic_records(events[:HALF], schema), kafka, progress=False).events == HALF
        trainer.start()
        wait_for_batches(kafka, HALF, 120)  # the first half is featurized before the broker dies
        restart_broker(isolated)
        assert replay(synthetic_records(events[HALF:], schema), kafka, progress=False).events == HALF
        trainer.join(300)
        assert worker.poll() is None, f"the featurizer died:\n{log.read_text()[-3000:]}"
    finally:
        stop_process(worker)
    assert not trainer.is_alive() and "error" not in learned, learned.get("error")
    batches = [decode_batch(m.value()) for m in wait_for_batches(kafka, 2 * HALF, 60)]
    ids = {e for b in batches for e in b.event_ids}
    assert ids == {str(e[schema.event_id]) for e in events}, f"featurizer log:\n{log.read_text()[-3000:]}"
    # at-least-once upstream (a batch written just before the kill may be written again), exactly
    # once in the trainer: it learned every event once (a second copy is dropped: trainer/replayed.py)
    assert learned["summary"].events == len(ids) == 2 * HALF  # type: ignore[attr-defined]


def test_a_featurizer_killed_before_its_commit_costs_the_trainer_nothing(isolated, tmp_path):
    """A featurizer worker SIGKILLed once its first batches landed, before Faust committed their
    offsets (its commit interval is an hour here: a kill in time is not left to chance), and two
    workers of the same app after it: what it wrote is featurized again (by whichever of them holds
    the partition, and again by the other when a rebalance moves it), so the batches topic holds
    copies from several writers of one source partition (counted: the test needs some). The
    trainer's source learns every event once, and so does a source that resumes halfway with the
    offsets and marks the first one reached (as a restored snapshot has them)."""
    from trainer.source import BatchSource

    schema = load_schema()
    kafka = isolated.kafka
    ensure_topics(kafka)
    events, _ = SyntheticCriteo(schema).generate(2 * HALF)
    assert replay(synthetic_records(events, schema, 20, "arrow"), kafka, progress=False).events == 2 * HALF
    # takes of 1,000 events
    config = replace(isolated, stream=replace(isolated.stream, take_records=50, commit_interval_s=3600.0))
    first = start_cli(config, _folder(tmp_path / "first"), "stream")
    workers = {"first": first}
    try:
        deadline = time.monotonic() + 120
        while not sum(topic_ends(kafka, kafka.batches_topic)) and time.monotonic() < deadline:
            time.sleep(0.02)
        first[0].send_signal(signal.SIGKILL)  # batches written, their offsets not committed
        first[0].wait(30)
        workers.update({name: start_cli(config, _folder(tmp_path / name), "stream") for name in ("a", "b")})
        wait_for_batches(kafka, 2 * HALF, 240)
    finally:
        for worker, _ in workers.values():
            stop_process(worker)
    batches = [decode_batch(m.value()) for m in all_batches(kafka)]  # the copies written after too
    logs = "\n".join(log.read_text()[-2000:] for _, log in workers.values())
    written = [e for b in batches for e in b.event_ids]
    assert set(written) == {str(e[schema.event_id]) for e in events}, f"featurizer logs:\n{logs}"
    assert len(written) > 2 * HALF, "the kill came after the commit: nothing was written twice, nothing tested"

    def learn(source: BatchSource, stop_after: int | None = None) -> list[str]:
        out: list[str] = []
        try:
            for batch in source.batches(256, idle_s=3.0, first_wait_s=30):
                if batch is None:
                    break
                out += batch.event_ids
                if stop_after is not None and len(out) >= stop_after:
                    break
        finally:
            source.close()
        return out

    group = f"{isolated.trainer.group_id}-replayed"
    alone = BatchSource(kafka, group, schema.hash)
    assert sorted(learn(alone)) == sorted(set(written)) and alone.replayed == len(written) - 2 * HALF
    first = BatchSource(kafka, f"{group}-1", schema.hash)
    head = learn(first, stop_after=HALF)
    then = BatchSource(kafka, f"{group}-2", schema.hash, start_offsets=first.position, start_marks=first.marks)
    tail = learn(then)
    assert sorted(head + tail) == sorted(set(written))  # every event once across the resume


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def topic_ends(kafka, topic: str) -> list[int]:
    """Each partition's end (high watermark) of `topic`."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": f"size-{uuid.uuid4().hex[:6]}"})
    try:
        return [
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(kafka.partitions)
        ]
    finally:
        consumer.close()


def all_batches(kafka) -> list:
    """Every record on the batches topic (written outside transactions: one offset per record)."""
    total = sum(topic_ends(kafka, kafka.batches_topic))
    return drain(kafka.bootstrap, kafka.batches_topic, lambda m: len(m) >= total, 60, f"all-{uuid.uuid4().hex[:6]}")


def wait_for_batches(kafka, events: int, timeout_s: float) -> list:
    """The batch records on the topic once they hold `events` distinct events (or the timeout)."""

    def distinct(messages) -> int:
        return len({e for m in messages for e in decode_batch(m.value()).event_ids})

    group = f"b-{uuid.uuid4().hex[:6]}"
    return drain(kafka.bootstrap, kafka.batches_topic, lambda m: distinct(m) >= events, timeout_s, group)


def topic_size(kafka) -> int:
    """Records in the events topic: the sum of its partitions' high watermarks."""
    return sum(topic_ends(kafka, kafka.events_topic))


def test_a_trainer_killed_while_publishing_a_delta_never_shows_serving_a_torn_one(isolated, tmp_path):
    """SIGKILL the publishing replica while a delta is on its way to MLflow (its local folder
    exists from the moment it is written until the upload is done). Serving, polling all along,
    never fails on a delta and sees each version's deltas strictly in order; the group restarts
    and serving ends on its final base."""
    import re

    from common.checks import with_changes
    from serving.app import registry_fetch
    from tests.integration.helpers import start_cli
    from tests.integration.test_recovery import job_config, produce_batches

    produce_batches(isolated)
    (tmp_path / "deltas").mkdir()
    config = job_config(isolated, tmp_path, "deltas")
    config = replace(
        config, trainer=with_changes(config.trainer, {"snapshot.publish_every_s": 0.01, "snapshot.every_steps": 40})
    )
    schema = load_schema(config.stream.schema)
    fetch = registry_fetch(config.mlflow.tracking_uri, config.mlflow.model_name, config.serving, schema)
    seen: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve() -> None:
        current = None
        while not stop.is_set():
            try:
                newer = fetch(current)
            except BaseException as exc:  # noqa: BLE001 (the test reports it)
                errors.append(exc)
                return
            if newer is not None:
                current = newer
                seen.append((current.version, current.sequence))
            time.sleep(0.01)

    server = threading.Thread(target=serve)
    server.start()
    proc, log = start_cli(config, tmp_path / "deltas", "train", "--idle-exit", "4")
    try:
        deltas = Path(config.trainer.snapshot.dir) / "deltas"
        deadline = time.monotonic() + 120
        while not (deltas.is_dir() and any(deltas.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.001)
        pids = re.search(r"replicas \[([\d, ]+)\]", log.read_text())
        assert pids and deltas.is_dir(), log.read_text()[-2000:]
        os.kill(int(pids.group(1).split(",")[0]), signal.SIGKILL)  # rank 0 publishes
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
        time.sleep(3 * config.serving.poll_s + 2)
    finally:
        stop.set()
        server.join(60)
    assert "restart 1" in log.read_text()
    assert not errors, errors
    for version in {v for v, _ in seen}:
        sequences = [s for v, s in seen if v == version]
        assert sequences == sorted(set(sequences)), (version, sequences)
    assert any(s > 0 for _, s in seen)  # deltas were served
