"""What one take of the featurizer writes to Kafka, every record sized to fit the message limit. Pure.

featurize_isolating -> (FeatureBatch, [Rejected]) --plan_outputs--> [Output] (batches, then dead letters)

Kafka refuses a record over `kafka.max_message_bytes` (the producer before sending, the broker
for the topic), and a refused record is a lost one if its input is acknowledged anyway. So every
output is planned to fit before anything is sent:
- a batch is cut by event count (stream.batch_events), then halved until its Arrow bytes fit; an
  event that cannot fit even alone goes to the dead-letter topic with its reason (the field
  rules keep events small, so this is a safeguard, not a path);
- a dead letter whose copy of the record would not fit keeps the record's first bytes, with the
  headers `truncated` (the original length) and `source` (partition:offset on the events topic,
  where the whole record still is).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from stream.batch_codec import encode_batch
from stream.records import FeatureBatch, Rejected

RECORD_OVERHEAD = 512  # bytes a record adds to key + value + headers on the wire (batch header, varints)
MAX_REASON_CHARS = 1000  # a dead letter's reason is cut here (it names a field and a rule, rarely more)
BATCHES, DLQ = "batches", "dlq"  # Output.topic: which of the featurizer's two outputs


@dataclass(frozen=True)
class Output:
    """One Kafka record to write: to the batches topic (an Arrow batch) or the dead-letter topic."""

    topic: str  # BATCHES or DLQ
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    events: int  # events in a batch (0 for a dead letter)

    @property
    def size(self) -> int:
        return record_size(self.key, self.value, self.headers)


def record_size(key: bytes | None, value: bytes, headers: dict[str, bytes] | None = None) -> int:
    """The bytes Kafka counts against the message limit for one record, overhead included."""
    header_bytes = sum(len(k) + len(v) for k, v in (headers or {}).items())
    return len(key or b"") + len(value) + header_bytes + RECORD_OVERHEAD


def plan_outputs(
    batch: FeatureBatch, rejected: list[Rejected], batch_events: int, max_bytes: int, stage: str = "stream"
) -> list[Output]:
    """The records of one take: batches of at most `batch_events` events and `max_bytes` bytes,
    then a dead letter per rejected record (events too large for any batch among them)."""
    batches: list[Output] = []
    too_large: list[Rejected] = []
    for part in batch.split(batch_events):
        _fit_batch(part, max_bytes, batches, too_large)
    letters = [
        dead_letter(bad.value, bad.reason, f"{bad.partition}:{bad.offset}", max_bytes, stage)
        for bad in [*rejected, *too_large]
    ]
    return [*batches, *letters]


def _fit_batch(part: FeatureBatch, max_bytes: int, out: list[Output], too_large: list[Rejected]) -> None:
    """Append `part` as one batch record if it fits, else its halves (recursively)."""
    record = Output(BATCHES, part.event_ids[0].encode(), encode_batch(part), {}, len(part))
    if record.size <= max_bytes:
        out.append(record)
    elif len(part) > 1:
        half = len(part) // 2
        _fit_batch(part.slice(0, half), max_bytes, out, too_large)
        _fit_batch(part.slice(half, len(part)), max_bytes, out, too_large)
    else:
        reason = (
            f"record: the event's features take {record.size} bytes, more than "
            f"kafka.max_message_bytes={max_bytes}; raise it (topic, producer and consumer limits together)"
        )
        value = orjson.dumps({"event_id": part.event_ids[0][:256]})
        too_large.append(Rejected(int(part.partitions[0]), int(part.offsets[0]), value, reason))


def dead_letter(
    value: bytes, reason: str, source: str, max_bytes: int, stage: str = "stream", key: bytes | None = None
) -> Output:
    """The dead letter of a rejected record: its bytes, the reason and where it came from (`source`:
    partition:offset on the events topic, or a log file's line), cut to fit the message limit."""
    headers = {
        "reason": reason[:MAX_REASON_CHARS].encode(),
        "stage": stage.encode(),
        "source": source[:MAX_REASON_CHARS].encode(),
    }
    letter = Output(DLQ, key, value, headers, 0)
    if letter.size <= max_bytes:
        return letter
    headers["truncated"] = str(len(value)).encode()  # the whole record stays at `source`
    room = max_bytes - Output(DLQ, key, b"", headers, 0).size
    return Output(DLQ, key, value[: max(room, 0)], headers, 0)
