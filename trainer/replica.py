"""Trainer: one replica of the model. The dense network + Adam (or SGD), embedding rows in the store,
progressive metrics, and the state a snapshot needs (step, events, Kafka offsets).

Alone (no process group) it just learns. In a group of N replicas (trainer/group.py) it either
learns locally and merges every k steps (`learn` + `merge`), or, with k = 0, takes synchronous
data-parallel steps (`learn_sync`). Both paths are collectives in merge.py; this class only
keeps the counters.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from prometheus_client import Counter

from store.sparse_optim import SparseOptimConfig, row_grads, row_width, wide_columns
from store.table import EmbeddingTable, Lookup
from stream.featurize import shared_ids
from stream.schema import Schema
from trainer.batch import Batch
from trainer.compress import PowerSgd
from trainer.configs import make_optimizer, make_tier, model_config, table_config
from trainer.delayed import FinalLabels
from trainer.errors import SnapshotError, TrainerError
from trainer.group import check_gpu
from trainer.merge import (
    Group,
    MergeStats,
    average_buffers,
    average_dense,
    average_grads,
    average_row_grads,
    average_rows,
    max_step,
    set_optimizer_steps,
    share_sightings,
)
from trainer.metrics import ProgressiveMetrics
from trainer.model import CtrModel
from trainer.settings import TrainerSettings
from trainer.shard import ShardedTable
from trainer.snapshot import (
    MANIFEST,
    Manifest,
    finish_snapshot,
    load_optimizer_state,
    load_snapshot,
    publication_manifest,
    read_metrics,
    save_delta,
    snapshot_name,
    write_rows,
)
from trainer.step import StepResult, backward, predict, train_step
from trainer.wide import WideUpdate

STEPS = Counter("adstream_trainer_steps_total", "train steps")
SAMPLES = Counter("adstream_trainer_samples_total", "events learned")
MERGES = Counter("adstream_trainer_merges_total", "replica merges")
MERGE_BYTES = Counter("adstream_trainer_merge_bytes_total", "payload bytes this replica sent to merge or sync")


def warmup_factor(settings: TrainerSettings, step: int) -> float:
    """The share of the dense learning rates at 1-based `step`: linear warm-up, then 1."""
    warmup = settings.optim.warmup_steps
    return 1.0 if warmup <= 0 else min(1.0, step / warmup)


def node_groups(world: int, rank: int, sharded: bool) -> tuple[Group, Group, int]:
    """(this rank's node group, its cross-node group, nodes) for sharded rows: a node is
    LOCAL_WORLD_SIZE consecutive ranks (torchrun's layout); rank r of a node merges with rank r of
    the others. One node (or no sharding): the node group is every rank, and nothing to merge."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if sharded else world
    if not sharded or not dist.is_initialized() or local >= world:
        return None, None, 1
    if world % local:
        raise TrainerError(f"trainer.shard_within_node: {world} ranks are not whole nodes of LOCAL_WORLD_SIZE={local}")
    nodes = world // local
    # every rank creates every group, in the same order (torch.distributed's rule for new_group)
    by_node = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)]
    across = [dist.new_group([n * local + r for n in range(nodes)]) for r in range(local)]
    return cast(Group, by_node[rank // local]), cast(Group, across[rank % local]), nodes


class Trainer:
    def __init__(self, schema: Schema, settings: TrainerSettings) -> None:
        check_gpu(settings.device)
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.schema = schema
        self.settings = settings
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.model_config = model_config(schema, settings)
        self.device = torch.device(settings.device)
        self.model = CtrModel(self.model_config).to(self.device)
        self.optimizer = make_optimizer(self.model, settings)
        self.table_config = table_config(self.model_config, settings)
        tier = make_tier(settings, row_width(self.table_config.dim), self.rank)
        self.table = EmbeddingTable(tier, self.table_config, shared_ids(schema))
        # trainer.shard_within_node: the rows sharded over the ranks of this node (learn_sharded,
        # trainer/shard.py), this replica's table holding its shard; nodes merge shard by shard
        self.sharded = settings.shard_within_node
        self.node_group, self.cross_group, self.nodes = node_groups(self.world, self.rank, self.sharded)
        # trainer.group.dense_exchange "powersgd": the dense gradients averaged every step between
        # the replicas that merge every k steps (sharded rows: between nodes, each node's exact
        # average first), compressed (trainer/compress.py); rows wait for the merge
        group_settings = settings.group
        shares_dense = group_settings.dense_exchange == "powersgd" and group_settings.merge_every_steps > 0
        merging = self.nodes > 1 if self.sharded else self.world > 1
        self.compressor = (
            PowerSgd(
                self.model,
                self.optimizer,
                group_settings.dense_rank,
                settings.seed,
                self.cross_group,
                getattr(torch, group_settings.dense_wire),
            )
            if shares_dense and merging
            else None
        )
        self.shards = ShardedTable(self.table, self.node_group)
        merges = self.nodes > 1 if self.sharded else self.world > 1 and settings.group.merge_every_steps > 0
        if settings.group.row_merge == "deltas" and merges:
            self.table.keep_anchors()  # where each row started since the last merge
        self.metrics = ProgressiveMetrics(window=settings.metrics_window)
        # fake-negative labels: score each impression once, against its final label (trainer/delayed.py)
        fake_negatives = settings.optim.delayed_feedback != "none"
        self.final_labels = FinalLabels(round(settings.label_wait_s * 1000)) if fake_negatives else None
        self.step = 0
        self.events = 0
        self.offsets: dict[int, int] = {}  # partition -> next offset to consume, for the partitions learned here
        self.newest_event_ms = 0  # the newest event time learned (ms); a group's is the max over replicas
        self.train_seconds = 0.0  # time spent learning (not merging), for samples/s
        self.merge_seconds = 0.0
        self.bytes_sent = 0  # merge / sync payload this replica sent
        self.merges = 0
        self.merged_step = 0  # the step of the last merge (a restored replica: of its snapshot, taken at one)

    def _record(self, batch: Batch, probs: np.ndarray, started: float) -> None:
        if self.final_labels is None or len(batch.event_ids) != len(batch):
            self.metrics.update(batch.labels.numpy(), probs)
        else:
            partitions = {p for p, _ in batch.records} or {0}
            final, first_probs = self.final_labels.add(
                batch.event_ids, batch.labels.numpy(), probs, batch.newest_ms, partitions
            )
            if len(final):
                self.metrics.update(final, first_probs)
        self.events += len(batch)
        self.offsets.update(batch.source_offsets)
        self.newest_event_ms = max(self.newest_event_ms, batch.newest_ms)
        STEPS.inc()
        SAMPLES.inc(len(batch))
        self.train_seconds += time.perf_counter() - started

    def idle(self) -> None:
        """Nothing came for trainer.idle_s: this replica has read its partitions to their end, so
        impressions held for their final label are scored up to the newest time read (FinalLabels)."""
        if self.final_labels is not None:
            final, first_probs = self.final_labels.idle()
            if len(final):
                self.metrics.update(final, first_probs)

    def predict(self, batch: Batch) -> np.ndarray:
        """CTR (B,) without learning (what serving would answer for this batch)."""
        return predict(self.model, self.table, batch.to(self.device))

    @property
    def prefetches(self) -> bool:
        """Whether `prefetch` does anything (a pipelined tiered store): worth holding a batch ahead."""
        return self.table.prefetches

    def prefetch(self, batch: Batch) -> None:
        """Announce the batch that comes after the next `learn`'s: its cold rows are read from
        RocksDB while that one trains. The results of `learn` do not depend on it."""
        self.table.prefetch(np.concatenate([batch.ids.reshape(-1)] + [ids for _, ids in batch.lists]))

    def learn_round(self, batch: Batch | None, k: int) -> np.ndarray | None:
        """This replica's part of one learning round, by the group's layout: rows sharded over the
        node (`learn_sharded`), synchronous data parallel (k = 0: `learn_sync`), or a local step
        merged every k rounds (`learn`; `merge` is separate). The sharded and synchronous steps are
        collectives: every replica takes them, with or without a batch. Returns this replica's
        predictions (B,) made before the update (None without a batch). The loop and `bench merge`
        both learn through here."""
        if self.sharded:
            return self.learn_sharded(batch)[0]
        if k == 0:
            return self.learn_sync(batch)[0]
        if self.compressor is not None:
            return self.learn_shared_dense(batch)
        return self.learn(batch).probs if batch is not None else None

    def learn(self, batch: Batch) -> StepResult:
        """One local step (score first, then learn); merges are separate (`merge`)."""
        started = time.perf_counter()
        self.step += 1
        self._set_lr()
        result = train_step(self.model, self.optimizer, self.table, batch.to(self.device), self.step)
        self._record(batch, result.probs, started)
        return result

    def learn_shared_dense(self, batch: Batch | None) -> np.ndarray | None:
        """A local step on the rows with the dense gradients averaged over the group first
        (trainer.group.dense_exchange "powersgd": trainer/compress.py), so every replica takes the
        same dense step; the rows wait for the k-step merge. Collective: every replica takes it,
        with or without a batch. Returns this replica's predictions (B,) (None without a batch)."""
        assert self.compressor is not None
        started = time.perf_counter()
        self.step += 1
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        result = lookup = grad = wide = None
        if batch is not None:
            result, lookup, grad, wide = backward(
                self.model, self.optimizer, self.table, batch.to(self.device), self._wide_optim(), self.step
            )
        comm_started = time.perf_counter()
        dense_bytes = self.compressor.all_reduce() + average_buffers(self.model)
        self.optimizer.step()
        self._count(MergeStats(dense_bytes, 0, 0, time.perf_counter() - comm_started), merge=False)
        if batch is None or result is None or lookup is None or grad is None:
            return None
        self.table.update(lookup, grad, self.step, wide_columns=None if wide is None else wide.columns)
        self._record(batch, result.probs, started)
        return result.probs

    def _set_lr(self) -> None:
        if self.settings.optim.warmup_steps:
            for group in self.optimizer.param_groups:
                group["lr"] = group.setdefault("base_lr", group["lr"]) * warmup_factor(self.settings, self.step)

    def merge(self) -> MergeStats:
        """Average dense parameters, Adam moments and the rows touched since the last merge over
        the group (a collective: every replica calls it at the same round). With sharded rows the
        merge is between nodes, shard by shard: rank r of each node with rank r of the others."""
        started = time.perf_counter()
        group = self.cross_group if self.sharded else None
        if self.world == 1 or (self.sharded and self.nodes == 1):
            self.table.take_touched()
            self.table.forget_anchors()
            return MergeStats(0, 0, 0, 0.0)
        self.step = max_step(self.step, group)
        set_optimizer_steps(self.optimizer, self.step)
        # the dense network is the same on every replica when its gradients are shared every step
        dense_bytes = 0 if self.compressor is not None else average_dense(self.model, self.optimizer, group)
        rows, sparse_bytes = average_rows(self.table, self.table.take_touched(), self.step, group, self._deltas_power())
        self.merged_step = self.step
        sparse_bytes += share_sightings(self.table, group)
        stats = MergeStats(dense_bytes, sparse_bytes, rows, time.perf_counter() - started)
        self._count(stats)
        return stats

    def _deltas_power(self) -> float | None:
        """The rows' merge rule now (merge.average_rows): None for the mean; under "deltas", the
        power of the writers their summed changes are divided by; 1 (their mean change) when the
        group took one step since the last merge: one step from a common start is the same
        correction seen by every writer, and adding those up overshoots (at k = 1 and 8 workers
        the power 0.5 lost 0.04 AUC over the stream, nearly all at its start)."""
        if self.settings.group.row_merge != "deltas":
            return None
        return self.settings.group.row_deltas_power if self.step - self.merged_step > 1 else 1.0

    def learn_sync(self, batch: Batch | None) -> tuple[np.ndarray | None, MergeStats]:
        """Synchronous data parallel: one step with gradients averaged over the group before the
        update. A replica without a batch this round contributes zero gradients. Collective.
        With the wide part per event, each replica runs its own batch's events through the wide
        weights and the rows take the average of the replicas' changes (sent with the gradients).
        Returns this replica's predictions (B,) made before the update (None without a batch)."""

        def rows_step(lookup: Lookup | None, grad: torch.Tensor) -> tuple[int, int]:
            ids = lookup.unique_ids if lookup is not None else np.zeros(0, dtype=np.int64)
            if lookup is not None:
                self.table.count_sightings(lookup)
            union, avg_grad, sparse_bytes = average_row_grads(self.table, ids, grad)
            sparse_bytes += share_sightings(self.table)
            self.table.apply_grad(union, avg_grad, self.step)
            return len(union), sparse_bytes

        return self._synchronous_step(batch, self.table, None, rows_step)

    def _wide_optim(self) -> SparseOptimConfig | None:
        """The rows' optimizer when the ids' wide weights learn per event (backward's wide_optim), else None."""
        optim = self.table_config.optim
        return optim if optim.wide_per_event else None

    def _no_row_grads(self) -> torch.Tensor:
        """A replica's row gradients in a round without a batch: (0, dim), or (0, dim + 3) with the wide changes."""
        return torch.zeros((0, self.table.dim + (3 if self._wide_optim() else 0)))

    def _with_wide_changes(self, grad: torch.Tensor, lookup: Lookup, wide: WideUpdate | None) -> torch.Tensor:
        """Row gradients (u, dim) with the wide columns' per-event changes beside them
        (sparse_optim.row_grads), which travel and are averaged over the replicas with them."""
        changes = None if wide is None else wide.columns - lookup.rows[:, wide_columns(self.table.dim)]
        return row_grads(grad, changes)

    def learn_sharded(self, batch: Batch | None) -> tuple[np.ndarray | None, MergeStats]:
        """A synchronous step with the rows sharded over the node's ranks (trainer/shard.py: each rank
        stores and updates only the ids it owns, rows and gradients travel by all_to_all); equal
        to `learn_sync` on the same batches. A replica without a batch this round takes part with
        no ids. Collective. Returns this replica's predictions (B,) made before the update."""
        sent_before = self.shards.bytes_sent

        def rows_step(lookup: Lookup | None, grad: torch.Tensor) -> tuple[int, int]:
            rows = self.shards.apply_grads(grad, self.step)
            return rows, self.shards.bytes_sent - sent_before

        return self._synchronous_step(batch, self.shards, self.node_group, rows_step)

    def _synchronous_step(
        self,
        batch: Batch | None,
        rows: EmbeddingTable | ShardedTable,
        group: Group,
        rows_step: Callable[[Lookup | None, torch.Tensor], tuple[int, int]],
    ) -> tuple[np.ndarray | None, MergeStats]:
        """The step learn_sync and learn_sharded share: backward on this replica's batch (rows
        looked up in `rows`; no batch: no ids, still taking part in the lookup's collectives), the
        dense gradients and buffers averaged over `group`, the dense optimizer's step, then
        `rows_step(lookup, row grads)` -> (rows updated, bytes it sent)."""
        started = time.perf_counter()
        self.step += 1
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        lookup, grad, probs = None, self._no_row_grads(), None
        if batch is not None:
            result, lookup, grad, wide = backward(
                self.model, self.optimizer, rows, batch.to(self.device), self._wide_optim(), self.step
            )
            grad = self._with_wide_changes(grad, lookup, wide)
            probs = result.probs
        elif isinstance(rows, ShardedTable):
            rows.lookup(np.zeros(0, dtype=np.int64))  # its all_to_all takes every rank
        comm_started = time.perf_counter()
        dense_bytes = average_grads(self.model, group) + average_buffers(self.model, group)
        if self.sharded and self.compressor is not None:  # and between the nodes, compressed
            dense_bytes += self.compressor.all_reduce() + average_buffers(self.model, self.cross_group)
        self.optimizer.step()
        updated, sparse_bytes = rows_step(lookup, grad)
        stats = MergeStats(dense_bytes, sparse_bytes, updated, time.perf_counter() - comm_started)
        self._count(stats, merge=False)
        if batch is not None and probs is not None:
            self._record(batch, probs, started)
        return probs, stats

    def _count(self, stats: MergeStats, merge: bool = True) -> None:
        self.merge_seconds += stats.seconds
        self.bytes_sent += stats.bytes
        MERGE_BYTES.inc(stats.bytes)
        if merge:
            self.merges += 1
            MERGES.inc()

    # --- snapshots ------------------------------------------------------------------------
    def manifest(
        self,
        offsets: dict[int, int] | None = None,
        extra: dict[str, object] | None = None,
        events: int | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Manifest:
        """This replica's state as a manifest; a group passes every replica's offsets, the job's
        events and the group's metrics (metrics.merged_metrics)."""
        offsets = self.offsets if offsets is None else offsets
        return Manifest(
            schema_name=self.schema.name,
            schema_hash=self.schema.hash,
            model=self.model_config.to_dict(),
            table=self.table_config.to_dict(),
            step=self.step,
            events=self.events if events is None else events,
            offsets={str(p): o for p, o in sorted(offsets.items())},
            metrics=self.metrics.summary() if metrics is None else metrics,
            created_ms=int(time.time() * 1000),
            extra=dict(extra or {}),
            newest_event_ms=self.newest_event_ms,
        )

    @property
    def writes_snapshots(self) -> bool:
        """Whether this replica takes part in writing snapshots and base publications: rank 0, and
        with sharded rows every rank of its node (each writes its own rows' file). Replicas and
        the other nodes hold the same rows right after a merge."""
        return self.rank == 0 or (self.sharded and self.shards.writes_files())

    def changes(self, changed: np.ndarray) -> tuple[EmbeddingTable, np.ndarray] | None:
        """What a delta is written from: (table, changed ids) given this replica's take_changed;
        with sharded rows every rank's changes gathered on rank 0 (None on the others). Collective
        when sharded."""
        return (self.table, changed) if not self.sharded else self.shards.gathered_changes(changed)

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
        sharded rows a collective of the node (see writes_snapshots): returns the path on rank 0,
        None on the others."""
        self.table.expire_cold()  # rows past their TTL leave RocksDB too, not only the cached tiers
        counted = (metrics or self.metrics).state()
        return self._write(root, manifest or self.manifest(offsets, extra, events), recovery=True, metrics=counted)

    def publish_to(self, root: str | Path, manifest: Manifest) -> Path | None:
        """Write the serving publication of this step under root/step-NNNNNNNNN (vectors only);
        with sharded rows a collective of the node, like save."""
        return self._write(root, publication_manifest(manifest), recovery=False)

    def _write(
        self, root: str | Path, manifest: Manifest, recovery: bool, metrics: dict[str, np.ndarray] | None = None
    ) -> Path | None:
        path = Path(root) / snapshot_name(self.step)
        try:
            return self._write_files(path, manifest, recovery, metrics)
        except OSError as exc:  # a full or read-only disk: name the folder and the way out
            if not (path / MANIFEST).exists():  # nothing half-written is left to look like a snapshot
                shutil.rmtree(path, ignore_errors=True)
            raise SnapshotError(
                f"snapshot {path}: cannot write ({exc.strerror or exc}); free space there or point "
                "trainer.snapshot.dir at a writable folder"
            ) from None

    def _write_files(
        self, path: Path, manifest: Manifest, recovery: bool, metrics: dict[str, np.ndarray] | None
    ) -> Path | None:
        if not self.sharded or self.shards.world == 1:
            write_rows(path, self.table, vectors_only=not recovery)
        else:  # each rank its own rows' file; rank 0 the rest once every file is on disk
            write_rows(path, self.table, not recovery, self.shards.rank, self.shards.world)
            self.shards.barrier()
            if self.rank != 0:
                return None
            manifest = replace(manifest, shards=self.shards.world)
        if recovery:
            return finish_snapshot(path, manifest, self.model, self.optimizer, self.table, metrics)
        return finish_snapshot(path, manifest, self.model)

    def publish_delta_to(
        self, root: str | Path, manifest: Manifest, changed: np.ndarray, table: EmbeddingTable | None = None
    ) -> Path:
        """Write a delta publication (rows of the `changed` ids, dense weights) under
        root/step-NNNNNNNNN; the manifest carries its base and sequence."""
        return save_delta(Path(root) / snapshot_name(self.step), manifest, self.model, table or self.table, changed)

    def restore(self, path: str | Path) -> Manifest:
        """Continue from a snapshot: dense weights, optimizer state, every row, step, events, offsets.
        The store should be empty (a fresh replica)."""
        # sharded rows: this replica keeps the ids it owns (whatever the group size that wrote them)
        keep = (lambda ids: self.shards.owners(ids) == self.rank) if self.sharded else None
        snapshot = load_snapshot(path, self.table, keep)
        self.model.load_state_dict(snapshot.model.state_dict())
        load_optimizer_state(path, self.optimizer)
        if self.compressor is not None:
            self.compressor.fill_state()
        self.step = self.merged_step = snapshot.manifest.step
        self.events = snapshot.manifest.events
        self.offsets = {int(p): o for p, o in snapshot.manifest.offsets.items()}
        self.newest_event_ms = snapshot.manifest.newest_event_ms
        counted = read_metrics(path)
        if counted is not None:  # the metrics go on over the whole stream, not from the restart
            self.metrics.load_state(counted)
        return snapshot.manifest
