"""Snapshot folder -> ServedModel: the dense network plus a read-only, sorted embedding lookup.

Ids are looked up with a binary search over the sorted exported ids; an id the snapshot does not
hold reads what the trainer would give it (store.table.unseen_vectors): its field's shared row
under frequency admission, else its deterministic initial vector.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from serving.errors import ServingError
from store.init import initial_vectors
from store.table import TableConfig, unseen_vectors
from stream.featurize import shared_ids
from stream.schema import Schema
from trainer.model import CtrModel
from trainer.snapshot import Manifest, load_model, read_embeddings, read_manifest


@dataclass(frozen=True, eq=False)
class ServedModel:
    version: str
    manifest: Manifest
    model: CtrModel
    table: TableConfig
    ids: np.ndarray  # int64 (n,), sorted
    vectors: torch.Tensor  # float32 (n, E+1)

    shared: torch.Tensor | None = None  # (F, E+1): each field's shared row (min_count >= 2)

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """ids int64 (n, F) -> vectors (n * F, E+1), by the trainer's own rule for unseen ids
        (store.table.unseen_vectors)."""
        flat = ids.reshape(-1)
        pos, found = find_sorted(self.ids, flat)
        out = torch.empty((len(flat), self.table.dim), dtype=torch.float32)
        if found.any():
            out[torch.from_numpy(found)] = self.vectors[torch.from_numpy(pos[found])]
        if not found.all():
            columns = np.tile(np.arange(ids.shape[-1]), len(flat) // ids.shape[-1])
            out[torch.from_numpy(~found)] = unseen_vectors(flat, found, columns, self.table, self.shared)
        return out


def find_sorted(sorted_ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Binary search: positions (m,) of keys in sorted_ids and found (m,) bool."""
    pos = np.searchsorted(sorted_ids, keys).clip(max=max(len(sorted_ids) - 1, 0))
    found = (sorted_ids[pos] == keys) if len(sorted_ids) else np.zeros(len(keys), dtype=bool)
    return pos, found


def load_served_model(path: str | Path, version: str, schema: Schema) -> ServedModel:
    manifest = read_manifest(path)
    if manifest.schema_hash != schema.hash:
        raise ServingError(
            f"snapshot {path} (version {version}): schema hash {manifest.schema_hash} ({manifest.schema_name}) "
            f"differs from the served schema's {schema.hash} ({schema.name}); serve with the schema it was trained on"
        )
    emb = read_embeddings(path)
    ids = emb["ids"].numpy().astype(np.int64)
    if len(ids) > 1 and not (np.diff(ids) > 0).all():
        raise ServingError(f"snapshot {path}: embedding ids are not sorted and unique")
    table = TableConfig.from_dict(manifest.table)
    served = ServedModel(version, manifest, load_model(path, manifest), table, ids, emb["vectors"])
    if table.min_count <= 1:
        return served
    # the shared rows are read like any id, except that one never trained reads its initial vector
    keys = shared_ids(schema)
    pos, found = find_sorted(ids, keys)
    shared = initial_vectors(keys, table.dim, table.seed, table.init_std)
    if found.any():
        shared[torch.from_numpy(found)] = emb["vectors"][torch.from_numpy(pos[found])]
    return replace(served, shared=shared)
