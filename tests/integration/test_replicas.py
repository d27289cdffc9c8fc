"""Two replicas of run_training on the real broker: time-triggered merges, one merged result, and
every partition's offsets committed to the group once the final snapshot is durable; and two
replicas with their rows sharded between them, whose snapshot still holds every row."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from adstream.config import Config
from common.checks import with_changes
from stream.schema import load_schema
from trainer.group import launch_local
from trainer.loop import TrainSummary, run_training
from trainer.snapshot import read_embeddings

from .helpers import drain
from .test_recovery import RECORDS_PER_PARTITION, job_config, produce_batches

pytestmark = pytest.mark.integration


def replica(config: Config) -> TrainSummary:
    schema = load_schema(config.stream.schema)
    return run_training(schema, config.kafka, config.trainer, config.mlflow, idle_exit_s=3.0, progress=False)


def test_replicas_merge_on_a_timer_and_commit_every_partition(isolated: Config, tmp_path: Path):
    produce_batches(isolated)
    config = job_config(isolated, tmp_path, "timer")
    # k far beyond the stream: every merge but the final one is triggered by the clock
    config = replace(
        config, trainer=with_changes(config.trainer, {"group.merge_every_steps": 10_000, "group.merge_every_s": 0.2})
    )
    first, second = launch_local(replica, 2, config, timeout_s=300)
    assert first.steps == second.steps == RECORDS_PER_PARTITION
    assert first.events == 2 * RECORDS_PER_PARTITION * 64
    assert first.merges >= 2 and first.merges == second.merges  # the final merge plus timed ones
    assert first.merge_bytes == second.merge_bytes > 0
    assert first.progressive_auc == second.progressive_auc  # merged over both replicas' predictions
    assert first.snapshot_path and Path(first.snapshot_path).name == f"step-{RECORDS_PER_PARTITION:09d}"

    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": isolated.kafka.bootstrap, "group.id": config.trainer.group_id})
    try:
        committed = consumer.committed([TopicPartition(isolated.kafka.batches_topic, p) for p in (0, 1)], timeout=30)
    finally:
        consumer.close()
    assert {tp.partition: tp.offset for tp in committed} == {0: RECORDS_PER_PARTITION, 1: RECORDS_PER_PARTITION}


def test_replicas_with_sharded_rows_learn_every_record_and_snapshot_every_row(isolated: Config, tmp_path: Path):
    """trainer.shard_within_node: each replica stores the rows it owns; the snapshot rank 0 writes
    gathers every replica's, so it holds the row of every id on the topic."""
    import numpy as np

    from stream.formats.batch_codec import decode_batch

    produce_batches(isolated)
    config = job_config(isolated, tmp_path, "sharded")
    config = replace(
        config, trainer=with_changes(config.trainer, {"group.merge_every_steps": 0, "shard_within_node": True})
    )
    first, second = launch_local(replica, 2, config, timeout_s=300)
    assert first.steps == second.steps and first.events == 2 * RECORDS_PER_PARTITION * 64
    assert first.merges == 0 and first.merge_bytes > 0  # no merges: rows and gradients moved every step
    batches = drain(
        isolated.kafka.bootstrap,
        isolated.kafka.batches_topic,
        lambda m: len(m) >= 2 * RECORDS_PER_PARTITION,
        60,
        f"{config.trainer.group_id}-check",
    )
    on_topic = np.unique(np.concatenate([decode_batch(m.value()).ids.reshape(-1) for m in batches]))
    assert first.snapshot_path is not None
    np.testing.assert_array_equal(read_embeddings(first.snapshot_path)["ids"].numpy(), on_topic)
