"""Distributed clusters on 8 fake CPU devices against the single-device reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, PlanError, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.ops import optimizers as O
from embark_jax.ops import reference
from embark_jax.sharding.collection import CapacityOverflowError, EmbeddingCollection, lookup_fn
from tests import collection_ref

G = 8
B = 16

TABLES = [
    TableConfig(name="dp", vocab_size=20, dim=8),
    TableConfig(name="tw", vocab_size=50, dim=8),
    TableConfig(name="rw", vocab_size=64, dim=8),
    TableConfig(name="cw", vocab_size=30, dim=16),
    TableConfig(name="rc", vocab_size=40, dim=16),
    TableConfig(name="ub", vocab_size=60, dim=8),
    TableConfig(name="ubc", vocab_size=45, dim=16),
]
FEATURES = [
    FeatureConfig(name="f_dp", table="dp", max_hotness=3, combiner="mean"),
    FeatureConfig(name="f_dp_seq", table="dp", max_hotness=2, combiner="none"),
    FeatureConfig(name="f_tw", table="tw", max_hotness=4, combiner="sum", weighted=True),
    FeatureConfig(name="f_rw", table="rw", max_hotness=8, combiner="sqrtn"),
    FeatureConfig(name="f_rw2", table="rw", max_hotness=2, combiner="sum"),
    FeatureConfig(name="f_cw", table="cw", max_hotness=3, combiner="mean", weighted=True),
    FeatureConfig(name="f_rc", table="rc", max_hotness=5, combiner="sum"),
    FeatureConfig(name="f_ub", table="ub", max_hotness=4, combiner="sum"),
    FeatureConfig(name="f_ub_seq", table="ub", max_hotness=3, combiner="none"),
    FeatureConfig(name="f_ubc", table="ubc", max_hotness=2, combiner="mean"),
]
CONFIG = EmbeddingConfig.create(TABLES, FEATURES)


def mixed_plan(num_nodes=1):
    topo = Topology(num_nodes=num_nodes, devices_per_node=G // num_nodes)
    return Plan(
        topology=topo,
        batch_size=B,
        tables=(
            TablePlan(
                name="dp", cluster="dp", row_shards=1, column_shards=1, devices=(tuple(range(G)),)
            ),
            TablePlan(name="tw", cluster="rb", row_shards=1, column_shards=1, devices=((3,),)),
            TablePlan(
                name="rw", cluster="rb", row_shards=4, column_shards=1, devices=((0, 2, 4, 6),)
            ),
            TablePlan(name="cw", cluster="rb", row_shards=1, column_shards=2, devices=((1,), (5,))),
            TablePlan(
                name="rc", cluster="rb", row_shards=2, column_shards=2, devices=((0, 1), (4, 5))
            ),
            TablePlan(name="ub", cluster="ub", row_shards=2, column_shards=1, devices=((5, 7),)),
            TablePlan(
                name="ubc", cluster="ub", row_shards=2, column_shards=2, devices=((4, 6), (1, 3))
            ),
        ),
    )


def make_batch(seed=0, zipf=True):
    rng = np.random.default_rng(seed)
    ids, weights = {}, {}
    vocab = {t.name: t.vocab_size for t in TABLES}
    for f in FEATURES:
        v = vocab[f.table]
        if zipf:
            x = np.minimum((rng.zipf(1.3, size=(B, f.max_hotness)) - 1) * 7 % v, v - 1)
        else:
            x = rng.integers(0, v, size=(B, f.max_hotness))
        x[rng.random(x.shape) < 0.25] = -1
        x[1] = -1  # an empty bag
        ids[f.name] = x
        if f.weighted:
            weights[f.name] = rng.uniform(0.2, 2.0, size=x.shape)
    return SparseFeatures.from_dense(ids, weights, config=EmbeddingConfig.create(TABLES, FEATURES))


@pytest.fixture(scope="module", params=[1, 2], ids=["1x8", "2x4"])
def coll(request):
    plan = mixed_plan(num_nodes=request.param)
    return EmbeddingCollection(CONFIG, plan, plan.make_mesh(), rngs=nnx.Rngs(0))


def test_forward_matches_reference(coll):
    batch = make_batch(1)
    res = coll.lookup(coll.shard_batch(batch))
    want = collection_ref.forward(coll.config, coll.full_tables(), batch)
    for name, w in want.items():
        np.testing.assert_allclose(
            np.asarray(res.outputs[name]), w, rtol=1e-5, atol=1e-5, err_msg=name
        )
    assert all(int(v) == 0 for v in res.overflow.values())


@pytest.mark.parametrize(
    ("opt", "dp_grads"),
    [
        (O.SGD(learning_rate=0.5), "dense"),
        (O.Adagrad(learning_rate=0.3), "sparse"),
        (O.Adam(learning_rate=0.1), "dense"),
    ],
    ids=["sgd", "adagrad", "adam"],
)
def test_apply_gradients_matches_reference(opt, dp_grads):
    plan = mixed_plan(num_nodes=2)
    coll = EmbeddingCollection(
        CONFIG,
        plan,
        plan.make_mesh(),
        rngs=nnx.Rngs(1),
        optimizer=opt,
        options=RuntimeOptions(dp_gradients=dp_grads),
    )
    batch = make_batch(2)
    before = coll.full_tables()
    rng = np.random.default_rng(3)
    res = coll.lookup(coll.shard_batch(batch))
    grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in res.outputs.items()}
    coll.apply_gradients(res, grads, batch)
    want, _ = collection_ref.update(coll.config, before, batch, grads, opt)
    got = coll.full_tables()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
        assert not np.allclose(got[name], before[name]), name  # the update did something


def test_jax_grad_through_lookup_matches_reference(coll):
    batch = coll.shard_batch(make_batch(4))
    rng = np.random.default_rng(5)
    outs = coll(batch)
    cot = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in outs.items()}

    def loss(bufs):
        o, _, _ = lookup_fn(coll.lowered, coll.mesh, coll.options, bufs, batch)
        return sum(jnp.sum(o[k] * cot[k]) for k in o)

    g = jax.jit(jax.grad(loss))(coll.buffer_values())
    got = coll.lowered.unstack({k: np.asarray(v) for k, v in g.items()}, replicas="sum")
    full = {k: jnp.asarray(v) for k, v in coll.full_tables().items()}
    host = make_batch(4)

    def ref_loss(tables):
        total = 0.0
        for f in coll.config.features:
            ids, seg, w = host.flat(f.name)
            y = reference.lookup_pool(tables[f.table], ids, seg, B, w, f.combiner)
            total += jnp.sum(y.reshape(cot[f.name].shape) * cot[f.name])
        return total

    want = jax.grad(ref_loss)(full)
    for name in want:
        np.testing.assert_allclose(
            got[name], np.asarray(want[name]), rtol=1e-5, atol=1e-5, err_msg=name
        )


@pytest.mark.parametrize("cluster", ["rb", "ub"])
def test_overflow_is_counted_and_strict_mode_raises(cluster):
    tables = [
        TableConfig(name="rw", vocab_size=64, dim=8),
        TableConfig(name="tw", vocab_size=9, dim=8),
    ]
    features = [
        FeatureConfig(name="f", table="rw", max_hotness=8),
        FeatureConfig(name="g", table="tw", max_hotness=2),
    ]
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=G),
        batch_size=B,
        tables=(
            TablePlan(
                name="rw",
                cluster=cluster,
                row_shards=4,
                column_shards=1,
                devices=((0, 2, 4, 6),),
                capacity_factor=0.1,
            ),
            TablePlan(name="tw", cluster=cluster, row_shards=1, column_shards=1, devices=((1,),)),
        ),
    )
    coll = EmbeddingCollection(
        EmbeddingConfig.create(tables, features), plan, plan.make_mesh(), rngs=nnx.Rngs(0)
    )
    rng = np.random.default_rng(0)
    batch = SparseFeatures.from_dense(
        {"f": rng.integers(0, 64, size=(B, 8)), "g": rng.integers(0, 9, size=(B, 2))}
    )
    res = coll.lookup(coll.shard_batch(batch))
    assert int(res.overflow["rw"]) > 0
    assert int(res.overflow["tw"]) == 0
    # the exact count from a numpy bucket count; what did fit is looked up correctly
    want_out, want_lost = collection_ref.routed(coll, batch)
    assert {k: int(v) for k, v in res.overflow.items()} == want_lost
    for name in ("f", "g"):
        out = np.asarray(res.outputs[name])
        assert np.isfinite(out).all(), name
        np.testing.assert_allclose(out, want_out[name], rtol=1e-5, atol=1e-5, err_msg=name)
    want = collection_ref.forward(coll.config, coll.full_tables(), batch)
    np.testing.assert_allclose(np.asarray(res.outputs["g"]), want["g"], rtol=1e-5, atol=1e-5)
    strict = EmbeddingCollection(
        EmbeddingConfig.create(tables, features),
        plan,
        plan.make_mesh(),
        rngs=nnx.Rngs(0),
        options=RuntimeOptions(overflow="error"),
    )
    with pytest.raises(CapacityOverflowError, match="'rw'"):
        strict.lookup(strict.shard_batch(batch))


def test_plan_json_round_trip_and_validation():
    plan = mixed_plan(2)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    bad = plan.to_dict()
    bad["tables"][2]["devices"] = [[0, 0, 4, 6]]
    with pytest.raises(PlanError, match="table 'rw': device 0 holds two shards"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["tables"][0]["devices"] = [[0, 1]]
    with pytest.raises(PlanError, match="table 'dp': a dp table is replicated"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["tables"][1]["devices"] = [[9]]
    with pytest.raises(PlanError, match=r"table 'tw': device 9 out of range \[0, 8\)"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["tables"][3]["column_shards"] = 3
    bad["tables"][3]["devices"] = [[1], [5], [6]]
    with pytest.raises(PlanError, match="table 'cw': column_shards 3 does not divide dim 16"):
        EmbeddingCollection(CONFIG, Plan.from_dict(bad), plan.make_mesh(), rngs=nnx.Rngs(0))
    bad = plan.to_dict()
    bad["tables"][5]["cluster"] = "rb"
    with pytest.raises(PlanError, match="feature 'f_ub_seq' has combiner 'none'"):
        EmbeddingCollection(CONFIG, Plan.from_dict(bad), plan.make_mesh(), rngs=nnx.Rngs(0))
    with pytest.raises(PlanError, match="batch_size 12 must be a positive multiple of the 8"):
        Plan(topology=plan.topology, batch_size=12, tables=plan.tables)


def test_capacities_derived_from_observed_batches_remove_overflow():
    from embark_jax.sharding.capacity import derive_capacities

    tables = [TableConfig(name="rw", vocab_size=64, dim=8)]
    features = [FeatureConfig(name="f", table="rw", max_hotness=8)]
    config = EmbeddingConfig.create(tables, features)
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=G),
        batch_size=B,
        tables=(
            TablePlan(
                name="rw",
                cluster="rb",
                row_shards=4,
                column_shards=1,
                devices=((0, 2, 4, 6),),
                capacity_factor=0.5,
            ),
        ),
    )
    rng = np.random.default_rng(7)
    batch = SparseFeatures.from_dense(
        {"f": (rng.zipf(1.5, size=(B, 8)) - 1) % 64 * 4}
    )  # id % 4 == 0
    coll = EmbeddingCollection(
        EmbeddingConfig.create(tables, features), plan, plan.make_mesh(), rngs=nnx.Rngs(0)
    )
    assert int(coll.lookup(coll.shard_batch(batch)).overflow["rw"]) > 0
    tuned = derive_capacities(plan, config, [batch])
    assert tuned.table("rw").capacity_factor >= 4.0  # every id goes to row shard 0
    coll = EmbeddingCollection(config, tuned, tuned.make_mesh(), rngs=nnx.Rngs(0))
    res = coll.lookup(coll.shard_batch(batch))
    assert int(res.overflow["rw"]) == 0
    want = collection_ref.forward(config, coll.full_tables(), batch)
    np.testing.assert_allclose(np.asarray(res.outputs["f"]), want["f"], rtol=1e-5, atol=1e-5)


def _snapshot(coll):
    return [
        np.asarray(x).tobytes()
        for x in jax.tree.leaves((coll.buffer_values(), coll.state_values()))
    ]


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_non_finite_gradients_are_refused_and_nothing_changes(poison):
    """Transactional `apply_gradients`: one NaN/inf gradient element (of any feature, any
    cluster) refuses the whole update on every device; tables and slots keep their bits,
    the updates-applied counter does not move, and the next finite update applies."""
    from embark_jax.sharding.checks import NonFiniteUpdateError

    plan = mixed_plan()
    coll = EmbeddingCollection(
        CONFIG, plan, plan.make_mesh(), rngs=nnx.Rngs(0), optimizer=O.Adagrad(learning_rate=0.1)
    )
    batch = make_batch(3)
    res = coll.lookup(batch)
    before = _snapshot(coll)
    grads = {k: jnp.ones_like(v) for k, v in res.outputs.items()}
    grads["f_ub"] = grads["f_ub"].at[2, 1].set(poison)
    with pytest.raises(NonFiniteUpdateError, match="nothing was applied"):
        coll.apply_gradients(res, grads, batch)
    assert _snapshot(coll) == before
    assert int(coll.rounding.get_value()[-1]) == 0
    good = {k: jnp.ones_like(v) for k, v in res.outputs.items()}
    assert bool(coll.apply_gradients(res, good))
    assert _snapshot(coll) != before and int(coll.rounding.get_value()[-1]) == 1


def test_apply_gradients_names_a_misshapen_gradient_and_a_foreign_batch():
    """A gradient of the wrong shape or for an unknown/missing feature, and a result applied
    with another batch's ids, are one-line errors naming the feature; nothing is applied."""
    plan = mixed_plan()
    coll = EmbeddingCollection(
        CONFIG, plan, plan.make_mesh(), rngs=nnx.Rngs(0), optimizer=O.SGD(learning_rate=0.1)
    )
    batch = make_batch(4)
    res = coll.lookup(batch)
    before = _snapshot(coll)
    grads = {k: jnp.ones_like(v) for k, v in res.outputs.items()}
    bad = dict(grads, f_cw=jnp.ones((B, 8)))  # f_cw's table has dim 16
    with pytest.raises(ValueError, match=r"feature 'f_cw': gradient of shape \(16, 8\)"):
        coll.apply_gradients(res, bad, batch)
    missing = {k: v for k, v in grads.items() if k != "f_rw"}
    with pytest.raises(ValueError, match=r"missing \['f_rw'\]"):
        coll.apply_gradients(res, missing)
    with pytest.raises(ValueError, match=r"feature '.*': the batch's ids are not the ones"):
        coll.apply_gradients(res, grads, make_batch(5))
    assert _snapshot(coll) == before
    coll.apply_gradients(res, grads)  # the result's own batch by default
    assert _snapshot(coll) != before


