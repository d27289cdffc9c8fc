"""The training loop of one replica: source -> step -> merge every k steps -> snapshot -> publish.

Replicas of a group move in rounds. Each round every replica takes at most one batch from its
partitions, then all of them add up a small control vector (who has a batch, events, who is
idle, whether rank 0's clocks say a merge, a snapshot or a delta is due), so every decision
(learn, merge, snapshot, publish a delta, log, stop) is taken by all replicas at the same round
and collectives never deadlock.
Those decisions are one pure function, schedule.decide, which `bench merge` follows too.
A lone trainer runs the same loop with a group of one.

Recovery: on start the newest complete snapshot is restored (model, Adam state, rows, offsets)
and each replica seeks its partitions to the snapshot's offsets; offsets are committed to Kafka
only after the snapshot holding them is durable. Snapshots are taken right after a merge, when
every replica holds the same model, so rank 0 writes the one copy. Each snapshot is also a base
publication for serving; between them rank 0 sends deltas (trainer/publish.py).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from common.checks import flat_fields
from stream.prometheus import serve_metrics
from stream.schema import Schema
from stream.settings import KafkaSettings
from trainer.configs import store_path
from trainer.group import Control, in_group, local_gpu
from trainer.metrics import ProgressiveMetrics, merged_summary
from trainer.replica import Trainer
from trainer.rounds import send_delta, take_snapshot
from trainer.schedule import LoopState, Round, Schedule, decide
from trainer.settings import MlflowSettings, TrainerSettings
from trainer.snapshot import check_writable, latest_snapshot

if TYPE_CHECKING:
    from trainer.batch import Batch
    from trainer.publish import Publisher
    from trainer.source import LearnLog

log = logging.getLogger("adstream.trainer")
AUC = Gauge("adstream_trainer_progressive_auc", "cumulative progressive AUC over every replica")
WINDOW_AUC = Gauge("adstream_trainer_window_auc", "sliding-window progressive AUC of this replica")
CALIBRATION = Gauge(
    "adstream_trainer_calibration",
    "progressive calibration over every replica: ece (10 bins), mean_ctr (predicted), observed_ctr",
    ["stat"],
)
STORE = Gauge("adstream_trainer_store", "embedding store statistics (hit rates, evictions, bytes...)", ["stat"])


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    events: int  # events learned by the whole job, including before a resumed snapshot
    batches_built: int  # stream batches (Kafka records) this replica consumed
    progressive_auc: float  # over every replica's predictions
    progressive_logloss: float
    window_auc: float  # this replica's sliding window
    window_logloss: float
    model_version: str | None
    snapshot_path: str | None
    samples_per_s: float  # this run's events over the time spent learning and merging (as MLflow's figure)
    workers: int = 1
    merges: int = 0
    merge_bytes: int = 0  # payload all replicas sent to merge (or to sync, when merge_every_steps = 0)
    resumed_from: str | None = None


# which labels the progressive metrics score, as a run parameter in MLflow
METRICS_LABELS = {
    "none": "the labels as they arrive (final labels: the joiner's window policy, or labelled logs)",
    "fnw": "final labels: each impression once, its first prediction against its label trainer.label_wait_s later",
    "fnc": "final labels: each impression once, its first prediction against its label trainer.label_wait_s later",
}


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
    """Train from the batches topic until a stop condition; merge, snapshot and publish on the way
    and at the end. Joins the process group the environment describes (see group.py)."""
    return in_group(
        settings.device,
        lambda rank, world: _run(
            schema, kafka, settings, mlflow, rank, world, max_steps, max_events, idle_exit_s, progress
        ),
    )


def _run(
    schema: Schema,
    kafka: KafkaSettings,
    settings: TrainerSettings,
    mlflow: MlflowSettings,
    rank: int,
    world: int,
    max_steps: int | None,
    max_events: int | None,
    idle_exit_s: float | None,
    progress: bool,
) -> TrainSummary:
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from trainer.publish import Publisher
    from trainer.source import BatchSource, LearnLog

    _prepare_process(settings, rank)
    control = Control(world)
    trainer = Trainer(schema, settings)
    resumed, state, run_id = _resume(trainer, settings, rank)
    source = BatchSource(kafka, settings.group_id, schema.hash, rank, world, start_offsets=trainer.offsets)
    learn_log = LearnLog(settings.learn_log, rank)
    k = settings.group.merge_every_steps
    schedule = Schedule(world, k, settings.snapshot.every_steps, settings.log_every_steps, max_steps, max_events)
    version: str | None = None
    snapshot_path: Path | None = None
    batches_built = 0
    last_merge_t = last_snapshot_t = last_publish_t = idle_since = time.monotonic()
    start_events = state.events
    merged: dict[str, float] = {}
    bar = Progress(TextColumn("train"), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), disable=not progress)
    batches = source.batches(settings.batch_size, idle_s=settings.idle_s)
    if trainer.prefetches:
        batches = one_ahead(batches, trainer)
    # the MLflow run opens last, right before the loop that ends it (FINISHED, KILLED or FAILED)
    publisher = None
    if rank == 0:
        params = {
            **flat_fields(settings),
            "schema_hash": schema.hash,
            "max_events": max_events,
            "workers": world,
            "metrics_labels": METRICS_LABELS[settings.optim.delayed_feedback],
        }
        publisher = Publisher(mlflow, params=params, run_id=run_id)
    try:
        with bar:
            task = bar.add_task("train", info="waiting for batches")
            while True:
                batch = next(batches)
                now = time.monotonic()
                if batch is not None:
                    idle_since = now
                else:
                    trainer.idle()
                publish_due = rank == 0 and 0 < settings.snapshot.publish_every_s <= now - last_publish_t
                no_base = publisher is not None and publisher.base_path is None  # a delta needs a base first
                mine = Round.vector(
                    events=len(batch) if batch is not None else None,
                    idle=idle_exit_s is not None and now - idle_since >= idle_exit_s,
                    merge_due=rank == 0 and 0 < settings.group.merge_every_s <= now - last_merge_t,
                    snapshot_due=rank == 0
                    and (now - last_snapshot_t >= settings.snapshot.every_s or publish_due and no_base),
                    publish_due=publish_due,
                )
                state, act = decide(state, Round.from_sum(control.sum(mine)), schedule)
                if act.learn:
                    batches_built += _learn(trainer, batch, k, learn_log)
                if act.merge:
                    _merge(trainer)
                if act.sync:
                    last_merge_t = time.monotonic()
                if act.snapshot:
                    snapshot_path, version = take_snapshot(trainer, control, publisher, source, settings, state.events)
                    last_snapshot_t = last_publish_t = time.monotonic()
                if act.publish:
                    send_delta(trainer, control, publisher, settings, state.events)
                    last_publish_t = time.monotonic()
                if act.report:
                    merged = _report(trainer, control, publisher)
                    info = f"step {trainer.step} events {state.events} auc {merged['progressive_auc']:.4f}"
                    bar.update(task, info=info)
                if act.stop:
                    break
        merged = _report(trainer, control, publisher)
        if publisher is not None:
            publisher.finish()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (cli: cmd_train): stopped by its operator
        if publisher is not None:
            publisher.finish("KILLED")
        raise
    except BaseException:
        if publisher is not None:
            publisher.finish("FAILED")
        raise
    finally:
        source.close()
        learn_log.close()
    learning = trainer.train_seconds + trainer.merge_seconds  # not start-up, waiting or an idle exit
    window = trainer.metrics.summary()
    return TrainSummary(
        steps=trainer.step,
        events=state.events,
        batches_built=batches_built,
        progressive_auc=merged["progressive_auc"],
        progressive_logloss=merged["progressive_logloss"],
        window_auc=window["window_auc"],
        window_logloss=window["window_logloss"],
        model_version=version,
        snapshot_path=str(snapshot_path) if snapshot_path else None,
        samples_per_s=(state.events - start_events) / learning if learning else 0.0,
        workers=world,
        merges=trainer.merges,
        merge_bytes=int(sum(control.gather(trainer.bytes_sent))),
        resumed_from=str(resumed) if resumed else None,
    )


def one_ahead(batches: Iterator[Batch | None], trainer: Trainer) -> Iterator[Batch | None]:
    """The source's batches, each handed out once the next one is in hand and announced
    (Trainer.prefetch), so its cold rows are read from RocksDB while this one trains. Costs one
    batch of latency; recovery is unaffected (snapshots hold the offsets of what was learned, not
    of what was read)."""
    end = object()
    current = next(batches, end)
    while current is not end:
        upcoming = next(batches, end)
        if upcoming is not None and upcoming is not end:
            trainer.prefetch(upcoming)  # type: ignore[arg-type]
        yield current  # type: ignore[misc]
        current = upcoming


def _learn(trainer: Trainer, batch: Batch | None, k: int, learn_log: LearnLog) -> int:
    """This replica's part of a learning round; returns the stream batches it learned."""
    trainer.learn_round(batch, k)
    if batch is None:
        return 0
    learn_log.write(batch, trainer.step)
    return batch.parts


