"""Snapshots: a folder with a manifest, dense weights and embedding rows. Never a pickle.

Two artifacts, two jobs. A *recovery* snapshot is the trainer's whole state (what a restarted replica
restores: optimizer state in the rows and of the dense part, admission counters, offsets); it
stays on the trainer's disk. A *publication* is what serving needs and nothing more: the dense
weights and each row's vector, no optimizer state (a third of a recovery snapshot's row bytes);
it is what goes to MLflow. A publication is a *base* (every row) or a *delta* (the rows changed
since the previous publication, and the dense weights), numbered 1, 2, ... after its base; serving
applies deltas in order, in place (serving/loader.py). Files:

    manifest.json            format, schema name/hash, model and table config, step, events,
                             batches-topic offsets consumed, metrics, file list
    dense.safetensors        CtrModel state_dict
    optimizer.safetensors    the dense Adam state, flattened ("<param index>.<key>")
    embeddings.safetensors   ids int64 (n,), vectors float32 (n, E+1), state_a, state_b (n, E+1)
                             (the two optimizer-state blocks of each row, whatever the sparse
                             optimizer keeps there: FTRL's z and n, Adagrad's sum, Adam's moments,
                             see store/sparse_optim.py; snapshots written before 2026-12-05 name them
                             exp_avg and exp_avg_sq, and still load); with rows sharded
                             over a node's N ranks, one file per rank instead, each written by
                             its owner (embeddings-RRRRR-of-NNNNN.safetensors, manifest.shards = N),
                             so no rank ever holds the whole table
    admission.safetensors    the admission sketch's counters (only with min_count >= 2)
    metrics.safetensors      the progressive metrics' counts (recovery only: trainer/metrics.py state)

The manifest is written last, so a folder without one is incomplete and never loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save_file as _save_file

from store.configs import TableConfig
from store.sparse_optim import join_rows, split_rows
from store.table import EmbeddingTable
from trainer.errors import SnapshotError
from trainer.model import CtrModel, ModelConfig

# the format's names, spelled here only
FORMAT = "adstream-snapshot/1"
MANIFEST = "manifest.json"
DENSE = "dense.safetensors"
OPTIMIZER = "optimizer.safetensors"
EMBEDDINGS = "embeddings.safetensors"
ADMISSION = "admission.safetensors"
METRICS = "metrics.safetensors"
FOLDER_PREFIX = "step-"


def snapshot_name(step: int) -> str:
    """The folder (and MLflow artifact path) name of the snapshot at `step`; sorts by step."""
    return f"{FOLDER_PREFIX}{step:09d}"


DELTAS = "deltas"  # the folder of a base publication's deltas, beside its files (and where a delta is staged)
PUBLICATIONS = "publications"  # the folder of base publications: under trainer.snapshot.dir, and in the run's artifacts
DELTA_TAG = "adstream.delta"  # model version tag: the sequence of the newest delta uploaded after the base


def delta_path(sequence: int) -> str:
    """Where delta `sequence` of a base lives, relative to the base: deltas/SSSSSSSSS (sorts by sequence)."""
    return f"{DELTAS}/{sequence:09d}"


def is_complete(path: str | Path) -> bool:
    """A snapshot folder is complete once its manifest exists (it is written last)."""
    return (Path(path) / MANIFEST).is_file()


@dataclass(frozen=True)
class Manifest:
    schema_name: str
    schema_hash: str
    model: dict[str, object]  # ModelConfig.to_dict()
    table: dict[str, object]  # TableConfig as a dict
    step: int  # train steps taken
    events: int  # events learned
    offsets: dict[str, int]  # batches-topic partition -> next offset to consume
    metrics: dict[str, float] = field(default_factory=dict)
    created_ms: int = 0
    format: str = FORMAT
    extra: dict[str, object] = field(default_factory=dict)  # e.g. the MLflow run and group size of the job
    kind: str = "recovery"  # "recovery" (the whole trainer state), "publication" (a base) or "delta"
    newest_event_ms: int = 0  # the newest event time the model has learned (ms): how fresh it is
    base_step: int = 0  # publications: the step of the base a delta applies to (a base: its own step)
    sequence: int = 0  # deltas: 1, 2, ... after their base, applied in this order; 0 for a base
    shards: int = 1  # files the rows are in: 1 (EMBEDDINGS), or one per rank of a node with sharded rows
    marks: dict[str, int] = field(default_factory=dict)  # events-topic partition -> newest source key learned


@dataclass(frozen=True, eq=False)
class Snapshot:
    manifest: Manifest
    model: CtrModel
    table: EmbeddingTable


def save_file(tensors: dict[str, torch.Tensor], file: str | Path) -> None:
    """safetensors' save_file, its IO failures as the OSError they are: safetensors reports a full
    disk as a SafetensorError ("I/O error: No space left on device (os error 28)"), no OSError, so callers
    that name the folder for an OSError would show its traceback instead."""
    try:
        _save_file(tensors, file)
    except SafetensorError as exc:
        found = re.search(r"(?:os error|code:) (\d+)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(file)) from None


def rows_file(shard: int = 0, shards: int = 1) -> str:
    """The name of the file holding the rows: EMBEDDINGS, or shard `shard` of `shards`."""
    return EMBEDDINGS if shards <= 1 else f"embeddings-{shard:05d}-of-{shards:05d}.safetensors"


STATE_A, STATE_B = "state_a", "state_b"  # a row's two optimizer-state blocks in a rows file
_OLD_STATE_NAMES = ("exp_avg", "exp_avg_sq")  # their names before 2026-12-05 (they held FTRL's z and n too)


def _row_states(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A rows file's two optimizer-state blocks, under today's names or the old ones."""
    if STATE_A in tensors:
        return tensors[STATE_A], tensors[STATE_B]
    return tensors[_OLD_STATE_NAMES[0]], tensors[_OLD_STATE_NAMES[1]]