def test_a_dense_optimizer_over_params_never_touches_the_tables():
    """`nnx.Optimizer(model, optax.adam(...), wrt=nnx.Param)` on a model holding a
    collection: the tables and slots are their own variable types, so the dense optimizer
    neither holds state for them nor changes them."""
    import optax

    plan = mixed_plan()

    class Model(nnx.Module):
        def __init__(self):
            self.emb = EmbeddingCollection(
                CONFIG,
                plan,
                plan.make_mesh(),
                rngs=nnx.Rngs(0),
                optimizer=O.Adagrad(learning_rate=0.1),
            )
            self.head = nnx.Linear(4, 1, rngs=nnx.Rngs(1))

    model = Model()
    tables = [np.asarray(v) for v in model.emb.buffer_values().values()]
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    shapes = {x.shape for x in jax.tree.leaves(nnx.state(opt, nnx.optimizer.OptState))}
    assert all(x.ndim != 3 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert shapes <= {(), (4, 1), (1,)}, shapes  # Adam's moments of the head only
    grads = nnx.grad(
        lambda m: jnp.sum(m.head(jnp.ones((2, 4)))), argnums=nnx.DiffState(0, nnx.Param)
    )(model)
    opt.update(model, grads)
    for before, after in zip(tables, model.emb.buffer_values().values(), strict=True):
        np.testing.assert_array_equal(before, np.asarray(after))


@pytest.mark.parametrize("cluster", ["dp", "rb", "ub"])
def test_a_stacked_group_makes_one_kernel_call_per_phase(cluster):
    """Three tables of one width (one stacked group), four features (two share a table):
    the compiled lookup + update makes one lookup-and-pool call (UB: one gather on the owner,
    one pooling of the received vectors), one staged update and one commit, whatever the
    number of features."""
    from embark_jax.sharding.collection import apply_gradients_fn
    from embark_jax.training import state as train_state
    from embark_jax.training.models import DenseConfig

    dim, batch = 8, 16
    config = EmbeddingConfig.create(
        [TableConfig(name=f"t{i}", vocab_size=100 * (i + 1), dim=dim) for i in range(3)],
        [
            FeatureConfig(name="a", table="t0", max_hotness=2),
            FeatureConfig(name="b", table="t1", max_hotness=3),
            FeatureConfig(name="c", table="t2", max_hotness=1),
            FeatureConfig(name="d", table="t2", max_hotness=2),
        ],
    )
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=1),
        batch_size=batch,
        tables=tuple(
            TablePlan(name=f"t{i}", cluster=cluster, row_shards=1, column_shards=1, devices=((0,),))
            for i in range(3)
        ),
    )
    setup, state = train_state.create(
        config, plan, dense=DenseConfig.mini(), sparse_optimizer=O.RowWiseAdagrad(learning_rate=0.1)
    )
    assert len(setup.lowered.groups) == 1
    rng = np.random.default_rng(0)
    dense = {f.name: rng.integers(0, 100, (batch, f.max_hotness)) for f in config.features}
    sparse = jax.device_put(SparseFeatures.from_dense(dense, config=config), setup.table_sharding)
    grads = {f.name: jnp.ones((batch, dim), jnp.float32) for f in config.features}
    args = (setup.lowered, setup.mesh, setup.options)

    def step(tables, slots, sparse, grads):
        outputs, residuals, _ = lookup_fn(*args, tables, sparse)
        new = apply_gradients_fn(*args, tables, slots, residuals, grads, setup.optimizers, sparse)
        return outputs, new

    lowered = jax.jit(step).lower(dict(state.tables), dict(state.slots), sparse, grads)
    text = lowered.compile().as_text()
    calls = {
        target: text.count(f'custom_call_target="{target}"')
        for target in ("embark_lookup_pool", "embark_sparse_grad_stage", "embark_commit_rows")
    }
    lookups = 2 if cluster == "ub" else 1
    assert calls == {
        "embark_lookup_pool": lookups,
        "embark_sparse_grad_stage": 1,
        "embark_commit_rows": 1,
    }


