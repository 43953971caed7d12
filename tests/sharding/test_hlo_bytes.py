"""The planner's communication prices against the compiled step: for every cluster kind (DP
with dense and sparse gradients, RB flat and hierarchical, UB, column and row splits) and
the `-mini` presets, on a 1x8 and a 2x4 mesh of fake CPU devices, the bytes each device
sends over intra- and inter-node links, predicted vs read from the HLO of the lookup and
the two-phase backward (`hlo_bytes.wire_bytes`), agree within 10% per link class.

Two predictions are checked: `traffic.plan_traffic` (the runtime's padded group buffers,
uniform over devices) everywhere, and the per-shard prices the search ranks options by
(`evaluate`, busiest device) wherever a plan has no group padding: one table, its row
shards filling whole nodes. And the HLO parser itself, on a hand-written module.
"""

import dataclasses

import pytest

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.ops.optimizers import SGD
from embark_jax.planner import evaluate, get_hardware, load_preset, plan
from embark_jax.planner.model import ModelSpec
from embark_jax.planner.traffic import plan_traffic
from embark_jax.sharding import hlo_bytes as comm
from embark_jax.sharding.hlo_bytes import wire_bytes
from tests.embedding_step import compile_embedding_step

B, D, H = 64, 16, 4  # global batch, dim, hotness: tiny, to compile fast
TOL = 0.10
MESHES = {
    "1x8": Topology(num_nodes=1, devices_per_node=8),
    "2x4": Topology(num_nodes=2, devices_per_node=4),
}


def compiled_step(config: EmbeddingConfig, plan_: Plan, options: RuntimeOptions) -> str:
    """HLO text of one lookup + backward/update (`tests.embedding_step`)."""
    return compile_embedding_step(config, plan_, options, SGD(learning_rate=0.1), B).as_text()


def measured(config, plan_, options=None) -> dict[str, float]:
    text = compiled_step(config, plan_, options or RuntimeOptions())
    topo = plan_.topology
    shape = (8,) if topo.num_nodes == 1 else (topo.num_nodes, topo.devices_per_node)
    return wire_bytes(text, shape, plan_.axis_names)


def assert_close(pred: dict[str, float], hlo: dict[str, float], what: str) -> None:
    for link in ("intra", "inter"):
        p, h = pred[link], hlo[link]
        assert abs(p - h) <= TOL * max(h, 1.0), (what, link, p, h)


def hardware(topo: Topology):
    return get_hardware("dgx-h100", topo.num_nodes, topo.devices_per_node)


def predicted(spec: ModelSpec, plan_: Plan, hierarchical: bool = True) -> dict[str, float]:
    intra, inter = plan_traffic(spec, plan_, hardware(plan_.topology), hierarchical)
    return {"intra": intra, "inter": inter}


def busiest(spec: ModelSpec, plan_: Plan) -> dict[str, float]:
    """The per-shard prices of the search: the busiest device's link bytes."""
    hw = hardware(plan_.topology)
    ev = evaluate(spec, plan_, hw)
    return {
        "intra": float((ev.device_intra * hw.intra_bw).max()),
        "inter": float((ev.device_inter * hw.inter_bw).max()),
    }


def test_wire_bytes_convention():
    """All-to-all: (n - 1) / n of the result leaves the device, split by where the peers
    are; all-reduce: a hierarchical ring."""
    hlo = (
        "  %a = f32[8,10]{1,0} all-to-all(%x), replica_groups={{0,1,2,3,4,5,6,7}}\n"
        "  %b = f32[4,10]{1,0} all-to-all(%y), replica_groups={{0,1,2,3},{4,5,6,7}}\n"
        "  %c = f32[2,10]{1,0} all-to-all(%z), replica_groups={{0,4},{1,5},{2,6},{3,7}}\n"
        "  %d = f32[10]{0} all-reduce(%w), replica_groups={{0,1,2,3,4,5,6,7}}\n"
    )
    got = wire_bytes(hlo, (2, 4), ("node", "local"))
    intra = 40 * 3 + 40 * 3 + 0 + 2 * 40 * 3 / 4
    inter = 40 * 4 + 0 + 40 * 1 + 2 * 40 / 4 / 2
    assert got == pytest.approx({"intra": intra, "inter": inter})
    flat = wire_bytes(hlo.splitlines()[0], (8,), ("device",))
    assert flat == pytest.approx({"intra": 320 * 7 / 8, "inter": 0.0})


