"""The shared part of the Criteo readers (`embark_jax.data.criteo`): the TSV line format,
the dense transform, bad-row accounting, and batches as a pure function of the step."""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from embark_jax.core.dynamic import DynamicConfig, key_words
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.batch import Batch
from embark_jax.data.prefetch import Prefetcher
from embark_jax.data.sparse import PAD, SparseFeatures

__all__ = [
    "MAX_EXAMPLES",
    "NUM_CATEGORICAL",
    "NUM_DENSE",
    "NUM_FIELDS",
    "TSV_LINE",
    "BadRow",
    "CriteoBase",
    "dense_transform",
    "parse_tsv_line",
]


NUM_DENSE = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
MAX_EXAMPLES = 5

_INT = re.compile(rb"-?[0-9]{1,18}")
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")
# a whole valid line in one match (the index pass's fast path; `parse_tsv_line` says why not)
TSV_LINE = re.compile(rb"[01](?:\t(?:-?[0-9]{1,18})?){13}(?:\t[0-9a-fA-F]{0,16}){26}\r?\n?")


class BadRow(ValueError):
    """A TSV line that is not a sample; `reason` is one of `CriteoTSV.REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def parse_tsv_line(line: bytes) -> tuple[int, list[int], list[int]]:
    """(label, 13 raw dense integers, 26 raw categorical integers) of one TSV line; missing
    values are 0. A `BadRow` when the line is not a valid sample."""
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != NUM_FIELDS:
        raise BadRow("field_count", f"{len(fields)} fields, expected {NUM_FIELDS}")
    label = fields[0]
    if label not in (b"0", b"1"):
        raise BadRow("label", f"label {label[:20]!r}")
    dense = []
    for j, x in enumerate(fields[1 : 1 + NUM_DENSE]):
        if not x:
            dense.append(0)
        elif _INT.fullmatch(x):
            dense.append(int(x))
        else:
            raise BadRow("dense", f"dense feature {j}: {x[:20]!r}")
    cats = []
    for j, x in enumerate(fields[1 + NUM_DENSE :]):
        if not x:
            cats.append(0)
        elif _HEX.fullmatch(x):
            cats.append(int(x, 16))
        else:
            raise BadRow("categorical", f"categorical feature {j}: {x[:20]!r}")
    return int(label), dense, cats


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """`log(1 + max(x, 0))` as float32 (missing values arrive as 0 and stay 0)."""
    return np.log1p(np.maximum(np.asarray(raw, np.float64), 0.0)).astype(np.float32)


class CriteoBase:
    """Batching, sharding over processes and prefetching; subclasses read samples: their
    `_open(source, **options)` opens `source` with the format's own keyword options, sets
    `_what` (the source in messages) and `_range`."""

    REASONS: tuple[str, ...] = ()

    def __init__(
        self,
        source: str,
        config: EmbeddingConfig,
        *,
        batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        prefetch: int = 1,
        dynamic: DynamicConfig | None = None,
        columns: Sequence[str] | None = None,
        **options: Any,
    ):
        features = _column_features(config, dynamic, columns)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process {process_index} of {process_count} is not a process")
        if batch_size % process_count:
            raise ValueError(
                f"batch size {batch_size} is not a multiple of the {process_count} processes"
            )
        self.config = config
        self.batch_size = int(batch_size)
        self.num_dense = NUM_DENSE
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.dynamic = dynamic
        self._features = features
        self._dynamic_names = frozenset(f.name for f in dynamic.features) if dynamic else ()
        self._vocab = [
            None if f.name in self._dynamic_names else config.table_by_name[f.table].vocab_size
            for f in features
        ]
        self._range = (0, 0)  # [lo, hi) of the underlying samples; set by the subclass
        self._prefetch_depth = int(prefetch)
        self._prefetcher = Prefetcher(self._global_batch, self._prefetch_depth)
        self._lock = threading.Lock()
        self.bad_rows: dict[str, int] = {r: 0 for r in self.REASONS}
        self.bad_examples: list[tuple[int, str]] = []
        self._open(str(source), **options)
        self._check_nonempty(self._what)

    def _open(self, source: str, **options: Any) -> None:
        raise NotImplementedError

    # --- samples -------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        lo, hi = self._range
        return hi - lo

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def sample_indices(self, step: int, rows: slice | None = None) -> np.ndarray:
        """Underlying sample numbers of batch `step`'s rows (default: this process's)."""
        if rows is None:
            r = self.local_batch_size
            rows = slice(self.process_index * r, (self.process_index + 1) * r)
        lo, _ = self._range
        i = np.arange(self.batch_size, dtype=np.int64)[rows]
        return lo + (int(step) * self.batch_size + i) % self.num_samples

    def split(self, holdout: int) -> tuple[CriteoBase, CriteoBase]:
        """(train, held out): the last `holdout` samples become a separate dataset sharing
        the index and files (its `batch(i)` for i = 0, 1, ... walks the held-out samples)."""
        lo, hi = self._range
        if not 0 < holdout < hi - lo:
            raise ValueError(f"cannot hold out {holdout} of {hi - lo} samples")
        return self._view(lo, hi - holdout), self._view(hi - holdout, hi)

    def _view(self, lo: int, hi: int):
        view = copy.copy(self)
        view._range = (lo, hi)
        view._prefetcher = Prefetcher(view._global_batch, self._prefetch_depth)
        return view

    def _check_nonempty(self, what: str) -> None:
        if self.num_samples < 1:
            raise ValueError(f"{what}: no valid samples")

    # --- batches -------------------------------------------------------------------------

    def batch(self, step: int) -> Batch:
        """Global batch `step` (see the module docstring for what other processes' rows
        hold); the next batch is built in the background meanwhile."""
        return self._prefetcher.get(step)

    def local_batch(self, step: int) -> Batch:
        """This process's rows of batch `step`, read from the data."""
        labels, dense, ids = self._read(self.sample_indices(step))
        return self._batch(labels, dense, ids)

    def _batch(self, labels, dense, ids) -> Batch:
        """The `Batch` of per-column ids: fixed ids to `sparse`, dynamic words to `dynamic`."""
        fixed = {k: v for k, v in ids.items() if k not in self._dynamic_names}
        words = {k: v for k, v in ids.items() if k in self._dynamic_names}
        sparse = SparseFeatures.from_dense(fixed, config=self.config)
        return Batch(sparse=sparse, dense=dense, labels=labels, dynamic=words)

    def _global_batch(self, step: int) -> Batch:
        if self.process_count == 1:
            return self.local_batch(step)
        b, r, p = self.batch_size, self.local_batch_size, self.process_index
        labels = self._labels(self.sample_indices(step, slice(None)))
        own_labels, own_dense, own_ids = self._read(self.sample_indices(step))
        labels[p * r : (p + 1) * r] = own_labels
        dense = np.zeros((b, NUM_DENSE), np.float32)
        dense[p * r : (p + 1) * r] = own_dense
        ids = {}
        for name, x in own_ids.items():  # other processes' rows: padding (-1, all-ones words)
            fill = PAD if x.dtype.kind == "i" else np.iinfo(x.dtype).max
            full = np.full((b, *x.shape[1:]), fill, x.dtype)
            full[p * r : (p + 1) * r] = x
            ids[name] = full
        return self._batch(labels, dense, ids)

    def batches(self, start: int = 0, num: int | None = None):
        step = start
        while num is None or step < start + num:
            yield self.batch(step)
            step += 1

    def close(self) -> None:
        """Stops the background read-ahead."""
        self._prefetcher.close()

    # --- bad rows ------------------------------------------------------------------------

    def _count_bad(self, reason: str, where: int, n: int = 1) -> None:
        with self._lock:
            self.bad_rows[reason] = self.bad_rows.get(reason, 0) + n
            if len(self.bad_examples) < MAX_EXAMPLES:
                self.bad_examples.append((where, reason))

    def describe_bad_rows(self) -> str:
        """One line: the counts by reason and the first examples, or that there were none."""
        total = sum(self.bad_rows.values())
        if not total:
            return f"{self._what}: no bad rows"
        counts = ", ".join(f"{k} {v}" for k, v in self.bad_rows.items() if v)
        where = ", ".join(f"{self._where} {w} ({r})" for w, r in self.bad_examples)
        return f"{self._what}: {total} bad ({counts}); first: {where}"

    _what = "criteo"
    _where = "row"

    # --- for subclasses ------------------------------------------------------------------

    def _read(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """(labels [k] float32, dense [k, 13] float32, {feature: ids [k, H] int64})."""
        raise NotImplementedError

    def _labels(self, samples: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _column_ids(self, j: int, raw: np.ndarray, empty: np.ndarray | None = None):
        """Column j's raw ids `[k, h]` (uint64 or int64; `empty` marks empty slots) as its
        feature takes them, fitted to its `max_hotness` (first ids kept, then padding): a
        fixed table's `raw mod vocab_size` as int64 `[k, H]` (-1: empty), a dynamic table's
        raw 64-bit ids as uint32 words `[k, H, 2]` (all ones: empty)."""
        h = self._features[j].max_hotness
        raw = raw[:, :h]
        if self._vocab[j] is None:  # the 64 bits as they are
            ids = raw.view(np.int64) if raw.dtype == np.uint64 else raw.astype(np.int64)
        else:
            ids = (raw % raw.dtype.type(self._vocab[j])).astype(np.int64)
        if empty is not None:
            ids = np.where(empty[:, :h], PAD, ids)
        if ids.shape[1] < h:
            pad = np.full((ids.shape[0], h - ids.shape[1]), PAD, np.int64)
            ids = np.concatenate([ids, pad], axis=1)
        if self._vocab[j] is None:
            return key_words(ids.reshape(-1)).reshape(*ids.shape, 2)
        return ids


def _column_features(config: EmbeddingConfig, dynamic, columns) -> list:
    """The feature (fixed or dynamic) fed by each of the 26 categorical columns: `columns`
    names them in column order (default: the config's features, then the dynamic ones)."""
    if dynamic is not None and not isinstance(dynamic, DynamicConfig):
        raise ValueError(f"dynamic must be a DynamicConfig, got {type(dynamic).__name__}")
    by_name = {f.name: f for f in config.features}
    by_name.update({f.name: f for f in (dynamic.features if dynamic else ())})
    names = list(by_name) if columns is None else list(columns)
    if len(names) != NUM_CATEGORICAL or len(by_name) != NUM_CATEGORICAL:
        raise ValueError(
            f"Criteo data has {NUM_CATEGORICAL} categorical features but the model has "
            f"{len(by_name)} features; use a preset with {NUM_CATEGORICAL} tables"
        )
    if sorted(names) != sorted(by_name):
        raise ValueError(
            f"columns {names} must name each of the model's features {sorted(by_name)} once"
        )
    return [by_name[n] for n in names]
