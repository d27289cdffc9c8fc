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


class EmbeddingTable:
    def __init__(self, tier: Tier, config: TableConfig) -> None:
        if tier.width != 3 * config.dim:
            raise StoreError(f"EmbeddingTable: tier width {tier.width} != 3 * dim ({3 * config.dim})")
        self.tier = tier
        self.config = config
        self.pending: dict[int, int] = {}  # ids below min_count -> batches seen so far
        self.admissions = 0

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
        new_rows = sparse_adam(lookup.rows, grad, step, self.config).detach()
        keep = lookup.admitted
        if not keep.all():
            mask = torch.from_numpy(keep).to(new_rows.device)
            new_rows = new_rows[mask]
        ids = lookup.unique_ids[keep]
        if self.config.min_count > 1:  # count this sighting of ids still waiting; admit the ones that made it
            new = ~lookup.found
            for key in lookup.unique_ids[new & ~keep].tolist():
                self.pending[key] = self.pending.get(key, 0) + 1
            for key in lookup.unique_ids[new & keep].tolist():
                self.pending.pop(key, None)
            self.admissions += int((new & keep).sum())
        self.tier.write(ids, new_rows, step=step)

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
