"""serving/follow.py's policy without HTTP or MLflow: an in-memory registry, models as (version, sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from serving.follow import DELTA_DOWNLOAD_TRIES, KEPT_BASES, Follower
from serving.registry import VersionRef


@dataclass(frozen=True)
class Model:
    version: str
    sequence: int = 0


@dataclass
class Registry:
    """Versions, the one behind the alias, each version's deltas; what is broken, what fails to download."""

    alias: str | None = None
    deltas: dict[str, list[int]] = field(default_factory=dict)
    broken: set[str] = field(default_factory=set)  # "v" (a base) or "v/3" (a delta) that will not load
    failing: dict[str, int] = field(default_factory=dict)  # "v/3" -> downloads still to fail
    downloads: list[str] = field(default_factory=list)

    def resolve(self) -> VersionRef | None:
        return None if self.alias is None else VersionRef("m", self.alias, "src", "run")

    def download(self, ref: VersionRef) -> Path:
        self.downloads.append(ref.version)
        return Path(ref.version)

    def list_deltas(self, ref: VersionRef) -> list[int]:
        return self.deltas.get(ref.version, [])

    def download_delta(self, ref: VersionRef, sequence: int) -> Path | None:
        key = f"{ref.version}/{sequence}"
        if self.failing.get(key, 0) > 0:
            self.failing[key] -= 1
            raise OSError(f"download of {key} failed")
        return Path(key)


def follower(registry: Registry, dropped: list[str] | None = None) -> Follower:
    gone = [] if dropped is None else dropped

    def load(path: Path, version: str) -> Model:
        if version in registry.broken:
            raise ValueError(f"base {version} unreadable")
        return Model(version)

    def apply(model: Model, path: Path) -> Model:
        if str(path) in registry.broken:
            raise ValueError(f"delta {path} refused")
        return replace(model, sequence=int(str(path).split("/")[1]))

    return Follower(registry, load, apply, lambda m: gone.append(m.version))  # type: ignore[arg-type]


def test_a_base_then_its_deltas_in_order_then_nothing_newer():
    registry = Registry(alias="1", deltas={"1": [1, 2]})
    follow = follower(registry)
    assert follow(None) == Model("1", 2)
    assert follow(Model("1", 2)) is None
    registry.deltas["1"].append(3)
    assert follow(Model("1", 2)) == Model("1", 3)


def test_a_refused_base_is_not_downloaded_again_and_the_next_one_is_taken():
    registry = Registry(alias="1", broken={"1"})
    follow = follower(registry)
    with pytest.raises(ValueError, match="base 1"):
        follow(None)
    assert follow(None) is None and registry.downloads == ["1"]
    registry.alias = "2"
    assert follow(None) == Model("2")


def test_a_broken_delta_behind_a_good_one_serves_the_good_one_and_is_raised_next_poll():
    registry = Registry(alias="1", deltas={"1": [1, 2, 3]}, broken={"1/2"})
    follow = follower(registry)
    assert follow(None) == Model("1", 1)  # what applied is served at once
    with pytest.raises(ValueError, match="delta 1/2"):  # and the refusal is not silent
        follow(Model("1", 1))
    assert follow(Model("1", 1)) is None  # stuck until the next base
    registry.alias = "2"
    assert follow(Model("1", 1)) == Model("2")


def test_a_delta_download_is_tried_again_until_the_limit_then_the_version_waits():
    registry = Registry(alias="1", deltas={"1": [1]}, failing={"1/1": DELTA_DOWNLOAD_TRIES - 1})
    follow = follower(registry)
    assert follow(None) == Model("1")  # the base; the failure is raised at the next poll
    for _ in range(DELTA_DOWNLOAD_TRIES - 1):
        with pytest.raises(OSError):
            follow(Model("1"))
    assert follow(Model("1")) == Model("1", 1)  # fewer failures than the limit: applied
    registry.deltas["1"].append(2)
    registry.failing["1/2"] = DELTA_DOWNLOAD_TRIES
    for _ in range(DELTA_DOWNLOAD_TRIES):
        with pytest.raises(OSError):
            follow(Model("1", 1))
    registry.failing["1/2"] = 0
    assert follow(Model("1", 1)) is None  # the limit reached: it waits for the next base


def test_only_the_newest_bases_stay_loaded():
    registry, dropped = Registry(), []
    follow = follower(registry, dropped)
    for version in map(str, range(1, KEPT_BASES + 3)):
        registry.alias = version
        assert follow(None) == Model(version)
    assert dropped == ["1", "2"]
