"""Routing and dedup capacities, sized in one place (`docs/design.md`, "Capacities").

RB and UB send requests through fixed-capacity buckets, one per (source, destination device),
and UB deduplicates each device's ids into a fixed number of slots. This module owns every
size involved:

* `table_capacity`: a table's bucket slots per (source, shard) and, for UB, its dedup slots,
  from the plan, the local batch, the features' hotness and the `RuntimeOptions`. A table's
  own `capacity_factor` wins over `options.capacity_factor`; with neither, the default
  sizing is the binomial tail (`binomial_capacity`): the slots a shard needs so that the
  chance of more requests than slots is below `TAIL_PROBABILITY`, for requests spread
  uniformly over the row shards (a table-wise table gets its exact worst case).
* `group_capacity`: the bucket of a stacked group, the worst over devices of the sum of the
  capacities of the shards a device holds (what the RB and UB clusters allocate).
* `derive_capacities`: a plan whose `capacity_factor` / `unique_capacity` are sized from
  observed batches (jax-tpu-embedding's FDO is the anchor): count, on the host, what each
  device would send where, and size to the worst observed load times a margin.
* `grow_capacities`: a plan with the capacities of overflowing tables doubled: the slots
  each could use in its group's bucket, padding included, so every growth enlarges it.

Overflow is never silent: what does not fit is dropped, counted per table and reported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

import numpy as np

from embark_jax.core.capacity_rule import TAIL_PROBABILITY, binomial_capacity, bucket_slots
from embark_jax.core.layout import ShardLayout
from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Cluster, Plan, TablePlan
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.sharding.lowering import Group, Lowered, lower

__all__ = [
    "DEFAULT_CAPACITY_FACTOR",
    "TAIL_PROBABILITY",
    "TableCapacity",
    "binomial_capacity",
    "derive_capacities",
    "group_capacity",
    "grow_capacities",
    "table_capacity",
]

# The factor `grow_capacities` doubles for a table sized by the default (binomial) rule.
DEFAULT_CAPACITY_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class TableCapacity:
    """Static capacities of one table on one device.

    Attributes:
      bucket: slots the table's requests take in a source's bucket to each of its shards
        (0 for DP, which does not route).
      unique: UB only: dedup slots for the device's unique ids of the table.
    """

    bucket: int
    unique: int | None = None


def _factor(tp: TablePlan, options: RuntimeOptions) -> float | None:
    return tp.capacity_factor or options.capacity_factor


_bucket = bucket_slots  # the rule lives in `embark_jax.core.capacity_rule`


def table_capacity(
    lowered: Lowered,
    table: str,
    local_batch: int,
    hotness: Mapping[str, int],
    options: RuntimeOptions,
) -> TableCapacity:
    """The bucket (and, for UB, dedup) capacity of `table` on one device.

    RB sends every id slot of every feature: each feature's `b * hotness` slots spread over
    the row shards. UB sends the device's unique ids of the table: at most the table's slots
    over all its features and at most its vocabulary, capped by the plan's `unique_capacity`;
    a row shard receives at most its own rows of them.
    """
    tp = lowered.plan.table(table)
    if tp.cluster is Cluster.DP:
        return TableCapacity(bucket=0)
    r = tp.row_shards
    factor = _factor(tp, options)
    slots = [local_batch * hotness[f.name] for f in lowered.config.features if f.table == table]
    if tp.cluster is Cluster.RB:
        return TableCapacity(bucket=_bucket(slots, factor, r))
    vocab = lowered.table(table).vocab_size
    worst = min(sum(slots), vocab)
    cap_u = worst if tp.unique_capacity is None else min(worst, tp.unique_capacity)
    shard_rows = -(-vocab // r)
    return TableCapacity(bucket=_bucket([cap_u], factor, r, shard_rows), unique=max(1, cap_u))


def group_capacity(
    lowered: Lowered,
    group: Group,
    local_batch: int,
    hotness: Mapping[str, int],
    options: RuntimeOptions,
) -> int:
    """Bucket slots per destination of a group: the worst over devices of the sum of the
    table capacities of the shards the device holds (at least 1)."""
    per_dst = [0] * lowered.num_devices
    for t in group.tables:
        cap = table_capacity(lowered, t, local_batch, hotness, options).bucket
        for s in group.shards:
            if s.table == t:
                per_dst[s.device] += cap
    return max(1, max(per_dst))


def _default_factor(tp: TablePlan, config: EmbeddingConfig | None, local_batch: int) -> float:
    """The factor the default (binomial) sizing amounts to for a table at the plan's batch
    and the features' `max_hotness` (`DEFAULT_CAPACITY_FACTOR` without a config)."""
    if config is None:
        return DEFAULT_CAPACITY_FACTOR
    n = sum(local_batch * f.max_hotness for f in config.features if f.table == tp.name)
    if tp.cluster is Cluster.UB:
        n = min(n, config.table_by_name[tp.name].vocab_size, tp.unique_capacity or n)
    if n <= 0:
        return DEFAULT_CAPACITY_FACTOR
    effective = binomial_capacity(n, tp.row_shards) * tp.row_shards / n
    return max(DEFAULT_CAPACITY_FACTOR, math.ceil(effective * 1000) / 1000)


