"""The planner's cost model: small pure functions, one per quantity and one per cluster kind,
all per step (forward plus backward) and per device, in bytes; `seconds` turns bytes into
time on a topology. `estimate` applies them to a table's `Option`.

Notation: B global batch, G devices (N nodes x L per node), b = B / G, h ids per sample for
the table, H = ceil(h) its id slots per sample, d its dim, d' = d / c a column slice, r row
shards, e bytes per element, u a unique ratio. `slots` is the optimizer's slot footprint:
(float32 slots per element, per row).

Link bytes are what crosses links, per device and direction: a device's own slice of an
all-to-all or all-gather never leaves it. Routed tables move padded buffers whose size is
the bucket capacity `cap` (per source and row shard, `embark_jax.core.capacity_rule`, the
rule the runtime sizes them with), not the ideal id count.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from embark_jax.core import dp_exchange
from embark_jax.core.capacity_rule import bucket_slots
from embark_jax.core.specs import Combiner
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import PlannerTable
from embark_jax.planner.types import Cost

__all__ = [
    "Cost",
    "a2a_split",
    "allreduce_split",
    "dense_seconds",
    "dp_cost",
    "dp_dense_gradients",
    "dp_grad_rows",
    "expected_unique",
    "rb_bucket",
    "rb_requester_cost",
    "rb_shard_cost",
    "seconds",
    "slot_floats_per_row",
    "staged_memory",
    "table_memory",
    "ub_bucket",
    "ub_requester_cost",
    "ub_shard_cost",
    "unique_ratio",
    "update_bytes",
]

ID_BYTES = 4


def seconds(c: Cost, hw: HardwareTopology) -> tuple[float, float]:
    """(compute seconds, communication seconds) of a cost on `hw`."""
    return c.compute / hw.memory_bw, c.intra / hw.intra_bw + c.inter / hw.inter_bw


@functools.lru_cache(maxsize=1 << 16)
def expected_unique(n: float, vocab: int, alpha: float) -> float:
    """Expected number of distinct ids among n draws of a Zipf(alpha) law over `vocab` ids:
    sum_i 1 - (1 - p_i)^n, with ranks grouped in geometric bins (O(log V) work)."""
    if n <= 0:
        return 0.0
    edges = np.unique(np.geomspace(1, vocab + 1, num=min(vocab + 1, 512)).astype(np.int64))
    lo, hi = edges[:-1].astype(np.float64), edges[1:].astype(np.float64)
    mid = np.sqrt(lo * hi)
    weights = mid**-alpha
    norm = (weights * (hi - lo)).sum()
    p = weights / norm
    return float(((hi - lo) * -np.expm1(n * np.log1p(-np.minimum(p, 1 - 1e-12)))).sum())


def unique_ratio(t: PlannerTable, n: float) -> float:
    """Distinct ids / ids among n ids of the table (measured if the table says so)."""
    if t.unique_ratio is not None:
        return t.unique_ratio
    return min(1.0, expected_unique(n, t.vocab_size, t.alpha) / max(n, 1.0))


def slot_floats_per_row(slots: tuple[int, int], width: int) -> float:
    """float32 optimizer slots one row of `width` elements carries."""
    per_element, per_row = slots
    return float(per_element * width + per_row)


def update_bytes(rows: float, width: int, e: int, slots: tuple[int, int]) -> float:
    """Fused sparse update: read + write each touched row and its optimizer slots."""
    return rows * (2 * width * e + 2 * 4 * slot_floats_per_row(slots, width))


def table_memory(rows: float, width: int, e: int, slots: tuple[int, int]) -> float:
    return rows * (width * e + 4 * slot_floats_per_row(slots, width))


def staged_memory(ids: float, rows: float, width: int, e: int, slots: tuple[int, int]) -> float:
    """The staged in-place update of a shard (or stacked group) of `rows` rows that `ids`
    id slots reach: min(ids, rows) slots of a row index, the new row and its new optimizer
    slots, live until the step's commit verdict (`ops.stage_backward_update`)."""
    return min(ids, rows) * (ID_BYTES + width * e + 4 * slot_floats_per_row(slots, width))


def id_slots(t: PlannerTable) -> int:
    """Id slots per sample the runtime allocates for the table's feature (its max hotness)."""
    return max(1, math.ceil(t.hotness))


