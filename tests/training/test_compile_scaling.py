"""The compiled train step does not grow with the number of features: an RB group routes,
pools, divides and counts the overflow of all its features at once (per-feature data are
array operands), and the bounds check runs over all features together. What still grows
per feature (each feature's input and output array, the dense net's concatenation) is a
few instructions, far from the whole routing of a feature. Instruction counts only (one
compilation per size, tiny shapes); nothing here is timed."""

import jax

from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.training.models import DenseConfig
from embark_jax.training.state import create
from embark_jax.training.step import compile_train_step

ALL = tuple(range(8))
HALVES = ((0, 1, 2, 3), (4, 5, 6, 7))
COMBINERS = ("sum", "mean", "sqrtn")


def _model(n: int, batch: int = 16):
    """n tables of 64 rows, one feature each (hotness 1-2, the three pooled combiners);
    even tables RB by rows over 8 devices, odd ones by 4 rows x 2 column slices."""
    tables = [TableConfig(name=f"t{i}", vocab_size=64, dim=8) for i in range(n)]
    feats = [
        FeatureConfig(name=f"f{i}", table=f"t{i}", max_hotness=1 + i % 2, combiner=COMBINERS[i % 3])
        for i in range(n)
    ]
    plans = [
        TablePlan(name=f"t{i}", cluster="rb", row_shards=8, column_shards=1, devices=(ALL,))
        if i % 2 == 0
        else TablePlan(name=f"t{i}", cluster="rb", row_shards=4, column_shards=2, devices=HALVES)
        for i in range(n)
    ]
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8), batch_size=batch, tables=tuple(plans)
    )
    return EmbeddingConfig.create(tables, feats), plan


def _instructions(n: int) -> int:
    config, plan = _model(n)
    dense = DenseConfig(bottom=(8,), top=(8, 1), cross_layers=1, cross_rank=4)
    setup, state = create(
        config, plan, dense=dense, sparse_optimizer=O.Adagrad(learning_rate=0.1), num_dense=4
    )
    batch = SyntheticDataset(config, batch_size=plan.batch_size, num_dense=4, seed=0).batch(0)
    batch = jax.device_put(batch, setup.table_sharding)
    text = compile_train_step(setup).lower(state, batch).compile().as_text()
    return sum(1 for line in text.splitlines() if " = " in line)


def test_step_instructions_do_not_grow_with_features():
    """10 -> 40 features: at most 40 more instructions a feature (measured 36: 3241 ->
    4313), and at most 1.4x the instructions (before RB routed per group, 100 features
    compiled to 3.0x the HLO lines of 10: docs/benchmarks.md section 2b)."""
    small, large = _instructions(10), _instructions(40)
    assert (large - small) / 30 <= 40 and large <= 1.4 * small, (small, large)
