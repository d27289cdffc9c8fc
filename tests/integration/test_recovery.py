"""A 2-replica training job on the real broker and MLflow server, SIGKILLed and restarted by its
supervisor: every produced record is learned, nothing is learned twice except what came after
the snapshot it resumed from, and the final model equals a job that was never killed."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from adstream.config import Config
from common.checks import with_changes
from stream.featurizer.ingest import featurize_records
from stream.formats.batch_codec import encode_batch
from stream.kafka.topics import ensure_topics
from stream.produce.replay import synthetic_records
from stream.produce.synthetic import SyntheticCriteo
from stream.records import RawRecord
from stream.schema import load_schema
from trainer.snapshot import latest_snapshot, read_manifest

from .helpers import start_cli

pytestmark = pytest.mark.integration
RECORDS_PER_PARTITION, EVENTS_PER_RECORD = 48, 64


def produce_batches(config: Config) -> set[tuple[int, int]]:
    """Featurized batches straight into the batches topic, the same count on each partition."""
    from confluent_kafka import Producer

    schema = load_schema(config.stream.schema)
    ensure_topics(config.kafka)
    events, _ = SyntheticCriteo(schema).generate(2 * RECORDS_PER_PARTITION * EVENTS_PER_RECORD)
    bundles = list(synthetic_records(events, schema, bundle=EVENTS_PER_RECORD, fmt="arrow"))
    producer = Producer({"bootstrap.servers": config.kafka.bootstrap})
    produced = set()
    for i, record in enumerate(bundles):
        batch, rejected = featurize_records([RawRecord(0, i, record.value)], schema)
        assert not rejected
        partition = i % 2
        producer.produce(config.kafka.batches_topic, encode_batch(batch), partition=partition)
        produced.add((partition, i // 2))  # a fresh topic: offsets count from 0 per partition
    assert producer.flush(30) == 0
    return produced


# the tiered store's budgets are a few batches' rows, so rows go down to RocksDB and come back
# (through the pipelined loop: one batch held ahead, its cold rows prefetched)
TIERED = {"store.kind": "tiered", "store.device_bytes": 250_000, "store.ram_bytes": 100_000}


def job_config(config: Config, tmp_path: Path, name: str, store: str = "ram") -> Config:
    tiered = {**TIERED, "store.path": str(tmp_path / name / "rocksdb")} if store == "tiered" else {}
    trainer = with_changes(
        config.trainer,
        {
            **tiered,
            "group_id": f"{config.trainer.group_id}-{name}",
            "learn_log": str(tmp_path / name / "learned"),
            "batch_size": EVENTS_PER_RECORD,
            "threads": 1,
            "model.embed_dim": 4,
            "model.hidden": (16,),
            "snapshot.dir": str(tmp_path / name / "snapshots"),
            "snapshot.every_steps": 6,
            "snapshot.every_s": 3600.0,
            # no clocks: every sync point comes from the step counts, so the killed job's rounds,
            # merges and snapshots are the reference's (a publish clock's extra merge is not)
            "snapshot.publish_every_s": 0.0,
            "group.merge_every_steps": 3,
            "group.workers": 2,
            "group.max_restarts": 2,
        },
    )
    return replace(config, trainer=trainer)


def learned(folder: Path) -> list[tuple[int, int, int, int]]:
    """(partition, offset, step, attempt) of every record any replica learned."""
    rows = []
    for file in folder.glob("rank*.tsv"):
        for line in file.read_text().splitlines():
            p, o, s, a = map(int, line.split("\t"))
            rows.append((p, o, s, a))
    return rows


def final_model(snapshots: Path) -> dict[str, np.ndarray]:
    last = latest_snapshot(snapshots)
    assert last is not None
    return {**load_file(str(last / "dense.safetensors")), **load_file(str(last / "embeddings.safetensors"))}


def run_job(config: Config, tmp_path: Path, name: str, kill: bool) -> tuple[subprocess.Popen[bytes], Path]:
    proc, log = start_cli(config, tmp_path / name, "train", "--idle-exit", "4")
    if kill:  # SIGKILL one replica at a random point after the first snapshot, while records remain
        snapshots = Path(config.trainer.snapshot.dir)
        deadline = time.monotonic() + 120
        while latest_snapshot(snapshots) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        latest = 2 * RECORDS_PER_PARTITION * 3 // 4
        target = random.randint(min(len(learned(Path(config.trainer.learn_log))), latest), latest)
        while len(learned(Path(config.trainer.learn_log))) < target and time.monotonic() < deadline:
            time.sleep(0.005)
        pids = [int(p) for p in re.findall(r"\d+", re.search(r"replicas \[([\d, ]+)\]", log.read_text()).group(1))]
        victim = random.choice(pids)
        os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    return proc, log


@pytest.mark.parametrize("store", ["ram", "tiered"])
def test_killed_replica_resumes_from_the_snapshot_with_no_record_lost(isolated: Config, tmp_path: Path, store: str):
    produced = produce_batches(isolated)
    (tmp_path / "reference").mkdir()
    (tmp_path / "killed").mkdir()
    reference = job_config(isolated, tmp_path, "reference", store)
    killed = job_config(isolated, tmp_path, "killed", store)
    run_job(reference, tmp_path, "reference", kill=False)
    _, log = run_job(killed, tmp_path, "killed", kill=True)
    assert "restart 1" in log.read_text()

    ref_rows = learned(tmp_path / "reference" / "learned")
    assert {(p, o) for p, o, _, _ in ref_rows} == produced and len(ref_rows) == len(produced)

    rows = learned(tmp_path / "killed" / "learned")
    assert {(p, o) for p, o, _, _ in rows} == produced  # nothing lost, no gap
    first = [r for r in rows if r[3] == 0]
    second = [r for r in rows if r[3] == 1]
    assert second, "the restarted group learned the rest"
    resumed_step = min(s for _, _, s, _ in second) - 1  # the restored snapshot's step
    again = {(p, o) for p, o, _, _ in first} & {(p, o) for p, o, _, _ in second}
    before_snapshot = {(p, o) for p, o, s, _ in first if s <= resumed_step}
    assert not again & before_snapshot  # nothing the snapshot holds is learned twice
    assert again == {(p, o) for p, o, s, _ in first if s > resumed_step}  # what came after it is relearned
    kept = {(p, o): s for p, o, s, _ in first if s <= resumed_step} | {(p, o): s for p, o, s, _ in second}
    assert kept == {(p, o): s for p, o, s, _ in ref_rows}  # each record learned at the reference's step

    ref, got = final_model(Path(reference.trainer.snapshot.dir)), final_model(Path(killed.trainer.snapshot.dir))
    assert ref.keys() == got.keys()
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], atol=1e-6, err_msg=key)
    final = latest_snapshot(Path(killed.trainer.snapshot.dir))
    assert final is not None and final.name == latest_snapshot(Path(reference.trainer.snapshot.dir)).name
    # the metrics cover the whole stream across the restart, as the job that was never killed reports them
    ref_metrics = read_manifest(latest_snapshot(Path(reference.trainer.snapshot.dir))).metrics
    got_metrics = read_manifest(final).metrics
    assert got_metrics["events"] == ref_metrics["events"] == len(produced) * EVENTS_PER_RECORD
    for key in ("progressive_auc", "progressive_logloss", "progressive_ece"):
        assert got_metrics[key] == pytest.approx(ref_metrics[key], abs=1e-6), key

    # the merged model is what the registry serves: the alias points at the final snapshot
    from mlflow import MlflowClient

    client = MlflowClient(isolated.mlflow.tracking_uri)
    version = client.get_model_version_by_alias(isolated.mlflow.model_name, isolated.mlflow.alias)
    assert version.source.endswith(f"publications/{final.name}")  # the serving publication of that step
    if store == "tiered":  # rows really went down to RocksDB and came back through the prefetch
        experiment = client.get_experiment_by_name(isolated.mlflow.experiment)
        runs = client.search_runs([experiment.experiment_id], f"params.group_id = '{reference.trainer.group_id}'")
        metrics = runs[0].data.metrics
        assert metrics["store_writebacks"] > 0 and metrics["store_io_prefetched_rows"] > 0, metrics