def rb_bucket(t: PlannerTable, r: int, batch: int, hw: HardwareTopology, factor=None) -> int:
    """Slots of one source's bucket to one RB row shard (`sharding.capacity.table_capacity`)."""
    return bucket_slots([batch // hw.num_devices * id_slots(t)], factor, r)


def ub_bucket(
    t: PlannerTable, r: int, batch: int, hw: HardwareTopology, factor=None, unique=None
) -> int:
    """Slots of one source's bucket to one UB row shard: its dedup slots min(b H, V) (or the
    plan's `unique_capacity`), spread over r shards, at most a shard's rows."""
    worst = min(batch // hw.num_devices * id_slots(t), t.vocab_size)
    cap_u = worst if unique is None else min(worst, unique)
    return bucket_slots([cap_u], factor, r, -(-t.vocab_size // r))


def a2a_split(per_peer: float, hw: HardwareTopology) -> tuple[float, float]:
    """An all-to-all (or all-gather) over every device, `per_peer` bytes to or from each other
    device: L - 1 peers share the node, G - L are on other nodes (the own slice stays)."""
    g, local = hw.num_devices, hw.devices_per_node
    return per_peer * (local - 1), per_peer * (g - local)


def allreduce_split(nbytes: float, hw: HardwareTopology) -> tuple[float, float]:
    """A hierarchical (NCCL-style) all-reduce of `nbytes` per device: reduce-scatter and
    all-gather inside the node, and 1/L of the buffer per device across nodes."""
    local, n = hw.devices_per_node, hw.num_nodes
    return 2 * nbytes * (local - 1) / local, 2 * nbytes / local * (n - 1) / n


def _owner(
    t: PlannerTable,
    r: int,
    c: int,
    batch: int,
    slots: tuple[int, int],
    received: float,
    slot: float,
) -> tuple[float, float]:
    """A routed shard's own side: (bytes of its update of the rows the batch touches, its
    memory: the rows and their optimizer slots, `received` buffer slots of `slot` bytes each,
    and the staged update of at most that many rows)."""
    e, w = t.dtype_bytes, t.dim // c
    rows = math.ceil(t.vocab_size / r)
    touched = expected_unique(batch * t.hotness, t.vocab_size, t.alpha) / r
    memory = (
        table_memory(rows, w, e, slots)
        + received * slot
        + staged_memory(received, rows, w, e, slots)
    )
    return update_bytes(touched, w, e, slots), memory


@functools.lru_cache(maxsize=1 << 16)
def rb_shard_cost(
    t: PlannerTable,
    split: tuple[int, int],
    batch: int,
    hw: HardwareTopology,
    slots: tuple[int, int],
    row_shards_in_node: int = 1,
    hierarchical: bool = False,
    cap: int | None = None,
) -> Cost:
    """One RB shard of the table's (row, column) `split`: it receives a bucket of `cap` id
    slots (row and bag, int32) from every source (B*h/r of them used), pools them into one
    partial vector per sample (b*d' bytes to each requester), gets the same gradient bytes
    back, and updates its touched rows."""
    (r, c), e, w = split, t.dtype_bytes, t.dim // split[1]
    local, n = hw.devices_per_node, hw.num_nodes
    b = batch / hw.num_devices
    cap = rb_bucket(t, r, batch, hw) if cap is None else cap
    n_ids = batch * t.hotness / r
    update, memory = _owner(t, r, c, batch, slots, hw.num_devices * cap, 2 * ID_BYTES + w * e)
    compute = (n_ids * w * e + batch * w * e) + (batch * w * 4 + n_ids * w * 4) + update
    i_intra, i_inter = a2a_split(cap * 2 * ID_BYTES, hw)
    vec = 2 * b * w * e  # partials forward + gradients backward, per peer
    if hierarchical and n > 1:  # in-node all-to-all of N peers' slots, then one per node
        v_intra = vec * (local - 1) * n
        v_inter = vec * (n - 1) * local / max(row_shards_in_node, 1)
    else:
        v_intra, v_inter = a2a_split(vec, hw)
    return Cost(compute, i_intra + v_intra, i_inter + v_inter, memory)


@functools.lru_cache(maxsize=1 << 16)
def ub_shard_cost(
    t: PlannerTable,
    split: tuple[int, int],
    batch: int,
    hw: HardwareTopology,
    slots: tuple[int, int],
    cap: int | None = None,
) -> Cost:
    """One UB shard of the table's (row, column) `split`: every device sends a bucket of
    `cap` unique-id slots to it (about u*b*h/r of them used); the shard returns one vector
    per slot and gets one gradient back per slot. The padded buffers move whole, so the
    dedup pays off in bytes only as far as the capacities are sized from data
    (`derive_capacities`)."""
    (r, c), e, w = split, t.dtype_bytes, t.dim // split[1]
    cap = ub_bucket(t, r, batch, hw) if cap is None else cap
    m = hw.num_devices * cap  # slots received (and vectors sent back)
    update, memory = _owner(t, r, c, batch, slots, m, ID_BYTES + w * e)
    compute = 2 * m * w * e + m * w * 4 + update
    intra, inter = a2a_split(cap * (ID_BYTES + 2 * w * e), hw)
    return Cost(compute, intra, inter, memory)


def dp_grad_rows(t: PlannerTable) -> int:
    """Output gradient rows per sample of the table's feature: one pooled vector, or one per
    id slot of a sequence (`none`) feature."""
    return id_slots(t) if t.combiner is Combiner.NONE else 1


def dp_dense_gradients(t: PlannerTable, batch: int, hw: HardwareTopology) -> bool:
    """The runtime's `DPGradients.AUTO` rule (`core.dp_exchange.dense_wins`) for the table
    as a group of its own."""
    b = batch // hw.num_devices
    return dp_exchange.dense_wins(
        t.vocab_size, t.dim, b * id_slots(t), b * dp_grad_rows(t), hw.num_devices
    )


@functools.lru_cache(maxsize=1 << 16)
def dp_cost(t: PlannerTable, batch: int, hw: HardwareTopology, slots: tuple[int, int]) -> Cost:
    """A DP replica (on every device): local lookups of the device's b samples; gradients
    exchanged as the runtime does (`dp_dense_gradients`): a dense all-reduce of the fp32
    gradients and touched counts (V (4d + 4) bytes), or an all-gather of each device's b H
    id slots and its pooled fp32 output gradients (`core.dp_exchange`); the same sparse
    update on every replica."""
    e, d = t.dtype_bytes, t.dim
    g = hw.num_devices
    b = batch / g
    touched = expected_unique(batch * t.hotness, t.vocab_size, t.alpha)
    compute = b * t.hotness * d * e + b * d * e + update_bytes(touched, d, e, slots)
    if dp_dense_gradients(t, batch, hw):
        compute += 2 * t.vocab_size * d * 4  # the dense gradient, written and read
        intra, inter = allreduce_split(t.vocab_size * (d * 4 + 4), hw)
        staged_ids = t.vocab_size
    else:
        b_int = batch // g
        per_dev = dp_exchange.sparse_bytes_per_device(
            b_int * id_slots(t), b_int * dp_grad_rows(t), d
        )
        compute += g * per_dev  # every device's id slots and gradients, read by the kernel
        intra, inter = a2a_split(per_dev, hw)
        staged_ids = g * b_int * id_slots(t)
    mem = table_memory(t.vocab_size, d, e, slots) + staged_memory(
        staged_ids, t.vocab_size, d, e, slots
    )
    return Cost(compute, intra, inter, mem)


def rb_requester_cost(t: PlannerTable, r: int, batch: int, hw: HardwareTopology) -> Cost:
    """Work every device does for its own samples of an RB table: it sums r partial vectors
    per sample (and fans the gradient back out)."""
    b = batch / hw.num_devices
    return Cost(compute=2 * b * r * t.dim * t.dtype_bytes)


def ub_requester_cost(t: PlannerTable, batch: int, hw: HardwareTopology) -> Cost:
    """Work every device does for its own samples of a UB table: it pools its b * h ids
    from the returned unique vectors (and scatters their gradients). (A DP table's local
    lookup is already in `dp_cost`.)"""
    e, d = t.dtype_bytes, t.dim
    b = batch / hw.num_devices
    return Cost(compute=2 * (b * t.hotness * d * e + b * d * e))


def dense_seconds(flops_per_sample: float, params: int, batch: int, hw: HardwareTopology) -> float:
    """The data-parallel dense net: forward + backward FLOPs of the local batch, plus the
    all-reduce of its fp32 gradients."""
    b = batch / hw.num_devices
    compute = 3 * flops_per_sample * b / hw.dense_flops
    intra, inter = allreduce_split(params * 4, hw)
    return compute + intra / hw.intra_bw + inter / hw.inter_bw
