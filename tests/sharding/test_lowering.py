"""`ShardLayout`: the id -> (row shard, local row) rule, its inverse, and lowering built on it."""

import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.core.layout import ShardLayout
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.sharding.lowering import lower
from tests.numpy_ref import BF16_ROUNDING

CASES = [(1, 1, 1), (10, 1, 1), (10, 3, 2), (11, 4, 1), (7, 8, 4), (100, 5, 2), (3, 7, 8)]


@pytest.mark.parametrize("vocab,r,c", CASES)
def test_rule_and_inverse_round_trip(vocab, r, c):
    layout = ShardLayout(vocab, 8, r, c)
    ids = np.random.default_rng(vocab * r + c).integers(0, vocab, size=200)
    j, row = layout.row_shard(ids), layout.local_row(ids)
    assert ((0 <= j) & (j < r)).all()
    assert (row < np.array([layout.shard_rows(int(x)) for x in j])).all()
    np.testing.assert_array_equal(layout.global_id(j, row), ids)
    # the same rule on JAX arrays and on Python ints
    np.testing.assert_array_equal(np.asarray(layout.row_shard(jnp.asarray(ids))), j)
    np.testing.assert_array_equal(np.asarray(layout.local_row(jnp.asarray(ids))), row)
    assert (layout.row_shard(int(ids[0])), layout.local_row(int(ids[0]))) == (j[0], row[0])


@pytest.mark.parametrize("vocab,r,c", CASES)
def test_shards_partition_the_ids_and_columns(vocab, r, c):
    layout = ShardLayout(vocab, 8, r, c)
    assert sum(layout.shard_rows(j) for j in range(r)) == vocab
    every = np.arange(vocab)
    seen = np.concatenate([every[layout.ids_of(j)] for j in range(r)])
    np.testing.assert_array_equal(np.sort(seen), every)
    for j in range(r):
        held = every[layout.ids_of(j)]
        assert held.size == layout.shard_rows(j)
        np.testing.assert_array_equal(layout.row_shard(held), j)
        np.testing.assert_array_equal(layout.local_row(held), np.arange(held.size))
    cols = np.concatenate([np.arange(8)[layout.columns(k)] for k in range(c)])
    np.testing.assert_array_equal(cols, np.arange(8))
    assert layout.width * c == 8


def test_invalid_layouts_and_shards_are_rejected():
    with pytest.raises(ValueError):
        ShardLayout(10, 8, 0, 1)
    with pytest.raises(ValueError):
        ShardLayout(10, 8, 1, 3)  # 3 does not divide 8
    layout = ShardLayout(10, 8, 2, 2)
    with pytest.raises(IndexError):
        layout.ids_of(2)
    with pytest.raises(IndexError):
        layout.shard_rows(-1)
    with pytest.raises(IndexError):
        layout.columns(2)


def _lowered():
    tables = [
        TableConfig(name="dp", vocab_size=9, dim=4),
        TableConfig(name="rw", vocab_size=23, dim=8),
        TableConfig(name="rc", vocab_size=17, dim=8),
        TableConfig(name="ub", vocab_size=5, dim=8, dtype="bfloat16"),
    ]
    features = [FeatureConfig(name=f"f_{t.name}", table=t.name) for t in tables]
    plan = Plan(
        topology=Topology(num_nodes=2, devices_per_node=4),
        batch_size=16,
        tables=(
            TablePlan(
                name="dp", cluster="dp", row_shards=1, column_shards=1, devices=((*range(8),),)
            ),
            TablePlan(name="rw", cluster="rb", row_shards=3, column_shards=1, devices=((0, 3, 6),)),
            TablePlan(
                name="rc", cluster="rb", row_shards=2, column_shards=2, devices=((1, 7), (2, 3))
            ),
            TablePlan(
                name="ub",
                cluster="ub",
                row_shards=4,
                column_shards=2,
                devices=((0, 1, 2, 3), (4, 5, 6, 7)),
            ),
        ),
    )
    return lower(plan, EmbeddingConfig.create(tables, features))


