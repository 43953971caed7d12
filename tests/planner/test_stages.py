"""The planner's stages one by one, on tiny models whose expected result is known by hand,
and the determinism of a whole planning run (in-process and across interpreters)."""

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from embark_jax.core.plan import Cluster, Plan
from embark_jax.core.specs import Combiner, EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.planner import (
    BASELINES,
    PRESETS,
    ModelSpec,
    PlannerError,
    PlannerTable,
    canonical_preset,
    load_preset,
    plan,
    preset_aliases,
    preset_names,
    report,
)
from embark_jax.planner import cost as C
from embark_jax.planner.baselines import baseline, best_of_baselines, evaluate
from embark_jax.planner.enumerators import can_split_rows, cluster_options, split_options
from embark_jax.planner.estimate import requester_cost, shard_cost, table_seconds
from embark_jax.planner.explain import explain
from embark_jax.planner.place import place
from embark_jax.planner.propose import choose_clusters, presplit_rows
from embark_jax.planner.refine import fit_memory, improve
from embark_jax.planner.types import (
    ClusterChoice,
    Option,
    Problem,
    Refinement,
    Retarget,
    RowSplit,
    Trace,
)

SGD = (0, 0)
H100 = PRESETS["dgx-h100"]
DP, RB, UB = Option(Cluster.DP), Option(Cluster.RB), Option(Cluster.UB)


def table(name, vocab=1000, dim=16, hotness=1.0, combiner=Combiner.SUM):
    return PlannerTable(name=name, vocab_size=vocab, dim=dim, hotness=hotness, combiner=combiner)


def model(*tables, slots=SGD):
    return ModelSpec(name="tiny", tables=tables, slot_footprint=slots)


def problem(m, batch=64, nodes=1, per_node=4, cap=math.inf, **hw):
    return Problem(m, batch, dataclasses.replace(H100.with_shape(nodes, per_node), **hw), cap)


# --- model: the optimizer as numbers ----------------------------------------------------------


def test_slot_footprint_replaces_the_optimizer():
    assert load_preset("dcnv2").slot_footprint == (1, 0)  # the paper's DCNv2: Adagrad
    assert load_preset("t180").slot_footprint == (0, 0)  # SGD
    with pytest.raises(TypeError, match="slot_footprint"):
        ModelSpec(name="x", tables=(), slot_footprint=object())
    # slots per element scale with the width, slots per row do not
    assert C.table_memory(10, 8, 4, (0, 1)) == 10 * (8 * 4 + 4)  # row-wise Adagrad
    assert C.table_memory(10, 8, 4, (2, 0)) == 10 * (8 * 4 + 2 * 8 * 4)  # Adam
    assert C.update_bytes(10, 8, 4, (0, 0)) == 10 * 2 * 8 * 4  # SGD: the rows only


def test_from_config_without_jax():
    cfg = EmbeddingConfig.create(
        [
            TableConfig(name="a", vocab_size=100, dim=8, dtype="bfloat16"),
            TableConfig(name="b", vocab_size=50, dim=4),
        ],
        [
            FeatureConfig(name="f1", table="a", max_hotness=3),
            FeatureConfig(name="f2", table="a", max_hotness=2),
            FeatureConfig(name="f3", table="b", combiner=Combiner.NONE),
        ],
    )
    spec = ModelSpec.from_config(cfg)
    assert spec.slot_footprint == (1, 0)  # Adagrad by default
    a, b = spec.table("a"), spec.table("b")
    assert (a.hotness, a.dtype_bytes, a.combiner) == (5.0, 2, Combiner.SUM)
    assert (b.hotness, b.dtype_bytes, b.combiner) == (1.0, 4, Combiner.NONE)
    assert ModelSpec.from_config(cfg, slot_footprint=(2, 0)).slot_footprint == (2, 0)


# --- enumerate ------------------------------------------------------------------------------


def test_cluster_options_sorted_and_no_rb_for_sequences():
    assert cluster_options(table("t")) == [DP, RB, UB]
    assert cluster_options(table("s", combiner=Combiner.NONE)) == [DP, UB]


def test_split_options_by_hand():
    t = table("t", vocab=100, dim=32)
    assert split_options(t, RB, 4) == [
        ("columns", Option(Cluster.RB, 1, 2)),
        ("rows", Option(Cluster.RB, 2, 1)),
    ]
    assert split_options(table("t", dim=16), RB, 4) == [("rows", Option(Cluster.RB, 2))]
    assert split_options(table("t", vocab=1, dim=32), UB, 4) == [("columns", UB.with_columns(2))]
    assert split_options(t, Option(Cluster.RB, 2, 2), 4) == []  # no device for a 5th shard
    assert can_split_rows(t, RB, 2) and not can_split_rows(t, Option(Cluster.RB, 2), 2)
    assert not can_split_rows(t, DP, 8) and not can_split_rows(table("t", vocab=1), RB, 8)