def _available_slots(lowered: Lowered, local_batch: int, options: RuntimeOptions) -> dict[str, int]:
    """Table -> the most bucket slots its requests to one of its shards may take: the
    group's bucket (all tables of a group share one per destination) less what the other
    tables' shards on that device are sized for. A table stacked with a larger one on
    other devices gets the group's padding on top of its own capacity."""
    hotness = {f.name: f.max_hotness for f in lowered.config.features}
    out: dict[str, int] = {}
    for group in lowered.groups:
        if group.cluster is Cluster.DP:
            continue
        caps = {
            t: table_capacity(lowered, t, local_batch, hotness, options).bucket
            for t in group.tables
        }
        per_dst = [0] * lowered.num_devices
        for s in group.shards:
            per_dst[s.device] += caps[s.table]
        bucket = max(1, max(per_dst))
        for t in group.tables:
            devices = {s.device for s in group.shards if s.table == t}
            out[t] = max(bucket - per_dst[d] + caps[t] for d in devices)
    return out


def _request_slots(tp: TablePlan, config: EmbeddingConfig, local_batch: int) -> int:
    """The request slots a table's factor is applied to on one device: `b * max_hotness`
    over its features (RB), its dedup slots (UB)."""
    n = sum(local_batch * f.max_hotness for f in config.features if f.table == tp.name)
    if tp.cluster is Cluster.UB:
        n = min(n, config.table_by_name[tp.name].vocab_size, tp.unique_capacity or n)
    return n


