"""Progressive (test-then-train) AUC and logloss, cumulative and over a sliding window.

Cumulative AUC uses fixed histograms of predicted probability (bounded memory for an endless
stream; ties within a bin count one half, error well below 1e-3 with 10^4 bins); the window AUC
is exact over the last `window` events.
"""

from __future__ import annotations

from collections import deque

import numpy as np

_EPS = 1e-7


def auc_exact(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mann-Whitney AUC with average ranks for ties; NaN if one class is absent."""
    labels = np.asarray(labels, dtype=np.float64)
    pos = labels.sum()
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(probs, kind="mergesort")
    sorted_p = np.asarray(probs)[order]
    ranks = np.empty(len(probs), dtype=np.float64)
    _, first, counts = np.unique(sorted_p, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    p = np.clip(probs, _EPS, 1 - _EPS)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


class ProgressiveMetrics:
    def __init__(self, window: int = 10_000, bins: int = 10_000) -> None:
        self.bins = bins
        self.pos_hist = np.zeros(bins, dtype=np.int64)
        self.neg_hist = np.zeros(bins, dtype=np.int64)
        self.loss_sum = 0.0
        self.count = 0
        self._window: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._window_len = 0
        self.window = window

    def update(self, labels: np.ndarray, probs: np.ndarray) -> None:
        idx = np.clip((probs * self.bins).astype(np.int64), 0, self.bins - 1)
        self.pos_hist += np.bincount(idx[labels == 1], minlength=self.bins)
        self.neg_hist += np.bincount(idx[labels == 0], minlength=self.bins)
        self.loss_sum += logloss(labels, probs) * len(labels)
        self.count += len(labels)
        self._window.append((labels, probs))
        self._window_len += len(labels)
        while self._window_len - len(self._window[0][0]) >= self.window:
            self._window_len -= len(self._window.popleft()[0])

    def auc(self) -> float:
        pos, neg = self.pos_hist.sum(), self.neg_hist.sum()
        if pos == 0 or neg == 0:
            return float("nan")
        neg_below = np.cumsum(self.neg_hist) - self.neg_hist
        return float((self.pos_hist * (neg_below + 0.5 * self.neg_hist)).sum() / (pos * neg))

    def logloss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    def window_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._window:
            return np.zeros(0), np.zeros(0)
        return np.concatenate([w[0] for w in self._window]), np.concatenate([w[1] for w in self._window])

    def summary(self) -> dict[str, float]:
        labels, probs = self.window_arrays()
        return {
            "progressive_auc": self.auc(),
            "progressive_logloss": self.logloss(),
            "window_auc": auc_exact(labels, probs) if len(labels) else float("nan"),
            "window_logloss": logloss(labels, probs) if len(labels) else float("nan"),
            "events": float(self.count),
        }


def merged_summary(metrics: ProgressiveMetrics) -> dict[str, float]:
    """Cumulative progressive AUC / logloss over every replica's predictions (a collective: the
    histograms and loss sums are all-reduced, so the figure is what one process scoring the whole
    stream would report, to histogram resolution)."""
    import torch
    import torch.distributed as dist

    merged = ProgressiveMetrics(window=1, bins=metrics.bins)
    hist = torch.from_numpy(np.stack([metrics.pos_hist, metrics.neg_hist]))
    sums = torch.tensor([metrics.loss_sum, float(metrics.count)], dtype=torch.float64)
    if dist.is_initialized():
        from trainer.merge import comm_device

        hist, sums = hist.to(comm_device()), sums.to(comm_device())
        dist.all_reduce(hist)
        dist.all_reduce(sums)
        hist, sums = hist.cpu(), sums.cpu()
    merged.pos_hist, merged.neg_hist = hist[0].numpy(), hist[1].numpy()
    merged.loss_sum, merged.count = float(sums[0]), int(sums[1])
    return {"progressive_auc": merged.auc(), "progressive_logloss": merged.logloss(), "events": float(merged.count)}
