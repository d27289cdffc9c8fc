"""Shared fixtures. The session's real Kafka broker and MLflow server are started here, on their own
ports and state folder, by the `stack` fixture; a failure to start them fails the tests that
need them (never a skip)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from adstream import stack as local_stack
from adstream.config import Config, build_config
from stream.schema import Schema, load_schema

ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """The read-only shared data: $ADSTREAM_SHARED, else ../shared beside the clone, else /work/shared."""
    for candidate in (os.environ.get("ADSTREAM_SHARED"), ROOT.parent / "shared", "/work/shared"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return ROOT.parent / "shared"


def needs_shared(present: bool, what: str) -> pytest.MarkDecorator:
    """Skip a test on a machine without the shared data, except under CI=true, where it runs and fails."""
    return pytest.mark.skipif(not present and os.environ.get("CI") != "true", reason=f"{what} is not on this machine")


CRITEO_DIR = Path(os.environ.get("ADSTREAM_CRITEO_DIR", shared_dir() / "data" / "criteo"))
CRITEO_FILES = sorted(CRITEO_DIR.glob("*.txt")) if CRITEO_DIR.is_dir() else []
# real Criteo rows in time order: the 10k contiguous file first
CRITEO_FILES.sort(key=lambda p: (not p.name.startswith("autoint"), p.name))


@pytest.fixture(scope="session")
def schema() -> Schema:
    return load_schema("criteo")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Config]:
    """A real Kafka broker + MLflow server for this test session (ports 29092/29093 and 25000 by default)."""
    state = tmp_path_factory.mktemp("stack")
    kafka_port = int(os.environ.get("ADSTREAM_TEST_KAFKA_PORT", "29092"))
    mlflow_port = int(os.environ.get("ADSTREAM_TEST_MLFLOW_PORT", "25000"))
    config = build_config(
        {
            "stack": {
                "state_dir": str(state),
                "kafka_port": kafka_port,
                "controller_port": kafka_port + 1,
                "mlflow_port": mlflow_port,
            }
        }
    )
    try:
        local_stack.up(config.stack, config.kafka)
    except Exception as exc:
        local_stack.down(config.stack)
        pytest.fail(f"the test stack (Kafka + MLflow) did not start: {exc}", pytrace=False)
    yield config
    local_stack.down(config.stack)


@pytest.fixture
def isolated(stack: Config, tmp_path: Path) -> Config:
    """The session stack with topics, groups, experiment and model name of this test alone."""
    tag = uuid.uuid4().hex[:8]
    kafka = replace(stack.kafka.scoped(f"t{tag}"), partitions=2)
    return replace(
        stack,
        kafka=kafka,
        stream=replace(stack.stream, app_id=f"t{tag}-featurizer", batch_within_s=0.5),
        trainer=replace(
            stack.trainer,
            group_id=f"t{tag}-trainer",
            snapshot_dir=str(tmp_path / "snapshots"),
            snapshot_every_steps=1000,
            snapshot_every_s=3600.0,
        ),
        mlflow=replace(stack.mlflow, experiment=f"test-{tag}", model_name=f"test-model-{tag}"),
        serving=replace(stack.serving, cache_dir=str(tmp_path / "serving"), poll_s=0.5),
    )


def criteo_event(i: int = 0, **overrides: object) -> dict[str, object]:
    """A valid Criteo-shaped event dict."""
    event: dict[str, object] = {"event_id": f"e{i}", "ts": 1_700_000_000_000 + i, "label": i % 2}
    event.update({f"I{k}": (k * 7 + i) % 50 - 1 for k in range(1, 14)})
    event.update({f"C{k}": f"{(k * 2654435761 + i) & 0xFFFFFFFF:08x}" for k in range(1, 27)})
    event.update(overrides)
    return event


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