# (name, cluster, vocab, row shards, column shards, devices of each column slice)
CASES = [
    ("dp-dense", "dp", 16, 1, 1, [range(8)]),  # a tiny table (core.dp_exchange): all-reduce
    ("dp-sparse", "dp", 4096, 1, 1, [range(8)]),  # all-gather of id slots and pooled grads
    ("rb-node", "rb", 4096, 4, 1, [range(4)]),  # 2x4: hierarchical, shards fill node 0
    ("rb-rows", "rb", 4096, 8, 1, [range(8)]),  # row-split over every device
    ("ub-node", "ub", 4096, 4, 1, [range(4)]),
    ("rb-cols", "rb", 4096, 2, 2, [range(2), range(2, 4)]),
    ("ub-cols", "ub", 4096, 2, 2, [range(2), range(2, 4)]),
]


def one_table(cluster, vocab, r, c, devices, topo):
    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=vocab, dim=D)],
        [FeatureConfig(name="f", table="t", max_hotness=H)],
    )
    tp = TablePlan(
        name="t",
        cluster=cluster,
        row_shards=r,
        column_shards=c,
        devices=tuple(tuple(d) for d in devices),
    )
    plan_ = Plan(topology=topo, batch_size=B, tables=(tp,))
    return config, plan_, ModelSpec.from_config(config, slot_footprint=(0, 0))


def _no_group_padding(topo: Topology, r: int, cluster: str) -> bool:
    """Per-shard prices equal the padded buffers: one table whose row shards fill nodes."""
    return topo.num_nodes == 1 or cluster != "rb" or r % topo.devices_per_node == 0


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_table(case, mesh):
    name, cluster, vocab, r, c, devices = case
    topo = MESHES[mesh]
    config, plan_, spec = one_table(cluster, vocab, r, c, devices, topo)
    hlo = measured(config, plan_)
    assert_close(predicted(spec, plan_), hlo, f"{name} {mesh} traffic")
    if _no_group_padding(topo, r, cluster):
        assert_close(busiest(spec, plan_), hlo, f"{name} {mesh} per-shard")


def test_rb_flat_on_two_nodes():
    """RB with the hierarchical return path off: flat all-to-alls over all 8 devices."""
    config, plan_, spec = one_table("rb", 4096, 4, 1, [range(4)], MESHES["2x4"])
    hlo = measured(config, plan_, RuntimeOptions(hierarchical=False))
    assert_close(predicted(spec, plan_, hierarchical=False), hlo, "rb flat 2x4")
    assert hlo["inter"] > 0


PRESETS = {"dcnv2-mini": 6, "t180-mini": 30, "t200-mini": 34}  # every k-th table


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_mini_presets(preset, mesh):
    """The planner's own plan for a slice of each -mini preset (vocabularies and hotness
    capped, tiny batch): many tables, several groups, every cluster the search picks."""
    full = load_preset(preset)
    tables = tuple(
        dataclasses.replace(t, vocab_size=min(t.vocab_size, 512), hotness=min(t.hotness, H))
        for t in full.tables[:: PRESETS[preset]]
    )
    spec = dataclasses.replace(full, tables=tables, slot_footprint=(0, 0))
    topo = MESHES[mesh]
    ev = plan(spec, B, hardware(topo))
    hlo = measured(spec.embedding_config(), ev.plan)
    assert_close(predicted(spec, ev.plan), hlo, f"{preset} {mesh}")


def test_parser_reads_sizes_dtypes_and_axes():
    hlo = (
        "  %a2a = (f32[1,20]{1,0}, f32[1,20]{1,0}) all-to-all(%x, %y), "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}\n"
        "  %ar = s32[7]{0} all-reduce(%z), replica_groups={{0,1,2,3,4,5,6,7}}\n"
        "  ROOT %ag = bf16[2,4]{1,0} all-gather-start(%w), replica_groups={{0,4},{1,5},{2,6},{3,7}}\n"
    )
    got = comm.collectives(hlo, (2, 4), ("node", "local"))
    assert [(c.kind, c.axis, c.bytes) for c in got] == [
        ("all-to-all", "local", 160),
        ("all-reduce", "all", 28),
        ("all-gather", "node", 16),
    ]
    links = comm.link_bytes(comm.collective_bytes(hlo, (2, 4), ("node", "local")), (2, 4))
    assert links == {"intra": 160 + 14.0, "inter": 16 + 14.0}
