"""Snapshot folder -> ServedModel: the dense network plus a read-only, sorted embedding lookup.

Ids are looked up with a binary search over the sorted exported ids; an id the snapshot does not
hold reads its deterministic initial vector (store.init), exactly as the trainer would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from serving.errors import ServingError
from store.init import initial_vectors
from store.table import TableConfig
from stream.schema import Schema
from trainer.model import DeepFM
from trainer.snapshot import Manifest, load_model, read_embeddings, read_manifest


@dataclass(frozen=True, eq=False)
class ServedModel:
    version: str
    manifest: Manifest
    model: DeepFM
    table: TableConfig
    ids: np.ndarray  # int64 (n,), sorted
    vectors: torch.Tensor  # float32 (n, E+1)

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """ids int64 (m,) -> vectors (m, E+1)."""
        flat = ids.reshape(-1)
        pos = np.searchsorted(self.ids, flat).clip(max=max(len(self.ids) - 1, 0))
        found = (self.ids[pos] == flat) if len(self.ids) else np.zeros(len(flat), dtype=bool)
        out = torch.empty((len(flat), self.table.dim), dtype=torch.float32)
        if found.any():
            out[torch.from_numpy(found)] = self.vectors[torch.from_numpy(pos[found])]
        if (~found).any() and self.table.min_count > 1:  # the trainer reads a shared zero row for these
            out[torch.from_numpy(~found)] = 0.0
        elif (~found).any():
            out[torch.from_numpy(~found)] = initial_vectors(
                flat[~found], self.table.dim, self.table.seed, self.table.init_std
            )
        return out


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
    table = TableConfig(**manifest.table)  # type: ignore[arg-type]
    return ServedModel(version, manifest, load_model(path, manifest), table, ids, emb["vectors"])
