"""Publish to MLflow: one run per training job (params, metrics), each snapshot as run artifacts,
registered as a new model version and given the serving alias."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from trainer.errors import TrainerError
from trainer.settings import MlflowSettings
from trainer.snapshot import folder_bytes, snapshot_name

log = logging.getLogger("adstream.trainer")


class Publisher:
    def __init__(
        self,
        settings: MlflowSettings,
        run_name: str | None = None,
        params: dict[str, object] | None = None,
        run_id: str | None = None,
    ):
        """A new run, or with run_id the run of a job resuming from its snapshot (params kept)."""
        import mlflow
        from mlflow import MlflowClient

        self.settings = settings
        mlflow.set_tracking_uri(settings.tracking_uri)
        self.client = MlflowClient(settings.tracking_uri)
        try:
            experiment = self.client.get_experiment_by_name(settings.experiment)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
            )
        except Exception as exc:  # the MLflow client raises many kinds on a dead server
            raise TrainerError(
                f"mlflow at {settings.tracking_uri}: unreachable ({type(exc).__name__}); start it with `adstream up`"
            ) from None
        if run_id:
            try:
                self.run = self.client.get_run(run_id)
                self.run_id = run_id
                return
            except Exception as exc:  # deleted, or another tracking server: start a new run
                log.warning("mlflow run %s of the snapshot not found (%s); starting a new run", run_id, exc)
        self.run = self.client.create_run(experiment_id, run_name=run_name)
        self.run_id = self.run.info.run_id
        if params:
            for key, value in params.items():
                self.client.log_param(self.run_id, key, str(value)[:500])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        clean = [Metric(k, float(v), now, step) for k, v in metrics.items() if not math.isnan(float(v))]
        if clean:
            self.client.log_batch(self.run_id, metrics=clean)

    def publish(self, folder: Path, step: int, recovery_bytes: int = 0) -> str:
        """Upload a serving publication, register it as a version, point the alias at it; log its
        bytes (and, for comparison, the recovery snapshot's). Returns the version."""
        artifact_path = f"publications/{snapshot_name(step)}"
        self.client.log_artifacts(self.run_id, str(folder), artifact_path)
        published = folder_bytes(folder)
        self.log_metrics({"publish_bytes": float(published), "recovery_snapshot_bytes": float(recovery_bytes)}, step)
        name = self.settings.model_name
        if not self._model_exists(name):
            self.client.create_registered_model(name)
        source = f"{self.run.info.artifact_uri}/{artifact_path}"
        version = self.client.create_model_version(name, source=source, run_id=self.run_id)
        self.client.set_registered_model_alias(name, self.settings.alias, version.version)
        log.info("published %s version %s (step %d)", name, version.version, step)
        return str(version.version)

    def _model_exists(self, name: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
            return True
        except MlflowException:
            return False

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