def write_rows(path: str | Path, table: EmbeddingTable, vectors_only: bool, shard: int = 0, shards: int = 1) -> None:
    """Every row `table` holds into the folder's rows file (shard `shard` of `shards`): ids and
    vectors, and for a recovery snapshot (vectors_only False) the optimizer state too."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids, rows = table.export()
    vectors, state_a, state_b = split_rows(rows, table.dim)
    tensors = {"ids": torch.from_numpy(ids), "vectors": vectors.contiguous()}
    if not vectors_only:
        tensors |= {STATE_A: state_a.contiguous(), STATE_B: state_b.contiguous()}
    save_file(tensors, path / rows_file(shard, shards))


def finish_snapshot(
    path: str | Path,
    manifest: Manifest,
    model: CtrModel,
    optimizer: torch.optim.Optimizer | None = None,
    table: EmbeddingTable | None = None,
    metrics: dict[str, np.ndarray] | None = None,
) -> Path:
    """After the rows file(s): the dense weights, the dense optimizer state, the table's admission
    counters and the metrics' counts (recovery), then the manifest, which makes the folder complete."""
    path = Path(path)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, path / DENSE)
    if optimizer is not None:
        save_file(_flat_optimizer_state(optimizer), path / OPTIMIZER)
    if metrics is not None:
        save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in metrics.items()}, path / METRICS)
    if table is not None and table.sketch is not None:
        counts = torch.from_numpy(table.sketch.counts.view(np.int16).copy())
        save_file({"counts": counts, "added": torch.tensor([table.sketch.added])}, path / ADMISSION)
    return _complete(path, manifest)


def publication_manifest(manifest: Manifest) -> Manifest:
    """A base publication's manifest: its own base, no delta applied yet."""
    return replace(manifest, kind="publication", base_step=manifest.step, sequence=0)


def save_delta(
    path: str | Path, manifest: Manifest, model: CtrModel, table: EmbeddingTable, changed: np.ndarray
) -> Path:
    """A delta publication: the dense weights, the vectors of the `changed` ids (sorted, unique) the
    table holds, and as `removed` those it no longer holds (expired: serving drops them too, so
    they read the unseen-id rule there as here); the manifest (kind "delta", its base and sequence
    already set by the caller) comes last."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, path / DENSE)
    rows, held = table.stored_rows(changed)
    vectors, _, _ = split_rows(rows[torch.from_numpy(held)], table.dim)
    tensors = {"ids": torch.from_numpy(changed[held]), "vectors": vectors.contiguous()}
    save_file({**tensors, "removed": torch.from_numpy(changed[~held])}, path / EMBEDDINGS)
    return _complete(path, replace(manifest, kind="delta"))


def _complete(path: Path, manifest: Manifest) -> Path:
    """Make the folder durable, then write its manifest: the data is on disk before the manifest
    says the folder is complete, and the manifest appears last and atomically."""
    for file in path.iterdir():
        _fsync(file)
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True))
    _fsync(tmp)
    os.replace(tmp, path / MANIFEST)
    _fsync(path)
    return path


def folder_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(root: str | Path) -> None:
    """Fail at start, not at the first snapshot minutes later, when the snapshot folder cannot be
    made or written (read-only, full, a file in the way)."""
    probe = Path(root) / f".adstream-write-check-{os.getpid()}"  # one per process: replicas check at once
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"\0" * 4096)
        _fsync(probe)
        probe.unlink()
    except OSError as exc:
        raise SnapshotError(
            f"trainer.snapshot.dir={str(root)!r}: cannot write there ({exc.strerror or exc}); point "
            "trainer.snapshot.dir at a writable folder with free space"
        ) from None


def prune_snapshots(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete recovery snapshots under root, and incomplete
    folders older than the newest complete one (a write cut short); returns what was deleted."""
    folders = sorted(Path(root).glob(f"{FOLDER_PREFIX}*")) if Path(root).is_dir() else []
    complete = [f for f in folders if is_complete(f)]
    if not complete:
        return []
    kept = set(complete[-keep:])
    doomed = [f for f in folders if f not in kept and f < complete[-1]]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    return doomed


