"""Stage `refine`: from the proposed options to a placed plan, then better ones.

1. `fit_memory`: place; while a table finds no room, double its row shards (or, if it
   cannot split further, those of the splittable table with the largest shards: that
   frees the most memory everywhere) and place again, until it fits or nothing can split.
2. `improve`: up to `max_rounds` times, take the (at most 3) heaviest sharded tables on
   the bottleneck device, try each with twice the row shards and with twice the column
   shards, and keep the trial with the lowest predicted step (ties: table name, then
   "columns" before "rows"); stop when no trial lowers the step.
3. `split_over`: when many devices are about equally busy, one split cannot lower the
   step; for a target time, split at once the heaviest table on every device above it
   (rows, else columns), place again, repeat; keep the fastest placement seen.
4. `rebalance`: while it lowers the busiest device, move one of its shards to another
   device (the least loaded ones, and the nodes of the shard's column slice, which keep
   hierarchical RB reductions inside a node) with memory left and no shard of the same
   table, or, when no move does, swap one of its shards with a smaller one of a less busy
   device; each change must leave every device it touches below the busiest device's
   time before it (ties: busiest touched device, table, slice, device). Shards are
   repriced with the node-mates of the new placement.

They return the decisions they made (`RowSplit`, `Refinement`, `Move`) for `explain`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from embark_jax.core.plan import Cluster
from embark_jax.planner import cost as C
from embark_jax.planner.enumerators import can_split_rows, split_options
from embark_jax.planner.estimate import shard_cost, table_seconds
from embark_jax.planner.place import place
from embark_jax.planner.types import (
    Evaluation,
    Move,
    Option,
    PlannerError,
    Problem,
    Refinement,
    RowSplit,
)

__all__ = ["IMPROVE_TOP_TABLES", "fit_memory", "improve", "rebalance", "split_over"]

IMPROVE_TOP_TABLES = 3  # sharded tables on the bottleneck device tried per round
MIN_GAIN = 1e-9  # a trial must lower the step by more than this fraction
MOVE_TARGETS = 16  # least-loaded devices tried per shard by `rebalance`
SWAP_TARGETS = 8  # least-loaded devices tried for swaps, and their best-estimated pairs
SWAP_PAIRS = 4


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


def _slice_costs(p: Problem, n: str, o: Option, col: list[int]) -> dict[int, tuple[float, float]]:
    """(seconds, resident bytes) of each shard of one column slice placed on `col`."""
    local, t = p.hw.devices_per_node, p.tables[n]
    out, per_node = {}, Counter(x // local for x in col)
    for dev in col:
        c = shard_cost(p, t, o, per_node[dev // local])
        out[dev] = (sum(C.seconds(c, p.hw)), c.memory)
    return out


def rebalance(
    p: Problem, options: dict[str, Option], best: Evaluation, max_moves: int
) -> tuple[Evaluation, list[Move]]:
    """Moves (or swaps) shards off the busiest device while that lowers it; see the module
    doc."""
    local, g = p.hw.devices_per_node, p.hw.num_devices
    cols = {
        tp.name: [list(c) for c in tp.devices]
        for tp in best.plan.tables
        if tp.cluster is not Cluster.DP
    }
    time, mem = best.device_time.copy(), best.device_memory.copy()
    moves: list[Move] = []
    for _ in range(max_moves):
        d = int(time.argmax())
        top = time[d]
        free = sorted(range(g), key=lambda x: (time[x], x))[:MOVE_TARGETS]
        holders = {n: {x for c in cols[n] for x in c} for n in cols}
        on_d = [(n, k) for n in sorted(cols) for k, col in enumerate(cols[n]) if d in col]
        trial = None
        for n, k in on_d:  # moves
            col = cols[n][k]
            targets = set(free)
            if options[n].cluster is Cluster.RB:  # next to the slice's other row shards
                for x in col:
                    targets.update(range(x // local * local, (x // local + 1) * local))
            for e in sorted(targets - holders[n]):
                after = _after(p, options, cols, time, mem, [(n, k, _swap_dev(col, d, e))])
                if after is not None and (key := _worst(after)) < top * (1 - MIN_GAIN):
                    if trial is None or (key, n, k, e) < trial[0]:
                        trial = ((key, n, k, e), [(n, k, d, e)], after)
        if trial is None:  # swaps: a shard of d for a smaller one of a less busy device
            size = {(n, k): _slice_costs(p, n, options[n], cols[n][k])[d][0] for n, k in on_d}
            for e in free[:SWAP_TARGETS]:
                on_e = {
                    (m, i): _slice_costs(p, m, options[m], c)[e][0]
                    for m in sorted(cols)
                    for i, c in enumerate(cols[m])
                    if e in c
                }
                pairs = sorted(
                    (max(top - size[a] + sb, time[e] - sb + size[a]), a, b)
                    for a in on_d
                    for b, sb in on_e.items()
                    if 0 < size[a] - sb < top - time[e]  # estimate: both end below top
                )
                for _, (n, k), (m, i) in pairs[:SWAP_PAIRS]:
                    if n == m or e in holders[n] or d in holders[m]:
                        continue
                    changes = [
                        (n, k, _swap_dev(cols[n][k], d, e)),
                        (m, i, _swap_dev(cols[m][i], e, d)),
                    ]
                    after = _after(p, options, cols, time, mem, changes)
                    if after is not None and (key := _worst(after)) < top * (1 - MIN_GAIN):
                        if trial is None or (key, n, k, e) < trial[0]:
                            trial = ((key, n, k, e), [(n, k, d, e), (m, i, e, d)], after)
        if trial is None:
            break
        (worst, *_), changed, after = trial
        peak = float(max(worst, _max_except(time, after)))
        for n, k, src, dst in changed:
            moves.append(Move(n, src, dst, top, peak))
            cols[n][k] = _swap_dev(cols[n][k], src, dst)
        for x, (ts, ms) in after.items():
            time[x], mem[x] = ts, ms
    if not moves:
        return best, moves
    ev = place(p, options, fixed=cols, name=best.name)
    return (ev, moves) if ev.step_s <= best.step_s else (best, [])


def _swap_dev(col: list[int], old: int, new: int) -> list[int]:
    return [new if x == old else x for x in col]


def _after(p: Problem, options, cols, time, mem, changes) -> dict | None:
    """(time, memory) of every device that `changes` [(table, slice, new devices)] touch,
    or None when one would exceed the memory cap."""
    delta: dict[int, list[float]] = {}
    for n, k, new_col in changes:
        for sign, col in ((-1.0, cols[n][k]), (1.0, new_col)):
            for x, (ts, ms) in _slice_costs(p, n, options[n], col).items():
                acc = delta.setdefault(x, [0.0, 0.0])
                acc[0] += sign * ts
                acc[1] += sign * ms
    after = {}
    for x, (dt, dm) in delta.items():
        if mem[x] + dm > p.cap:
            return None
        after[x] = (time[x] + dt, mem[x] + dm)
    return after


def _worst(after: dict) -> float:
    return max(v[0] for v in after.values())


def _max_except(time, after: dict) -> float:
    """The busiest device's time once the devices in `after` take their new times."""
    rest = [t for x, t in enumerate(time) if x not in after]
    return max(rest, default=0.0)


