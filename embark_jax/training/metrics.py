"""Training metrics: logloss and AUC, exact on the host, and accumulated on the device.

`DeviceMetrics` sums what a step reports inside the compiled step (loss, per-sample logloss,
binned AUC histograms, overflow and invalid counts), so the host reads them only when it
prints or logs; `StreamingAUC` is the host-side total they drain into.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax.sharding.dynamic import COUNT_NAMES

__all__ = ["AUC_BINS", "DeviceMetrics", "HostSums", "StreamingAUC", "auc", "logloss"]

# Probability bins of the device AUC histograms (AUC exact to about 1 / AUC_BINS).
AUC_BINS = 16384
_EPS = 1e-7  # logloss clips probabilities to [eps, 1 - eps]


def logloss(labels: np.ndarray, probs: np.ndarray, eps: float = _EPS) -> float:
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


def _bin(probs, bins: int):
    return jnp.clip((probs * bins).astype(jnp.int32), 0, bins - 1)


class StreamingAUC:
    """AUC and logloss accumulated over batches: scores are binned into `bins` equal-width
    probability bins (ties inside a bin count half), exact to ~1/bins; logloss is exact.
    `add_sums` adds what a `DeviceMetrics` accumulated (same bins)."""

    def __init__(self, bins: int = AUC_BINS):
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

    def add_sums(self, pos: np.ndarray, neg: np.ndarray, logloss_sum: float, count: int) -> None:
        self.pos += np.asarray(pos, np.int64)
        self.neg += np.asarray(neg, np.int64)
        self.loss_sum += float(logloss_sum)
        self.count += int(count)

    def copy(self) -> StreamingAUC:
        out = StreamingAUC(self.bins)
        out.add_sums(self.pos, self.neg, self.loss_sum, self.count)
        return out

    def since(self, earlier: StreamingAUC) -> StreamingAUC:
        """What was added after `earlier` (a `copy` of this one taken then)."""
        out = StreamingAUC(self.bins)
        out.add_sums(
            self.pos - earlier.pos,
            self.neg - earlier.neg,
            self.loss_sum - earlier.loss_sum,
            self.count - earlier.count,
        )
        return out

    def auc(self) -> float:
        pos, neg = self.pos.sum(), self.neg.sum()
        if pos == 0 or neg == 0:
            return 0.5
        neg_below = np.cumsum(self.neg) - self.neg
        return float((self.pos * (neg_below + 0.5 * self.neg)).sum() / (pos * neg))

    def logloss(self) -> float:
        return self.loss_sum / max(self.count, 1)


def _kahan(total, comp, x):
    """Compensated float32 summation: `(total, comp)` plus `x`, the rounding error kept in
    `comp`, so `total + comp` tracks the exact sum over millions of steps."""
    y = x - comp
    t = total + y
    return t, (t - total) - y


class DeviceMetrics(NamedTuple):
    """Running sums over every step a runner ran, on the device (a pytree of replicated
    arrays, updated inside the compiled step; O(batch) per step). They are never reset, so
    any process may read them at any time without running anything on the device (no
    collective a single process could wait in): counts are uint32 that wrap (a reader takes
    differences modulo 2**32, reading often enough), float sums are compensated
    (`_kahan`: value + compensation)."""

    steps: jax.Array  # [] uint32, steps run (committed or refused)
    applied: jax.Array  # [] uint32, steps committed
    loss: jax.Array  # [2] float32, sum of the committed steps' mean losses (+ compensation)
    logloss: jax.Array  # [2] float32, sum of per-sample logloss (+ compensation)
    samples: jax.Array  # [] uint32
    pos: jax.Array  # [AUC_BINS] uint32, positive labels per probability bin
    neg: jax.Array  # [AUC_BINS] uint32
    overflow: jax.Array  # [num_tables] uint32, ids lost to a capacity (every step run)
    invalid: jax.Array  # [num_tables] uint32, ids outside their table (every step run)
    dynamic: jax.Array  # [num_dynamic_tables, len(COUNT_NAMES)] uint32, dynamic tables' ids

    @classmethod
    def zeros(cls, num_tables: int, bins: int = AUC_BINS, num_dynamic: int = 0) -> DeviceMetrics:
        # distinct arrays: the runner donates the sums, and one buffer cannot be donated twice
        def z(shape=(), dtype=jnp.uint32):
            return jnp.zeros(shape, dtype)

        return cls(
            z(),
            z(),
            z((2,), jnp.float32),
            z((2,), jnp.float32),
            z(),
            z((bins,)),
            z((bins,)),
            z((num_tables,)),
            z((num_tables,)),
            z((num_dynamic, len(COUNT_NAMES))),
        )

    def add_predictions(self, labels, probs, weight) -> DeviceMetrics:
        """These sums with a batch's predictions (log loss, AUC bins) added, if `weight`."""
        y = labels.astype(jnp.float32)
        p = jnp.clip(probs.astype(jnp.float32), _EPS, 1.0 - _EPS)
        ll = -jnp.sum(y * jnp.log(p) + (1.0 - y) * jnp.log1p(-p))
        idx = _bin(probs, self.pos.shape[0])
        w = weight.astype(jnp.uint32)
        pos = self.pos.at[idx].add(jnp.where(y > 0.5, w, 0).astype(jnp.uint32))
        neg = self.neg.at[idx].add(jnp.where(y > 0.5, 0, w).astype(jnp.uint32))
        logloss = jnp.stack(_kahan(*self.logloss, jnp.where(weight, ll, 0.0)))
        n = jnp.asarray(y.shape[0], jnp.uint32) * w
        return self._replace(logloss=logloss, samples=self.samples + n, pos=pos, neg=neg)

    def add_step(self, metrics, labels) -> DeviceMetrics:
        """These sums plus one train step's `metrics` (`train_step`'s) on `labels`."""
        applied = metrics["applied"]
        dynamic = self.dynamic
        if "dynamic" in metrics:  # a model with dynamic tables
            dynamic = dynamic + metrics["dynamic"].astype(jnp.uint32)
        out = self.add_predictions(labels, jax.nn.sigmoid(metrics["logits"]), applied)
        loss = jnp.stack(_kahan(*self.loss, jnp.where(applied, metrics["loss"], 0.0)))
        return out._replace(
            steps=self.steps + 1,
            applied=self.applied + applied.astype(jnp.uint32),
            loss=loss,
            overflow=self.overflow + metrics["overflow"].astype(jnp.uint32),
            invalid=self.invalid + metrics["invalid"].astype(jnp.uint32),
            dynamic=dynamic,
        )


