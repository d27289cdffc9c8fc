"""Which model serving serves next: the registry's alias followed, bases loaded, deltas applied.

    Follower(registry, load, apply, drop)(current) -> a newer ServedModel, or None (nothing newer)

The policy, tested without HTTP or MLflow (tests/test_serving_follow.py): a new version behind the
alias is downloaded and loaded whole; while it stays, its deltas are applied in order. A refused
version or delta is not downloaded again: the model stays until the alias moves to the next base.
A delta whose download fails (the registry or the network for a moment) is tried again at the next
polls, DELTA_DOWNLOAD_TRIES in all. A failure met after a newer model was already in hand (a broken
delta behind a new base or a good delta) does not hold that model back: it is returned, and the
failure is raised at the next poll, so every refusal is logged and counted (serving/app.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from serving.loader import ServedModel
from serving.registry import VersionRef

DELTA_DOWNLOAD_TRIES = 3  # polls a delta's download may fail (registry or network) before the version sticks
KEPT_BASES = 2  # bases kept loaded (requests may still run on the one before the newest)


class Registry(Protocol):
    """Where publications come from (serving/registry.py over MLflow; a dict in the tests)."""

    def resolve(self) -> VersionRef | None: ...  # the version behind the alias, if any
    def download(self, ref: VersionRef) -> Path: ...  # the base's folder on disk
    def list_deltas(self, ref: VersionRef) -> list[int]: ...  # the delta sequences published after it
    def download_delta(self, ref: VersionRef, sequence: int) -> Path | None: ...  # None: still uploading


class Follower:
    """Called once per poll with the model served now; its state is what it refused and tried."""

    def __init__(
        self,
        registry: Registry,
        load: Callable[[Path, str], ServedModel],  # a base's folder, its version -> the model
        apply: Callable[[ServedModel, Path], ServedModel],  # a delta applied (raises when refused)
        drop: Callable[[ServedModel], None] = lambda model: None,  # a base no longer kept
    ) -> None:
        self.registry, self.load, self.apply, self.drop = registry, load, apply, drop
        self.refused: set[str] = set()  # versions that failed to load
        self.stuck: set[str] = set()  # versions whose next delta was refused (a gap or a broken delta)
        self.unreported: list[Exception] = []  # a failure met after a newer model was in hand
        self.failed_downloads: dict[tuple[str, int], int] = {}  # (version, sequence) -> failed attempts
        self.loaded: list[ServedModel] = []  # the bases loaded, newest last

    def __call__(self, current: ServedModel | None) -> ServedModel | None:
        if self.unreported:  # the last poll served what did apply and kept this back: report it now
            raise self.unreported.pop()
        ref = self.registry.resolve()
        if ref is None or ref.version in self.refused:
            return None
        fresh: ServedModel | None = None
        if current is None or ref.version != current.version:
            current = fresh = self._load(ref)
        elif ref.version in self.stuck:
            return None
        if ref.delta is not None and ref.delta <= current.sequence:
            return fresh  # the publisher's tag says there is no newer delta: no listing
        for sequence in self.registry.list_deltas(ref):
            if sequence <= current.sequence:
                continue
            try:
                path = self._download_delta(ref, sequence)
                if path is None:  # still uploading: next poll
                    break
                fresh = current = self._apply(ref, current, path)
            except Exception as exc:
                if fresh is not None:  # serve what did apply; the failure is raised at the next poll
                    self.unreported.append(exc)
                    return fresh
                raise
        return fresh

    def _load(self, ref: VersionRef) -> ServedModel:
        try:
            model = self.load(self.registry.download(ref), ref.version)
        except Exception:
            self.refused.add(ref.version)
            raise
        self.loaded.append(model)
        while len(self.loaded) > KEPT_BASES:
            self.drop(self.loaded.pop(0))
        return model

    def _download_delta(self, ref: VersionRef, sequence: int) -> Path | None:
        try:
            return self.registry.download_delta(ref, sequence)
        except Exception:  # transient until it has failed DELTA_DOWNLOAD_TRIES polls
            key = (ref.version, sequence)
            self.failed_downloads[key] = self.failed_downloads.get(key, 0) + 1
            if self.failed_downloads[key] >= DELTA_DOWNLOAD_TRIES:
                self.stuck.add(ref.version)
            raise

    def _apply(self, ref: VersionRef, current: ServedModel, path: Path) -> ServedModel:
        try:
            return self.apply(current, path)
        except Exception:  # refused (a gap, another base, an unreadable file): wait for the next base
            self.stuck.add(ref.version)
            raise
