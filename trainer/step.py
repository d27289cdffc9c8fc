"""One train step and one prediction, as functions over (model, optimizer, table, batch).

Progressive validation comes for free: the probabilities returned by train_step are computed
before the step changes any weight, so each batch is scored before it is learned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from store.table import EmbeddingTable, Lookup
from trainer.batch import Batch
from trainer.model import CtrModel


class Rows(Protocol):
    """Where a step reads its rows: an EmbeddingTable, or a table sharded over the group (trainer/shard.py)."""

    def lookup(self, ids: np.ndarray, device: torch.device | str = ..., columns: np.ndarray | None = ...) -> Lookup: ...


@dataclass(frozen=True, eq=False)
class StepResult:
    probs: np.ndarray  # (B,) predicted CTR before the update
    loss: float  # mean binary cross-entropy of the batch


def _gather(leaf: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """leaf (u, E+1) -> its rows at inverse (n,): (n, E+1). An embedding lookup rather than
    leaf[inverse]: the same values, and its backward (summing gradients per row) is ~1.6x faster
    on the CPU than indexing's accumulating scatter (106k lookups into 30k rows: 8.0 -> 4.9 ms)."""
    return F.embedding(inverse, leaf)


def forward(model: CtrModel, table: Rows, batch: Batch):  # type: ignore[no-untyped-def]
    """Look up the batch's rows and run the model. Returns (logits (B,), lookup, leaf vectors (u, E+1)).

    The single-id fields give (B, F, E+1); each list field's values are pooled per event (mean or
    sum, ModelConfig.list_pooling) into one more field, so the model sees (B, F + L, E+1). Gradients
    reach every value's row through the pooling."""
    n, f = batch.ids.shape
    if not batch.lists:
        lookup = table.lookup(batch.ids, device=batch.labels.device)
        leaf = _leaf(lookup.vectors)
        return model(_gather(leaf, lookup.inverse).view(n, f, -1), batch.dense), lookup, leaf
    flat = [batch.ids.reshape(-1)] + [ids for _, ids in batch.lists]
    columns = [np.tile(np.arange(f), n)] + [np.full(len(ids), f + j) for j, (_, ids) in enumerate(batch.lists)]
    lookup = table.lookup(np.concatenate(flat), device=batch.labels.device, columns=np.concatenate(columns))
    leaf = _leaf(lookup.vectors)
    rows = _gather(leaf, lookup.inverse)
    fields = [rows[: n * f].view(n, f, -1)]
    at = n * f
    for j, (starts, ids) in enumerate(batch.lists):
        values = rows[at : at + len(ids)]
        at += len(ids)
        lengths = torch.from_numpy(np.diff(starts)).to(rows.device)
        owner = torch.repeat_interleave(torch.arange(n, device=rows.device), lengths)
        pooled = torch.zeros((n, rows.shape[1]), dtype=rows.dtype, device=rows.device).index_add(0, owner, values)
        if model.config.list_pooling[j] == "mean":
            pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(rows.dtype)
        fields.append(pooled.unsqueeze(1))
    return model(torch.cat(fields, dim=1), batch.dense), lookup, leaf


def _leaf(vectors: torch.Tensor) -> torch.Tensor:
    """The looked-up vectors as the leaf the row gradients collect in (none when predicting)."""
    leaf = vectors.detach()
    return leaf.requires_grad_(True) if torch.is_grad_enabled() else leaf


def backward(model: CtrModel, optimizer: torch.optim.Optimizer, table: Rows, batch: Batch):  # type: ignore[no-untyped-def]
    """Score the batch and compute gradients, changing no weight yet. Returns (StepResult, lookup,
    row gradients (u, E+1) of the summed loss); the dense gradients are in the parameters' .grad."""
    model.train()
    logits, lookup, leaf = forward(model, table, batch)
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    assert leaf.grad is not None
    # the rows want the gradient of the summed loss (store/sparse_optim.py): an id seen c times gets
    # c events' worth, independent of the batch size
    row_grad = leaf.grad * len(batch)
    return StepResult(torch.sigmoid(logits.detach()).cpu().numpy(), float(loss.detach())), lookup, row_grad


def train_step(
    model: CtrModel, optimizer: torch.optim.Optimizer, table: EmbeddingTable, batch: Batch, step: int
) -> StepResult:
    """Score, then learn: the dense optimizer on the network, the sparse one on the touched rows. `step` is 1-based."""
    result, lookup, row_grad = backward(model, optimizer, table, batch)
    optimizer.step()
    table.update(lookup, row_grad, step)
    return result


@torch.inference_mode()
def predict(model: CtrModel, table: EmbeddingTable, batch: Batch) -> np.ndarray:
    """CTR (B,) for a batch, without learning (unseen ids read what store.table.unseen_vectors gives)."""
    if model.training:  # eval() walks every module: skip it when already set (serving's hot path)
        model.eval()
    logits, _, _ = forward(model, table, batch)
    return torch.sigmoid(logits).cpu().numpy()
