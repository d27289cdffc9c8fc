"""FrozenTier: a tier over sorted arrays, frozen to training, that serving reads a publication from.

Rows are found by binary search over sorted ids, so a publication loads with no index to build.
Its width is whatever the publication holds: serving keeps vectors only (dim), no optimizer state;
an EmbeddingTable over a tier of width dim answers lookups and refuses updates.

Serving applies published deltas in place (`apply`): a row the tier holds is overwritten where it
lies; ids it does not hold go to a small sorted overlay, merged into the base once the overlay
passes a quarter of it. Ids a delta removes (rows the trainer expired) are tombstoned in the base
(a flag, flipped in place) or dropped from the overlay; an id written again comes back to life.
Readers see one consistent (base, overlay) pair: the pair is replaced by one reference assignment.
A request reading while a delta lands may see some rows of the delta and not others (each row
whole or not at all is not promised either): the same staleness any in-place update has, bounded
by one delta.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from store.errors import StoreError
from store.tier import Tier

OVERLAY_SHARE = 0.25  # merge the overlay into the base once it holds this share of the base's rows


def find_sorted(sorted_ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Binary search: positions (m,) of keys in sorted_ids (n,) and found (m,) bool."""
    pos = np.searchsorted(sorted_ids, keys).clip(max=max(len(sorted_ids) - 1, 0))
    found = (sorted_ids[pos] == keys) if len(sorted_ids) else np.zeros(len(keys), dtype=bool)
    return pos, found


class _Arrays(NamedTuple):
    base_ids: np.ndarray  # int64 (n,) sorted, unique
    base_rows: torch.Tensor  # float32 (n, width)
    base_dead: np.ndarray  # bool (n,): removed by a delta (a tombstone; reads miss it)
    extra_ids: np.ndarray  # int64 (m,) sorted, unique, none of them in base_ids
    extra_rows: torch.Tensor  # float32 (m, width)


