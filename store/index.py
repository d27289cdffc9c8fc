"""IdIndex: int64 id -> int32 slot, an open-addressing hash table in numpy arrays.

The table is three flat arrays (keys, slots, a full/empty byte per position), probed linearly at
load factor <= 0.6, and the index costs about 22 bytes per id (a Python dict costs ~100). Any
64-bit id is a valid key. A removal shifts the entries after it back into the gap (Knuth's
deletion for linear probing) instead of leaving a tombstone: a tier that evicts and admits rows
every step would otherwise fill with tombstones, and every probe for an absent id would walk
them. Every operation takes a batch of ids; the probe loops are compiled by numba: one pass over
the batch, one or two cache misses per id, no Python work per id.
"""

from __future__ import annotations

import numba
import numpy as np

from store.hashing import GOLDEN

_EMPTY, _FULL = 0, 1
_GOLDEN = GOLDEN  # the home slot: the top bits of id * GOLDEN (store/hashing.py)
_MAX_LOAD = 0.6


@numba.njit(cache=True, nogil=True, inline="always")
def _home(key: np.int64, shift: np.uint64) -> np.int64:
    return np.int64((np.uint64(key) * _GOLDEN) >> shift)


@numba.njit(cache=True, nogil=True)
def _find(keys: np.ndarray, vals: np.ndarray, state: np.ndarray, bits: int, ids: np.ndarray) -> np.ndarray:
    """The slot of each id, -1 if absent (ids (n,) int64 -> (n,) int64)."""
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    out = np.full(len(ids), -1, dtype=np.int64)
    for i in range(len(ids)):
        pos = _home(ids[i], shift)
        while state[pos] == _FULL:
            if keys[pos] == ids[i]:
                out[i] = vals[pos]
                break
            pos = (pos + 1) & mask
    return out


@numba.njit(cache=True, nogil=True)
def _insert(
    keys: np.ndarray, vals: np.ndarray, state: np.ndarray, bits: int, ids: np.ndarray, slots: np.ndarray
) -> None:
    """Insert ids (absent, unique) at the first empty position of their probe."""
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    for i in range(len(ids)):
        pos = _home(ids[i], shift)
        while state[pos] == _FULL:
            pos = (pos + 1) & mask
        keys[pos] = ids[i]
        vals[pos] = slots[i]
        state[pos] = _FULL


@numba.njit(cache=True, nogil=True)
def _delete(keys: np.ndarray, vals: np.ndarray, state: np.ndarray, bits: int, ids: np.ndarray) -> np.ndarray:
    """Remove ids; their slots (-1 where absent). Each gap is refilled by the first later entry of
    the run whose home does not lie cyclically in (gap, entry], until an empty position ends the run."""
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    out = np.full(len(ids), -1, dtype=np.int64)
    for i in range(len(ids)):
        gap = _home(ids[i], shift)
        while state[gap] == _FULL and keys[gap] != ids[i]:
            gap = (gap + 1) & mask
        if state[gap] != _FULL:
            continue  # absent
        out[i] = vals[gap]
        pos = gap
        while True:
            pos = (pos + 1) & mask
            if state[pos] != _FULL:
                break
            home = _home(keys[pos], shift)
            # the entry at pos may move back to gap unless its home is cyclically in (gap, pos]
            if (home - gap - 1) & mask < (pos - gap) & mask:
                continue
            keys[gap], vals[gap] = keys[pos], vals[pos]
            gap = pos
        state[gap] = _EMPTY
        vals[gap] = -1
    return out


class IdIndex:
    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(max(16, 1 << int(np.ceil(np.log2(max(capacity, 1) / _MAX_LOAD)))))
        self.size = 0

    def _alloc(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, dtype=np.int64)
        self.vals = np.full(capacity, -1, dtype=np.int32)
        self.state = np.zeros(capacity, dtype=np.uint8)
        self.bits = capacity.bit_length() - 1

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes + self.state.nbytes

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where absent."""
        return _find(self.keys, self.vals, self.state, self.bits, np.ascontiguousarray(ids, dtype=np.int64))

    def put(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Insert ids that are NOT present (unique), with their slots."""
        if self.size + len(ids) > _MAX_LOAD * len(self.keys):
            self._rehash(self.size + len(ids))
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        _insert(self.keys, self.vals, self.state, self.bits, ids, np.ascontiguousarray(slots, dtype=np.int32))
        self.size += len(ids)

    def pop(self, ids: np.ndarray) -> np.ndarray:
        """Remove ids (unique); returns their slots (-1 where absent)."""
        out = _delete(self.keys, self.vals, self.state, self.bits, np.ascontiguousarray(ids, dtype=np.int64))
        self.size -= int((out >= 0).sum())
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
