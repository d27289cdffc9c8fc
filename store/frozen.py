"""FrozenTier: a read-only tier over sorted arrays (what serving reads a snapshot's rows from).

Rows are found by binary search over the sorted ids, so a snapshot loads with no index to build.
Its width is whatever the snapshot holds: serving keeps vectors only (dim), no optimizer state;
an EmbeddingTable over a tier of width dim answers lookups and refuses updates.
"""

from __future__ import annotations

import numpy as np
import torch

from store.errors import StoreError


def find_sorted(sorted_ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Binary search: positions (m,) of keys in sorted_ids (n,) and found (m,) bool."""
    pos = np.searchsorted(sorted_ids, keys).clip(max=max(len(sorted_ids) - 1, 0))
    found = (sorted_ids[pos] == keys) if len(sorted_ids) else np.zeros(len(keys), dtype=bool)
    return pos, found


class FrozenTier:
    def __init__(self, ids: np.ndarray, rows: torch.Tensor, where: str = "FrozenTier") -> None:
        """ids int64 (n,) sorted and unique; rows float32 (n, width)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) > 1 and not (np.diff(ids) > 0).all():
            raise StoreError(f"{where}: ids are not sorted and unique; sort them (np.unique) first")
        if rows.ndim != 2 or len(rows) != len(ids):
            raise StoreError(f"{where}: rows of shape {tuple(rows.shape)} for {len(ids)} ids; need ({len(ids)}, width)")
        self.ids = ids
        self.rows = rows
        self.width = rows.shape[1]
        self.capacity_bytes = self.bytes_used()

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        pos, found = find_sorted(self.ids, ids)
        out = torch.zeros((len(ids), self.width), dtype=torch.float32)
        if found.any():
            out[torch.from_numpy(found)] = self.rows[torch.from_numpy(pos[found])]
        return out, found

    def write(self, ids: np.ndarray, rows: torch.Tensor, step: int = 0) -> None:
        raise StoreError(
            "FrozenTier.write: this tier is read-only (a loaded snapshot); train on a RamTier or TieredStore"
        )

    def remove(self, ids: np.ndarray) -> int:
        raise StoreError("FrozenTier.remove: this tier is read-only (a loaded snapshot)")

    def all_ids(self) -> np.ndarray:
        return self.ids

    def bytes_used(self) -> int:
        return int(self.ids.nbytes + self.rows.element_size() * self.rows.nelement())

    def __len__(self) -> int:
        return len(self.ids)