class HostSums:
    """The host's int64 / float64 totals of a `DeviceMetrics`, from reads of its running
    sums: counts advance by the difference to the previous read modulo 2**32 (exact while
    fewer than 2**31 are added between two reads), float sums are read whole."""

    def __init__(self, num_tables: int, bins: int = AUC_BINS):
        self.raw = None  # the previous read's uint32 counts
        self.counts: dict[str, np.ndarray] = {}
        self.floats = {"loss": 0.0, "logloss": 0.0}
        self.num_tables, self.bins = num_tables, bins

    def read(self, sums: DeviceMetrics) -> None:
        """Takes a host copy (numpy) of the device sums."""
        counts = {k: np.asarray(getattr(sums, k), np.uint32) for k in _COUNTS}
        for k, v in counts.items():
            prev = self.raw[k] if self.raw else np.zeros_like(v)
            step = (v.astype(np.int64) - prev.astype(np.int64)) % (1 << 32)
            self.counts[k] = self.counts.get(k, 0) + step
        self.raw = counts
        for k in self.floats:
            hi, lo = (float(x) for x in np.asarray(getattr(sums, k), np.float64))
            self.floats[k] = hi - lo  # Kahan: the compensation holds the negated error


_COUNTS = ("steps", "applied", "samples", "pos", "neg", "overflow", "invalid", "dynamic")
