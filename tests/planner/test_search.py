"""The planner: hand-computed cost formulas, golden plans, properties, CLI for every preset."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embark_jax.cli.main import main
from embark_jax.core.plan import Cluster, Plan
from embark_jax.core.specs import Combiner
from embark_jax.planner import (
    BASELINES,
    PRESETS,
    ModelSpec,
    PlannerError,
    PlannerTable,
    baseline,
    load_preset,
    plan,
    preset_names,
)
from embark_jax.planner import cost as C
from embark_jax.planner.baselines import best_of_baselines

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
SGD, ADAGRAD = (0, 0), (1, 0)  # optimizer slot footprints (per element, per row)
HW1 = PRESETS["dgx-h100"]
HW2 = HW1.with_shape(2, 4)


def small_model():
    tables = (
        PlannerTable(name="big", vocab_size=1_000_000, dim=64, hotness=20),
        PlannerTable(name="onehot", vocab_size=50_000, dim=32, hotness=1),
        PlannerTable(name="tiny", vocab_size=10, dim=16, hotness=1),
        PlannerTable(name="seq", vocab_size=5_000, dim=32, hotness=4, combiner=Combiner.NONE),
        PlannerTable(name="mid", vocab_size=200_000, dim=128, hotness=8),
    )
    return ModelSpec(name="small", tables=tables, slot_footprint=SGD)


# --- hand-computed costs ----------------------------------------------------------------------


def test_expected_unique_uniform_matches_closed_form():
    v, n = 1000, 500
    want = v * (1 - (1 - 1 / v) ** n)
    assert C.expected_unique(n, v, 0.0) == pytest.approx(want, rel=1e-6)
    assert C.expected_unique(0, v, 1.1) == 0.0
    # skew means fewer distinct ids than uniform for the same draws
    assert C.expected_unique(n, v, 1.1) < want


def test_rb_shard_cost_by_hand():
    hw = HW1.with_shape(2, 4)  # G = 8, L = 4
    t = PlannerTable(name="t", vocab_size=1000, dim=8, hotness=4, unique_ratio=None, alpha=0.0)
    batch = 16
    c = C.rb_shard_cost(
        t,
        split=(2, 1),
        batch=batch,
        hw=hw,
        slots=SGD,
        row_shards_in_node=1,
        hierarchical=True,
    )
    n_ids = 16 * 4 / 2  # 32 ids per shard
    touched = C.expected_unique(64, 1000, 0.0) / 2
    compute = (n_ids * 8 * 4 + 16 * 8 * 4) + (16 * 8 * 4 + n_ids * 8 * 4) + touched * 2 * 8 * 4
    assert c.compute == pytest.approx(compute)
    # each of 8 sources sends a padded bucket: b H = 2 x 4 = 8 slots, all of them at r = 2
    cap = 8
    assert C.rb_bucket(t, 2, batch, hw) == cap
    ids = cap * 8  # row + bag, int32, per peer (the own slice stays on the device)
    vec = 2 * 2 * 8 * 4  # b = 2 partials of width 8 forward, gradients back, per peer
    # hierarchical: N = 2 peers' slots to each of 3 local peers; across nodes one slot per
    # node, carried by the 1 row shard in this node for all L = 4 local ranks
    assert c.intra == pytest.approx(ids * 3 + vec * 3 * 2)
    assert c.inter == pytest.approx(ids * 4 + vec * 1 * 4)
    # the shard's 500 rows, the receive buffers, and the staged update: min(8 x 8 ids, 500
    # rows) slots of a row index and a new row (SGD: no optimizer slots)
    assert c.memory == pytest.approx(500 * 8 * 4 + 8 * cap * (8 + 32) + 64 * (4 + 32))
    flat = C.rb_shard_cost(t, (2, 1), batch, hw, SGD, hierarchical=False)
    assert flat.intra == pytest.approx((ids + vec) * 3)
    assert flat.inter == pytest.approx((ids + vec) * 4)


def test_ub_and_dp_costs_by_hand():
    hw = HW1.with_shape(1, 8)
    t = PlannerTable(name="t", vocab_size=100, dim=4, hotness=2, unique_ratio=0.5, alpha=0.0)
    slots = ADAGRAD  # one float slot per element
    ub = C.ub_shard_cost(t, (1, 1), batch=64, hw=hw, slots=slots)
    # the padded bucket: min(b H, V) = 16 dedup slots per source, whatever the unique ratio
    cap = 16
    assert C.ub_bucket(t, 1, 64, hw) == cap
    m = 8 * cap
    touched = C.expected_unique(128, 100, 0.0)
    assert ub.compute == pytest.approx(2 * m * 4 * 4 + m * 4 * 4 + touched * (2 * 16 + 2 * 4 * 4))
    assert ub.intra == pytest.approx(7 * cap * (4 + 2 * 16)) and ub.inter == 0
    # rows and Adagrad slots, the receive buffers, and the staged update of min(m = 128,
    # V = 100) rows: a row index, the new row and its new slots
    assert ub.memory == pytest.approx(100 * (16 + 16) + m * (4 + 16) + 100 * (4 + 16 + 16))
    # a capacity from data (`derive_capacities`) is what makes the dedup pay
    small = C.ub_shard_cost(t, (1, 1), batch=64, hw=hw, slots=slots, cap=8)
    assert small.intra == pytest.approx(ub.intra / 2)
    dp = C.dp_cost(t, 64, hw, slots)
    # the runtime's AUTO rule (core.dp_exchange), in words: dense 2 V (d + 1) + 2 V d = 1800
    # >= sparse 2 G (3 b H + b d) = 1280: the all-gather of b H id slots (row, bag, scale)
    # and b pooled gradient rows per device
    assert not C.dp_dense_gradients(t, 64, hw)
    assert dp.intra == pytest.approx(7 * (8 * 2 * 12 + 8 * 4 * 4)) and dp.inter == 0
    # the replica, and the staged update of every device's id slots: min(G b H = 128, 100)
    assert dp.memory == pytest.approx(100 * (16 + 16) + 100 * (4 + 16 + 16))
    small_v = dataclasses.replace(t, vocab_size=10)  # dense 180 < 1280: the all-reduce
    assert C.dp_dense_gradients(small_v, 64, hw)
    assert C.dp_cost(small_v, 64, hw, slots).intra == pytest.approx(2 * 10 * (16 + 4) * 7 / 8)


def test_seconds_and_dense_time():
    hw = HW1
    s = C.seconds(C.Cost(compute=hw.memory_bw, intra=hw.intra_bw, inter=2 * hw.inter_bw), hw)
    assert s == pytest.approx((1.0, 3.0))
    assert C.dense_seconds(1e6, 0, 8 * 1000, hw) == pytest.approx(3 * 1e6 * 1000 / hw.dense_flops)


# --- search -----------------------------------------------------------------------------------


def test_cluster_choice_follows_the_traffic():
    ev = plan(small_model(), 4096, HW1, compare_baselines=False)
    by = {t.name: t for t in ev.plan.tables}
    assert by["tiny"].cluster is Cluster.DP
    assert by["seq"].cluster is Cluster.UB  # sequence output: never rb
    assert by["big"].cluster is Cluster.RB  # 20 pooled ids per sample
    # one-hot: with the runtime's default capacities UB moves its worst case (b ids per
    # source), so its dedup does not pay and it is priced like RB
    assert by["onehot"].cluster in (Cluster.RB, Cluster.UB)
    assert all(ev.reasons[n] for n in by)


def test_golden_small_plans():
    """The planner is deterministic: its plans for fixed inputs are pinned."""
    for name, hw in (("small_1x8", HW1), ("small_2x4", HW2)):
        got = plan(small_model(), 4096, hw).plan.to_dict()
        path = os.path.join(GOLDEN, f"plan_{name}.json")
        if os.environ.get("EMBARK_UPDATE_GOLDEN"):
            with open(path, "w") as fh:
                json.dump(got, fh, indent=1)
        with open(path) as fh:
            assert got == json.load(fh), f"{name}: plan changed (EMBARK_UPDATE_GOLDEN=1 to pin)"


def test_nothing_fits_raises_typed_error():
    huge = ModelSpec(
        name="huge",
        slot_footprint=SGD,
        tables=(PlannerTable(name="giant", vocab_size=10**12, dim=128, hotness=1),),
    )
    with pytest.raises(PlannerError, match=r"table 'giant' does not fit: needs .* GB short") as e:
        plan(huge, 4096, HW1)
    assert e.value.table == "giant" and e.value.need > e.value.available


@st.composite
def models(draw):
    n = draw(st.integers(1, 6))
    tables = tuple(
        PlannerTable(
            name=f"t{i}",
            vocab_size=draw(st.integers(1, 2_000_000)),
            dim=draw(st.sampled_from([8, 16, 64, 128])),
            hotness=float(draw(st.integers(1, 50))),
            combiner=draw(st.sampled_from([Combiner.SUM, Combiner.SUM, Combiner.NONE])),
        )
        for i in range(n)
    )
    return ModelSpec(name="p", tables=tables, slot_footprint=SGD)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(model=models(), nodes=st.sampled_from([1, 2]), batch_per_device=st.sampled_from([64, 512]))
def test_plan_properties(model, nodes, batch_per_device):
    hw = HW1.with_shape(nodes, 8 // nodes)
    batch = batch_per_device * 8
    # the search alone, without its fallback to the best baseline (with it, "never slower
    # than a baseline" would hold by construction)
    ev = plan(model, batch, hw, compare_baselines=False)
    # a valid plan: every row and column owned exactly once (Plan validates), round-trips
    assert Plan.from_json(ev.plan.to_json()) == ev.plan
    assert {t.name for t in ev.plan.tables} == {t.name for t in model.tables}
    for t in ev.plan.tables:
        assert model.table(t.name).dim % t.column_shards == 0
        assert t.cluster is not Cluster.RB or model.table(t.name).combiner is not Combiner.NONE
    assert ev.device_memory.max() <= 0.9 * hw.memory_bytes * (1 + 1e-9)
    # deterministic
    again = plan(model, batch, hw, compare_baselines=False)
    assert again.plan == ev.plan and again.step_s == ev.step_s
    # the search finds a plan never predicted slower than any baseline that fits
    for b in BASELINES:
        try:
            other = baseline(model, batch, hw, b)
        except PlannerError:
            continue
        assert ev.step_s <= other.step_s * (1 + 1e-9), b


def test_the_fallback_takes_the_fastest_baseline():
    model = small_model()
    every = {b: baseline(model, 4096, HW1, b, with_bound=False) for b in BASELINES}
    slowest = max(every, key=lambda b: every[b].step_s)
    fastest = min(every, key=lambda b: every[b].step_s)
    assert every[fastest].step_s < every[slowest].step_s
    got, winner = best_of_baselines(every[slowest], model, 4096, HW1, 0.9)
    assert winner == fastest and got.step_s == every[fastest].step_s
    got, winner = best_of_baselines(every[fastest], model, 4096, HW1, 0.9)
    assert winner is None and got is every[fastest]


# --- presets and CLI --------------------------------------------------------------------------


def test_presets_load_and_minis_keep_the_shape():
    assert {"dcnv2", "t180", "t200", "t510", "t7", "t180-mini"} <= set(preset_names())
    full, mini = load_preset("t200"), load_preset("t200-mini")
    assert len(full.tables) == len(mini.tables) == 200
    for a, b in zip(full.tables, mini.tables, strict=True):
        assert (a.dim, a.hotness) == (b.dim, b.hotness) and b.vocab_size <= a.vocab_size
    assert max(t.vocab_size for t in mini.tables) <= 20_000
    assert full.dense_flops_per_sample > 0 and full.dense_params > 0


@pytest.mark.parametrize("model", preset_names())
def test_plan_cli_runs_for_every_preset(model, tmp_path, capsys):
    # t7 (1.8 TB) needs several nodes; t510's staged updates do not fit one node's GPUs
    nodes = {"t7": 8, "t510": 2}.get(model, 1)
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    argv = ["plan", "--model", model, "--nodes", str(nodes), "--out", str(out)]
    if model.endswith("-mini"):
        argv += ["--batch-size", "4096", "--plot", str(png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "predicted step" in text and "clusters:" in text and "why" in text
    p = Plan.from_json(out.read_text())
    assert len(p.tables) == len(load_preset(model).tables)
    if model.endswith("-mini"):
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_cli_baseline_and_error(tmp_path, capsys):
    assert main(["plan", "--model", "dcnv2", "--baseline", "trw"]) == 0
    assert "plan 'trw'" in capsys.readouterr().out
    assert main(["plan", "--model", "t7", "--nodes", "1"]) == 2
    res = capsys.readouterr()
    assert "does not fit" in res.out + res.err


def test_simulate_cli_small(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--models", "dcnv2", "--nodes", "1", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["speedup"] >= 1.0 for r in rows)
    assert "speedup over TRW" in capsys.readouterr().out


def test_planned_mini_model_runs_on_8_devices():
    """A planner plan lowers and runs: dcnv2-mini on the 8 fake CPU devices."""
    import jax
    from flax import nnx

    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.sharding.collection import EmbeddingCollection
    from tests import collection_ref

    model = load_preset("dcnv2-mini")
    model = dataclasses.replace(
        model,
        tables=tuple(
            dataclasses.replace(t, vocab_size=min(t.vocab_size, 2000), dim=16) for t in model.tables
        ),
    )
    hw = HW1.with_shape(2, 4)
    ev = plan(model, 64, hw)
    cfg = model.embedding_config()
    coll = EmbeddingCollection(cfg, ev.plan, ev.plan.make_mesh(), rngs=nnx.Rngs(0))
    batch = SyntheticDataset(cfg, batch_size=64, seed=0).batch(0).sparse
    out = coll(coll.shard_batch(batch))
    want = collection_ref.forward(cfg, coll.full_tables(), batch)
    for k, v in want.items():
        np.testing.assert_allclose(np.asarray(out[k]), v, rtol=1e-5, atol=1e-5)
    assert len(jax.devices()) == 8 and math.isfinite(ev.step_s)
