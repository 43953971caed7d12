"""Deriving routing and dedup capacities from observed batches (jax-tpu-embedding's FDO is
the anchor): count, on the host, what each device would send where, and size the buffers to
the worst observed load times a margin. The result is a plan with `capacity_factor` and
`unique_capacity` set per table; overflow stays counted at run time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from embark_jax.core.plan import Cluster, Plan
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures

__all__ = ["TableLoad", "derive_capacities", "observe"]


@dataclasses.dataclass
class TableLoad:
    """Worst observed loads of one table: the routing factor (requests to one row shard /
    expected) and, for UB, the most unique ids on one device."""

    route_factor: float = 0.0
    max_unique: int = 0


def observe(
    plan: Plan, config: EmbeddingConfig, batches: Iterable[SparseFeatures]
) -> dict[str, TableLoad]:
    g = plan.topology.num_devices
    loads = {t.name: TableLoad() for t in plan.tables}
    for batch in batches:
        b = batch.batch_size // g
        for tp in plan.tables:
            if tp.cluster is Cluster.DP:
                continue
            r = tp.row_shards
            feats = [f for f in config.features if f.table == tp.name]
            for dev in range(g):
                per_feature = [
                    np.asarray(batch.ids[f.name])[dev * b : (dev + 1) * b].reshape(-1)
                    for f in feats
                ]
                if tp.cluster is Cluster.UB:
                    ids = np.concatenate(per_feature)
                    uniq = np.unique(ids[ids >= 0])
                    loads[tp.name].max_unique = max(loads[tp.name].max_unique, uniq.size)
                    groups = [(uniq, uniq.size)]
                else:  # the run time expects b * hotness / r requests per row shard
                    groups = [(x[x >= 0], x.size) for x in per_feature]
                for ids, slots in groups:
                    e = max(slots, 1) / r
                    if ids.size:
                        counts = np.bincount(ids % r, minlength=r)
                        loads[tp.name].route_factor = max(
                            loads[tp.name].route_factor, counts.max() / e
                        )
    return loads


def derive_capacities(
    plan: Plan, config: EmbeddingConfig, batches: Iterable[SparseFeatures], margin: float = 1.25
) -> Plan:
    """A copy of `plan` with capacities sized from `batches` (worst load x `margin`)."""
    loads = observe(plan, config, batches)
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
