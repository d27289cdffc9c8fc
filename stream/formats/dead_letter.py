"""A Kafka record to write, its size against the message limit, and the dead-letter format.

Every stage that rejects a record (replay, the joiner, the featurizer) writes it to the
dead-letter topic with these headers: `reason`, `stage`, `source` (partition:offset on its input
topic, or a log file's line), and `truncated` when the copy had to be cut to fit.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    partition: int | None = None  # the topic's partition to write to (None: the key's hash decides)

    @property
    def size(self) -> int:
        return record_size(self.key, self.value, self.headers)


def record_size(key: bytes | None, value: bytes, headers: dict[str, bytes] | None = None) -> int:
    """The bytes Kafka counts against the message limit for one record, overhead included."""
    header_bytes = sum(len(k) + len(v) for k, v in (headers or {}).items())
    return len(key or b"") + len(value) + header_bytes + RECORD_OVERHEAD


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
