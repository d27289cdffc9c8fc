"""The interface every storage tier implements (RAM, the device's HBM, RocksDB, the tiered store
over them, and serving's read-only FrozenTier), and the optional capabilities a tier may have.

A tier maps int64 feature ids to rows of `width` float32 values. The row is opaque to the tier:
the table (table.py) lays it out as [vector | optimizer state a | optimizer state b], so a row's
optimizer state always travels with it.

Every tier subclasses Tier: the six methods a table needs are abstract (a tier without one cannot
be built), and the optional capabilities are declared here with what a tier without them does, so
the table calls them on any tier and a new tier says, by overriding or not, which ones it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch


class Tier(ABC):
    width: int  # float32 values per row
    capacity_bytes: int  # budget; a write beyond it raises StoreError (or evicts, in the hierarchy)

    @abstractmethod
    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """ids int64 (n,) -> rows float32 (n, width) (zeros where absent), found bool (n,)."""

    @abstractmethod
    def write(self, ids: np.ndarray, rows: torch.Tensor, step: int = 0) -> None:
        """Insert or overwrite rows; ids int64 (n,) must be unique, rows float32 (n, width);
        `step` is the training step, for the eviction and expiry policies."""

    @abstractmethod
    def remove(self, ids: np.ndarray) -> int:
        """Drop rows; returns how many were present."""

    @abstractmethod
    def all_ids(self) -> np.ndarray:
        """Every id held, int64 (len,), in no particular order."""

    @abstractmethod
    def bytes_used(self) -> int: ...

    @abstractmethod
    def __len__(self) -> int: ...

    # --- optional capabilities: what a tier without them does ---------------------------------
    @property
    def prefetches(self) -> bool:
        """Whether it reads ahead: the table then hands it the next batch's ids (`prefetch`)."""
        return False

    def prefetch(self, ids: np.ndarray) -> None:
        """Start reading these ids' rows now, for a later read (called only when `prefetches`)."""
        return None

    def load_rows(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Bulk-load a snapshot's rows (the tiered store: straight into RocksDB); else written."""
        self.write(ids, rows)

    def expire_cold(self) -> int:
        """Drop the rows past their TTL that the tier keeps cold; how many went (no TTL: none)."""
        return 0

    def take_expired(self) -> np.ndarray:
        """Ids int64 dropped by TTL expiry since the last call (a delta must remove them); resets."""
        return np.zeros(0, dtype=np.int64)

    def stats(self) -> dict[str, float]:
        """Figures for the metrics: the rows held (the tiered store: hit rates, rows and bytes per
        tier; not their union, which would scan RocksDB)."""
        return {"rows": float(len(self))}

    def close(self) -> None:
        """Let go of files and threads (nothing held: nothing to do)."""
        return None
