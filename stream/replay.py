"""Replay ad logs into Kafka: raw Criteo TSV files (.txt/.gz) or the synthetic generator.

Each good line becomes one JSON event on `events_topic` (key = event id). A line that cannot be
parsed goes to the dead-letter topic with its reason: nothing is dropped silently. Throughput
settings follow confluent-kafka's advice: linger, lz4, idempotence, no per-message callbacks
(only errors are reported), poll every ~1000 messages.
"""

from __future__ import annotations

import gzip
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from stream import rules
from stream.errors import DecodeError, StreamError
from stream.schema import Schema
from stream.settings import KafkaSettings

_INT = re.compile(r"-?\d+")
BASE_TS_MS = 1_400_000_000_000  # Criteo carries no timestamps; file order is time order


@dataclass(frozen=True)
class ReplaySummary:
    events: int  # events produced to the events topic
    bytes: int  # bytes of event values produced
    seconds: float
    events_per_s: float
    rejected: int  # lines sent to the dead-letter topic instead


def parse_criteo_line(line: str, schema: Schema, event_id: str, ts: int) -> dict[str, object]:
    """One raw Criteo TSV line -> event dict, checked by the rules of rules.py; raises DecodeError."""
    parts = line.rstrip("\n").split("\t")
    expected = 1 + len(schema.integer_fields) + len(schema.categorical_fields)
    if len(parts) != expected:
        raise DecodeError("", f"expected {expected} tab-separated fields, got {len(parts)}")
    if parts[0] not in ("0", "1"):
        raise DecodeError(schema.label, rules.LABEL if parts[0] else rules.LABEL_MISSING)
    event: dict[str, object] = {schema.event_id: event_id, schema.timestamp: ts, schema.label: int(parts[0])}
    n_int = len(schema.integer_fields)
    for name, raw in zip(schema.integer_fields, parts[1 : 1 + n_int]):
        value = int(raw) if _INT.fullmatch(raw) else (None if raw == "" else raw)
        broken = rules.check_integer(value)
        if broken:
            raise DecodeError(name, broken)
        event[name] = value
    hex32 = schema.categorical_encoding == "hex32"
    for name, raw in zip(schema.categorical_fields, parts[1 + n_int :]):
        broken = rules.check_category(raw, hex32) if raw else None
        if broken:
            raise DecodeError(name, broken)
        event[name] = raw or None
    return event


def criteo_file_lines(paths: Iterable[str | Path], loop: bool = False) -> Iterator[tuple[str, int, str]]:
    """(file stem, 0-based line number, line) over the files in order; forever with loop."""
    rounds = 0
    while True:
        for path in map(Path, paths):
            if not path.is_file():
                raise StreamError(f"replay: no file at {path}")
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8", errors="replace") as fh:  # type: ignore[operator]
                for number, line in enumerate(fh):
                    yield (f"{path.stem}" if not rounds else f"{path.stem}#{rounds}"), number, line
        rounds += 1
        if not loop:
            return


# One replay item: (event id, event dict or None, raw bytes of a bad line, reason or None)
Item = tuple[str, dict[str, object] | None, bytes, str | None]
# One Kafka record to send: (key, value, reason or None, events in it)
Record = tuple[bytes, bytes, str | None, int]


def criteo_events(paths: Iterable[str | Path], schema: Schema, loop: bool = False) -> Iterator[Item]:
    """Parse Criteo TSV lines; a bad line keeps its bytes and the reason."""
    for index, (stem, number, line) in enumerate(criteo_file_lines(paths, loop)):
        event_id = f"{stem}:{number}"
        try:
            yield event_id, parse_criteo_line(line, schema, event_id, BASE_TS_MS + index), b"", None
        except DecodeError as exc:
            yield event_id, None, line.encode(), f"line {number + 1} of {stem}: {exc}"


def synthetic_events(events: Iterable[dict[str, object]], schema: Schema) -> Iterator[Item]:
    for event in events:
        yield str(event[schema.event_id]), event, b"", None


