"""Synthetic recommendation data, the paper's generator: Zipf-skewed ids per table.

Each table draws ids from a bounded Zipf(alpha) law over [0, V): rank r (0 = hottest) has
probability ~ (r + 1)^-alpha, and ranks are mapped to ids through a per-table random
permutation, so hot ids are spread over the table (as real data is). The permutation is an
affine bijection `id = (a * r + c) mod V` with `gcd(a, V) = 1`: O(1) memory at any V.

Labels come from a hidden teacher: each (table, id) has a fixed hidden score, each dense
feature a hidden weight; the label is Bernoulli(sigmoid(teacher logit)). A model that learns
the hot ids' embeddings and the dense weights beats chance, so training runs can be judged.

Batches are a pure function of (seed, step): nothing is held in memory, and a run can resume
from any step.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping

import numpy as np

from embark_jax.core.dynamic import key_words
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.batch import Batch
from embark_jax.data.sparse import PAD, SparseFeatures

__all__ = ["SyntheticDataset", "zipf_ranks"]


def zipf_ranks(rng: np.random.Generator, alpha: float, vocab: int, size) -> np.ndarray:
    """Ranks in [0, vocab) from a bounded power law with exponent `alpha` (inverse CDF of the
    continuous law on [1, vocab + 1), floored): P(rank r) ~ (r + 1)^-alpha."""
    u = rng.random(size)
    if alpha <= 0:
        x = 1.0 + u * vocab
    elif abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * math.log(vocab + 1.0))
    else:
        e = 1.0 - alpha
        x = (((vocab + 1.0) ** e - 1.0) * u + 1.0) ** (1.0 / e)
    return np.minimum(np.floor(x).astype(np.int64) - 1, vocab - 1).clip(0)


def _affine_permutation(seed: int, vocab: int) -> tuple[int, int]:
    rng = np.random.default_rng([seed, vocab, 7])
    if vocab == 1:
        return 1, 0
    a = int(rng.integers(1, vocab)) | 1
    while math.gcd(a, vocab) != 1:
        a = (a + 2) % vocab or 1
    c = int(rng.integers(0, vocab))
    return a, c


def _hidden_score(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random value in [-1, 1) per id (splitmix64 of id ^ salt)."""
    z = ids.astype(np.uint64) ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 52) - 1.0


class SyntheticDataset:
    """Deterministic stream of synthetic batches for an `EmbeddingConfig`.

    Arguments:
      config: tables and features; each feature draws up to `max_hotness` ids per sample
        from its table's Zipf law.
      batch_size: global batch size B.
      alpha: Zipf exponent, one for all tables or a mapping table name -> alpha (default 1.1,
        as in the paper).
      num_dense: number of dense features (default 13, as Criteo).
      varying_lengths: if True each bag has a uniform random length in [1, max_hotness];
        otherwise every bag is full.
      seed: the stream's seed; batch `step` is a pure function of (seed, step).
      dynamic_features: names of features of `config` served as dynamic-table ids instead
        (`Batch.dynamic`, uint32 words `[B, H, 2]`, each id its own 64-bit key): the
        stream is the same, and `fixed_config` (`config` without them and their tables)
        is the config of the batches' `sparse` part.
    """

    def __init__(
        self,
        config: EmbeddingConfig,
        *,
        batch_size: int,
        alpha: float | Mapping[str, float] = 1.1,
        num_dense: int = 13,
        varying_lengths: bool = False,
        seed: int = 0,
        dynamic_features: Collection[str] = (),
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config = config
        self.dynamic_features = frozenset(dynamic_features)
        self.fixed_config = _without(config, self.dynamic_features)
        self.batch_size = int(batch_size)
        self.num_dense = int(num_dense)
        self.varying_lengths = varying_lengths
        self.seed = int(seed)
        self._alpha = {
            t.name: float(alpha[t.name] if isinstance(alpha, Mapping) else alpha)
            for t in config.tables
        }
        self._perm = {
            t.name: _affine_permutation(seed + i, t.vocab_size) for i, t in enumerate(config.tables)
        }
        rng = np.random.default_rng([seed, 1])
        self._dense_w = rng.normal(size=num_dense) / math.sqrt(max(num_dense, 1))
        self._salt = {t.name: int(rng.integers(0, 2**62)) for t in config.tables}

    def alpha(self, table: str) -> float:
        return self._alpha[table]

    def ids(self, rng: np.random.Generator, table: str, shape) -> np.ndarray:
        """Zipf ids of `table`, permuted (ranks -> ids)."""
        vocab = self.config.table_by_name[table].vocab_size
        ranks = zipf_ranks(rng, self._alpha[table], vocab, shape)
        a, c = self._perm[table]
        return ((ranks * a + c) % vocab).astype(np.int64)

    def rank_of(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Inverse of the permutation: the Zipf rank of each id (0 = hottest)."""
        vocab = self.config.table_by_name[table].vocab_size
        a, c = self._perm[table]
        a_inv = pow(a, -1, vocab) if vocab > 1 else 0
        return ((np.asarray(ids, np.int64) - c) % vocab * a_inv) % vocab

    def batch(self, step: int) -> Batch:
        """Batch number `step` of the stream."""
        rng = np.random.default_rng([self.seed, 2, int(step)])
        b = self.batch_size
        ids, logit = {}, np.zeros(b)
        for f in self.config.features:
            h = f.max_hotness
            x = self.ids(rng, f.table, (b, h))
            if self.varying_lengths:
                lengths = rng.integers(1, h + 1, size=b)
                x = np.where(np.arange(h)[None, :] < lengths[:, None], x, PAD)
            valid = x >= 0
            score = np.where(valid, _hidden_score(np.maximum(x, 0), self._salt[f.table]), 0.0)
            logit += score.sum(axis=1) / np.maximum(valid.sum(axis=1), 1)
            ids[f.name] = x
        dense = rng.normal(size=(b, self.num_dense)).astype(np.float32)
        logit = logit * 1.5 + dense @ self._dense_w
        logit = 2.5 * logit / math.sqrt(len(self.config.features) * 0.75 + 1.0)
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        words = {
            k: key_words(ids.pop(k).reshape(-1)).reshape(b, -1, 2) for k in self.dynamic_features
        }
        sparse = SparseFeatures.from_dense(ids, config=self.fixed_config)
        return Batch(sparse=sparse, dense=dense, labels=labels, dynamic=words)

    def batches(self, start: int = 0, num: int | None = None) -> Iterator[Batch]:
        """Streams batches `start, start + 1, ...` (forever when `num` is None)."""
        step = start
        while num is None or step < start + num:
            yield self.batch(step)
            step += 1


def _without(config: EmbeddingConfig, features: frozenset[str]) -> EmbeddingConfig:
    """`config` without `features` and the tables only they look up."""
    if not features:
        return config
    unknown = sorted(features - {f.name for f in config.features})
    if unknown:
        raise ValueError(f"dynamic_features {unknown} are not features of the config")
    kept = [f for f in config.features if f.name not in features]
    used = {f.table for f in kept}
    return EmbeddingConfig.create([t for t in config.tables if t.name in used], kept)
