"""The inputs both libraries get, written once to a directory, and the numpy reference of
one step that their results are checked against.

The driver writes, for a workload (`Inputs.write`):

  manifest.json                the workload, seed, ids kind, learning rate, eps, batches
  table_I.npy   [rows, dim]    table I's initial values, float32, uniform in +-1/sqrt(dim)
  ids_K_I.npy   [B, hotness]   batch K's ids of feature I (table I), int32, every bag full
  grad_I.npy    [B, dim]       the output gradient of feature I, float32 uniform in [-1, 1),
                               the same at every step (the dense part is not benchmarked)
  rows_I.npy    [R]            the rows of table I compared after the first step: up to
                               `SAMPLE_TOUCHED` rows batch 0 touches (its most frequent ids
                               first, then others at random) and `SAMPLE_UNTOUCHED` it does not

Workers read them (memory-mapped) and copy them into their own structures, so both start
from the same tables, ids and gradients. Ids are the library's synthetic Zipf ids
(`embark_jax.data.synthetic.SyntheticDataset(..., alpha=1.1)`, batch K = `batch(K)`) or
uniform ones (`numpy.random.default_rng`).

The reference (float64) of step 1 on batch 0: the pooled outputs, and the sampled rows after
exact row-wise Adagrad (gradients of a row summed over the whole batch, one accumulator per
row: `acc += mean(g * g)`, `w -= lr * g / (sqrt(acc) + eps)`, both libraries' rule).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from experiments.collection.workloads import Workload

SAMPLE_TOUCHED = 2048
SAMPLE_UNTOUCHED = 256
HOT_FIRST = 256
CHUNK_ROWS = 1 << 20
LEARNING_RATE = 0.01  # TBE's default learning rate
EPS = 1e-8  # TBE's default eps, and RowWiseAdagrad's


@dataclasses.dataclass(frozen=True)
class Inputs:
    """A directory of inputs (see the module docstring)."""

    root: str
    workload: Workload
    batches: int
    seed: int = 0
    ids: str = "zipf"
    learning_rate: float = LEARNING_RATE
    eps: float = EPS

    # --- paths -------------------------------------------------------------------------

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def table(self, i: int) -> np.ndarray:
        return np.load(self.path(f"table_{i}.npy"), mmap_mode="r")

    def batch_ids(self, k: int, i: int) -> np.ndarray:
        return np.load(self.path(f"ids_{k}_{i}.npy"))

    def grad(self, i: int) -> np.ndarray:
        return np.load(self.path(f"grad_{i}.npy"))

    def sample_rows(self, i: int) -> np.ndarray:
        return np.load(self.path(f"rows_{i}.npy"))

    @property
    def manifest(self) -> str:
        return self.path("manifest.json")

    # --- reading and writing -----------------------------------------------------------

    @classmethod
    def load(cls, manifest: str) -> Inputs:
        with open(manifest) as fh:
            d = json.load(fh)
        d["workload"] = Workload.from_json(d["workload"])
        d["root"] = os.path.dirname(os.path.abspath(manifest))
        return cls(**d)

    def write(self) -> Inputs:
        """Writes every input file, then the manifest."""
        w = self.workload
        os.makedirs(self.root, exist_ok=True)
        for i, t in enumerate(w.tables):
            _write_table(self.path(f"table_{i}.npy"), t.rows, t.dim, [self.seed, 3, i])
            rng = np.random.default_rng([self.seed, 4, i])
            g = rng.random((w.batch, t.dim), dtype=np.float32) * 2 - 1
            np.save(self.path(f"grad_{i}.npy"), g)
        for k in range(self.batches):
            for i, ids in enumerate(self._make_ids(k)):
                np.save(self.path(f"ids_{k}_{i}.npy"), ids)
        for i, t in enumerate(w.tables):
            rows = sample_rows(self.batch_ids(0, i), t.rows, [self.seed, 5, i])
            np.save(self.path(f"rows_{i}.npy"), rows)
        d = dataclasses.asdict(self)
        d["workload"] = w.to_json()
        del d["root"]
        with open(self.manifest, "w") as fh:
            json.dump(d, fh, indent=1)
        return self

    def _make_ids(self, k: int) -> list[np.ndarray]:
        w = self.workload
        if self.ids == "uniform":
            rng = np.random.default_rng([self.seed, 6, k])
            return [rng.integers(0, t.rows, (w.batch, t.hotness), dtype=np.int32) for t in w.tables]
        if self.ids != "zipf":
            raise ValueError(f"ids must be 'zipf' or 'uniform', got {self.ids!r}")
        from embark_jax.data.synthetic import SyntheticDataset

        ds = SyntheticDataset(embedding_config(w), batch_size=w.batch, seed=self.seed)
        ids = ds.batch(k).sparse.ids
        return [np.asarray(ids[w.feature(t)], np.int32) for t in w.tables]


def embedding_config(w: Workload, initializer=None):
    """The workload as an `EmbeddingConfig` (one feature per table, its pooling; the tables'
    `initializer`, the library's default when None)."""
    from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig

    tables = [
        TableConfig(name=t.name, vocab_size=t.rows, dim=t.dim, initializer=initializer)
        for t in w.tables
    ]
    features = [
        FeatureConfig(name=w.feature(t), table=t.name, max_hotness=t.hotness, combiner=w.pooling)
        for t in w.tables
    ]
    return EmbeddingConfig.create(tables, features)


def _write_table(path: str, rows: int, dim: int, seed) -> None:
    """Uniform in +-1/sqrt(dim), float32, generated and written a chunk of rows at a time."""
    rng = np.random.default_rng(seed)
    a = np.float32(1.0 / np.sqrt(dim))
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    for lo in range(0, rows, CHUNK_ROWS):
        hi = min(rows, lo + CHUNK_ROWS)
        out[lo:hi] = (rng.random((hi - lo, dim), dtype=np.float32) * 2 - 1) * a
    out.flush()
    del out


def sample_rows(ids: np.ndarray, rows: int, seed) -> np.ndarray:
    """Sorted rows to compare after step 1: the `HOT_FIRST` most frequent ids of the batch,
    other touched rows at random up to `SAMPLE_TOUCHED`, and up to `SAMPLE_UNTOUCHED`
    untouched rows (their values must not change)."""
    rng = np.random.default_rng(seed)
    uniq, counts = np.unique(ids[ids >= 0], return_counts=True)
    order = np.argsort(-counts, kind="stable")
    hot, rest = uniq[order[:HOT_FIRST]], uniq[order[HOT_FIRST:]]
    take = min(len(rest), max(0, SAMPLE_TOUCHED - len(hot)))
    touched = np.concatenate([hot, rng.choice(rest, take, replace=False)])
    untouched = []
    if rows > len(uniq):
        cand = rng.integers(0, rows, 4 * SAMPLE_UNTOUCHED + 16)
        cand = np.unique(cand[~np.isin(cand, uniq)])
        untouched = rng.permutation(cand)[:SAMPLE_UNTOUCHED]
    return np.sort(np.concatenate([touched, untouched]).astype(np.int64))


# --- the reference of step 1 -----------------------------------------------------------------


def reference_output(inp: Inputs, i: int) -> np.ndarray:
    """Feature i's pooled output `[B, dim]` of batch 0 before any update (float64)."""
    ids = inp.batch_ids(0, i)
    table = inp.table(i)
    out = np.zeros((ids.shape[0], table.shape[1]))
    for j in range(ids.shape[1]):  # one id column at a time: a [B, dim] gather each
        out += table[ids[:, j]]
    if inp.workload.pooling == "mean":
        out /= ids.shape[1]
    return out


def reference_rows(inp: Inputs, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(initial, updated) values of table i's sampled rows after step 1 on batch 0
    (float64); untouched rows keep their values."""
    ids, grad, rows = inp.batch_ids(0, i), inp.grad(i).astype(np.float64), inp.sample_rows(i)
    if inp.workload.pooling == "mean":
        grad = grad / ids.shape[1]
    flat = ids.reshape(-1)
    bag = np.repeat(np.arange(ids.shape[0]), ids.shape[1])
    hit = np.isin(flat, rows)
    g = np.zeros((len(rows), grad.shape[1]))
    np.add.at(g, np.searchsorted(rows, flat[hit]), grad[bag[hit]])
    w0 = np.asarray(inp.table(i)[rows], np.float64)
    acc = np.mean(g * g, axis=1)
    step = inp.learning_rate / (np.sqrt(acc) + inp.eps)
    return w0, w0 - step[:, None] * g
