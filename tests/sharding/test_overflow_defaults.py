"""The default capacities lose nothing on the library's own data: the
binomial-tail sizing gives small per-device counts their (near) worst case, where a fixed
factor times the mean dropped ids on batches of 16 and 32."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.sharding.collection import EmbeddingCollection
from tests.sharding.test_collection import CONFIG, mixed_plan


def readme_setup():
    """The README example's tables and plan."""
    tables = [
        TableConfig(name="items", vocab_size=10_000, dim=16),
        TableConfig(name="users", vocab_size=100, dim=16),
    ]
    features = [
        FeatureConfig(name="clicked", table="items", max_hotness=4, combiner="mean"),
        FeatureConfig(name="user", table="users", max_hotness=1),
    ]
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8),
        batch_size=64,
        tables=(
            TablePlan(
                name="items",
                cluster="rb",
                row_shards=4,
                column_shards=2,
                devices=((0, 1, 2, 3), (4, 5, 6, 7)),
            ),
            TablePlan(
                name="users",
                cluster="dp",
                row_shards=1,
                column_shards=1,
                devices=(tuple(range(8)),),
            ),
        ),
    )
    return EmbeddingConfig.create(tables, features), plan


SETUPS = {"readme": readme_setup, "mixed": lambda: (CONFIG, mixed_plan(1))}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("batch_size", [16, 32])
def test_default_capacities_lose_no_ids_on_small_synthetic_batches(setup, batch_size):
    config, plan = SETUPS[setup]()
    plan = dataclasses.replace(plan, batch_size=batch_size)
    coll = EmbeddingCollection(config, plan, plan.make_mesh(), rngs=nnx.Rngs(0))
    for alpha in (1.1, 0.0):  # the library's Zipf data, and uniform ids
        data = SyntheticDataset(config, batch_size=batch_size, alpha=alpha, seed=1)
        for step in range(6):
            res = coll.lookup(coll.shard_batch(data.batch(step).sparse))
            lost = {k: int(v) for k, v in res.overflow.items() if int(v)}
            assert not lost, (setup, batch_size, alpha, step, lost)


def test_readme_example_batch_loses_no_ids():
    config, plan = readme_setup()
    coll = EmbeddingCollection(config, plan, plan.make_mesh(), rngs=nnx.Rngs(0))
    for seed in range(4):  # the README's batch (seed 0) and a few like it
        rng = np.random.default_rng(seed)
        batch = SparseFeatures.from_dense(
            {"clicked": rng.integers(-1, 10_000, (64, 4)), "user": rng.integers(0, 100, (64, 1))},
            config=config,
        )
        res = coll.lookup(coll.shard_batch(batch))
        assert all(int(v) == 0 for v in res.overflow.values()), (seed, res.overflow)
