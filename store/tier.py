"""The small interface every storage tier implements (RAM now; device and RocksDB in the hierarchy).

A tier maps int64 feature ids to rows of `width` float32 values. The row is opaque to the tier:
the table (table.py) lays it out as [vector | Adam exp_avg | Adam exp_avg_sq], so a row's
optimizer state always travels with it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Tier(Protocol):
    width: int  # float32 values per row
    capacity_bytes: int  # budget; a write beyond it raises StoreError (or evicts, in the hierarchy)

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """ids int64 (n,) -> rows float32 (n, width) (zeros where absent), found bool (n,)."""
        ...

    def write(self, ids: np.ndarray, rows: torch.Tensor, step: int = 0) -> None:
        """Insert or overwrite rows; ids int64 (n,) must be unique, rows float32 (n, width);
        `step` is the training step, for the eviction and expiry policies."""
        ...

    def remove(self, ids: np.ndarray) -> int:
        """Drop rows; returns how many were present."""
        ...

    def all_ids(self) -> np.ndarray:
        """Every id held, int64 (len,), in no particular order."""
        ...

    def bytes_used(self) -> int: ...

    def __len__(self) -> int: ...
