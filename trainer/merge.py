"""Replica merging over torch.distributed: the collectives behind k-step averaging and the
synchronous data-parallel baseline. Every function is a collective: all ranks call it together.

k-step merging (Baidu's ads trainers): each replica runs Adam locally; every k steps
  - dense: every parameter and Adam's exp_avg / exp_avg_sq are averaged over the replicas
    (all-reduce, bucketed into a few large messages); step counts are set to the maximum;
  - sparse: the ids each replica wrote since the last merge are gathered into their union U;
    every replica sends, for each id of U, what it has of the row and a 1 if it updated the row
    since the last merge (0 and zeros if not); summed over the replicas, the merged rows are
    written back into every replica's store. Only rows of U travel. Two rules
    (trainer.group.row_merge):
      "deltas" (the default): each writer sends its change since the last merge and the row it
        started from (its anchor, kept by the table); the merged row is the anchor plus the
        sum of the changes / writers^p (p = row_deltas_power, 0.5): between the writers' mean
        change (p = 1) and a parameter server's sum of every change (p = 0), and at most twice
        their mean change (MAX_DELTAS_GAIN: beyond 4 writers writers^0.5 would pass it). State
        moves with the vector; FTRL's weights are then re-derived from the merged z and n;
      "mean": each writer sends its row; the merged row is their mean (p = 1 above).
A row is merged over the replicas that updated it. A replica that only holds the copy from the
last merge (or expired the row) adds nothing new and is left out, so a rare feature seen by one
replica keeps that replica's whole update instead of 1/N of it. A row several replicas wrote
is where k-step merging loses most against synchronous steps (each replica learned it from
1/N of the events): the mean keeps one replica's worth of change, a sum overshoots on hot rows
(every replica corrected the same error); writers^0.5 between them kept the window AUC of
`adstream bench merge` within 0.001 of synchronous at 4 workers, where the mean lost 0.0026.

Synchronous data parallel (k = 0): gradients are averaged before each step instead: dense
gradients over all replicas; a row's gradient over the replicas that touched it in this step,
the same rule as the merge, so with plain SGD a merge after every step equals synchronous
training exactly (tests/test_merge.py pins this).

Bytes are what this rank puts on the wire as payload (ids and rows, not protocol overhead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from store.sparse_optim import column_lr, ftrl_weights, join_rows, split_rows
from store.table import EmbeddingTable

BUCKET_BYTES = 16 << 20  # dense all-reduce message size: few large messages, bounded extra memory
# "deltas" moves a row by at most this many times its writers' mean change. Every writer of a hot
# row corrects the same error e; if each removes a fraction f of it (0..1) and the merge applies
# g times their mean change, the error left is (1 - g f) e, which grows for f > 2 / g. With g = 2
# no row can diverge however fast it learns; writers^0.5 passes 2 beyond 4 writers (8 writers,
# 2M synthetic events: a seed whose window AUC fell to 0.70 under 8^0.5, see the README).
MAX_DELTAS_GAIN = 2.0


@dataclass(frozen=True)
class MergeStats:
    dense_bytes: int  # payload this rank sent for the dense part
    sparse_bytes: int  # payload this rank sent for ids and rows
    rows: int  # rows in the union that was averaged
    seconds: float

    @property
    def bytes(self) -> int:
        return self.dense_bytes + self.sparse_bytes


Group = dist.ProcessGroup | None  # the ranks a collective runs over; None: all of them


def alone(group: Group = None) -> bool:
    """No group (a lone trainer) or a group of one: collectives are the identity."""
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def comm_device() -> torch.device:
    """Where collective buffers live: the GPU for NCCL, the host for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (zeros, step 0) so replicas that have not stepped
    yet can merge (plain SGD keeps none)."""
    init = getattr(optimizer, "init_state", None)
    if init is not None:
        init()


def dense_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a dense merge averages: every parameter, the float buffers (the dense features' running
    statistics), then every optimizer state tensor but the step counts (Adam's moments, Adagrad's
    sums; none for SGD)."""
    ensure_optimizer_state(optimizer)
    tensors = [p.data for p in model.parameters()] + float_buffers(model)
    for p in model.parameters():
        state = optimizer.state.get(p, {})
        tensors += [state[key] for key in sorted(state) if key != "step"]
    return tensors


