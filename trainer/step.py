"""One train step and one prediction, as functions over (model, optimizer, table, batch).

Progressive validation comes for free: the probabilities returned by train_step are computed
before anything learns from the event they score, so each batch is scored before it is learned
(with the wide part per event, trainer/wide.py, event i's score already has the batch's earlier
events in its ids' first-order weights, as an online learner's would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from store.sparse_optim import SparseOptimConfig
from store.table import EmbeddingTable, Lookup
from trainer.batch import Batch
from trainer.delayed import fn_calibrated, fn_weighted_logloss
from trainer.gather import gather_rows
from trainer.model import CtrModel, ModelConfig
from trainer.wide import learn_wide


class Rows(Protocol):
    """Where a step reads its rows: an EmbeddingTable, or a table sharded over the group (trainer/shard.py)."""

    def lookup(self, ids: np.ndarray, device: torch.device | str = ..., columns: np.ndarray | None = ...) -> Lookup: ...


@dataclass(frozen=True, eq=False)
class StepResult:
    probs: np.ndarray  # (B,) predicted CTR before the update
    loss: float  # mean binary cross-entropy of the batch


def forward(model: CtrModel, table: Rows, batch: Batch):  # type: ignore[no-untyped-def]
    """Look up the batch's rows and run the model. Returns (logits (B,), lookup, leaf vectors (u, W))."""
    rows, lookup, leaf = model_inputs(model, table, batch)
    return model(rows, batch.dense), lookup, leaf


def model_inputs(model: CtrModel, table: Rows, batch: Batch):  # type: ignore[no-untyped-def]
    """The model's input rows for a batch: (rows (B, F + L, W), lookup, leaf vectors (u, W)).

    The single-id fields give (B, F, W); each list field's values are pooled per event (mean or
    sum, ModelConfig.list_pooling) into one more field, so the model sees (B, F + L, W). Gradients
    reach every value's row through the pooling. W is E + 1, or 1 for a family that reads no factors
    (lr): its step gathers only the first-order weights, 1/(E+1) of the values."""
    n, f = batch.ids.shape
    if not batch.lists:
        lookup = table.lookup(batch.ids, device=batch.labels.device)
        leaf = _leaf(model, lookup.vectors)
        return gather_rows(leaf, lookup.inverse).view(n, f, -1), lookup, leaf
    flat = [batch.ids.reshape(-1)] + [ids for _, ids in batch.lists]
    columns = [np.tile(np.arange(f), n)] + [np.full(len(ids), f + j) for j, (_, ids) in enumerate(batch.lists)]
    lookup = table.lookup(np.concatenate(flat), device=batch.labels.device, columns=np.concatenate(columns))
    leaf = _leaf(model, lookup.vectors)
    rows = gather_rows(leaf, lookup.inverse)
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
    return torch.cat(fields, dim=1), lookup, leaf


def _leaf(model: CtrModel, vectors: torch.Tensor) -> torch.Tensor:
    """The looked-up vectors (u, E+1) as the leaf the row gradients collect in (none when
    predicting): all of them, or only the first-order column (u, 1) when the model reads no factors."""
    if not model.reads_factors:
        vectors = vectors[:, -1:]
    leaf = (
        vectors.detach().contiguous()
    )  # a view of the rows' first columns: gathers from a compact copy run ~4x faster
    return leaf.requires_grad_(True) if torch.is_grad_enabled() else leaf


def _row_grad(leaf_grad: torch.Tensor, lookup: Lookup) -> torch.Tensor:
    """The leaf's gradient (u, W) as the rows' (u, E+1): the factor columns' zero when W = 1."""
    if leaf_grad.shape[1] == lookup.vectors.shape[1]:
        return leaf_grad
    full = torch.zeros_like(lookup.vectors)
    full[:, -1:] = leaf_grad
    return full


def backward(  # type: ignore[no-untyped-def]
    model: CtrModel,
    optimizer: torch.optim.Optimizer,
    table: Rows,
    batch: Batch,
    wide_optim: SparseOptimConfig | None = None,
    step: int = 0,
):
    """Score the batch and compute gradients, changing no weight yet. Returns (StepResult, lookup,
    row gradients (u, E+1) of the summed loss, WideUpdate or None); the dense gradients are in the
    parameters' .grad. Given wide_optim (the rows' optimizer) and the 1-based step, the ids' wide
    weights also learn event by event (trainer/wide.py): the scores returned are then each event's
    after the batch's earlier events' wide steps, and the WideUpdate holds the rows' new wide
    columns for EmbeddingTable.update. The gradients stay the batch's own, taken at the weights
    every part of the model was read with (at the shifted scores the synthetic stream's deep part
    learned less: last-100k gap to truth 0.0106 vs 0.0098)."""
    model.train()
    logits, lookup, leaf = forward(model, table, batch)
    fnw = model.config.delayed_feedback == "fnw"
    loss = (
        fn_weighted_logloss(logits, batch.labels) if fnw else F.binary_cross_entropy_with_logits(logits, batch.labels)
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    assert leaf.grad is not None
    # the rows want the gradient of the summed loss (store/sparse_optim.py): an id seen c times gets
    # c events' worth, independent of the batch size
    row_grad = _row_grad(leaf.grad, lookup) * len(batch)
    scored, wide = logits.detach(), None
    if wide_optim is not None:
        wide = learn_wide(scored, batch, lookup, wide_optim, model.config.list_pooling, step, fnw)
        scored = scored + wide.logit_shift
        loss = F.binary_cross_entropy_with_logits(scored, batch.labels)
    ctr = ctr_of(scored, model.config)
    return StepResult(ctr.cpu().numpy(), float(loss.detach())), lookup, row_grad, wide


def ctr_of(logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The CTR (B,) a model's logits (B,) stand for: their sigmoid, or under "fnc" the sigmoid
    mapped back from the fake-negative labels' rate (trainer/delayed.py)."""
    p = torch.sigmoid(logits)
    return fn_calibrated(p) if config.delayed_feedback == "fnc" else p


def train_step(
    model: CtrModel, optimizer: torch.optim.Optimizer, table: EmbeddingTable, batch: Batch, step: int
) -> StepResult:
    """Score, then learn: the dense optimizer on the network, the sparse one on the touched rows
    (their wide weights event by event when the table's optimizer says wide_per_event). `step` is 1-based."""
    optim = table.config.optim
    result, lookup, row_grad, wide = backward(
        model, optimizer, table, batch, optim if optim.wide_per_event else None, step
    )
    optimizer.step()
    table.update(lookup, row_grad, step, wide_columns=None if wide is None else wide.columns)
    return result


@torch.inference_mode()
def predict(model: CtrModel, table: Rows, batch: Batch) -> np.ndarray:
    """CTR (B,) for a batch, without learning (unseen ids read what store.table.unseen_vectors gives)."""
    if model.training:  # eval() walks every module: skip it when already set (serving's hot path)
        model.eval()
    logits, _, _ = forward(model, table, batch)
    return ctr_of(logits, model.config).cpu().numpy()
