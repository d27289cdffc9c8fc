"""Replica: one replica of the model and its state. The dense network + Adam (or SGD), embedding
rows in the store (sharded over the node's ranks with trainer.shard_within_node), the PowerSGD
compressor when dense gradients are shared, progressive metrics, and what a snapshot needs (step,
events, Kafka offsets, the newest event time), with its counters.

How it learns in a group is its layout (trainer/layouts.py: local, shared dense, synchronous,
sharded); its snapshot files and the group's snapshot and delta rounds are its checkpointer's
(trainer/checkpoint.py); `Trainer` (trainer/trainer.py) is the replica with both, chosen once at
start. Alone it takes local steps (`learn`).
"""

from __future__ import annotations

import os
import time
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from prometheus_client import Counter

from store.sparse_optim import SparseOptimConfig, row_width
from store.table import EmbeddingTable
from stream.featurizer.featurize import shared_ids
from stream.schema import Schema
from trainer.batch import Batch
from trainer.compress import PowerSgd
from trainer.configs import make_optimizer, make_tier, model_config, table_config
from trainer.delayed import FinalLabels
from trainer.errors import TrainerError
from trainer.group import Control, check_gpu
from trainer.merge import Group, MergeStats
from trainer.metrics import ProgressiveMetrics
from trainer.model import CtrModel
from trainer.settings import TrainerSettings
from trainer.shard import ShardedTable
from trainer.step import StepResult, predict, train_step

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


class Replica:
    """One replica's state and its local step (see the module docstring); `Trainer` adds its layout
    and checkpointer (trainer/trainer.py)."""

    def __init__(self, schema: Schema, settings: TrainerSettings, counted: bool = True) -> None:
        """`counted`: whether its steps, events and merges go to the process's Prometheus counters
        (a challenger's do not: trainer/members.py reports it by name)."""
        check_gpu(settings.device)
        self.counted = counted
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
        # trainer.shard_within_node: the rows sharded over the ranks of this node (layouts.Sharded,
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
        self.marks: dict[int, int] = {}  # events-topic partition -> newest source key learned (trainer/replayed.py)
        self.newest_event_ms = 0  # the newest event time learned (ms); a group's is the max over replicas
        self.train_seconds = 0.0  # time spent learning (not merging), for samples/s
        self.merge_seconds = 0.0
        self.bytes_sent = 0  # merge / sync payload this replica sent
        self.merges = 0
        self.merged_step = 0  # the step of the last merge (a restored replica: of its snapshot, taken at one)

    def record(self, batch: Batch, probs: np.ndarray, started: float) -> None:
        """Count a learned batch: progressive metrics (each impression once, under fake negatives),
        events, offsets and marks, the newest event time."""
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
        self.marks.update(batch.source_marks)
        self.newest_event_ms = max(self.newest_event_ms, batch.newest_ms)
        if self.counted:
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

    def learn(self, batch: Batch) -> StepResult:
        """One local step (score first, then learn); merges are separate (`merge`)."""
        started = time.perf_counter()
        self.step += 1
        self._set_lr()
        result = train_step(self.model, self.optimizer, self.table, batch.to(self.device), self.step)
        self.record(batch, result.probs, started)
        return result

    def begin_step(self) -> None:
        """A step of a layout that runs backward itself: the step counted, the warm-up's rates, no gradients."""
        self.step += 1
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)

    def _set_lr(self) -> None:
        if self.settings.optim.warmup_steps:
            for group in self.optimizer.param_groups:
                group["lr"] = group.setdefault("base_lr", group["lr"]) * warmup_factor(self.settings, self.step)

    def wide_optim(self) -> SparseOptimConfig | None:
        """The rows' optimizer when the ids' wide weights learn per event (backward's wide_optim), else None."""
        optim = self.table_config.optim
        return optim if optim.wide_per_event else None

    def count(self, stats: MergeStats, merge: bool = True) -> None:
        """Add what a merge (or a synchronous step's exchange) sent and took to the counters."""
        self.merge_seconds += stats.seconds
        self.bytes_sent += stats.bytes
        if self.counted:
            MERGE_BYTES.inc(stats.bytes)
        if merge:
            self.merges += 1
            if self.counted:
                MERGES.inc()

    def agree_on_newest(self, control: Control) -> None:
        """The group's freshest event time, on every replica (what a publication says it has seen)."""
        self.newest_event_ms = max(control.gather(self.newest_event_ms))

    def agree_before_base(self, control: Control) -> None:
        """Before a base publication: the compression's state the same on every replica
        (trainer/compress.py), the group's newest event time, and deltas counted again from here
        (a base holds every row). A collective."""
        if self.compressor is not None:
            self.compressor.share_errors()
        self.agree_on_newest(control)
        self.table.take_changed()

    def changes_since_publication(self, control: Control) -> tuple[EmbeddingTable, np.ndarray] | None:
        """What a delta is written from: (table, the ids changed since the last publication); with
        sharded rows every rank's changes gathered on rank 0 (None on the others). A collective."""
        changed = self.table.take_changed()
        self.agree_on_newest(control)
        return (self.table, changed) if not self.sharded else self.shards.gathered_changes(changed)
