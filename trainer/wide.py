"""The ids' first-order (wide) weights learned event by event inside each batch.

A minibatch learner scores all B events of a batch with the weights from before it and then
takes one step. An online logistic regression (river, Vowpal Wabbit, McMahan et al.'s FTRL)
scores event i with what events 0..i-1 taught it. On a young stream the difference is large:
an id's first sighting moves its weight before its second, even in the same batch. This module
gives the wide part of every family that behaviour while the rest of the model (factors, MLP,
cross layers, dense linear term, bias) still steps once per batch:

  for event i in order:
      logit_i = batch logit_i + sum over its ids of (w_now - w_before_batch) * weight
      p_i = sigmoid(logit_i)                     # the score reported for event i
      each id's wide weight takes one step of the sparse optimizer with (p_i - y_i) * weight

`weight` is 1 for a single-id field and 1 / length for a value of a mean-pooled list field (its
share of the pooled row). The step is the same rule as store/sparse_optim.py's on the vector's
last column (at `wide_lr`), in float64, one event at a time; at batch size 1 both paths give the
same rows (tests/test_wide.py). The rest of the model keeps the batch's own gradients, taken at
the weights it read (trainer/step.py says why).

Shapes: logits (B,), labels (B,); an occurrence is one (event, row) pair: starts (B + 1,) into
rows_of (n,) and weights (n,); rows (u, 3 * dim) as the lookup read them (store/sparse_optim.py: the row layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from store.sparse_optim import SparseOptimConfig, row_dim, wide_columns
from store.table import Lookup
from trainer.batch import Batch

_RULE_CODES = {"sgd": 0, "adagrad": 1, "ftrl": 2, "adam": 3}


@dataclass(frozen=True, eq=False)
class WideUpdate:
    logit_shift: torch.Tensor  # (B,) what each event's score owes to the batch's earlier events
    columns: torch.Tensor  # (u, 3) the wide column's new (w, state_a, state_b) for each lookup row


def occurrences(batch: Batch, list_pooling: tuple[str, ...], inverse: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every (event, row) pair of the batch, grouped by event: (starts (B + 1,), rows_of (n,),
    weights (n,)). `inverse` (positions,) is the lookup's, in forward()'s order: the single-id
    fields event by event, then each list field's values."""
    n, f = batch.ids.shape
    if not batch.lists:  # f rows per event, already in event order
        return np.arange(n + 1) * f, inverse.astype(np.int64), np.ones(n * f)
    events = [np.repeat(np.arange(n), f)]
    weights = [np.ones(n * f)]
    for j, (starts, _) in enumerate(batch.lists):
        lengths = np.diff(starts)
        events.append(np.repeat(np.arange(n), lengths))
        share = 1.0 / np.maximum(lengths, 1) if list_pooling[j] == "mean" else np.ones(n)
        weights.append(np.repeat(share, lengths))
    event_of = np.concatenate(events)
    order = np.argsort(event_of, kind="stable")
    starts = np.searchsorted(event_of[order], np.arange(n + 1))
    return starts, inverse[order].astype(np.int64), np.concatenate(weights)[order]


def learn_wide(
    logits: torch.Tensor,
    batch: Batch,
    lookup: Lookup,
    cfg: SparseOptimConfig,
    list_pooling: tuple[str, ...],
    step: int,
    fn_weighted: bool = False,
) -> WideUpdate:
    """Run the batch's events in order through the wide weights (see the module docstring).
    Pure: the lookup's rows are read, not changed. `step` (1-based) is Adam's bias correction."""
    # a GPU sync point: the pass runs on the host, over B logits and the touched rows' 3 columns
    columns = lookup.rows[:, wide_columns(row_dim(lookup.rows))].double().cpu().numpy().copy()
    starts, rows_of, weights = occurrences(batch, list_pooling, lookup.inverse.cpu().numpy())
    shift = _wide_pass(
        logits.detach().double().cpu().numpy(),
        batch.labels.double().cpu().numpy(),
        starts,
        rows_of,
        weights,
        columns,
        _RULE_CODES[cfg.name],
        cfg.wide_lr if cfg.wide_lr > 0 else cfg.lr,
        cfg.l2,
        cfg.eps,
        cfg.beta1,
        cfg.beta2,
        cfg.initial_accumulator,
        cfg.ftrl_beta,
        cfg.ftrl_l1,
        step,
        fn_weighted,
    )
    device = lookup.rows.device
    return WideUpdate(
        torch.from_numpy(shift).to(device=device, dtype=logits.dtype),
        torch.from_numpy(columns).to(device=device, dtype=lookup.rows.dtype),
    )


@numba.njit(cache=True)
def _wide_pass(  # type: ignore[no-untyped-def]
    logits,
    labels,
    starts,
    rows_of,
    weights,
    columns,
    rule,
    lr,
    l2,
    eps,
    beta1,
    beta2,
    accumulator,
    ftrl_beta,
    l1,
    step,
    fnw,
):
    """The per-event loop; updates columns (u, 3) in place and returns each event's logit shift (B,).
    fnw: each event's gradient carries its FN weight (trainer/delayed.py), at its own p."""
    before = columns[:, 0].copy()
    # FTRL's sqrt(n + accumulator) per row, kept as n grows: one square root per occurrence, not two
    roots = np.sqrt(columns[:, 2] + accumulator) if rule == 2 else before
    shift = np.zeros(len(logits))
    for i in range(len(logits)):
        s = 0.0
        for k in range(starts[i], starts[i + 1]):
            r = rows_of[k]
            s += (columns[r, 0] - before[r]) * weights[k]
        shift[i] = s
        p = 1.0 / (1.0 + math.exp(-(logits[i] + s)))
        fn = 1.0
        if fnw:
            fn = (1.0 + p) if labels[i] > 0.5 else (1.0 - p) * (1.0 + p)
        for k in range(starts[i], starts[i + 1]):
            r = rows_of[k]
            g = (p - labels[i]) * weights[k] * fn
            w, a, b = columns[r, 0], columns[r, 1], columns[r, 2]
            if rule != 2 and l2 > 0:  # FTRL takes its L2 in its closed form
                g += l2 * w
            if rule == 0:  # sgd
                w -= lr * g
            elif rule == 1:  # adagrad: a = sum of squared gradients
                a += g * g
                w -= lr * g / (math.sqrt(a + accumulator) + eps)
            elif rule == 2:  # ftrl: a = z, b = n
                root_old = roots[r]
                b += g * g
                root_new = math.sqrt(b + accumulator)
                roots[r] = root_new
                a += g - (root_new - root_old) / lr * w
                if abs(a) <= l1:
                    w = 0.0
                else:
                    w = -(a - math.copysign(l1, a)) / ((root_new + ftrl_beta) / lr + l2)
            else:  # adam (lazy): a = exp_avg, b = exp_avg_sq, bias-corrected at the batch's step
                a = beta1 * a + (1.0 - beta1) * g
                b = beta2 * b + (1.0 - beta2) * g * g
                denom = math.sqrt(b / (1.0 - beta2**step)) + eps
                w -= lr / (1.0 - beta1**step) * a / denom
            columns[r, 0], columns[r, 1], columns[r, 2] = w, a, b
    return shift
