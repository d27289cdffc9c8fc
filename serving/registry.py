"""Which publication to serve: resolve an alias in the MLflow model registry, download its artifacts,
and list and download the deltas published after that base (trainer/publish.py has the layout).

Serving polls every second or so, on the machine that answers requests, so a quiet poll is one
registry call on a client made once: the publisher tags each version with the newest delta it
uploaded (DELTA_TAG), and the deltas folder is listed only when that tag is ahead of what is served.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from serving.errors import ServingError
from trainer.snapshot import DELTA_TAG, DELTAS, MANIFEST, delta_path, is_complete


@dataclass(frozen=True)
class VersionRef:
    name: str
    version: str
    source: str  # artifact URI of the snapshot folder
    run_id: str
    delta: int | None = None  # the newest delta uploaded after this base (DELTA_TAG); None: untagged, list to know


@lru_cache(maxsize=4)
def _client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


def resolve(tracking_uri: str, name: str, alias: str) -> VersionRef | None:
    """The version behind `alias` (or the highest version for "latest"); None if there is none yet."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        if alias == "latest":
            versions = client.search_model_versions(f"name = '{name}'")
            if not versions:
                return None
            mv = max(versions, key=lambda v: int(v.version))
        else:
            mv = client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if "RESOURCE_DOES_NOT_EXIST" in str(exc.error_code) or "not found" in str(exc).lower():
            return None
        raise ServingError(f"registry at {tracking_uri}: {exc}") from None
    delta = (mv.tags or {}).get(DELTA_TAG)
    return VersionRef(name, str(mv.version), str(mv.source), str(mv.run_id), int(delta) if delta else None)


def cache_folder(cache_dir: str | Path, ref: VersionRef) -> Path:
    """Where a version's download lives: by name, version AND where it came from (its run and
    artifact URI). A registry made anew (a stack brought down with its volumes, another MLflow on
    the same port) numbers its versions from 1 again; a cache keyed by the number alone served an
    earlier registry's version 1 with the new one's deltas on top, rows of two runs mixed."""
    origin = hashlib.sha256(f"{ref.run_id}|{ref.source}".encode()).hexdigest()[:12]
    return Path(cache_dir) / ref.name / f"{ref.version}-{origin}"


def download(tracking_uri: str, ref: VersionRef, cache_dir: str | Path) -> Path:
    """Download a version's snapshot folder once; later calls reuse it. The folder appears whole
    (downloaded beside it, then renamed): serving workers sharing the cache map what another one
    downloaded, never a file still being written."""
    import mlflow

    target = cache_folder(cache_dir, ref)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
        path = Path(mlflow.artifacts.download_artifacts(artifact_uri=ref.source, dst_path=tmp))
        if not is_complete(path):
            raise ServingError(f"version {ref.version} of {ref.name}: no {MANIFEST} under {ref.source}")
        try:
            path.rename(target)
        except OSError:  # another worker's download got there first (or a half one from before a crash)
            if not is_complete(target):
                shutil.rmtree(target, ignore_errors=True)
                path.rename(target)
    return target


def list_deltas(tracking_uri: str, ref: VersionRef) -> list[int]:
    """Sequence numbers of the deltas uploaded (or being uploaded) after this version's base, sorted."""
    import mlflow

    listing = mlflow.artifacts.list_artifacts(artifact_uri=f"{ref.source}/{DELTAS}", tracking_uri=tracking_uri)
    names = [Path(info.path).name for info in listing if info.is_dir]
    return sorted(int(name) for name in names if name.isdigit())


def download_delta(tracking_uri: str, ref: VersionRef, sequence: int, cache_dir: str | Path) -> Path | None:
    """Download delta `sequence` of this version's base; None while it is still being uploaded (its
    manifest, uploaded last, is not there yet)."""
    import mlflow

    target = cache_folder(cache_dir, ref) / delta_path(sequence)
    if is_complete(target):
        return target
    uri = f"{ref.source}/{delta_path(sequence)}"
    # look before downloading: a folder caught between its creation and its first file lists empty,
    # and MLflow then takes it for a file and fails; with the manifest listed, every file is there
    listed = mlflow.artifacts.list_artifacts(artifact_uri=uri, tracking_uri=tracking_uri)
    if MANIFEST not in {Path(info.path).name for info in listed}:
        return None
    with tempfile.TemporaryDirectory(dir=Path(cache_dir)) as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp, tracking_uri=tracking_uri))
        if not is_complete(local):
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        local.rename(target)  # whole or not at all: the cache never holds half a delta
    return target


@dataclass(frozen=True)
class MlflowRegistry:
    """One registered model behind one alias, as serving/follow.py's Registry: these functions bound."""

    tracking_uri: str
    name: str
    alias: str
    cache_dir: str  # where bases and deltas are downloaded

    def resolve(self) -> VersionRef | None:
        return resolve(self.tracking_uri, self.name, self.alias)

    def download(self, ref: VersionRef) -> Path:
        return download(self.tracking_uri, ref, self.cache_dir)

    def list_deltas(self, ref: VersionRef) -> list[int]:
        return list_deltas(self.tracking_uri, ref)

    def download_delta(self, ref: VersionRef, sequence: int) -> Path | None:
        return download_delta(self.tracking_uri, ref, sequence, self.cache_dir)
