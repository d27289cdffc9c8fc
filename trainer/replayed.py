"""Drop the events a featurizer wrote twice: the trainer learns every event once. Pure.

The featurizer is at least once: a worker killed before Faust commits its offsets has its takes
featurized again by the worker that gets its partitions, so those events reach the batches topic
twice. It writes each events-topic (source) partition's events in source order, (offset, row), to
one batches partition (stream/featurizer/outputs.py); every writer's copy of a source partition is
therefore in order there, however two writers interleave. So a mark per source partition, the
newest source key learned (FeatureBatch.source_keys), is all it takes: an event is new exactly when
its key is past the mark. Marks travel with the trainer's offsets (Batch.source_marks ->
Replica.marks -> the snapshot manifest), so a resumed trainer drops what it learned before too.

Batches without rows (written by something else than the featurizer, or before rows were
carried) are learned whole, as before.
"""

from __future__ import annotations

import numpy as np

from stream.records import FeatureBatch


def unseen(part: FeatureBatch, marks: dict[int, int]) -> tuple[FeatureBatch, dict[int, int]]:
    """(the events of `part` past their source partition's mark, the marks after them).

    marks: source partition -> the newest source key learned from it (absent: none yet). An event
    is kept when its key is past the mark and past every earlier event of its partition in `part`
    (an event twice in one batch is kept once)."""
    if part.rows is None or not len(part):
        return part, marks
    keys = part.source_keys()
    keep = np.ones(len(part), bool)
    after = dict(marks)
    for partition in np.unique(part.partitions).tolist():
        if partition < 0:  # not from Kafka: no place to compare
            continue
        at = np.flatnonzero(part.partitions == partition)
        mine = keys[at]
        newest_before = np.maximum.accumulate(np.concatenate(([after.get(partition, -1)], mine[:-1])))
        keep[at] = mine > newest_before
        after[partition] = max(after.get(partition, -1), int(mine.max()))
    if keep.all():
        return part, after
    return part.select(np.flatnonzero(keep)), after


def newest_marks(parts: list[dict[int, int]]) -> dict[int, int]:
    """Several replicas' marks as one: the newest per source partition (a mark only grows, so a
    stale copy, restored from a snapshot by a replica that no longer reads that partition, loses)."""
    out: dict[int, int] = {}
    for marks in parts:
        for partition, key in marks.items():
            out[partition] = max(out.get(partition, -1), key)
    return out
