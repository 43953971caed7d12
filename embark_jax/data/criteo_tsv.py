"""`CriteoTSV`: the Kaggle / Terabyte Criteo TSV files (format: `embark_jax.data.criteo`)."""

from __future__ import annotations

import os

import numpy as np

from embark_jax.data.batch import DataError
from embark_jax.data.criteo_base import (
    NUM_CATEGORICAL,
    NUM_DENSE,
    TSV_LINE,
    BadRow,
    CriteoBase,
    dense_transform,
    parse_tsv_line,
)

__all__ = ["CriteoTSV"]


class _Fd:
    """An open file descriptor, closed when the last dataset view using it goes."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


class CriteoTSV(CriteoBase):
    """The Kaggle / Terabyte TSV format (module docstring): `CriteoTSV(path, config,
    batch_size=B, process_index=p, process_count=n)`."""

    REASONS = ("field_count", "label", "dense", "categorical")
    _where = "line"

    def _open(self, path: str, *, index_cache: str | None = None) -> None:
        self.path = path
        self._what = f"criteo-tsv {self.path}"
        self._index_cache = index_cache
        self._handle = _Fd(self.path)  # before indexing: what is indexed is what is read
        self._stamp = self._file_stamp()
        self._offsets, self._lengths, self._all_labels = self._index(index_cache)
        self._range = (0, len(self._offsets))

    def _file_stamp(self) -> np.ndarray:
        """(size, mtime in ns) of the open file: the index holds while they do."""
        st = os.fstat(self._handle.fd)
        return np.array([st.st_size, st.st_mtime_ns], np.int64)

    def _check_unchanged(self) -> None:
        """A `DataError` when the file was written to after it was indexed: the offsets
        would then point into other lines, or past its end."""
        now = self._file_stamp()
        if not np.array_equal(now, self._stamp):
            size = (
                f"size {int(self._stamp[0])} -> {int(now[0])} bytes"
                if now[0] != self._stamp[0]
                else "modified"
            )
            raise DataError(
                f"{self._what}: the file changed after it was indexed ({size}); restart to "
                "index it again"
            )

    def _line_number(self, offset: int) -> int:
        """The 1-based line that starts at byte `offset` (newlines before it, counted)."""
        count, pos, chunk = 0, 0, 1 << 24
        while pos < offset:
            buf = os.pread(self._handle.fd, min(chunk, offset - pos), pos)
            if not buf:
                break
            count += buf.count(b"\n")
            pos += len(buf)
        return count + 1

    def _index(self, cache: str | None):
        stamp = self._stamp
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
        with os.fdopen(os.dup(self._handle.fd), "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not TSV_LINE.fullmatch(line):
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
        self._check_unchanged()
        k = len(samples)
        labels = np.empty(k, np.float32)
        raw_dense = np.empty((k, NUM_DENSE), np.int64)
        raw_cats = np.empty((k, NUM_CATEGORICAL), np.uint64)
        for i, line in enumerate(self._lines(samples)):
            try:
                labels[i], raw_dense[i], raw_cats[i] = parse_tsv_line(line)
            except BadRow as e:  # it parsed when indexed: the file changed since
                self._check_unchanged()
                where = self._line_number(int(self._offsets[samples[i]]))
                cache = self._index_cache
                hint = f"; delete the index cache {cache}" if cache else ""
                raise DataError(
                    f"{self._what}: line {where} is no longer a valid sample ({e}): the file "
                    f"changed after it was indexed; restart to index it again{hint}"
                ) from None
        ids = {}
        for j, f in enumerate(self._features):
            ids[f.name] = self._column_ids(j, raw_cats[:, j : j + 1])
        return labels, dense_transform(raw_dense), ids

    def _labels(self, samples):
        return self._all_labels[samples].astype(np.float32)
