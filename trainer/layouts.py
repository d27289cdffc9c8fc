"""How a replica learns in its group: one layout, chosen once at start (`layout_of`), each with
`learn` (this replica's part of one round) and `merge` (the k-step merge).

    Local         alone, or a local step merged every k rounds (trainer.group.merge_every_steps = k)
    SharedDense   a local step on the rows, the dense gradients averaged over the group every step,
                  compressed (trainer.group.dense_exchange "powersgd", trainer/compress.py)
    Synchronous   k = 0: one data-parallel step, gradients averaged before the update
    Sharded       trainer.shard_within_node: a synchronous step over rows sharded across the node's
                  ranks (trainer/shard.py); nodes merge every k rounds, shard by shard

Every collective is in merge.py, compress.py and shard.py; a layout only says which run when.
`learn` returns this replica's predictions (B,) made before the update (None without a batch);
the synchronous layouts are collectives, so every replica calls `learn` each round, with or
without a batch. The loop and `bench merge` both learn through `Trainer.learn_round` (trainer/trainer.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from store.sparse_optim import row_grads, wide_columns
from store.table import EmbeddingTable, Lookup
from trainer.batch import Batch
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
from trainer.replica import Replica
from trainer.shard import ShardedTable
from trainer.step import backward


class Local:
    """A local step (score first, then learn); the replicas meet only at `merge`."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def learn(self, batch: Batch | None) -> np.ndarray | None:
        return self.replica.learn(batch).probs if batch is not None else None

    def merge(self) -> MergeStats:
        """Average dense parameters, Adam moments and the rows touched since the last merge over
        the group (a collective: every replica calls it at the same round). With sharded rows the
        merge is between nodes, shard by shard: rank r of each node with rank r of the others."""
        r = self.replica
        started = time.perf_counter()
        group = r.cross_group if r.sharded else None
        if r.world == 1 or (r.sharded and r.nodes == 1):
            r.table.take_touched()
            r.table.forget_anchors()
            return MergeStats(0, 0, 0, 0.0)
        r.step = max_step(r.step, group)
        set_optimizer_steps(r.optimizer, r.step)
        # the dense network is the same on every replica when its gradients are shared every step
        dense_bytes = 0 if r.compressor is not None else average_dense(r.model, r.optimizer, group)
        rows, sparse_bytes = average_rows(r.table, r.table.take_touched(), r.step, group, self._deltas_power())
        r.merged_step = r.step
        sparse_bytes += share_sightings(r.table, group)
        stats = MergeStats(dense_bytes, sparse_bytes, rows, time.perf_counter() - started)
        r.count(stats)
        return stats

    def _deltas_power(self) -> float | None:
        """The rows' merge rule now (merge.average_rows): None for the mean; under "deltas", the
        power of the writers their summed changes are divided by; 1 (their mean change) when the
        group took one step since the last merge: one step from a common start is the same
        correction seen by every writer, and adding those up overshoots (at k = 1 and 8 workers
        the power 0.5 lost 0.04 AUC over the stream, nearly all at its start)."""
        r = self.replica
        if r.settings.group.row_merge != "deltas":
            return None
        return r.settings.group.row_deltas_power if r.step - r.merged_step > 1 else 1.0


class SharedDense(Local):
    """A local step on the rows with the dense gradients averaged over the group first, so every
    replica takes the same dense step; the rows wait for the k-step merge."""

    def learn(self, batch: Batch | None) -> np.ndarray | None:
        r = self.replica
        assert r.compressor is not None
        started = time.perf_counter()
        r.begin_step()
        result = lookup = grad = wide = None
        if batch is not None:
            result, lookup, grad, wide = backward(
                r.model, r.optimizer, r.table, batch.to(r.device), r.wide_optim(), r.step
            )
        comm_started = time.perf_counter()
        dense_bytes = r.compressor.all_reduce() + average_buffers(r.model)
        r.optimizer.step()
        r.count(MergeStats(dense_bytes, 0, 0, time.perf_counter() - comm_started), merge=False)
        if batch is None or result is None or lookup is None or grad is None:
            return None
        r.table.update(lookup, grad, r.step, wide_columns=None if wide is None else wide.columns)
        r.record(batch, result.probs, started)
        return result.probs


