"""The planner's value types, shared by every stage (docs/design.md, section "Planner").

`Option` is one way to shard one table (cluster, row shards, column shards); `Cost` is what
one shard of an option moves per step; `Problem` bundles what every stage prices against
(model, batch, hardware, memory cap); `Evaluation` is a placed plan with its per-device
times. The decision records (`ClusterChoice`, `RowSplit`, `Refinement`) and `Trace` are what
the search decided, in order; `explain` turns them into the per-table reasons afterwards,
so the algorithm itself never formats text.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from embark_jax.core.names import name_mismatch
from embark_jax.core.plan import Cluster, Plan
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import ModelSpec, PlannerTable

__all__ = [
    "Bound",
    "ClusterChoice",
    "Cost",
    "Evaluation",
    "Gap",
    "Move",
    "Option",
    "PlannerError",
    "Problem",
    "Refinement",
    "Retarget",
    "RowSplit",
    "TableBound",
    "Trace",
    "check_plan",
]


class PlannerError(ValueError):
    """No plan fits: names the table and by how much it misses the memory cap."""

    def __init__(self, table: str, need: float, available: float, detail: str = ""):
        self.table, self.need, self.available = table, need, available
        super().__init__(
            f"table {table!r} does not fit: needs {need / 1e9:.2f} GB on a device, "
            f"{available / 1e9:.2f} GB available ({(need - available) / 1e9:.2f} GB short)"
            + (f"; {detail}" if detail else "")
        )


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to shard a table: its cluster, split into `row_shards` x `column_shards`
    shards (one per device); a DP option is one replica on every device. `capacity_factor`
    and `unique_capacity`: a given plan's routing capacities (None: the runtime's default
    sizing), which the cost model prices."""

    cluster: Cluster
    row_shards: int = 1
    column_shards: int = 1
    capacity_factor: float | None = None
    unique_capacity: int | None = None

    @property
    def sort_key(self) -> tuple[str, int, int]:
        return (self.cluster.value, self.row_shards, self.column_shards)

    @property
    def shards(self) -> int:
        return self.row_shards * self.column_shards

    def with_rows(self, row_shards: int) -> Option:
        return dataclasses.replace(self, row_shards=row_shards)

    def with_columns(self, column_shards: int) -> Option:
        return dataclasses.replace(self, column_shards=column_shards)


@dataclasses.dataclass(frozen=True)
class Cost:
    """Bytes a device moves for one shard in one step."""

    compute: float = 0.0  # HBM bytes read + written (lookup, pooling, backward, update)
    intra: float = 0.0  # bytes over intra-node links
    inter: float = 0.0  # bytes over inter-node links
    memory: float = 0.0  # resident bytes (table + optimizer slots + routing buffers)


def check_plan(model: ModelSpec, plan: Plan, hw: HardwareTopology) -> None:
    """A given plan must be for these devices and this model's tables (`ValueError`, one
    line naming the mismatch), before anything prices it."""
    t = plan.topology
    if (t.num_nodes, t.devices_per_node) != (hw.num_nodes, hw.devices_per_node):
        raise ValueError(
            f"the plan is for {t.num_nodes}x{t.devices_per_node} devices, the hardware "
            f"{hw.name!r} is {hw.num_nodes}x{hw.devices_per_node}"
        )
    unknown, missing = name_mismatch(
        (tp.name for tp in plan.tables), (x.name for x in model.tables)
    )
    parts = [
        f"{what} {names[:5]}"
        for what, names in (
            ("tables not in the model", unknown),
            ("tables without a placement", missing),
        )
        if names
    ]
    if parts:
        raise ValueError(f"the plan does not match model {model.name!r}: " + "; ".join(parts))


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """What every stage prices against: the model, the global batch, the hardware and the
    per-device memory cap (bytes)."""

    model: ModelSpec
    batch: int
    hw: HardwareTopology
    cap: float
    tables: dict[str, PlannerTable] = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "tables", {t.name: t for t in self.model.tables})

    @classmethod
    def create(
        cls, model: ModelSpec, batch: int, hw: HardwareTopology, memory_fraction: float | None
    ) -> Problem:
        """`memory_fraction` of each device's memory is the cap; None: no cap."""
        cap = math.inf if memory_fraction is None else memory_fraction * hw.memory_bytes
        return cls(model, batch, hw, cap)


@dataclasses.dataclass(frozen=True)
class TableBound:
    """One table in the lower bound: the option the relaxation priced it with (for a range
    of row counts, the smallest), its device-seconds, its floor on the busiest device (its
    uniform work plus its smallest shard) and what the memory cap ruled out ("" if none)."""

    table: str
    option: Option
    device_s: float
    floor_s: float
    ruled_out: str = ""


