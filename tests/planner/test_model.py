"""Planner model specs (`planner.model`): optimizer slot footprints, configs, presets and their names."""

import pytest

from embark_jax.core.specs import Combiner, EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.planner import (
    ModelSpec,
    canonical_preset,
    load_preset,
    preset_aliases,
    preset_names,
)
from embark_jax.planner import cost as C


def test_slot_footprint_replaces_the_optimizer():
    assert load_preset("dcnv2").slot_footprint == (1, 0)  # the paper's DCNv2: Adagrad
    assert load_preset("t180").slot_footprint == (0, 0)  # SGD
    with pytest.raises(TypeError, match="slot_footprint"):
        ModelSpec(name="x", tables=(), slot_footprint=object())
    # slots per element scale with the width, slots per row do not
    assert C.table_memory(10, 8, 4, (0, 1)) == 10 * (8 * 4 + 4)  # row-wise Adagrad
    assert C.table_memory(10, 8, 4, (2, 0)) == 10 * (8 * 4 + 2 * 8 * 4)  # Adam
    assert C.update_bytes(10, 8, 4, (0, 0)) == 10 * 2 * 8 * 4  # SGD: the rows only


def test_from_config_without_jax():
    cfg = EmbeddingConfig.create(
        [
            TableConfig(name="a", vocab_size=100, dim=8, dtype="bfloat16"),
            TableConfig(name="b", vocab_size=50, dim=4),
        ],
        [
            FeatureConfig(name="f1", table="a", max_hotness=3),
            FeatureConfig(name="f2", table="a", max_hotness=2),
            FeatureConfig(name="f3", table="b", combiner=Combiner.NONE),
        ],
    )
    spec = ModelSpec.from_config(cfg)
    assert spec.slot_footprint == (1, 0)  # Adagrad by default
    a, b = spec.table("a"), spec.table("b")
    assert (a.hotness, a.dtype_bytes, a.combiner) == (5.0, 2, Combiner.SUM)
    assert (b.hotness, b.dtype_bytes, b.combiner) == (1.0, 4, Combiner.NONE)
    assert ModelSpec.from_config(cfg, slot_footprint=(2, 0)).slot_footprint == (2, 0)


@pytest.mark.parametrize(
    "alias,name",
    [
        ("dcnv2", "dcnv2"),
        ("dlrm_dcnv2", "dcnv2"),
        ("dlrm-dcnv2", "dcnv2"),
        ("DLRM-DCNv2", "dcnv2"),
        ("DLRM_DCNV2-Mini", "dcnv2-mini"),
        ("dlrm-dcnv2-mini", "dcnv2-mini"),
        ("T180", "t180"),
        ("t510_mini", "t510-mini"),
        (" t7 ", "t7"),
    ],
)
def test_model_names_and_aliases(alias, name):
    assert canonical_preset(alias) == name
    spec = load_preset(alias)
    assert spec.name == name and spec == load_preset(name)


def test_preset_listing_and_unknown_names():
    names = preset_names()
    assert names == [
        "dcnv2", "dcnv2-mini", "t180", "t180-mini", "t200", "t200-mini",
        "t510", "t510-mini", "t7", "t7-mini",
    ]  # fmt: skip
    aliases = preset_aliases()
    assert aliases["dlrm_dcnv2"] == aliases["dlrm-dcnv2"] == "dcnv2"
    assert aliases["dlrm-dcnv2-mini"] == "dcnv2-mini"
    assert all(v in names for v in aliases.values())
    assert all(canonical_preset(a) == v for a, v in aliases.items())
    for bad in ("dcnv3", "t181", "mini", "dcnv2-mini-mini", ""):
        with pytest.raises(ValueError, match="unknown model") as e:
            load_preset(bad)
        assert "dcnv2, dcnv2-mini, t180" in str(e.value) and "dlrm-dcnv2" in str(e.value)


def test_presets_load_and_minis_keep_the_shape():
    assert {"dcnv2", "t180", "t200", "t510", "t7", "t180-mini"} <= set(preset_names())
    full, mini = load_preset("t200"), load_preset("t200-mini")
    assert len(full.tables) == len(mini.tables) == 200
    for a, b in zip(full.tables, mini.tables, strict=True):
        assert (a.dim, a.hotness) == (b.dim, b.hotness) and b.vocab_size <= a.vocab_size
    assert max(t.vocab_size for t in mini.tables) <= 20_000
    assert full.dense_flops_per_sample > 0 and full.dense_params > 0