def split_over(
    p: Problem, options: dict[str, Option], best: Evaluation, target: float, max_rounds: int
) -> tuple[Evaluation, dict[str, Option], list[Refinement]]:
    """Splits, all at once, the heaviest shard's table on every device busier than `target`
    (rows, else columns) and places again, for up to `max_rounds` rounds; returns the
    fastest placement seen (the splits that led to it)."""
    ev, steps, trail, kept = best, [], [], options
    g = p.hw.num_devices
    for _ in range(max_rounds):
        over = {int(x) for x in np.flatnonzero(ev.device_time > target)}
        if not over:
            break
        heaviest: dict[int, tuple[float, str]] = {}
        for tp in ev.plan.tables:
            if tp.cluster is Cluster.DP or not split_options(
                p.tables[tp.name], options[tp.name], g
            ):
                continue
            s = sum(C.seconds(shard_cost(p, p.tables[tp.name], options[tp.name]), p.hw))
            for x in (x for col in tp.devices for x in col if x in over):
                heaviest[x] = max(heaviest.get(x, (-1.0, "")), (s, tp.name))
        names = sorted({n for _, n in heaviest.values()})
        if not names:
            break
        trial = dict(options)
        for n in names:
            how, new = split_options(p.tables[n], options[n], g)[-1]  # rows if possible
            trial[n] = new
            trail.append(Refinement(n, how, new, ev.bottleneck, ev.step_s, math.nan))
        try:
            ev = place(p, trial)
        except PlannerError:
            break
        options = trial
        if ev.step_s < best.step_s * (1 - MIN_GAIN):
            best, steps = ev, [dataclasses.replace(s, after_s=ev.step_s) for s in trail]
            kept = dict(options)
    return best, kept, steps