def average_tensors(
    tensors: Sequence[torch.Tensor],
    bucket_bytes: int = BUCKET_BYTES,
    group: Group = None,
    wire: torch.dtype = torch.float32,
) -> int:
    """Average tensors in place over all ranks, bucketed by size; returns payload bytes sent. `wire`:
    the dtype summed and sent (bfloat16: half the bytes, each sum rounded to 8 significant bits;
    PowerSGD's factors, whose rounding its error feedback takes back)."""
    if alone(group):
        return 0
    world, device, sent = dist.get_world_size(group), comm_device(), 0
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size, sent
        if not bucket:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in bucket]).to(device, wire)
        dist.all_reduce(flat, group=group)
        sent += flat.numel() * flat.element_size()
        flat = flat.float() / world
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        bucket, size = [], 0

    for t in tensors:
        bucket.append(t)
        size += t.numel() * 4
        if size >= bucket_bytes:
            flush()
    flush()
    return sent


def max_step(step: int, group: Group = None) -> int:
    """The largest step count over the ranks (replicas that had no data in some rounds lag)."""
    if alone(group):
        return step
    t = torch.tensor([step], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def set_optimizer_steps(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Every parameter's step count set to `step` (after a merge, to the group's maximum)."""
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(step), dtype=state["step"].dtype, device=state["step"].device)


def average_dense(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Group = None) -> int:
    """Dense half of a merge: parameters and Adam moments averaged in place; returns bytes sent."""
    return average_tensors(dense_tensors(model, optimizer), group=group)


def union_ids(ids: np.ndarray, group: Group = None) -> tuple[np.ndarray, int]:
    """Sorted union over the ranks of each rank's int64 ids; returns (union, bytes sent)."""
    parts, sent = gather_ids(ids, group)
    return np.unique(np.concatenate(parts)), sent


def counted(rows: torch.Tensor, at: torch.Tensor, n: int) -> torch.Tensor:
    """A rank's part of an average over the ranks that touched each row: rows (m, w) placed at
    positions `at` (m,) of n, with a count column, 1 where this rank has a row: (n, w + 1). The
    parts are summed over the ranks (all_reduce, or index_add at a shard's owner), then
    `touchers_mean` divides each row by how many ranks sent it."""
    payload = torch.zeros((n, rows.shape[1] + 1))
    payload[at, :-1] = rows
    payload[at, -1] = 1.0
    return payload


def touchers_mean(summed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed `counted` parts (n, w + 1) -> (each row's mean over the ranks that sent it (n, w),
    how many did (n,)). A row no rank sent stays zero."""
    count = summed[:, -1]
    return summed[:, :-1] / count.clamp(min=1)[:, None], count


def average_rows(
    table: EmbeddingTable, touched: np.ndarray, step: int, group: Group = None, deltas_power: float | None = None
) -> tuple[int, int]:
    """Sparse half of a merge: rows written on any rank since the last merge (`touched`: this
    rank's, sorted unique), merged over the ranks that wrote them, written back everywhere.
    deltas_power None (trainer.group.row_merge "mean"): each row the mean of the writers' rows.
    A number a (row_merge "deltas"): the row the writers started from (its anchor, kept by the
    table: EmbeddingTable.keep_anchors) plus the sum of their changes divided by writers^a (a = 1:
    their mean change, 0: every change, as a parameter server applies them), and never more than
    MAX_DELTAS_GAIN times their mean change, state and all; under
    FTRL the weights are then the ones the merged z and n stand for. Returns (rows merged, bytes sent)."""
    deltas = deltas_power is not None
    union, sent = union_ids(touched, group)
    if len(union) == 0:
        table.forget_anchors()
        return 0, sent
    mine = np.isin(union, touched, assume_unique=True)
    rows, held = torch.zeros((0, table.tier.width)), np.zeros(0, dtype=bool)
    if mine.any():
        rows, held = table.stored_rows(union[mine])
        mine[np.nonzero(mine)[0][~held]] = False  # written, then expired since: nothing to offer
    rows = rows[torch.from_numpy(held)]
    if deltas:
        anchors = table.take_anchors(union[mine])
        rows = torch.cat([rows - anchors, anchors], dim=1)  # what changed, and where it started
    payload = counted(rows, torch.from_numpy(np.nonzero(mine)[0]), len(union))
    if not alone(group):
        payload = payload.to(comm_device())
        dist.all_reduce(payload, group=group)
        sent += payload.numel() * payload.element_size()
    summed, count = touchers_mean(payload.cpu())
    if deltas_power is not None:
        width, writers = table.tier.width, count.clamp(min=1)[:, None]
        gain = writers.pow(1 - deltas_power).clamp(max=MAX_DELTAS_GAIN)  # x the writers' mean change
        merged = summed[:, width:] + summed[:, :width] * gain
        if table.config.optim.name == "ftrl":
            merged = _ftrl_weights_of_state(merged, table)
    else:
        merged = summed
    keep = (count > 0).numpy()  # a row every writer has since expired stays expired
    table.put(union[keep], merged[torch.from_numpy(keep)], step)
    return int(keep.sum()), sent


def _ftrl_weights_of_state(rows: torch.Tensor, table: EmbeddingTable) -> torch.Tensor:
    """FTRL rows whose z and n were merged: their weights are the ones that state stands for."""
    cfg = table.config.optim
    _, z, n = split_rows(rows, table.dim)
    lr = column_lr(cfg, table.dim)
    return join_rows(ftrl_weights(z, (n + cfg.initial_accumulator).sqrt(), lr, cfg), z, n)


def gather_ids(ids: np.ndarray, group: Group = None) -> tuple[list[np.ndarray], int]:
    """Every rank's int64 ids (n_r,), in rank order; returns (per-rank arrays, bytes sent)."""
    if alone(group):
        return [ids], 0
    device, world = comm_device(), dist.get_world_size(group)
    length = torch.tensor([len(ids)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    if longest == 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(world)], 8
    padded = torch.zeros(longest, dtype=torch.int64, device=device)
    padded[: len(ids)] = torch.from_numpy(ids).to(device)
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [g[: int(n.item())].cpu().numpy() for g, n in zip(gathered, lengths)], 8 + 8 * longest


def share_sightings(table: EmbeddingTable, group: Group = None) -> int:
    """Admission counts: each rank adds the sightings the others counted since the last call, so
    every replica admits the same ids at the same time. Returns bytes sent (0 without admission)."""
    if table.sketch is None:
        return 0
    mine = table.take_sighted()
    if alone(group):
        return 0
    parts, sent = gather_ids(mine, group)
    rank = dist.get_rank(group)
    others = [p for r, p in enumerate(parts) if r != rank]
    if others:
        table.add_sightings(np.concatenate(others))
    return sent


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's float buffers: the dense features' running statistics."""
    return [b for b in model.buffers() if b.is_floating_point()]


def average_buffers(model: torch.nn.Module, group: Group = None) -> int:
    """The float buffers averaged in place, so synchronous replicas keep normalizing alike; returns bytes sent."""
    return average_tensors(float_buffers(model), group=group)


def average_grads(model: torch.nn.Module, group: Group = None) -> int:
    """Synchronous data parallel, dense: every .grad averaged over the ranks (None counts as zeros)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return average_tensors([p.grad for p in model.parameters() if p.grad is not None], group=group)


def average_row_grads(
    table: EmbeddingTable, ids: np.ndarray, grad: torch.Tensor
) -> tuple[np.ndarray, torch.Tensor, int]:
    """Synchronous data parallel, sparse: this rank's (ids (n,), grad (n, w)) -> the union of
    ids over the ranks and each row's gradient averaged over the ranks that touched it. w is the
    same on every rank: dim, or dim + 3 with the wide columns' per-event changes (trainer/wide.py).
    Returns (union (u,), grad (u, w), bytes sent)."""
    union, sent = union_ids(ids)
    width = grad.shape[1]
    if len(union) == 0:
        return union, torch.zeros((0, width)), sent
    payload = counted(grad.detach().cpu(), torch.from_numpy(np.searchsorted(union, ids)), len(union))
    if not alone():
        payload = payload.to(comm_device())
        dist.all_reduce(payload)
        sent += payload.numel() * payload.element_size()
    return union, touchers_mean(payload.cpu())[0], sent
