"""Publication folder -> ServedModel: the dense network plus a read-only embedding table; and a
delta folder applied to a ServedModel in place.

The table is the trainer's own EmbeddingTable over a FrozenTier (store/frozen.py: the snapshot's
sorted ids and vectors, binary search), so an id the snapshot does not hold reads what the
trainer would give it by the very same code (store.table.unseen_vectors): its field's shared row
under frequency admission, else its deterministic initial vector.

A delta (trainer/snapshot.py) carries the rows changed since the previous publication and the new
dense weights. It applies only to the base it names and only right after the previous delta; it is
read and checked whole before any row lands, so a refused delta changes nothing.
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
    table: EmbeddingTable  # vectors only (n, E+1): lookups, no updates (deltas land in its FrozenTier)

    @property
    def sequence(self) -> int:
        """The last delta applied after the base (0: the base alone)."""
        return self.manifest.sequence


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


def apply_delta(served: ServedModel, path: str | Path) -> ServedModel:
    """The model after delta `path`: its rows written into served's tier in place, its dense weights
    in a new network. Raises ServingError (nothing applied) for a delta of another base or schema,
    out of order (a gap), or unreadable."""
    manifest, now = read_manifest(path), served.manifest
    where = f"delta {path}"
    if manifest.kind != "delta":
        raise ServingError(f"{where}: kind {manifest.kind!r}, expected 'delta'")
    if (manifest.schema_hash, manifest.model, manifest.table) != (now.schema_hash, now.model, now.table):
        raise ServingError(f"{where}: schema, model or table config differs from the served base's; refusing it")
    if manifest.base_step != now.base_step:
        raise ServingError(f"{where}: applies to the base of step {manifest.base_step}, serving step {now.base_step}")
    if manifest.sequence != now.sequence + 1:
        raise ServingError(
            f"{where}: sequence {manifest.sequence} after {now.sequence} is a gap; "
            "keeping the served model until the next base"
        )
    emb = read_embeddings(path)
    model = load_model(path, manifest)  # both read before any row lands
    tier = served.table.tier
    if not isinstance(tier, FrozenTier):
        raise ServingError(f"{where}: the served table's tier ({type(tier).__name__}) takes no deltas")
    try:
        tier.apply(emb["ids"].numpy().astype(np.int64), emb["vectors"])
    except StoreError as exc:
        raise ServingError(str(exc)) from exc
    return ServedModel(served.version, manifest, model, served.table)
