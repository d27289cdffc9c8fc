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

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serving.errors import ServingError
from serving.scorer import Scorer, scorer_of
from store.configs import TableConfig
from store.errors import StoreError
from store.frozen import FrozenTier
from store.rocks import RocksTier
from store.table import EmbeddingTable
from store.tier import Tier
from stream.featurizer.featurize import shared_ids
from stream.schema import Schema
from trainer.model import CtrModel
from trainer.snapshot import Manifest, load_model, read_embeddings, read_manifest, rows_file, save_file, unreadable

JOINED_ROWS = "serving-rows.safetensors"  # a sharded publication's rows joined, for the workers to map
SAFETENSORS_DTYPES = {np.int64: "I64", np.float32: "F32"}
LOAD_CHUNK = 100_000  # rows per RocksDB write batch when a base is loaded


@dataclass(frozen=True, eq=False)
class ServedModel:
    version: str
    manifest: Manifest
    model: CtrModel
    table: EmbeddingTable  # vectors only (n, E+1): lookups, no updates (deltas land in its FrozenTier)
    folder: Path | None = None  # the base publication's folder it was loaded from (the download cache's)
    scorer: Scorer = field(init=False, repr=False)  # `model` as numpy arrays, what requests are scored with

    def __post_init__(self) -> None:
        object.__setattr__(self, "scorer", scorer_of(self.model))

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
    tier: Tier
    try:
        if rocksdb is None:
            ids, vectors = shared_rows(path, manifest.shards)
            tier = FrozenTier(ids, vectors, where=f"snapshot {path}")
        else:
            emb = read_embeddings(path)
            ids = emb["ids"].numpy().astype(np.int64)
            shutil.rmtree(rocksdb, ignore_errors=True)
            tier = RocksTier(rocksdb, emb["vectors"].shape[1], disk_bytes, wal=False)
            for start in range(0, len(ids), LOAD_CHUNK):
                tier.write_new(ids[start : start + LOAD_CHUNK], emb["vectors"][start : start + LOAD_CHUNK])
    except StoreError as exc:
        raise ServingError(str(exc)) from exc
    config = TableConfig.from_dict(manifest.table)
    table = EmbeddingTable(tier, config, shared_ids(schema) if config.min_count > 1 else None)
    return ServedModel(version, manifest, load_model(path, manifest), table, Path(path))


def shared_rows(path: str | Path, shards: int = 1) -> tuple[np.ndarray, torch.Tensor]:
    """A base publication's rows (ids int64 (n,), vectors float32 (n, W)) mapped from its file,
    copy-on-write: every serving worker on one machine reads the same pages of the OS's page cache
    (one copy of the table in RAM however many workers), and a delta written into the rows makes
    private copies of the pages it touches, so the file and the other workers never change.
    Rows sharded over several files are joined once into JOINED_ROWS beside them, then mapped."""
    folder = Path(path)
    if shards > 1:
        file = folder / JOINED_ROWS
        if not file.is_file():
            emb = read_embeddings(folder)
            tmp = folder / f".{JOINED_ROWS}.{os.getpid()}"
            save_file({"ids": emb["ids"].to(torch.int64), "vectors": emb["vectors"]}, tmp)
            os.replace(tmp, file)  # whole or not at all: another worker maps it only once complete
    else:
        file = folder / rows_file(0, 1)
    header, start = _safetensors_header(file)
    size = file.stat().st_size
    mapped = {}
    for name, dtype in (("ids", np.int64), ("vectors", np.float32)):
        entry = header.get(name)
        begin, end = entry["data_offsets"] if entry is not None else (0, 0)
        if entry is None or entry["dtype"] != SAFETENSORS_DTYPES[dtype] or start + end > size:
            raise unreadable(file, f"no whole {name} of {SAFETENSORS_DTYPES[dtype]} in its {size} bytes")
        shape = tuple(entry["shape"])
        mapped[name] = (
            np.memmap(file, dtype=dtype, mode="c", offset=start + begin, shape=shape)
            if end > begin
            else np.zeros(shape, dtype=dtype)  # an empty table: nothing to map
        )
    return mapped["ids"], torch.from_numpy(mapped["vectors"])


def _safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts:
    8 bytes of little-endian header length, the JSON header, then the tensors' bytes."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            return json.loads(f.read(length)), 8 + length
    except (OSError, ValueError) as exc:
        raise unreadable(file, str(exc)) from None


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
