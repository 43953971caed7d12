"""`Batch`: one training batch (sparse features, dense features, labels), a JAX pytree, and
its host-side validation against the model it is fed to."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures

__all__ = ["Batch"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch: `sparse` features, `dense` features `[B, num_dense]`, `labels` `[B]` (0/1).

    Host (numpy) or device arrays alike; `validate` checks a host batch before it is placed.
    """

    sparse: SparseFeatures
    dense: Any
    labels: Any

    @property
    def batch_size(self) -> int:
        labels = np.shape(self.labels)
        return int(labels[0]) if labels else 0

    def validate(self, config: EmbeddingConfig, *, num_devices: int, num_dense: int) -> None:
        """Host-side checks of a training batch; a `ValueError` naming what is wrong."""
        labels = np.asarray(self.labels)
        b = self.batch_size
        if b == 0:
            raise ValueError("empty batch: no samples")
        if b % num_devices:
            raise ValueError(f"batch size {b} is not a multiple of the {num_devices} devices")
        if labels.shape != (b,) or not np.all((labels == 0) | (labels == 1)):
            raise ValueError(f"labels must be [B] zeros and ones, got shape {labels.shape}")
        dense = np.asarray(self.dense)
        if dense.shape != (b, num_dense):
            raise ValueError(f"dense features must be [{b}, {num_dense}], got {dense.shape}")
        if not np.issubdtype(dense.dtype, np.number) or not np.all(np.isfinite(dense)):
            bad = np.argwhere(~np.isfinite(dense.astype(np.float64)))
            pos = tuple(int(i) for i in bad[0]) if len(bad) else ()
            raise ValueError(f"dense features must be finite numbers; bad value at {pos}")
        sparse = self.sparse
        missing = sorted({f.name for f in config.features} - set(sparse.ids))
        if missing:
            raise ValueError(f"features {missing} are missing from the batch")
        if sparse.batch_size != b:
            raise ValueError(f"sparse batch size {sparse.batch_size} != {b} labels")
        for f in config.features:
            if sparse.hotness(f.name) != f.max_hotness:
                raise ValueError(
                    f"feature {f.name!r}: ids are [B, {sparse.hotness(f.name)}], "
                    f"the step is compiled for max_hotness {f.max_hotness}"
                )
        sparse.validate(config)
