"""Stage helper: prices one table's `Option` on a `Problem` with the formulas of `cost`.

Three numbers per option: the cost of one of its shards (on the device that holds it), the
work every device does for its own samples of the table (the requester side), and the
device-seconds the table costs the whole machine (what the stages rank tables and options
by).
"""

from __future__ import annotations

from embark_jax.core.plan import Cluster
from embark_jax.planner import cost as C
from embark_jax.planner.model import PlannerTable
from embark_jax.planner.types import Cost, Option, Problem

__all__ = ["requester_cost", "shard_cost", "table_seconds"]


def shard_cost(p: Problem, t: PlannerTable, o: Option, in_node: int = 1) -> Cost:
    """One shard of `o` (a DP replica: the copy on each device). `in_node`: how many of the
    column slice's row shards share this shard's node (hierarchical RB reduces them there
    before they cross nodes)."""
    slots = p.model.slot_footprint
    if o.cluster is Cluster.DP:
        return C.dp_cost(t, p.batch, p.hw, slots)
    if o.cluster is Cluster.UB:
        return C.ub_shard_cost(t, o.row_shards, o.column_shards, p.batch, p.hw, slots)
    return C.rb_shard_cost(
        t,
        o.row_shards,
        o.column_shards,
        p.batch,
        p.hw,
        slots,
        row_shards_in_node=in_node,
        hierarchical=p.hw.num_nodes > 1,
    )


def requester_cost(p: Problem, t: PlannerTable, o: Option) -> Cost:
    """Work each device does for its own samples of the table (the same on every device)."""
    if o.cluster is Cluster.RB:
        return C.rb_requester_cost(t, o.row_shards, p.batch, p.hw)
    if o.cluster is Cluster.UB:
        return C.ub_requester_cost(t, p.batch, p.hw)
    return Cost()  # DP: the local lookup is part of the replica's cost


def table_seconds(p: Problem, t: PlannerTable, o: Option, best_in_node: bool = False) -> float:
    """Device-seconds the table costs the whole machine with this option. `best_in_node`:
    RB row shards placed in as few nodes as possible (each column slice's shards fill
    nodes of L devices; hierarchical RB reduces them there), else each priced alone in
    its node."""
    hw = p.hw
    requester = sum(C.seconds(requester_cost(p, t, o), hw)) * hw.num_devices
    if best_in_node and o.cluster is Cluster.RB:
        r, shards = o.row_shards, 0.0
        while r > 0:  # full nodes first, then the rest
            k = min(r, hw.devices_per_node)
            shards += k * sum(C.seconds(shard_cost(p, t, o, in_node=k), hw))
            r -= k
        return shards * o.column_shards + requester
    per_shard = sum(C.seconds(shard_cost(p, t, o), hw))
    copies = hw.num_devices if o.cluster is Cluster.DP else o.shards
    return per_shard * copies + requester