@dataclasses.dataclass(frozen=True)
class Bound:
    """A lower bound on the predicted step of every legal plan (`bound.lower_bound`):
    `embedding_s` (the busiest device at least) + `dense_s`. `mean_s` is the relaxation's
    mean device time (cheapest device-seconds of every table / G); `binding` says what sets
    the bound ("mean", or "floor of <table>": the table's smallest shard plus every table's
    uniform work); `unconstrained_s` is the bound without the memory cap."""

    step_s: float
    embedding_s: float
    dense_s: float
    mean_s: float
    binding: str
    unconstrained_s: float
    tables: tuple[TableBound, ...] = ()

    def table(self, name: str) -> TableBound:
        return next(t for t in self.tables if t.table == name)


@dataclasses.dataclass(frozen=True)
class Gap:
    """Where a plan's predicted step exceeds its bound (seconds): `imbalance_s` (busiest
    minus mean device), `extra_work_s` (the plan's mean device minus the relaxation's: its
    options cost more device-seconds than the cheapest ones, per table in `tables`, largest
    first), and `memory_s` (what the memory cap adds to the bound itself)."""

    step_s: float
    bound_s: float
    imbalance_s: float
    extra_work_s: float
    memory_s: float
    tables: tuple[tuple[str, float], ...] = ()

    @property
    def ratio(self) -> float:
        return self.step_s / self.bound_s if self.bound_s > 0 else math.inf


@dataclasses.dataclass
class Evaluation:
    """A placed plan with its per-device costs (seconds) and the predicted step time."""

    plan: Plan
    device_compute: np.ndarray
    device_comm: np.ndarray
    device_intra: np.ndarray
    device_inter: np.ndarray
    device_memory: np.ndarray
    dense_s: float
    name: str = "embark"
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    bound: Bound | None = None  # the lower bound for the same model, batch and hardware
    gap: Gap | None = None  # where this plan's step exceeds the bound

    @property
    def bound_ratio(self) -> float | None:
        """Predicted step / lower bound (>= 1), or None without a bound."""
        if self.bound is None:
            return None
        return self.step_s / self.bound.step_s if self.bound.step_s > 0 else math.inf

    @property
    def device_time(self) -> np.ndarray:
        return self.device_compute + self.device_comm

    @property
    def embedding_s(self) -> float:
        return float(self.device_time.max())

    @property
    def step_s(self) -> float:
        return self.embedding_s + self.dense_s

    @property
    def bottleneck(self) -> int:
        return int(np.argmax(self.device_time))

    @property
    def comm_share(self) -> float:
        d = self.bottleneck
        return float(self.device_comm[d] / self.step_s) if self.step_s else 0.0


# --- what the search decided (read by `explain`) ------------------------------------------


@dataclasses.dataclass(frozen=True)
class ClusterChoice:
    """Stage `propose`: the cluster picked for a table and every candidate's price
    (device-seconds per step over the whole machine), in candidate order."""

    table: str
    option: Option
    priced: tuple[tuple[Option, float], ...]


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Stage `refine.fit_memory`: a table's rows were doubled so that it finds room."""

    table: str
    row_shards: int


@dataclasses.dataclass(frozen=True)
class Refinement:
    """Stage `refine.improve`: a split of the heaviest shard on the bottleneck device that
    lowered the predicted step from `before_s` to `after_s`."""

    table: str
    how: str  # "rows" or "columns"
    option: Option
    device: int
    before_s: float
    after_s: float


@dataclasses.dataclass(frozen=True)
class Retarget:
    """Stage `propose.target_options`: the table took `option`, its fewest device-seconds
    with its largest shard under `target_s` of embedding time per device (`bound_s`: the
    bound's embedding time)."""

    table: str
    option: Option
    target_s: float
    bound_s: float


@dataclasses.dataclass(frozen=True)
class Move:
    """Stage `refine.rebalance`: a shard of `table` moved from the busiest device `source`
    to `dest`; the busiest device's embedding time went from `before_s` to `after_s`."""

    table: str
    source: int
    dest: int
    before_s: float
    after_s: float


@dataclasses.dataclass
class Trace:
    """The search's decisions in the order it made them; `baseline` names the baseline that
    replaced the search's plan (predicted faster), if any."""

    clusters: list[ClusterChoice] = dataclasses.field(default_factory=list)
    steps: list[RowSplit | Refinement | Retarget | Move] = dataclasses.field(default_factory=list)
    baseline: str | None = None
