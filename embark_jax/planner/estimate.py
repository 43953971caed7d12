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


def _cap(p: Problem, t: PlannerTable, o: Option, ideal: bool) -> float:
    """The bucket slots one source sends the shard: the runtime's capacity, or with `ideal`
    the fair share worst / r (a lower bound of every capacity, monotone in r: the bound)."""
    r, cf = o.row_shards, o.capacity_factor
    if ideal:
        worst = p.batch // p.hw.num_devices * C.id_slots(t)
        if o.cluster is Cluster.UB:
            worst = min(worst, t.vocab_size, o.unique_capacity or worst)
        return worst / r
    if o.cluster is Cluster.UB:
        return C.ub_bucket(t, r, p.batch, p.hw, cf, o.unique_capacity)
    return C.rb_bucket(t, r, p.batch, p.hw, cf)


def shard_cost(
    p: Problem, t: PlannerTable, o: Option, in_node: int = 1, ideal: bool = False
) -> Cost:
    """One shard of `o` (a DP replica: the copy on each device). `in_node`: how many of the
    column slice's row shards share this shard's node (hierarchical RB reduces them there
    before they cross nodes). `ideal`: buckets priced at their fair share (`_cap`)."""
    slots = p.model.slot_footprint
    if o.cluster is Cluster.DP:
        return C.dp_cost(t, p.batch, p.hw, slots)
    cap = _cap(p, t, o, ideal)
    split = (o.row_shards, o.column_shards)
    if o.cluster is Cluster.UB:
        return C.ub_shard_cost(t, split, p.batch, p.hw, slots, cap)
    return C.rb_shard_cost(
        t,
        split,
        p.batch,
        p.hw,
        slots,
        row_shards_in_node=in_node,
        hierarchical=p.hw.num_nodes > 1,
        cap=cap,
    )


def requester_cost(p: Problem, t: PlannerTable, o: Option) -> Cost:
    """Work each device does for its own samples of the table (the same on every device)."""
    if o.cluster is Cluster.RB:
        return C.rb_requester_cost(t, o.row_shards, p.batch, p.hw)
    if o.cluster is Cluster.UB:
        return C.ub_requester_cost(t, p.batch, p.hw)
    return Cost()  # DP: the local lookup is part of the replica's cost


def table_seconds(
    p: Problem, t: PlannerTable, o: Option, best_in_node: bool = False, ideal: bool = False
) -> float:
    """Device-seconds the table costs the whole machine with this option. `best_in_node`:
    RB row shards placed in as few nodes as possible (each column slice's shards fill
    nodes of L devices; hierarchical RB reduces them there), else each priced alone in
    its node. `ideal`: buckets at their fair share (see `shard_cost`)."""
    hw = p.hw
    requester = sum(C.seconds(requester_cost(p, t, o), hw)) * hw.num_devices
    if best_in_node and o.cluster is Cluster.RB:
        r, shards = o.row_shards, 0.0
        while r > 0:  # full nodes first, then the rest
            k = min(r, hw.devices_per_node)
            shards += k * sum(C.seconds(shard_cost(p, t, o, k, ideal), hw))
            r -= k
        return shards * o.column_shards + requester
    per_shard = sum(C.seconds(shard_cost(p, t, o, ideal=ideal), hw))
    copies = hw.num_devices if o.cluster is Cluster.DP else o.shards
    return per_shard * copies + requester
