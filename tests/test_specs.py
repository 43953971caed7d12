import dataclasses

import jax
import jax.numpy as jnp
import pytest

from embark_jax import Combiner, EmbeddingConfig, FeatureConfig, TableConfig


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
