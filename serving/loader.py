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

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.errors import ServingError
from store.errors import StoreError
from store.frozen import FrozenTier
from store.rocks import RocksTier
from store.table import EmbeddingTable, TableConfig
from store.tier import Tier
from stream.featurize import shared_ids
from stream.schema import Schema
from trainer.model import CtrModel
from trainer.snapshot import Manifest, load_model, read_embeddings, read_manifest

LOAD_CHUNK = 100_000  # rows per RocksDB write batch when a base is loaded


@dataclass(frozen=True, eq=False)
class ServedModel:
    version: str
    manifest: Manifest
    model: CtrModel
    table: EmbeddingTable  # vectors only (n, E+1): lookups, no updates (deltas land in its FrozenTier)
    folder: Path | None = None  # the base publication's folder it was loaded from (the download cache's)

    @property
    def sequence(self) -> int:
        """The last delta applied after the base (0: the base alone)."""
        return self.manifest.sequence


def load_served_model(
    path: str | Path, version: str, schema: Schema, rocksdb: str | Path | None = None, disk_bytes: int = 64 << 30
) -> ServedModel:
    """A base publication -> ServedModel. Its rows go to a FrozenTier in RAM, or with `rocksdb` (a
    folder) to a RocksDB of its own there, for tables larger than serving's RAM (a disk read per
    id not in RocksDB's block cache; the same rows, the same answers)."""
    manifest = read_manifest(path)
    if manifest.schema_hash != schema.hash:
        raise ServingError(
            f"snapshot {path} (version {version}): schema hash {manifest.schema_hash} ({manifest.schema_name}) "
            f"differs from the served schema's {schema.hash} ({schema.name}); serve with the schema it was trained on"
        )
    emb = read_embeddings(path)
    ids = emb["ids"].numpy().astype(np.int64)
    tier: Tier
    try:
        if rocksdb is None:
            tier = FrozenTier(ids, emb["vectors"], where=f"snapshot {path}")
        else:
            shutil.rmtree(rocksdb, ignore_errors=True)
            tier = RocksTier(rocksdb, emb["vectors"].shape[1], disk_bytes, wal=False)
            for start in range(0, len(ids), LOAD_CHUNK):
                tier.write_new(ids[start : start + LOAD_CHUNK], emb["vectors"][start : start + LOAD_CHUNK])
    except StoreError as exc:
        raise ServingError(str(exc)) from exc
    config = TableConfig.from_dict(manifest.table)
    table = EmbeddingTable(tier, config, shared_ids(schema) if config.min_count > 1 else None)
    return ServedModel(version, manifest, load_model(path, manifest), table, Path(path))


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
    tier, ids = served.table.tier, emb["ids"].numpy().astype(np.int64)
    removed = emb["removed"].numpy().astype(np.int64) if "removed" in emb else np.zeros(0, dtype=np.int64)
    try:
        if isinstance(tier, FrozenTier):
            tier.apply(ids, emb["vectors"])
        else:  # RocksDB: one write batch, atomic
            tier.write(ids, emb["vectors"])
        if len(removed):  # rows the trainer expired: here too they read the unseen-id rule
            tier.remove(removed)
    except StoreError as exc:
        raise ServingError(str(exc)) from exc
    return ServedModel(served.version, manifest, model, served.table, served.folder)
