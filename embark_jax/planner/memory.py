"""The per-device memory of a plan's compiled embedding step, as the runtime lays it out.

`cost` prices each shard on its own, for the search's memory cap. This module prices a
placed plan the way `embark_jax.sharding.lowering` allocates it and the step runs it, so it
can be checked against the compiled step's `memory_analysis()`:

- state: per stacked group (cluster, width, dtype), one buffer of `rows_per_device` rows
  (the most rows any device holds of the group; every device allocates that many) of the
  table's dtype plus its float32 optimizer slots;
- batch: the device's ids (int32 per id slot) and bag lengths (int32 per sample and feature);
- staged: every group's staged update (`ops.stage_backward_update`), live together until
  the step's one commit verdict: C = min(N, rows_per_device) slots of a row index, the new
  row and its new slots, N the id slots reaching the group's update on one device;
- exchange: the largest group's update inputs, live beside the staged rows: the gradients
  and id slots the owner receives (RB: one partial vector per (feature, column slice) slot
  and sample of every peer; UB: one vector per unique-id slot of every peer, received as
  per-peer slices and then joined; DP: every device's id slots and pooled gradients, or
  the dense `[V, w]` gradient and touch counts).

N per device: DP, every device's id slots of every feature of the group (sparse exchange) or
all `V` rows (dense); RB and UB, G times the group's bucket (`traffic.routed_bucket`).
"""

from __future__ import annotations

import dataclasses

from embark_jax.core import dp_exchange
from embark_jax.core.layout import ShardLayout
from embark_jax.core.plan import Cluster, Plan
from embark_jax.planner import cost as C
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import ModelSpec
from embark_jax.planner.traffic import dp_group_exchange, groups, routed_bucket, slots_per_device
from embark_jax.planner.types import check_plan

__all__ = ["StepMemory", "plan_memory"]

ID_BYTES = C.ID_BYTES  # int32 rows, bags and lengths


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device of one compiled embedding step (see the module doc)."""

    state: float
    batch: float
    staged: float
    exchange: float
    backward: float = 0.0

    @property
    def total(self) -> float:
        return self.state + self.batch + max(self.staged + self.exchange, self.backward)


@dataclasses.dataclass(frozen=True)
class _Group:
    cluster: Cluster
    width: int
    members: list
    rows_per_device: int


def _rows_per_device(members, g: int) -> int:
    """The most rows of the group one device holds (lowering's `rows_per_device`), each
    shard's rows by the table's `ShardLayout`."""
    used = [0] * g
    for t, tp in members:
        dp = tp.cluster is Cluster.DP
        layout = ShardLayout(t.vocab_size, t.dim, 1 if dp else tp.row_shards)
        for _, j, dev in tp.shard_devices():
            used[dev] += layout.shard_rows(0 if dp else j)
    return max(1, max(used))


def _update_inputs(grp: _Group, plan: Plan, hw: HardwareTopology) -> tuple[int, float]:
    """(N id slots reaching the group's update on one device, bytes of its inputs)."""
    g, b, w = hw.num_devices, plan.batch_size // hw.num_devices, grp.width
    if grp.cluster is Cluster.DP:
        dense, rows, id_slots, grad_rows = dp_group_exchange(grp.members, b, w, g)
        if dense:
            return rows, rows * (w + 1) * 4
        return g * id_slots, g * dp_exchange.sparse_bytes_per_device(id_slots, grad_rows, w)
    n = g * routed_bucket(grp.members, plan.batch_size, hw)
    if grp.cluster is Cluster.UB:
        return n, n * (ID_BYTES + 4 * w)
    return n, n * 3 * ID_BYTES + _rb_partials(grp, plan, hw)


def _rb_partials(grp: _Group, plan: Plan, hw: HardwareTopology) -> float:
    """Bytes of an RB group's partial vectors (or their gradients) on one device: one per
    (feature, column slice) slot it serves, sample and peer."""
    g = hw.num_devices
    return g * slots_per_device(grp.members, g) * (plan.batch_size // g) * grp.width * 4


def plan_memory(model: ModelSpec, plan: Plan, hw: HardwareTopology) -> StepMemory:
    """Per-device bytes of the plan's compiled embedding step (lookup, backward and the
    staged in-place update of every group); see the module doc. `ValueError` if the plan
    is not for `hw`'s devices or `model`'s tables."""
    check_plan(model, plan, hw)
    g = hw.num_devices
    b = plan.batch_size // g
    state = staged = exchange = ub_backward = rb_backward = 0.0
    for (cluster, w, e), members in groups(model, plan).items():
        grp = _Group(cluster, w, members, _rows_per_device(members, g))
        state += C.table_memory(grp.rows_per_device, w, e, model.slot_footprint)
        n, inputs = _update_inputs(grp, plan, hw)
        staged += C.staged_memory(n, grp.rows_per_device, w, e, model.slot_footprint)
        exchange = max(exchange, inputs)
        if cluster is Cluster.UB:
            ub_backward += 3 * n * 4 * w
        elif cluster is Cluster.RB:
            rb_backward = max(rb_backward, 3 * _rb_partials(grp, plan, hw))
    batch = sum(b * (C.id_slots(t) + 1) * ID_BYTES for t in model.tables)
    return StepMemory(state, batch, staged, exchange, max(ub_backward, rb_backward))
