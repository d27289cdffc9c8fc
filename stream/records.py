"""The frozen records that flow through stream/: Event, RawRecord, FeatureBatch.

event (JSON on Kafka) --decode--> Event --featurize--> FeatureBatch --batch_codec--> Arrow IPC
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stream.errors import StreamError

ROW_BITS = 24  # bits of a source key (FeatureBatch.source_keys) for the row within a record


@dataclass(frozen=True)
class Event:
    """One ad impression, validated against a schema. None marks a missing value."""

    event_id: str
    ts: int  # event time, ms since the epoch
    label: int | None  # 0/1, None when unlabelled (serving requests)
    ints: tuple[int | None, ...]  # one per schema.integer_fields
    cats: tuple[str | None, ...]  # one per schema.categorical_fields, as sent (hex or string)
    floats: tuple[float | None, ...] = ()  # one per schema.float_fields
    lists: tuple[tuple[str, ...], ...] = ()  # one per schema.list_fields: its values (empty = missing)


@dataclass(frozen=True)
class RawRecord:
    """One Kafka record as the featurizer receives it: where it came from and its bytes."""

    partition: int
    offset: int
    value: bytes


@dataclass(frozen=True)
class Rejected:
    """A record (or one line of a bundle) that failed to decode, bound for the dead-letter topic."""

    partition: int
    offset: int
    value: bytes
    reason: str


@dataclass(frozen=True, eq=False)
class FeatureBatch:
    """Featurized events, column-wise. n = number of events.

    labels      float32 (n,)          0/1; NaN when unlabelled
    dense       float32 (n, D)        signed log1p of each integer field, then each float field; 0 when missing
    ids         int64   (n, F)        one 64-bit feature id per sparse field
    ts          int64   (n,)          event time, ms
    event_ids   tuple[str] (n,)
    partitions  int32   (n,)          Kafka partition of the source record (-1: not from Kafka)
    offsets     int64   (n,)          Kafka offset of the source record (-1: not from Kafka)
    rows        int32   (n,) or None  the event's place among its source record's featurized events; set
                                      by the featurizer, which writes each source partition's events
                                      in this (offset, row) order (source_keys); None: no such order
    schema_hash str                   the schema the ids were computed under
    lists       per list field: (starts int64 (n + 1,), ids int64 (total,)); event i's ids are
                ids[starts[i]:starts[i + 1]], never empty (an empty list is the field's missing id)
    """

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    ts: np.ndarray
    event_ids: tuple[str, ...]
    partitions: np.ndarray
    offsets: np.ndarray
    schema_hash: str
    lists: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    schema_name: str = ""  # the schema's name, so a reader of another schema can say which it was given
    rows: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @classmethod
    def empty(
        cls, num_dense: int, num_sparse: int, schema_hash: str, num_lists: int = 0, schema_name: str = ""
    ) -> FeatureBatch:
        """A batch of no events with the right column widths."""
        return cls(
            labels=np.zeros(0, np.float32),
            dense=np.zeros((0, num_dense), np.float32),
            ids=np.zeros((0, num_sparse), np.int64),
            ts=np.zeros(0, np.int64),
            event_ids=(),
            partitions=np.zeros(0, np.int32),
            offsets=np.zeros(0, np.int64),
            schema_hash=schema_hash,
            lists=tuple((np.zeros(1, np.int64), np.zeros(0, np.int64)) for _ in range(num_lists)),
            schema_name=schema_name,
        )

    @classmethod
    def concat(cls, parts: Sequence[FeatureBatch]) -> FeatureBatch:
        """One batch of every part's events, in order; the parts share one schema."""
        if not parts:
            raise StreamError("FeatureBatch.concat: no parts; use FeatureBatch.empty for a batch of no events")
        if len({p.schema_hash for p in parts}) > 1:
            raise StreamError(f"FeatureBatch.concat: parts of schemas {sorted({p.schema_hash for p in parts})}")
        if len(parts) == 1:
            return parts[0]
        return cls(
            labels=np.concatenate([p.labels for p in parts]),
            dense=np.concatenate([p.dense for p in parts]),
            ids=np.concatenate([p.ids for p in parts]),
            ts=np.concatenate([p.ts for p in parts]),
            event_ids=tuple(e for p in parts for e in p.event_ids),
            partitions=np.concatenate([p.partitions for p in parts]),
            offsets=np.concatenate([p.offsets for p in parts]),
            schema_hash=parts[0].schema_hash,
            lists=tuple(concat_lists([p.lists[j] for p in parts]) for j in range(len(parts[0].lists))),
            schema_name=parts[0].schema_name,
            rows=None if any(p.rows is None for p in parts) else np.concatenate([p.rows for p in parts]),
        )

    def slice(self, start: int, end: int) -> FeatureBatch:
        """Events [start, end) (views, no copy)."""
        return FeatureBatch(
            labels=self.labels[start:end],
            dense=self.dense[start:end],
            ids=self.ids[start:end],
            ts=self.ts[start:end],
            event_ids=self.event_ids[start:end],
            partitions=self.partitions[start:end],
            offsets=self.offsets[start:end],
            schema_hash=self.schema_hash,
            lists=tuple(slice_list(starts, ids, start, min(end, len(self))) for starts, ids in self.lists),
            schema_name=self.schema_name,
            rows=None if self.rows is None else self.rows[start:end],
        )

    def select(self, index: np.ndarray) -> FeatureBatch:
        """The events at `index` (int64 (k,)), in that order (copies)."""
        return FeatureBatch(
            labels=self.labels[index],
            dense=self.dense[index],
            ids=self.ids[index],
            ts=self.ts[index],
            event_ids=tuple(self.event_ids[i] for i in index.tolist()),
            partitions=self.partitions[index],
            offsets=self.offsets[index],
            schema_hash=self.schema_hash,
            lists=tuple(select_list(starts, ids, index) for starts, ids in self.lists),
            schema_name=self.schema_name,
            rows=None if self.rows is None else self.rows[index],
        )

    def source_keys(self) -> np.ndarray:
        """int64 (n,): each event's place in its source partition, offset and row in one number
        (offset << ROW_BITS | row), so that "already learned" is one comparison. Needs rows."""
        if self.rows is None:
            raise StreamError("FeatureBatch.source_keys: the batch has no rows (not written in source order)")
        if len(self.rows) and int(self.rows.max()) >= 1 << ROW_BITS:
            raise StreamError(f"FeatureBatch.source_keys: a record of over {1 << ROW_BITS} events")
        return (self.offsets.astype(np.int64) << ROW_BITS) | self.rows.astype(np.int64)

    def split(self, size: int) -> list[FeatureBatch]:
        """Consecutive batches of at most `size` events (none if this one is empty)."""
        if size < 1:
            raise StreamError(f"FeatureBatch.split: size={size}; must be >= 1")
        return [self.slice(start, start + size) for start in range(0, len(self), size)]


def select_list(starts: np.ndarray, ids: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Events `index` of one list field, as (starts from 0, ids)."""
    lengths = (starts[1:] - starts[:-1])[index]
    new_starts = np.zeros(len(index) + 1, np.int64)
    np.cumsum(lengths, out=new_starts[1:])
    # each kept event's ids: its old start + 0, 1, ... its length - 1
    within = np.arange(int(new_starts[-1]), dtype=np.int64) - np.repeat(new_starts[:-1], lengths)
    return new_starts, ids[np.repeat(starts[:-1][index], lengths) + within]


def concat_lists(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One list field's (starts, ids) of several batches -> the field's (starts, ids) of them all."""
    starts, total = [np.zeros(1, np.int64)], 0
    for part_starts, _ in parts:
        starts.append(part_starts[1:] - part_starts[0] + total)
        total += int(part_starts[-1] - part_starts[0])
    ids = [part_ids[part_starts[0] : part_starts[-1]] for part_starts, part_ids in parts]
    return np.concatenate(starts).astype(np.int64), np.concatenate(ids).astype(np.int64)


def slice_list(starts: np.ndarray, ids: np.ndarray, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Events [start, end) of one list field, with starts from 0."""
    end = max(end, start)
    return starts[start : end + 1] - starts[start], ids[starts[start] : starts[end]]