class FrozenTier(Tier):
    def __init__(self, ids: np.ndarray, rows: torch.Tensor, where: str = "FrozenTier") -> None:
        """ids int64 (n,) sorted and unique; rows float32 (n, width)."""
        ids = np.asarray(ids, dtype=np.int64)
        _check(ids, rows, where)
        self.where = where
        self.width = rows.shape[1]
        self._arrays = _Arrays(
            ids, rows, np.zeros(len(ids), dtype=bool), np.zeros(0, dtype=np.int64), rows.new_zeros((0, self.width))
        )
        self.capacity_bytes = self.bytes_used()

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        arrays = self._arrays  # read once: a concurrent apply swaps the pair, never half of it
        pos, found = find_sorted(arrays.base_ids, ids)
        if len(arrays.base_dead):
            found &= ~arrays.base_dead[pos]
        # one gather from the base (serving's hot path: usually every id is there), misses zeroed
        if len(arrays.base_ids):
            out = arrays.base_rows.index_select(0, torch.from_numpy(pos))
        else:
            out = torch.zeros((len(ids), self.width), dtype=torch.float32)
        missing = np.nonzero(~found)[0]
        if len(missing):
            out[torch.from_numpy(missing)] = 0.0
            # the overlay holds only ids the base lacks: look there for the misses alone
            at, hit = find_sorted(arrays.extra_ids, ids[missing])
            if hit.any():
                out[torch.from_numpy(missing[hit])] = arrays.extra_rows[torch.from_numpy(at[hit])]
                found[missing[hit]] = True
        return out, found

    def apply(self, ids: np.ndarray, rows: torch.Tensor) -> int:
        """A published delta: rows (k, width) for unique ids (k,). Held rows are overwritten in
        place, new ids join the overlay. Returns how many ids were new."""
        ids = np.asarray(ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ids, rows = ids[order], rows[torch.from_numpy(order)]
        _check(ids, rows, f"{self.where}: delta")
        if rows.shape[1] != self.width:
            raise StoreError(f"{self.where}: delta rows of width {rows.shape[1]}, this tier holds {self.width}")
        arrays = self._arrays
        left = np.ones(len(ids), dtype=bool)
        for sorted_ids, stored in ((arrays.base_ids, arrays.base_rows), (arrays.extra_ids, arrays.extra_rows)):
            pos, hit = find_sorted(sorted_ids, ids)
            if hit.any():
                stored[torch.from_numpy(pos[hit])] = rows[torch.from_numpy(hit)]  # in place
                if stored is arrays.base_rows:
                    arrays.base_dead[pos[hit]] = False  # written again: alive
                left &= ~hit
        if not left.any():
            return 0
        extra_ids, extra_rows = _merge(arrays.extra_ids, arrays.extra_rows, ids[left], rows[torch.from_numpy(left)])
        if len(extra_ids) > OVERLAY_SHARE * max(len(arrays.base_ids), 1):
            alive = ~arrays.base_dead  # tombstoned rows leave when the base is rebuilt
            base_ids, base_rows = _merge(
                arrays.base_ids[alive], arrays.base_rows[torch.from_numpy(alive)], extra_ids, extra_rows
            )
            self._arrays = _Arrays(base_ids, base_rows, np.zeros(len(base_ids), bool), extra_ids[:0], extra_rows[:0])
        else:
            self._arrays = arrays._replace(extra_ids=extra_ids, extra_rows=extra_rows)
        return int(left.sum())

    def write(self, ids: np.ndarray, rows: torch.Tensor, step: int = 0) -> None:
        raise StoreError(
            "FrozenTier.write: this tier is frozen to training (a loaded publication); "
            "train on a RamTier or TieredStore"
        )

    def remove(self, ids: np.ndarray) -> int:
        """A published delta's removals (rows the trainer expired): base rows are tombstoned in
        place, overlay rows dropped. Returns how many were held."""
        ids = np.asarray(ids, dtype=np.int64)
        arrays = self._arrays
        pos, hit = find_sorted(arrays.base_ids, ids)
        if len(arrays.base_ids):
            hit &= ~arrays.base_dead[pos]
            arrays.base_dead[pos[hit]] = True
        in_extra = np.isin(arrays.extra_ids, ids)
        if in_extra.any():
            keep = ~in_extra
            self._arrays = arrays._replace(
                extra_ids=arrays.extra_ids[keep], extra_rows=arrays.extra_rows[torch.from_numpy(keep)]
            )
        return int(hit.sum() + in_extra.sum())

    def all_ids(self) -> np.ndarray:
        arrays = self._arrays
        return np.sort(np.concatenate([arrays.base_ids[~arrays.base_dead], arrays.extra_ids]))

    def bytes_used(self) -> int:
        a = self._arrays
        row_bytes = a.base_rows.element_size() * (a.base_rows.nelement() + a.extra_rows.nelement())
        return int(a.base_ids.nbytes + a.extra_ids.nbytes + row_bytes)

    def __len__(self) -> int:
        a = self._arrays
        return len(a.base_ids) - int(a.base_dead.sum()) + len(a.extra_ids)


def _check(ids: np.ndarray, rows: torch.Tensor, where: str) -> None:
    if len(ids) > 1 and not (np.diff(ids) > 0).all():
        raise StoreError(f"{where}: ids are not sorted and unique; sort them (np.unique) first")
    if rows.ndim != 2 or len(rows) != len(ids):
        raise StoreError(f"{where}: rows of shape {tuple(rows.shape)} for {len(ids)} ids; need ({len(ids)}, width)")


def _merge(
    ids_a: np.ndarray, rows_a: torch.Tensor, ids_b: np.ndarray, rows_b: torch.Tensor
) -> tuple[np.ndarray, torch.Tensor]:
    """Two disjoint sorted id sets and their rows -> one sorted set (new arrays; the inputs stay)."""
    ids = np.concatenate([ids_a, ids_b])
    order = np.argsort(ids, kind="stable")
    return ids[order], torch.cat([rows_a, rows_b])[torch.from_numpy(order)]
