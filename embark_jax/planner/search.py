"""The planner: cluster choice by cost, greedy 3D splitting and placement under a memory cap,
and the baselines it must never lose to (all priced by the same cost model).

Pipeline (deterministic: every candidate list is sorted, ties broken by name and device id):
  1. choose_clusters: per table, the cheapest of DP (if its replica fits a small memory
     budget), RB (pooled features only) and UB, each priced as one table-wise shard;
  2. place: tables hottest first; each column slice's row shards go to the least-loaded
     devices that have memory left (RB row shards inside one node when they fit, so that
     hierarchical RB can reduce them before they cross nodes);
  3. refine: up to `max_rounds` times, split the heaviest table on the bottleneck device by
     rows or by columns, whichever lowers the predicted step time most; stop when neither does;
  4. compare with the baselines (tw, rw, trw, dp) and return the best.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import numpy as np

from embark_jax.core.plan import Cluster, Plan, TablePlan
from embark_jax.core.specs import Combiner
from embark_jax.planner import cost as C
from embark_jax.planner.hardware import HardwareTopology
from embark_jax.planner.model import ModelSpec, PlannerTable

__all__ = ["BASELINES", "Choice", "Evaluation", "PlannerError", "baseline", "evaluate", "plan"]

DP_MEMORY_FRACTION = 0.05  # replicas of all DP tables together use at most this much memory
MIN_COLUMN_WIDTH = 16


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
class Choice:
    cluster: Cluster
    row_shards: int = 1
    column_shards: int = 1


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


# --- pricing ------------------------------------------------------------------------------


def _shard_cost(
    t: PlannerTable,
    ch: Choice,
    batch: int,
    hw: HardwareTopology,
    model: ModelSpec,
    in_node: int = 1,
) -> C.Cost:
    if ch.cluster is Cluster.DP:
        return C.dp_cost(t, batch, hw, model.optimizer)
    if ch.cluster is Cluster.UB:
        return C.ub_shard_cost(t, ch.row_shards, ch.column_shards, batch, hw, model.optimizer)
    return C.rb_shard_cost(
        t,
        ch.row_shards,
        ch.column_shards,
        batch,
        hw,
        model.optimizer,
        row_shards_in_node=in_node,
        hierarchical=hw.num_nodes > 1,
    )


def _requester(t, ch, batch, hw) -> C.Cost:
    return C.requester_cost(t, ch.cluster.value, ch.row_shards, batch, hw)


def _total_seconds(t, ch, batch, hw, model) -> float:
    """Device-seconds a table costs the whole machine with this choice."""
    c = _shard_cost(t, ch, batch, hw, model)
    per_shard = sum(C.seconds(c, hw))
    copies = hw.num_devices if ch.cluster is Cluster.DP else ch.row_shards * ch.column_shards
    return per_shard * copies + sum(C.seconds(_requester(t, ch, batch, hw), hw)) * hw.num_devices


def choose_clusters(
    model: ModelSpec, batch: int, hw: HardwareTopology
) -> tuple[dict[str, Choice], dict[str, str]]:
    choices, reasons = {}, {}
    dp_budget = DP_MEMORY_FRACTION * hw.memory_bytes
    for t in sorted(model.tables, key=lambda t: t.name):
        options = {}
        for cl in (Cluster.DP, Cluster.RB, Cluster.UB):
            if cl is Cluster.RB and t.combiner is Combiner.NONE:
                continue
            ch = Choice(cl)
            if cl is Cluster.DP and _shard_cost(t, ch, batch, hw, model).memory > dp_budget:
                continue
            options[cl] = _total_seconds(t, ch, batch, hw, model)
        best = min(sorted(options, key=lambda c: c.value), key=lambda c: options[c])
        if best is Cluster.DP:
            dp_budget -= _shard_cost(t, Choice(best), batch, hw, model).memory
        choices[t.name] = Choice(best)
        priced = ", ".join(
            f"{c.value} {options[c] * 1e6:.1f} us" for c in sorted(options, key=lambda c: c.value)
        )
        why = {
            Cluster.DP: "small replica, no routing",
            Cluster.RB: f"pooling {t.hotness:g} ids/sample at the owner compresses traffic",
            Cluster.UB: "few distinct ids per device (or sequence output): one vector per "
            "unique id is the least traffic",
        }[best]
        reasons[t.name] = f"{best.value}: {why} [{priced}]"
    return choices, reasons


# --- placement ----------------------------------------------------------------------------


def _place(
    model: ModelSpec,
    choices: dict[str, Choice],
    batch: int,
    hw: HardwareTopology,
    cap: float,
    name: str = "embark",
    reasons: dict | None = None,
    fixed: dict[str, list[list[int]]] | None = None,
) -> Evaluation:
    g, local = hw.num_devices, hw.devices_per_node
    comp, intra, inter, mem = (np.zeros(g) for _ in range(4))
    tables = {t.name: t for t in model.tables}
    placements: dict[str, list[list[int]]] = {}

    def add(dev, c: C.Cost):
        cs, _ = C.seconds(c, hw)
        comp[dev] += cs
        intra[dev] += c.intra / hw.intra_bw
        inter[dev] += c.inter / hw.inter_bw
        mem[dev] += c.memory

    load = lambda: comp + intra + inter  # noqa: E731
    for n in sorted(choices):  # every device's own samples: uniform work
        req = _requester(tables[n], choices[n], batch, hw)
        for dev in range(g):
            add(dev, req)
    dp = [n for n in sorted(choices) if choices[n].cluster is Cluster.DP]
    for n in dp:
        c = _shard_cost(tables[n], choices[n], batch, hw, model)
        for dev in range(g):
            add(dev, c)
        placements[n] = [list(range(g))]
    order = sorted(
        (n for n in choices if choices[n].cluster is not Cluster.DP),
        key=lambda n: (-_total_seconds(tables[n], choices[n], batch, hw, model), n),
    )
    for n in order:
        t, ch = tables[n], choices[n]
        base = _shard_cost(t, ch, batch, hw, model)
        used: set[int] = set()
        cols = []
        for k in range(ch.column_shards):
            if fixed is not None:
                devs = fixed[n][k]
            else:
                devs = _pick(load(), mem, base.memory, cap, ch, used, hw)
                if devs is None:
                    free = sorted((cap - mem[d] for d in range(g) if d not in used), reverse=True)
                    room = free[ch.row_shards - 1] if len(free) >= ch.row_shards else 0.0
                    raise PlannerError(
                        n,
                        base.memory,
                        max(room, 0.0),
                        f"as {ch.row_shards} row x {ch.column_shards} column "
                        "shards, one per device",
                    )
            used.update(devs)
            for dev in devs:
                in_node = sum(1 for x in devs if x // local == dev // local)
                add(dev, _shard_cost(t, ch, batch, hw, model, in_node))
            cols.append(devs)
        placements[n] = cols
    over = np.flatnonzero(mem > cap)
    if over.size and fixed is not None:
        d = int(over[0])
        worst = max(
            (n for n in placements if d in functools.reduce(operator.iadd, placements[n], [])),
            key=lambda n: _shard_cost(tables[n], choices[n], batch, hw, model).memory,
        )
        raise PlannerError(worst, mem[d], cap, f"device {d} would hold {mem[d] / 1e9:.2f} GB")
    plan = Plan(
        topology=hw.topology,
        batch_size=batch,
        tables=tuple(
            TablePlan(
                name=n,
                cluster=choices[n].cluster,
                row_shards=choices[n].row_shards,
                column_shards=choices[n].column_shards,
                devices=tuple(tuple(c) for c in placements[n]),
            )
            for n in [t.name for t in model.tables]
        ),
    )
    dense = C.dense_seconds(model.dense_flops_per_sample, model.dense_params, batch, hw)
    return Evaluation(
        plan, comp, intra + inter, intra, inter, mem, dense, name, dict(reasons or {})
    )


def _pick(load, mem, need, cap, ch: Choice, used: set[int], hw: HardwareTopology):
    """Devices for one column slice's row shards: least loaded with room, not already holding
    a shard of the table; RB shards inside one node when they fit there."""
    r, local = ch.row_shards, hw.devices_per_node
    ok = [d for d in range(hw.num_devices) if d not in used and mem[d] + need <= cap]
    if len(ok) < r:
        return None
    ok.sort(key=lambda d: (load[d], d))
    if ch.cluster is Cluster.RB and 1 < r <= local and hw.num_nodes > 1:
        best = None
        for node in range(hw.num_nodes):
            cand = [d for d in ok if d // local == node][:r]
            if len(cand) == r:
                score = (max(load[d] for d in cand), node)
                if best is None or score < best[0]:
                    best = (score, cand)
        if best is not None:
            return sorted(best[1])
    return sorted(ok[:r])


# --- search -------------------------------------------------------------------------------


def _fit_rows(model, choices, batch, hw, cap) -> dict[str, Choice]:
    """Splits rows of tables whose single shard exceeds a quarter of the memory cap."""
    out = dict(choices)
    for t in model.tables:
        ch = out[t.name]
        if ch.cluster is Cluster.DP:
            continue
        r = ch.row_shards
        while _shard_cost(
            t, Choice(ch.cluster, r, ch.column_shards), batch, hw, model
        ).memory > cap / 4 and r < min(hw.num_devices, t.vocab_size):
            r *= 2
        out[t.name] = Choice(ch.cluster, min(r, hw.num_devices), ch.column_shards)
    return out


def plan(
    model: ModelSpec,
    batch_size: int,
    hw: HardwareTopology,
    *,
    memory_fraction: float = 0.9,
    max_rounds: int = 20,
    compare_baselines: bool = True,
) -> Evaluation:
    """The EMBark plan for `model` on `hw`; never predicted slower than a baseline."""
    if batch_size % hw.num_devices:
        raise ValueError(f"batch size {batch_size} is not a multiple of {hw.num_devices} devices")
    cap = memory_fraction * hw.memory_bytes
    choices, reasons = choose_clusters(model, batch_size, hw)
    choices = _fit_rows(model, choices, batch_size, hw, cap)
    tables = {t.name: t for t in model.tables}
    while True:  # a table that finds no room gets more row shards, until it cannot
        try:
            best = _place(model, choices, batch_size, hw, cap, reasons=reasons)
            break
        except PlannerError as e:
            # split the failing table; if it cannot split further, the table with the
            # largest shards that still can (it frees the most memory everywhere)
            def can_split(n):
                ch = choices[n]
                return (
                    ch.cluster is not Cluster.DP
                    and tables[n].vocab_size > ch.row_shards
                    and ch.row_shards * 2 * ch.column_shards <= hw.num_devices
                )

            victim = (
                e.table
                if can_split(e.table)
                else max(
                    (n for n in sorted(choices) if can_split(n)),
                    default=None,
                    key=lambda n: _shard_cost(tables[n], choices[n], batch_size, hw, model).memory,
                )
            )
            if victim is None:
                raise
            ch = choices[victim]
            choices[victim] = Choice(ch.cluster, ch.row_shards * 2, ch.column_shards)
            reasons[victim] = reasons.get(victim, "") + (
                f"; rows split to {ch.row_shards * 2} to fit the memory cap"
            )
    for _ in range(max_rounds):
        dev = best.bottleneck
        on_dev = sorted(
            (
                tp
                for tp in best.plan.tables
                if tp.cluster is not Cluster.DP and any(dev in col for col in tp.devices)
            ),
            key=lambda tp: (
                -_total_seconds(tables[tp.name], choices[tp.name], batch_size, hw, model),
                tp.name,
            ),
        )[:3]
        trials = []
        for tp in on_dev:
            t, ch = tables[tp.name], choices[tp.name]
            cands = []
            if (
                ch.row_shards * 2 * ch.column_shards <= hw.num_devices
                and ch.row_shards * 2 <= t.vocab_size
            ):
                cands.append(("rows", Choice(ch.cluster, ch.row_shards * 2, ch.column_shards)))
            if (
                t.dim % (ch.column_shards * 2) == 0
                and t.dim // (ch.column_shards * 2) >= MIN_COLUMN_WIDTH
                and ch.row_shards * ch.column_shards * 2 <= hw.num_devices
            ):
                cands.append(("columns", Choice(ch.cluster, ch.row_shards, ch.column_shards * 2)))
            for how, new in cands:
                trial = dict(choices, **{tp.name: new})
                try:
                    ev = _place(model, trial, batch_size, hw, cap, reasons=best.reasons)
                except PlannerError:
                    continue
                trials.append((ev.step_s, tp.name, how, trial, ev))
        if not trials:
            break
        trials.sort(key=lambda x: (x[0], x[1], x[2]))
        step, name, how, trial, ev = trials[0]
        if step >= best.step_s * (1 - 1e-9):
            break
        ch = trial[name]
        ev.reasons[name] = (
            best.reasons.get(name, "") + f"; split {how} -> r={ch.row_shards} "
            f"c={ch.column_shards} (it was the heaviest shard on the bottleneck "
            f"device {dev}: step {best.step_s * 1e3:.3f} -> {step * 1e3:.3f} ms)"
        )
        choices, best = trial, ev
    if compare_baselines:
        for b in BASELINES:
            try:
                other = baseline(model, batch_size, hw, b, memory_fraction=memory_fraction)
            except PlannerError:
                continue
            if other.step_s < best.step_s:
                other.name = f"embark (= baseline {b})"
                other.reasons = {n: f"baseline {b} was predicted fastest" for n in tables}
                best = other
    return best


# --- baselines ----------------------------------------------------------------------------

BASELINES = ("tw", "rw", "trw", "dp")


def baseline(
    model: ModelSpec,
    batch_size: int,
    hw: HardwareTopology,
    kind: str,
    *,
    memory_fraction: float = 0.9,
) -> Evaluation:
    """Classic plans in the same format, priced by the same model: `tw` (table i on device
    i mod G), `rw` (every table row-split over all devices), `trw` (table i on node i mod N,
    row-split over that node's devices: the paper's baseline) and `dp` (all replicated)."""
    g, local, n_nodes = hw.num_devices, hw.devices_per_node, hw.num_nodes
    cap = memory_fraction * hw.memory_bytes
    choices, fixed = {}, {}
    for i, t in enumerate(model.tables):
        pooled = Cluster.UB if t.combiner is Combiner.NONE else Cluster.RB
        if kind == "tw":
            choices[t.name], fixed[t.name] = Choice(pooled), [[i % g]]
        elif kind == "rw":
            r = min(g, t.vocab_size)
            choices[t.name], fixed[t.name] = Choice(pooled, r), [list(range(r))]
        elif kind == "trw":
            r = min(local, t.vocab_size)
            node = i % n_nodes
            choices[t.name] = Choice(pooled, r)
            fixed[t.name] = [[node * local + j for j in range(r)]]
        elif kind == "dp":
            choices[t.name], fixed[t.name] = Choice(Cluster.DP), [list(range(g))]
        else:
            raise ValueError(f"unknown baseline {kind!r}; choose from {BASELINES}")
    reasons = {t.name: f"baseline {kind}" for t in model.tables}
    return _place(model, choices, batch_size, hw, cap, name=kind, reasons=reasons, fixed=fixed)


def evaluate(model: ModelSpec, plan_: Plan, hw: HardwareTopology) -> Evaluation:
    """Prices an existing plan (e.g. from a JSON file)."""
    choices = {t.name: Choice(t.cluster, t.row_shards, t.column_shards) for t in plan_.tables}
    fixed = {t.name: [list(c) for c in t.devices] for t in plan_.tables}
    return _place(model, choices, plan_.batch_size, hw, math.inf, name="given", fixed=fixed)
