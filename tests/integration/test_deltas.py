"""Deltas through the real MLflow server: the trainer's Publisher uploads a base and its deltas,
serving's registry fetch follows them in order and serves the trainer's predictions; a gap is
refused, counted once, and the last good model keeps serving until the next base; a delta whose
upload is unfinished is invisible."""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from adstream.config import Config
from serving.app import registry_fetch
from serving.predict import predict_events
from stream.schema import load_schema
from tests.helpers import trained_trainer
from tests.test_deltas import learn_more, probe_events, publish_base, publish_delta, trainer_predictions
from trainer.errors import TrainerError
from trainer.publish import Publisher

pytestmark = pytest.mark.integration


def served_base(config: Config, tmp_path: Path, run_name: str):
    """A trained trainer's base published through the real MLflow and fetched by serving:
    (schema, trainer, publisher, fetch, the served model)."""
    schema = load_schema(config.stream.schema)
    trainer = trained_trainer(schema, 3)
    publisher = Publisher(config.mlflow, run_name=run_name)
    version = publisher.publish(publish_base(trainer, tmp_path), trainer.step)
    fetch = registry_fetch(config.mlflow.tracking_uri, config.mlflow.model_name, config.serving, schema)
    served = fetch(None)
    assert served is not None and served.version == version and served.sequence == 0
    return schema, trainer, publisher, fetch, served


def test_serving_follows_base_and_deltas_and_refuses_a_gap(isolated: Config, tmp_path: Path, monkeypatch):
    import serving.registry

    listings = []  # a quiet poll is one registry call: the deltas folder is listed only when the tag moved
    real_list_deltas = serving.registry.list_deltas
    monkeypatch.setattr(serving.registry, "list_deltas", lambda *a: listings.append(a) or real_list_deltas(*a))
    schema, trainer, publisher, fetch, served = served_base(isolated, tmp_path, "deltas")
    version = served.version
    assert fetch(served) is None and not listings  # nothing newer, and the version's tag said so

    for sequence, first in ((1, 150), (2, 250)):
        learn_more(trainer, schema, first, 2)
        delta, changed = publish_delta(trainer, tmp_path, publisher.base_step, sequence)
        publisher.publish_delta(delta, sequence, trainer.step, len(changed))
    served = fetch(served)  # both deltas in one poll, in order
    assert served is not None and served.version == version and served.sequence == 2
    np.testing.assert_allclose(
        predict_events(served, probe_events(schema), schema), trainer_predictions(trainer, schema), rtol=1e-5, atol=1e-6
    )
    late = fetch(None)  # a server starting now: the base, then every delta
    assert late is not None and late.sequence == 2
    listings.clear()
    assert fetch(served) is None and not listings

    # a delta still being uploaded (a trainer killed mid-upload leaves the same): its data is there,
    # its manifest (sent last) is not. It is invisible: no error, the model stays
    learn_more(trainer, schema, 300, 1)
    torn, changed = publish_delta(trainer, tmp_path, publisher.base_step, 3)
    target = f"{publisher.base_path}/deltas/{3:09d}"
    for name in ("dense.safetensors", "embeddings.safetensors"):
        publisher.client.log_artifact(publisher.run_id, str(torn / name), target)
    assert fetch(served) is None
    publisher.publish_delta(torn, 3, trainer.step, len(changed))  # now whole
    served = fetch(served)
    assert served is not None and served.sequence == 3

    # a gap: delta 5 uploaded where 4 never was (the publisher refuses to, so go around it)
    with pytest.raises(TrainerError, match="not the next one"):
        publisher.publish_delta(delta, 5, trainer.step, 0)
    learn_more(trainer, schema, 350, 1)
    gap, _ = publish_delta(trainer, tmp_path, publisher.base_step, 5)
    publisher.sequence = 4
    publisher.publish_delta(gap, 5, trainer.step, 0)
    with pytest.raises(Exception, match="gap"):
        fetch(served)
    assert fetch(served) is None  # refused once, not downloaded again: the model stays
    # the next base brings serving up to date
    new_version = publisher.publish(publish_base(trainer, tmp_path / "next"), trainer.step)
    newest = fetch(served)
    assert newest is not None and newest.version == new_version and newest.sequence == 0
    np.testing.assert_allclose(
        predict_events(newest, probe_events(schema), schema), trainer_predictions(trainer, schema), rtol=1e-5, atol=1e-6
    )


