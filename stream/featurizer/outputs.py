"""What one take of the featurizer writes to Kafka, in source order, every record sized to fit the
message limit. Pure.

featurize_isolating -> (FeatureBatch, [Rejected]) --plan_outputs--> [Output] (batches, then dead letters)

Source order is what lets the trainer learn every event once although the featurizer is at least
once (a worker killed before Faust commits its offsets has its takes featurized again by the worker
that gets its partitions): each events-topic partition's events go, sorted by (offset, row), to one
batches partition (source partition % batch partitions). So each writer's events of a source
partition reach that batches partition in order, and the trainer drops any event whose (offset, row)
is not past the newest it learned from that source partition (trainer/replayed.py): an event written
twice, by a worker and its successor, or twice by one worker, is learned once; none is skipped.

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

from dataclasses import replace

import numpy as np
import orjson

from stream.formats.batch_codec import encode_batch
from stream.formats.dead_letter import BATCHES, Output, dead_letter
from stream.records import FeatureBatch, Rejected


def plan_outputs(
    batch: FeatureBatch,
    rejected: list[Rejected],
    batch_events: int,
    max_bytes: int,
    batch_partitions: int,
    stage: str = "stream",
) -> list[Output]:
    """The records of one take: per source partition, its events in source order (in_source_order)
    as batches of at most `batch_events` events and `max_bytes` bytes, each for batches partition
    source partition % `batch_partitions`; then a dead letter per rejected record (events too
    large for any batch among them)."""
    batches: list[Output] = []
    too_large: list[Rejected] = []
    for source in by_source_partition(in_source_order(batch)):
        target = int(source.partitions[0]) % batch_partitions
        for part in source.split(batch_events):
            _fit_batch(part, max_bytes, target, batches, too_large)
    letters = [
        dead_letter(bad.value, bad.reason, f"{bad.partition}:{bad.offset}", max_bytes, stage)
        for bad in [*rejected, *too_large]
    ]
    return [*batches, *letters]


def in_source_order(batch: FeatureBatch) -> FeatureBatch:
    """The events sorted by (source partition, offset), a record's events kept in their order, each
    numbered by its place among its record's featurized events (rows). Featurizing is a pure function
    of a record's bytes, so a record featurized again gets the same rows: (partition, offset, row)
    names an event for good. Each record's events must come once (featurize_records sees to it)."""
    order = np.lexsort((batch.offsets, batch.partitions))  # stable: a record's events keep their order
    if not (order[1:] > order[:-1]).all():  # (the usual take is sorted already: no copy)
        batch = batch.select(order)
    partitions, offsets = batch.partitions, batch.offsets
    first = np.ones(len(batch), bool)  # the first event of each record
    first[1:] = (partitions[1:] != partitions[:-1]) | (offsets[1:] != offsets[:-1])
    record_start = np.flatnonzero(first)[np.cumsum(first) - 1]
    rows = (np.arange(len(batch)) - record_start).astype(np.int32)
    return replace(batch, rows=rows)


def by_source_partition(batch: FeatureBatch) -> list[FeatureBatch]:
    """A batch sorted by source partition, cut into one batch per source partition."""
    cuts = [0, *(np.flatnonzero(batch.partitions[1:] != batch.partitions[:-1]) + 1).tolist(), len(batch)]
    return [batch.slice(start, end) for start, end in zip(cuts, cuts[1:]) if end > start]


def _fit_batch(
    part: FeatureBatch, max_bytes: int, partition: int, out: list[Output], too_large: list[Rejected]
) -> None:
    """Append `part` as one batch record for `partition` if it fits, else its halves (recursively)."""
    record = Output(BATCHES, part.event_ids[0].encode(), encode_batch(part), {}, len(part), partition)
    if record.size <= max_bytes:
        out.append(record)
    elif len(part) > 1:
        half = len(part) // 2
        _fit_batch(part.slice(0, half), max_bytes, partition, out, too_large)
        _fit_batch(part.slice(half, len(part)), max_bytes, partition, out, too_large)
    else:
        reason = (
            f"record: the event's features take {record.size} bytes, more than "
            f"kafka.max_message_bytes={max_bytes}; raise it (topic, producer and consumer limits together)"
        )
        value = orjson.dumps({"event_id": part.event_ids[0][:256]})
        too_large.append(Rejected(int(part.partitions[0]), int(part.offsets[0]), value, reason))