@pytest.mark.parametrize("cluster", ["dp", "rb", "ub"])
def test_lookup_and_update_in_one_jit_with_given_gradients_copy_no_table(cluster):
    """`lookup_fn` + `apply_gradients_fn` in one donated jit, the output gradients an input
    (so the update does not depend on the lookup's outputs): the update is still ordered
    after the lookup's reads by the read marker, and no whole table or slot is copied."""
    from embark_jax.sharding import hlo_scan
    from embark_jax.sharding.collection import apply_gradients_fn
    from embark_jax.training import state as train_state
    from embark_jax.training.models import DenseConfig

    vocab, dim, hot, batch = 50_000, 16, 4, 64
    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=vocab, dim=dim)],
        [FeatureConfig(name="f", table="t", max_hotness=hot)],
    )
    tp = TablePlan(name="t", cluster=cluster, row_shards=1, column_shards=1, devices=((0,),))
    plan = Plan(topology=Topology(num_nodes=1, devices_per_node=1), batch_size=batch, tables=(tp,))
    setup, state = train_state.create(
        config, plan, dense=DenseConfig.mini(), sparse_optimizer=O.RowWiseAdagrad(learning_rate=0.1)
    )
    rng = np.random.default_rng(0)
    host = SparseFeatures.from_dense({"f": rng.integers(0, vocab, (batch, hot))}, config=config)
    sparse = jax.device_put(host, setup.table_sharding)
    grads = {"f": jnp.ones((batch, dim), jnp.float32)}
    args = (setup.lowered, setup.mesh, setup.options)

    def step(tables, slots, sparse, grads):
        outputs, residuals, _ = lookup_fn(*args, tables, sparse)
        tables, slots, applied = apply_gradients_fn(
            *args, tables, slots, residuals, grads, setup.optimizers, sparse
        )
        return tables, slots, outputs, applied

    tables, slots = dict(state.tables), dict(state.slots)
    before = {k: np.asarray(v) for k, v in tables.items()}
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(tables, slots, sparse, grads).compile()
    buffers = {
        f"{k}{i}": (str(x.dtype), x.shape[1:] if x.ndim > 2 else x.shape)
        for k, tree in (("tables", tables), ("slots", slots))
        for i, x in enumerate(jax.tree.leaves(tree))
        if x.ndim >= 2
    }
    assert hlo_scan.scan(compiled.as_text(), buffers) == []
    assert compiled.memory_analysis().alias_size_in_bytes >= sum(
        x.nbytes for x in jax.tree.leaves((tables, slots))
    )
    new_tables, _, outputs, applied = compiled(tables, slots, sparse, grads)
    assert bool(applied)
    # the lookup read the tables before the update: the outputs are the old rows' sums
    want = reference.lookup_pool(
        jnp.asarray(setup.lowered.unstack(before)["t"]),
        *host.flat("f")[:2],
        batch,
    )
    np.testing.assert_allclose(np.asarray(outputs["f"]), np.asarray(want), rtol=1e-6, atol=1e-6)
    moved = np.asarray(
        setup.lowered.unstack({k: np.asarray(v) for k, v in new_tables.items()})["t"]
    )
    assert not np.array_equal(moved, setup.lowered.unstack(before)["t"])


