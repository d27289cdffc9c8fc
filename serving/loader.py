"""Snapshot folder -> ServedModel: the dense network plus a read-only embedding table.

The table is the trainer's own EmbeddingTable over a FrozenTier (store/frozen.py: the snapshot's
sorted ids and vectors, binary search), so an id the snapshot does not hold reads what the
trainer would give it by the very same code (store.table.unseen_vectors): its field's shared row
under frequency admission, else its deterministic initial vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.errors import ServingError
from store.errors import StoreError
from store.frozen import FrozenTier
from store.table import EmbeddingTable, TableConfig
from stream.featurize import shared_ids
from stream.schema import Schema
from trainer.model import CtrModel
from trainer.snapshot import Manifest, load_model, read_embeddings, read_manifest


@dataclass(frozen=True, eq=False)
class ServedModel:
    version: str
    manifest: Manifest
    model: CtrModel
    table: EmbeddingTable  # vectors only (n, E+1): lookups, no updates


def load_served_model(path: str | Path, version: str, schema: Schema) -> ServedModel:
    manifest = read_manifest(path)
    if manifest.schema_hash != schema.hash:
        raise ServingError(
            f"snapshot {path} (version {version}): schema hash {manifest.schema_hash} ({manifest.schema_name}) "
            f"differs from the served schema's {schema.hash} ({schema.name}); serve with the schema it was trained on"
        )
    emb = read_embeddings(path)
    try:
        tier = FrozenTier(emb["ids"].numpy().astype(np.int64), emb["vectors"], where=f"snapshot {path}")
    except StoreError as exc:
        raise ServingError(str(exc)) from exc
    config = TableConfig.from_dict(manifest.table)
    table = EmbeddingTable(tier, config, shared_ids(schema) if config.min_count > 1 else None)
    return ServedModel(version, manifest, load_model(path, manifest), table)
