"""Stage `refine`: from the proposed options to a placed plan, then better ones.

1. `fit_memory`: place; while a table finds no room, double its row shards (or, if it
   cannot split further, those of the splittable table with the largest shards: that
   frees the most memory everywhere) and place again, until it fits or nothing can split.
2. `improve`: up to `max_rounds` times, take the (at most 3) heaviest sharded tables on
   the bottleneck device, try each with twice the row shards and with twice the column
   shards, and keep the trial with the lowest predicted step (ties: table name, then
   "columns" before "rows"); stop when no trial lowers the step.

Both return the decisions they made (`RowSplit`, `Refinement`) for `explain`.
"""

from __future__ import annotations

from embark_jax.core.plan import Cluster
from embark_jax.planner.enumerators import can_split_rows, split_options
from embark_jax.planner.estimate import shard_cost, table_seconds
from embark_jax.planner.place import place
from embark_jax.planner.types import Evaluation, Option, PlannerError, Problem, Refinement, RowSplit

__all__ = ["IMPROVE_TOP_TABLES", "fit_memory", "improve"]

IMPROVE_TOP_TABLES = 3  # sharded tables on the bottleneck device tried per round
MIN_GAIN = 1e-9  # a trial must lower the step by more than this fraction


def fit_memory(
    p: Problem, options: dict[str, Option]
) -> tuple[Evaluation, dict[str, Option], list[RowSplit]]:
    """The first placement that fits, the options it placed and the row splits it took."""
    options, splits = dict(options), []
    g = p.hw.num_devices
    while True:
        try:
            return place(p, options), options, splits
        except PlannerError as e:
            can = [n for n in sorted(options) if can_split_rows(p.tables[n], options[n], g)]
            if e.table in can:
                victim = e.table
            else:
                victim = max(
                    can,
                    default=None,
                    key=lambda n: shard_cost(p, p.tables[n], options[n]).memory,
                )
            if victim is None:
                raise
            r = options[victim].row_shards * 2
            options[victim] = options[victim].with_rows(r)
            splits.append(RowSplit(victim, r))


def improve(
    p: Problem, options: dict[str, Option], best: Evaluation, max_rounds: int
) -> tuple[Evaluation, dict[str, Option], list[Refinement]]:
    """Greedy splitting of the bottleneck's heaviest shards; see the module doc."""
    steps = []
    for _ in range(max_rounds):
        trials = _trials(p, options, best)
        if not trials:
            break
        step, name, how, trial, ev = min(trials, key=lambda x: (x[0], x[1], x[2]))
        if step >= best.step_s * (1 - MIN_GAIN):
            break
        steps.append(Refinement(name, how, trial[name], best.bottleneck, best.step_s, step))
        options, best = trial, ev
    return best, options, steps


def _trials(p: Problem, options: dict[str, Option], best: Evaluation) -> list[tuple]:
    """(step, table, how, options, evaluation) of every split that still fits."""
    dev = best.bottleneck
    on_dev = sorted(
        (
            tp.name
            for tp in best.plan.tables
            if tp.cluster is not Cluster.DP and any(dev in col for col in tp.devices)
        ),
        key=lambda n: (-table_seconds(p, p.tables[n], options[n]), n),
    )[:IMPROVE_TOP_TABLES]
    trials = []
    for n in on_dev:
        for how, new in split_options(p.tables[n], options[n], p.hw.num_devices):
            trial = dict(options, **{n: new})
            try:
                ev = place(p, trial)
            except PlannerError:
                continue
            trials.append((ev.step_s, n, how, trial, ev))
    return trials