# --- estimate -------------------------------------------------------------------------------


def test_table_seconds_by_hand():
    t = table("t", dim=16, hotness=3)
    p = problem(model(t))
    hw, g, b = p.hw, 4, 64 / 4
    per_shard = sum(C.seconds(C.rb_shard_cost(t, (2, 1), 64, hw, SGD), hw))
    requester = 2 * b * 2 * 16 * 4 / hw.memory_bw  # RB: sum 2 partials per sample
    rb2 = Option(Cluster.RB, 2)
    assert requester_cost(p, t, rb2) == C.Cost(compute=2 * b * 2 * 16 * 4)
    assert table_seconds(p, t, rb2) == pytest.approx(2 * per_shard + g * requester)
    dp = sum(C.seconds(C.dp_cost(t, 64, hw, SGD), hw))
    assert table_seconds(p, t, DP) == pytest.approx(g * dp)  # a replica per device
    # on several nodes RB is priced hierarchically
    p2 = problem(model(t), nodes=2, per_node=2)
    want = C.rb_shard_cost(t, (2, 1), 64, p2.hw, SGD, row_shards_in_node=2, hierarchical=True)
    assert shard_cost(p2, t, rb2, in_node=2) == want


# --- propose --------------------------------------------------------------------------------


def test_choose_clusters_dp_budget_by_hand():
    """Three tiny tables; a DP replica takes 10 x 16 x 4 = 640 bytes and its staged update
    min(4 devices x 16 ids, 10 rows) x (4 + 64) = 680 bytes, and the DP budget is 5% of
    40 kB = 2000 bytes: only the first table by name ('a') is replicated."""
    m = model(table("b", vocab=10), table("a", vocab=10), table("s", 10, combiner=Combiner.NONE))
    p = problem(m, memory_bytes=40_000.0)
    assert shard_cost(p, m.table("a"), DP).memory == 640 + 680
    options, decisions = choose_clusters(p)
    assert [d.table for d in decisions] == ["a", "b", "s"]
    assert options["a"] == DP and options["b"].cluster is not Cluster.DP
    assert [o for o, _ in decisions[0].priced] == [DP, RB, UB]
    assert [o for o, _ in decisions[1].priced] == [RB, UB]  # no budget left for DP
    assert [o for o, _ in decisions[2].priced] == [UB]  # sequence output: never RB
    for d in decisions:
        assert d.option == min(d.priced, key=lambda x: x[1])[0]


def test_presplit_rows_by_hand():
    """One RB shard of a 1000 x 16 fp32 table holds ceil(1000 / r) rows of 64 bytes plus
    receive buffers of (8 + 64) bytes per slot: 4 sources x the padded bucket of 16 slots
    (16, 16, 13 for r = 1, 2, 4), and its staged update, (4 + 64) bytes for each of the
    64, 64, 52 received ids: 72960, 40960, 23280 bytes. With a cap of 96 kB (a quarter:
    24 kB) the table starts with 4 row shards."""
    t = table("t")
    p = problem(model(t, table("d", vocab=10)), cap=96_000.0)
    mem = [shard_cost(p, t, Option(Cluster.RB, r)).memory for r in (1, 2, 4)]
    assert mem == [72960, 40960, 23280]
    out = presplit_rows(p, {"t": RB, "d": DP})
    assert out == {"t": Option(Cluster.RB, 4), "d": DP}
    # never more row shards than devices
    assert presplit_rows(dataclasses.replace(p, cap=4.0), {"t": RB, "d": DP})["t"].row_shards == 4


# --- place ----------------------------------------------------------------------------------


def test_place_hottest_first_on_least_loaded_devices():
    """'x' (hotter, 2 row shards) goes first on devices 0 and 1 (all equally loaded: ties
    by id); 'y' then on the least loaded, device 2; the DP table everywhere."""
    m = model(table("y"), table("x", hotness=10), table("d", vocab=10))
    p = problem(m)
    ev = place(p, {"x": Option(Cluster.RB, 2), "y": RB, "d": DP})
    devices = {t.name: t.devices for t in ev.plan.tables}
    assert devices == {"x": ((0, 1),), "y": ((2,),), "d": ((0, 1, 2, 3),)}
    assert [t.name for t in ev.plan.tables] == ["y", "x", "d"]  # model order
    x_mem = shard_cost(p, m.table("x"), Option(Cluster.RB, 2)).memory
    d_mem = shard_cost(p, m.table("d"), DP).memory
    y_mem = shard_cost(p, m.table("y"), RB).memory
    assert ev.device_memory.tolist() == [x_mem + d_mem] * 2 + [d_mem + y_mem, d_mem]


