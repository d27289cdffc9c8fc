"""EmbeddingTable: what the trainer talks to. Looks rows up by id, initializes unseen ids
deterministically, and applies a sparse (lazy) Adam step to the rows a batch touched.

Row layout in the tier, width 3 * dim: [vector (dim) | exp_avg (dim) | exp_avg_sq (dim)].
Like torch.optim.SparseAdam, only touched rows' moments change, and bias correction uses the
table's global step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from store.errors import StoreError
from store.init import initial_vectors
from store.tier import Tier


@dataclass(frozen=True)
class TableConfig:
    dim: int  # vector width per feature id
    seed: int = 0  # seed of the deterministic initializer
    init_std: float = 0.01  # std of initial vectors
    lr: float = 0.001  # sparse Adam learning rate
    beta1: float = 0.9  # sparse Adam first-moment decay
    beta2: float = 0.999  # sparse Adam second-moment decay
    eps: float = 1e-8  # sparse Adam denominator epsilon
    min_count: int = 1  # an id gets its own row after this many batches; before, a shared zero row, untrained
    optimizer: str = "adam"  # "adam" (lazy sparse Adam) or "sgd" (plain SGD: moments stay zero; for tests)

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise StoreError(f"TableConfig.optimizer={self.optimizer!r}; use 'adam' or 'sgd'")


@dataclass(frozen=True, eq=False)
class Lookup:
    """The rows of one batch: unique ids (u,), inverse (n,) into them, vectors (u, dim) on `device`."""

    unique_ids: np.ndarray
    inverse: torch.Tensor
    vectors: torch.Tensor
    rows: torch.Tensor  # full rows (u, 3 * dim), kept for the update
    admitted: np.ndarray  # bool (u,): False for ids still below min_count (shared zero row, not trained)
    found: np.ndarray  # bool (u,): the row already existed in the store


def sparse_adam(rows: torch.Tensor, grad: torch.Tensor, step: int, cfg: TableConfig) -> torch.Tensor:
    """One lazy Adam step on rows (u, 3*dim) with grad (u, dim) at global step `step` (1-based). Pure."""
    d = cfg.dim
    w, m, v = rows[:, :d], rows[:, d : 2 * d], rows[:, 2 * d :]
    m = cfg.beta1 * m + (1 - cfg.beta1) * grad
    v = cfg.beta2 * v + (1 - cfg.beta2) * grad * grad
    m_hat = m / (1 - cfg.beta1**step)
    v_hat = v / (1 - cfg.beta2**step)
    w = w - cfg.lr * m_hat / (v_hat.sqrt() + cfg.eps)
    return torch.cat([w, m, v], dim=1)


def sparse_sgd(rows: torch.Tensor, grad: torch.Tensor, cfg: TableConfig) -> torch.Tensor:
    """One plain SGD step on the vector part of rows (u, 3*dim); the moment columns are kept. Pure."""
    d = cfg.dim
    return torch.cat([rows[:, :d] - cfg.lr * grad, rows[:, d:]], dim=1)


def optimizer_step(rows: torch.Tensor, grad: torch.Tensor, step: int, cfg: TableConfig) -> torch.Tensor:
    return sparse_sgd(rows, grad, cfg) if cfg.optimizer == "sgd" else sparse_adam(rows, grad, step, cfg)


class EmbeddingTable:
    def __init__(self, tier: Tier, config: TableConfig) -> None:
        if tier.width != 3 * config.dim:
            raise StoreError(f"EmbeddingTable: tier width {tier.width} != 3 * dim ({3 * config.dim})")
        self.tier = tier
        self.config = config
        self.pending: dict[int, int] = {}  # ids below min_count -> batches seen so far
        self.admissions = 0
        self._touched: list[np.ndarray] = []  # ids written since the last take_touched() (replica merges)

    @property
    def dim(self) -> int:
        return self.config.dim

    def fresh_rows(self, ids: np.ndarray) -> torch.Tensor:
        rows = torch.zeros((len(ids), 3 * self.dim), dtype=torch.float32)
        rows[:, : self.dim] = initial_vectors(ids, self.dim, self.config.seed, self.config.init_std)
        return rows

    def lookup(self, ids: np.ndarray, device: torch.device | str = "cpu") -> Lookup:
        """ids int64 of any shape -> Lookup; unseen ids get their deterministic initial row."""
        unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        rows, found = self.tier.read(unique)
        rows = rows.cpu()
        admitted = found.copy()
        missing = np.nonzero(~found)[0]
        if len(missing) and self.config.min_count > 1:
            keys = unique[missing].tolist()
            counts = np.fromiter((self.pending.get(k, 0) + 1 for k in keys), dtype=np.int64, count=len(keys))
            admitted[missing] = counts >= self.config.min_count
        elif len(missing):
            admitted[missing] = True
        fresh = np.nonzero(~found & admitted)[0]
        if len(fresh):
            rows[torch.from_numpy(fresh)] = self.fresh_rows(unique[fresh])
        rows = rows.to(device)
        return Lookup(unique, torch.from_numpy(inverse).to(device), rows[:, : self.dim], rows, admitted, found)

    def update(self, lookup: Lookup, grad: torch.Tensor, step: int) -> None:
        """Apply sparse Adam with grad (u, dim) to the admitted rows and write them back."""
        new_rows = optimizer_step(lookup.rows, grad, step, self.config).detach()
        keep = lookup.admitted
        if not keep.all():
            mask = torch.from_numpy(keep).to(new_rows.device)
            new_rows = new_rows[mask]
        ids = lookup.unique_ids[keep]
        self.count_sightings(lookup)
        self.tier.write(ids, new_rows, step=step)
        self._touched.append(ids)

    def count_sightings(self, lookup: Lookup) -> None:
        """min_count bookkeeping: count this sighting of ids still waiting; admit the ones that made it."""
        if self.config.min_count <= 1:
            return
        new, keep = ~lookup.found, lookup.admitted
        for key in lookup.unique_ids[new & ~keep].tolist():
            self.pending[key] = self.pending.get(key, 0) + 1
        for key in lookup.unique_ids[new & keep].tolist():
            self.pending.pop(key, None)
        self.admissions += int((new & keep).sum())

    # --- what replica merges need (trainer/merge.py) ---------------------------------------
    def take_touched(self) -> np.ndarray:
        """Unique ids (sorted) of the rows written since the last call; resets the record."""
        touched = np.unique(np.concatenate(self._touched)) if self._touched else np.zeros(0, dtype=np.int64)
        self._touched = []
        return touched

    def stored_rows(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Rows (n, 3*dim) on the host for unique ids, and held (n,): whether this store has the row."""
        rows, held = self.tier.read(ids)
        return rows.cpu(), held

    def put(self, ids: np.ndarray, rows: torch.Tensor, step: int) -> None:
        """Overwrite (or create) rows for unique ids: merged rows are admitted wherever they land."""
        if self.pending:
            for key in ids.tolist():
                self.pending.pop(key, None)
        self.tier.write(ids, rows, step=step)

    def apply_grad(self, ids: np.ndarray, grad: torch.Tensor, step: int) -> None:
        """One optimizer step on rows for unique ids with grad (n, dim) (synchronous data parallel:
        every replica applies the same averaged gradient). Unseen ids start from their initial row."""
        rows, held = self.stored_rows(ids)
        if not held.all():
            fresh = np.nonzero(~held)[0]
            rows[torch.from_numpy(fresh)] = self.fresh_rows(ids[fresh])
        self.put(ids, optimizer_step(rows, grad.cpu(), step, self.config).detach(), step)

    def export(self) -> tuple[np.ndarray, torch.Tensor]:
        """Every row: ids int64 (n,) sorted, rows float32 (n, 3*dim)."""
        ids = np.sort(self.tier.all_ids())
        rows, _ = self.tier.read(ids)
        return ids, rows

    def load(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Bulk-load rows (a snapshot): straight into the cold tier when the store has one."""
        bulk = getattr(self.tier, "load_rows", None)
        if bulk is not None:
            bulk(ids, rows)
        else:
            self.tier.write(ids, rows)

    def __len__(self) -> int:
        return len(self.tier)

    def stats(self) -> dict[str, float]:
        stats = {
            "bytes_used": float(self.tier.bytes_used()),
            "admissions": float(self.admissions),
            "pending_admission": float(len(self.pending)),
        }
        tier_stats = getattr(self.tier, "stats", None)
        if tier_stats:  # a tiered store reports rows per tier; counting their union would scan RocksDB
            return {**stats, **tier_stats()}
        return {**stats, "rows": float(len(self.tier))}
