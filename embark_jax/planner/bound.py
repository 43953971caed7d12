"""Stage `bound`: a lower bound on the predicted step time of ANY legal plan for a model, batch
and topology, priced by the same cost functions as the search (`estimate`, `cost`).

Every device carries, for each table, the table's uniform work (the requester side of a
sharded table, or a DP replica) and the shards placed on it. A plan's step is the busiest
device's time plus the dense net. Two relaxations bound the busiest device from below:

* **mean**: the busiest device is at least the mean, i.e. the machine-wide device-seconds of
  all tables divided by G. Each table contributes at least its cheapest option's
  device-seconds (`estimate.table_seconds`, RB row shards placed in as few nodes as
  possible);
* **floor**: whichever device holds a shard of table t carries that shard (at least the
  option's smallest one: it cannot be split further than r x c shards) plus every table's
  uniform work.

The bound is the least tau such that every table has an option whose floor is <= tau and
the tables' cheapest such options together take <= tau x G device-seconds; an exact sweep
over the floors finds it. Options are every legal split (the `Plan` rules: c divides d,
r <= V, r x c <= G), not only the search's powers of two; options that cannot fit the memory
cap (a DP replica, or a shard larger than the cap) are ruled out. To keep it cheap, row
counts are grouped in ranges [lo, hi] (1, 2-3, 4-7, ...): a range is priced with the
device-seconds and uniform work of `lo` and the shard of `hi`, each a lower bound over the
range (device-seconds and the uniform work never fall, and a shard never grows, with more
rows shards; `tests/planner/test_bound.py` checks these monotonicities and, on small
models, that an exhaustive search over all plans never beats the bound).

`gap` explains a placed plan's distance to the bound: imbalance (busiest vs mean device),
work above the relaxation (the plan's options cost more device-seconds than the cheapest),
and what the memory cap ruled out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

from embark_jax.core.plan import Cluster
from embark_jax.planner import cost as C
from embark_jax.planner.enumerators import cluster_options
from embark_jax.planner.estimate import requester_cost, shard_cost, table_seconds
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import ModelSpec, PlannerTable
from embark_jax.planner.types import Bound, Evaluation, Gap, Option, Problem, TableBound

__all__ = [
    "Bound",
    "Gap",
    "attach",
    "gap",
    "lower_bound",
    "plan_table_seconds",
    "row_ranges",
    "step_bound",
    "table_options",
]


@dataclasses.dataclass(frozen=True)
class _Priced:
    """One option (or range of row counts) of a table, as the bound sees it."""

    option: Option  # the range's smallest row count
    hi: int  # the range's largest row count
    device_s: float  # machine-wide device-seconds (lower bound over the range)
    uniform_s: float  # per-device uniform work: requester side or DP replica
    shard_s: float  # the smallest shard's time (0 for DP: it is uniform)
    memory: float  # the smallest shard's resident bytes (a DP replica's for DP)


EXACT_RANGE = 4  # row ranges this short are priced at each of their row counts


def row_ranges(max_rows: int) -> list[tuple[int, int]]:
    """[1, 1], [2, 3], [4, 7], ... up to `max_rows` (inclusive ranges covering 1..max)."""
    out, lo = [], 1
    while lo <= max_rows:
        out.append((lo, min(2 * lo - 1, max_rows)))
        lo *= 2
    return out


def _seconds(p: Problem, c) -> float:
    return sum(C.seconds(c, p.hw))


def _price(p: Problem, t: PlannerTable, o: Option, hi: int) -> _Priced:
    g, local = p.hw.num_devices, p.hw.devices_per_node
    uniform = _seconds(p, requester_cost(p, t, o))
    if o.cluster is Cluster.DP:
        replica = shard_cost(p, t, o)
        s = _seconds(p, replica)
        return _Priced(o, 1, g * s, s, 0.0, replica.memory)
    # short ranges: the least over their row counts, as they run; longer ones price buckets
    # at their fair share (padded capacities are not monotone in r: binomial tails, UB's cap
    # at a shard's rows; their fair share is, and bounds them from below)
    if hi - o.row_shards < EXACT_RANGE:
        opts = [o.with_rows(r) for r in range(o.row_shards, hi + 1)]
        shards = [shard_cost(p, t, x, min(x.row_shards, local)) for x in opts]
        ds = min(table_seconds(p, t, x, best_in_node=True) for x in opts)
        shard_s = min(_seconds(p, c) for c in shards)
        return _Priced(o, hi, ds, uniform, shard_s, min(c.memory for c in shards))
    smallest = shard_cost(p, t, o.with_rows(hi), min(hi, local), ideal=True)
    ds = table_seconds(p, t, o, best_in_node=True, ideal=True)
    return _Priced(o, hi, ds, uniform, _seconds(p, smallest), smallest.memory)


def table_options(p: Problem, t: PlannerTable) -> list[_Priced]:
    """Every legal option of `t` (row counts grouped in ranges), priced for the bound;
    memory not checked."""
    g = p.hw.num_devices
    out = []
    for base in cluster_options(t):
        if base.cluster is Cluster.DP:
            out.append(_price(p, t, base, 1))
            continue
        for c in (c for c in range(1, t.dim + 1) if t.dim % c == 0 and c <= g):
            for lo, hi in row_ranges(min(g // c, t.vocab_size)):
                out.append(_price(p, t, Option(base.cluster, lo, c), hi))
    return out


def _kind(t: PlannerTable) -> PlannerTable:
    return dataclasses.replace(t, name="")


def _options_of(p: Problem, t: PlannerTable) -> tuple[_Priced, ...]:
    """`table_options` of a table, shared by tables that differ only by name."""
    return _cached_options(p, _kind(t))


@functools.lru_cache(maxsize=1024)
def _cached_options(p: Problem, t: PlannerTable) -> tuple[_Priced, ...]:
    return tuple(table_options(p, t))


def _sweep(kinds: list[tuple[int, list[_Priced]]], uniform_min: float, g: int):
    """The least tau with, for every table kind (count m, options), an option whose floor
    `uniform_min - min uniform + uniform + shard` is <= tau, and the sum of the cheapest such
    options' device-seconds <= tau x G. Returns (tau, mean part, index of the binding kind
    or None, chosen option per kind)."""
    events = []
    for i, (_, opts) in enumerate(kinds):
        own = min(o.uniform_s for o in opts)
        for o in opts:
            events.append((uniform_min - own + o.uniform_s + o.shard_s, o.device_s, i, o))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    best_ds = [math.inf] * len(kinds)
    chosen: list[_Priced | None] = [None] * len(kinds)
    missing, total = len(kinds), 0.0
    result = (math.inf, math.inf, None, list(chosen))
    j = 0
    while j < len(events):
        tau = events[j][0]
        last = None
        while j < len(events) and events[j][0] == tau:  # all options with this floor
            _, ds, i, o = events[j]
            if ds < best_ds[i]:
                m = kinds[i][0]
                if best_ds[i] == math.inf:
                    missing -= 1
                else:
                    total -= m * best_ds[i]
                total += m * ds
                best_ds[i], chosen[i] = ds, o
            last = i
            j += 1
        if missing:
            continue
        mean = total / g
        if max(tau, mean) < result[0]:
            result = (max(tau, mean), mean, last if tau > mean else None, list(chosen))
        if mean <= tau:  # larger tau can only be worse
            break
    return result


def step_bound(
    model: ModelSpec, batch_size: int, hw: HardwareTopology, *, memory_fraction: float = 0.9
) -> Bound:
    """The lower bound on the predicted step of any plan of `model` on `hw` whose devices
    stay under `memory_fraction` of their memory (None: no cap)."""
    return lower_bound(Problem.create(model, batch_size, hw, memory_fraction))


def lower_bound(p: Problem) -> Bound:
    """The bound for the problem (see the module doc)."""
    g = p.hw.num_devices
    dense = C.dense_seconds(p.model.dense_flops_per_sample, p.model.dense_params, p.batch, p.hw)
    tables = sorted(p.model.tables, key=lambda t: t.name)
    groups: dict[PlannerTable, list[PlannerTable]] = {}
    for t in tables:
        groups.setdefault(_kind(t), []).append(t)

    def solve(cap: float):
        kinds, ruled = [], {}
        for k, members in groups.items():
            opts = _options_of(p, members[0])
            fit = [o for o in opts if o.memory <= cap]
            ruled[k] = [o for o in opts if o.memory > cap]
            if not fit:
                return None, ruled
            kinds.append((len(members), fit))
        uniform_min = sum(m * min(o.uniform_s for o in opts) for m, opts in kinds)
        return _sweep(kinds, uniform_min, g), ruled

    sol, ruled = solve(p.cap)
    free, _ = solve(math.inf)
    keys = list(groups)
    if sol is None:  # some table has no option that fits: no plan exists
        return Bound(math.inf, math.inf, dense, math.inf, "memory", free[0] + dense)
    tau, mean, binding, chosen = sol
    per_table = []
    for k, members in groups.items():
        i = keys.index(k)
        o = chosen[i]
        ruled_txt = _ruled_text(ruled[k], o)
        for t in members:
            floor = o.uniform_s + o.shard_s
            per_table.append(TableBound(t.name, o.option, o.device_s, floor, ruled_txt))
    per_table.sort(key=lambda x: x.table)
    why = "mean" if binding is None else f"floor of {groups[keys[binding]][0].name}"
    return Bound(tau + dense, tau, dense, mean, why, free[0] + dense, tuple(per_table))


def _ruled_text(ruled: list[_Priced], chosen: _Priced) -> str:
    """What the memory cap ruled out for a table, briefly: DP, and the smallest row counts
    of each sharded cluster and column count."""
    parts = []
    if any(o.option.cluster is Cluster.DP for o in ruled):
        parts.append("dp")
    most: dict[tuple[str, int], int] = {}
    for o in ruled:
        if o.option.cluster is not Cluster.DP:
            key = (o.option.cluster.value, o.option.column_shards)
            most[key] = max(most.get(key, 0), o.hi)
    for (cl, c), hi in sorted(most.items()):
        parts.append(f"{cl} c={c} r<={hi}")
    return ", ".join(parts)


def plan_table_seconds(p: Problem, t: PlannerTable, o: Option, devices) -> float:
    """Device-seconds of table `t` as placed in a plan (`devices[k][j]`)."""
    g, local = p.hw.num_devices, p.hw.devices_per_node
    uniform = g * _seconds(p, requester_cost(p, t, o))
    if o.cluster is Cluster.DP:
        return uniform + g * _seconds(p, shard_cost(p, t, o))
    total = 0.0
    for col in devices:
        per_node = Counter(x // local for x in col)
        for dev in col:
            total += _seconds(p, shard_cost(p, t, o, per_node[dev // local]))
    return uniform + total


def gap(p: Problem, ev: Evaluation, b: Bound, top: int = 5) -> Gap:
    """Where `ev`'s predicted step exceeds the bound `b` (see `types.Gap`)."""
    g = p.hw.num_devices
    extra = []
    for tp in ev.plan.tables:
        o = Option(tp.cluster, tp.row_shards, tp.column_shards)
        ds = plan_table_seconds(p, p.tables[tp.name], o, tp.devices)
        extra.append((tp.name, (ds - b.table(tp.name).device_s) / g))
    extra.sort(key=lambda x: (-x[1], x[0]))
    mean = float(ev.device_time.mean())
    return Gap(
        step_s=ev.step_s,
        bound_s=b.step_s,
        imbalance_s=float(ev.device_time.max()) - mean,
        extra_work_s=mean - b.mean_s,
        memory_s=b.step_s - b.unconstrained_s,
        tables=tuple(x for x in extra[:top] if x[1] > 0),
    )


def attach(p: Problem, ev: Evaluation, b: Bound | None = None) -> Evaluation:
    """`ev` with its bound (computed if not given) and gap filled in."""
    ev.bound = lower_bound(p) if b is None else b
    if math.isfinite(ev.bound.step_s):
        ev.gap = gap(p, ev, ev.bound)
    return ev