def to_records(items: Iterable[Item], schema: Schema, bundle: int = 1, fmt: str = "json") -> Iterator[Record]:
    """Encode events as Kafka records: one JSON event each, or bundles of `bundle` events
    (newline-separated JSON, or an Arrow batch with fmt="arrow"). Bad lines pass through with their reason."""
    from stream.bundle import encode_event_bundle

    if fmt not in ("json", "arrow"):
        raise StreamError(f"replay: bundle format {fmt!r}; use 'json' or 'arrow'")
    pending: list[dict[str, object]] = []

    def flush() -> Record:
        key = str(pending[0][schema.event_id]).encode()
        if fmt == "arrow":
            value = encode_event_bundle(pending, schema)
        else:
            value = b"\n".join(orjson.dumps(e) for e in pending)
        count = len(pending)
        pending.clear()
        return key, value, None, count

    for event_id, event, raw, reason in items:
        if event is None:
            yield event_id.encode(), raw, reason, 0
        elif bundle <= 1 and fmt == "json":
            yield event_id.encode(), orjson.dumps(event), None, 1
        else:
            pending.append(event)
            if len(pending) >= max(bundle, 1):
                yield flush()
    if pending:
        yield flush()


def criteo_records(
    paths: Iterable[str | Path], schema: Schema, loop: bool = False, bundle: int = 1, fmt: str = "json"
) -> Iterator[Record]:
    return to_records(criteo_events(paths, schema, loop), schema, bundle, fmt)


def synthetic_records(
    events: Iterable[dict[str, object]], schema: Schema, bundle: int = 1, fmt: str = "json"
) -> Iterator[Record]:
    return to_records(synthetic_events(events, schema), schema, bundle, fmt)


def producer_config(kafka: KafkaSettings) -> dict[str, object]:
    return {
        "bootstrap.servers": kafka.bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 50,
        "compression.type": "lz4",
        "batch.size": 1 << 20,
        "message.max.bytes": kafka.max_message_bytes,
        "queue.buffering.max.kbytes": 1 << 20,
        "delivery.report.only.error": True,
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

    def _on_error(self, err: object, msg: object) -> None:  # only errors are reported (see config)
        if err is not None:
            self.errors.append(str(err))

    def send(self, topic: str, value: bytes, key: bytes | None = None, headers: dict[str, str] | None = None) -> None:
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers)  # type: ignore[arg-type]
                break
            except BufferError:  # local queue full: let librdkafka send, then retry
                self._producer.poll(0.05)
        self._since_poll += 1
        if self._since_poll >= 1000:
            self._producer.poll(0)
            self._since_poll = 0

    def flush(self, timeout_s: float = 60.0) -> None:
        left = self._producer.flush(timeout_s)
        if left or self.errors:
            raise StreamError(
                f"kafka producer: {left} message(s) undelivered, {len(self.errors)} error(s): {self.errors[:3]}"
            )


def replay(
    records: Iterable[Record],
    kafka: KafkaSettings,
    rate: float | None = None,
    limit: int | None = None,
    progress: bool = True,
    total: int | None = None,
) -> ReplaySummary:
    """Produce records (see to_records) to Kafka: good ones to events_topic, bad lines to the DLQ."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    writer = KafkaWriter(kafka)
    events = rejected = nbytes = 0
    next_report = 1000
    start = time.perf_counter()
    bar = Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not progress)
    with bar:
        task = bar.add_task("replay", total=limit or total)
        for key, value, reason, count in records:
            if reason is not None:
                writer.send(kafka.dlq_topic, value, key, {"reason": reason, "stage": "replay"})
                rejected += 1
                continue
            writer.send(kafka.events_topic, value, key)
            events += count
            nbytes += len(value)
            if events >= next_report:
                next_report = events + 1000
                bar.update(task, completed=events)
                if rate:
                    ahead = events / rate - (time.perf_counter() - start)
                    if ahead > 0:
                        time.sleep(ahead)
            if limit is not None and events >= limit:
                break
        writer.flush()
        bar.update(task, completed=events)
    seconds = time.perf_counter() - start
    return ReplaySummary(events, nbytes, seconds, events / seconds if seconds else 0.0, rejected)
