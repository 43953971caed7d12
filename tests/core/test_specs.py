import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import Combiner, EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.sharding.lowering import lower


def test_table_config_is_frozen_and_keyword_only():
    t = TableConfig(name="t", vocab_size=10, dim=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.dim = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        TableConfig("t", 10, 4)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "", "vocab_size": 10, "dim": 4}, "non-empty string"),
        ({"name": "t", "vocab_size": 0, "dim": 4}, "table 't': vocab_size must be >= 1, got 0"),
        ({"name": "t", "vocab_size": 10, "dim": 0}, "table 't': dim must be >= 1, got 0"),
        ({"name": "t", "vocab_size": 10, "dim": 2.5}, "table 't': dim must be an int"),
        ({"name": "t", "vocab_size": 10, "dim": 4, "dtype": jnp.int32}, "float32 or bfloat16"),
        (
            {"name": "x" * 300, "vocab_size": 10, "dim": 4},
            r"^table name 'x{40}\.\.\.' is too long: 300 characters, 300 as a checkpoint "
            r"directory name .*; at most 200 are allowed$",
        ),
        (
            {"name": "a/b" * 45, "vocab_size": 10, "dim": 4},
            r"too long: 135 characters, 225 as a checkpoint directory name",
        ),
    ],
)
def test_table_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TableConfig(**kwargs)


def test_feature_config_parses_combiner():
    f = FeatureConfig(name="f", table="t", max_hotness=3, combiner="MEAN")
    assert f.combiner is Combiner.MEAN
    assert not Combiner.NONE.pooled and Combiner.SQRTN.pooled


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "f", "table": "t", "max_hotness": 0}, "feature 'f': max_hotness must be >= 1"),
        ({"name": "f", "table": "t", "combiner": "max"}, "feature 'f': unknown combiner 'max'"),
        ({"name": "f", "table": ""}, "feature 'f': table must be a table name"),
        ({"name": "f", "table": "t", "weighted": "no"}, "feature 'f': weighted must be True or"),
        ({"name": "f", "table": "t", "weighted": 1}, "feature 'f': weighted must be True or"),
        ({"name": "f", "table": "t", "weighted": None}, "feature 'f': weighted must be True or"),
    ],
)
def test_feature_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FeatureConfig(**kwargs)


def test_embedding_config_cross_checks():
    t = TableConfig(name="t", vocab_size=10, dim=4)
    f = FeatureConfig(name="f", table="t")
    cfg = EmbeddingConfig.create([t], [f, FeatureConfig(name="g", table="t")])
    assert cfg.table_of("g") is t
    with pytest.raises(ValueError, match="feature 'x' looks up unknown table 'u'"):
        EmbeddingConfig.create([t], [f, FeatureConfig(name="x", table="u")])
    with pytest.raises(ValueError, match="duplicate feature name 'f'"):
        EmbeddingConfig.create([t], [f, f])
    with pytest.raises(ValueError, match="duplicate table name 't'"):
        EmbeddingConfig.create([t, t], [f])
    with pytest.raises(ValueError, match=r"tables not looked up by any feature: \['v'\]"):
        EmbeddingConfig.create([t, TableConfig(name="v", vocab_size=3, dim=2)], [f])
    with pytest.raises(ValueError, match="unknown feature 'zz'"):
        cfg.table_of("zz")


def test_table_init_shape_dtype_and_range():
    t = TableConfig(name="t", vocab_size=50, dim=16, dtype=jnp.bfloat16)
    w = t.init(jax.random.key(0))
    assert w.shape == (50, 16) and w.dtype == jnp.bfloat16
    assert float(jnp.abs(w.astype(jnp.float32)).max()) <= 0.25 + 1e-3


def test_default_init_spreads_over_the_whole_range_and_shards_differ():
    """The upper bound above passes for an all-zero table: check the spread too.
    Uniform(+-1/sqrt(dim)): min and max near the bounds, std bound/sqrt(3), mean 0;
    and every shard of a row- and column-sharded table draws its own values."""
    dim, vocab = 16, 4096
    bound = 1.0 / np.sqrt(dim)
    for dtype in (jnp.float32, jnp.bfloat16):
        t = TableConfig(name="t", vocab_size=vocab, dim=dim, dtype=dtype)
        w = np.asarray(t.init(jax.random.key(1)).astype(jnp.float32))
        assert w.min() >= -bound - 1e-3 and w.max() <= bound + 1e-3
        assert w.min() < -0.99 * bound and w.max() > 0.99 * bound
        assert abs(w.std() - bound / np.sqrt(3)) < 0.01 * bound
        assert abs(w.mean()) < 0.01 * bound
        assert len(np.unique(w)) > (1000 if dtype == jnp.bfloat16 else 0.9 * w.size)

    # one table in 2 row shards x 2 column slices on 4 devices, one more table-wise
    config = EmbeddingConfig.create(
        [
            TableConfig(name="a", vocab_size=512, dim=8),
            TableConfig(name="b", vocab_size=256, dim=4),
        ],
        [FeatureConfig(name="fa", table="a"), FeatureConfig(name="fb", table="b")],
    )
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=4),
        batch_size=4,
        tables=(
            TablePlan(
                name="a", cluster="rb", row_shards=2, column_shards=2, devices=((0, 1), (2, 3))
            ),
            TablePlan(name="b", cluster="rb", row_shards=1, column_shards=1, devices=((3,),)),
        ),
    )
    lowered = lower(plan, config, None)
    mesh = plan.make_mesh()
    bufs = {
        g.name: np.asarray(lowered.init_buffer(g, jax.random.key(0), lowered.sharding(mesh)))
        for g in lowered.groups
    }
    tables = lowered.unstack(bufs)
    a, b = tables["a"], tables["b"]
    # the shards of "a": row shard j holds the ids with id % 2 == j, slice k columns 4k..4k+3
    shards = [a[j::2, 4 * k : 4 * (k + 1)] for k in range(2) for j in range(2)]
    for s, bound in [*((s, 1 / np.sqrt(8)) for s in shards), (b, 1 / np.sqrt(4))]:
        assert np.abs(s).max() <= bound + 1e-6  # the table's dim sets the range, not the slice's
        assert s.std() > 0.9 * bound / np.sqrt(3) and np.abs(s).max() > 0.9 * bound
    for i in range(len(shards)):
        for j in range(i + 1, len(shards)):
            assert not np.allclose(shards[i], shards[j]), (i, j)  # no key reused across shards
    # nor across tables: the same key would give the same uniforms, so compare them unscaled
    assert shards[0].shape == b.shape and not np.allclose(shards[0] * np.sqrt(8), b * 2)
