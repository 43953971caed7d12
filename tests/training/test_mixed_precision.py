"""`train --mixed-precision` end to end, through the CLI's own builder: the flag parsed by the
`train` argument parser and turned into a runner by `embark_jax.cli.train._build`, exactly as
`python -m embark_jax train --mixed-precision` does, on a tiny config instead of a preset (the
subprocess run would cost ~15 s of the CI budget). The step, as traced for compilation, must
compute the dense net and move embeddings in bf16 while the tables stay float32, and a few
steps must give finite metrics."""

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.cli.train import _build, add_train_args
from embark_jax.core.options import CommDtype
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.training import state as train_state
from embark_jax.training.step import compile_train_step

B = 16
CFG = EmbeddingConfig.create(
    [TableConfig(name="a", vocab_size=64, dim=8), TableConfig(name="b", vocab_size=32, dim=8)],
    [
        FeatureConfig(name="fa", table="a", max_hotness=3, combiner="mean"),
        FeatureConfig(name="fb", table="b", max_hotness=2),
    ],
)
PLAN = Plan(
    topology=Topology(num_nodes=1, devices_per_node=8),
    batch_size=B,
    tables=(
        TablePlan(name="a", cluster="rb", row_shards=2, column_shards=1, devices=((0, 1),)),
        TablePlan(name="b", cluster="ub", row_shards=2, column_shards=1, devices=((2, 3),)),
    ),
)


def parse(*flags):
    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args(["--lr", "0.1", "--dense-lr", "0.01", *flags])


@pytest.fixture(scope="module")
def mixed():
    runner, state = _build(parse("--mixed-precision"), CFG, PLAN)
    ds = SyntheticDataset(CFG, batch_size=B, seed=4)
    return runner, state, ds


def test_flag_sets_bf16_activations_and_communication(mixed):
    runner, _, _ = mixed
    assert runner.setup.options.comm_dtype is CommDtype.BFLOAT16
    assert not parse().mixed_precision  # off by default


def test_compiled_step_computes_in_bf16_and_tables_stay_float32(mixed):
    """The step as traced (StableHLO): dense matmuls on bf16 operands and embedding vectors
    exchanged in bf16. XLA:CPU then widens bf16 dots and collectives to f32 around converts
    (float normalization): the compiled CPU program shows only f32 dots around bf16
    converts, so the traced program is the one to read."""
    runner, state, ds = mixed
    batch = runner.put_batch(ds.batch(0))
    traced = compile_train_step(runner.setup, donate=False).lower(state, batch).as_text()
    lines = traced.splitlines()
    dots = [line for line in lines if "stablehlo.dot_general" in line]
    assert dots and all("xbf16>" in line for line in dots), "a dense matmul is not bf16"
    a2a = [re.findall(r"-> tensor<[^>]*>", line)[-1] for line in lines if "all_to_all" in line]
    vectors = [t for t in a2a if "xi32>" not in t]  # the ids travel as int32
    assert vectors and all(t.endswith("xbf16>") for t in vectors), vectors
    assert all(buf.dtype == jnp.float32 for buf in state.tables.values())


def test_mixed_precision_steps_give_finite_metrics(mixed):
    runner, state, ds = mixed
    state = jax.tree.map(jnp.copy, state)  # the steps donate it; the fixture's stays
    tables0 = train_state.full_tables(runner.setup, state)
    losses = []
    for i in range(3):
        state, r = runner.step(state, ds.batch(i))
        losses.append(float(r.loss))
    totals = runner.totals()
    assert totals.applied == 3 and 0.0 < totals.auc.logloss() < 1.5
    assert np.isfinite(losses).all() and 0.3 < losses[0] < 1.5, losses
    assert runner.num_compilations() == 1 and int(state.step) == 3
    tables = train_state.full_tables(runner.setup, state)
    for name, t in tables.items():
        assert t.dtype == np.float32 and np.isfinite(t).all(), name
        assert not np.array_equal(t, tables0[name]), name  # the sparse update ran
    leaves = jax.tree.leaves(state.dense_params)
    assert all(x.dtype == jnp.float32 and np.isfinite(np.asarray(x)).all() for x in leaves)
