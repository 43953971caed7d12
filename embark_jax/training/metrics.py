"""Evaluation metrics computed on the host: logloss and AUC."""

from __future__ import annotations

import numpy as np

__all__ = ["StreamingAUC", "auc", "logloss"]


def logloss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
    p = np.clip(np.asarray(probs, np.float64), eps, 1 - eps)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with average ranks for ties); 0.5 if one class only."""
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, np.float64).ravel()
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return 0.5
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), np.float64)
    sorted_s = s[order]
    # average ranks over ties
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


class StreamingAUC:
    """AUC and logloss accumulated over batches: scores are binned into `bins` equal-width
    probability bins (ties inside a bin count half), exact to ~1/bins; logloss is exact."""

    def __init__(self, bins: int = 100_000):
        self.bins = bins
        self.pos = np.zeros(bins, np.int64)
        self.neg = np.zeros(bins, np.int64)
        self.loss_sum = 0.0
        self.count = 0

    def update(self, labels: np.ndarray, probs: np.ndarray) -> None:
        y = np.asarray(labels).astype(bool).ravel()
        p = np.asarray(probs, np.float64).ravel()
        idx = np.clip((p * self.bins).astype(np.int64), 0, self.bins - 1)
        self.pos += np.bincount(idx[y], minlength=self.bins)
        self.neg += np.bincount(idx[~y], minlength=self.bins)
        self.loss_sum += logloss(y, p) * y.size
        self.count += y.size

    def auc(self) -> float:
        pos, neg = self.pos.sum(), self.neg.sum()
        if pos == 0 or neg == 0:
            return 0.5
        neg_below = np.cumsum(self.neg) - self.neg
        return float((self.pos * (neg_below + 0.5 * self.neg)).sum() / (pos * neg))

    def logloss(self) -> float:
        return self.loss_sum / max(self.count, 1)
