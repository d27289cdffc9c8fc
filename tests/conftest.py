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
import torch

from adstream import stack as local_stack
from adstream.config import Config, build_config
from stream.schema import Schema, load_schema
from trainer.settings import SnapshotSettings

# the CUDA paths' tests need a GPU: collected where torch sees one (a GPU machine), not on CI
collect_ignore = [] if torch.cuda.is_available() else ["test_cuda.py"]


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
            snapshot=SnapshotSettings(dir=str(tmp_path / "snapshots"), every_steps=1000, every_s=3600.0),
        ),
        mlflow=replace(stack.mlflow, experiment=f"test-{tag}", model_name=f"test-model-{tag}"),
        serving=replace(stack.serving, cache_dir=str(tmp_path / "serving"), poll_s=0.5),
    )


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
