"""Stage `baselines`: the classic plans the planner must never lose to, in the same format and
priced by the same cost model, and the pricing of any given plan.

`tw`: table i on device i mod G; `rw`: every table row-split over all devices; `trw`: table
i on node i mod N, row-split over that node's devices (the paper's baseline); `dp`: every
table replicated. Sharded baseline tables are RB, or UB for sequence outputs.
"""

from __future__ import annotations

from embark_jax.core.plan import Cluster, Plan
from embark_jax.core.specs import Combiner
from embark_jax.planner.bound import attach
from embark_jax.planner.explain import baseline_reasons
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import ModelSpec, PlannerTable
from embark_jax.planner.place import Placement, place
from embark_jax.planner.types import Evaluation, Option, PlannerError, Problem, check_plan

__all__ = ["BASELINES", "baseline", "best_of_baselines", "evaluate"]

BASELINES = ("tw", "rw", "trw", "dp")


def _baseline_table(
    kind: str, i: int, t: PlannerTable, hw: HardwareTopology
) -> tuple[Option, Placement]:
    """Table `t` (the i-th of the model) in baseline `kind`: its option and devices."""
    g, local = hw.num_devices, hw.devices_per_node
    sharded = Cluster.UB if t.combiner is Combiner.NONE else Cluster.RB
    if kind == "tw":
        return Option(sharded), [[i % g]]
    if kind == "rw":
        r = min(g, t.vocab_size)
        return Option(sharded, r), [list(range(r))]
    if kind == "trw":
        r = min(local, t.vocab_size)
        node = i % hw.num_nodes
        return Option(sharded, r), [[node * local + j for j in range(r)]]
    if kind == "dp":
        return Option(Cluster.DP), [list(range(g))]
    raise ValueError(f"unknown baseline {kind!r}; choose from {BASELINES}")


def baseline(
    model: ModelSpec,
    batch_size: int,
    hw: HardwareTopology,
    kind: str,
    *,
    memory_fraction: float = 0.9,
    with_bound: bool = True,
) -> Evaluation:
    """Baseline `kind` (see the module doc), with the lower bound and its gap unless
    `with_bound` is off; `PlannerError` if a device exceeds `memory_fraction` of its
    memory."""
    options, fixed = {}, {}
    for i, t in enumerate(model.tables):
        options[t.name], fixed[t.name] = _baseline_table(kind, i, t, hw)
    p = Problem.create(model, batch_size, hw, memory_fraction)
    ev = place(p, options, fixed=fixed, name=kind)
    ev.reasons = baseline_reasons(model, kind)
    return attach(p, ev) if with_bound else ev


def best_of_baselines(
    ev: Evaluation, model: ModelSpec, batch_size: int, hw: HardwareTopology, memory_fraction: float
) -> tuple[Evaluation, str | None]:
    """`ev`, or the fastest baseline predicted faster than it (and that baseline's name)."""
    winner = None
    for kind in BASELINES:
        try:
            other = baseline(
                model, batch_size, hw, kind, memory_fraction=memory_fraction, with_bound=False
            )
        except PlannerError:
            continue
        if other.step_s < ev.step_s:
            ev, winner = other, kind
    return ev, winner


def evaluate(model: ModelSpec, plan_: Plan, hw: HardwareTopology) -> Evaluation:
    """Prices an existing plan (e.g. from a JSON file), without a memory cap (and with the
    lower bound without one). `ValueError` if the plan is not for `hw`'s devices or
    `model`'s tables."""
    check_plan(model, plan_, hw)
    options = {
        t.name: Option(
            t.cluster, t.row_shards, t.column_shards, t.capacity_factor, t.unique_capacity
        )
        for t in plan_.tables
    }
    fixed = {t.name: [list(c) for c in t.devices] for t in plan_.tables}
    p = Problem.create(model, plan_.batch_size, hw, None)
    return attach(p, place(p, options, fixed=fixed, name="given"))
