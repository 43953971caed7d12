"""Transactional steps, in place: a step whose update produces NaN is refused on the device
and never checkpointed; under `overflow="error"` nothing is committed; the state the step
returns (the caller's state was donated) equals the one before the step and trains on.
Optimizer hyper-parameters are validated at construction."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from embark_jax.ops import optimizers as O
from embark_jax.sharding.collection import CapacityOverflowError
from embark_jax.training import checkpoint as ckpt
from embark_jax.training.checkpoint import CheckpointEvery
from embark_jax.training.loop import fit
from embark_jax.training.runner import NonFiniteLossError
from tests.training.test_reliability import assert_tables_equal, tables_of, tiny


def nan_after(n):
    """A dense learning rate that becomes NaN from update `n` on (the loss computed before
    that update is still finite)."""
    return optax.sgd(lambda count: jnp.where(count >= n, jnp.nan, 0.1))


def test_an_update_that_produces_nan_is_refused_and_never_checkpointed(tmp_path):
    """The verdict covers the dense update, not only the loss computed before it: step 3's
    NaN parameters are refused on the device, never checkpointed, and the last good
    checkpoint is named."""
    runner, state, ds = tiny(dense_opt=nan_after(2))
    saver = CheckpointEvery(str(tmp_path), runner, every=1, last_step=5)
    state, _ = fit(runner, state, ds, 2, callbacks=[saver])
    before = tables_of(runner, state)
    with pytest.raises(
        NonFiniteLossError,
        match=r"non-finite dense update at step 3 \(the step was not applied.*\); "
        r"last good checkpoint: .*step_00000002",
    ) as e:
        fit(runner, state, ds, 3, start=2, callbacks=[saver])
    assert ckpt.latest_step(str(tmp_path)) == 2
    assert all(buf.is_deleted() for buf in state.tables.values())  # donated: in place
    kept = e.value.state  # fit hands back the last committed state
    assert int(kept.step) == 2
    assert_tables_equal(tables_of(runner, kept), before)
    restored, _ = ckpt.restore(str(tmp_path), runner.setup)
    assert int(restored.step) == 2
    assert all(np.isfinite(v).all() for v in before.values())


def test_save_refuses_a_non_finite_state(tmp_path):
    runner, state, _ = tiny()
    bad = state.replace(tables={k: v * jnp.nan for k, v in state.tables.items()})
    with pytest.raises(FloatingPointError, match=r"refusing to save step 0: .*NaN or inf"):
        ckpt.save(str(tmp_path), runner.setup, bad)
    assert ckpt.latest_step(str(tmp_path)) is None


def test_overflow_error_commits_nothing_and_the_state_stays_usable():
    """Under `error` the device refuses the overflowing step: the step counter, tables and
    dense parameters of the returned state are the ones before it, and it trains on; the
    error comes when the runner reads the step's flags (here `sync`)."""
    runner, state, ds = tiny(policy="error", factor=0.2)
    batch = ds.batch(0)
    before = tables_of(runner, state)
    dense = jax.tree.map(np.asarray, state.dense_params)
    new, _ = runner.step(state, batch)
    with pytest.raises(
        CapacityOverflowError, match=r"at step 1 \(.*'a'.*the step was not applied"
    ) as e:
        runner.sync()
    assert e.value.step == 1
    assert int(new.step) == 0
    assert_tables_equal(tables_of(runner, new), before)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new.dense_params), dense)
    # the same state trains on under another policy
    counting, _, _ = tiny(policy="count", factor=0.2)
    new, _ = counting.step(new, batch)
    assert int(new.step) == 1 and counting.totals().overflow["a"] > 0


def test_a_donated_state_is_refused_with_a_message():
    runner, state, ds = tiny()
    runner.step(state, ds.batch(0))
    assert all(buf.is_deleted() for buf in state.tables.values())  # updated in place
    with pytest.raises(ValueError, match="donated to an earlier step"):
        runner.step(state, ds.batch(1))


BAD_HPARAMS = [
    (
        O.SGD,
        {"learning_rate": math.nan},
        "SGD: learning_rate must be a finite number >= 0, got nan",
    ),
    (
        O.SGD,
        {"learning_rate": math.inf},
        "SGD: learning_rate must be a finite number >= 0, got inf",
    ),
    (O.Adagrad, {"learning_rate": -0.1}, "Adagrad: learning_rate must be .* got -0.1"),
    (O.Adagrad, {"learning_rate": "0.1"}, "Adagrad: learning_rate must be .* got '0.1'"),
    (O.Adagrad, {"learning_rate": 0.1, "eps": -1.0}, "Adagrad: eps must be .* got -1.0"),
    (
        O.RowWiseAdagrad,
        {"learning_rate": 0.1, "initial_accumulator": math.nan},
        "RowWiseAdagrad: initial_accumulator must be .* got nan",
    ),
    (O.Adam, {"learning_rate": 0.1, "b1": 1.0}, r"Adam: b1 must be a number in \[0, 1\), got 1.0"),
    (O.Adam, {"learning_rate": 0.1, "b2": None}, "Adam: b2 must be .* got None"),
    (O.Adam, {"learning_rate": True}, "Adam: learning_rate must be .* got True"),
]


@pytest.mark.parametrize(("cls", "kw", "pattern"), BAD_HPARAMS)
def test_optimizer_hyper_parameters_are_validated(cls, kw, pattern):
    with pytest.raises(ValueError, match=f"^{pattern}$"):
        cls(**kw)


def test_valid_hyper_parameters_are_accepted():
    O.Adam(learning_rate=np.float32(0.1), b1=0.0, b2=0.5, eps=0.0)
    O.SGD(learning_rate=0)
