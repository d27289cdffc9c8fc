"""Embedding rows sharded over the ranks of a group (the ranks of one node): each id has one owner.

Replicated training (merge.py) keeps every row a rank saw on that rank: a node with 8 GPUs stores
the table 8 times. Sharded, rank r holds only the ids the placement plan gives it
(`store.placement.shard_of(id, ranks) == r`; every rank computes the same map), and a synchronous
step moves rows to where the batch is and gradients back to where the row lives:

  1. ids    each rank splits its batch's unique ids by owner and sends them there (all_to_all:
            the counts, then the ids);
  2. rows   each owner reads the ids it was sent from its own table (an unseen id: its initial
            row) and sends their vectors back (with the wide part per event, trainer/wide.py,
            also the wide column's two optimizer states, and step 4 carries its changes back);
  3. step   each rank scores and back-propagates its own batch with those vectors; the dense
            gradients are averaged over the ranks, as in synchronous data parallel;
  4. grads  each rank sends every row gradient back to the row's owner with a 1; the owner
            averages a row's gradient over the ranks that touched it (merge.average_row_grads'
            rule) and applies its sparse optimizer.

So a sharded step equals a synchronous data-parallel step over replicated tables
(`layouts.Synchronous`) on the same batches, row for row (tests/test_shard.py), while each rank
stores about 1/N of the rows. Every call here is a collective over the node's process group: all
its ranks call it together, a rank without a batch with no ids. Between nodes, layouts.Local.merge
averages every k steps over a second group, rank r of each node with rank r of the others (they own
the same ids), as replicas merge (merge.py). On GPUs the same all_to_all runs over NCCL (which takes
NVLink by itself); in the tests it runs over gloo on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from store.dedup import unique_inverse
from store.placement import shard_of
from store.ram import RamTier
from store.sparse_optim import row_width, vectors_of, wide_columns
from store.table import EmbeddingTable, Lookup
from trainer.errors import TrainerError
from trainer.merge import Group, alone, comm_device, counted, touchers_mean


def exchange(parts: list[torch.Tensor], group: Group = None) -> tuple[list[torch.Tensor], int]:
    """all_to_all of tensors of any length over `group`: parts[r] (n_r, ...) goes to its rank r.
    Returns what each rank sent here, by source rank, and the payload bytes this rank sent. Collective."""
    if alone(group):
        return [parts[0]], 0
    device = comm_device()
    sizes = [len(p) for p in parts]
    received_sizes = torch.zeros(len(parts), dtype=torch.int64, device=device)
    dist.all_to_all_single(received_sizes, torch.tensor(sizes, dtype=torch.int64, device=device), group=group)
    counts = received_sizes.cpu().tolist()
    received = torch.empty((sum(counts), *parts[0].shape[1:]), dtype=parts[0].dtype, device=device)
    # one message, split along dim 0 (gloo's list form wants equal sizes)
    dist.all_to_all_single(received, torch.cat(parts).to(device), counts, sizes, group=group)
    sent = sum(p.numel() * p.element_size() for r, p in enumerate(parts) if r != dist.get_rank(group))
    return list(received.cpu().split(counts)), sent


@dataclass(frozen=True)
class Route:
    """Where one lookup's ids went: this rank's unique ids (u,) in owner order, and how many went
    to each rank; and the ids each rank sent here (this rank is their owner), by source rank."""

    order: np.ndarray  # int64 (u,): positions of the unique ids, grouped by owner rank
    counts: list[int]  # ids sent to each rank (sum = u)
    served: list[np.ndarray]  # int64 ids received from each rank, in the order they came


class ShardedTable:
    """A rank's shard of the table (`local`, an EmbeddingTable over this rank's tier) behind the
    lookup interface the step uses (`lookup` -> Lookup), plus `apply_grads` for step 4. The rows
    are sharded over `group` (the ranks of one node; None: every rank)."""

    def __init__(self, local: EmbeddingTable, group: Group = None) -> None:
        self.local = local
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.route: Route | None = None  # the last lookup's, for its gradients
        self.bytes_sent = 0

    @property
    def dim(self) -> int:
        return self.local.dim

    def owners(self, ids: np.ndarray) -> np.ndarray:
        """int64 (n,): the rank owning each id (the placement plan's shard map)."""
        return shard_of(ids, self.world)

    def lookup(self, ids: np.ndarray, device: torch.device | str = "cpu", columns: np.ndarray | None = None) -> Lookup:
        """Steps 1-2: ids int64 (any shape) -> the Lookup of their rows, read from their owners.
        Collective. (Frequency admission needs every sighting at the owner: not with sharding.)"""
        unique, inverse = unique_inverse(ids.reshape(-1))
        owner = self.owners(unique)
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=self.world).tolist()
        asked, sent = exchange(list(torch.from_numpy(unique[order]).split(counts)), self.group)
        served = [a.numpy() for a in asked]
        # the owner's side: vectors of the ids it was sent (its own rows; unseen ids: their initial row)
        wanted = np.concatenate(served) if served else np.zeros(0, np.int64)
        rows, held = self.local.stored_rows(wanted)
        if not held.all():
            fresh = np.nonzero(~held)[0]
            rows[torch.from_numpy(fresh)] = self.local.fresh_rows(wanted[fresh])
        # the vectors, and with the wide part per event (trainer/wide.py) the wide column's two
        # optimizer states, which that pass steps from
        answer = rows[:, self._answer_columns()]
        answers, sent_back = exchange(list(answer.split([len(s) for s in served])), self.group)
        self.bytes_sent += sent + sent_back
        got = torch.zeros((len(unique), answer.shape[1]))
        got[torch.from_numpy(order)] = torch.cat(answers) if answers else got[:0]
        vectors = vectors_of(got, self.dim)
        # the rows themselves stay with their owners (step 4 updates them there); what a step reads
        # of them: the vectors, plus the wide column's states when it learns per event (zeros elsewhere)
        held_rows = vectors
        if self.per_event:
            held_rows = torch.zeros((len(unique), row_width(self.dim)))
            vectors_of(held_rows, self.dim)[:] = vectors
            held_rows[:, wide_columns(self.dim)[1:]] = got[:, self.dim :]
        self.route = Route(order, counts, served)
        counts_per_id = torch.from_numpy(np.bincount(inverse.reshape(-1), minlength=len(unique)))
        return Lookup(
            unique_ids=unique,
            inverse=torch.from_numpy(inverse.reshape(-1)).to(device),
            vectors=vectors.to(device),
            rows=held_rows.to(device),
            counts=counts_per_id,
            waiting=np.zeros(0, np.int64),
            new=0,
        )

    @property
    def per_event(self) -> bool:
        """Whether the ids' wide weights learn event by event (their changes then travel with the gradients)."""
        return self.local.config.optim.wide_per_event

    def _answer_columns(self) -> list[int]:
        """The columns of a row an owner sends back: the vector, and the wide column's two states."""
        return list(range(self.dim)) + (wide_columns(self.dim)[1:] if self.per_event else [])

    def apply_grads(self, grad: torch.Tensor, step: int) -> int:
        """Step 4: grad (u, dim), the row gradients of the last lookup's unique ids, go to their
        owners; each owner averages a row's over the ranks that sent one and takes one optimizer
        step on it. grad (u, dim + 3) also carries the wide column's per-event changes, averaged
        and added the same way (EmbeddingTable.apply_grad). Collective. Returns the rows this rank updated."""
        route = self.route
        if route is None:
            raise TrainerError("ShardedTable.apply_grads: no lookup to apply gradients to; call lookup first")
        self.route = None
        grad = grad.detach().cpu()
        payload = counted(grad[torch.from_numpy(route.order)], torch.arange(len(grad)), len(grad))
        received, sent = exchange(list(payload.split(route.counts)), self.group)
        self.bytes_sent += sent
        ids = np.concatenate(route.served) if route.served else np.zeros(0, np.int64)
        if not len(ids):
            return 0
        union, where = unique_inverse(ids)
        summed = torch.zeros((len(union), grad.shape[1] + 1))
        summed.index_add_(0, torch.from_numpy(where), torch.cat(received))
        self.local.apply_grad(union, touchers_mean(summed)[0], step)
        self.local.mark_touched(union)  # what a k-step merge between nodes averages
        return len(union)

    # --- what snapshots, publications and deltas are written from ----------------------------
    def writes_files(self) -> bool:
        """Whether this rank writes its rows' file into snapshots and base publications: the ranks
        of the node holding the job's rank 0 (the other nodes hold the same rows after a merge)."""
        if not dist.is_initialized():
            return True
        return (dist.get_global_rank(self.group, 0) if self.group is not None else 0) == 0

    def barrier(self) -> None:
        """Wait for every rank of the group (their rows' files are on disk after it)."""
        if not alone(self.group):
            dist.barrier(group=self.group)

    def gathered_changes(self, changed: np.ndarray) -> tuple[EmbeddingTable, np.ndarray] | None:
        """For a delta: each rank's changed ids (its take_changed) -> on rank 0, a table of the
        changed rows the ranks still hold and the union of the changed ids (those not held were
        removed: the delta says so); None on the others. Collective. (A delta holds the rows
        changed in a few seconds, so one rank can hold them; snapshots and bases are written
        shard by shard instead, see Checkpointer.save.)"""
        rows, held = self.local.stored_rows(changed)
        parts = self._gather((changed[held], rows[torch.from_numpy(held)].numpy(), changed))
        if parts is None:
            return None
        return self._table_of(parts), np.unique(np.concatenate([p[2] for p in parts]))

    def _gather(self, part: tuple[np.ndarray, ...]) -> list[tuple[np.ndarray, ...]] | None:
        """Every rank's `part` on the group's first rank when that is the job's rank 0 (it writes
        the files); None elsewhere. Other nodes hold the same rows right after a merge: they skip."""
        if alone(self.group):
            return [part] if not dist.is_initialized() or dist.get_rank() == 0 else None
        leader = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        if leader != 0:
            return None
        parts: list[object] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(part, parts, dst=0, group=self.group)
        return parts if self.rank == 0 else None  # type: ignore[return-value]

    def _table_of(self, parts: list[tuple[np.ndarray, ...]]) -> EmbeddingTable:
        ids = np.concatenate([p[0] for p in parts])
        rows = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        width = self.local.tier.width
        table = EmbeddingTable(RamTier(width, (len(ids) + 1) * RamTier(width, 1).row_bytes), self.local.config)
        table.load(ids, rows)
        return table


__all__ = ["Route", "ShardedTable", "exchange"]