def test_lowered_layout_matches_the_plan():
    lowered = _lowered()
    assert lowered.layout("dp") == ShardLayout(9, 4)  # replicated: r = c = 1
    assert lowered.layout("rc") == ShardLayout(17, 8, 2, 2)
    for group in lowered.groups:
        for s in group.shards:
            layout = lowered.layout(s.table)
            assert s.rows == layout.shard_rows(lowered.row_shard(s))
            assert (s.col_start, s.width) == (layout.columns(s.k).start, layout.width)
    total = {t: 0 for t in ("rw", "rc", "ub")}
    for group in lowered.groups:
        for s in group.shards:
            if s.table in total and s.k == 0:
                total[s.table] += s.rows
    assert total == {"rw": 23, "rc": 17, "ub": 5}


def test_stack_unstack_round_trips_tables():
    lowered = _lowered()
    rng = np.random.default_rng(0)
    tables = {
        t.name: rng.normal(size=(t.vocab_size, t.dim)).astype(np.dtype(t.dtype))
        for t in lowered.config.tables
    }
    buffers = {g.name: lowered.stack(tables, g) for g in lowered.groups}
    for g in lowered.groups:
        assert buffers[g.name].shape == (lowered.num_devices, g.rows_per_device, g.width)
        for s in g.shards:  # a shard holds its layout's ids and columns, at its offset
            layout = lowered.layout(s.table)
            want = tables[s.table][lowered.shard_ids(s), layout.columns(s.k)]
            np.testing.assert_array_equal(
                buffers[g.name][s.device, s.row_offset : s.row_offset + s.rows], want
            )
    back = lowered.unstack(buffers)
    assert set(back) == set(tables)
    for name, value in tables.items():
        np.testing.assert_array_equal(back[name], value)
    summed = lowered.unstack(buffers, replicas="sum")  # dp replicas add up
    np.testing.assert_allclose(summed["dp"], 8 * tables["dp"], rtol=1e-6)
    np.testing.assert_array_equal(summed["rw"], tables["rw"])


def test_lookup_residuals_are_typed_per_cluster():
    """Each cluster's residuals are its NamedTuple, with a leading device axis out of
    `shard_map` (they are pytrees: `jax.tree.map` keeps the type)."""
    import jax

    from embark_jax.core.options import RuntimeOptions
    from embark_jax.data.sparse import SparseFeatures
    from embark_jax.sharding.clusters import DPResiduals, RBResiduals, UBResiduals
    from embark_jax.sharding.collection import GroupResiduals, lookup_fn

    lowered = _lowered()
    mesh = lowered.plan.make_mesh()
    sharding = lowered.sharding(mesh)
    key = jax.random.key(0)
    buffers = {g.name: lowered.init_buffer(g, key, sharding) for g in lowered.groups}
    rng = np.random.default_rng(0)
    batch = SparseFeatures.from_dense(
        {f"f_{t.name}": rng.integers(0, t.vocab_size, size=(16, 2)) for t in lowered.config.tables}
    )
    outputs, residuals, overflow = lookup_fn(
        lowered, mesh, RuntimeOptions(capacity_factor=8.0), buffers, jax.device_put(batch, sharding)
    )
    kinds = {"dp": DPResiduals, "rb": RBResiduals, "ub": UBResiduals}
    assert len(residuals) == len(lowered.groups)
    for g in lowered.groups:
        assert type(residuals[g.name]) is GroupResiduals
        assert residuals[g.name].marker.shape[0] == lowered.num_devices
        res = residuals[g.name].routing
        assert type(res) is kinds[g.cluster.value]
        assert all(x.shape[0] == lowered.num_devices for x in jax.tree.leaves(res))
        assert type(jax.tree.map(lambda x: x[0], res)) is kinds[g.cluster.value]
    assert int(np.asarray(overflow).sum()) == 0
    tables = lowered.unstack({k: np.asarray(v) for k, v in buffers.items()})
    for t in lowered.config.tables:  # sum of 2 ids per sample
        ids = np.asarray(batch.ids[f"f_{t.name}"])
        want = tables[t.name].astype(np.float32)[ids].sum(axis=1)
        got = outputs[f"f_{t.name}"]
        # the rows are exact in float32 and summed there; a bfloat16 output rounds once
        rtol = BF16_ROUNDING if got.dtype == jnp.bfloat16 else 1e-6
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=rtol, atol=1e-6)