def latest_snapshot(root: str | Path) -> Path | None:
    """The newest complete snapshot (highest step with a manifest) under root, or None."""
    folders = sorted(Path(root).glob(f"{FOLDER_PREFIX}*")) if Path(root).is_dir() else []
    complete = [f for f in folders if is_complete(f)]
    return complete[-1] if complete else None


def read_manifest(path: str | Path) -> Manifest:
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise SnapshotError(f"snapshot {path}: no {MANIFEST}; the snapshot is incomplete or not a snapshot")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise unreadable(file, str(exc)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise SnapshotError(f"snapshot {path}: format {found!r}, this version reads {FORMAT!r}")
    try:
        return Manifest(**data)
    except TypeError as exc:
        raise SnapshotError(f"snapshot {file}: not a manifest of {FORMAT} ({exc})") from None


def _load(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file of a snapshot; an error naming the file if it is missing, truncated or corrupt."""
    try:
        return load_file(str(file))
    except Exception as exc:  # safetensors raises its own error type on a truncated or corrupt file
        raise unreadable(file, str(exc)) from None


def unreadable(file: Path, why: str) -> SnapshotError:
    """The error for a snapshot file that cannot be read (missing, truncated, corrupt), naming it."""
    return SnapshotError(f"snapshot {file.parent}: {file.name} is unreadable ({why}); refusing it")


def read_embeddings(path: str | Path) -> dict[str, torch.Tensor]:
    """The folder's rows as one set of tensors ("ids" sorted when the rows were sharded over files)."""
    parts = list(read_rows_files(path))
    if len(parts) == 1:
        return parts[0]
    joined = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    order = torch.from_numpy(np.argsort(joined["ids"].numpy(), kind="stable"))
    return {key: value[order] for key, value in joined.items()}


def read_rows_files(path: str | Path) -> Iterator[dict[str, torch.Tensor]]:
    """The folder's rows file by file (one, or one per shard as its manifest says), so a reader
    keeping a share of the rows never holds them all."""
    shards = read_manifest(path).shards if (Path(path) / MANIFEST).is_file() else 1
    for shard in range(shards):
        yield _load(Path(path) / rows_file(shard, shards))


def load_model(path: str | Path, manifest: Manifest) -> CtrModel:
    model = CtrModel(ModelConfig.from_dict(manifest.model))
    weights = _load(Path(path) / DENSE)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise SnapshotError(f"snapshot {path}: dense weights do not fit the model config ({exc})") from None
    return model.eval()


def load_snapshot(
    path: str | Path, table: EmbeddingTable, keep: Callable[[np.ndarray], np.ndarray] | None = None
) -> Snapshot:
    """Read a snapshot into a fresh model and into `table` (whose tier should be empty); with
    `keep` (ids (n,) -> bool (n,)), only the rows it keeps (a shard's)."""
    manifest = read_manifest(path)
    if not table.config.holds_rows_of(TableConfig.from_dict(manifest.table)):  # type: ignore[arg-type]
        raise SnapshotError(
            f"snapshot {path}: its rows were written under table config {manifest.table}, which this "
            f"trainer's {table.config} cannot read (width, initializer, admission or sparse optimizer "
            "differ); resume with the settings it was taken with, or start from an empty snapshot folder"
        )
    for emb in read_rows_files(path):  # file by file: with `keep`, only a share is ever held
        ids = emb["ids"].numpy().astype(np.int64)
        rows = join_rows(emb["vectors"], *_row_states(emb))
        if keep is not None:
            mask = keep(ids)
            ids, rows = ids[mask], rows[torch.from_numpy(mask)]
        table.load(ids, rows)
    if table.sketch is not None and (Path(path) / ADMISSION).is_file():
        sketch = _load(Path(path) / ADMISSION)
        table.sketch.load(sketch["counts"].numpy().view(np.uint16), int(sketch["added"][0]))
    return Snapshot(manifest, load_model(path, manifest), table)


def read_metrics(path: str | Path) -> dict[str, np.ndarray] | None:
    """The metrics' counts a recovery snapshot holds (None for snapshots written before they were kept)."""
    file = Path(path) / METRICS
    if not file.is_file():
        return None
    return {k: v.numpy() for k, v in _load(file).items()}


def load_optimizer_state(path: str | Path, optimizer: torch.optim.Optimizer) -> None:
    flat = _load(Path(path) / OPTIMIZER)
    state = optimizer.state_dict()
    for key, value in flat.items():
        index, name = key.split(".", 1)
        state["state"].setdefault(int(index), {})[name] = value
    optimizer.load_state_dict(state)


def _flat_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {}
    for index, values in optimizer.state_dict()["state"].items():
        for name, value in values.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            flat[f"{index}.{name}"] = tensor.detach().cpu().contiguous()
    return flat
