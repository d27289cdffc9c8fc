"""Challengers on the real broker and MLflow: a job whose own configuration learns nothing and whose
challenger learns publishes the challenger once it leads, as a new base registered with its name;
serving then loads a model of the challenger's family; the run logs every member's curves and
which member served when."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from adstream.config import Config
from common.checks import with_changes
from serving.app import registry_fetch
from stream.schema import load_schema

pytestmark = pytest.mark.integration

LEARNING = "model.kind=lr optim.wide_lr=0.05 optim.lr=0.003 optim.sparse_lr=0"


def test_a_leading_challenger_is_published_as_a_base_and_served_with_its_family(isolated: Config, tmp_path: Path):
    from mlflow import MlflowClient

    from trainer.loop import run_training
    from trainer.publish import CHAMPION_TAG
    from trainer.snapshot import read_manifest

    from .test_recovery import RECORDS_PER_PARTITION, job_config, produce_batches

    produce_batches(isolated)
    config = job_config(isolated, tmp_path, "champion")
    changes = {
        "optim.lr": 0.0,  # the default member learns nothing: it predicts 0.5 throughout
        "optim.wide_lr": 0.0,
        "optim.sparse_lr": 1e-12,
        "challengers": (LEARNING,),
        "switch_every": 1024,
        "snapshot.publish_every_s": 0.05,
    }
    config = replace(config, trainer=with_changes(config.trainer, changes))
    schema = load_schema(config.stream.schema)
    summary = run_training(schema, config.kafka, config.trainer, config.mlflow, idle_exit_s=3.0, progress=False)
    assert summary.steps == 2 * RECORDS_PER_PARTITION and summary.champion == LEARNING
    assert summary.members == ["default", LEARNING]

    client = MlflowClient(config.mlflow.tracking_uri)
    versions = sorted(client.search_model_versions(f"name='{config.mlflow.model_name}'"), key=lambda v: int(v.version))
    served_by = [v.tags.get(CHAMPION_TAG) for v in versions]
    assert served_by[0] == "default" and served_by[-1] == LEARNING  # the first base, then the challenger's
    assert served_by.index(LEARNING) == served_by.count("default")  # no flip back: one switch
    run_id = str(read_manifest(summary.snapshot_path).extra["mlflow_run_id"])
    champion = [m.value for m in sorted(client.get_metric_history(run_id, "champion"), key=lambda m: m.step)]
    assert champion[0] == 0 and champion[-1] == 1
    slug = "kind-lr_wide_lr-0.05_lr-0.003_sparse_lr-0"
    challenger_loss = client.get_metric_history(run_id, f"member/{slug}/window_logloss")[-1].value
    default_loss = client.get_metric_history(run_id, "member/default/window_logloss")[-1].value
    assert challenger_loss < default_loss
    assert client.get_run(run_id).data.tags[CHAMPION_TAG] == LEARNING

    served = registry_fetch(config.mlflow.tracking_uri, config.mlflow.model_name, config.serving, schema)(None)
    assert served is not None and served.version == versions[-1].version
    assert served.manifest.model["kind"] == "lr" and served.manifest.extra["champion"] == LEARNING
    assert Path(summary.served_snapshot_path).parent.parent.name == "challengers"  # the challenger's own snapshot
    assert read_manifest(summary.served_snapshot_path).step == served.manifest.step
