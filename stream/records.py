"""The frozen records that flow through stream/: Event, RawRecord, FeatureBatch.

event (JSON on Kafka) --decode--> Event --featurize--> FeatureBatch --batch_codec--> Arrow IPC
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Event:
    """One ad impression, validated against a schema. None marks a missing value."""

    event_id: str
    ts: int  # event time, ms since the epoch
    label: int | None  # 0/1, None when unlabelled (serving requests)
    ints: tuple[int | None, ...]  # one per schema.integer_fields
    cats: tuple[str | None, ...]  # one per schema.categorical_fields, as sent (hex or string)


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
    dense       float32 (n, D)        signed log1p of each integer field, 0 when missing
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
