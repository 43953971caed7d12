"""Stage `place`: every table's shards on devices under the memory cap, priced per device.

Every device first gets the requester work of every table (its own samples) and a replica
of every DP table. Sharded tables then go hottest first (by `estimate.table_seconds`, ties
by name); each column slice's row shards go to the least-loaded devices (ties by id) that
have memory left and hold no other shard of the table; RB row shards stay inside one node
when they fit there, so that hierarchical RB reduces them before they cross nodes. A
table that finds no room raises `PlannerError` (the `refine` stage splits it and retries).

With `fixed` placements (baselines, a given plan) the devices are not chosen, only priced;
a device over the cap then raises `PlannerError` naming its largest shard.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from embark_jax.core.plan import Cluster, Plan, TablePlan
from embark_jax.planner import cost as C
from embark_jax.planner.estimate import requester_cost, shard_cost, table_seconds
from embark_jax.planner.types import Cost, Evaluation, Option, PlannerError, Problem

__all__ = ["place"]

Placement = list[list[int]]  # devices of each column slice's row shards


class _Loads:
    """Per-device seconds (compute, intra-node, inter-node) and resident bytes."""

    def __init__(self, p: Problem):
        self.hw = p.hw
        g = p.hw.num_devices
        self.comp, self.intra, self.inter, self.mem = (np.zeros(g) for _ in range(4))

    def add(self, dev: int | slice | np.ndarray, c: Cost) -> None:
        self.comp[dev] += C.seconds(c, self.hw)[0]
        self.intra[dev] += c.intra / self.hw.intra_bw
        self.inter[dev] += c.inter / self.hw.inter_bw
        self.mem[dev] += c.memory

    @property
    def time(self) -> np.ndarray:
        return self.comp + self.intra + self.inter


def place(
    p: Problem,
    options: Mapping[str, Option],
    fixed: Mapping[str, Placement] | None = None,
    name: str = "embark",
) -> Evaluation:
    """Places (or, with `fixed`, only prices) every table's option; see the module doc."""
    loads = _Loads(p)
    placements: dict[str, Placement] = {}
    for n in sorted(options):  # every device's own samples: uniform work
        loads.add(slice(None), requester_cost(p, p.tables[n], options[n]))
    for n in sorted(options):
        if options[n].cluster is Cluster.DP:
            loads.add(slice(None), shard_cost(p, p.tables[n], options[n]))
            placements[n] = [list(range(p.hw.num_devices))]
    order = sorted(
        (n for n in options if options[n].cluster is not Cluster.DP),
        key=lambda n: (-table_seconds(p, p.tables[n], options[n]), n),
    )
    for n in order:
        placements[n] = _place_table(p, n, options[n], loads, None if fixed is None else fixed[n])
    if fixed is not None:
        _check_memory(p, options, placements, loads)
    return _evaluation(p, options, placements, loads, name)


def _place_table(
    p: Problem, n: str, o: Option, loads: _Loads, fixed: Placement | None
) -> Placement:
    t, local = p.tables[n], p.hw.devices_per_node
    need = shard_cost(p, t, o).memory
    used: set[int] = set()
    cols = []
    for k in range(o.column_shards):
        devs = fixed[k] if fixed is not None else _pick(p, o, loads, need, used)
        if devs is None:
            raise _no_room(p, n, o, loads, need, used)
        used.update(devs)
        per_node = Counter(x // local for x in devs)
        by_count: dict[int, list[int]] = {}  # shards priced alike: as many node-mates
        for dev in devs:
            by_count.setdefault(per_node[dev // local], []).append(dev)
        for in_node, group in sorted(by_count.items()):
            loads.add(np.asarray(group), shard_cost(p, t, o, in_node))
        cols.append(devs)
    return cols


def _pick(p: Problem, o: Option, loads: _Loads, need: float, used: set[int]) -> list[int] | None:
    """Devices for one column slice's row shards: least loaded with room, not already
    holding a shard of the table; RB shards inside one node when they fit there."""
    hw, r = p.hw, o.row_shards
    local = hw.devices_per_node
    ok = loads.mem + need <= p.cap
    if used:
        ok[list(used)] = False
    cand = np.flatnonzero(ok)
    if len(cand) < r:
        return None
    load = loads.time
    order = cand[np.argsort(load[cand], kind="stable")].tolist()  # ties: device id
    if o.cluster is Cluster.RB and 1 < r <= local and hw.num_nodes > 1:
        per_node: dict[int, list[int]] = {}
        for d in order:
            per_node.setdefault(d // local, []).append(d)
        best = None
        for node in sorted(per_node):
            devs = per_node[node][:r]
            if len(devs) == r:
                score = (max(load[d] for d in devs), node)
                if best is None or score < best[0]:
                    best = (score, devs)
        if best is not None:
            return sorted(best[1])
    return sorted(order[:r])


def _no_room(
    p: Problem, n: str, o: Option, loads: _Loads, need: float, used: set[int]
) -> PlannerError:
    """The error for a column slice that finds fewer devices with room than row shards:
    the room on the r-th freest device is what the table had."""
    free = sorted(
        (p.cap - loads.mem[d] for d in range(p.hw.num_devices) if d not in used), reverse=True
    )
    room = free[o.row_shards - 1] if len(free) >= o.row_shards else 0.0
    return PlannerError(
        n,
        need,
        max(room, 0.0),
        f"as {o.row_shards} row x {o.column_shards} column shards, one per device",
    )


def _check_memory(
    p: Problem,
    options: Mapping[str, Option],
    placements: Mapping[str, Placement],
    loads: _Loads,
) -> None:
    """Fixed placements: the first device over the cap fails, naming its largest shard."""
    over = np.flatnonzero(loads.mem > p.cap)
    if not over.size:
        return
    d = int(over[0])
    worst = max(
        (n for n in placements if any(d in col for col in placements[n])),
        key=lambda n: shard_cost(p, p.tables[n], options[n]).memory,
    )
    mem = loads.mem[d]
    raise PlannerError(worst, mem, p.cap, f"device {d} would hold {mem / 1e9:.2f} GB")


def _evaluation(
    p: Problem,
    options: Mapping[str, Option],
    placements: Mapping[str, Sequence[Sequence[int]]],
    loads: _Loads,
    name: str,
) -> Evaluation:
    plan = Plan(
        topology=p.hw.topology,
        batch_size=p.batch,
        tables=tuple(
            TablePlan(
                name=t.name,
                cluster=options[t.name].cluster,
                row_shards=options[t.name].row_shards,
                column_shards=options[t.name].column_shards,
                devices=tuple(tuple(c) for c in placements[t.name]),
                capacity_factor=options[t.name].capacity_factor,
                unique_capacity=options[t.name].unique_capacity,
            )
            for t in p.model.tables
        ),
    )
    dense = C.dense_seconds(p.model.dense_flops_per_sample, p.model.dense_params, p.batch, p.hw)
    comm = loads.intra + loads.inter
    return Evaluation(plan, loads.comp, comm, loads.intra, loads.inter, loads.mem, dense, name)
