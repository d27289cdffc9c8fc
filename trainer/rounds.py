"""What the training loop does at a snapshot round and at a publish round, as a group.

    take_snapshot: every replica's offsets gathered -> rank 0 (with sharded rows, its node) writes
                   the recovery snapshot and the serving publication (trainer/snapshot.py), the
                   Publisher uploads and registers it (trainer/publish.py); every replica then
                   commits its offsets, once the snapshot is durable
    send_delta:    the rows changed since the last publication and the dense weights -> the next
                   delta of the current base

Both are collectives (every replica calls them at the same round, trainer/schedule.py says when).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.metrics import merged_metrics
from trainer.snapshot import folder_bytes, prune_snapshots

if TYPE_CHECKING:
    from trainer.group import Control
    from trainer.publish import Publisher
    from trainer.replica import Trainer
    from trainer.settings import TrainerSettings
    from trainer.source import BatchSource

log = logging.getLogger("adstream.trainer")


def take_snapshot(
    trainer: Trainer,
    control: Control,
    publisher: Publisher | None,
    source: BatchSource,
    settings: TrainerSettings,
    events: int,
) -> tuple[Path | None, str | None]:
    """Rank 0 writes the recovery snapshot (kept on disk) and the serving publication (vectors only,
    uploaded and registered); the replicas hold the same model right after a merge. With sharded
    rows every rank of rank 0's node writes its own rows' file of both. Every replica then commits
    its offsets. Returns (recovery snapshot path, registry version) on rank 0."""
    if trainer.compressor is not None:  # the compression's state, the same on every replica (trainer/compress.py)
        trainer.compressor.share_errors()
    offsets: dict[int, int] = {}
    for part in control.gather(trainer.offsets):  # replicas read disjoint partitions
        offsets.update(part)
    trainer.newest_event_ms = max(control.gather(trainer.newest_event_ms))  # the group's freshest event
    trainer.table.take_changed()  # a base holds every row: deltas start again from here
    counted = merged_metrics(trainer.metrics)  # every replica's counts: what the resumed job reports on from
    path = version = None
    if trainer.writes_snapshots:
        extra: dict[str, object] = {"workers": control.world, "merge_every_steps": settings.group.merge_every_steps}
        if publisher is not None:
            extra["mlflow_run_id"] = publisher.run_id
        manifest = trainer.manifest(offsets, extra, events, counted.summary())  # one manifest for both artifacts
        path = trainer.save(settings.snapshot.dir, manifest=manifest, metrics=counted)  # sharded: the node's collective
        publication = trainer.publish_to(Path(settings.snapshot.dir) / "publications", manifest)
        if publisher is not None and path is not None and publication is not None:
            version = publisher.publish(publication, trainer.step, recovery_bytes=folder_bytes(path))
            shutil.rmtree(publication, ignore_errors=True)  # uploaded; the recovery snapshot stays
    else:
        trainer.table.expire_cold()  # as save does on the writers: every replica drops its TTL-expired rows
    control.barrier()  # the snapshot is durable before any replica commits its offsets
    source.commit(offsets)
    if path is not None:  # rank 0: the older recovery snapshots are no longer needed
        prune_snapshots(settings.snapshot.dir, settings.snapshot.keep)
    return path, version


def send_delta(
    trainer: Trainer, control: Control, publisher: Publisher | None, settings: TrainerSettings, events: int
) -> None:
    """Rank 0 sends serving the rows changed since the last publication and the dense weights, as
    the next delta of the current base (replicas hold the same model right after the merge). A
    failed upload is logged, not fatal: the next publication is then a base."""
    changed = trainer.table.take_changed()  # every replica: what changed since the last publication
    trainer.newest_event_ms = max(control.gather(trainer.newest_event_ms))
    changes = trainer.changes(changed)  # with sharded rows: every rank's, on rank 0 (a collective)
    group_metrics = merged_metrics(trainer.metrics).summary()  # a collective: the group's figures, as a base has them
    if publisher is None or publisher.base_path is None or changes is None:
        return
    table, changed = changes
    extra = {"mlflow_run_id": publisher.run_id, "workers": control.world}
    manifest = replace(
        trainer.manifest(extra=extra, events=events, metrics=group_metrics),
        base_step=publisher.base_step,
        sequence=publisher.sequence + 1,
    )
    try:
        folder = trainer.publish_delta_to(Path(settings.snapshot.dir) / "deltas", manifest, changed, table)
    except OSError as exc:  # a full disk: this delta is lost, so the next publication is a base
        publisher.forget_base()
        shutil.rmtree(Path(settings.snapshot.dir) / "deltas", ignore_errors=True)
        log.error(
            "delta %d of base step %d not written (%s: %s); free space under trainer.snapshot.dir=%s; the "
            "next publication is a base",
            manifest.sequence,
            manifest.base_step,
            exc.strerror or exc,
            exc.filename,
            settings.snapshot.dir,
        )
        return
    try:
        publisher.publish_delta(folder, manifest.sequence, trainer.step, len(changed))
    except Exception as exc:  # MLflow unreachable for a moment: the next publication is a base
        log.error(
            "delta %d of base step %d not published (%s); the next publication is a base",
            manifest.sequence,
            manifest.base_step,
            exc,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
