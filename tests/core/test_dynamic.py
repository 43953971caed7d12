"""`embark_jax.core.dynamic`: the dynamic table config, its checks, and the host-side id words."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from embark_jax.core.dynamic import (
    DynamicConfig,
    DynamicFeatureConfig,
    DynamicTableConfig,
    Eviction,
    key_words,
    shard_of,
)


def cfg(**kw) -> DynamicTableConfig:
    base = dict(name="t", dim=4, capacity=16, bucket_size=4)
    return DynamicTableConfig(**{**base, **kw})


# --- the config --------------------------------------------------------------------------


def test_config_defaults_and_derived_fields():
    c = DynamicTableConfig(name="items", dim=64, capacity=1024)
    assert (c.bucket_size, c.num_buckets, c.eviction) == (32, 32, Eviction.LRU)
    assert (c.admission_threshold, c.admission_candidates, c.ttl_steps, c.ttl) == (1, 0, None, 0)
    assert c.scale == pytest.approx(1 / 8) and c.dtype == np.float32
    c = DynamicTableConfig(
        name="t", dim=4, capacity=64, bucket_size=8, eviction="LFU", admission_threshold=3
    )
    assert c.eviction is Eviction.LFU and c.admission_candidates == 8
    assert (
        DynamicTableConfig(name="t", dim=4, capacity=32, dtype="bfloat16").dtype.name == "bfloat16"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dim = 8


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(name=""), "dynamic table name must be a non-empty string, got ''"),
        (dict(dim=0), "dim must be >= 1, got 0"),
        (dict(dim=4.0), "dim must be an int, got 4.0"),
        (dict(capacity=True), "capacity must be an int, got True"),
        (dict(capacity=18), "capacity must be a multiple of bucket_size 4, got 18"),
        (dict(bucket_size=2048, capacity=4096), "bucket_size must be <= 1024, got 2048"),
        (dict(dtype="float16"), "dtype must be float32 or bfloat16, got 'float16'"),
        (dict(eviction="fifo"), "eviction: unknown eviction 'fifo'; expected one of"),
        (dict(admission_threshold=0), "admission_threshold must be an int >= 1, got 0"),
        (dict(admission_candidates=2), "admission_candidates must be 0 when admission_thr"),
        (
            dict(admission_threshold=2, admission_candidates=0),
            "admission_candidates must be >= 1 when admission_threshold is 2, got 0",
        ),
        (dict(ttl_steps=0), "ttl_steps must be None or an int in [1, 2**31), got 0"),
        (dict(initializer="normal"), "initializer must be one of uniform, zeros, got 'normal'"),
        (dict(init_scale=float("nan")), "init_scale must be finite and >= 0, got nan"),
        (dict(seed=-1), "seed must be an int in [0, 2**32), got -1"),
    ],
)
def test_config_errors_name_the_field_and_value(kw, message):
    with pytest.raises(ValueError) as e:
        cfg(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)
    if kw.get("name") != "":
        assert str(e.value).startswith("dynamic table 't': ")


def test_core_module_loads_no_jax():
    code = "import sys, embark_jax.core.dynamic; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dynamic_config_checks_replicated_names():
    tables = (cfg(name="a"), cfg(name="b"))
    feats = (DynamicFeatureConfig(name="f", table="a"), DynamicFeatureConfig(name="g", table="b"))
    c = DynamicConfig(tables, feats, replicated=("b", "b"))
    assert c.replicated == ("b",) and c.is_replicated("b") and not c.is_replicated("a")
    assert [f.name for f in c.features_of("a")] == ["f"]
    with pytest.raises(ValueError, match=r"dynamic replicated tables \['z'\] are not dynamic"):
        DynamicConfig(tables, feats, replicated=("z",))
    with pytest.raises(ValueError, match="combiner must be sum, mean or sqrtn, got 'none'"):
        DynamicFeatureConfig(name="f", table="a", combiner="none")


def test_key_words_refuse_floats_and_2d_ints_in_one_line():
    assert key_words(np.array([], np.int64)).shape == (0, 2)
    with pytest.raises(ValueError, match=r"got float64 of shape \(1,\)$"):
        key_words(np.array([1.5]))
    with pytest.raises(ValueError, match=r"got int64 of shape \(2, 3\)$"):
        key_words(np.zeros((2, 3), np.int64))


def test_shard_of_is_in_range_and_deterministic():
    words = key_words(np.arange(64))
    s = shard_of(words, 3)
    assert s.dtype == np.int32 and set(s.tolist()) == {0, 1, 2}
    np.testing.assert_array_equal(s, shard_of(words.copy(), 3))
    assert not shard_of(words, 1).any()
