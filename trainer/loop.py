"""The training loop: source -> train step -> metrics -> snapshot every n steps or t seconds -> publish.

A thin shell: the work is in step.train_step, snapshot.save_snapshot and publish.Publisher.
Offsets are committed to Kafka only after the snapshot that holds them is published.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge, start_http_server

from store.hierarchy import HierarchyConfig, TieredStore
from store.ram import RamTier
from store.table import EmbeddingTable, TableConfig
from store.tier import Tier
from stream.schema import Schema
from stream.settings import KafkaSettings
from trainer.batch import Batch
from trainer.errors import TrainerError
from trainer.metrics import ProgressiveMetrics
from trainer.model import DeepFM, ModelConfig
from trainer.settings import MlflowSettings, TrainerSettings
from trainer.snapshot import Manifest, save_snapshot
from trainer.step import train_step

log = logging.getLogger("adstream.trainer")
STEPS = Counter("adstream_trainer_steps_total", "train steps")
SAMPLES = Counter("adstream_trainer_samples_total", "events learned")
AUC = Gauge("adstream_trainer_progressive_auc", "cumulative progressive AUC")
WINDOW_AUC = Gauge("adstream_trainer_window_auc", "sliding-window progressive AUC")
STORE = Gauge("adstream_trainer_store", "embedding store statistics (hit rates, evictions, bytes...)", ["stat"])


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    events: int
    batches_built: int  # stream batches (Kafka records) consumed
    progressive_auc: float
    progressive_logloss: float
    window_auc: float
    window_logloss: float
    model_version: str | None
    snapshot_path: str | None
    samples_per_s: float


def make_tier(settings: TrainerSettings, width: int) -> Tier:
    """The embedding store the settings ask for."""
    if settings.store == "ram":
        return RamTier(width, settings.ram_bytes)
    if settings.store == "tiered":
        config = HierarchyConfig(
            device_bytes=settings.device_bytes,
            ram_bytes=settings.ram_bytes,
            disk_bytes=settings.disk_bytes,
            path=settings.store_path,
            device=settings.device,
            policy=settings.eviction,
            ttl_steps=settings.ttl_steps,
        )
        return TieredStore(width, config)
    raise TrainerError(f"trainer.store={settings.store!r}; use 'ram' or 'tiered'")


class Trainer:
    """One trainer replica: dense DeepFM + Adam, embedding rows in the store, progressive metrics."""

    def __init__(self, schema: Schema, settings: TrainerSettings) -> None:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.schema = schema
        self.settings = settings
        self.model_config = ModelConfig(
            schema.num_sparse, schema.num_dense, settings.embed_dim, tuple(settings.hidden), settings.seed
        )
        self.device = torch.device(settings.device)
        self.model = DeepFM(self.model_config).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=settings.lr)
        self.table_config = TableConfig(
            dim=self.model_config.row_dim, seed=settings.seed, lr=settings.sparse_lr, min_count=settings.min_count
        )
        self.table = EmbeddingTable(make_tier(settings, 3 * self.table_config.dim), self.table_config)
        self.metrics = ProgressiveMetrics(window=settings.metrics_window)
        self.step = 0
        self.events = 0
        self.offsets: dict[int, int] = {}
        self.train_seconds = 0.0  # time spent in learn(), for samples/s

    def learn(self, batch: Batch) -> None:
        started = time.perf_counter()
        self.step += 1
        result = train_step(self.model, self.optimizer, self.table, batch.to(self.device), self.step)
        self.metrics.update(batch.labels.numpy(), result.probs)
        self.events += len(batch)
        self.offsets.update(batch.source_offsets)
        STEPS.inc()
        SAMPLES.inc(len(batch))
        self.train_seconds += time.perf_counter() - started

    def manifest(self) -> Manifest:
        return Manifest(
            schema_name=self.schema.name,
            schema_hash=self.schema.hash,
            model=self.model_config.to_dict(),
            table=asdict(self.table_config),
            step=self.step,
            events=self.events,
            offsets={str(p): o for p, o in sorted(self.offsets.items())},
            metrics=self.metrics.summary(),
            created_ms=int(time.time() * 1000),
        )

    def save(self, root: str | Path) -> Path:
        return save_snapshot(
            Path(root) / f"step-{self.step:09d}", self.manifest(), self.model, self.table, self.optimizer
        )


def run_training(
    schema: Schema,
    kafka: KafkaSettings,
    settings: TrainerSettings,
    mlflow: MlflowSettings,
    max_steps: int | None = None,
    max_events: int | None = None,
    idle_exit_s: float | None = None,
    progress: bool = True,
) -> TrainSummary:
    """Train from the batches topic until a stop condition; snapshot + publish on the way and at the end."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from trainer.publish import Publisher
    from trainer.source import BatchSource

    if settings.metrics_port:
        start_http_server(settings.metrics_port)
    if settings.device.startswith("cuda"):  # run on the CPUs (and so the memory) of this GPU's NUMA node
        from store.placement import make_plan, pin_to
        from store.topology import discover

        gpu = torch.device(settings.device).index or 0
        placement = next((p for p in make_plan(discover()).placements if p.gpu == gpu), None)
        if placement is not None:
            log.info("GPU%d: pinned to NUMA node %d, CPUs %s", gpu, placement.numa, pin_to(placement))
    trainer = Trainer(schema, settings)
    publisher = Publisher(mlflow, params={**asdict(settings), "schema_hash": schema.hash, "max_events": max_events})
    source = BatchSource(kafka, settings.group_id, schema.hash)
    version: str | None = None
    snapshot_path: Path | None = None
    last_snapshot_step, last_snapshot_t = 0, time.monotonic()
    batches_built = 0
    idle_since = time.monotonic()

    def snapshot() -> None:
        nonlocal version, snapshot_path, last_snapshot_step, last_snapshot_t
        snapshot_path = trainer.save(settings.snapshot_dir)
        version = publisher.publish_snapshot(snapshot_path, trainer.step)
        source.commit(trainer.offsets)  # only after the snapshot holding them is durable
        last_snapshot_step, last_snapshot_t = trainer.step, time.monotonic()

    bar = Progress(TextColumn("train"), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), disable=not progress)
    try:
        with bar:
            task = bar.add_task("train", info="waiting for batches")
            for batch in source.batches(settings.batch_size, idle_s=1.0):
                if batch is None:
                    if idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                        break
                    continue
                idle_since = time.monotonic()
                batches_built += batch.parts
                trainer.learn(batch)
                if trainer.step % settings.log_every_steps == 0:
                    summary = trainer.metrics.summary()
                    AUC.set(summary["progressive_auc"])
                    WINDOW_AUC.set(summary["window_auc"])
                    rate = trainer.events / trainer.train_seconds
                    store_stats = {f"store_{k}": v for k, v in trainer.table.stats().items()}
                    for key, value in store_stats.items():
                        STORE.labels(key).set(value)
                    publisher.log_metrics({**summary, **store_stats, "samples_per_s": rate}, trainer.step)
                    bar.update(
                        task, info=f"step {trainer.step} events {trainer.events} auc {summary['progressive_auc']:.4f}"
                    )
                due_steps = trainer.step - last_snapshot_step >= settings.snapshot_every_steps
                due_time = time.monotonic() - last_snapshot_t >= settings.snapshot_every_s
                if due_steps or due_time:
                    snapshot()
                if (max_steps and trainer.step >= max_steps) or (max_events and trainer.events >= max_events):
                    break
        if trainer.step > last_snapshot_step:
            snapshot()
        summary = trainer.metrics.summary()
        rate = trainer.events / trainer.train_seconds if trainer.train_seconds else 0.0
        publisher.log_metrics({**summary, "samples_per_s": rate}, trainer.step)
        publisher.finish()
    except BaseException:
        publisher.finish("FAILED")
        raise
    finally:
        source.close()
    return TrainSummary(
        steps=trainer.step,
        events=trainer.events,
        batches_built=batches_built,
        progressive_auc=summary["progressive_auc"],
        progressive_logloss=summary["progressive_logloss"],
        window_auc=summary["window_auc"],
        window_logloss=summary["window_logloss"],
        model_version=version,
        snapshot_path=str(snapshot_path) if snapshot_path else None,
        samples_per_s=rate,
    )
