"""The planner's per-device memory against the compiled step: `plan_memory` (the runtime's
stacked buffers, staged updates and exchange buffers) within 10% of `memory_analysis()`
(arguments + outputs - aliases + temporaries) of the embedding step compiled on 8 fake CPU
devices, for slices of every `-mini` preset under the planner's plan and forced DP, RB
(flat and hierarchical) and UB plans; its state term equal to the lowered buffers; and the
search's per-shard prices built from the same terms. (A sweep of all 25 preset x {plan, dp,
rw, tw, ub} pairs: 24 within 10%, t200-mini all-UB at 0.89; docs/design.md section 5.)"""

import dataclasses

import jax.numpy as jnp
import pytest

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Cluster, Plan, TablePlan, Topology
from embark_jax.ops.optimizers import Adagrad
from embark_jax.planner import baseline, evaluate, get_hardware, load_preset, plan
from embark_jax.planner import cost as C
from embark_jax.planner.memory import plan_memory
from embark_jax.planner.model import ModelSpec
from embark_jax.sharding.lowering import lower
from tests.embedding_step import compile_embedding_step

TOL = 0.10
B = 512  # global batch
OPT = Adagrad(learning_rate=0.1)  # a slot per element: the staged rows carry as much again


def spec_of(preset: str, every: int, vocab: int = 20_000, hotness: int = 20) -> ModelSpec:
    """Every `every`-th table of `preset`, vocabulary and hotness capped (fast to compile)."""
    full = load_preset(preset)
    tables = tuple(
        dataclasses.replace(t, vocab_size=min(t.vocab_size, vocab), hotness=min(t.hotness, hotness))
        for t in full.tables[::every]
    )
    return dataclasses.replace(full, tables=tables, slot_footprint=OPT.slot_footprint)


def plan_of(spec: ModelSpec, kind: str, hw) -> Plan:
    """The planner's plan, a baseline, or `ub`: every table row-split over all devices, UB."""
    if kind == "plan":
        return plan(spec, B, hw).plan
    if kind == "ub":
        rw = baseline(spec, B, hw, "rw").plan
        ub = tuple(dataclasses.replace(t, cluster=Cluster.UB) for t in rw.tables)
        return dataclasses.replace(rw, tables=ub)
    return baseline(spec, B, hw, kind).plan


def compiled_peak(spec: ModelSpec, plan_: Plan) -> int:
    """Peak bytes per device of the donated lookup + backward + in-place update, compiled."""
    config = spec.embedding_config()
    compiled = compile_embedding_step(config, plan_, RuntimeOptions(), OPT, B, donate=True)
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


# (preset, every k-th table, plan kind, nodes): every cluster kind, every -mini preset
CASES = [
    ("dcnv2-mini", 2, "plan", 1),
    ("dcnv2-mini", 2, "dp", 1),
    ("t7-mini", 1, "rw", 1),
    ("t7-mini", 1, "ub", 1),
    ("t180-mini", 12, "ub", 1),
    ("t200-mini", 20, "tw", 1),
    ("t510-mini", 40, "plan", 1),
    ("t180-mini", 12, "trw", 2),  # hierarchical RB on a 2 x 4 mesh
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_plan_memory_matches_the_compiled_step(case):
    preset, every, kind, nodes = case
    spec = spec_of(preset, every)
    hw = get_hardware("dgx-h100", nodes, 8 // nodes)
    plan_ = plan_of(spec, kind, hw)
    predicted = plan_memory(spec, plan_, hw).total
    peak = compiled_peak(spec, plan_)
    assert abs(predicted - peak) <= TOL * peak, (case, predicted / 1e6, peak / 1e6)


def test_state_is_the_lowered_buffers():
    """The state term is exactly the stacked buffers lowering allocates (rows_per_device,
    the most any device holds) with their optimizer slots."""
    spec = spec_of("t180-mini", 6)
    hw = get_hardware("dgx-h100", 1, 8)
    for kind in ("plan", "tw", "dp"):
        plan_ = plan_of(spec, kind, hw)
        lowered = lower(plan_, spec.embedding_config())
        want = sum(
            g.rows_per_device
            * (
                g.width * jnp.dtype(g.dtype).itemsize
                + 4 * C.slot_floats_per_row(OPT.slot_footprint, g.width)
            )
            for g in lowered.groups
        )
        assert plan_memory(spec, plan_, hw).state == want, kind


def test_search_prices_the_staged_update_per_shard():
    """One table row-split over every device (no group padding): the busiest device's
    per-shard memory holds its shard, its staged update (min(ids, rows) rows) and its
    receive buffers, and covers the step model's state and staged terms."""
    spec = spec_of("dcnv2-mini", 26, vocab=4096, hotness=8)
    t = spec.tables[0]
    tp = TablePlan(
        name=t.name, cluster="rb", row_shards=8, column_shards=1, devices=(tuple(range(8)),)
    )
    plan_ = Plan(topology=Topology(num_nodes=1, devices_per_node=8), batch_size=B, tables=(tp,))
    hw = get_hardware("dgx-h100", 1, 8)
    per_shard = float(evaluate(spec, plan_, hw).device_memory.max())
    m = plan_memory(spec, plan_, hw)
    rows = -(-t.vocab_size // 8)
    cap = C.rb_bucket(t, 8, B, hw)
    staged = C.staged_memory(8 * cap, rows, t.dim, 4, spec.slot_footprint)
    assert staged == m.staged > 0
    assert per_shard == pytest.approx(
        C.table_memory(rows, t.dim, 4, spec.slot_footprint) + 8 * cap * (8 + 4 * t.dim) + staged
    )
    assert per_shard >= m.state + m.staged


def test_a_plan_for_other_devices_or_tables_is_refused():
    spec = spec_of("t7-mini", 1)
    hw = get_hardware("dgx-h100", 1, 8)
    plan_ = plan_of(spec, "rw", hw)
    for other in (get_hardware("dgx-h100", 2, 8), get_hardware("dgx-h100", 1, 4)):
        with pytest.raises(ValueError, match="the plan is for 1x8 devices"):
            plan_memory(spec, plan_, other)
        with pytest.raises(ValueError, match="the plan is for 1x8 devices"):
            evaluate(spec, plan_, other)
    with pytest.raises(ValueError, match=r"tables not in the model .*; tables without a placement"):
        plan_memory(spec_of("t180-mini", 12), plan_, hw)
