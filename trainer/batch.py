"""Batch: the training-side form of FeatureBatch, with tensors and the Kafka offsets it covers.

labels float32 (B,), dense float32 (B, D), ids int64 numpy (B, F) (ids stay on the host: the
store resolves them), lists: per list field (starts (B + 1,), ids) on the host, source_offsets:
per batches-topic partition, the next offset to consume
once this batch is learned; source_marks: per events-topic partition, the newest source key
learned once it is (trainer/replayed.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from stream.records import FeatureBatch, concat_lists


@dataclass(frozen=True, eq=False)
class Batch:
    labels: torch.Tensor
    dense: torch.Tensor
    ids: np.ndarray
    event_ids: tuple[str, ...] = ()
    source_offsets: dict[int, int] = field(default_factory=dict)
    parts: int = 1  # stream batches (Kafka records) this batch was assembled from
    records: tuple[tuple[int, int], ...] = ()  # (partition, offset) of each of those Kafka records
    lists: tuple[tuple[np.ndarray, np.ndarray], ...] = ()  # per list field: (starts (B + 1,), ids), host
    newest_ms: int = 0  # the newest event time in the batch (ms), for the freshness a model reports
    source_marks: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.labels.to(device),
            self.dense.to(device),
            self.ids,
            self.event_ids,
            self.source_offsets,
            self.parts,
            self.records,
            self.lists,
            self.newest_ms,
            self.source_marks,
        )


def batch_from_features(
    parts: Sequence[FeatureBatch],
    source_offsets: dict[int, int] | None = None,
    records: tuple[tuple[int, int], ...] = (),
    source_marks: dict[int, int] | None = None,
) -> Batch:
    """Concatenate stream batches into one training batch."""
    return Batch(
        labels=torch.from_numpy(np.concatenate([p.labels for p in parts])),
        dense=torch.from_numpy(np.concatenate([p.dense for p in parts])),
        ids=np.concatenate([p.ids for p in parts]),
        event_ids=tuple(e for p in parts for e in p.event_ids),
        source_offsets=dict(source_offsets or {}),
        parts=len(parts),
        records=records,
        lists=tuple(concat_lists([p.lists[j] for p in parts]) for j in range(len(parts[0].lists))) if parts else (),
        newest_ms=max((int(p.ts.max()) for p in parts if len(p.ts)), default=0),
        source_marks=dict(source_marks or {}),
    )
