"""Criteo click logs: the Kaggle / Terabyte TSV files and the MLPerf DLRM-DCNv2 multi-hot
numpy layout, as datasets `fit` can train on (`batch(step) -> Batch`, `batch_size`).

Both readers map the 26 categorical columns, in order, to the config's 26 features (the
preset's order: column j feeds `config.features[j]` and its table), and serve fixed-size
global batches as a pure function of the step: sample `(step * B + i) mod N` is row i of
batch `step` (N samples, wrapping around at the end of the data), so `batch(step)` is the
same after a restart, for any number of processes and with or without prefetching.

**TSV** (`CriteoTSV`, Kaggle Display Advertising `train.txt` and Terabyte `day_N`): one
sample per line, 40 tab-separated fields: the label (`0` or `1`), 13 integer features
(decimal, optionally negative, at most 18 digits) and 26 categorical features (hexadecimal,
at most 16 digits, any case). Any dense or categorical field may be empty (missing).

  - dense value x -> `log(1 + max(x, 0))` as float32; missing -> 0.
  - categorical hex h -> `int(h, 16) mod vocab_size` of the feature's table (modulo, no
    hash); missing -> 0 (as TorchRec's Criteo preprocessing), so every bag holds one id;
    the remaining `max_hotness - 1` slots are padding.
  - bad rows are skipped whole and counted by reason (`bad_rows`): `field_count` (not 40
    fields: never re-aligned, so columns never shift), `label` (not 0/1), `dense` (not a
    decimal integer), `categorical` (not hexadecimal). The first few line numbers are kept
    (`bad_examples`).

Random access uses an index of the good lines' byte offsets and lengths, built once by one
pass over the file at construction (every process builds it: it is what tells which lines
are samples); `index_cache=PATH` stores it and reuses it while the file's size and mtime are
unchanged. Batches are read with `os.pread` (thread-safe).

**Multi-hot** (`CriteoMultiHot`, the MLPerf DLRMv2 preprocessed dataset, as TorchRec's
`materialize_synthetic_multihot_dataset.py` writes it): a directory holding, per day X,
  - `day_X_labels.npy`: labels, shape `[N]` or `[N, 1]`, integer or float, 0/1;
  - `day_X_dense.npy`: `[N, 13]` dense features, already transformed by the preprocessing
    (used as they are, cast to float32);
  - `day_X_sparse_multi_hot.npz` (an `np.savez` archive with members `0.npy` ... `25.npy`),
    or the same members unpacked in a directory `day_X_sparse_multi_hot_unpacked/`: member
    j is `[N, hotness_j]` (or `[N]` for hotness 1) integer ids of categorical feature j.
Days are taken in numeric order of X (all days found, or `days=`) and concatenated. Ids are
mapped `id mod vocab_size` of the feature's table (the files' ids are already below the
full-size vocabularies; the modulo matters for `-mini` presets and `--max-vocab`); a bag
wider than the feature's `max_hotness` keeps its first `max_hotness` ids, a narrower one is
padded; a negative id is treated as an empty slot and counted (`bad_rows["negative_id"]`).
Uncompressed archive members and `.npy` files are memory-mapped (only the rows of a batch are
read); a compressed member is loaded whole into memory.

**Processes.** With `process_count` n (from `jax.process_count()`), process p reads only
rows `[p * B/n, (p + 1) * B/n)` of every global batch: `local_batch(step)`. `batch(step)`
is the global-shaped batch the current `StepRunner` expects (it keeps each process's own
rows): this process's rows in place, the others' rows empty (padding ids, zero dense
features) but with their labels (cheap: from the index or the labels file), so host-side
metrics over the global batch stay right. With one process both are the full batch.

**Prefetch.** `batch(step)` also starts building batch `step + 1` in a background thread
(`embark_jax.data.prefetch.Prefetcher`), so reading and parsing overlap the step.
"""

from __future__ import annotations

import copy
import os
import re
import struct
import threading
import zipfile
from collections.abc import Sequence

import numpy as np

from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.batch import Batch
from embark_jax.data.prefetch import Prefetcher
from embark_jax.data.sparse import PAD, SparseFeatures

