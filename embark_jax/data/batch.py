"""`Batch`: one training batch (sparse features, dense features, labels), a JAX pytree, and
its host-side validation against the model it is fed to."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from embark_jax.core.dynamic import DynamicConfig
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures

__all__ = ["Batch", "DataError", "check_finite_dense"]


class DataError(ValueError):
    """Input data the model cannot take: a batch, or the file it was read from, holds a bad
    value (a label that is not 0 or 1, a dense feature that is not a finite number, an id
    out of range, a file changed or cut short). The message names the value and where it
    is (the feature, sample, file, row); the command line prints it as one `error:` line."""


def check_finite_dense(
    dense: np.ndarray, where: Callable[[int], str], shown: np.ndarray | None = None
) -> None:
    """A `DataError` naming the first value of `dense` `[B, F]` that is NaN or infinite, as
    `{where(i)}: dense feature {j} is {value}, not a finite float32 number`; `shown` holds
    the values to print (the file's, before a cast), default `dense`."""
    finite = np.isfinite(dense)
    if finite.all():
        return
    i, j = (int(k) for k in np.argwhere(~finite)[0])
    value = (dense if shown is None else shown)[i, j]
    raise DataError(f"{where(i)}: dense feature {j} is {value}, not a finite float32 number")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch: `sparse` features, `dense` features `[B, num_dense]`, `labels` `[B]` (0/1),
    and `dynamic` features of dynamic tables: name -> `[B, H, 2]` uint32 id words (low, high;
    all ones: padding; `core.dynamic.key_words`).

    Host (numpy) or device arrays alike; `validate` checks a host batch before it is placed.
    """

    sparse: SparseFeatures
    dense: Any
    labels: Any
    dynamic: Any = dataclasses.field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        labels = np.shape(self.labels)
        return int(labels[0]) if labels else 0

    def validate(
        self,
        config: EmbeddingConfig,
        *,
        num_devices: int,
        num_dense: int,
        dynamic: DynamicConfig | None = None,
    ) -> None:
        """Host-side checks of a training batch; a `DataError` (a `ValueError`) naming what
        is wrong: the value and its sample (and feature) where it is one value. `dynamic`:
        the dynamic features the batch must carry (none without it)."""
        try:
            self._validate(config, num_devices, num_dense)
            self._validate_dynamic(dynamic)
        except DataError:
            raise
        except ValueError as e:  # the sparse features' checks
            raise DataError(str(e)) from None

    def _validate(self, config: EmbeddingConfig, num_devices: int, num_dense: int) -> None:
        labels = np.asarray(self.labels)
        b = self.batch_size
        if b == 0:
            raise DataError("empty batch: no samples")
        if b % num_devices:
            raise DataError(f"batch size {b} is not a multiple of the {num_devices} devices")
        if labels.shape != (b,) or not np.issubdtype(labels.dtype, np.number):
            raise DataError(f"labels must be [B] zeros and ones, got {labels.dtype} {labels.shape}")
        bad = np.flatnonzero(~((labels == 0) | (labels == 1)))
        if bad.size:
            i = int(bad[0])
            raise DataError(f"labels must be 0 or 1: label {labels[i]} at sample {i}")
        dense = np.asarray(self.dense)
        if dense.shape != (b, num_dense):
            raise DataError(f"dense features must be [{b}, {num_dense}], got {dense.shape}")
        if not np.issubdtype(dense.dtype, np.number):
            raise DataError(f"dense features must be finite numbers, got dtype {dense.dtype}")
        check_finite_dense(dense, lambda i: f"sample {i}")
        sparse = self.sparse
        missing = sorted({f.name for f in config.features} - set(sparse.ids))
        if missing:
            raise DataError(f"features {missing} are missing from the batch")
        if sparse.batch_size != b:
            raise DataError(f"sparse batch size {sparse.batch_size} != {b} labels")
        for f in config.features:
            if sparse.hotness(f.name) != f.max_hotness:
                raise DataError(
                    f"feature {f.name!r}: ids are [B, {sparse.hotness(f.name)}], "
                    f"the step is compiled for max_hotness {f.max_hotness}"
                )
        sparse.validate(config)

    def _validate_dynamic(self, dynamic: DynamicConfig | None) -> None:
        want = {f.name: f for f in (dynamic.features if dynamic else ())}
        if set(self.dynamic) != set(want):
            raise DataError(
                f"dynamic features: the batch has {sorted(self.dynamic)}, the model takes "
                f"{sorted(want)}"
            )
        b = self.batch_size
        for name, f in want.items():
            x = self.dynamic[name]
            shape, dtype = tuple(np.shape(x)), np.asarray(x).dtype
            if shape != (b, f.max_hotness, 2) or dtype != np.uint32:
                raise DataError(
                    f"dynamic feature {name!r}: ids must be uint32 [{b}, {f.max_hotness}, 2] "
                    f"id words (core.dynamic.key_words), got {dtype}{list(shape)}"
                )