def test_place_keeps_rb_row_shards_in_one_node():
    """2 nodes x 2 devices: 'a' (hotter) lands on device 0; 'b' (2 row shards) would take
    the least-loaded devices 1 and 2 across nodes, but stays in node 1 (devices 2, 3)."""
    m = model(table("a", hotness=50), table("b"))
    p = problem(m, nodes=2, per_node=2)
    b2 = Option(Cluster.RB, 2)
    assert table_seconds(p, m.table("a"), RB) > table_seconds(p, m.table("b"), b2)
    ev = place(p, {"a": RB, "b": b2})
    assert {t.name: t.devices for t in ev.plan.tables} == {"a": ((0,),), "b": ((2, 3),)}


def test_place_errors_name_the_table():
    t = table("t")
    need = 72960.0  # see test_presplit_rows_by_hand
    p = problem(model(t), cap=need - 1)
    with pytest.raises(PlannerError) as e:
        place(p, {"t": RB})
    assert (e.value.table, e.value.need, e.value.available) == ("t", need, need - 1)
    # a fixed placement over the cap names the largest shard on the first full device
    p = problem(model(t, table("u", vocab=10)), cap=need)
    with pytest.raises(PlannerError, match="device 0 would hold") as e:
        place(p, {"t": RB, "u": UB}, fixed={"t": [[0]], "u": [[0]]})
    assert e.value.table == "t"


# --- refine ---------------------------------------------------------------------------------


def test_fit_memory_splits_the_table_that_finds_no_room():
    """The table needs 68608 bytes in one shard, 34304 in two: with a 50 kB cap it fits
    once its rows are split in two."""
    p = problem(model(table("t")), cap=50_000.0)
    ev, options, splits = fit_memory(p, {"t": RB})
    assert options == {"t": Option(Cluster.RB, 2)} and splits == [RowSplit("t", 2)]
    assert ev.plan.tables[0].devices == ((0, 1),)
    with pytest.raises(PlannerError):  # one row cannot split
        fit_memory(problem(model(table("t", vocab=1)), cap=10.0), {"t": RB})


def test_improve_splits_the_bottleneck_until_no_device_is_left():
    """One hot table on 2 devices: the first split (rows or columns, whichever is faster)
    spreads it over both devices; then no split has a device left."""
    t = table("t", vocab=100_000, dim=64, hotness=20)
    p = problem(model(t), batch=1024, per_node=2)
    start = place(p, {"t": RB})
    same, options, steps = improve(p, {"t": RB}, start, max_rounds=0)
    assert same is start and options == {"t": RB} and steps == []
    ev, options, steps = improve(p, {"t": RB}, start, max_rounds=5)
    assert len(steps) == 1 and options["t"].shards == 2
    s = steps[0]
    assert (s.table, s.device, s.before_s, s.after_s) == ("t", 0, start.step_s, ev.step_s)
    by_hand = {how: place(p, {"t": o}).step_s for how, o in split_options(t, RB, 2)}
    assert s.how == min(by_hand, key=by_hand.get) and ev.step_s == min(by_hand.values())
    assert ev.step_s < start.step_s


# --- baselines ------------------------------------------------------------------------------


def test_baselines_by_hand():
    tables = [table(f"t{i}") for i in range(4)] + [table("s", vocab=1, combiner=Combiner.NONE)]
    m = model(*tables)
    hw = H100.with_shape(2, 2)

    def devices(kind):
        ev = baseline(m, 64, hw, kind)
        assert ev.name == kind and ev.reasons["t0"] == f"baseline {kind}"
        return [(t.cluster.value, t.devices) for t in ev.plan.tables]

    assert devices("tw") == [("rb", ((i,),)) for i in range(4)] + [("ub", ((0,),))]
    assert devices("trw") == [("rb", ((0, 1),)), ("rb", ((2, 3),))] * 2 + [("ub", ((0,),))]
    assert devices("rw") == [("rb", ((0, 1, 2, 3),))] * 4 + [("ub", ((0,),))]
    assert devices("dp") == [("dp", ((0, 1, 2, 3),))] * 5
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline(m, 64, hw, "nope")


def test_best_of_baselines_and_evaluate():
    m = model(table("a", hotness=10), table("b"))
    hw = H100.with_shape(1, 4)
    slow = place(problem(m), {"a": RB, "b": RB})
    slow.dense_s = 1.0  # slower than anything
    best, winner = best_of_baselines(slow, m, 64, hw, 0.9)
    steps = {k: baseline(m, 64, hw, k).step_s for k in BASELINES}
    assert winner == min(BASELINES, key=steps.get) and best.step_s == steps[winner]
    same, winner = best_of_baselines(best, m, 64, hw, 0.9)
    assert same is best and winner is None
    again = evaluate(m, Plan.from_json(best.plan.to_json()), hw)
    assert again.name == "given" and again.plan == best.plan and again.step_s == best.step_s


