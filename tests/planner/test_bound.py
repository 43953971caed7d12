"""The planner's lower bound: sound against an exhaustive search over every legal
plan of small models, its relaxations' monotonicity checked, tight where the optimum is
known, and shown in every report; the search's own gains pinned (no baseline fallback)."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embark_jax.cli.plan import default_batch
from embark_jax.core.plan import Cluster
from embark_jax.core.specs import Combiner
from embark_jax.planner import (
    PRESETS,
    ModelSpec,
    PlannerError,
    PlannerTable,
    baseline,
    evaluate,
    get_hardware,
    load_preset,
    plan,
    report,
    step_bound,
)
from embark_jax.planner import cost as C
from embark_jax.planner.bound import _Priced, _sweep, lower_bound, row_ranges, table_options
from embark_jax.planner.enumerators import cluster_options
from embark_jax.planner.estimate import requester_cost, shard_cost, table_seconds
from embark_jax.planner.place import place
from embark_jax.planner.types import Option, Problem

SGD, ADAGRAD = (0, 0), (1, 0)
H100 = PRESETS["dgx-h100"]


def tbl(name, vocab=1000, dim=8, hotness=1.0, combiner=Combiner.SUM, **kw):
    return PlannerTable(
        name=name, vocab_size=vocab, dim=dim, hotness=hotness, combiner=combiner, **kw
    )


def problem(tables, nodes, per_node, batch=96, cap=math.inf, slots=SGD, **hw):
    m = ModelSpec(name="m", tables=tuple(tables), slot_footprint=slots, dense_flops_per_sample=1e5)
    return Problem(m, batch, dataclasses.replace(H100.with_shape(nodes, per_node), **hw), cap)


# --- exhaustive search over every legal plan --------------------------------------------------


def all_options(t: PlannerTable, g: int) -> list[Option]:
    """Every option a `Plan` accepts: DP, and RB (pooled only) / UB with any r <= V rows and
    any c dividing d, one shard per device."""
    out = []
    for base in cluster_options(t):
        if base.cluster is Cluster.DP:
            out.append(base)
            continue
        for c in (c for c in range(1, t.dim + 1) if t.dim % c == 0):
            for r in range(1, min(g // c, t.vocab_size) + 1):
                out.append(Option(base.cluster, r, c))
    return out


def placements(p: Problem, t: PlannerTable):
    """(option, devices[c][r], per-device seconds, per-device bytes) of every legal option
    and placement of `t`, priced with the planner's cost functions."""
    g, local = p.hw.num_devices, p.hw.devices_per_node
    for o in all_options(t, g):
        uniform = sum(C.seconds(requester_cost(p, t, o), p.hw))
        if o.cluster is Cluster.DP:
            rep = shard_cost(p, t, o)
            s = sum(C.seconds(rep, p.hw))
            yield o, [list(range(g))], np.full(g, s + uniform), np.full(g, rep.memory)
            continue
        for perm in itertools.permutations(range(g), o.shards):
            cols = [
                list(perm[k * o.row_shards : (k + 1) * o.row_shards])
                for k in range(o.column_shards)
            ]
            time, mem = np.full(g, uniform), np.zeros(g)
            for col in cols:
                for dev in col:
                    in_node = sum(1 for x in col if x // local == dev // local)
                    c = shard_cost(p, t, o, in_node)
                    time[dev] += sum(C.seconds(c, p.hw))
                    mem[dev] += c.memory
            yield o, cols, time, mem


def exhaustive(p: Problem):
    """The fastest legal plan under the memory cap: (step, options, devices)."""
    dense = C.dense_seconds(p.model.dense_flops_per_sample, p.model.dense_params, p.batch, p.hw)
    per_table = [list(placements(p, t)) for t in p.model.tables]
    best = (math.inf, None)
    # combine table by table, keeping every partial sum (small models only)
    partial = [((), np.zeros(p.hw.num_devices), np.zeros(p.hw.num_devices))]
    for choices in per_table:
        partial = [
            ((*picks, (o, cols)), time + t2, mem + m2)
            for picks, time, mem in partial
            for o, cols, t2, m2 in choices
            if (mem + m2).max() <= p.cap
        ]
    for picks, time, _ in partial:
        step = time.max() + dense
        if step < best[0]:
            best = (step, picks)
    return best


SMALL = [
    # (tables, nodes, devices per node, cap)
    ([tbl("a", 1000, 4, 8.0), tbl("b", 20, 2, 1.0)], 2, 2, math.inf),
    ([tbl("a", 50_000, 4, 20.0), tbl("s", 300, 4, 3.0, Combiner.NONE)], 1, 4, math.inf),
    ([tbl("a", 3, 2, 1.0), tbl("b", 5, 4, 2.0), tbl("c", 7, 2, 30.0)], 1, 3, math.inf),
    ([tbl("a", 10_000, 4, 40.0), tbl("b", 4, 2, 1.0), tbl("c", 900, 2, 5.0)], 2, 1, math.inf),
    # memory: the big table cannot take DP, nor fit in fewer than 2 row shards
    ([tbl("a", 100_000, 4, 6.0), tbl("b", 100, 2, 2.0)], 2, 2, 1.2e6),
]


@pytest.mark.parametrize("case", range(len(SMALL)))
def test_bound_never_beaten_by_exhaustive_search(case):
    tables, nodes, per_node, cap = SMALL[case]
    p = problem(tables, nodes, per_node, cap=cap)
    best, picks = exhaustive(p)
    b = lower_bound(p)
    assert math.isfinite(best)
    assert b.step_s <= best * (1 + 1e-9), (b, best, picks)
    # and not vacuous: on these models the best plan's embedding time is within 20% of it
    # (5% before buckets were priced padded: at these tiny batches, b H <= 40 slots, the
    # fair-share relaxation of long row ranges is what is left of the gap)
    assert best - b.dense_s <= 1.2 * b.embedding_s
    if cap == math.inf:  # the planner's own plan is never faster than the optimum
        ev = plan(p.model, p.batch, p.hw, memory_fraction=None)
        assert b.step_s <= best <= ev.step_s * (1 + 1e-9)
        assert ev.bound.step_s == pytest.approx(b.step_s)


def test_exhaustive_pricing_matches_place():
    """The exhaustive search prices plans like the planner does (`place` with fixed devices)."""
    tables, nodes, per_node, _ = SMALL[0]
    p = problem(tables, nodes, per_node)
    a, b = (list(placements(p, t)) for t in tables)
    for (oa, ca, ta, ma), (ob, cb, tb, mb) in itertools.islice(
        itertools.product(a[::7], b[::5]), 0, 60
    ):
        ev = place(p, {"a": oa, "b": ob}, fixed={"a": ca, "b": cb})
        np.testing.assert_allclose(ev.device_time, ta + tb, rtol=1e-12)
        np.testing.assert_allclose(ev.device_memory, ma + mb, rtol=1e-12)


@st.composite
def small_problems(draw):
    n = draw(st.integers(1, 2))
    tables = [
        tbl(
            f"t{i}",
            vocab=draw(st.sampled_from([1, 3, 40, 5_000, 200_000])),
            dim=draw(st.sampled_from([2, 4])),
            hotness=float(draw(st.sampled_from([1, 3, 20, 60]))),
            combiner=draw(st.sampled_from([Combiner.SUM, Combiner.NONE])),
        )
        for i in range(n)
    ]
    nodes, per_node = draw(st.sampled_from([(1, 2), (2, 1), (1, 4), (2, 2)]))
    batch = draw(st.sampled_from([64, 4096]))
    cap = draw(st.sampled_from([math.inf, 4e5, 4e6]))
    return problem(tables, nodes, per_node, batch=batch, cap=cap, slots=ADAGRAD)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(p=small_problems())
def test_bound_sound_on_random_small_models(p):
    best, _ = exhaustive(p)
    b = lower_bound(p)
    if not math.isfinite(best):  # nothing fits: the bound says so too, or is below anyway
        return
    assert b.step_s <= best * (1 + 1e-9)


def test_bound_exact_on_one_device():
    """On one device every plan puts everything there: the bound is the optimum."""
    tables = [tbl("a", 1000, 4, 8.0), tbl("b", 20, 2, 1.0), tbl("s", 50, 4, 2.0, Combiner.NONE)]
    p = problem(tables, 1, 1)
    best, _ = exhaustive(p)
    assert lower_bound(p).step_s == pytest.approx(best, rel=1e-12)


# --- the relaxations the bound relies on ------------------------------------------------------


@pytest.mark.parametrize("nodes,per_node", [(1, 8), (2, 4), (4, 8)])
def test_row_ranges_rely_on_monotone_costs(nodes, per_node):
    """Per cluster and column count, with more row shards: the table's device-seconds and
    uniform work never fall and its smallest shard never grows (so a range priced with
    its lowest row count's device-seconds and highest row count's shard is a lower bound)."""
    tables = [
        tbl("hot", 100_000, 64, 50.0),
        tbl("one", 3_000, 32, 1.0),
        tbl("seq", 20_000, 16, 4.0, Combiner.NONE),
        tbl("few", 5, 16, 2.0),
    ]
    p = problem(tables, nodes, per_node, batch=4096, slots=ADAGRAD)
    g, local = p.hw.num_devices, p.hw.devices_per_node
    for t in tables:
        for base in cluster_options(t):
            if base.cluster is Cluster.DP:
                continue
            for c in (1, 2, 4):
                rows = range(1, min(g // c, t.vocab_size) + 1)
                opts = [Option(base.cluster, r, c) for r in rows]
                ds = [table_seconds(p, t, o, best_in_node=True, ideal=True) for o in opts]
                uni = [sum(C.seconds(requester_cost(p, t, o), p.hw)) for o in opts]
                sh = [
                    sum(C.seconds(shard_cost(p, t, o, min(o.row_shards, local), True), p.hw))
                    for o in opts
                ]
                mem = [shard_cost(p, t, o, min(o.row_shards, local), True).memory for o in opts]
                for seq, sign in ((ds, 1), (uni, 1), (sh, -1), (mem, -1)):
                    diffs = sign * np.diff(seq)
                    assert (diffs >= -1e-12 * max(seq)).all(), (t.name, base, c, seq)
    assert row_ranges(1) == [(1, 1)]
    assert row_ranges(12) == [(1, 1), (2, 3), (4, 7), (8, 12)]


def test_table_options_cover_every_legal_option():
    t = tbl("a", 10, 8, 3.0)
    p = problem([t], 1, 8)
    got = {(o.option, o.hi) for o in table_options(p, t)}
    ranges = {o.option.cluster: set() for o in table_options(p, t)}
    for o, hi in got:
        ranges[o.cluster].update((r, o.column_shards) for r in range(o.row_shards, hi + 1))
    legal = {(o.row_shards, o.column_shards) for o in all_options(t, 8) if o.cluster is Cluster.RB}
    assert ranges[Cluster.RB] == legal and ranges[Cluster.UB] == legal


def test_memory_rules_out_options_and_raises_the_bound():
    big = tbl("big", 200_000, 16, 4.0)
    free = problem([big, tbl("x", 10, 16)], 1, 4)
    tight = dataclasses.replace(free, cap=free.hw.memory_bytes * 1e-4)
    b0, b1 = lower_bound(free), lower_bound(tight)
    assert b1.step_s >= b0.step_s and b1.unconstrained_s == pytest.approx(b0.step_s)
    assert "dp" in b1.table("big").ruled_out and b0.table("big").ruled_out == ""
    none = dataclasses.replace(free, cap=10.0)  # nothing fits anywhere
    assert lower_bound(none).step_s == math.inf and lower_bound(none).binding == "memory"


def test_sweep_by_hand():
    """Kind A: one shard of 8 s (8 device-s) or, split, shards of 5 s (10 device-s); kind B:
    2 device-s in one shard of 2 s; 4 devices. The plain relaxation says (8 + 2) / 4 = 2.5 s,
    but whoever holds A's shard carries at least 5 s: the bound is 5 s, set by A's floor."""
    a = [
        _Priced(Option(Cluster.RB), 1, 8.0, 0.0, 8.0, 0.0),
        _Priced(Option(Cluster.RB, 2), 2, 10.0, 0.0, 5.0, 0.0),
    ]
    b = [_Priced(Option(Cluster.UB), 1, 2.0, 0.0, 2.0, 0.0)]
    tau, mean, binding, chosen = _sweep([(1, a), (1, b)], 0.0, 4)
    assert (tau, mean, binding) == (5.0, 3.0, 0) and chosen == [a[1], b[0]]
    # with 8 copies of B the mean binds: (10 + 16) / 4 = 6.5 > 5 (A's one-shard option
    # would need 8 > 6.5)
    tau, mean, binding, chosen = _sweep([(1, a), (8, b)], 0.0, 4)
    assert (tau, mean, binding) == (6.5, 6.5, None) and chosen == [a[1], b[0]]
    # uniform work of the other tables counts in every floor
    tau, *_ = _sweep([(1, a), (1, [dataclasses.replace(b[0], uniform_s=1.0, shard_s=0.0)])], 1.0, 4)
    assert tau == 6.0


# --- reports ----------------------------------------------------------------------------------


def test_every_plan_reports_its_bound_and_gap():
    m = load_preset("dcnv2-mini")
    hw = H100.with_shape(2, 4)
    ev = plan(m, 4096, hw)
    assert ev.bound is not None and ev.gap is not None
    assert step_bound(m, 4096, hw) == ev.bound  # the same bound, public
    assert ev.bound.step_s <= ev.step_s and ev.bound_ratio == pytest.approx(
        ev.step_s / ev.bound.step_s
    )
    g = ev.gap
    emb = float(ev.device_time.max())
    assert g.imbalance_s == pytest.approx(emb - ev.device_time.mean())
    assert g.extra_work_s + ev.bound.mean_s == pytest.approx(ev.device_time.mean())
    text = report.summary(ev)
    assert "lower bound" in text and f"{ev.bound_ratio:.2f}x" in text
    assert "imbalance" in text and "memory" in text
    for kind in ("trw", "dp"):
        other = baseline(m, 4096, hw, kind)
        assert other.bound is not None and other.step_s >= other.bound.step_s * (1 - 1e-12)
        assert "lower bound" in report.summary(other)
    given = evaluate(m, ev.plan, hw)
    assert given.bound is not None and given.step_s >= given.bound.step_s
    # a plan far from its bound says what keeps it there
    tw = baseline(m, 4096, hw, "tw")
    assert tw.bound_ratio > 1.2 and "above 1.2x: mostly imbalance" in report.summary(tw)
    assert "above 1.2x" not in text


# --- the search closes the gap on the paper's setups -----------------------------------------

# T510 on one node does not fit: its float32 tables fill 57 GB of each GPU's 72 GB cap, and
# the staged in-place update of its hot shards needs more (test_t510_on_one_node_does_not_fit)
PAPER = [
    (m, n) for m in ("dcnv2", "t180", "t200", "t510") for n in (1, 8, 16) if (m, n) != ("t510", 1)
]


@pytest.mark.slow
def test_paper_setups_within_1_2x_of_the_bound():
    ratios = []
    for name, nodes in PAPER:
        model = load_preset(name)
        hw = get_hardware("dgx-h100", nodes, 8)
        ev = plan(model, default_batch(model, nodes, 8), hw)
        ratios.append(ev.bound_ratio)
        assert ev.bound_ratio <= 1.2, (name, nodes, ev.bound_ratio)
    assert sum(ratios) / len(ratios) <= 1.1


def test_t510_on_one_node_does_not_fit():
    """The staged update's rows count against the cap: the planner refuses the plan (naming
    the table and the shortfall) instead of a step that runs out of memory."""
    model = load_preset("t510")
    with pytest.raises(PlannerError, match=r"does not fit: needs .* GB on a device"):
        plan(model, default_batch(model, 1, 8), get_hardware("dgx-h100", 1, 8))


# --- the search on its own -------------------------------------------------------------------

# predicted speedup of the search's own plan (no baseline fallback) over each baseline that
# fits, from the cost model: pinned so that a search that got worse fails (re-pinned when
# the model priced padded buckets and link bytes without the own slice: 2-9% lower; and when
# DP tables exchanged pooled gradients instead of per-id ones: up to 14% higher; T180 moved
# from one node to eight when the staged update counted against the cap and no baseline of
# T180 fit on one node any more)
SEARCH_WINS = {
    ("dcnv2", 1): {"tw": 1.6805, "rw": 2.1823, "trw": 2.1823},
    ("dcnv2", 8): {"tw": 4.9310, "rw": 8.5459, "trw": 1.7935},
    ("dcnv2", 16): {"tw": 6.9394, "rw": 12.1130, "trw": 1.9595},
    ("t180", 8): {"tw": 1.4567, "rw": 6.2087, "trw": 1.4496},
}


@pytest.mark.parametrize("setup", sorted(SEARCH_WINS))
def test_search_alone_beats_the_baselines_by_pinned_margins(setup):
    name, nodes = setup
    model = load_preset(name)
    hw = get_hardware("dgx-h100", nodes, 8)
    batch = default_batch(model, nodes, 8)
    ev = plan(model, batch, hw, compare_baselines=False)
    assert ev.name == "embark"  # the search's own plan, never a baseline's
    for kind, want in SEARCH_WINS[setup].items():
        got = baseline(model, batch, hw, kind, with_bound=False).step_s / ev.step_s
        assert got == pytest.approx(want, rel=2e-3), kind
        assert got > 1.0
    # with the comparison on, the same plan stands
    assert plan(model, batch, hw).plan == ev.plan


def test_targeted_start_only_helps():
    """The bound-guided start never makes a plan slower than the greedy start alone."""
    for name, nodes in (("dcnv2-mini", 2), ("t200-mini", 1)):
        model = load_preset(name)
        hw = H100.with_shape(nodes, 8 // nodes if nodes <= 8 else 1)
        a = plan(model, 4096, hw, compare_baselines=False, targeted=False)
        b = plan(model, 4096, hw, compare_baselines=False)
        assert b.step_s <= a.step_s * (1 + 1e-12)
        assert b.bound.step_s <= b.step_s