__all__ = [
    "NUM_CATEGORICAL",
    "NUM_DENSE",
    "BadRow",
    "CriteoMultiHot",
    "CriteoTSV",
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
_LINE = re.compile(rb"[01](?:\t(?:-?[0-9]{1,18})?){13}(?:\t[0-9a-fA-F]{0,16}){26}\r?\n?")


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


class _CriteoBase:
    """Batching, sharding over processes and prefetching; subclasses read samples."""

    REASONS: tuple[str, ...] = ()

    def __init__(
        self,
        config: EmbeddingConfig,
        *,
        batch_size: int,
        process_index: int,
        process_count: int,
        prefetch: int,
    ):
        features = list(config.features)
        if len(features) != NUM_CATEGORICAL:
            raise ValueError(
                f"Criteo data has {NUM_CATEGORICAL} categorical features but the model has "
                f"{len(features)} features; use a preset with {NUM_CATEGORICAL} tables"
            )
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
        self._features = features
        self._vocab = [config.table_by_name[f.table].vocab_size for f in features]
        self._range = (0, 0)  # [lo, hi) of the underlying samples; set by the subclass
        self._prefetch_depth = int(prefetch)
        self._prefetcher = Prefetcher(self._global_batch, self._prefetch_depth)
        self._lock = threading.Lock()
        self.bad_rows: dict[str, int] = {r: 0 for r in self.REASONS}
        self.bad_examples: list[tuple[int, str]] = []

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

    def split(self, holdout: int) -> tuple[_CriteoBase, _CriteoBase]:
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
        sparse = SparseFeatures.from_dense(ids, config=self.config)
        return Batch(sparse=sparse, dense=dense, labels=labels)

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
        for name, x in own_ids.items():
            full = np.full((b, x.shape[1]), PAD, np.int64)
            full[p * r : (p + 1) * r] = x
            ids[name] = full
        sparse = SparseFeatures.from_dense(ids, config=self.config)
        return Batch(sparse=sparse, dense=dense, labels=labels)

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

    def _pad_ids(self, j: int, ids: np.ndarray) -> np.ndarray:
        """Ids `[k, h]` of feature j fitted to its `max_hotness` (first ids kept, padded)."""
        h = self._features[j].max_hotness
        if ids.shape[1] >= h:
            return ids[:, :h]
        pad = np.full((ids.shape[0], h - ids.shape[1]), PAD, ids.dtype)
        return np.concatenate([ids, pad], axis=1)


class _Fd:
    """An open file descriptor, closed when the last dataset view using it goes."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


class CriteoTSV(_CriteoBase):
    """The Kaggle / Terabyte TSV format (module docstring): `CriteoTSV(path, config,
    batch_size=B, process_index=p, process_count=n)`."""

    REASONS = ("field_count", "label", "dense", "categorical")
    _where = "line"

    def __init__(
        self,
        path: str,
        config: EmbeddingConfig,
        *,
        batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        prefetch: int = 1,
        index_cache: str | None = None,
    ):
        super().__init__(
            config,
            batch_size=batch_size,
            process_index=process_index,
            process_count=process_count,
            prefetch=prefetch,
        )
        self.path = str(path)
        self._what = f"criteo-tsv {self.path}"
        self._offsets, self._lengths, self._all_labels = self._index(index_cache)
        self._range = (0, len(self._offsets))
        self._handle = _Fd(self.path)
        self._check_nonempty(self._what)

    def _index(self, cache: str | None):
        st = os.stat(self.path)
        stamp = np.array([st.st_size, st.st_mtime_ns], np.int64)
        if cache and os.path.exists(cache):
            with np.load(cache) as z:
                if np.array_equal(z["stamp"], stamp):
                    self.bad_rows.update(
                        {r: int(c) for r, c in zip(self.REASONS, z["bad"], strict=True)}
                    )
                    self.bad_examples = [
                        (int(w), self.REASONS[int(r)]) for w, r in z["examples"].reshape(-1, 2)
                    ]
                    return z["offsets"], z["lengths"], z["labels"]
        offsets, lengths, labels = [], [], []
        pos = 0
        with open(self.path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not _LINE.fullmatch(line):
                    try:
                        parse_tsv_line(line)
                    except BadRow as e:
                        self._count_bad(e.reason, lineno)
                        pos += len(line)
                        continue
                offsets.append(pos)
                lengths.append(len(line))
                labels.append(line[0] - 48)  # b"0" / b"1"
                pos += len(line)
        out = (
            np.asarray(offsets, np.int64),
            np.asarray(lengths, np.int64),
            np.asarray(labels, np.int8),
        )
        if cache:
            examples = [(w, self.REASONS.index(r)) for w, r in self.bad_examples]
            tmp = f"{cache}.tmp.npz"
            np.savez(
                tmp,
                stamp=stamp,
                offsets=out[0],
                lengths=out[1],
                labels=out[2],
                bad=np.array([self.bad_rows[r] for r in self.REASONS], np.int64),
                examples=np.array(examples, np.int64).reshape(-1, 2),
            )
            os.replace(tmp, cache)
        return out

    def _lines(self, samples: np.ndarray) -> list[bytes]:
        """The lines of `samples`, read in runs of consecutive samples (one pread each)."""
        out: list[bytes] = []
        breaks = np.flatnonzero(np.diff(samples) != 1) + 1
        for run in np.split(samples, breaks):
            if not len(run):
                continue
            start = int(self._offsets[run[0]])
            end = int(self._offsets[run[-1]] + self._lengths[run[-1]])
            buf = os.pread(self._handle.fd, end - start, start)
            for s in run:
                a = int(self._offsets[s]) - start
                out.append(buf[a : a + int(self._lengths[s])])
        return out

    def _read(self, samples):
        k = len(samples)
        labels = np.empty(k, np.float32)
        raw_dense = np.empty((k, NUM_DENSE), np.int64)
        raw_cats = np.empty((k, NUM_CATEGORICAL), np.uint64)
        for i, line in enumerate(self._lines(samples)):
            labels[i], raw_dense[i], raw_cats[i] = parse_tsv_line(line)
        ids = {}
        for j, f in enumerate(self._features):
            col = (raw_cats[:, j] % np.uint64(self._vocab[j])).astype(np.int64)
            ids[f.name] = self._pad_ids(j, col[:, None])
        return labels, dense_transform(raw_dense), ids

    def _labels(self, samples):
        return self._all_labels[samples].astype(np.float32)


_DAY = re.compile(r"day_(\d+)_labels\.npy")


def _npy_header(fh):
    version = np.lib.format.read_magic(fh)
    readers = {
        (1, 0): np.lib.format.read_array_header_1_0,
        (2, 0): np.lib.format.read_array_header_2_0,
    }
    if version not in readers:
        return None
    return readers[version](fh)


def _npz_members(path: str) -> dict[str, np.ndarray]:
    """Members of an `np.savez` archive: memory-mapped when stored uncompressed."""
    out = {}
    with zipfile.ZipFile(path) as zf:
        infos = [i for i in zf.infolist() if i.filename.endswith(".npy")]
    with open(path, "rb") as fh:
        for info in infos:
            key = info.filename[: -len(".npy")]
            header = None
            if info.compress_type == zipfile.ZIP_STORED:
                fh.seek(info.header_offset)
                local = fh.read(30)
                if local[:4] == b"PK\x03\x04":
                    name_len, extra_len = struct.unpack("<HH", local[26:30])
                    fh.seek(info.header_offset + 30 + name_len + extra_len)
                    header = _npy_header(fh)
            if header is None:
                with np.load(path) as z:
                    out[key] = z[key]
                continue
            shape, fortran, dtype = header
            out[key] = np.memmap(
                path, dtype, "r", offset=fh.tell(), shape=shape, order="F" if fortran else "C"
            )
    return out


class CriteoMultiHot(_CriteoBase):
    """The MLPerf DLRMv2 multi-hot layout (module docstring): `CriteoMultiHot(directory,
    config, batch_size=B, process_index=p, process_count=n, days=None)`."""

    REASONS = ("negative_id",)
    _where = "sample"

    def __init__(
        self,
        directory: str,
        config: EmbeddingConfig,
        *,
        batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        prefetch: int = 1,
        days: Sequence[int] | None = None,
    ):
        super().__init__(
            config,
            batch_size=batch_size,
            process_index=process_index,
            process_count=process_count,
            prefetch=prefetch,
        )
        self.directory = str(directory)
        self._what = f"criteo-multihot {self.directory}"
        found = sorted(
            int(m.group(1)) for n in os.listdir(self.directory) if (m := _DAY.fullmatch(n))
        )
        self.days = list(found if days is None else days)
        if not self.days:
            raise ValueError(f"{self._what}: no day_X_labels.npy files")
        self._labels_by_day, self._dense, self._sparse = [], [], []
        for d in self.days:
            self._open_day(d)
        sizes = [len(x) for x in self._labels_by_day]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._range = (0, int(self._starts[-1]))
        self._check_nonempty(self._what)

    def _file(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _open_day(self, d: int) -> None:
        where = f"{self._what} day {d}"
        try:
            labels = np.load(self._file(f"day_{d}_labels.npy"), mmap_mode="r")
            dense = np.load(self._file(f"day_{d}_dense.npy"), mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        if labels.ndim == 2 and labels.shape[1] == 1:
            labels = labels[:, 0]
        n = labels.shape[0]
        if labels.ndim != 1:
            raise ValueError(f"{where}: labels must be [N] or [N, 1], got {labels.shape}")
        if dense.shape != (n, NUM_DENSE):
            raise ValueError(f"{where}: dense must be [{n}, {NUM_DENSE}], got {dense.shape}")
        npz = self._file(f"day_{d}_sparse_multi_hot.npz")
        unpacked = self._file(f"day_{d}_sparse_multi_hot_unpacked")
        if os.path.isdir(unpacked):
            sparse = {
                n_[:-4]: np.load(os.path.join(unpacked, n_), mmap_mode="r")
                for n_ in os.listdir(unpacked)
                if n_.endswith(".npy")
            }
        elif os.path.exists(npz):
            try:
                sparse = _npz_members(npz)
            except (OSError, ValueError, zipfile.BadZipFile) as e:
                raise ValueError(f"{where}: {npz}: {e}") from None
        else:
            raise ValueError(f"{where}: neither {npz} nor {unpacked}/ exists")
        cols = []
        for j in range(NUM_CATEGORICAL):
            x = sparse.get(str(j))
            if x is None:
                raise ValueError(f"{where}: sparse feature {j} ({j}.npy) is missing")
            if x.ndim == 1:
                x = x[:, None]
            if x.ndim != 2 or x.shape[0] != n or not np.issubdtype(x.dtype, np.integer):
                raise ValueError(
                    f"{where}: sparse feature {j} must be [{n}, hotness] integers, got "
                    f"{x.dtype} {x.shape}"
                )
            cols.append(x)
        self._labels_by_day.append(labels)
        self._dense.append(dense)
        self._sparse.append(cols)

    def _locate(self, samples: np.ndarray):
        day = np.searchsorted(self._starts, samples, side="right") - 1
        return day, samples - self._starts[day]

    def _read(self, samples):
        k = len(samples)
        day, local = self._locate(samples)
        labels = np.empty(k, np.float32)
        dense = np.empty((k, NUM_DENSE), np.float32)
        raw = [None] * NUM_CATEGORICAL
        for d in np.unique(day):
            mask = day == d
            rows = local[mask]
            labels[mask] = self._labels_by_day[d][rows]
            dense[mask] = self._dense[d][rows]
            for j, col in enumerate(self._sparse[d]):
                h = self._features[j].max_hotness
                x = np.asarray(col[rows, :h], np.int64)
                neg = x < 0
                if neg.any():
                    first = int(samples[np.flatnonzero(mask)[np.flatnonzero(neg.any(1))[0]]])
                    self._count_bad("negative_id", first, int(neg.sum()))
                x = self._pad_ids(j, np.where(neg, PAD, x % self._vocab[j]))
                if raw[j] is None:
                    raw[j] = np.empty((k, h), np.int64)
                raw[j][mask] = x
        ids = {f.name: raw[j] for j, f in enumerate(self._features)}
        return labels, dense, ids

    def _labels(self, samples):
        day, local = self._locate(samples)
        out = np.empty(len(samples), np.float32)
        for d in np.unique(day):
            mask = day == d
            out[mask] = self._labels_by_day[d][local[mask]]
        return out
