"""Stage `explain`: the reason behind every table's decision, written after the search from
the decisions it recorded (`types.Trace`), never inside the algorithm.

A table's reason is its cluster (with why, and every candidate's price), then each split
it took in order: its split for a target step near the bound, rows doubled to fit the
memory cap, rows or columns doubled because it was the heaviest shard on the bottleneck
device (with the step before and after), and shards moved off the busiest device.
"""

from __future__ import annotations

from embark_jax.core.plan import Cluster
from embark_jax.planner.model import ModelSpec, PlannerTable
from embark_jax.planner.types import ClusterChoice, Move, Refinement, Retarget, RowSplit, Trace

__all__ = ["baseline_reasons", "explain"]


def explain(model: ModelSpec, trace: Trace) -> dict[str, str]:
    """Per table name, why the search gave it its cluster and splits."""
    if trace.baseline is not None:
        return {t.name: f"baseline {trace.baseline} was predicted fastest" for t in model.tables}
    tables = {t.name: t for t in model.tables}
    reasons = {c.table: _cluster_reason(tables[c.table], c) for c in trace.clusters}
    moved: dict[str, list[Move]] = {}
    for s in trace.steps:
        if isinstance(s, Move):
            moved.setdefault(s.table, []).append(s)
        else:
            reasons[s.table] = reasons.get(s.table, "") + _step_reason(s)
    for name, ms in moved.items():
        reasons[name] = reasons.get(name, "") + _moves_reason(ms)
    return reasons


def baseline_reasons(model: ModelSpec, kind: str) -> dict[str, str]:
    return {t.name: f"baseline {kind}" for t in model.tables}


_WHY = {
    Cluster.DP: lambda t: "small replica, no routing",
    Cluster.RB: lambda t: f"pooling {t.hotness:g} ids/sample at the owner compresses traffic",
    Cluster.UB: lambda t: (
        "few distinct ids per device (or sequence output): one vector per "
        "unique id is the least traffic"
    ),
}


def _cluster_reason(t: PlannerTable, c: ClusterChoice) -> str:
    priced = ", ".join(
        f"{o.cluster.value} {s * 1e6:.1f} us"
        for o, s in sorted(c.priced, key=lambda x: x[0].sort_key)
    )
    cheapest = min(c.priced, key=lambda x: x[1])[0].cluster if c.priced else c.option.cluster
    if c.option.cluster is not cheapest:  # a bound-guided start chose it (its Retarget says)
        why = f"not the cheapest alone ({cheapest.value}), but it balances the devices"
    else:
        why = _WHY[c.option.cluster](t)
    return f"{c.option.cluster.value}: {why} [{priced}]"


def _moves_reason(ms: list[Move]) -> str:
    first, last = ms[0], ms[-1]
    what = f"a shard moved from device {first.source} to {first.dest}"
    if len(ms) > 1:
        what = f"{len(ms)} shards moved off the busiest devices"
    return (
        f"; {what} to rebalance (busiest device {first.before_s * 1e3:.3f} -> "
        f"{last.after_s * 1e3:.3f} ms)"
    )


def _step_reason(s: RowSplit | Refinement | Retarget) -> str:
    if isinstance(s, RowSplit):
        return f"; rows split to {s.row_shards} to fit the memory cap"
    if isinstance(s, Retarget):
        return (
            f"; r={s.option.row_shards} c={s.option.column_shards}: its fewest device-seconds "
            f"with shards under a target of {s.target_s * 1e3:.3f} ms per device "
            f"({s.target_s / s.bound_s:.2f}x the bound)"
        )
    return (
        f"; split {s.how} -> r={s.option.row_shards} c={s.option.column_shards} (it was the "
        f"heaviest shard on the bottleneck device {s.device}: step {s.before_s * 1e3:.3f} -> "
        f"{s.after_s * 1e3:.3f} ms)"
    )
