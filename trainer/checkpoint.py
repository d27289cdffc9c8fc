"""The replica's snapshot files and the group's rounds that write them (trainer/snapshot.py has the
formats; trainer/publish.py the MLflow side).

    save / restore       a recovery snapshot: the whole trainer state, kept on the trainer's disk
    publish_to           a base publication for serving: dense weights + every row's vector
    publish_delta_to     a delta: the dense weights + the rows changed since the last publication
    base_round           as a group: rank 0 (with sharded rows, its node) writes the recovery
                         snapshot and, for the member that serves, the base publication, which the
                         Publisher uploads and registers (trainer/members.py gathers the offsets
                         first and commits them once every member's snapshot is durable)
    delta_round          as a group: the next delta of the current base, sent by rank 0

The rounds are collectives (every replica calls them at the same round; trainer/schedule.py says
when), taken right after a merge, when every replica holds the same model.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from store.table import EmbeddingTable
from trainer.errors import SnapshotError
from trainer.metrics import ProgressiveMetrics, merged_metrics
from trainer.replica import Replica
from trainer.snapshot import (
    DELTAS,
    MANIFEST,
    PUBLICATIONS,
    Manifest,
    finish_snapshot,
    folder_bytes,
    load_optimizer_state,
    load_snapshot,
    prune_snapshots,
    publication_manifest,
    read_metrics,
    save_delta,
    snapshot_name,
    write_rows,
)

if TYPE_CHECKING:
    from trainer.group import Control
    from trainer.publish import Publisher

log = logging.getLogger("adstream.trainer")


class Checkpointer:
    """Writes and reads one replica's snapshots and publications (`Trainer.checkpoints`)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def manifest(
        self,
        offsets: dict[int, int] | None = None,
        extra: dict[str, object] | None = None,
        events: int | None = None,
        metrics: dict[str, float] | None = None,
        marks: dict[int, int] | None = None,
    ) -> Manifest:
        """The replica's state as a manifest; a group passes every replica's offsets and marks, the
        job's events and the group's metrics (metrics.merged_metrics)."""
        r = self.replica
        offsets = r.offsets if offsets is None else offsets
        marks = r.marks if marks is None else marks
        return Manifest(
            schema_name=r.schema.name,
            schema_hash=r.schema.hash,
            model=r.model_config.to_dict(),
            table=r.table_config.to_dict(),
            step=r.step,
            events=r.events if events is None else events,
            offsets={str(p): o for p, o in sorted(offsets.items())},
            metrics=r.metrics.summary() if metrics is None else metrics,
            created_ms=int(time.time() * 1000),
            extra=dict(extra or {}),
            newest_event_ms=r.newest_event_ms,
            marks={str(p): key for p, key in sorted(marks.items())},
        )

    @property
    def writes(self) -> bool:
        """Whether this replica takes part in writing snapshots and base publications: rank 0, and
        with sharded rows every rank of its node (each writes its own rows' file). Replicas and
        the other nodes hold the same rows right after a merge."""
        r = self.replica
        return r.rank == 0 or (r.sharded and r.shards.writes_files())

    def save(
        self,
        root: str | Path,
        offsets: dict[int, int] | None = None,
        extra: dict[str, object] | None = None,
        events: int | None = None,
        manifest: Manifest | None = None,
        metrics: ProgressiveMetrics | None = None,
    ) -> Path | None:
        """Write a recovery snapshot under root/step-NNNNNNNNN (see snapshot.py); offsets and events
        default to this replica's (a group passes every replica's offsets and the job's total
        events), or the whole manifest is given. Rows past their TTL leave RocksDB first. With
        sharded rows a collective of the node (see `writes`): returns the path on rank 0, None on
        the others."""
        self.replica.table.expire_cold()  # rows past their TTL leave RocksDB too, not only the cached tiers
        counted = (metrics or self.replica.metrics).state()
        return self._write(root, manifest or self.manifest(offsets, extra, events), recovery=True, metrics=counted)

    def publish_to(self, root: str | Path, manifest: Manifest) -> Path | None:
        """Write the serving publication of this step under root/step-NNNNNNNNN (vectors only);
        with sharded rows a collective of the node, like save."""
        return self._write(root, publication_manifest(manifest), recovery=False)

    def publish_delta_to(
        self, root: str | Path, manifest: Manifest, changed: np.ndarray, table: EmbeddingTable | None = None
    ) -> Path:
        """Write a delta publication (rows of the `changed` ids, dense weights) under
        root/step-NNNNNNNNN; the manifest carries its base and sequence."""
        r = self.replica
        return save_delta(Path(root) / snapshot_name(r.step), manifest, r.model, table or r.table, changed)

    def _write(
        self, root: str | Path, manifest: Manifest, recovery: bool, metrics: dict[str, np.ndarray] | None = None
    ) -> Path | None:
        r = self.replica
        path = Path(root) / snapshot_name(r.step)
        try:
            if r.sharded and r.shards.world > 1:  # each rank its own rows' file; rank 0 the rest once all are on disk
                write_rows(path, r.table, not recovery, r.shards.rank, r.shards.world)
                r.shards.barrier()
                if r.rank != 0:
                    return None
                manifest = replace(manifest, shards=r.shards.world)
            else:
                write_rows(path, r.table, vectors_only=not recovery)
            if recovery:
                return finish_snapshot(path, manifest, r.model, r.optimizer, r.table, metrics)
            return finish_snapshot(path, manifest, r.model)
        except OSError as exc:  # a full or read-only disk: name the folder and the way out
            if not (path / MANIFEST).exists():  # nothing half-written is left to look like a snapshot
                shutil.rmtree(path, ignore_errors=True)
            raise SnapshotError(
                f"snapshot {path}: cannot write ({exc.strerror or exc}); free space there or point "
                "trainer.snapshot.dir at a writable folder"
            ) from None

    def restore(self, path: str | Path) -> Manifest:
        """Continue from a snapshot: dense weights, optimizer state, every row, step, events, offsets.
        The store should be empty (a fresh replica)."""
        r = self.replica
        # sharded rows: this replica keeps the ids it owns (whatever the group size that wrote them)
        keep = (lambda ids: r.shards.owners(ids) == r.rank) if r.sharded else None
        snapshot = load_snapshot(path, r.table, keep)
        r.model.load_state_dict(snapshot.model.state_dict())
        load_optimizer_state(path, r.optimizer)
        if r.compressor is not None:
            r.compressor.fill_state()
        r.step = r.merged_step = snapshot.manifest.step
        r.events = snapshot.manifest.events
        r.offsets = {int(p): o for p, o in snapshot.manifest.offsets.items()}
        r.marks = {int(p): key for p, key in snapshot.manifest.marks.items()}
        r.newest_event_ms = snapshot.manifest.newest_event_ms
        counted = read_metrics(path)
        if counted is not None:  # the metrics go on over the whole stream, not from the restart
            r.metrics.load_state(counted)
        return snapshot.manifest

    # --- the group's rounds -----------------------------------------------------------------
    def base_round(
        self,
        control: Control,
        events: int,
        offsets: dict[int, int],
        extra: dict[str, object],
        publish: bool,
        publisher: Publisher | None,
        marks: dict[int, int] | None = None,
    ) -> tuple[Path | None, str | None]:
        """As a group (a collective): rank 0 writes this replica's recovery snapshot of the group's
        `offsets` and `marks` (None: this replica's) and, when it `publish`es (the member that
        serves), the serving publication (vectors only), which rank 0's `publisher` uploads and
        registers. With sharded rows every rank of rank 0's node writes its own rows' file of both.
        The caller commits the offsets once every member's snapshot is durable (trainer/members.py).
        Returns (recovery snapshot path, registry version) on rank 0."""
        r, snapshot = self.replica, self.replica.settings.snapshot
        r.agree_before_base(control)
        counted = merged_metrics(r.metrics)  # every replica's counts: what the resumed job reports on from
        path = version = None
        if self.writes:
            extra = {"workers": control.world, "merge_every_steps": r.settings.group.merge_every_steps, **extra}
            manifest = self.manifest(offsets, extra, events, counted.summary(), marks)  # one manifest for both
            path = self.save(snapshot.dir, manifest=manifest, metrics=counted)  # sharded: the node's collective
            if publish:  # sharded: the node's collective, publisher or not
                publication = self.publish_to(Path(snapshot.dir) / PUBLICATIONS, manifest)
                if publisher is not None and path is not None and publication is not None:
                    champion = str(extra.get("champion", ""))
                    version = publisher.publish(publication, r.step, folder_bytes(path), champion)
                    shutil.rmtree(publication, ignore_errors=True)  # uploaded; the recovery snapshot stays
        else:
            r.table.expire_cold()  # as save does on the writers: every replica drops its TTL-expired rows
        return path, version

    def prune(self) -> None:
        """Rank 0, once a newer snapshot is durable: the older recovery snapshots past snapshot.keep go."""
        snapshot = self.replica.settings.snapshot
        if self.replica.rank == 0:
            prune_snapshots(snapshot.dir, snapshot.keep)

    def delta_round(
        self,
        control: Control,
        publisher: Publisher | None,
        events: int,
        extra: dict[str, object] | None = None,
        offsets: dict[int, int] | None = None,
    ) -> None:
        """Rank 0 sends serving the rows changed since the last publication and the dense weights,
        as the next delta of the current base (a member that does not serve passes no publisher: its
        changes are only forgotten, its base comes whole if it ever serves). `offsets`: every
        replica's (Members.group_positions; None: this replica's own). A failed write or upload is
        logged, not fatal: the next publication is then a base. A collective."""
        r, folder_root = self.replica, Path(self.replica.settings.snapshot.dir) / DELTAS
        changes = r.changes_since_publication(control)  # with sharded rows: every rank's, on rank 0
        group_metrics = merged_metrics(r.metrics).summary()  # a collective: the group's figures, as a base has them
        if publisher is None or publisher.base_path is None or changes is None:
            return
        table, changed = changes
        extra = {"mlflow_run_id": publisher.run_id, "workers": control.world, **(extra or {})}
        manifest = replace(
            self.manifest(offsets, extra=extra, events=events, metrics=group_metrics),
            base_step=publisher.base_step,
            sequence=publisher.sequence + 1,
        )
        where = f"delta {manifest.sequence} of base step {manifest.base_step}"
        try:
            folder = self.publish_delta_to(folder_root, manifest, changed, table)
        except OSError as exc:  # a full disk: this delta is lost, so the next publication is a base
            publisher.forget_base()
            shutil.rmtree(folder_root, ignore_errors=True)
            log.error(
                "%s not written (%s: %s); free space under trainer.snapshot.dir=%s; the next publication is a base",
                where,
                exc.strerror or exc,
                exc.filename,
                r.settings.snapshot.dir,
            )
            return
        try:
            publisher.publish_delta(folder, manifest.sequence, r.step, len(changed))
        except Exception as exc:  # MLflow unreachable for a moment: the next publication is a base
            log.error("%s not published (%s); the next publication is a base", where, exc)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
