"""Training on 8 fake devices: one step equals the single-device reference step; the model
learns; the second step does not recompile; bf16 communication matches f32 at bf16 precision
(lookup outputs and table updates)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from embark_jax.core.options import CommDtype, RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.sharding.collection import lookup_fn
from embark_jax.training import state as train_state
from embark_jax.training.loop import fit
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import StepRunner
from embark_jax.training.step import bce_loss
from tests import collection_ref

D = 8
CFG = EmbeddingConfig.create(
    [
        TableConfig(name="dp", vocab_size=30, dim=D),
        TableConfig(name="rw", vocab_size=200, dim=D),
        TableConfig(name="rc", vocab_size=100, dim=D),
        TableConfig(name="ub", vocab_size=80, dim=D),
    ],
    [
        FeatureConfig(name="f_dp", table="dp", max_hotness=2),
        FeatureConfig(name="f_rw", table="rw", max_hotness=6, combiner="mean"),
        FeatureConfig(name="f_rc", table="rc", max_hotness=3),
        FeatureConfig(name="f_ub", table="ub", max_hotness=1),
        FeatureConfig(name="f_ub_seq", table="ub", max_hotness=3, combiner="none"),
    ],
)


def mixed_plan(batch=32):
    return Plan(
        topology=Topology(num_nodes=2, devices_per_node=4),
        batch_size=batch,
        tables=(
            TablePlan(
                name="dp", cluster="dp", row_shards=1, column_shards=1, devices=(tuple(range(8)),)
            ),
            TablePlan(
                name="rw", cluster="rb", row_shards=4, column_shards=1, devices=((4, 5, 6, 7),)
            ),
            TablePlan(
                name="rc", cluster="rb", row_shards=2, column_shards=2, devices=((0, 1), (2, 3))
            ),
            TablePlan(name="ub", cluster="ub", row_shards=2, column_shards=1, devices=((1, 6),)),
        ),
    )


DENSE = DenseConfig(kind="dlrm", bottom=(16, D), top=(16, 1))


def make_runner(plan, *, dense=DENSE, opt, dense_opt=None, seed=0, **options):
    """A step runner and the initial state for `plan`."""
    setup, state = train_state.create(
        CFG,
        plan,
        dense=dense,
        sparse_optimizer=opt,
        dense_optimizer=dense_opt,
        seed=seed,
        options=RuntimeOptions(**options),
    )
    return StepRunner(setup), state


PER_TABLE = {
    "dp": O.SGD(learning_rate=0.5),
    "rw": O.Adagrad(learning_rate=0.2),
    "rc": O.Adam(learning_rate=0.1),
    "ub": O.RowWiseAdagrad(learning_rate=0.3),
}


@pytest.mark.parametrize(
    "opt",
    [O.SGD(learning_rate=0.5), O.Adagrad(learning_rate=0.2), PER_TABLE],
    ids=["sgd", "adagrad", "per-table"],
)
def test_one_step_equals_single_device_reference(opt):
    runner, state = make_runner(mixed_plan(), opt=opt, dense_opt=optax.sgd(0.1))
    setup = runner.setup
    batch = SyntheticDataset(CFG, batch_size=32, seed=1, varying_lengths=True).batch(0)
    tables0 = train_state.full_tables(setup, state)
    params0 = jax.tree.map(np.asarray, state.dense_params)

    # single-device reference: forward from full tables, dense grads, sparse table update
    emb = {k: jnp.asarray(v) for k, v in collection_ref.forward(CFG, tables0, batch.sparse).items()}

    def loss_fn(params, e):
        return bce_loss(
            nnx.merge(setup.graphdef, params)(jnp.asarray(batch.dense), e),
            jnp.asarray(batch.labels),
        )

    loss, (gp, ge) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params0, emb)
    want_params = jax.tree.map(lambda p, g: p - 0.1 * g, params0, gp)
    want_tables, _ = collection_ref.update(CFG, tables0, batch.sparse, ge, opt)

    state, r = runner.step(state, batch)
    assert float(r.loss) == pytest.approx(float(loss), rel=1e-5)
    assert int(state.step) == 1
    got_params = jax.tree.map(np.asarray, state.dense_params)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    got_tables = train_state.full_tables(setup, state)
    for name, want in want_tables.items():
        np.testing.assert_allclose(got_tables[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.array_equal(got_tables[name], tables0[name]), name


def test_learns_and_never_recompiles():
    runner, state = make_runner(
        mixed_plan(128),
        dense=DenseConfig(kind="dcnv2", bottom=(16, 8), top=(16, 1), cross_layers=1, cross_rank=8),
        opt=O.Adagrad(learning_rate=0.1),
    )
    ds = SyntheticDataset(CFG, batch_size=128, seed=3)
    state, summary = fit(runner, state, ds, steps=60)
    assert runner.num_compilations() == 1  # 60 steps, one compiled program
    assert int(state.step) == 60
    ev = runner.evaluate(state, [ds.batch(10_000 + i) for i in range(4)])
    # chance is 0.5; the teacher is learnable from the ids (measured ~0.7 here)
    assert ev["auc"] > 0.6, ev
    assert summary.final_loss < summary.losses[0]


def _bf16_vs_f32(batch):
    """Lookup outputs and one SGD step's table updates with f32 and bf16 communication,
    from the same initial state: `{comm: (outputs, deltas)}`."""
    got = {}
    for dt in ("table", "bfloat16"):
        runner, state = make_runner(mixed_plan(), opt=O.SGD(learning_rate=0.5), comm_dtype=dt)
        setup = runner.setup
        tables0 = train_state.full_tables(setup, state)
        lookup = jax.jit(functools.partial(lookup_fn, setup.lowered, setup.mesh, setup.options))
        outputs = lookup(state.tables, runner.put_batch(batch).sparse)[0]
        if dt == "bfloat16":
            assert "bf16" in runner.compiled_step(state, batch).as_text()
        state, _ = runner.step(state, batch)
        tables1 = train_state.full_tables(setup, state)
        deltas = {k: tables1[k] - tables0[k] for k in tables0}
        got[dt] = ({k: np.asarray(v, np.float32) for k, v in outputs.items()}, deltas)
    return got


def _assert_bf16_close(got):
    """bf16 precision: outputs within a few bf16 ulps (2^-8 relative) of the f32 ones,
    table updates within 2% of the largest update, per feature / table."""
    (out_f, delta_f), (out_b, delta_b) = got["table"], got["bfloat16"]
    for k, want in out_f.items():
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(out_b[k], want, rtol=2**-8, atol=2**-8 * scale, err_msg=k)
    for k, want in delta_f.items():
        scale = float(np.max(np.abs(want)))
        assert scale > 0, k
        np.testing.assert_allclose(delta_b[k], want, rtol=0, atol=2e-2 * scale, err_msg=k)


@pytest.fixture(scope="module")
def bf16_batch():
    return SyntheticDataset(CFG, batch_size=32, seed=5).batch(0)


def test_bf16_communication_matches_f32_at_bf16_precision(bf16_batch):
    """Lookup outputs and updated tables, not the loss: zeroing every embedding moves the
    loss by only 2-3%, so a loss tolerance cannot see a broken bf16 path."""
    _assert_bf16_close(_bf16_vs_f32(bf16_batch))


def test_bf16_check_catches_a_path_that_zeroes_half_the_columns(bf16_batch, monkeypatch):
    """The deliberately broken variant (bf16 on the wire, half the columns zeroed) fails
    the check above (the old loss check at rtol=2e-2 passed it)."""
    real = RuntimeOptions.to_wire

    def broken(self, x):
        y = real(self, x)
        if self.comm_dtype is CommDtype.TABLE:
            return y
        return y.at[..., : y.shape[-1] // 2].set(0)

    monkeypatch.setattr(RuntimeOptions, "to_wire", broken)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        _assert_bf16_close(_bf16_vs_f32(bf16_batch))


def test_ids_outside_their_table_are_counted_and_dropped_in_training():
    """A batch that skipped host validation: ids >= vocab are dropped on device and counted
    per table as `invalid` in the step result; no row that no valid id looked up changes
    (the neighbour-table case is in tests/sharding/test_bounds.py)."""
    from embark_jax.data.batch import Batch
    from embark_jax.data.sparse import SparseFeatures

    runner, state = make_runner(mixed_plan(), opt=O.SGD(learning_rate=0.5))
    runner.validate_inputs = False
    setup = runner.setup
    good = SyntheticDataset(CFG, batch_size=32, seed=2).batch(0)
    ids = {k: np.array(v) for k, v in good.sparse.ids.items()}
    ids["f_rw"][:5, 0] = 200 + np.arange(5)  # vocab 200: five ids out of range
    bad = Batch(
        SparseFeatures(ids=ids, lengths=good.sparse.lengths, weights=good.sparse.weights),
        good.dense,
        good.labels,
    )
    before = train_state.full_tables(setup, state)
    state, _ = runner.step(state, bad)
    assert runner.totals().invalid == {"dp": 0, "rw": 5, "rc": 0, "ub": 0}
    after = train_state.full_tables(setup, state)
    touched = {i for i in np.asarray(ids["f_rw"]).reshape(-1) if 0 <= i < 200}
    untouched = sorted(set(range(200)) - touched)
    np.testing.assert_array_equal(after["rw"][untouched], before["rw"][untouched])
