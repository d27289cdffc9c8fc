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

import orjson

from stream.formats.batch_codec import encode_batch
from stream.formats.dead_letter import BATCHES, Output, dead_letter
from stream.records import FeatureBatch, Rejected


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
