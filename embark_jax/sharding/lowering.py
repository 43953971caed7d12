"""Lowering a plan to arrays and shardings, in exactly one place.

Shards with the same (cluster, column width, dtype) are stacked per device into one buffer of
shape `[G, rows_per_device, width]`, sharded on axis 0 over all mesh axes: device g holds
`buffer[g]`, the concatenation of its shards, each at a static row offset. A dp table has one
replica per device at the same offset everywhere. Which ids and columns a shard holds is the
table's `ShardLayout` (`embark_jax.core.layout`), which `Lowered.layout` hands out. Nothing
else in embark_jax builds shardings for tables; modules ask the `Lowered` object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embark_jax.core.layout import ShardLayout
from embark_jax.core.plan import Cluster, Plan
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig, default_initializer
from embark_jax.ops.optimizers import SparseOptimizer

__all__ = ["Group", "Lowered", "Shard", "lower"]


@dataclasses.dataclass(frozen=True)
class Shard:
    table: str
    k: int  # column slice
    j: int  # row shard (dp: the replica's device)
    device: int
    rows: int
    row_offset: int
    col_start: int
    width: int


@dataclasses.dataclass(frozen=True)
class Group:
    """One stacked buffer: all shards of one (cluster, width, dtype, optimizer), bfloat16
    tables that round to nearest apart from those that round stochastically."""

    name: str
    cluster: Cluster
    width: int
    dtype: str
    rows_per_device: int
    tables: tuple[str, ...]
    shards: tuple[Shard, ...]
    optimizer: SparseOptimizer | None = None  # per-table optimizers: one per group
    # bfloat16 tables with `TableConfig.stochastic_rounding`: updates round stochastically
    stochastic_rounding: bool = False

    def shard(self, table: str, k: int, j: int) -> Shard:
        for s in self.shards:
            if s.table == table and s.k == k and s.j == j:
                return s
        raise KeyError((table, k, j))

    def placement(self, table: str, c: int, r: int) -> tuple[np.ndarray, np.ndarray]:
        """`(device [c, r], row_offset [c, r])` of a table's shards in this group."""
        dev = np.zeros((c, r), np.int32)
        off = np.zeros((c, r), np.int32)
        for s in self.shards:
            if s.table == table:
                dev[s.k, s.j] = s.device
                off[s.k, s.j] = s.row_offset
        return dev, off


@dataclasses.dataclass(frozen=True)
class Lowered:
    plan: Plan
    config: EmbeddingConfig
    groups: tuple[Group, ...]

    @property
    def num_devices(self) -> int:
        return self.plan.topology.num_devices

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self.plan.axis_names

    @property
    def spec(self) -> P:
        """PartitionSpec of a stacked buffer (and of the batch): axis 0 over every mesh axis."""
        return P(self.axis_names)

    def sharding(self, mesh: jax.sharding.Mesh) -> NamedSharding:
        return NamedSharding(mesh, self.spec)

    def group_of(self, table: str) -> Group:
        for g in self.groups:
            if table in g.tables:
                return g
        raise KeyError(table)

    def features_of(self, group: Group) -> tuple[FeatureConfig, ...]:
        return tuple(f for f in self.config.features if f.table in group.tables)

    def table(self, name: str) -> TableConfig:
        return self.config.table_by_name[name]

    def layout(self, table: str) -> ShardLayout:
        """The id -> (row shard, local row) rule of a table and its inverse (DP: r = c = 1)."""
        return ShardLayout.of(self.table(table), self.plan.table(table))

    def row_shard(self, shard: Shard) -> int:
        """The row shard a shard holds, for `layout(shard.table)`: its `j`, except for a dp
        replica, whose `j` is its device and which holds every id (row shard 0)."""
        return 0 if self.plan.table(shard.table).cluster is Cluster.DP else shard.j

    def shard_ids(self, shard: Shard) -> slice:
        """The ids a shard holds in local-row order, as a slice of a `[V, ...]` array."""
        return self.layout(shard.table).ids_of(self.row_shard(shard))

    # --- initialisation --------------------------------------------------------------------

    def init_buffer(self, group: Group, key: jax.Array, sharding: NamedSharding) -> jax.Array:
        """A freshly initialised group buffer, built shard by shard on the devices' own
        processes (no host ever holds a whole table). Each shard gets its own key, folded
        from (table, column slice, row shard); dp replicas share theirs so they are equal.
        A table's initializer is called per shard with shape `(rows, width)`."""
        index_of = {t.name: i for i, t in enumerate(self.config.tables)}
        dtype = jnp.dtype(group.dtype)

        def block(g: int, out: np.ndarray) -> None:  # fills out [rows_per_device, width]
            for s in group.shards:
                if s.device != g:
                    continue
                t = self.table(s.table)
                init = t.initializer or default_initializer(t.dim)
                j = self.row_shard(s)
                k = jax.random.fold_in(jax.random.fold_in(key, index_of[s.table]), s.k * 65536 + j)
                rows = slice(s.row_offset, s.row_offset + s.rows)
                out[rows] = np.asarray(init(k, (s.rows, s.width), dtype))

        def callback(index):  # each block written once, where it is returned (no stacked copy)
            devs = range(self.num_devices)[index[0]]
            out = np.zeros((len(devs), group.rows_per_device, group.width), dtype)
            for i, g in enumerate(devs):
                block(g, out[i])
            return out

        shape = (self.num_devices, group.rows_per_device, group.width)
        return jax.make_array_from_callback(shape, sharding, callback)

    # --- host-side assembly (full_tables, gradients) ----------------------------------------

    def stack(self, tables: Mapping[str, np.ndarray], group: Group) -> np.ndarray:
        """Full tables -> the group's `[G, rows_per_device, width]` buffer (host numpy)."""
        buf = np.zeros(
            (self.num_devices, group.rows_per_device, group.width), dtype=jnp.dtype(group.dtype)
        )
        for s in group.shards:
            cols = self.layout(s.table).columns(s.k)
            part = np.asarray(tables[s.table])[self.shard_ids(s), cols]
            buf[s.device, s.row_offset : s.row_offset + s.rows] = part
        return buf

    def unstack(
        self, buffers: Mapping[str, np.ndarray], *, replicas: str = "first"
    ) -> dict[str, np.ndarray]:
        """Group buffers -> full `[V, d]` tables. `replicas`: how dp replicas combine,
        `first` (they are identical: values) or `sum` (per-replica gradients)."""
        out: dict[str, np.ndarray] = {}
        for group in self.groups:
            buf = np.asarray(buffers[group.name])
            for s in group.shards:
                layout = self.layout(s.table)
                if s.table not in out:
                    out[s.table] = np.zeros((layout.vocab_size, layout.dim), buf.dtype)
                part = buf[s.device, s.row_offset : s.row_offset + s.rows]
                ids, cols = self.shard_ids(s), layout.columns(s.k)
                if group.cluster is not Cluster.DP:
                    out[s.table][ids, cols] = part
                elif replicas == "sum":
                    out[s.table][ids, cols] += part
                elif s.device == 0:
                    out[s.table][ids, cols] = part
        return out