# --- explain --------------------------------------------------------------------------------


def test_explain_from_the_trace_by_hand():
    m = model(table("a", hotness=2.5), table("b"))
    trace = Trace(
        clusters=[
            ClusterChoice("a", RB, ((DP, 3e-6), (RB, 1.25e-6), (UB, 2e-6))),
            ClusterChoice("b", DP, ((DP, 1e-6),)),
        ],
        steps=[
            RowSplit("a", 2),
            Refinement("a", "columns", Option(Cluster.RB, 2, 2), 3, 2e-3, 1.5e-3),
        ],
    )
    assert explain(m, trace) == {
        "a": "rb: pooling 2.5 ids/sample at the owner compresses traffic "
        "[dp 3.0 us, rb 1.2 us, ub 2.0 us]; rows split to 2 to fit the memory cap; "
        "split columns -> r=2 c=2 (it was the heaviest shard on the bottleneck device 3: "
        "step 2.000 -> 1.500 ms)",
        "b": "dp: small replica, no routing [dp 1.0 us]",
    }
    # a bound-guided start's option that was not the cheapest alone says so, with its target
    trace.clusters[1] = ClusterChoice("b", DP, ((DP, 3e-6), (RB, 1e-6)))
    trace.steps = [Retarget("b", DP, 2e-3, 1e-3)]
    assert explain(m, trace)["b"] == (
        "dp: not the cheapest alone (rb), but it balances the devices [dp 3.0 us, rb 1.0 us]; "
        "r=1 c=1: its fewest device-seconds with shards under a target of 2.000 ms per device "
        "(2.00x the bound)"
    )
    trace.baseline = "trw"
    assert explain(m, trace) == {n: "baseline trw was predicted fastest" for n in ("a", "b")}


def test_report_summary_truncates():
    ev = plan(load_preset("dcnv2-mini"), 4096, H100.with_shape(2, 4))
    text = report.summary(ev, max_tables=3, max_devices=2)
    assert text.startswith(f"plan '{ev.name}': 26 tables on 2 node(s) x 4 devices")
    assert "6 less loaded devices not shown" in text and "23 more tables" in text


# --- the whole pipeline ---------------------------------------------------------------------


def test_planning_is_deterministic_in_process():
    m = load_preset("t200")
    hw = H100.with_shape(2, 8)
    a, b = plan(m, 65536, hw), plan(m, 65536, hw)
    assert a.plan.to_json() == b.plan.to_json() and a.reasons == b.reasons
    assert a.step_s == b.step_s and (a.device_time == b.device_time).all()


def test_planning_is_deterministic_across_interpreters(tmp_path):
    """Two fresh interpreters with different hash seeds write the same plan JSON."""
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"plan{seed}.json"
        argv = ["plan", "--model", "dcnv2", "--nodes", "2", "--out", str(out)]
        code = f"from embark_jax.cli.main import main; raise SystemExit(main({argv!r}))"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert res.returncode == 0, res.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


# --- model names: one vocabulary ------------------------------------------------------------


@pytest.mark.parametrize(
    "alias,name",
    [
        ("dcnv2", "dcnv2"),
        ("dlrm_dcnv2", "dcnv2"),
        ("dlrm-dcnv2", "dcnv2"),
        ("DLRM-DCNv2", "dcnv2"),
        ("DLRM_DCNV2-Mini", "dcnv2-mini"),
        ("dlrm-dcnv2-mini", "dcnv2-mini"),
        ("T180", "t180"),
        ("t510_mini", "t510-mini"),
        (" t7 ", "t7"),
    ],
)
def test_model_names_and_aliases(alias, name):
    assert canonical_preset(alias) == name
    spec = load_preset(alias)
    assert spec.name == name and spec == load_preset(name)


def test_preset_listing_and_unknown_names():
    names = preset_names()
    assert names == [
        "dcnv2", "dcnv2-mini", "t180", "t180-mini", "t200", "t200-mini",
        "t510", "t510-mini", "t7", "t7-mini",
    ]  # fmt: skip
    aliases = preset_aliases()
    assert aliases["dlrm_dcnv2"] == aliases["dlrm-dcnv2"] == "dcnv2"
    assert aliases["dlrm-dcnv2-mini"] == "dcnv2-mini"
    assert all(v in names for v in aliases.values())
    assert all(canonical_preset(a) == v for a, v in aliases.items())
    for bad in ("dcnv3", "t181", "mini", "dcnv2-mini-mini", ""):
        with pytest.raises(ValueError, match="unknown model") as e:
            load_preset(bad)
        assert "dcnv2, dcnv2-mini, t180" in str(e.value) and "dlrm-dcnv2" in str(e.value)