class Synchronous(Local):
    """Synchronous data parallel: one step with gradients averaged over the group before the
    update. A replica without a batch this round contributes zero gradients. With the wide part
    per event, each replica runs its own batch's events through the wide weights and the rows take
    the average of the replicas' changes (sent with the gradients)."""

    def learn(self, batch: Batch | None) -> np.ndarray | None:
        return self.step(batch)[0]

    def step(self, batch: Batch | None) -> tuple[np.ndarray | None, MergeStats]:
        """`learn`, with what the step sent."""
        r = self.replica

        def rows_step(lookup: Lookup | None, grad: torch.Tensor) -> tuple[int, int]:
            ids = lookup.unique_ids if lookup is not None else np.zeros(0, dtype=np.int64)
            if lookup is not None:
                r.table.count_sightings(lookup)
            union, avg_grad, sparse_bytes = average_row_grads(r.table, ids, grad)
            sparse_bytes += share_sightings(r.table)
            r.table.apply_grad(union, avg_grad, r.step)
            return len(union), sparse_bytes

        return synchronous_step(r, batch, r.table, None, rows_step)


class Sharded(Local):
    """A synchronous step with the rows sharded over the node's ranks (each rank stores and updates
    only the ids it owns, rows and gradients travel by all_to_all); equal to `Synchronous` on the
    same batches (tests/test_shard.py). A replica without a batch takes part with no ids."""

    def learn(self, batch: Batch | None) -> np.ndarray | None:
        return self.step(batch)[0]

    def step(self, batch: Batch | None) -> tuple[np.ndarray | None, MergeStats]:
        """`learn`, with what the step sent."""
        r = self.replica
        sent_before = r.shards.bytes_sent

        def rows_step(lookup: Lookup | None, grad: torch.Tensor) -> tuple[int, int]:
            rows = r.shards.apply_grads(grad, r.step)
            return rows, r.shards.bytes_sent - sent_before

        return synchronous_step(r, batch, r.shards, r.node_group, rows_step)


def layout_of(replica: Replica) -> Local:
    """The replica's layout from its settings (see the module docstring)."""
    if replica.sharded:
        return Sharded(replica)
    if replica.settings.group.merge_every_steps == 0:
        return Synchronous(replica)
    if replica.compressor is not None:
        return SharedDense(replica)
    return Local(replica)


def synchronous_step(
    r: Replica,
    batch: Batch | None,
    rows: EmbeddingTable | ShardedTable,
    group: Group,
    rows_step: Callable[[Lookup | None, torch.Tensor], tuple[int, int]],
) -> tuple[np.ndarray | None, MergeStats]:
    """The step Synchronous and Sharded share: backward on this replica's batch (rows looked up in
    `rows`; no batch: no ids, still taking part in the lookup's collectives), the dense gradients
    and buffers averaged over `group`, the dense optimizer's step, then
    `rows_step(lookup, row grads)` -> (rows updated, bytes it sent)."""
    started = time.perf_counter()
    r.begin_step()
    wide_optim = r.wide_optim()
    lookup, probs = None, None
    # a replica's row gradients in a round without a batch, in the row-gradient format (0, dim [+ 3])
    no_changes = torch.zeros((0, len(wide_columns(r.table.dim)))) if wide_optim else None
    grad = row_grads(torch.zeros((0, r.table.dim)), no_changes)
    if batch is not None:
        result, lookup, grad, wide = backward(r.model, r.optimizer, rows, batch.to(r.device), wide_optim, r.step)
        # the wide columns' per-event changes travel beside the gradients and are averaged with them
        changes = None if wide is None else wide.columns - lookup.rows[:, wide_columns(r.table.dim)]
        grad = row_grads(grad, changes)
        probs = result.probs
    elif isinstance(rows, ShardedTable):
        rows.lookup(np.zeros(0, dtype=np.int64))  # its all_to_all takes every rank
    comm_started = time.perf_counter()
    dense_bytes = average_grads(r.model, group) + average_buffers(r.model, group)
    if r.sharded and r.compressor is not None:  # and between the nodes, compressed
        dense_bytes += r.compressor.all_reduce() + average_buffers(r.model, r.cross_group)
    r.optimizer.step()
    updated, sparse_bytes = rows_step(lookup, grad)
    stats = MergeStats(dense_bytes, sparse_bytes, updated, time.perf_counter() - comm_started)
    r.count(stats, merge=False)
    if batch is not None and probs is not None:
        r.record(batch, probs, started)
    return probs, stats
