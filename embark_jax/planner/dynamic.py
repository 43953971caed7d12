"""Pricing dynamic (hash) tables: their capacity from the ids they should hold, the step
cost of each placement, and the choice between them (docs/design.md §11, "Planner").

A dynamic table is placed one of two ways (`sharding.dynamic.DynamicShards`):
  sharded     one shard on every device, ids routed to `shard_of(id)` (unique-based: a
              sort, a bucket of `binomial_capacity(b H, G)` slots a peer, two all-to-alls);
  replicated  the whole table on every device, every device's unique ids all-gathered and
              inserted everywhere, the gradient rows all-gathered (no capacity, no
              all-to-all; G times the probes and the memory).

Costs are per device and step in bytes, as in `planner.cost` (notation there; u is the
expected distinct ids, from the Zipf law over the ids the table holds). Beyond a fixed
table's terms, a hash table pays its probes: a received id scans its bucket's key words
(`bucket_size` x 8 bytes, the worst case: a miss in a full bucket), and the sort of the
id words that deduplicates the local batch (`SORT_PASSES` passes over 12 bytes an id).
The keys, scores and admission candidates are 16 bytes a slot beside the rows.

`plan_dynamic` replicates a table when that is predicted faster and its copy takes at most
`REPLICA_SHARE` of a device's memory; otherwise it shards it.
"""

from __future__ import annotations

import dataclasses
import math

from embark_jax.core.capacity_rule import binomial_capacity
from embark_jax.planner.cost import (
    a2a_split,
    expected_unique,
    seconds,
    slot_floats_per_row,
    staged_memory,
    update_bytes,
)
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.types import Cost

__all__ = [
    "REPLICA_SHARE",
    "DynamicChoice",
    "DynamicTableSpec",
    "dynamic_capacity",
    "plan_dynamic",
    "replicated_cost",
    "sharded_cost",
]

WORD_BYTES = 8  # an id: two uint32 words
SLOT_BYTES = 16  # a slot's key words and (last step, count) score
SORT_PASSES = 4
REPLICA_SHARE = 0.05


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicTableSpec:
    """A dynamic table as the planner sees it. `distinct_ids`: the ids it should hold (the
    expected distinct ids of the training data, or of a window under eviction);
    `hotness`: ids per sample over the features that look it up, `max_hotness` their id
    slots; `alpha`: the Zipf exponent of the ids; `load`: the load factor capacity is
    sized for."""

    name: str
    dim: int
    hotness: float
    distinct_ids: int
    max_hotness: int | None = None
    alpha: float = 1.1
    dtype_bytes: int = 4
    bucket_size: int = 32
    load: float = 0.5

    def __post_init__(self) -> None:
        where = f"dynamic table {self.name!r}"
        for field in ("dim", "distinct_ids", "bucket_size", "dtype_bytes"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}: {field} must be an int >= 1, got {v!r}")
        if not (isinstance(self.hotness, int | float) and self.hotness > 0):
            raise ValueError(f"{where}: hotness must be > 0, got {self.hotness!r}")
        if not 0 < self.load <= 1:
            raise ValueError(f"{where}: load must be in (0, 1], got {self.load!r}")

    @property
    def id_slots(self) -> int:
        return self.max_hotness or max(1, math.ceil(self.hotness))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicChoice:
    """The planner's placement of one dynamic table: `capacity` rows per device, the
    predicted seconds per step of both placements, the chosen one's cost and a reason."""

    name: str
    replicated: bool
    capacity: int
    cost: Cost
    sharded_s: float
    replicated_s: float
    reason: str

    @property
    def seconds(self) -> float:
        return self.replicated_s if self.replicated else self.sharded_s


def dynamic_capacity(t: DynamicTableSpec, num_devices: int, replicated: bool = False) -> int:
    """Rows per device: `distinct_ids` at load `load` over the devices (a replica holds them
    all), in whole buckets, at least one."""
    share = 1 if replicated else num_devices
    rows = t.distinct_ids / share / t.load
    return max(1, math.ceil(rows / t.bucket_size)) * t.bucket_size


def _resident(t: DynamicTableSpec, capacity: int, slots: tuple[int, int], moved: int) -> float:
    """Memory a device holds: the rows, their optimizer slots, keys and scores, and for the
    `moved` id slots it serves a buffer (id words and a row each) and the staged update."""
    floats = slot_floats_per_row(slots, t.dim)
    table = capacity * (t.dim * t.dtype_bytes + 4 * floats + SLOT_BYTES)
    buffers = moved * (WORD_BYTES + t.dim * t.dtype_bytes)
    return table + buffers + staged_memory(moved, capacity, t.dim, t.dtype_bytes, slots)


