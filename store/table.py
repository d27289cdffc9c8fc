"""EmbeddingTable: what the trainer talks to. Looks rows up by id, initializes unseen ids
deterministically, admits ids by frequency, and applies the sparse optimizer to the rows a batch
touched (sparse_optim.py: Adagrad, FTRL-Proximal, Adam or SGD; the state lives in the row).

Row layout in the tier, width 3 * dim: [vector (dim) | optimizer state (2 * dim)].
A table over a tier of width dim holds vectors only (serving's loaded snapshot): the same
lookups, no updates.

Unseen ids, one rule for the trainer and for serving (`unseen_vectors`):
  - min_count <= 1: an unseen id reads its deterministic initial vector (store/init.py) and gets a
    row of its own when it is learned;
  - min_count >= 2: an unseen id reads its field's *shared row* (one per field, keyed by the
    shared id the caller names, trained by every rare occurrence of the field). The occurrence
    trains that shared row until the id has been seen in `min_count` batches; from then on the id
    has its own row, which starts from the deterministic initial vector. A brand-new value of a
    field is thus scored with what the model learned about rare values of that field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from store.admission import AdmissionSketch
from store.configs import TableConfig
from store.dedup import unique_inverse
from store.errors import StoreError
from store.init import initial_vectors
from store.sparse_optim import cowclip, row_width, sparse_step, split_row_grads, vectors_of
from store.sparse_optim import wide_columns as wide_columns_of
from store.tier import Tier


@dataclass(frozen=True, eq=False)
class Lookup:
    """The rows of one batch. unique_ids (u,): every row taking part (own rows and shared rows);
    inverse (n,) into them; vectors (u, dim) what the model reads, on `device`; rows (u, 3 * dim)
    what the optimizer updates (a newly admitted id: its initial row, though it was scored with
    its field's shared row); counts (u,) occurrences in the batch; waiting: unseen ids below
    min_count (their sighting is counted when the batch is learned)."""

    unique_ids: np.ndarray
    inverse: torch.Tensor
    vectors: torch.Tensor
    rows: torch.Tensor
    counts: torch.Tensor
    waiting: np.ndarray
    new: int  # ids that got a row of their own in this batch


def unseen_vectors(
    unique: np.ndarray, found: np.ndarray, columns: np.ndarray, config: TableConfig, shared: torch.Tensor | None
) -> torch.Tensor:
    """What unseen ids read (the rule in the module docstring): for the ids of `unique` (u,) with
    found False, the vectors (m, dim) of their initial rows or, with min_count >= 2, of their
    columns' shared rows `shared` (F, dim)."""
    missing = ~found
    if config.min_count <= 1 or shared is None:
        return initial_vectors(unique[missing], config.dim, config.seed, config.init_std)
    return shared[torch.from_numpy(columns[missing])]


class EmbeddingTable:
    def __init__(self, tier: Tier, config: TableConfig, shared_ids: np.ndarray | None = None) -> None:
        if tier.width not in (config.dim, row_width(config.dim)):
            raise StoreError(
                f"EmbeddingTable: tier width {tier.width}; use 3 * dim ({row_width(config.dim)}) to train, "
                f"or dim ({config.dim}) for vectors only (lookups, as serving does)"
            )
        if config.min_count > 1 and shared_ids is None:
            raise StoreError("EmbeddingTable: min_count > 1 needs shared_ids (one shared row id per field)")
        self.tier = tier
        self.config = config
        self.trainable = tier.width == row_width(config.dim)  # False: vectors only, no optimizer state
        self.shared_ids = None if shared_ids is None else np.asarray(shared_ids, dtype=np.int64)
        admitting = config.min_count > 1 and self.trainable
        self.sketch = AdmissionSketch(config.admission_bytes, config.seed) if admitting else None
        self.admissions = 0
        self._touched: list[np.ndarray] = []  # ids written since the last take_touched() (replica merges)
        # with keep_anchors(): each touched row as it was before its first write since the last
        # take_anchors() (a merge that sums the replicas' changes needs where they started from)
        self._anchors: list[tuple[np.ndarray, torch.Tensor]] | None = None
        self._anchored = np.zeros(0, dtype=np.int64)  # sorted ids with an anchor
        self._changed: list[np.ndarray] = []  # ids written or merged since the last take_changed() (deltas)
        self._sighted: list[np.ndarray] = []  # ids counted by the sketch since the last take_sighted()
        self._next_ids: np.ndarray | None = None  # the coming batch's ids, prefetched after the next lookup
        # the announced batch's ids (flat) with np.unique(ids, return_inverse=True) of them, worked
        # out once for its prefetch and reused by its lookup (a sort of ~100k ids a step)
        self._announced: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def dim(self) -> int:
        return self.config.dim

    def fresh_rows(self, ids: np.ndarray) -> torch.Tensor:
        """(n, tier width): initial vectors, zero optimizer state."""
        rows = torch.zeros((len(ids), self.tier.width), dtype=torch.float32)
        vectors_of(rows, self.dim)[:] = initial_vectors(ids, self.dim, self.config.seed, self.config.init_std)
        return rows

    def shared_rows(self) -> torch.Tensor:
        """(F, tier width): each field's shared row as stored (its initial row if never trained)."""
        assert self.shared_ids is not None
        rows, found = self.tier.read(self.shared_ids)
        rows = rows.cpu()
        if not found.all():
            rows[torch.from_numpy(~found)] = self.fresh_rows(self.shared_ids[~found])
        return rows

    def shared_vectors(self) -> torch.Tensor:
        """(F, dim): the current vector of each field's shared row."""
        return vectors_of(self.shared_rows(), self.dim)

    def lookup(self, ids: np.ndarray, device: torch.device | str = "cpu", columns: np.ndarray | None = None) -> Lookup:
        """ids int64 (n, F) -> the Lookup of their rows; or ids of any shape with `columns` (same
        shape): each id's field, which admission needs to find its shared row (min_count 1: any shape)."""
        found = self._lookup(ids, device, columns)
        if self._next_ids is not None:  # this batch's reads are done: start on the next one's
            flat = self._next_ids.reshape(-1)
            unique, inverse = unique_inverse(flat)
            self._announced = (flat, unique, inverse)
            self.tier.prefetch(unique)
            self._next_ids = None
        return found

    def _unique(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """unique_inverse(flat), from the announcement if these are the announced ids."""
        announced = self._announced
        if announced is not None and np.array_equal(announced[0], flat):
            self._announced = None
            return announced[1], announced[2]
        return unique_inverse(flat)

    def _lookup(self, ids: np.ndarray, device: torch.device | str, columns: np.ndarray | None) -> Lookup:
        flat = ids.reshape(-1)
        unique, inverse = self._unique(flat)
        if self.config.min_count <= 1:
            rows, found = self.tier.read(unique)
            rows = rows.to(device)  # an HBM tier's rows stay on the GPU: no round trip through the host
            fresh = np.nonzero(~found)[0]
            if len(fresh):
                rows[torch.from_numpy(fresh).to(rows.device)] = self.fresh_rows(unique[fresh]).to(rows.device)
            counts = np.bincount(inverse, minlength=len(unique))
            return self._finish(
                unique, inverse, rows, vectors_of(rows, self.dim), counts, np.zeros(0, np.int64), len(fresh), device
            )
        if columns is None:
            fields = 0 if self.shared_ids is None else len(self.shared_ids)
            if ids.ndim != 2 or ids.shape[1] > fields:
                raise StoreError(
                    f"EmbeddingTable.lookup: ids of shape {ids.shape}; admission needs (n, <= {fields}) or columns"
                )
            columns = np.tile(np.arange(ids.shape[1]), ids.shape[0])
        return self._lookup_admitting(columns.reshape(-1), unique, inverse, device)

    def _lookup_admitting(
        self, field_of: np.ndarray, unique: np.ndarray, inverse: np.ndarray, device: torch.device | str
    ) -> Lookup:
        """field_of (n,): each looked-up position's field (for its shared row)."""
        assert self.shared_ids is not None
        rows, found = self.tier.read(unique)
        rows = rows.cpu()
        columns = np.zeros(len(unique), dtype=np.int64)
        columns[inverse] = field_of
        vectors = vectors_of(rows, self.dim).clone()
        missing = np.nonzero(~found)[0]
        if len(missing) == 0:
            counts = np.bincount(inverse, minlength=len(unique))
            return self._finish(unique, inverse, rows, vectors, counts, np.zeros(0, np.int64), 0, device)
        shared = self.shared_rows()  # (F, 3 * dim), read once: what unseen ids read and what waiting ids train
        vectors[torch.from_numpy(missing)] = unseen_vectors(
            unique, found, columns, self.config, vectors_of(shared, self.dim)
        )
        if self.sketch is None:  # vectors only: nothing is learned, so there is nothing to admit
            admit = np.ones(len(missing), dtype=bool)
        else:
            admit = self.sketch.estimate(unique[missing]) + 1 >= self.config.min_count
        new = missing[admit]
        rows[torch.from_numpy(new)] = self.fresh_rows(unique[new])
        # ids still waiting: their occurrences point at their field's shared row instead
        waiting = missing[~admit]
        keep = np.ones(len(unique), dtype=bool)
        keep[waiting] = False
        used_fields = np.unique(columns[waiting])
        target = np.where(keep, np.cumsum(keep) - 1, 0)  # kept ids: their position among the kept rows
        target[waiting] = keep.sum() + np.searchsorted(used_fields, columns[waiting])  # waiting: after them
        shared_rows = shared[torch.from_numpy(used_fields)]
        keep_t = torch.from_numpy(keep)
        all_ids = np.concatenate([unique[keep], self.shared_ids[used_fields]])
        all_rows = torch.cat([rows[keep_t], shared_rows])
        all_vectors = torch.cat([vectors[keep_t], vectors_of(shared_rows, self.dim)])
        new_inverse = target[inverse]
        counts = np.bincount(new_inverse, minlength=len(all_ids))
        return self._finish(all_ids, new_inverse, all_rows, all_vectors, counts, unique[waiting], len(new), device)

    def _finish(self, unique, inverse, rows, vectors, counts, waiting, new, device) -> Lookup:  # type: ignore[no-untyped-def]
        return Lookup(
            unique_ids=unique,
            inverse=torch.from_numpy(inverse).to(device),
            vectors=vectors.to(device),
            rows=rows.to(device),
            counts=torch.from_numpy(counts.astype(np.float32)).to(device),
            waiting=waiting,
            new=new,
        )

    @property
    def prefetches(self) -> bool:
        """Whether `prefetch` does anything: the tier reads ahead (a pipelined hierarchy)."""
        return self.tier.prefetches

    def prefetch(self, ids: np.ndarray) -> None:
        """ids of the batch after the next lookup's (any shape): the tier starts reading their rows
        right after that lookup's own reads, so they come in while that batch trains."""
        if self.prefetches:
            self._next_ids = ids

    def update(self, lookup: Lookup, grad: torch.Tensor, step: int, wide_columns: torch.Tensor | None = None) -> None:
        """Apply the sparse optimizer with grad (u, dim) (of the batch's summed loss) and write the rows back.
        wide_columns (u, 3): the last column's (vector, state_a, state_b) as learned event by event
        (trainer/wide.py); they replace what the batch step made of that column."""
        if not self.trainable:
            raise StoreError(
                "EmbeddingTable.update: this table holds vectors only (a served snapshot); it cannot learn"
            )
        grad = cowclip(grad, vectors_of(lookup.rows, self.dim), lookup.counts, self.config.optim)
        new_rows = sparse_step(lookup.rows, grad, step, self.config.optim).detach()
        if wide_columns is not None:
            new_rows[:, wide_columns_of(self.dim)] = wide_columns
        self.count_sightings(lookup)
        if self._anchors is not None:
            self._anchor(lookup.unique_ids, lookup.rows)
        self.tier.write(lookup.unique_ids, new_rows, step=step)
        self._touched.append(lookup.unique_ids)
        self._changed.append(lookup.unique_ids)

    def count_sightings(self, lookup: Lookup) -> None:
        """Admission bookkeeping: one more sighting of every id still waiting."""
        self.admissions += lookup.new
        if self.sketch is not None and len(lookup.waiting):
            self.sketch.add(lookup.waiting)
            self._sighted.append(lookup.waiting)

    # --- what replica merges need (trainer/merge.py) ---------------------------------------
    def mark_touched(self, ids: np.ndarray) -> None:
        """Record rows written outside `update` (a shard owner's step) for the next merge."""
        self._touched.append(ids)

    def keep_anchors(self) -> None:
        """From now on keep each touched row as it was before its first write since the last
        take_anchors (trainer.group.row_merge "deltas": trainer/merge.py adds up the replicas'
        changes on the row they started from)."""
        self._anchors = []

    def _anchor(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        first = ~np.isin(ids, self._anchored, assume_unique=True)
        if first.any():
            assert self._anchors is not None
            self._anchors.append((ids[first], rows[torch.from_numpy(first).to(rows.device)].detach().cpu().clone()))
            self._anchored = np.union1d(self._anchored, ids[first])

    def forget_anchors(self) -> None:
        """Drop every anchor kept since the last take_anchors (a merge with nothing to merge)."""
        if self._anchors is not None:
            self._anchors, self._anchored = [], np.zeros(0, dtype=np.int64)

    def take_anchors(self, ids: np.ndarray) -> torch.Tensor:
        """The anchors of unique ids (each must have one) (n, 3*dim); forgets every anchor
        (none kept: nothing to forget, and no ids may be asked for)."""
        if not self._anchors:
            if len(ids):
                raise StoreError("EmbeddingTable.take_anchors: no anchors kept (call keep_anchors() first)")
            return torch.zeros((0, row_width(self.dim)))
        held = np.concatenate([i for i, _ in self._anchors])
        rows = torch.cat([r for _, r in self._anchors])
        order = np.argsort(held)
        at = order[np.minimum(np.searchsorted(held, ids, sorter=order), len(held) - 1)]
        if not np.array_equal(held[at], ids):
            raise StoreError(
                "EmbeddingTable.take_anchors: rows written outside update() and apply_grad() have no anchor"
            )
        self._anchors, self._anchored = [], np.zeros(0, dtype=np.int64)
        return rows[torch.from_numpy(at)]

    def take_touched(self) -> np.ndarray:
        """Unique ids (sorted) of the rows written since the last call; resets the record."""
        touched = np.unique(np.concatenate(self._touched)) if self._touched else np.zeros(0, dtype=np.int64)
        self._touched = []
        return touched

    def take_changed(self) -> np.ndarray:
        """Unique ids (sorted) of every row changed here since the last call, by a step, a merge or
        TTL expiry: what a published delta must carry (an id the table no longer holds is a
        removal). Resets the record."""
        self._changed.append(self.tier.take_expired())
        changed = np.unique(np.concatenate(self._changed)) if self._changed else np.zeros(0, dtype=np.int64)
        self._changed = []
        return changed

    def take_sighted(self) -> np.ndarray:
        """Ids counted by the admission sketch since the last call (with repeats); resets the record."""
        sighted = np.concatenate(self._sighted) if self._sighted else np.zeros(0, dtype=np.int64)
        self._sighted = []
        return sighted

    def add_sightings(self, ids: np.ndarray) -> None:
        """Count sightings other replicas made (a merge), so every replica admits the same ids."""
        if self.sketch is not None:
            self.sketch.add(ids)

    def stored_rows(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Rows (n, 3*dim) on the host for unique ids, and held (n,): whether this store has the row."""
        rows, held = self.tier.read(ids)
        return rows.cpu(), held

    def put(self, ids: np.ndarray, rows: torch.Tensor, step: int) -> None:
        """Overwrite (or create) rows for unique ids: merged rows are admitted wherever they land."""
        self.tier.write(ids, rows, step=step)
        self._changed.append(ids)

    def apply_grad(self, ids: np.ndarray, grad: torch.Tensor, step: int) -> None:
        """One optimizer step on rows for unique ids with grad (n, dim) (synchronous data parallel:
        every replica applies the same averaged gradient). Unseen ids start from their initial row.
        grad (n, dim + 3): with the wide column's (w, state_a, state_b) changes, learned event by
        event (trainer/wide.py) and averaged (sparse_optim.row_grads); they replace the step's own."""
        rows, held = self.stored_rows(ids)
        if not held.all():
            fresh = np.nonzero(~held)[0]
            rows[torch.from_numpy(fresh)] = self.fresh_rows(ids[fresh])
        if self._anchors is not None:  # a shard owner's step (trainer/shard.py), merged between nodes
            self._anchor(ids, rows)
        grad, wide_changes = split_row_grads(grad.cpu(), self.dim)
        new_rows = sparse_step(rows, grad, step, self.config.optim).detach()
        if wide_changes is not None:
            wide = wide_columns_of(self.dim)
            new_rows[:, wide] = rows[:, wide] + wide_changes
        self.put(ids, new_rows, step)

    def expire_cold(self) -> int:
        """Let the tier drop rows past their TTL that it keeps cold (the tiered store's RocksDB);
        a tier without a TTL has nothing to do. Returns how many rows went."""
        return self.tier.expire_cold()

    def export(self) -> tuple[np.ndarray, torch.Tensor]:
        """Every row: ids int64 (n,) sorted, rows float32 (n, 3*dim)."""
        ids = np.sort(self.tier.all_ids())
        rows, _ = self.tier.read(ids)
        return ids, rows

    def load(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Bulk-load rows (a snapshot): straight into the cold tier when the store has one."""
        self.tier.load_rows(ids, rows)

    def __len__(self) -> int:
        return len(self.tier)

    def stats(self) -> dict[str, float]:
        stats = {"bytes_used": float(self.tier.bytes_used()), "admissions": float(self.admissions)}
        if self.sketch is not None:
            stats["admission_sketch_bytes"] = float(self.sketch.bytes_used)
        return {**stats, **self.tier.stats()}  # a tiered store: rows per tier (their union would scan RocksDB)
