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
* `grow_capacities`: a plan with the capacities of overflowing tables doubled.

Overflow is never silent: what does not fit is dropped, counted per table and reported.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from embark_jax.core.layout import ShardLayout
from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Cluster, Plan, TablePlan
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures

if TYPE_CHECKING:
    from embark_jax.sharding.lowering import Group, Lowered

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
# Default sizing: P(requests from one source to one shard > its slots) below this.
TAIL_PROBABILITY = 1e-6


@functools.lru_cache(maxsize=1024)
def binomial_capacity(n: int, row_shards: int, tail: float = TAIL_PROBABILITY) -> int:
    """The least c with P(Binomial(n, 1/row_shards) > c) < tail (at most n).

    `n` requests, each to one of `row_shards` shards uniformly at random: the slots one
    shard needs so that it overflows with probability below `tail`. Small `n` get their
    worst case (n), large `n` about n/r + 5 standard deviations at the default tail.
    """
    if n <= 0:
        return 0
    if row_shards <= 1:
        return n
    p = 1.0 / row_shards
    k = np.arange(n + 1, dtype=np.float64)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(k[1:]))])  # log(k!)
    log_pmf = log_fact[n] - log_fact - log_fact[::-1] + k * math.log(p) + (n - k) * math.log1p(-p)
    pmf = np.exp(log_pmf)
    above = np.cumsum(pmf[::-1])[::-1]  # above[c] = P(X >= c), summed from the small end
    # P(X > c) = above[c + 1]; the least c where it drops below `tail`
    over = np.append(above[1:], 0.0) >= tail
    return int(np.argmin(over)) if not over.all() else n


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


def _bucket(
    slots: list[int], factor: float | None, row_shards: int, most: int | None = None
) -> int:
    """Slots for one source's requests to one row shard of a table.

    `slots` are the table's request slots per feature (their sum is the worst case), `most`
    an optional hard cap (e.g. the rows of the largest shard, for unique ids). Without a
    factor: the binomial tail of the total (exact worst case for a table-wise table). With
    one: `ceil(factor * slots / r)` per feature, each at most its worst case (an explicit
    override, which may be below the default).
    """
    worst = sum(slots)
    if factor is None:
        cap = binomial_capacity(worst, row_shards)
    else:
        cap = sum(min(n, math.ceil(factor * n / row_shards)) for n in slots)
    if most is not None:
        cap = min(cap, most)
    return max(1, min(worst, cap))


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


def grow_capacities(
    plan: Plan,
    tables: Iterable[str],
    options: RuntimeOptions,
    config: EmbeddingConfig | None = None,
) -> Plan:
    """`plan` with the routing factor and the dedup capacity (when set) of `tables` doubled
    (the overflow policy `grow`). The factor doubled is the one in effect; for a table on
    the default sizing, the factor that sizing amounts to at the plan's batch (given the
    `config`, else `DEFAULT_CAPACITY_FACTOR`), so growing never shrinks a bucket."""
    grow = set(tables)
    local_batch = plan.batch_size // plan.topology.num_devices
    out = []
    for tp in plan.tables:
        if tp.name in grow and tp.cluster is not Cluster.DP:
            cf = 2.0 * (_factor(tp, options) or _default_factor(tp, config, local_batch))
            uc = None if tp.unique_capacity is None else 2 * tp.unique_capacity
            tp = dataclasses.replace(tp, capacity_factor=cf, unique_capacity=uc)
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
