"""The link bytes a placed plan moves, priced as the runtime sends them: per stacked group.

The runtime (`embark_jax.sharding.lowering`) stacks the shards of one (cluster, width, dtype)
into a group and runs one padded all-to-all per group and direction; every peer's slice has
the same shape, the worst device's. So every device moves the same bytes, sized by:

- RB ids: the group bucket, the most any device holds of Σ its shards' capacities
  (`cost.rb_bucket`), two int32 per slot (row, bag);
- RB vectors, flat: S partial vectors of b samples per peer, S = the most (feature, column
  slice) slots a device serves; hierarchical (N > 1): the in-node all-to-all carries N x S_n
  slots per local peer and the rail all-to-all S_n per node peer, S_n = the most slots a
  node serves; forward partials and backward gradients alike;
- UB: the group bucket of unique-id slots (`cost.ub_bucket`): one int32 id out, one vector
  back and one gradient out per slot;
- DP: per group, the dense all-reduce of the stacked replicas' fp32 gradients and touched
  counts, or the all-gather of every device's id slots and pooled output gradients,
  whichever the runtime's `DPGradients.AUTO` rule picks (`core.dp_exchange`);
- the overflow and invalid counts (two int32 per table, all-reduced).

Link bytes per device and direction: an all-to-all or all-gather with n peers moves
(n - 1) / n of its result; an all-reduce is priced as a hierarchical ring (`cost`).
"""

from __future__ import annotations

from collections import defaultdict

from embark_jax.core import dp_exchange
from embark_jax.core.plan import Cluster, Plan
from embark_jax.planner import cost as C
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import ModelSpec
from embark_jax.planner.types import check_plan

__all__ = ["dp_group_exchange", "groups", "plan_traffic", "routed_bucket", "slots_per_device"]


def groups(model: ModelSpec, plan: Plan) -> dict[tuple, list]:
    """(cluster, width, dtype bytes) -> [(planner table, table plan)], as lowering stacks."""
    tables = {t.name: t for t in model.tables}
    out: dict[tuple, list] = defaultdict(list)
    for tp in plan.tables:
        t = tables[tp.name]
        out[(tp.cluster, t.dim // tp.column_shards, t.dtype_bytes)].append((t, tp))
    return out


def routed_bucket(members, batch: int, hw: HardwareTopology) -> int:
    """The group's bucket: the most slots any device's shards take per source."""
    per_dev = [0] * hw.num_devices
    for t, tp in members:
        r, cf = tp.row_shards, tp.capacity_factor
        if tp.cluster is Cluster.UB:
            cap = C.ub_bucket(t, r, batch, hw, cf, tp.unique_capacity)
        else:
            cap = C.rb_bucket(t, r, batch, hw, cf)
        for _, _, dev in tp.shard_devices():
            per_dev[dev] += cap
    return max(1, max(per_dev))


def _rb_vectors(members, b: int, w: int, e: int, hw: HardwareTopology, hierarchical: bool):
    """(intra, inter) bytes of an RB group's partial vectors and their gradients."""
    g, local, n = hw.num_devices, hw.devices_per_node, hw.num_nodes
    per_node: list[set] = [set() for _ in range(n)]
    for _, tp in members:
        for k, _, dev in tp.shard_devices():
            per_node[dev // local].add((tp.name, k))
    vec = 2 * b * w * e  # forward partials + backward gradients, per slot and peer
    if hierarchical and n > 1:
        s_node = max(1, max(len(s) for s in per_node))
        return vec * s_node * n * (local - 1), vec * s_node * (n - 1)
    return C.a2a_split(vec * slots_per_device(members, g), hw)


def slots_per_device(members, num_devices: int) -> int:
    """S of an RB group: the most (feature, column slice) slots one device serves."""
    per_dev = [0] * num_devices
    for _, tp in members:
        for _, _, dev in tp.shard_devices():
            per_dev[dev] += 1
    return max(1, max(per_dev))


def dp_group_exchange(members, b: int, w: int, num_devices: int) -> tuple[bool, int, int, int]:
    """How a DP group exchanges its gradients (`DPCluster.stage`, by the rule of
    `core.dp_exchange`): (dense, its replica's rows, one device's id slots, one device's
    output gradient rows)."""
    rows = sum(t.vocab_size for t, _ in members)
    id_slots = sum(b * C.id_slots(t) for t, _ in members)
    grad_rows = sum(b * C.dp_grad_rows(t) for t, _ in members)
    return (
        dp_exchange.dense_wins(rows, w, id_slots, grad_rows, num_devices),
        rows,
        id_slots,
        grad_rows,
    )


def _dp(members, b: int, w: int, hw: HardwareTopology) -> tuple[float, float]:
    """(intra, inter) bytes of a DP group's gradient exchange."""
    dense, rows, id_slots, grad_rows = dp_group_exchange(members, b, w, hw.num_devices)
    if dense:
        return C.allreduce_split(rows * (w + 1) * 4, hw)
    return C.a2a_split(dp_exchange.sparse_bytes_per_device(id_slots, grad_rows, w), hw)


def plan_traffic(
    model: ModelSpec, plan: Plan, hw: HardwareTopology, hierarchical: bool = True
) -> tuple[float, float]:
    """(intra-node, inter-node) bytes every device moves per step (forward + backward) for
    the plan's embeddings; see the module doc. `hierarchical`: the runtime's option.
    `ValueError` if the plan is not for `hw`'s devices or `model`'s tables."""
    check_plan(model, plan, hw)
    g = hw.num_devices
    b = plan.batch_size // g
    intra = inter = 0.0
    for (cluster, w, e), members in sorted(groups(model, plan).items(), key=str):
        if cluster is Cluster.DP:
            x = _dp(members, b, w, hw)
        elif cluster is Cluster.UB:
            x = C.a2a_split(routed_bucket(members, plan.batch_size, hw) * (4 + 2 * w * e), hw)
        else:
            ids = C.a2a_split(routed_bucket(members, plan.batch_size, hw) * 2 * 4, hw)
            vec = _rb_vectors(members, b, w, e, hw, hierarchical)
            x = (ids[0] + vec[0], ids[1] + vec[1])
        intra, inter = intra + x[0], inter + x[1]
    counts = C.allreduce_split(2 * 4 * len(plan.tables), hw)
    return intra + counts[0], inter + counts[1]
