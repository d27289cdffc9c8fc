"""Learning from labels that come late: the fake-negative corrections of Ktena et al. (RecSys 2019). Pure.

Under the join's `fake_negative` policy (stream/join/policy.py) every impression is first learned as a
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

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F


def fn_weights(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FNW's per-event weights (B,): 1 + p for a positive, (1 - p)(1 + p) for a negative, p detached."""
    p = torch.sigmoid(logits.detach())
    return torch.where(labels > 0.5, 1 + p, (1 - p) * (1 + p))


def fn_weighted_logloss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The FNW loss per impression: the mean over the batch's events of the weighted binary
    cross-entropy, times 1 + the batch's mean p (p detached). Under fake_negative an impression comes
    as 1 + p events on average (its negative, and a positive copy with chance p), so a mean over the
    events shrinks each impression's step, against a trainer of final labels, by that much. The
    factor is the model's expectation, not the batch's count of first emissions: a batch that
    happens to hold mostly positive copies would otherwise take an outsized step (dividing by that
    count spread the demo's served AUC over 0.018 in 6 runs; this factor: 0.0015 in 4, as no factor).
    On the drifting synthetic stream (`bench join`, 30-minute window, 3 arrival seeds) it is
    0.0003-0.0005 AUC nearer the oracle than the plain mean. logits, labels (B,)."""
    mean = F.binary_cross_entropy_with_logits(logits, labels, weight=fn_weights(logits, labels))
    return mean * (1 + torch.sigmoid(logits.detach()).mean())


def fn_calibrated(biased: torch.Tensor) -> torch.Tensor:
    """FNC's served CTR from a model of the fake-negative labels: b / (1 - b), which is p when
    b = p / (1 + p); clipped to [0, 1] (b above 1/2 has no true probability behind it)."""
    return (biased / (1 - biased).clamp_min(1e-7)).clamp(0.0, 1.0)


class FinalLabels:
    """Progressive metrics against final labels under the fake_negative policy: each impression
    scored once, with the prediction made when it first arrived (its label-0 emission), against the
    label it has once its window is over (1 if a positive copy came, else 0).

    Under fake_negative every first emission is labelled 0 and every later one 1, so the labels
    alone say which is which. `add(event_ids, labels, probs, now_ms)` holds the first emissions,
    marks the held ones a copy names as clicked, and returns (labels, probs) of the impressions
    whose wait is over (first seen more than `wait_ms` of event time ago), in the order they came.
    Event time here is a watermark over the batches topic's partitions: the oldest of each
    partition's newest `now_ms` (`partitions`: the ones the batch came from), never going back. A
    replica reads its partitions unevenly: a clock run by the fastest one would score impressions
    before their copies in a slower partition were read, as unclicked. A copy read before its
    impression's negative (they came through different partitions of the events or batches topics,
    read in another order) is kept for `wait_ms`: the negative that follows is then held as clicked,
    with the copy's prediction (made before the model learned either of the two; the negative's own
    came after the model had learned the copy). A copy whose impression is not held and whose
    negative does not follow within `wait_ms` (scored already, or seen by another replica) changes
    nothing. At
    most `max_held` impressions are held; past that the oldest are scored early (a metric of a
    little less delay, never lost memory). `idle()`, when the replica has read all there is, lets
    the clock go to the newest time read (no partition holds it back then: a stream's end would
    otherwise leave its last partitions' impressions unscored, as many as the partitions' ends lie
    apart).
    """

    def __init__(self, wait_ms: int, max_held: int = 2_000_000) -> None:
        self.wait_ms, self.max_held = wait_ms, max_held
        self._held: dict[str, list] = {}  # event id -> [prob, first seen ms, clicked]; insertion order = time order
        self._early: dict[str, list] = {}  # event id -> [prob, seen ms] of a copy read before its negative
        self.clock = -(1 << 62)  # event time (ms): the oldest partition's newest, never going back
        self._newest: dict[int, int] = {}  # batches-topic partition -> newest event time read from it

    def add(
        self,
        event_ids: tuple[str, ...],
        labels: np.ndarray,
        probs: np.ndarray,
        now_ms: int,
        partitions: Iterable[int] = (0,),
    ) -> tuple[np.ndarray, np.ndarray]:
        held = self._held
        for p in partitions:
            self._newest[p] = max(self._newest.get(p, now_ms), now_ms)
        if self._newest:
            self.clock = max(self.clock, min(self._newest.values()))
        now_ms = self.clock
        for event_id, label, prob in zip(event_ids, labels.tolist(), probs.tolist(), strict=True):
            if label < 0.5:
                if event_id not in held:
                    early = self._early.pop(event_id, None) if self._early else None
                    held[event_id] = [prob, now_ms, 0] if early is None else [early[0], now_ms, 1]
            elif event_id in held:
                held[event_id][2] = 1
            else:
                self._early.setdefault(event_id, [prob, now_ms])
        return self._release()

    def idle(self) -> tuple[np.ndarray, np.ndarray]:
        """Every partition read to its end (nothing came for a while): none holds the clock back,
        which moves to the newest event time read; returns what that made final, as `add`."""
        if self._newest:
            self.clock = max(self.clock, max(self._newest.values()))
        return self._release()

    def _release(self) -> tuple[np.ndarray, np.ndarray]:
        """Score the held impressions whose wait is over at the clock, oldest first."""
        held, now_ms, early = self._held, self.clock, self._early
        while early:  # copies whose negative did not follow in time: scored already, or another replica's
            event_id, (_, seen) = next(iter(early.items()))
            if now_ms - seen <= self.wait_ms and len(early) <= self.max_held:
                break
            del early[event_id]
        done_labels, done_probs = [], []
        while held:
            event_id, (prob, seen, clicked) = next(iter(held.items()))
            if now_ms - seen <= self.wait_ms and len(held) <= self.max_held:
                break
            del held[event_id]
            done_labels.append(clicked)
            done_probs.append(prob)
        return np.asarray(done_labels, dtype=np.float32), np.asarray(done_probs, dtype=np.float64)

    def __len__(self) -> int:
        return len(self._held)
