"""BatchSource: reads Arrow batches from the batches topic and assembles training batches.

Replica r of a group of N reads the partitions p with p % N == r (a fixed share, logged), from
the offsets of the snapshot it resumed from, else the group's committed offsets, else the start.
Stream batches are never split, so the (partition, offset) records of a training batch say
exactly which Kafka records it holds. Events a featurizer wrote twice are dropped as they are
handed out (trainer/replayed.py), against marks resumed with the offsets. Offsets are committed
to Kafka only by `commit`, which the loop calls after the snapshot holding them is durable.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import Counter

from stream.errors import StreamError
from stream.formats.batch_codec import decode_batch
from stream.kafka.client_log import broker_back, quiet_logs
from stream.kafka.retry import retrying
from stream.kafka.settings import KafkaSettings
from stream.records import FeatureBatch
from trainer.batch import Batch, batch_from_features
from trainer.errors import TrainerError
from trainer.replayed import unseen

log = logging.getLogger("adstream.trainer")
REPLAYED = Counter("adstream_trainer_replayed_events_total", "events dropped as learned before (written twice)")
COMMIT_GIVE_UP_S = 60.0  # how long a refused offset commit is retried before it is left to the next snapshot


FOREIGN_STOP = 10  # batches, all of another schema and none of ours, that stop the trainer
READ_AHEAD_PARTS = 256  # stream batches read ahead at most while waiting for a partition to catch up


def _event_time(part: FeatureBatch | None) -> int:
    """A queued record's place in event time: its newest event (a skipped record: at once)."""
    return int(part.ts.max()) if part is not None and len(part.ts) else -(1 << 62)


def schema_label(schema_hash: str, name: str = "") -> str:
    """A schema hash with its name: the one a batch carries, else its bundled schema's name:
    "avazu (315e9a39eaf96a1c)"."""
    from stream.schema import SCHEMA_DIR, load_schema

    if name:
        return f"{name} ({schema_hash})"
    for path in sorted(SCHEMA_DIR.glob("*.toml")):
        if load_schema(path).hash == schema_hash:
            return f"{path.stem} ({schema_hash})"
    return f"(not a bundled schema) {schema_hash}"


def partitions_of(rank: int, world: int, partitions: int) -> list[int]:
    """The fixed share of the batches topic's partitions replica `rank` of `world` reads."""
    return [p for p in range(partitions) if reads(rank, world, p)]


def reads(rank: int, world: int, partition: int) -> bool:
    """Whether replica `rank` of `world` reads `partition` of the batches topic."""
    return partition % world == rank