def _prepare_process(settings: TrainerSettings, rank: int) -> None:
    """Metrics endpoint, NUMA pinning, and a clean RocksDB folder (the snapshot is the truth; rows
    on disk may be newer than it)."""
    check_writable(settings.snapshot.dir)
    port = settings.metrics_port + rank if settings.metrics_port else 0
    serve_metrics(port, settings.metrics_host, "trainer.metrics_port")
    if settings.device.startswith("cuda"):
        _pin_to_gpu_numa_node(settings.device)
    if settings.store.kind == "tiered":
        shutil.rmtree(store_path(settings, rank), ignore_errors=True)


def _resume(trainer: Trainer, settings: TrainerSettings, rank: int) -> tuple[Path | None, LoopState, str | None]:
    """Restore the newest complete snapshot, if any: (its path, the loop's counters, its MLflow run)."""
    resumed = latest_snapshot(settings.snapshot.dir)
    if resumed is None:
        return None, LoopState(), None
    manifest = trainer.restore(resumed)
    if rank != 0:  # rank 0 carries the job's counts (events, the metrics' sums): the others add from zero
        trainer.events = 0
        trainer.metrics = ProgressiveMetrics(window=settings.metrics_window)
    log.warning("replica %d resumes from %s (step %d)", rank, resumed, trainer.step)
    return resumed, LoopState(events=manifest.events), str(manifest.extra.get("mlflow_run_id") or "") or None


