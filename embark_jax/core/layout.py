"""The row-ownership rule of a sharded table, in one place.

A table of `vocab_size` rows and `dim` columns is split into `row_shards` (r) row shards and
`column_shards` (c) column slices. Row ownership is *modulo*: id `i` lives in row shard
`i % r`, at local row `i // r` (hot ids, which are often small or clustered, spread over the
shards; HugeCTR and jax-tpu-embedding use the same rule). Row shard `j` therefore holds the
ids `j, j + r, j + 2r, ...` in that order, and column slice `k` holds the columns
`[k * d / c, (k + 1) * d / c)`.

Every module that maps ids to shards or shards back to ids (lowering, the clusters, the
checkpoints, capacity sizing) asks a `ShardLayout`. Its methods use only arithmetic
operators, so they work on Python ints, numpy arrays and JAX arrays alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from embark_jax.core.plan import Cluster, TablePlan
from embark_jax.core.specs import TableConfig

__all__ = ["ShardLayout", "local_row_of", "row_shard_of"]


def row_shard_of(ids: Any, row_shards: Any) -> Any:
    """Row shard that owns each id (`ids % r`); `r` may be an array (each id's table's)."""
    return ids % row_shards


def local_row_of(ids: Any, row_shards: Any) -> Any:
    """Row of each id inside its row shard (`ids // r`); `r` may be an array."""
    return ids // row_shards


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How one table's ids and columns map to its (row shard, column slice) shards.

    A replicated (DP) table is the layout with `row_shards == column_shards == 1`.
    """

    vocab_size: int
    dim: int
    row_shards: int = 1
    column_shards: int = 1

    def __post_init__(self) -> None:
        if self.row_shards < 1 or self.column_shards < 1:
            raise ValueError(f"row_shards and column_shards must be >= 1, got {self}")
        if self.dim % self.column_shards:
            raise ValueError(f"column_shards {self.column_shards} does not divide dim {self.dim}")

    @classmethod
    def of(cls, table: TableConfig, plan: TablePlan) -> ShardLayout:
        """The layout of `table` under its `plan` (a DP table: r = c = 1)."""
        if plan.cluster is Cluster.DP:
            return cls(table.vocab_size, table.dim)
        return cls(table.vocab_size, table.dim, plan.row_shards, plan.column_shards)

    @property
    def width(self) -> int:
        """Columns of one column slice."""
        return self.dim // self.column_shards

    # --- ids -> shards -----------------------------------------------------------------

    def row_shard(self, ids: Any) -> Any:
        """Row shard that owns each id (`ids % r`)."""
        return row_shard_of(ids, self.row_shards)

    def local_row(self, ids: Any) -> Any:
        """Row of each id inside its row shard (`ids // r`)."""
        return local_row_of(ids, self.row_shards)

    # --- shards -> ids -----------------------------------------------------------------

    def shard_rows(self, j: int) -> int:
        """Number of rows of row shard `j`: the ids j, j + r, ... below `vocab_size`."""
        r = self.row_shards
        return (self.vocab_size - self._check(j, r, "row shard") + r - 1) // r

    def ids_of(self, j: int) -> slice:
        """The ids of row shard `j` in local-row order, as a slice of a `[V, ...]` array."""
        return slice(self._check(j, self.row_shards, "row shard"), None, self.row_shards)

    def global_id(self, j: int, local_row: Any) -> Any:
        """Inverse of (`row_shard`, `local_row`)."""
        return local_row * self.row_shards + j

    def columns(self, k: int) -> slice:
        """The columns of column slice `k`, as a slice of a `[..., dim]` array."""
        self._check(k, self.column_shards, "column slice")
        return slice(k * self.width, (k + 1) * self.width)

    @staticmethod
    def _check(i: int, n: int, what: str) -> int:
        if not 0 <= i < n:
            raise IndexError(f"{what} {i} out of range [0, {n})")
        return i
