"""Frequency admission: an id gets its own embedding row only after `min_count` sightings.

Most ids of an ad log are seen once or twice; giving each a row costs memory and learns noise.
Until an id is admitted, its occurrences read and train a shared row of its field (see
table.py). Sightings are counted in a count-min sketch: `depth` rows of `slots` uint16
counters, a fixed memory budget however many ids the stream holds (an estimate never undercounts;
a collision can only admit an id a little early). So that an endless stream does not fill every
counter, all counters are halved each time as many sightings as there are slots have been added
(old sightings fade). The counters are plain arrays: they go into snapshots, and replicas add
each other's sightings at a merge.
"""

from __future__ import annotations

import numpy as np

from store.errors import StoreError
from store.init import splitmix64

_DEPTH = 2


class AdmissionSketch:
    def __init__(self, budget_bytes: int, seed: int = 0) -> None:
        slots = 1 << max(int(budget_bytes // (2 * _DEPTH)).bit_length() - 1, 0)
        if slots < 1024:
            raise StoreError(f"admission sketch budget {budget_bytes} bytes is too small: give it at least 4096 bytes")
        self.slots = slots
        self.seed = seed
        self.counts = np.zeros((_DEPTH, slots), dtype=np.uint16)
        self.added = 0  # sightings added since the last halving

    @property
    def bytes_used(self) -> int:
        return int(self.counts.nbytes)

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """ids int64 (n,) -> counter positions (depth, n)."""
        keys = ids.astype(np.uint64)
        with np.errstate(over="ignore"):
            rows = [splitmix64(keys ^ np.uint64(self.seed * 7919 + 104729 * (r + 1))) for r in range(_DEPTH)]
        return np.stack(rows) & np.uint64(self.slots - 1)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Sightings so far of ids (n,), int64 (never fewer than the true count)."""
        if len(ids) == 0:
            return np.zeros(0, dtype=np.int64)
        pos = self._slots(ids)
        return np.min(self.counts[np.arange(_DEPTH)[:, None], pos], axis=0).astype(np.int64)

    def add(self, ids: np.ndarray) -> None:
        """Count one sighting of each id (n,) (repeats count again)."""
        if len(ids) == 0:
            return
        pos = self._slots(ids).astype(np.int64)
        for r in range(_DEPTH):
            np.add.at(self.counts[r], pos[r], 1)
        self.added += len(ids)
        if self.added >= self.slots:
            self.counts >>= 1
            self.added = 0

    def load(self, counts: np.ndarray, added: int = 0) -> None:
        if counts.shape != self.counts.shape:
            raise StoreError(
                f"admission sketch: saved counters {counts.shape} do not fit this budget's {self.counts.shape}; "
                "restore with the trainer.store.admission_bytes the snapshot was taken with"
            )
        self.counts = counts.astype(np.uint16).copy()
        self.added = int(added)