def grow_capacities(
    plan: Plan,
    tables: Iterable[str],
    options: RuntimeOptions,
    config: EmbeddingConfig | None = None,
    lowered: Lowered | None = None,
) -> Plan:
    """`plan` with the routing capacity and the dedup capacity (when set) of `tables`
    doubled (the overflow policy `grow`).

    Without `config` (or `lowered`), the factor in effect is doubled: for a table on the
    default sizing, `DEFAULT_CAPACITY_FACTOR`. With it, every growth doubles what the table
    could really use: the slots available to it in its group's bucket (`_available_slots`:
    its own capacity plus the padding a larger table stacked with it leaves), so that each
    step of growth enlarges the bucket that overflowed. Doubling the factor alone could
    leave the bucket as it was: a table sized at 2 slots in a group whose bucket is 4 (for
    another table's shard) still had 4 after its factor doubled. `lowered` (the plan lowered
    with its optimizers, as the train step runs it) groups tables exactly; without it they
    are grouped as `lower(plan, config)` does, by cluster, width and dtype."""
    grow = set(tables)
    local_batch = plan.batch_size // plan.topology.num_devices
    if lowered is not None:
        config = lowered.config
        if lowered.plan != plan:
            opts = {t: g.optimizer for g in lowered.groups for t in g.tables}
            lowered = lower(plan, config, opts if None not in opts.values() else None)
    elif config is not None:
        lowered = lower(plan, config)
    available = {} if lowered is None else _available_slots(lowered, local_batch, options)
    out = []
    for tp in plan.tables:
        if tp.name in grow and tp.cluster is not Cluster.DP:
            cf = 2.0 * (_factor(tp, options) or _default_factor(tp, config, local_batch))
            uc = None if tp.unique_capacity is None else 2 * tp.unique_capacity
            tp = dataclasses.replace(tp, unique_capacity=uc)
            if tp.name in available:
                # the factor whose bucket holds twice the slots the table had
                n = _request_slots(tp, config, local_batch)
                need = 2 * available[tp.name] * tp.row_shards / max(n, 1)
                cf = max(cf, math.ceil(need * 1000) / 1000)
            tp = dataclasses.replace(tp, capacity_factor=cf)
        out.append(tp)
    return dataclasses.replace(plan, tables=tuple(out))


# --- sizing from observed batches ----------------------------------------------------------


@dataclasses.dataclass
class _Load:
    """Worst observed loads of one table: the routing factor (requests to one row shard /
    expected) and, for UB, the most unique ids on one device."""

    route_factor: float = 0.0
    max_unique: int = 0

    def add_route(self, layout: ShardLayout, ids: np.ndarray, slots: int) -> None:
        """Requests `ids` out of `slots` expected ones, spread over the row shards."""
        if ids.size:
            r = layout.row_shards
            counts = np.bincount(layout.row_shard(ids), minlength=r)
            self.route_factor = max(self.route_factor, counts.max() / (max(slots, 1) / r))


def _observe(
    plan: Plan, config: EmbeddingConfig, batches: Iterable[SparseFeatures]
) -> dict[str, _Load]:
    g = plan.topology.num_devices
    loads = {t.name: _Load() for t in plan.tables}
    routed = [tp for tp in plan.tables if tp.cluster is not Cluster.DP]
    for batch in batches:
        b = batch.batch_size // g
        for tp in routed:
            layout = ShardLayout.of(config.table_by_name[tp.name], tp)
            load = loads[tp.name]
            feats = [f for f in config.features if f.table == tp.name]
            for dev in range(g):
                per_feature = [
                    np.asarray(batch.ids[f.name])[dev * b : (dev + 1) * b].reshape(-1)
                    for f in feats
                ]
                if tp.cluster is Cluster.UB:
                    ids = np.concatenate(per_feature)
                    uniq = np.unique(ids[ids >= 0])
                    load.max_unique = max(load.max_unique, uniq.size)
                    load.add_route(layout, uniq, uniq.size)
                else:  # the run time expects b * hotness / r requests per row shard
                    for x in per_feature:
                        load.add_route(layout, x[x >= 0], x.size)
    return loads


def derive_capacities(
    plan: Plan, config: EmbeddingConfig, batches: Iterable[SparseFeatures], margin: float = 1.25
) -> Plan:
    """A copy of `plan` with capacities sized from `batches` (worst load x `margin`)."""
    loads = _observe(plan, config, batches)
    tables = []
    for tp in plan.tables:
        load = loads[tp.name]
        changes = {}
        if tp.cluster is not Cluster.DP:
            if tp.row_shards > 1:
                changes["capacity_factor"] = round(max(load.route_factor, 1.0) * margin, 3)
            if tp.cluster is Cluster.UB and load.max_unique:
                changes["unique_capacity"] = math.ceil(load.max_unique * margin)
        tables.append(dataclasses.replace(tp, **changes))
    return dataclasses.replace(plan, tables=tuple(tables))