class BatchSource:
    def __init__(
        self,
        kafka: KafkaSettings,
        group_id: str,
        schema_hash: str,
        rank: int = 0,
        world: int = 1,
        start_offsets: dict[int, int] | None = None,
        start_marks: dict[int, int] | None = None,
    ) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from stream.kafka.topics import ensure_topics

        self.kafka = kafka
        self.schema_hash = schema_hash
        ensure_topics(kafka)
        self.consumer = Consumer(
            {
                "bootstrap.servers": kafka.bootstrap,
                "group.id": group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "fetch.max.bytes": max(kafka.max_message_bytes, 52428800),
                "max.partition.fetch.bytes": kafka.max_message_bytes,
                **quiet_logs(),
            }
        )
        topic = kafka.batches_topic
        count = len(self.consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        self.partitions = partitions_of(rank, world, count)
        if not self.partitions:
            log.warning("replica %d of %d: %s has %d partitions, none for this replica", rank, world, topic, count)
        starts = dict(start_offsets or {})
        missing = [p for p in self.partitions if p not in starts]
        if missing:
            starts.update(self._committed(missing))
        self.consumer.assign([TopicPartition(topic, p, starts[p]) for p in self.partitions])
        log.warning(
            "replica %d of %d reads %s partitions %s from %s",
            rank,
            world,
            topic,
            self.partitions,
            {p: starts[p] if starts[p] >= 0 else "start" for p in self.partitions},
        )
        self.position: dict[int, int] = {}  # partition -> next offset after what was handed out
        self.marks = dict(start_marks or {})  # events-topic partition -> newest source key handed out
        self.replayed = 0  # events dropped as handed out before (a featurizer wrote them twice)
        self.dropping = False  # the last stream batch handed out had such events (one log line per stretch)
        self.fetched = {p: o for p, o in starts.items() if o >= 0}  # partition -> next offset to fetch
        self.queued: dict[int, deque[tuple[tuple[int, int], FeatureBatch | None]]] = {}  # read, not handed out
        self.outage = False  # a consumer error was logged and no record has come since
        self.skipped = 0  # records that could not be decoded (logged, counted)
        self.learned_parts = 0  # batches of this trainer's schema handed out
        self.foreign: dict[str, int] = {}  # schema hash -> batches of another schema skipped

    def _foreign(self, schema_hash: str, schema_name: str = "") -> None:
        """A batch of another schema: logged once per schema; when the first FOREIGN_STOP batches
        are all foreign (nothing learned yet), a wrong setting, not a migration: stop, naming both."""
        self.foreign[schema_hash] = self.foreign.get(schema_hash, 0) + 1
        theirs, ours = schema_label(schema_hash, schema_name), schema_label(self.schema_hash)
        if self.foreign[schema_hash] == 1:
            log.error("skipping batches of schema %s: this trainer learns schema %s", theirs, ours)
        if self.learned_parts == 0 and sum(self.foreign.values()) >= FOREIGN_STOP:
            name = theirs.split(" ")[0]
            fix = f"--set stream.schema={name}" if not name.startswith("(") else "stream.schema = the featurizer's"
            raise TrainerError(
                f"{self.kafka.batches_topic}: the first {sum(self.foreign.values())} batches were featurized under "
                f"schema {theirs}; this trainer expects {ours}: run train (and serve) with {fix}, as the featurizer"
            )

    def _committed(self, partitions: list[int], timeout_s: float = 60.0) -> dict[int, int]:
        """The group's committed offsets (OFFSET_BEGINNING where none), retried while the broker
        is still electing the group's coordinator (NOT_COORDINATOR right after a group is new)."""
        from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

        wanted = [TopicPartition(self.kafka.batches_topic, p) for p in partitions]
        try:
            tps = retrying(lambda: self.consumer.committed(wanted, timeout=10), "committed offsets", log, timeout_s)
        except KafkaException as exc:
            raise TrainerError(
                f"kafka at {self.kafka.bootstrap}: committed offsets of {self.kafka.batches_topic} "
                f"unavailable ({exc}); is the broker up (`adstream up`)?"
            ) from None
        return {tp.partition: tp.offset if tp.offset >= 0 else OFFSET_BEGINNING for tp in tps}

    def batches(self, batch_size: int, idle_s: float = 1.0, first_wait_s: float = 30.0) -> Iterator[Batch | None]:
        """Yield training batches of >= batch_size events (or fewer after idle_s without data);
        None when nothing arrived for idle_s (first_wait_s before the first record: the first
        fetch is slow), which lets the loop check its stop conditions and keep its group in step.

        A replica with a backlog in several partitions reads them in step, in event time: of the
        stream batches read, the next one learned is the partition head with the oldest newest
        event time, once every partition with unread records has a head to compare (Kafka hands
        out whole fetches of one partition at a time: read as fetched, a catching-up trainer
        learned one partition's hour before another's, in an order set by fetch timing). A
        partition that delivers nothing for idle_s, or READ_AHEAD_PARTS stream batches waiting,
        ends the wait."""
        parts: list[FeatureBatch] = []
        records: list[tuple[int, int]] = []
        rows = 0
        last_data = time.monotonic() + max(first_wait_s - idle_s, 0.0)
        while True:
            messages = self.consumer.consume(256, timeout=0.1)
            self._read(messages)
            if messages:
                last_data = time.monotonic()
                broker_back()
            idle = time.monotonic() - last_data >= idle_s
            while (taken := self._take(in_step=not idle)) is not None:
                (partition, offset), part = taken
                self.position[partition] = offset + 1
                if part is not None:
                    part = self._unseen(part, partition, offset)
                if part is None:  # a record skipped (logged when read) or all seen: only the position moves
                    continue
                parts.append(part)
                records.append((partition, offset))
                rows += len(part)
                if rows >= batch_size:
                    yield batch_from_features(parts, self.position, tuple(records), self.marks)
                    parts, records, rows = [], [], 0
                    last_data = max(last_data, time.monotonic())  # idle counts time spent waiting here only
            if idle:
                if parts:
                    yield batch_from_features(parts, self.position, tuple(records), self.marks)
                    parts, records, rows = [], [], 0
                else:
                    yield None
                last_data = time.monotonic()

    def _unseen(self, part: FeatureBatch, partition: int, offset: int) -> FeatureBatch | None:
        """`part` without the events handed out before (None if none is left); counted, and logged
        once per stretch of drops."""
        fresh, self.marks = unseen(part, self.marks)
        dropped = len(part) - len(fresh)
        if dropped:
            if not self.dropping:
                log.warning(
                    "batches %s:%s: %d of %d events were learned before (a featurizer wrote them twice, e.g. "
                    "after a worker died); dropped, as are the next such",
                    partition,
                    offset,
                    dropped,
                    len(part),
                )
            REPLAYED.inc(dropped)
            self.replayed += dropped
        self.dropping = dropped > 0
        return fresh if len(fresh) else None

    def _read(self, messages: list) -> None:
        """Decode fetched records into their partition's queue; an undecodable record or one of
        another schema is queued as None (its offset still has to be passed in order)."""
        for message in messages:
            error = message.error()
            if error is not None:
                if error.fatal():
                    raise TrainerError(f"kafka consumer on {self.kafka.batches_topic}: {error}")
                if not self.outage:  # librdkafka retries by itself: one line per outage, not one per error
                    log.warning("kafka consumer on %s: %s (retrying)", self.kafka.batches_topic, error)
                self.outage = True
                continue
            if self.outage:
                log.warning("kafka consumer on %s: reading again", self.kafka.batches_topic)
                self.outage = False
            partition, offset = message.partition() or 0, message.offset() or 0
            self.fetched[partition] = offset + 1
            part: FeatureBatch | None = None
            try:
                part = decode_batch(message.value() or b"")
            except StreamError as exc:
                self.skipped += 1
                log.error("skipping batch at %s:%s: %s", partition, offset, exc)
            if part is not None and part.schema_hash != self.schema_hash:
                self.skipped += 1
                self._foreign(part.schema_hash, part.schema_name)
                part = None
            if part is not None:
                self.learned_parts += 1
            self.queued.setdefault(partition, deque()).append(((partition, offset), part))

    def _take(self, in_step: bool) -> tuple[tuple[int, int], FeatureBatch | None] | None:
        """The next queued record to learn: the head with the oldest newest event time (a skipped
        record first); None while a partition with unread records has nothing queued to compare
        (unless not in_step, or READ_AHEAD_PARTS records are queued)."""
        heads = {p: q[0] for p, q in self.queued.items() if q}
        if not heads:
            return None
        waiting = sum(len(q) for q in self.queued.values())
        if (
            in_step
            and waiting < READ_AHEAD_PARTS
            and any(not self._caught_up(p) for p in self.partitions if p not in heads)
        ):
            return None
        p = min(heads, key=lambda p: _event_time(heads[p][1]))
        return self.queued[p].popleft()

    def _caught_up(self, partition: int) -> bool:
        """Whether every record of `partition` known to the last fetch was read (its high offset)."""
        from confluent_kafka import TopicPartition

        low, high = self.consumer.get_watermark_offsets(
            TopicPartition(self.kafka.batches_topic, partition), cached=True
        )
        if high is None or high < 0:
            return False  # no fetch answered for it yet
        fetched = self.fetched.get(partition)
        return fetched >= high if fetched is not None else low >= high

    def commit(self, offsets: dict[int, int], give_up_s: float = COMMIT_GIVE_UP_S) -> bool:
        """Commit this replica's share of `offsets` (partition -> next offset) to the group; True
        once committed. Never fatal: the snapshot just written holds these offsets and is what a
        restart resumes from, so a commit the broker refuses (a coordinator moving after a broker
        restart: NOT_COORDINATOR) is retried with backoff for give_up_s, then logged and left to
        the next snapshot's commit."""
        from confluent_kafka import KafkaException, TopicPartition

        mine = {p: o for p, o in offsets.items() if p in self.partitions}
        if not mine:
            return True
        tps = [TopicPartition(self.kafka.batches_topic, p, o) for p, o in mine.items()]
        try:
            retrying(lambda: self.consumer.commit(offsets=tps, asynchronous=False), "commit", log, give_up_s)
        except KafkaException as exc:
            log.error(
                "kafka at %s: offsets %s of %s not committed (%s); the snapshot holds them, the next snapshot "
                "commits again",
                self.kafka.bootstrap,
                mine,
                self.kafka.batches_topic,
                exc,
            )
            return False
        return True

    def close(self) -> None:
        self.consumer.close()


class LearnLog:
    """Audit log of the Kafka records a replica learned: `partition offset step attempt` per line."""

    def __init__(self, folder: str, rank: int) -> None:
        self.file = None
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(folder) / f"rank{rank}.tsv", "a")  # noqa: SIM115 (closed by close())
        self.attempt = os.environ.get("ADSTREAM_ATTEMPT", "0")

    def write(self, batch: Batch, step: int) -> None:
        if self.file:
            self.file.write("".join(f"{p}\t{o}\t{step}\t{self.attempt}\n" for p, o in batch.records))
            self.file.flush()  # in the OS's hands: survives a SIGKILL of this process

    def close(self) -> None:
        if self.file:
            self.file.close()
