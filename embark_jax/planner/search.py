"""The planner's pipeline (docs/design.md, section "Planner"): `plan` runs the stages in order,
each a module of small pure functions, all priced by the same cost model (`cost`):

  bound      a lower bound on the step of any legal plan (`bound.lower_bound`);
  propose    two starts: (a) the cheapest of each table's clusters as one shard (`enumerators`,
             priced by `estimate`), DP within a memory budget, and row splits for shards
             too large to pack; (b) for a few targets above the bound's embedding time, each
             table's cheapest option whose shards stay under the target (`target_options`:
             splits heavy tables over idle devices, replicates small hot ones);
  refine     place the shards under the memory cap (`place`), splitting rows of tables that
             find no room; split the heaviest shards on the bottleneck device while that
             lowers the predicted step; move shards off the busiest device while that
             lowers it (`rebalance`); the faster of the two starts wins (ties: (a));
  baselines  keep the plan only if no baseline (tw, rw, trw, dp) is predicted faster;
  explain    the reason for every table's decision, from the decisions recorded above;
             the result carries the bound and where its step exceeds it (`bound.gap`).

Deterministic: every candidate list is sorted and ties are broken by name and device id.
"""

from __future__ import annotations

import dataclasses

from embark_jax.planner.baselines import best_of_baselines
from embark_jax.planner.bound import attach, lower_bound
from embark_jax.planner.explain import explain
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import ModelSpec
from embark_jax.planner.propose import choose_clusters, presplit_rows, target_options
from embark_jax.planner.refine import fit_memory, improve, rebalance, split_over
from embark_jax.planner.types import (
    Bound,
    ClusterChoice,
    Evaluation,
    Move,
    Option,
    PlannerError,
    Problem,
    Retarget,
    Trace,
)

__all__ = ["TARGETS", "plan"]

# targets of start (b), as multiples of the bound's embedding time: below 1, smaller shards
# that pack better; above, fewer splits
TARGETS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
REFINED_STARTS = 6  # the fastest placed targets refined further
# `split_over` targets for the best plan, as multiples of the bound's embedding time, and
# its rounds
OVER_TARGETS = (1.05, 1.15)
OVER_ROUNDS = 8


def plan(
    model: ModelSpec,
    batch_size: int,
    hw: HardwareTopology,
    *,
    memory_fraction: float = 0.9,
    max_rounds: int = 20,
    compare_baselines: bool = True,
    targeted: bool = True,
    max_moves: int | None = None,
) -> Evaluation:
    """The EMBark plan for `model` on `hw`, with its lower bound and gap (`Evaluation.bound`,
    `.gap`); never predicted slower than a baseline unless `compare_baselines` is off.
    `targeted=False` skips the bound-guided start (b); `max_moves` caps `rebalance`
    (default: the number of devices). Raises `PlannerError` when no plan fits."""
    if batch_size % hw.num_devices:
        raise ValueError(f"batch size {batch_size} is not a multiple of {hw.num_devices} devices")
    p = Problem.create(model, batch_size, hw, memory_fraction)
    moves = hw.num_devices if max_moves is None else max_moves
    bound = lower_bound(p)
    best, trace = _greedy(p, max_rounds, moves)
    if targeted:
        for ev, tr in _targeted(p, bound, max_rounds, moves):
            if ev.step_s < best.step_s:
                best, trace = ev, tr
        best, trace = _close_gap(p, bound, best, trace, max_rounds, moves)
    if compare_baselines:
        best, trace.baseline = best_of_baselines(best, model, batch_size, hw, memory_fraction)
        if trace.baseline is not None:
            best.name = f"embark (= baseline {trace.baseline})"
    best.reasons = explain(model, trace)
    return attach(p, best, bound)


def _greedy(p: Problem, max_rounds: int, moves: int) -> tuple[Evaluation, Trace]:
    """Start (a): cheapest clusters, row splits to fit, bottleneck splits, moves."""
    trace = Trace()
    options, trace.clusters = choose_clusters(p)
    options = presplit_rows(p, options)
    best, options, splits = fit_memory(p, options)
    best, options, refinements = improve(p, options, best, max_rounds)
    best, moved = rebalance(p, options, best, moves)
    trace.steps = [*splits, *refinements, *moved]
    return best, trace


def _close_gap(
    p: Problem, bound: Bound, best: Evaluation, trace: Trace, max_rounds: int, moves: int
) -> tuple[Evaluation, Trace]:
    """From the best plan so far, `split_over` each of `OVER_TARGETS` (the heaviest table
    on every device over the target split at once), refined again; the fastest wins."""
    options = {t.name: Option(t.cluster, t.row_shards, t.column_shards) for t in best.plan.tables}
    start, base = best, [s for s in trace.steps if not isinstance(s, Move)]  # re-placed
    for x in OVER_TARGETS:
        ev, opts, splits = split_over(p, options, start, bound.embedding_s * x, OVER_ROUNDS)
        if not splits:
            continue
        ev, opts, refinements = improve(p, opts, ev, max_rounds)
        ev, moved = rebalance(p, opts, ev, moves)
        if ev.step_s < best.step_s:
            best = ev
            trace = dataclasses.replace(trace, steps=[*base, *splits, *refinements, *moved])
    return best, trace


def _targeted(p: Problem, bound: Bound, max_rounds: int, moves: int):
    """Start (b): `target_options` for each of `TARGETS`, placed (once per distinct set of
    options); the `REFINED_STARTS` fastest (ties: the lower target) refined; yields
    (evaluation, trace)."""
    _, choices = choose_clusters(p)
    priced = {c.table: c.priced for c in choices}
    starts, seen = [], []
    for i, x in enumerate(TARGETS):
        target = bound.embedding_s * x
        try:
            ev, options, splits = fit_memory(p, target_options(p, target))
        except PlannerError:
            continue
        if options in seen:  # the same options as a lower target: the same plan
            continue
        seen.append(options)
        starts.append((ev.step_s, i, target, ev, options, splits))
    starts.sort(key=lambda s: (s[0], s[1]))
    for _, _, target, ev, options, splits in starts[:REFINED_STARTS]:
        trace = Trace()
        trace.clusters = [ClusterChoice(n, options[n], priced[n]) for n in sorted(options)]
        retargets = [Retarget(n, o, target, bound.embedding_s) for n, o in sorted(options.items())]
        ev, options, refinements = improve(p, options, ev, max_rounds)
        ev, moved = rebalance(p, options, ev, moves)
        trace.steps = [*retargets, *splits, *refinements, *moved]
        yield ev, trace
