"""Stage `propose`: the first option of every table, before any placement.

1. `choose_clusters`: per table (by name), the cheapest of its cluster options, each priced
   as one table-wise shard by `estimate.table_seconds`; DP only while the replicas of all
   DP tables together fit `DP_MEMORY_FRACTION` of a device's memory (a replica sits on
   every device, so this budget is the whole price of replication in memory).
2. `presplit_rows`: a sharded table whose single shard would take more than a quarter of
   the memory cap starts with its rows split in two, four, ... until it does not (or has
   a row shard per device), so that placement starts from shards that pack.
"""

from __future__ import annotations

from embark_jax.core.plan import Cluster
from embark_jax.planner.enumerators import cluster_options
from embark_jax.planner.estimate import shard_cost, table_seconds
from embark_jax.planner.types import ClusterChoice, Option, Problem

__all__ = ["DP_MEMORY_FRACTION", "choose_clusters", "presplit_rows"]

DP_MEMORY_FRACTION = 0.05  # replicas of all DP tables together use at most this much memory


def choose_clusters(p: Problem) -> tuple[dict[str, Option], list[ClusterChoice]]:
    """The cheapest cluster per table (ties: the first in candidate order), and the
    prices of every candidate it was chosen from."""
    options: dict[str, Option] = {}
    decisions = []
    dp_budget = DP_MEMORY_FRACTION * p.hw.memory_bytes
    for t in sorted(p.model.tables, key=lambda t: t.name):
        priced = []
        for o in cluster_options(t):
            if o.cluster is Cluster.DP and shard_cost(p, t, o).memory > dp_budget:
                continue
            priced.append((o, table_seconds(p, t, o)))
        best = min(priced, key=lambda x: x[1])[0]
        if best.cluster is Cluster.DP:
            dp_budget -= shard_cost(p, t, best).memory
        options[t.name] = best
        decisions.append(ClusterChoice(t.name, best, tuple(priced)))
    return options, decisions


def presplit_rows(p: Problem, options: dict[str, Option]) -> dict[str, Option]:
    """Row shards doubled until one shard takes at most a quarter of the cap."""
    out = dict(options)
    g = p.hw.num_devices
    for t in p.model.tables:
        o = out[t.name]
        if o.cluster is Cluster.DP:
            continue
        r = o.row_shards
        while shard_cost(p, t, o.with_rows(r)).memory > p.cap / 4 and r < min(g, t.vocab_size):
            r *= 2
        out[t.name] = o.with_rows(min(r, g))
    return out
