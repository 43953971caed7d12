"""The planner's pipeline (docs/design.md, section "Planner"): `plan` runs the stages in order,
each a module of small pure functions, all priced by the same cost model (`cost`):

  propose    the cheapest of each table's candidates (`enumerators`, priced by `estimate`):
             DP within a memory budget, RB, UB; and row splits for shards too large to pack;
  refine     place the shards under the memory cap (`place`), splitting rows of tables that
             find no room; then split the heaviest shards on the bottleneck device while
             that lowers the predicted step;
  baselines  keep the plan only if no baseline (tw, rw, trw, dp) is predicted faster;
  explain    the reason for every table's decision, from the decisions recorded above.

Deterministic: every candidate list is sorted and ties are broken by name and device id.
"""

from __future__ import annotations

from embark_jax.planner.baselines import best_of_baselines
from embark_jax.planner.explain import explain
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import ModelSpec
from embark_jax.planner.propose import choose_clusters, presplit_rows
from embark_jax.planner.refine import fit_memory, improve
from embark_jax.planner.types import Evaluation, Problem, Trace

__all__ = ["plan"]


def plan(
    model: ModelSpec,
    batch_size: int,
    hw: HardwareTopology,
    *,
    memory_fraction: float = 0.9,
    max_rounds: int = 20,
    compare_baselines: bool = True,
) -> Evaluation:
    """The EMBark plan for `model` on `hw`; never predicted slower than a baseline (unless
    `compare_baselines` is off). Raises `PlannerError` when no plan fits."""
    if batch_size % hw.num_devices:
        raise ValueError(f"batch size {batch_size} is not a multiple of {hw.num_devices} devices")
    p = Problem.create(model, batch_size, hw, memory_fraction)
    trace = Trace()
    options, trace.clusters = choose_clusters(p)
    options = presplit_rows(p, options)
    best, options, splits = fit_memory(p, options)
    best, options, refinements = improve(p, options, best, max_rounds)
    trace.steps = [*splits, *refinements]
    if compare_baselines:
        best, trace.baseline = best_of_baselines(best, model, batch_size, hw, memory_fraction)
        if trace.baseline is not None:
            best.name = f"embark (= baseline {trace.baseline})"
    best.reasons = explain(model, trace)
    return best
