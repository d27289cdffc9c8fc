"""Replay ad logs into Kafka: raw log files of any schema (its [source] table), or the synthetic generator.

Logs are parsed and checked in blocks, column-wise (logs.py); each good row becomes one JSON event on
`events_topic` (key = event id), or a bundle of rows becomes one record (newline-separated JSON,
or an Arrow IPC stream with fmt="arrow"). A row that fails goes to the dead-letter topic with its
reason: nothing is dropped silently. Throughput settings follow confluent-kafka's advice: linger,
lz4, idempotence, no per-message callbacks (only errors are reported), poll every ~1000 messages.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from stream.errors import StreamError
from stream.formats.arrow import encode_table, event_table
from stream.formats.dead_letter import dead_letter, record_size
from stream.formats.json_lines import json_lines, utf8_values
from stream.kafka.client_log import broker_back, quiet_logs
from stream.kafka.settings import KafkaSettings
from stream.produce.logs import read_log
from stream.schema import Schema

BUNDLE_FORMATS = ("json", "arrow")


DELIVERY_TIMEOUT_MS = 300_000  # how long a record may wait for a broker (librdkafka's default, stated)


@dataclass(frozen=True)
class ReplaySummary:
    events: int  # events produced to the events topic
    bytes: int  # bytes of event values produced
    seconds: float
    events_per_s: float
    rejected: int  # lines sent to the dead-letter topic instead
    skipped: int = 0  # records left out because the topics already held them (resume)
    clicks: int = 0  # click records sent to the clicks topic (replay --clicks; not counted in events)


class ReplayRecord(NamedTuple):
    """One Kafka record to send: events (to the events topic) or a rejected line (to the DLQ).
    Immutable like the other hops' dataclasses, but a tuple: replay makes one per event, and a
    frozen dataclass costs ~0.5 us of a ~10 us budget to build."""

    key: bytes  # the first event's id (a reject: where it was in the log)
    value: bytes  # one JSON event, a bundle, or the rejected line
    events: int  # events in the value (0 for a reject)
    reason: str | None = None  # why it was rejected; None for events
    topic: str | None = None  # where events go when not the events topic (replay --clicks: impressions, clicks)
    partition: int | None = None  # the partition to write to (None: the producer's partitioner, by key)


def table_records(table: pa.Table, schema: Schema, bundle: int = 1, fmt: str = "json") -> Iterator[ReplayRecord]:
    """Encode a bundle-layout table as Kafka records: one JSON event each, or bundles of `bundle` rows."""
    if fmt not in BUNDLE_FORMATS:
        raise StreamError(f"replay: bundle format {fmt!r}; use one of {list(BUNDLE_FORMATS)}")
    if not table.num_rows:
        return
    if fmt == "arrow":
        ids = table.column(schema.event_id).to_pylist()
        for start in range(0, table.num_rows, max(bundle, 1)):
            part = table.slice(start, max(bundle, 1))
            yield ReplayRecord(str(ids[start]).encode(), encode_table(part), part.num_rows)
        return
    lines = json_lines(table)
    if bundle <= 1:
        keys = utf8_values(pc.fill_null(table.column(schema.event_id).combine_chunks().cast(pa.string()), "None"))
        yield from map(ReplayRecord, keys, lines, [1] * len(lines))
        return
    ids = table.column(schema.event_id).to_pylist()
    for start in range(0, len(lines), bundle):
        chunk = lines[start : start + bundle]
        yield ReplayRecord(str(ids[start]).encode(), b"\n".join(chunk), len(chunk))


def log_records(
    paths: Iterable[str | Path], schema: Schema, loop: bool = False, bundle: int = 1, fmt: str = "json"
) -> Iterator[ReplayRecord]:
    """Raw log files (read by the schema's [source] table) -> records; bad rows become DLQ records."""
    for block in read_log(paths, schema, loop):
        for bad in block.bad:
            yield ReplayRecord(bad.where.encode(), bad.raw, 0, f"{bad.where}: {bad.reason}")
        yield from table_records(block.good, schema, bundle, fmt)


def synthetic_records(
    events: Iterable[dict[str, object]], schema: Schema, bundle: int = 1, fmt: str = "json"
) -> Iterator[ReplayRecord]:
    return table_records(event_table(list(events), schema), schema, bundle, fmt)


def producer_config(kafka: KafkaSettings) -> dict[str, object]:
    return {
        "bootstrap.servers": kafka.bootstrap,
        "enable.idempotence": True,
        # Java's default partitioner: impressions and clicks that a Java producer keys by impression
        # id land in the partitions ours do (the joiner needs the two topics co-partitioned)
        "partitioner": "murmur2_random",
        "acks": "all",
        "linger.ms": 50,
        "compression.type": "lz4",
        "batch.size": 1 << 20,
        "message.max.bytes": kafka.max_message_bytes,
        "queue.buffering.max.kbytes": 1 << 20,
        "delivery.report.only.error": True,
        "message.timeout.ms": DELIVERY_TIMEOUT_MS,
        **quiet_logs(),
    }


class KafkaWriter:
    """A confluent-kafka producer that counts delivery errors instead of taking per-message callbacks."""

    def __init__(self, kafka: KafkaSettings) -> None:
        from confluent_kafka import Producer

        self.errors: list[str] = []
        config = producer_config(kafka)
        config["on_delivery"] = self._on_error
        self._producer = Producer(config)
        self._since_poll = 0
        self._queued = 0  # records in the producer's queue at the last poll

    def _on_error(self, err: object, msg: object) -> None:  # only errors are reported (see config)
        if err is not None:
            self.errors.append(str(err))

    def send(
        self,
        topic: str,
        value: bytes,
        key: bytes | None = None,
        headers: dict[str, str] | dict[str, bytes] | None = None,
        partition: int | None = None,
    ) -> None:
        extra: dict[str, Any] = {}
        if headers is not None:
            extra["headers"] = headers
        if partition is not None:
            extra["partition"] = partition
        try:
            self._producer.produce(topic, value, key, **extra)
        except BufferError:  # local queue full: let librdkafka send, then retry
            while True:
                self._producer.poll(0.05)
                try:
                    self._producer.produce(topic, value, key, **extra)
                    break
                except BufferError:
                    continue
        self._since_poll += 1
        if self._since_poll >= 1000:
            self._producer.poll(0)
            self._since_poll = 0
            queued = len(self._producer)
            if queued < self._queued:  # records went out: the broker answers
                broker_back()
            self._queued = queued

    def flush(self, timeout_s: float = DELIVERY_TIMEOUT_MS / 1000 + 30) -> None:
        """Wait until every record is delivered: as long as the producer itself keeps retrying (a
        broker away for minutes is waited for), then a little more for the reports to arrive."""
        left = self._producer.flush(timeout_s)
        if left or self.errors:
            raise StreamError(
                f"kafka producer: {left} message(s) undelivered, {len(self.errors)} error(s): {self.errors[:3]}; "
                "once the broker is back, run the same replay with --resume to send only what the topic lacks"
            )


def held_keys(kafka: KafkaSettings, topics: Iterable[str]) -> set[bytes]:
    """The keys of every record the topics hold now (events: the event id, or a bundle's first
    event id; replay's dead letters: where the line was), read from the start up to each
    partition's end as it is now. What `--resume` skips."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": kafka.bootstrap, "group.id": "adstream-replay-resume", "enable.auto.commit": False}
    )
    keys: set[bytes] = set()
    try:
        ends: dict[tuple[str, int], int] = {}
        for topic in topics:
            for p in consumer.list_topics(topic, timeout=30).topics[topic].partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
                if high > low:
                    ends[(topic, p)] = high
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in ends])
        while ends:
            messages = consumer.consume(10_000, timeout=1.0)
            for message in messages:
                if message.error() is not None:
                    continue
                where = (message.topic() or "", message.partition() or 0)
                keys.add(message.key() or b"")
                if where in ends and (message.offset() or 0) + 1 >= ends[where]:
                    del ends[where]
            if not messages:  # the end may be a marker no message stands for: ask where each read is
                positions = consumer.position([TopicPartition(t, p) for t, p in ends])
                for tp in positions:
                    if tp.offset >= ends[(tp.topic, tp.partition)]:
                        del ends[(tp.topic, tp.partition)]
    finally:
        consumer.close()
    return keys


def replay(
    records: Iterable[ReplayRecord],
    kafka: KafkaSettings,
    rate: float | None = None,
    limit: int | None = None,
    progress: bool = True,
    total: int | None = None,
    skip: set[bytes] | None = None,
) -> ReplaySummary:
    """Produce records (log_records, synthetic_records) to Kafka: events to events_topic, rejects to the
    DLQ; records whose key is in `skip` (held_keys: what the topics already hold) are left out, and
    count towards `limit` as if sent."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    writer = KafkaWriter(kafka)
    events = rejected = nbytes = skipped = skipped_events = clicks = 0
    skip = skip or set()
    next_report = 1000
    start = time.perf_counter()
    bar = Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not progress)
    with bar:
        task = bar.add_task("replay", total=limit or total)
        send, topic = writer.send, kafka.events_topic
        for key, value, count, reason, to, partition in records:
            if key in skip:
                skipped += 1
                skipped_events += count
                if limit is not None and events + skipped_events >= limit:
                    break
                continue
            if reason is None and record_size(key, value) > kafka.max_message_bytes:
                reason = (
                    f"record: {len(value)} bytes ({count} events), over kafka.max_message_bytes="
                    f"{kafka.max_message_bytes}; replay with a smaller --bundle"
                )
            if reason is not None:  # to the DLQ, cut to fit if it must be: a reject is never lost
                letter = dead_letter(
                    value, reason, key.decode(errors="replace"), kafka.max_message_bytes, "replay", key
                )
                send(kafka.dlq_topic, letter.value, letter.key, letter.headers)
                rejected += 1
                continue
            send(to or topic, value, key, partition=partition)
            if to is not None and to == kafka.clicks_topic:  # the bar and the rate count impressions
                clicks += 1
                continue
            events += count
            nbytes += len(value)
            if events >= next_report:
                next_report = events + 1000
                bar.update(task, completed=events)
                if rate:
                    ahead = events / rate - (time.perf_counter() - start)
                    if ahead > 0:
                        time.sleep(ahead)
            if limit is not None and events + skipped_events >= limit:
                break
        writer.flush()
        bar.update(task, completed=events)
    seconds = time.perf_counter() - start
    return ReplaySummary(events, nbytes, seconds, events / seconds if seconds else 0.0, rejected, skipped, clicks)
