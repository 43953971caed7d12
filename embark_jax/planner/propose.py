"""Stage `propose`: the first option of every table, before any placement.

1. `choose_clusters`: per table (by name), the cheapest of its cluster options, each priced
   as one table-wise shard by `estimate.table_seconds`; DP only while the replicas of all
   DP tables together fit `DP_MEMORY_FRACTION` of a device's memory (a replica sits on
   every device, so this budget is the whole price of replication in memory).
2. `presplit_rows`: a sharded table whose single shard would take more than a quarter of
   the memory cap starts with its rows split in two, four, ... until it does not (or has
   a row shard per device), so that placement starts from shards that pack.
3. `target_options` (the second start of the search, guided by the lower bound): given a
   target embedding time per device, every table takes, among all its options
   (`enumerators.splits`), the one with the fewest device-seconds whose largest shard
   plus every device's uniform work (requester sides, DP replicas) stays under the target;
   DP within the same memory budget as above; a table that cannot get under the target
   takes its smallest shards. Low targets split the heavy tables of few-table models over
   idle devices; the search tries a few targets above the bound.
"""

from __future__ import annotations

import dataclasses
import functools

from embark_jax.core.plan import Cluster
from embark_jax.planner import cost as C
from embark_jax.planner.enumerators import cluster_options, splits
from embark_jax.planner.estimate import requester_cost, shard_cost, table_seconds
from embark_jax.planner.model import PlannerTable
from embark_jax.planner.types import ClusterChoice, Option, Problem

__all__ = [
    "DP_MEMORY_FRACTION",
    "Candidate",
    "candidates",
    "choose_clusters",
    "presplit_rows",
    "target_options",
]

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


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One option of a table as `target_options` weighs it."""

    option: Option
    device_s: float  # machine-wide device-seconds (RB row shards in as few nodes as possible)
    uniform_s: float  # work on every device: the requester side, or the DP replica
    shard_s: float  # the largest shard's time (0 for DP)
    memory: float  # one shard's (or replica's) resident bytes


def candidates(p: Problem, t: PlannerTable) -> tuple[Candidate, ...]:
    """Every option of `t` the search may use, priced; shared by tables that differ only by
    name (T510 has 510 tables of 7 kinds)."""
    return _candidates(p, dataclasses.replace(t, name=""))


@functools.lru_cache(maxsize=1024)
def _candidates(p: Problem, t: PlannerTable) -> tuple[Candidate, ...]:
    g, local = p.hw.num_devices, p.hw.devices_per_node
    out = []
    for o in splits(t, g):
        shard = shard_cost(p, t, o, in_node=min(o.row_shards, local))
        s = sum(C.seconds(shard, p.hw))
        if o.cluster is Cluster.DP:
            out.append(Candidate(o, g * s, s, 0.0, shard.memory))
            continue
        u = sum(C.seconds(requester_cost(p, t, o), p.hw))
        out.append(Candidate(o, table_seconds(p, t, o, best_in_node=True), u, s, shard.memory))
    return tuple(out)


def target_options(p: Problem, target: float) -> dict[str, Option]:
    """Per table, the cheapest option whose shards stay under `target` seconds of embedding
    time per device (see the module doc). The uniform work is first taken from the cheapest
    options, then from the first pass's choices."""
    uniform = 0.0
    options: dict[str, Option] = {}
    for _ in range(2):
        options, total = {}, 0.0
        dp_budget = DP_MEMORY_FRACTION * p.hw.memory_bytes
        for t in sorted(p.model.tables, key=lambda t: t.name):
            cands = candidates(p, t)
            best = None
            for c in cands:
                if c.option.cluster is Cluster.DP:
                    if c.memory > dp_budget:
                        continue
                elif c.memory > p.cap / 4 or uniform + c.shard_s > target:
                    continue
                if best is None or c.device_s < best.device_s:
                    best = c
            if best is None:  # nothing under the target: the smallest shards
                sharded = [c for c in cands if c.option.cluster is not Cluster.DP]
                best = min(sharded, key=lambda c: (c.shard_s, c.device_s))
            if best.option.cluster is Cluster.DP:
                dp_budget -= best.memory
            options[t.name] = best.option
            total += best.uniform_s
        uniform = total
    return options
