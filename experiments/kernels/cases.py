"""What a worker times: one `Case` per (library, op), built on a point's `Data`.

A case's `run` is one timed repetition and returns when the work is done (JAX: blocked until
ready; torch: synchronous on the CPU, synchronized on CUDA); `prepare`, if any, is untimed work
before each repetition (torch's forward before a timed backward); `sample` is what the driver
compares across libraries (a few rows of the output, or of the table after the updates), as a
float64 or int64 numpy array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from experiments.kernels import points as P


@dataclasses.dataclass
class Case:
    run: Callable[[], object]
    sample: Callable[[], np.ndarray]
    prepare: Callable[[], object] | None = None


class Data:
    """A point's host data, built once per worker and point (same seed: same bytes)."""

    def __init__(self, p: P.Point, seed: int = P.SEED):
        self.point = p
        self.ids = P.make_ids(p, seed).reshape(-1)  # [N] int32
        self.seg = P.segment_ids(p)  # [N] int32, ascending
        self.table = P.make_table(p, seed)  # [V, D] float32
        self.grads = P.make_output_grads(p, seed)  # [B, D] float32
        self._seed = seed
        self._values = None
        uniq = np.unique(self.ids)
        self.unique_rows = len(uniq)
        self.capacity = P.two_op_capacity(self.unique_rows)
        self.out_rows = P.sample_rows(p.batch)  # forward / segment_sum outputs compared here
        self.table_rows = uniq[P.sample_rows(len(uniq))]  # touched rows, compared after SGD
        self.id_rows = P.sample_rows(p.num_ids)  # inverse slots compared for `unique`

    @property
    def values(self) -> np.ndarray:
        if self._values is None:
            self._values = P.make_values(self.point, self._seed)
        return self._values

    def unique_sample(self, uniq, inverse, counts) -> np.ndarray:
        """The first 64 unique ids and counts, and the inverse slot of `id_rows`."""
        k = min(64, self.unique_rows)
        parts = [np.asarray(uniq)[:k], np.asarray(counts)[:k], np.asarray(inverse)[self.id_rows]]
        return np.concatenate([x.astype(np.int64).reshape(-1) for x in parts])


class Box:
    """Holds the latest output (or the updated table) of a case between repetitions."""

    def __init__(self, value=None):
        self.value = value