def test_a_training_job_publishes_deltas_between_bases(isolated: Config, tmp_path: Path):
    """run_training on the real broker sends deltas on its publish clock (before the first base
    exists it sends a base instead)."""
    from mlflow import MlflowClient

    from common.checks import with_changes
    from trainer.loop import run_training
    from trainer.snapshot import read_manifest

    from .test_recovery import RECORDS_PER_PARTITION, job_config, produce_batches

    produce_batches(isolated)
    config = job_config(isolated, tmp_path, "deltas")
    config = replace(config, trainer=with_changes(config.trainer, {"snapshot.publish_every_s": 0.05}))
    schema = load_schema(config.stream.schema)
    summary = run_training(schema, config.kafka, config.trainer, config.mlflow, idle_exit_s=3.0, progress=False)
    assert summary.steps == 2 * RECORDS_PER_PARTITION
    run_id = str(read_manifest(summary.snapshot_path).extra["mlflow_run_id"])
    client = MlflowClient(config.mlflow.tracking_uri)
    rows = [m.value for m in client.get_metric_history(run_id, "delta_rows")]
    assert rows and all(r > 0 for r in rows)
    bases = [info.path for info in client.list_artifacts(run_id, "publications")]
    deltas = [d for base in bases for d in client.list_artifacts(run_id, f"{base}/deltas")]
    assert len(deltas) == len(rows)


def test_a_delta_whose_download_fails_is_tried_again_and_only_then_sticks(isolated: Config, tmp_path: Path):
    """A download failure (here the local cache: a file where the deltas folder goes) is retried at
    the next polls; after DELTA_DOWNLOAD_TRIES failed polls the version waits for the next base."""
    from serving.follow import DELTA_DOWNLOAD_TRIES

    schema, trainer, publisher, fetch, served = served_base(isolated, tmp_path, "delta-retries")
    assert served.folder is not None
    assert served.folder.parent == Path(isolated.serving.cache_dir) / isolated.mlflow.model_name
    blocker = served.folder / "deltas"

    for sequence in (1, 2):
        learn_more(trainer, schema, 100 * sequence, 1)
        delta, changed = publish_delta(trainer, tmp_path, publisher.base_step, sequence)
        publisher.publish_delta(delta, sequence, trainer.step, len(changed))
        shutil.rmtree(blocker, ignore_errors=True)  # the deltas already applied leave the cache
        blocker.write_text("in the way")
        for _ in range(DELTA_DOWNLOAD_TRIES - 1 if sequence == 1 else DELTA_DOWNLOAD_TRIES):
            with pytest.raises(OSError):
                fetch(served)
        blocker.unlink()
        if sequence == 1:  # fewer failures than the limit: the next poll applies it
            served = fetch(served)
            assert served is not None and served.sequence == 1
        else:  # the limit reached: the version is stuck until the next base, even with the way clear
            assert fetch(served) is None
    new_version = publisher.publish(publish_base(trainer, tmp_path / "next"), trainer.step)
    newest = fetch(served)
    assert newest is not None and newest.version == new_version
    np.testing.assert_allclose(
        predict_events(newest, probe_events(schema), schema), trainer_predictions(trainer, schema), rtol=1e-5, atol=1e-6
    )


def test_a_broken_delta_behind_a_good_one_or_a_new_base_is_reported_never_silent(isolated: Config, tmp_path: Path):
    """A serving start fetches the base and its deltas in one poll; a broken delta behind a good one
    (or behind the base) does not hold back what applied, and its refusal is raised at the next
    poll: logged, counted by adstream_serving_refused_total, shown as /model's last_error."""
    from fastapi.testclient import TestClient
    from prometheus_client import REGISTRY

    from serving.app import create_app

    schema, trainer, publisher, _, _ = served_base(isolated, tmp_path, "broken-delta")
    for sequence in (1, 2):
        learn_more(trainer, schema, 100 * sequence, 1)
        delta, changed = publish_delta(trainer, tmp_path, publisher.base_step, sequence)
        if sequence == 2:
            (delta / "embeddings.safetensors").write_bytes(b"\x00" * 100)  # broken on disk, uploaded as is
        publisher.publish_delta(delta, sequence, trainer.step, len(changed))

    settings = replace(isolated.serving, cache_dir=str(tmp_path / "fresh-cache"))
    fetch = registry_fetch(isolated.mlflow.tracking_uri, isolated.mlflow.model_name, settings, schema)
    served = fetch(None)  # what a starting server does: base + delta 1 apply, delta 2 is refused
    assert served is not None and served.sequence == 1
    with pytest.raises(Exception, match="embeddings.safetensors"):
        fetch(served)  # the refusal, reported
    assert fetch(served) is None  # and not downloaded again: the model stays

    def refused() -> float:
        return REGISTRY.get_sample_value("adstream_serving_refused_total") or 0.0

    before = refused()
    settings = replace(settings, cache_dir=str(tmp_path / "app-cache"), poll_s=0.05)
    app_fetch = registry_fetch(isolated.mlflow.tracking_uri, isolated.mlflow.model_name, settings, schema)
    with TestClient(create_app(settings, schema, app_fetch, isolated.kafka)) as client:
        deadline = time.monotonic() + 30
        while refused() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        info = client.get("/model").json()
    assert info["sequence"] == 1 and "embeddings.safetensors" in (info["last_error"] or "")
    assert refused() == before + 1  # counted once
