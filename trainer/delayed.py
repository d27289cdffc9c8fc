"""Learning from labels that come late: the fake-negative corrections of Ktena et al. (RecSys 2019). Pure.

Under the join's `fake_negative` policy (stream/join.py) every impression is first learned as a
negative and a clicked one is learned again as a positive copy. The labels the trainer sees are
then drawn from b(x) = p(x) / (1 + p(x)) instead of the true click probability p(x). Two ways back:

- FN weighting (FNW): weight the logloss so its expectation under the biased labels is the
  logloss under the true ones: a positive by 1 + p, a negative by (1 - p)(1 + p), with p the
  model's own prediction, taken as a constant (detached).
- FN calibration (FNC): learn b with the plain logloss and serve p = b / (1 - b).

`trainer.optim.delayed_feedback` chooses one; it travels in the model's config (ModelConfig), so
trainer/step.py weights the loss under "fnw" (the wide part's per-event steps too: trainer/wide.py)
and scores, serves and measures b / (1 - b) under "fnc" (`ctr_of`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fn_weights(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FNW's per-event weights (B,): 1 + p for a positive, (1 - p)(1 + p) for a negative, p detached."""
    p = torch.sigmoid(logits.detach())
    return torch.where(labels > 0.5, 1 + p, (1 - p) * (1 + p))


def fn_weighted_logloss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The FNW loss: mean over the batch of the weighted binary cross-entropy. logits, labels (B,)."""
    return F.binary_cross_entropy_with_logits(logits, labels, weight=fn_weights(logits, labels))


def fn_calibrated(biased: torch.Tensor) -> torch.Tensor:
    """FNC's served CTR from a model of the fake-negative labels: b / (1 - b), which is p when
    b = p / (1 + p); clipped to [0, 1] (b above 1/2 has no true probability behind it)."""
    return (biased / (1 - biased).clamp_min(1e-7)).clamp(0.0, 1.0)
