"""Progressive (test-then-train) AUC, logloss and calibration, cumulative and over a sliding window.

Calibration: a CTR is a price input, so the mean predicted CTR should match the observed click
rate, in every range of predictions. The expected calibration error (ECE) over 10 equal-width
bins of predicted probability is sum_b (n_b / N) * |mean prediction in b - click rate in b|.

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


CALIBRATION_BINS = 10


def calibration_sums(labels: np.ndarray, probs: np.ndarray, bins: int = CALIBRATION_BINS) -> np.ndarray:
    """(3, bins) float64: per bin of predicted probability, [events, sum of predictions, clicks]."""
    idx = np.clip((np.asarray(probs) * bins).astype(np.int64), 0, bins - 1)
    return np.stack(
        [
            np.bincount(idx, minlength=bins).astype(np.float64),
            np.bincount(idx, weights=np.asarray(probs, dtype=np.float64), minlength=bins),
            np.bincount(idx, weights=np.asarray(labels, dtype=np.float64), minlength=bins),
        ]
    )


def ece_from_sums(sums: np.ndarray) -> float:
    """Expected calibration error from calibration_sums (NaN without events)."""
    total = sums[0].sum()
    if total == 0:
        return float("nan")
    return float(np.abs(sums[1] - sums[2]).sum() / total)


def ece(labels: np.ndarray, probs: np.ndarray, bins: int = CALIBRATION_BINS) -> float:
    """Expected calibration error over `bins` equal-width bins of predicted probability."""
    return ece_from_sums(calibration_sums(labels, probs, bins))


def calibration_summary(sums: np.ndarray, prefix: str) -> dict[str, float]:
    total = sums[0].sum()
    return {
        f"{prefix}_ece": ece_from_sums(sums),
        f"{prefix}_mean_ctr": float(sums[1].sum() / total) if total else float("nan"),
        f"{prefix}_observed_ctr": float(sums[2].sum() / total) if total else float("nan"),
    }


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
        self.calibration = np.zeros((3, CALIBRATION_BINS))  # see calibration_sums
        self._window: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._window_len = 0
        self.window = window

    def update(self, labels: np.ndarray, probs: np.ndarray) -> None:
        idx = np.clip((probs * self.bins).astype(np.int64), 0, self.bins - 1)
        self.pos_hist += np.bincount(idx[labels == 1], minlength=self.bins)
        self.neg_hist += np.bincount(idx[labels == 0], minlength=self.bins)
        self.loss_sum += logloss(labels, probs) * len(labels)
        self.count += len(labels)
        self.calibration += calibration_sums(labels, probs)
        self._window.append((labels, probs))
        self._window_len += len(labels)
        while self._window_len - len(self._window[0][0]) >= self.window:
            self._window_len -= len(self._window.popleft()[0])

    def state(self) -> dict[str, np.ndarray]:
        """Everything the metrics have counted, as arrays (a recovery snapshot's metrics file), so
        a resumed trainer reports over the whole stream, not only what came after the restart."""
        labels, probs = self.window_arrays()
        return {
            "pos_hist": self.pos_hist.copy(),
            "neg_hist": self.neg_hist.copy(),
            "loss_sum_count": np.array([self.loss_sum, float(self.count)], dtype=np.float64),
            "calibration": self.calibration.copy(),
            "window_labels": np.asarray(labels, dtype=np.float32),
            "window_probs": np.asarray(probs, dtype=np.float32),
        }

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Continue from state() (the histogram resolution must match)."""
        if state["pos_hist"].shape != self.pos_hist.shape:
            raise ValueError(f"metrics state of {state['pos_hist'].shape[0]} bins; these metrics have {self.bins}")
        self.pos_hist = state["pos_hist"].astype(np.int64)
        self.neg_hist = state["neg_hist"].astype(np.int64)
        self.loss_sum, count = (float(v) for v in state["loss_sum_count"])
        self.count = int(count)
        self.calibration = state["calibration"].astype(np.float64)
        self._window.clear()
        self._window_len = 0
        if len(state["window_labels"]):
            self._window.append((state["window_labels"], state["window_probs"]))
            self._window_len = len(state["window_labels"])

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
            **calibration_summary(self.calibration, "progressive"),
            **calibration_summary(calibration_sums(labels, probs), "window"),
            "events": float(self.count),
        }


def merged_summary(metrics: ProgressiveMetrics) -> dict[str, float]:
    """Cumulative progressive AUC / logloss over every replica's predictions (a collective: the
    histograms and loss sums are all-reduced, so the figure is what one process scoring the whole
    stream would report, to histogram resolution)."""
    merged = merged_metrics(metrics)
    return {
        "progressive_auc": merged.auc(),
        "progressive_logloss": merged.logloss(),
        **calibration_summary(merged.calibration, "progressive"),
        "events": float(merged.count),
    }


def merged_metrics(metrics: ProgressiveMetrics) -> ProgressiveMetrics:
    """Every replica's cumulative counts added up (a collective), with this replica's own window:
    what a group's snapshot keeps (rank 0 restores it, the others start from zero, so the sums
    stay right)."""
    import torch
    import torch.distributed as dist

    merged = ProgressiveMetrics(window=metrics.window, bins=metrics.bins)
    merged._window, merged._window_len = deque(metrics._window), metrics._window_len
    hist = torch.from_numpy(np.stack([metrics.pos_hist, metrics.neg_hist]))
    sums = torch.tensor([metrics.loss_sum, float(metrics.count)], dtype=torch.float64)
    calibration = torch.from_numpy(metrics.calibration.copy())
    if dist.is_initialized():
        from trainer.merge import comm_device

        hist, sums, calibration = hist.to(comm_device()), sums.to(comm_device()), calibration.to(comm_device())
        dist.all_reduce(hist)
        dist.all_reduce(sums)
        dist.all_reduce(calibration)
        hist, sums, calibration = hist.cpu(), sums.cpu(), calibration.cpu()
    merged.pos_hist, merged.neg_hist = hist[0].numpy(), hist[1].numpy()
    merged.loss_sum, merged.count = float(sums[0]), int(sums[1])
    merged.calibration = calibration.numpy()
    return merged