def test_staging_memory_is_written_in_place_and_changes_no_result():
    """`apply_gradients_fn(staging=init_staging(...))` on the mixed plan (DP, RB, UB groups,
    8 devices): the same tables and slots as staging into fresh memory, the staging donated
    and aliased with no copy of it in the compiled step."""
    from embark_jax.sharding import hlo_scan
    from embark_jax.sharding.collection import apply_gradients_fn
    from embark_jax.training import state as train_state
    from embark_jax.training.models import DenseConfig

    setup, state = train_state.create(
        CONFIG,
        mixed_plan(),
        dense=DenseConfig.mini(),
        sparse_optimizer=O.RowWiseAdagrad(learning_rate=0.1),
    )
    args = (setup.lowered, setup.mesh, setup.options)
    sparse = jax.device_put(make_batch(3), setup.table_sharding)

    def step(tables, slots, staging):
        outputs, residuals, _ = lookup_fn(*args, tables, sparse)
        grads = {k: 0.5 - jnp.cos(v) for k, v in outputs.items()}
        return apply_gradients_fn(
            *args, tables, slots, residuals, grads, setup.optimizers, sparse, staging=staging
        )

    def copy(tree):
        return jax.tree.map(jnp.copy, tree)

    fresh = jax.jit(lambda t, s: step(t, s, None))(copy(state.tables), copy(state.slots))
    staging = copy(state.staging)
    jitted = jax.jit(step, donate_argnums=(0, 1, 2))
    compiled = jitted.lower(state.tables, state.slots, staging).compile()
    buffers = {
        f"staging{i}": (str(x.dtype), x.shape)
        for i, x in enumerate(jax.tree.leaves(staging))
        if x.ndim == 2
    }
    assert buffers and hlo_scan.scan(compiled.as_text(), buffers) == []
    per_device = sum(x.nbytes for x in jax.tree.leaves((state.tables, state.slots, staging))) // G
    assert compiled.memory_analysis().alias_size_in_bytes >= per_device
    staged = compiled(copy(state.tables), copy(state.slots), staging)
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(staged[:3]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("cluster", ["dp", "rb", "ub"])
def test_staging_made_for_another_batch_is_not_used_and_comes_back_as_it_was(cluster):
    from embark_jax.sharding.collection import apply_gradients_fn, init_staging
    from embark_jax.training import state as train_state
    from embark_jax.training.models import DenseConfig

    vocab, hot, batch = 5_000, 4, 32
    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=vocab, dim=8)],
        [FeatureConfig(name="f", table="t", max_hotness=hot)],
    )
    tp = TablePlan(name="t", cluster=cluster, row_shards=1, column_shards=1, devices=((0,),))
    plan = Plan(topology=Topology(num_nodes=1, devices_per_node=1), batch_size=batch, tables=(tp,))
    setup, state = train_state.create(
        config, plan, dense=DenseConfig.mini(), sparse_optimizer=O.RowWiseAdagrad(learning_rate=0.1)
    )
    args = (setup.lowered, setup.mesh, setup.options)
    host = SparseFeatures.from_dense(
        {"f": np.random.default_rng(0).integers(0, vocab, (batch, hot))}, config=config
    )
    sparse = jax.device_put(host, setup.table_sharding)

    @jax.jit
    def step(tables, slots, staging):
        outputs, residuals, _ = lookup_fn(*args, tables, sparse)
        grads = {k: 0.5 - jnp.cos(v) for k, v in outputs.items()}
        return apply_gradients_fn(
            *args, tables, slots, residuals, grads, setup.optimizers, sparse, staging=staging
        )

    other = init_staging(
        *args, state.tables, state.slots, setup.optimizers, SparseFeatures.abstract(config, 4)
    )
    (g,) = other
    assert other[g].values.shape[0] < state.staging[g].values.shape[0]  # min(ids, rows)
    want = step(state.tables, state.slots, state.staging)
    got = step(state.tables, state.slots, other)
    for a, b in zip(jax.tree.leaves(want[:3]), jax.tree.leaves(got[:3]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(other[g], got[3][g], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    given = (state.tables, state.slots, None, {}, setup.optimizers, sparse)
    for bad, says in (
        ({"nope": other[g]}, "staging has unknown group 'nope'"),
        ({g: other[g][:2]}, f"staging\\['{g}'\\] must be an ops.Staging"),
        ([other[g]], "staging must map group names"),
    ):
        with pytest.raises(ValueError, match=f"apply_gradients_fn: {says}") as e:
            apply_gradients_fn(*args, *given, staging=bad)
        assert "\n" not in str(e.value)
