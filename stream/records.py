"""The frozen records that flow through stream/: Event, RawRecord, FeatureBatch.

event (JSON on Kafka) --decode--> Event --featurize--> FeatureBatch --batch_codec--> Arrow IPC
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stream.errors import StreamError


@dataclass(frozen=True)
class Event:
    """One ad impression, validated against a schema. None marks a missing value."""

    event_id: str
    ts: int  # event time, ms since the epoch
    label: int | None  # 0/1, None when unlabelled (serving requests)
    ints: tuple[int | None, ...]  # one per schema.integer_fields
    cats: tuple[str | None, ...]  # one per schema.categorical_fields, as sent (hex or string)
    floats: tuple[float | None, ...] = ()  # one per schema.float_fields


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
    schema_hash str                   the schema the ids were computed under
    """

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    ts: np.ndarray
    event_ids: tuple[str, ...]
    partitions: np.ndarray
    offsets: np.ndarray
    schema_hash: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @classmethod
    def empty(cls, num_dense: int, num_sparse: int, schema_hash: str) -> FeatureBatch:
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
        )

    def split(self, size: int) -> list[FeatureBatch]:
        """Consecutive batches of at most `size` events (none if this one is empty)."""
        if size < 1:
            raise StreamError(f"FeatureBatch.split: size={size}; must be >= 1")
        return [self.slice(start, start + size) for start in range(0, len(self), size)]
