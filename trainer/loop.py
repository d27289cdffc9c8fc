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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from common.checks import flat_fields
from stream.kafka.prometheus import serve_metrics
from stream.kafka.settings import KafkaSettings
from stream.schema import Schema
from trainer.champion import challenger_settings
from trainer.configs import store_path
from trainer.group import Control, in_group, local_gpu
from trainer.members import Members
from trainer.metrics import merged_summary
from trainer.schedule import Round, Schedule, decide
from trainer.settings import MlflowSettings, TrainerSettings
from trainer.snapshot import check_writable

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
    samples_per_s: float  # this run's events over the time every member spent learning and merging (as MLflow's)
    workers: int = 1
    merges: int = 0
    merge_bytes: int = 0  # payload all replicas sent to merge (or to sync, when merge_every_steps = 0)
    resumed_from: str | None = None
    champion: str = "default"  # the member served at the end (trainer.challengers)
    # the recovery snapshot of the member whose publication is served (snapshot_path when that is the default)
    served_snapshot_path: str | None = None
    members: list[str] = field(default_factory=list)  # the members still learning at the end (the budget's)


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
    """One replica's loop: every round it takes at most one batch, the group agrees on what to do
    (schedule.decide) and every replica does it, until the schedule says stop."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from trainer.source import BatchSource, LearnLog

    _prepare_process(settings, rank)
    control = Control(world)
    members = Members(schema, settings)  # the trainer's own configuration and its challengers
    trainer = members.main
    resumed, state, run_id = members.resume(rank, world)
    source = BatchSource(
        kafka, settings.group_id, schema.hash, rank, world, start_offsets=trainer.offsets, start_marks=trainer.marks
    )
    learn_log = LearnLog(settings.learn_log, rank)
    schedule = Schedule(
        world, settings.group.merge_every_steps, settings.snapshot.every_steps, settings.log_every_steps,
        max_steps, max_events,
    )  # fmt: skip
    now = time.monotonic()
    clocks = _Clocks(last_merge=now, last_snapshot=now, last_publish=now, idle_since=now)
    out = _Outcome(start_events=state.events, resumed=resumed)
    bar = Progress(TextColumn("train"), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), disable=not progress)
    batches = source.batches(settings.batch_size, idle_s=settings.idle_s)
    if members.prefetches:
        batches = one_ahead(batches, members)
    # the MLflow run opens last, right before the loop that ends it (FINISHED, KILLED or FAILED)
    publisher = _open_run(schema, settings, mlflow, world, max_events, run_id) if rank == 0 else None
    try:
        with bar:
            task = bar.add_task("train", info="waiting for batches")
            while True:
                batch = next(batches)
                mine = clocks.round_vector(batch, members, settings, publisher, idle_exit_s, rank == 0)
                state, act = decide(state, Round.from_sum(control.sum(mine)), schedule)
                if act.learn:
                    out.batches_built += _learn(members, batch, learn_log)
                if act.merge:
                    _merge(members)
                if act.sync:
                    clocks.last_merge = time.monotonic()
                if act.snapshot:
                    out.snapshot_path, out.version = members.snapshot_round(control, publisher, source, state.events)
                    clocks.last_snapshot = clocks.last_publish = time.monotonic()
                if act.publish:
                    members.delta_round(control, publisher, state.events)
                    clocks.last_publish = time.monotonic()
                if act.report:
                    # a new champion: the next publication is its base, never a delta of the old one's
                    # (no snapshot forced: its merge would be a sync point no step count decides)
                    if members.review(control, state.events, publisher) and publisher is not None:
                        publisher.forget_base()
                    out.merged = _report(members, control, publisher, source.replayed)
                    auc = out.merged["progressive_auc"]
                    info = f"step {trainer.step} events {state.events} auc {auc:.4f} serving {members.champion.slug}"
                    bar.update(task, info=info)
                if act.stop:
                    break
        out.merged = _report(members, control, publisher, source.replayed)
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
    return out.summary(members, control, state.events)


@dataclass
class _Clocks:
    """When rank 0 last merged, snapshotted and published, and when this replica last had a batch
    (monotonic seconds): what a round's control vector says is due."""

    last_merge: float
    last_snapshot: float
    last_publish: float
    idle_since: float

    def round_vector(
        self,
        batch: Batch | None,
        members: Members,
        settings: TrainerSettings,
        publisher: Publisher | None,
        idle_exit_s: float | None,
        leader: bool,
    ) -> list[float]:
        """This replica's part of the round's control vector (schedule.Round); only rank 0's clocks
        say a merge, a snapshot or a delta is due."""
        now = time.monotonic()
        if batch is not None:
            self.idle_since = now
        else:
            members.idle()
        publish_due = leader and 0 < settings.snapshot.publish_every_s <= now - self.last_publish
        no_base = publisher is not None and publisher.base_path is None  # a delta needs a base first
        return Round.vector(
            events=len(batch) if batch is not None else None,
            idle=idle_exit_s is not None and now - self.idle_since >= idle_exit_s,
            merge_due=leader and 0 < settings.group.merge_every_s <= now - self.last_merge,
            snapshot_due=leader and (now - self.last_snapshot >= settings.snapshot.every_s or publish_due and no_base),
            publish_due=publish_due,
        )