def _local(t: DynamicTableSpec, batch: int, hw: HardwareTopology) -> tuple[int, float, float]:
    """(id slots per device n = b H, its expected distinct ids u, the requester's bytes: the
    dedup sort and the pooling of its b h ids and the scatter of their gradients)."""
    b = batch // hw.num_devices
    n = b * t.id_slots
    u = expected_unique(b * t.hotness, t.distinct_ids, t.alpha)
    sort = SORT_PASSES * n * (WORD_BYTES + 4)
    pool = 2 * (b * t.hotness * t.dim * 4 + b * t.dim * 4)
    return n, u, sort + pool


def sharded_cost(
    t: DynamicTableSpec, batch: int, hw: HardwareTopology, slots: tuple[int, int], capacity: int
) -> Cost:
    """One shard on every device (unique-based routing): buffers of `binomial_capacity(n,
    G)` slots a peer move whole; about u ids arrive (u/G from each device) and probe."""
    e, d, g = t.dtype_bytes, t.dim, hw.num_devices
    n, u, local = _local(t, batch, hw)
    cap = binomial_capacity(n, g)
    m = g * cap  # slots received (and rows sent back, gradients received)
    touched = expected_unique(batch * t.hotness, t.distinct_ids, t.alpha) / g
    probe = u * t.bucket_size * WORD_BYTES
    compute = local + probe + 2 * m * d * e + m * d * 4 + update_bytes(touched, d, e, slots)
    intra, inter = a2a_split(cap * (WORD_BYTES + 2 * d * e), hw)
    return Cost(compute, intra, inter, _resident(t, capacity, slots, m))


def replicated_cost(
    t: DynamicTableSpec, batch: int, hw: HardwareTopology, slots: tuple[int, int], capacity: int
) -> Cost:
    """The whole table on every device: each device's first k = min(n, capacity) unique-id
    slots and their gradient rows all-gathered; every device probes all devices' ids."""
    e, d, g = t.dtype_bytes, t.dim, hw.num_devices
    n, u, local = _local(t, batch, hw)
    k = min(n, capacity)
    gathered = g * k
    touched = expected_unique(batch * t.hotness, t.distinct_ids, t.alpha)
    probe = g * min(u, k) * t.bucket_size * WORD_BYTES
    compute = local + probe + k * d * e + gathered * d * e + update_bytes(touched, d, e, slots)
    intra, inter = a2a_split(k * (WORD_BYTES + d * e), hw)
    return Cost(compute, intra, inter, _resident(t, capacity, slots, gathered))


def plan_dynamic(
    tables, batch: int, hw: HardwareTopology, slots: tuple[int, int]
) -> tuple[DynamicChoice, ...]:
    """Each table's placement (module docstring) and capacity."""
    out = []
    for t in tables:
        cap_s = dynamic_capacity(t, hw.num_devices)
        cap_r = dynamic_capacity(t, hw.num_devices, replicated=True)
        cost_s = sharded_cost(t, batch, hw, slots, cap_s)
        cost_r = replicated_cost(t, batch, hw, slots, cap_r)
        s_s, s_r = sum(seconds(cost_s, hw)), sum(seconds(cost_r, hw))
        small = cost_r.memory <= REPLICA_SHARE * hw.memory_bytes
        replicated = hw.num_devices > 1 and small and s_r < s_s
        if replicated:
            reason = f"replicated: {s_r * 1e6:.1f} us < sharded {s_s * 1e6:.1f} us"
        elif not small:
            reason = (
                f"sharded: a copy would take {cost_r.memory / 2**20:.1f} MiB, over "
                f"{REPLICA_SHARE:.0%} of a device"
            )
        else:
            reason = f"sharded: {s_s * 1e6:.1f} us <= replicated {s_r * 1e6:.1f} us"
        out.append(
            DynamicChoice(
                name=t.name,
                replicated=replicated,
                capacity=cap_r if replicated else cap_s,
                cost=cost_r if replicated else cost_s,
                sharded_s=s_s,
                replicated_s=s_r,
                reason=reason,
            )
        )
    return tuple(out)