def _pin_to_gpu_numa_node(device: str) -> None:
    """Run on the CPUs (and so the memory) of this GPU's NUMA node."""
    from store.placement import make_plan, pin_to
    from store.topology import discover

    gpu = local_gpu(device)
    placement = next((p for p in make_plan(discover()).placements if p.gpu == gpu), None)
    if placement is not None:
        log.info("GPU%d: pinned to NUMA node %d, CPUs %s", gpu, placement.numa, pin_to(placement))


def _merge(trainer: Trainer) -> None:
    stats = trainer.merge()
    if stats.rows or stats.dense_bytes:
        log.info("merge at step %d: %d rows, %d bytes, %.3fs", trainer.step, stats.rows, stats.bytes, stats.seconds)


def _report(trainer: Trainer, control: Control, publisher: Publisher | None) -> dict[str, float]:
    """Metrics to Prometheus (every replica) and MLflow (rank 0). Returns the merged summary."""
    merged = merged_summary(trainer.metrics)
    mine = {
        **trainer.metrics.summary(),
        "samples_per_s": trainer.events / trainer.train_seconds if trainer.train_seconds else 0.0,
        "merge_bytes": float(trainer.bytes_sent),
        "merge_seconds": trainer.merge_seconds,
    }
    everyone = control.gather(mine)
    AUC.set(merged["progressive_auc"])
    WINDOW_AUC.set(mine["window_auc"])
    for stat in ("ece", "mean_ctr", "observed_ctr"):
        CALIBRATION.labels(stat).set(merged[f"progressive_{stat}"])
    store_stats = {f"store_{key}": value for key, value in trainer.table.stats().items()}
    for key, value in store_stats.items():
        STORE.labels(key).set(value)
    if publisher is not None:
        metrics = {**mine, **merged, **store_stats, "merges": float(trainer.merges)}
        metrics["merge_bytes"] = sum(m["merge_bytes"] for m in everyone)
        if control.world > 1:
            metrics.update({f"rank{r}_{key}": value for r, m in enumerate(everyone) for key, value in m.items()})
        publisher.log_metrics(metrics, trainer.step)
    return merged