def lower(
    plan: Plan, config: EmbeddingConfig, optimizers: Mapping[str, SparseOptimizer] | None = None
) -> Lowered:
    """Groups the plan's shards into stacked buffers with static row offsets.

    `optimizers` (table name -> optimizer) splits groups further: the shards of one buffer
    share one optimizer (their slots are stacked the same way).
    """
    plan.validate(config)
    if optimizers is not None:
        missing = sorted(t.name for t in config.tables if t.name not in optimizers)
        if missing:
            raise ValueError(f"no optimizer given for tables {missing}")
    g_count = plan.topology.num_devices
    keyed: dict[tuple, list[str]] = {}
    opts: list[SparseOptimizer | None] = []
    for tp in plan.tables:
        t = config.table_by_name[tp.name]
        width = ShardLayout.of(t, tp).width
        opt = None if optimizers is None else optimizers[tp.name]
        if opt not in opts:
            opts.append(opt)
        dtype = str(jnp.dtype(t.dtype))
        # a bfloat16 table rounding to nearest is not stacked with stochastic ones
        nearest = dtype == "bfloat16" and not t.rounds_stochastically
        key = (tp.cluster.value, width, dtype, nearest, opts.index(opt))
        keyed.setdefault(key, []).append(tp.name)
    groups = []
    for (cluster_v, width, dtype, nearest, opt_idx), names in sorted(keyed.items()):
        cluster = Cluster(cluster_v)
        used = [0] * g_count
        shards = []
        for name in names:
            tp = plan.table(name)
            layout = ShardLayout.of(config.table_by_name[name], tp)
            for k, j, dev in tp.shard_devices():
                rows = layout.shard_rows(0 if cluster is Cluster.DP else j)
                col_start = layout.columns(k).start
                shards.append(Shard(name, k, j, dev, rows, used[dev], col_start, width))
                used[dev] += rows
        suffix = ("_nearest" if nearest else "") + (f"_opt{opt_idx}" if len(opts) > 1 else "")
        groups.append(
            Group(
                name=f"{cluster.value}_w{width}_{dtype}{suffix}",
                cluster=cluster,
                width=width,
                dtype=dtype,
                rows_per_device=max(max(used), 1),
                tables=tuple(names),
                shards=tuple(shards),
                optimizer=opts[opt_idx],
                stochastic_rounding=dtype == "bfloat16" and not nearest,
            )
        )
    return Lowered(plan=plan, config=config, groups=tuple(groups))
