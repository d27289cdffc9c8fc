"""IdIndex: int64 id -> int32 slot, an open-addressing hash table in numpy arrays.

Every operation is vectorized over a batch of ids (a few numpy passes per probe round, linear
probing, load factor <= 0.6), so there is no Python work per id, and the index costs about 22
bytes per id (a Python dict costs ~100). Any 64-bit id is a valid key.
"""

from __future__ import annotations

import numpy as np

_EMPTY, _FULL, _TOMB = 0, 1, 2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MAX_LOAD = 0.6


class IdIndex:
    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(max(16, 1 << int(np.ceil(np.log2(max(capacity, 1) / _MAX_LOAD)))))
        self.size = 0

    def _alloc(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, dtype=np.int64)
        self.vals = np.full(capacity, -1, dtype=np.int32)
        self.state = np.zeros(capacity, dtype=np.uint8)
        self.mask = capacity - 1
        self.bits = capacity.bit_length() - 1
        self.tombstones = 0

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes + self.state.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((ids.astype(np.uint64) * _GOLDEN) >> np.uint64(64 - self.bits)).astype(np.int64)

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """Position of each id in the table, -1 if absent."""
        pos = self._home(ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        pending = np.arange(len(ids))
        while len(pending):
            p = pos[pending]
            state = self.state[p]
            hit = (state == _FULL) & (self.keys[p] == ids[pending])
            out[pending[hit]] = p[hit]
            pending = pending[~(hit | (state == _EMPTY))]
            pos[pending] = (pos[pending] + 1) & self.mask
        return out

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where absent."""
        where = self._find(ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        found = where >= 0
        out[found] = self.vals[where[found]]
        return out

    def put(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Insert ids that are NOT present (unique), with their slots."""
        if self.size + self.tombstones + len(ids) > _MAX_LOAD * len(self.keys):
            self._rehash(self.size + len(ids))
        pos = self._home(ids)
        pending = np.arange(len(ids))
        while len(pending):
            p = pos[pending]
            free = self.state[p] != _FULL
            candidates, at = pending[free], p[free]
            taken, first = np.unique(at, return_index=True)  # one winner per free position
            winners = candidates[first]
            self.tombstones -= int((self.state[taken] == _TOMB).sum())
            self.keys[taken] = ids[winners]
            self.vals[taken] = slots[winners]
            self.state[taken] = _FULL
            placed = np.zeros(len(ids), dtype=bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            pos[pending] = (pos[pending] + 1) & self.mask
        self.size += len(ids)

    def pop(self, ids: np.ndarray) -> np.ndarray:
        """Remove ids; returns their slots (-1 where absent)."""
        where = self._find(ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        found = where >= 0
        at = where[found]
        out[found] = self.vals[at]
        self.state[at] = _TOMB
        self.vals[at] = -1
        self.size -= len(at)
        self.tombstones += len(at)
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        full = self.state == _FULL
        return self.keys[full], self.vals[full].astype(np.int64)

    def _rehash(self, needed: int) -> None:
        keys, vals = self.items()
        capacity = max(16, 1 << int(np.ceil(np.log2(max(needed, 1) / _MAX_LOAD))))
        self._alloc(capacity)
        self.size = 0
        if len(keys):
            self.put(keys, vals)