@dataclass
class _Outcome:
    """What the loop ends with, filled as it goes."""

    start_events: int
    resumed: Path | None
    batches_built: int = 0
    version: str | None = None
    snapshot_path: Path | None = None
    merged: dict[str, float] = field(default_factory=dict)

    def summary(self, members: Members, control: Control, events: int) -> TrainSummary:
        trainer = members.main
        # every member's learning and merging (trainer.challengers): not start-up, waiting or an idle exit
        learning = members.learn_seconds + members.merge_seconds
        window = trainer.metrics.summary()
        return TrainSummary(
            steps=trainer.step,
            events=events,
            batches_built=self.batches_built,
            progressive_auc=self.merged["progressive_auc"],
            progressive_logloss=self.merged["progressive_logloss"],
            window_auc=window["window_auc"],
            window_logloss=window["window_logloss"],
            model_version=self.version,
            snapshot_path=str(self.snapshot_path) if self.snapshot_path else None,
            samples_per_s=(events - self.start_events) / learning if learning else 0.0,
            workers=control.world,
            merges=trainer.merges,
            merge_bytes=int(sum(control.gather(trainer.bytes_sent))),
            resumed_from=str(self.resumed) if self.resumed else None,
            champion=members.champion.name,
            served_snapshot_path=str(members.served_snapshot) if members.served_snapshot else None,
            members=[m.name for m in members.members],
        )


def _open_run(
    schema: Schema,
    settings: TrainerSettings,
    mlflow: MlflowSettings,
    world: int,
    max_events: int | None,
    run_id: str | None,
) -> Publisher:
    """Rank 0's MLflow run (a resumed job's own run again), its parameters every setting."""
    from trainer.publish import Publisher

    params = {
        **flat_fields(settings),
        "schema_hash": schema.hash,
        "max_events": max_events,
        "workers": world,
        "metrics_labels": METRICS_LABELS[settings.optim.delayed_feedback],
    }
    return Publisher(mlflow, params=params, run_id=run_id)


def one_ahead(batches: Iterator[Batch | None], members: Members) -> Iterator[Batch | None]:
    """The source's batches, each handed out once the next one is in hand and announced
    (Members.prefetch), so its cold rows are read from RocksDB while this one trains. Costs one
    batch of latency; recovery is unaffected (snapshots hold the offsets of what was learned, not
    of what was read)."""
    end = object()
    current = next(batches, end)
    while current is not end:
        upcoming = next(batches, end)
        if upcoming is not None and upcoming is not end:
            members.prefetch(upcoming)  # type: ignore[arg-type]
        yield current  # type: ignore[misc]
        current = upcoming


def _learn(members: Members, batch: Batch | None, learn_log: LearnLog) -> int:
    """This replica's part of a learning round (every member's); returns the stream batches it learned."""
    members.learn_round(batch)
    if batch is None:
        return 0
    learn_log.write(batch, members.main.step)
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
        every = [settings, *(challenger_settings(settings, text, i) for i, text in enumerate(settings.challengers))]
        for member in every:
            shutil.rmtree(store_path(member, rank), ignore_errors=True)


def _pin_to_gpu_numa_node(device: str) -> None:
    """Run on the CPUs (and so the memory) of this GPU's NUMA node."""
    from store.placement import make_plan, pin_to
    from store.topology import discover

    gpu = local_gpu(device)
    placement = next((p for p in make_plan(discover()).placements if p.gpu == gpu), None)
    if placement is not None:
        log.info("GPU%d: pinned to NUMA node %d, CPUs %s", gpu, placement.numa, pin_to(placement))


def _merge(members: Members) -> None:
    trainer = members.main
    stats = members.merge()
    if stats.rows or stats.dense_bytes:
        log.info("merge at step %d: %d rows, %d bytes, %.3fs", trainer.step, stats.rows, stats.bytes, stats.seconds)


def _report(members: Members, control: Control, publisher: Publisher | None, replayed: int = 0) -> dict[str, float]:
    """Metrics to Prometheus (every replica) and MLflow (rank 0), every member's too; `replayed`:
    the events this replica's source dropped as written twice (trainer/replayed.py). Returns the
    merged summary of the default member."""
    trainer = members.main
    of_members = members.metrics(control) if len(members.names) > 1 else {}
    merged = merged_summary(trainer.metrics)
    mine = {
        **trainer.metrics.summary(),
        "samples_per_s": trainer.events / members.learn_seconds if members.learn_seconds else 0.0,  # every member's
        "merge_bytes": float(trainer.bytes_sent),
        "merge_seconds": trainer.merge_seconds,
        "replayed_events": float(replayed),
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
        metrics = {**mine, **merged, **store_stats, **of_members, "merges": float(trainer.merges)}
        metrics["merge_bytes"] = sum(m["merge_bytes"] for m in everyone)
        metrics["replayed_events"] = sum(m["replayed_events"] for m in everyone)  # since this start
        if control.world > 1:
            metrics.update({f"rank{r}_{key}": value for r, m in enumerate(everyone) for key, value in m.items()})
        publisher.log_metrics(metrics, trainer.step)
    return merged
