"""Reading the dead-letter topic back (`adstream dlq`): what was rejected, where, and why.

Every stage that rejects a record (replay, the joiner, the featurizer) writes it to
`adstream.events.dlq` with the headers `reason`, `stage` and `source` (stream/featurizer/outputs.py:
dead_letter). `read_dead_letters` reads the topic from its start to its end as of the call (no
consumer group is committed: reading changes nothing), counts the letters by reason and keeps the
newest `limit` that match a reason filter.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field

from stream.errors import StreamError
from stream.kafka.settings import KafkaSettings

QUIET_END_S = 2.0  # nothing more delivered for this long: the partitions' ends are reached


@dataclass(frozen=True)
class DeadLetter:
    """One rejected record as the dead-letter topic holds it."""

    partition: int  # where it is on the dead-letter topic
    offset: int
    reason: str  # why it was rejected (the field, the rule, the fix)
    stage: str  # "replay", "join" or "stream": who rejected it
    source: str  # where it came from (topic:partition:offset, a log file's line)
    value: bytes  # the record as it was (cut to the message limit: `truncated` says its length)
    truncated: int | None = None  # the record's whole length when the value is cut
    written_ms: int = 0  # when it was dead-lettered (the Kafka record's time)


@dataclass(frozen=True)
class DeadLetters:
    """What `read_dead_letters` found: counts by reason over the whole topic, and the newest matches."""

    total: int
    by_reason: dict[str, int] = field(default_factory=dict)  # every letter's reason -> how many
    newest: tuple[DeadLetter, ...] = ()  # the newest `limit` letters whose reason matched, oldest first


def letter_of(partition: int, offset: int, value: bytes, headers: object, written_ms: int = 0) -> DeadLetter:
    """A consumed dead-letter record (headers: confluent-kafka's list of (name, bytes)) -> DeadLetter
    (headers it lacks read as "")."""
    pairs = headers if isinstance(headers, list) else []
    named = {str(k): bytes(v or b"").decode("utf-8", "replace") for k, v in pairs}
    truncated = named.get("truncated")
    return DeadLetter(
        partition,
        offset,
        named.get("reason", ""),
        named.get("stage", ""),
        named.get("source", ""),
        value,
        int(truncated) if truncated and truncated.isdigit() else None,
        written_ms,
    )


def read_dead_letters(
    kafka: KafkaSettings, reason: str | None = None, limit: int = 20, timeout_s: float = 30.0
) -> DeadLetters:
    """Read the dead-letter topic to its current end: counts by reason, and the newest `limit`
    letters whose reason contains `reason` (case-insensitive; None: all)."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap,
            "group.id": f"adstream-dlq-{uuid.uuid4().hex[:8]}",  # never committed
            "enable.auto.commit": False,
            "socket.connection.setup.timeout.ms": 5000,
        }
    )
    try:
        try:
            topic = consumer.list_topics(kafka.dlq_topic, timeout=min(timeout_s, 10)).topics[kafka.dlq_topic]
        except KafkaException as exc:
            raise StreamError(
                f"dlq: kafka at {kafka.bootstrap} did not answer ({exc}); start it with `adstream up`"
            ) from None
        if topic.error is not None:
            raise StreamError(f"dlq: no topic {kafka.dlq_topic} at {kafka.bootstrap}; create it with `adstream up`")
        ends, starts = {}, {}
        for p in topic.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(kafka.dlq_topic, p), timeout=10)
            if high > low:
                ends[p], starts[p] = high, low  # (records before `low` were deleted by retention)
        consumer.assign([TopicPartition(kafka.dlq_topic, p, starts[p]) for p in ends])
        counts: Counter[str] = Counter()
        wanted = reason.lower() if reason else None
        newest: dict[int, deque[DeadLetter]] = {p: deque(maxlen=max(limit, 0)) for p in ends}
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while ends and time.monotonic() < deadline:
            messages = consumer.consume(1000, timeout=0.5)
            if messages:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= QUIET_END_S:
                # what is left holds no letter: a transaction's commit marker (the joiner writes its
                # dead letters in transactions) takes an offset and is never delivered
                break
            for message in messages:
                if message.error() is not None:
                    continue
                p, offset = int(message.partition() or 0), int(message.offset() or 0)
                written = message.timestamp()[1]
                letter = letter_of(p, offset, message.value() or b"", message.headers(), written)
                counts[letter.reason] += 1
                if wanted is None or wanted in letter.reason.lower():
                    newest[p].append(letter)
                if offset + 1 >= ends.get(p, 0):
                    ends.pop(p, None)
        if ends and time.monotonic() >= deadline:
            raise StreamError(
                f"dlq: {kafka.dlq_topic} not read to its end within {timeout_s:.0f}s (partitions {sorted(ends)} left)"
            )
        merged = sorted((x for q in newest.values() for x in q), key=lambda x: (x.written_ms, x.partition, x.offset))
        return DeadLetters(sum(counts.values()), dict(counts.most_common()), tuple(merged[-limit:] if limit else ()))
    finally:
        consumer.close()
