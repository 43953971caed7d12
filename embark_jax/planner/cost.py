"""The planner's cost model: small pure functions, one per quantity and one per cluster kind,
all per step (forward plus backward) and per device, in bytes; `seconds` turns bytes into
time on a topology. `estimate` applies them to a table's `Option`.

Notation: B global batch, G devices (N nodes x L per node), h ids per sample for the table,
d its dim, d' = d / c a column slice, r row shards, e bytes per element, u a unique ratio.
`slots` is the optimizer's slot footprint: (float32 slots per element, per row).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import PlannerTable
from embark_jax.planner.types import Cost

__all__ = [
    "Cost",
    "dense_seconds",
    "dp_cost",
    "expected_unique",
    "rb_requester_cost",
    "rb_shard_cost",
    "seconds",
    "slot_floats_per_row",
    "table_memory",
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


def _flat_split(nbytes: float, hw: HardwareTopology) -> tuple[float, float]:
    """An all-to-all over every device: (G - L) / G of the bytes cross nodes."""
    g, local = hw.num_devices, hw.devices_per_node
    return nbytes * local / g, nbytes * (g - local) / g


def _allreduce_split(nbytes: float, hw: HardwareTopology) -> tuple[float, float]:
    """A hierarchical (NCCL-style) all-reduce of `nbytes` per device: reduce-scatter and
    all-gather inside the node, and 1/L of the buffer per device across nodes."""
    local, n = hw.devices_per_node, hw.num_nodes
    return 2 * nbytes * (local - 1) / local, 2 * nbytes / local * (n - 1) / n


@functools.lru_cache(maxsize=1 << 16)
def rb_shard_cost(
    t: PlannerTable,
    r: int,
    c: int,
    batch: int,
    hw: HardwareTopology,
    slots: tuple[int, int],
    row_shards_in_node: int = 1,
    hierarchical: bool = False,
) -> Cost:
    """One RB shard: it receives B*h/r ids, pools them into one partial vector per sample
    (B*d' bytes out, the same gradient bytes back), and updates its touched rows."""
    e, w = t.dtype_bytes, t.dim // c
    n_ids = batch * t.hotness / r
    touched = expected_unique(batch * t.hotness, t.vocab_size, t.alpha) / r
    compute = (
        (n_ids * w * e + batch * w * e)
        + (batch * w * 4 + n_ids * w * 4)
        + update_bytes(touched, w, e, slots)
    )
    ids = n_ids * 2 * ID_BYTES
    vectors = 2 * batch * w * e  # partials forward + gradients backward
    i_intra, i_inter = _flat_split(ids, hw)
    if hierarchical and hw.num_nodes > 1:
        n = hw.num_nodes
        v_intra = vectors * (hw.devices_per_node - 1) / hw.devices_per_node
        v_inter = vectors * (n - 1) / n / max(row_shards_in_node, 1)
    else:
        v_intra, v_inter = _flat_split(vectors, hw)
    rows = math.ceil(t.vocab_size / r)
    mem = table_memory(rows, w, e, slots) + n_ids * (2 * ID_BYTES + w * e)  # + receive buffers
    return Cost(compute, i_intra + v_intra, i_inter + v_inter, mem)


@functools.lru_cache(maxsize=1 << 16)
def ub_shard_cost(
    t: PlannerTable, r: int, c: int, batch: int, hw: HardwareTopology, slots: tuple[int, int]
) -> Cost:
    """One UB shard: every device sends its unique ids (u * b * h) split over r shards;
    the shard returns one vector per requested id and gets one gradient back per id."""
    e, w = t.dtype_bytes, t.dim // c
    b = batch / hw.num_devices
    u_local = unique_ratio(t, b * t.hotness) * b * t.hotness
    n = hw.num_devices * u_local / r
    touched = expected_unique(batch * t.hotness, t.vocab_size, t.alpha) / r
    compute = 2 * n * w * e + n * w * 4 + update_bytes(touched, w, e, slots)
    intra, inter = _flat_split(n * ID_BYTES + 2 * n * w * e, hw)
    rows = math.ceil(t.vocab_size / r)
    mem = table_memory(rows, w, e, slots) + n * (ID_BYTES + w * e)  # + receive buffers
    return Cost(compute, intra, inter, mem)


@functools.lru_cache(maxsize=1 << 16)
def dp_cost(t: PlannerTable, batch: int, hw: HardwareTopology, slots: tuple[int, int]) -> Cost:
    """A DP replica (on every device): local lookups of the device's b samples; gradients
    exchanged as the cheaper of a dense all-reduce (2 V d) and an all-gather of the
    per-id gradients (B h d); the same sparse update on every replica."""
    e, d = t.dtype_bytes, t.dim
    g = hw.num_devices
    b = batch / g
    touched = expected_unique(batch * t.hotness, t.vocab_size, t.alpha)
    compute = (
        b * t.hotness * d * e
        + b * d * e
        + b * t.hotness * d * 4
        + update_bytes(touched, d, e, slots)
    )
    dense = _allreduce_split(t.vocab_size * (d * 4 + 4), hw)
    sparse = _flat_split((g - 1) * b * t.hotness * (d * 4 + ID_BYTES), hw)
    intra, inter = min(dense, sparse, key=lambda x: x[0] / hw.intra_bw + x[1] / hw.inter_bw)
    return Cost(compute, intra, inter, table_memory(t.vocab_size, d, e, slots))


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
    intra, inter = _allreduce_split(params * 4, hw)
    return compute + intra / hw.intra_bw + inter / hw.inter_bw
