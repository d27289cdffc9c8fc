"""Publish to MLflow (this module only talks to MLflow; trainer/checkpoint.py decides what a round
writes and sends): one run per training job (params, metrics); each base publication as run
artifacts, registered as a new model version and given the serving alias; deltas beside their base.

Layout in the run's artifacts:
    publications/step-NNNNNNNNN/                 a base: manifest, dense and every row's vector
    publications/step-NNNNNNNNN/deltas/SSSSSSSSS/ delta SSSSSSSSS of that base: changed rows only

Deltas are not registry versions (a version every few seconds would flood the registry): serving
finds them by listing the folder of the version it serves. A delta's manifest is uploaded after
its data, so a delta whose manifest is listed is whole; then the version's DELTA_TAG is set to its
sequence, so a serving poll learns "nothing new" from the one registry call it makes anyway.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from trainer.errors import TrainerError
from trainer.settings import MlflowSettings
from trainer.snapshot import DELTA_TAG, MANIFEST, PUBLICATIONS, delta_path, folder_bytes, snapshot_name

log = logging.getLogger("adstream.trainer")
CHAMPION_TAG = "champion"  # a version's tag (and the run's): the member of trainer.challengers it comes from


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
        self.base_path: str | None = None  # artifact path of the base deltas apply to (None: send a base)
        self.base_step = 0  # that base's step
        self.version = ""  # that base's registry version
        self.sequence = 0  # the last delta sent after it
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
            from mlflow.entities import Param

            try:  # one request per 100 settings; stopped meanwhile, the new run ends, never left RUNNING
                every = [Param(k, str(v)[:500]) for k, v in params.items()]
                for at in range(0, len(every), 100):  # MLflow takes at most 100 params a request
                    self.client.log_batch(self.run_id, params=every[at : at + 100])
            except BaseException as exc:
                self.finish("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
                raise

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        clean = [Metric(k, float(v), now, step) for k, v in metrics.items() if not math.isnan(float(v))]
        if clean:
            self.client.log_batch(self.run_id, metrics=clean)

    def publish(self, folder: Path, step: int, recovery_bytes: int = 0, champion: str = "") -> str:
        """Upload a serving publication, register it as a version (tagged with the member it comes
        from, `champion`: trainer/members.py), point the alias at it; log its bytes (and, for
        comparison, the recovery snapshot's). Returns the version."""
        artifact_path = f"{PUBLICATIONS}/{snapshot_name(step)}"
        self.client.log_artifacts(self.run_id, str(folder), artifact_path)
        published = folder_bytes(folder)
        self.log_metrics({"publish_bytes": float(published), "recovery_snapshot_bytes": float(recovery_bytes)}, step)
        name = self.settings.model_name
        if not self._model_exists(name):
            self.client.create_registered_model(name)
        source = f"{self.run.info.artifact_uri}/{artifact_path}"
        tags = {DELTA_TAG: "0", **({CHAMPION_TAG: champion} if champion else {})}
        version = self.client.create_model_version(name, source=source, run_id=self.run_id, tags=tags)
        self.client.set_registered_model_alias(name, self.settings.alias, version.version)
        self.base_path, self.base_step, self.sequence = artifact_path, step, 0
        self.version = str(version.version)
        log.info("published %s version %s (step %d)", name, version.version, step)
        return str(version.version)

    def forget_base(self) -> None:
        """A delta of the current base was lost (not written): no more deltas until the next base."""
        self.base_path = None

    def publish_delta(self, folder: Path, sequence: int, step: int, rows: int) -> None:
        """Upload delta `sequence` of the current base: data first, manifest last. On any failure
        the base is forgotten, so the next publication is a base (serving never sees a gap)."""
        if self.base_path is None or sequence != self.sequence + 1:
            raise TrainerError(f"delta {sequence}: no base to apply it to, or not the next one after {self.sequence}")
        target = f"{self.base_path}/{delta_path(sequence)}"
        try:
            files = sorted(f for f in folder.iterdir() if f.name != MANIFEST)
            for file in [*files, folder / MANIFEST]:
                self.client.log_artifact(self.run_id, str(file), target)
            self.client.set_model_version_tag(self.settings.model_name, self.version, DELTA_TAG, str(sequence))
        except BaseException:
            self.base_path = None
            raise
        self.sequence = sequence
        self.log_metrics({"delta_bytes": float(folder_bytes(folder)), "delta_rows": float(rows)}, step)

    def _model_exists(self, name: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
            return True
        except MlflowException:
            return False

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
