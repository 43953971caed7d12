"""`CriteoMultiHot`: the MLPerf DLRMv2 multi-hot numpy layout (format:
`embark_jax.data.criteo`)."""

from __future__ import annotations

import os
import re
import struct
import zipfile
from collections.abc import Sequence

import numpy as np

from embark_jax.data.batch import DataError, check_finite_dense
from embark_jax.data.criteo_base import NUM_CATEGORICAL, NUM_DENSE, CriteoBase

__all__ = ["CriteoMultiHot"]


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


def _load_npy(path: str, where: str) -> np.ndarray:
    """A `.npy` file memory-mapped, or a `ValueError` naming `where` (day, feature) and the
    file: a truncated file is "mmap length is greater than file size" to numpy."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0][:200]
        if "mmap length is greater than file size" in reason:
            reason = "shorter than its header says (truncated?)"
        raise ValueError(f"{where}: {path}: {reason}") from None


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
            try:
                out[key] = np.memmap(
                    path, dtype, "r", offset=fh.tell(), shape=shape, order="F" if fortran else "C"
                )
            except ValueError as e:  # the member runs past the end of the archive
                raise ValueError(
                    f"member {info.filename} is shorter than its header says (truncated?): {e}"
                ) from None
    return out


class CriteoMultiHot(CriteoBase):
    """The MLPerf DLRMv2 multi-hot layout (module docstring): `CriteoMultiHot(directory,
    config, batch_size=B, process_index=p, process_count=n, days=None)`."""

    REASONS = ("negative_id",)
    _where = "sample"

    def _open(self, directory: str, *, days: Sequence[int] | None = None) -> None:
        self.directory = directory
        self._what = f"criteo-multihot {self.directory}"
        found = sorted(
            int(m.group(1)) for n in os.listdir(self.directory) if (m := _DAY.fullmatch(n))
        )
        self.days = list(found if days is None else days)
        if not self.days:
            raise ValueError(f"{self._what}: no day_X_labels.npy files")
        self._labels_by_day, self._dense, self._sparse = [], [], []
        self._day_files: list[tuple[str, str]] = []  # (labels file, dense file) per day
        for d in self.days:
            self._open_day(d)
        sizes = [len(x) for x in self._labels_by_day]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._range = (0, int(self._starts[-1]))

    def _file(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _open_day(self, d: int) -> None:
        where = f"{self._what} day {d}"
        labels = _load_npy(self._file(f"day_{d}_labels.npy"), f"{where} labels")
        dense = _load_npy(self._file(f"day_{d}_dense.npy"), f"{where} dense features")
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
                n_[:-4]: _load_npy(os.path.join(unpacked, n_), f"{where} sparse feature {n_[:-4]}")
                for n_ in sorted(os.listdir(unpacked))
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
        self._day_files.append(
            (self._file(f"day_{d}_labels.npy"), self._file(f"day_{d}_dense.npy"))
        )

    def _checked_labels(self, d: int, rows: np.ndarray) -> np.ndarray:
        """Labels of day index `d`'s `rows`, or a `DataError` naming the file, row and value
        of one that is not 0 or 1."""
        labels = np.asarray(self._labels_by_day[d][rows])
        bad = np.flatnonzero(~((labels == 0) | (labels == 1)))
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{self._what} day {self.days[d]}: {self._day_files[d][0]} row {int(rows[i])}: "
                f"label {labels[i]} is not 0 or 1"
            )
        return labels

    def _checked_dense(self, d: int, rows: np.ndarray) -> np.ndarray:
        """Dense features of day index `d`'s `rows` as float32, or a `DataError` naming the
        file, row, feature and value of one that is not a finite float32 number."""
        raw = np.asarray(self._dense[d][rows])
        if not np.issubdtype(raw.dtype, np.number):
            raise DataError(
                f"{self._what} day {self.days[d]}: {self._day_files[d][1]}: dense features "
                f"must be numbers, got dtype {raw.dtype}"
            )
        with np.errstate(over="ignore", invalid="ignore"):
            dense = raw.astype(np.float32)
        where = f"{self._what} day {self.days[d]}: {self._day_files[d][1]} row"
        check_finite_dense(dense, lambda i: f"{where} {int(rows[i])}", raw)
        return dense

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
            labels[mask] = self._checked_labels(d, rows)
            dense[mask] = self._checked_dense(d, rows)
            for j, col in enumerate(self._sparse[d]):
                h = self._features[j].max_hotness
                x = np.asarray(col[rows, :h], np.int64)
                neg = x < 0
                if neg.any():
                    first = int(samples[np.flatnonzero(mask)[np.flatnonzero(neg.any(1))[0]]])
                    self._count_bad("negative_id", first, int(neg.sum()))
                x = self._column_ids(j, x, neg)
                if raw[j] is None:
                    raw[j] = np.empty((k, *x.shape[1:]), x.dtype)
                raw[j][mask] = x
        ids = {f.name: raw[j] for j, f in enumerate(self._features)}
        return labels, dense, ids

    def _labels(self, samples):
        day, local = self._locate(samples)
        out = np.empty(len(samples), np.float32)
        for d in np.unique(day):
            mask = day == d
            out[mask] = self._checked_labels(d, local[mask])
        return out
