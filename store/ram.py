"""RamTier: rows in one growable host tensor, ids -> slots in a dict. Any 64-bit id works.

Lookups are vectorized over the batch (`map(dict.get)` runs in C); there is no Python loop per id.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch

from store.errors import StoreError

_ID_OVERHEAD_BYTES = 8 + 8  # the dict's key and slot, counted against the budget


class RamTier:
    def __init__(self, width: int, capacity_bytes: int, initial_rows: int = 1024) -> None:
        if width <= 0:
            raise StoreError(f"RamTier: width={width}; must be positive")
        if capacity_bytes <= 0:
            raise StoreError(f"RamTier: capacity_bytes={capacity_bytes}; set store.ram_bytes to a positive budget")
        self.width = width
        self.capacity_bytes = capacity_bytes
        self._rows = torch.zeros((initial_rows, width), dtype=torch.float32)
        self._slot: dict[int, int] = {}
        self._free: list[int] = []
        self._used = 0  # slots handed out so far (high-water mark)

    @property
    def row_bytes(self) -> int:
        return self.width * 4 + _ID_OVERHEAD_BYTES

    def __len__(self) -> int:
        return len(self._slot)

    def bytes_used(self) -> int:
        return len(self._slot) * self.row_bytes

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        keys = ids.tolist()
        return np.fromiter(map(self._slot.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        slots = self._slots(ids)
        found = slots >= 0
        rows = torch.zeros((len(ids), self.width), dtype=torch.float32)
        if found.any():
            hit = torch.from_numpy(np.nonzero(found)[0])
            rows[hit] = self._rows[torch.from_numpy(slots[found])]
        return rows, found

    def write(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        if rows.shape != (len(ids), self.width):
            raise StoreError(f"RamTier.write: rows shape {tuple(rows.shape)}, expected ({len(ids)}, {self.width})")
        slots = self._slots(ids)
        new = np.nonzero(slots < 0)[0]
        if len(new):
            needed = (len(self._slot) + len(new)) * self.row_bytes
            if needed > self.capacity_bytes:
                raise StoreError(
                    f"RamTier: {len(self._slot) + len(new)} rows need {needed} bytes, over the "
                    f"budget of {self.capacity_bytes}; raise store.ram_bytes"
                )
            slots[new] = self._allocate(len(new))
            self._slot.update(zip(ids[new].tolist(), slots[new].tolist()))
        self._rows[torch.from_numpy(slots)] = rows.to(torch.float32)

    def _allocate(self, n: int) -> np.ndarray:
        reuse = [self._free.pop() for _ in range(min(n, len(self._free)))]
        fresh = n - len(reuse)
        if self._used + fresh > self._rows.shape[0]:
            grown = max(self._rows.shape[0] * 2, self._used + fresh)
            rows = torch.zeros((grown, self.width), dtype=torch.float32)
            rows[: self._used] = self._rows[: self._used]
            self._rows = rows
        out = np.concatenate([np.asarray(reuse, dtype=np.int64), np.arange(self._used, self._used + fresh)])
        self._used += fresh
        return out

    def remove(self, ids: np.ndarray) -> int:
        removed = 0
        for key in ids.tolist():
            slot = self._slot.pop(key, None)
            if slot is not None:
                self._free.append(slot)
                removed += 1
        return removed

    def all_ids(self) -> np.ndarray:
        return np.fromiter(self._slot.keys(), dtype=np.int64, count=len(self._slot))
