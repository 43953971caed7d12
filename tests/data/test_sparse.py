import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import EmbeddingConfig, FeatureConfig, SparseFeatures, TableConfig

CFG = EmbeddingConfig.create(
    [TableConfig(name="t", vocab_size=100, dim=4), TableConfig(name="u", vocab_size=7, dim=2)],
    [
        FeatureConfig(name="a", table="t", max_hotness=3),
        FeatureConfig(name="b", table="u", max_hotness=2, weighted=True),
    ],
)


def test_from_dense_packs_left_and_pads_to_max_hotness():
    ids = {"a": np.array([[5, -1, 7], [-1, -1, -1]]), "b": np.array([[1], [6]])}
    w = {"b": np.array([[0.5], [2.0]])}
    sf = SparseFeatures.from_dense(ids, w, config=CFG)
    np.testing.assert_array_equal(sf.ids["a"], [[5, 7, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(sf.lengths["a"], [2, 0])
    np.testing.assert_array_equal(sf.ids["b"], [[1, -1], [6, -1]])
    np.testing.assert_allclose(sf.weights["b"], [[0.5, 0.0], [2.0, 0.0]])
    assert sf.ids["a"].dtype == np.int32 and sf.batch_size == 2


def test_custom_pad_value():
    sf = SparseFeatures.from_dense({"a": np.array([[0, 9, 0]])}, pad=0)
    np.testing.assert_array_equal(sf.ids["a"], [[9, -1, -1]])
    np.testing.assert_array_equal(sf.lengths["a"], [1])


def test_ragged_round_trip():
    rows = {"a": [[1, 2, 3], [], [99]], "b": [[0, 6], [3], []]}
    weights = {"b": [[1.0, 2.0], [0.5], []]}
    sf = SparseFeatures.from_ragged(rows, weights, config=CFG)
    back_ids, back_w = sf.to_ragged()
    for name, r in rows.items():
        assert [list(x) for x in back_ids[name]] == r
    assert [list(x) for x in back_w["b"]] == weights["b"]
    # dense -> ragged -> dense is the identity too
    sf2 = SparseFeatures.from_ragged(back_ids, back_w, config=CFG)
    for name in rows:
        np.testing.assert_array_equal(sf.ids[name], sf2.ids[name])


def test_is_a_pytree_and_jit_consumes_it():
    sf = SparseFeatures.from_ragged({"a": [[1], [2, 3]]})
    leaves = jax.tree_util.tree_leaves(sf)
    assert len(leaves) == 2
    total = jax.jit(lambda s: jnp.sum(jnp.where(s.ids["a"] >= 0, s.ids["a"], 0)))(sf)
    assert int(total) == 6
    ids, seg, w = sf.flat("a")
    np.testing.assert_array_equal(seg, [0, 0, 1, 1])
    assert w is None and ids.shape == (4,)


@pytest.mark.parametrize(
    ("ids", "weights", "message"),
    [
        (
            {"a": np.array([[1, 100]]), "b": np.array([[1]])},
            None,
            r"feature 'a': id 100 at position \(0, 1\) is out of range for table 't' \(vocab_size 100\)",
        ),
        (
            {"a": np.array([[1, -5]]), "b": np.array([[1]])},
            None,
            r"feature 'a': negative id -5 at position \(0, 1\)",
        ),
        (
            {"a": np.array([[1.0]]), "b": np.array([[1]])},
            None,
            "feature 'a': ids must be an integer array, got dtype float64",
        ),
        (
            {"a": np.array([[1, 2, 3, 4]]), "b": np.array([[1]])},
            None,
            "feature 'a': sample 0 has 4 ids, above max_hotness 3",
        ),
        (
            {"a": np.array([[1]]), "b": np.array([[1]])},
            {"b": np.array([[np.nan]])},
            r"feature 'b': weight nan at position \(0, 0\) is not finite",
        ),
        (
            {"a": np.array([[1]]), "b": np.array([[1]])},
            {"b": np.array([[1.0, 2.0]])},
            r"feature 'b': weights shape \(1, 2\) != ids shape \(1, 1\)",
        ),
        (
            {"a": np.array([[1]]), "b": np.array([[1]])},
            {"a": np.array([[1.0]])},
            "feature 'a': weights given but the feature is not configured weighted=True",
        ),
        (
            {"a": np.array([[1], [2]]), "b": np.array([[1]])},
            None,
            "feature 'b': batch size 1 differs from other features' 2",
        ),
        ({"a": np.array([[1]])}, None, r"missing ids for configured features \['b'\]"),
        (
            {"a": np.array([[1]]), "b": np.array([[1]]), "c": np.array([[1]])},
            None,
            r"unknown features \['c'\]",
        ),
        (
            {"a": np.array([1, 2]), "b": np.array([[1]])},
            None,
            r"feature 'a': dense ids must be \[B, H\], got shape \(2,\)",
        ),
        (
            {"a": [[1, 2], [3]], "b": [[1], [2]]},
            None,
            r"^feature 'a': ids are not a rectangular \[B, H\] array \(sample 1 has 1 ids, "
            r"sample 0 2 ids\); SparseFeatures.from_ragged takes rows of different lengths$",
        ),
        (
            {"a": [[1], [2]], "b": [[1], [2]]},
            {"b": [[1.0], [1.0, 2.0]]},
            r"^feature 'b': weights are not a rectangular \[B, H\] array \(sample 1 has 2 "
            r"weights, sample 0 1 weights\)",
        ),
    ],
)
def test_from_dense_errors(ids, weights, message):
    with pytest.raises(ValueError, match=message):
        SparseFeatures.from_dense(ids, weights, config=CFG)


@pytest.mark.parametrize(
    ("values", "lengths", "message"),
    [
        (
            {"a": np.array([1, 2, 3])},
            {"a": np.array([1, 1])},
            "feature 'a': lengths sum to 2 but 3 values were given",
        ),
        (
            {"a": np.array([1, 2])},
            {"a": np.array([3, -1])},
            "feature 'a': negative length -1 at sample 1",
        ),
        (
            {"a": np.array([1, 2])},
            {"a": np.array([1.0, 1.0])},
            "feature 'a': lengths must be a 1-D integer array",
        ),
        (
            {"a": np.array([1, -2])},
            {"a": np.array([1, 1])},
            "feature 'a': negative id -2 at sample 1, position 0",
        ),
    ],
)
def test_from_lengths_errors(values, lengths, message):
    with pytest.raises(ValueError, match=message):
        SparseFeatures.from_lengths(values, lengths)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_unsigned_lengths_are_taken(dtype):
    """Unsigned lengths of every width give the int32 result, not an IndexError or a casting
    TypeError deep in numpy."""
    vals = np.array([1, 2, 3])
    got = SparseFeatures.from_lengths({"f": vals}, {"f": np.array([2, 1], dtype)})
    want = SparseFeatures.from_lengths({"f": vals}, {"f": np.array([2, 1], np.int32)})
    np.testing.assert_array_equal(got.ids["f"], want.ids["f"])
    np.testing.assert_array_equal(got.lengths["f"], want.lengths["f"])


def test_an_unsigned_length_too_large_is_refused_not_wrapped():
    """A uint64 sum wraps: [2**64 - 1, 2] summed to 1 and matched one value."""
    with pytest.raises(ValueError, match="feature 'f': length 18446744073709551615 is too large"):
        SparseFeatures.from_lengths(
            {"f": np.array([7])}, {"f": np.array([2**64 - 1, 2], np.uint64)}
        )


def test_ragged_rows_are_checked_one_by_one():
    """Rows of mixed types were merged first: bool with int rows became ids, uint64 with
    int64 rows became float64 (refused as floats)."""
    with pytest.raises(
        ValueError, match="feature 'f': ids must be an integer array, got dtype bool"
    ):
        SparseFeatures.from_ragged({"f": [np.array([True, False]), np.array([3])]})
    with pytest.raises(ValueError, match="feature 'f': id 9223372036854775808 does not fit"):
        SparseFeatures.from_ragged({"f": [[2**63], [3]]})
    mixed = SparseFeatures.from_ragged({"f": [np.array([1], np.uint64), np.array([3]), []]})
    np.testing.assert_array_equal(mixed.ids["f"], [[1], [3], [-1]])


def test_ragged_weight_length_mismatch():
    with pytest.raises(
        ValueError, match=r"feature 'b': weights lengths \[1\] do not match ids lengths \[2\]"
    ):
        SparseFeatures.from_ragged({"b": [[1, 2]]}, {"b": [[1.0]]})


def test_int64_ids_above_int32_need_x64():
    ids = {"a": np.array([[2**31 + 5]], dtype=np.int64)}
    with pytest.raises(
        ValueError, match=r"feature 'a': id 2147483653 at position \(0, 0\) needs 64-bit ids"
    ):
        SparseFeatures.from_dense(ids)
    small = SparseFeatures.from_dense({"a": np.array([[7]], dtype=np.int64)})
    assert small.ids["a"].dtype == np.int32 and int(small.ids["a"][0, 0]) == 7


def test_int64_ids_kept_with_x64():
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
        sf = SparseFeatures.from_dense({"a": np.array([[2**40]], dtype=np.int64)})
        assert sf.ids["a"].dtype == np.int64 and int(sf.ids["a"][0, 0]) == 2**40


def test_validate_catches_inconsistent_lengths():
    sf = SparseFeatures.from_dense(
        {"a": np.array([[1, 2, -1]]), "b": np.array([[1, -1]])}, config=CFG
    )
    bad = SparseFeatures(
        ids=sf.ids, lengths={"a": np.array([3], np.int32), "b": sf.lengths["b"]}, weights=sf.weights
    )
    with pytest.raises(
        ValueError, match="feature 'a': length 3 at sample 0 disagrees with its 2 valid ids"
    ):
        bad.validate(CFG)
    sf.validate(CFG)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ({"b": None}, "feature 'a': lengths missing"),
        ({"a": np.array([2, 0], np.int32)}, r"feature 'a': lengths shape \(2,\) != \(1,\)"),
        ({"a": np.array([[2]], np.int32)}, r"feature 'a': lengths shape \(1, 1\) != \(1,\)"),
        ({"a": np.array([2.0])}, "feature 'a': lengths must be integers, got dtype float64"),
        ({"a": np.array([True])}, "feature 'a': lengths must be integers, got dtype bool"),
    ],
)
def test_validate_rejects_missing_misshapen_or_float_lengths(lengths, message):
    sf = SparseFeatures.from_dense(
        {"a": np.array([[1, 2, -1]]), "b": np.array([[1, -1]])}, config=CFG
    )
    new = {"a": sf.lengths["a"], "b": sf.lengths["b"]}
    for k, v in lengths.items():
        if v is None:
            new.pop("a")
        else:
            new[k] = v
    bad = SparseFeatures(ids=sf.ids, lengths=new, weights=sf.weights)
    with pytest.raises(ValueError, match=message):
        bad.validate(CFG)


def test_mean_bag_with_a_non_positive_weight_sum_is_refused():
    import pytest

    from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig

    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=10, dim=4)],
        [FeatureConfig(name="f", table="t", max_hotness=2, combiner="mean", weighted=True)],
    )
    ids = np.array([[1, 2], [3, -1]])
    ok = SparseFeatures.from_dense(
        {"f": ids}, {"f": np.array([[2.0, -1.0], [0.5, 9.0]])}, config=config
    )
    assert ok.batch_size == 2
    with pytest.raises(ValueError, match=r"feature 'f': sample 1's weights sum to -0.5"):
        SparseFeatures.from_dense(
            {"f": ids}, {"f": np.array([[1.0, 1.0], [-0.5, 9.0]])}, config=config
        )


@pytest.mark.parametrize(
    ("combiner", "weights", "message"),
    [
        ("mean", [[1e-45, 0.0]], r"sample 0's weights sum to 1\.401298e-45; a mean combiner"),
        ("mean", [[2.0, 2.0], [1e-30, 0.0]], r"sample 1's weights sum to 1e-30"),
        ("sqrtn", [[1e-19, 0.0]], r"sample 0's weights' root sum of squares is 1e-19; a sqrtn"),
    ],
)
def test_a_bag_float32_would_pool_to_zeros_is_refused(combiner, weights, message):
    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=10, dim=4)],
        [FeatureConfig(name="f", table="t", max_hotness=2, combiner=combiner, weighted=True)],
    )
    ids = np.array([[1, 2]] * len(weights))
    with pytest.raises(ValueError, match=r"^feature 'f': " + message):
        SparseFeatures.from_dense({"f": ids}, {"f": np.array(weights, np.float32)}, config=config)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_the_smallest_bag_weights_accepted_pool_to_the_row(combiner):
    from embark_jax import ops
    from embark_jax.data.sparse import MIN_POOL_DENOMINATOR

    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=10, dim=4)],
        [FeatureConfig(name="f", table="t", max_hotness=2, combiner=combiner, weighted=True)],
    )
    w = np.array([[MIN_POOL_DENOMINATOR, 0.0]], np.float32)
    sf = SparseFeatures.from_dense({"f": np.array([[3, 4]])}, {"f": w}, config=config)
    table = jnp.asarray(np.full((10, 4), 0.01, np.float32))
    ids, seg, weights = sf.flat("f")
    out = ops.lookup_pool(table, ids, seg, 1, weights=weights, combiner=combiner)
    np.testing.assert_allclose(np.asarray(out), np.full((1, 4), 0.01), rtol=1e-6)


# --- a hand-built batch of host int64 ids passed into the caller's own jit -----------------

WRAPPING = [2**32 + 5, -(2**32) + 3, 2**33]  # would read rows 5, 3 and 0 once wrapped


@pytest.mark.parametrize("cluster", ["dp", "rb", "ub"])
def test_ids_that_would_wrap_at_the_callers_jit_are_refused(cluster):
    from flax import nnx

    from embark_jax.sharding.collection import EmbeddingCollection, lookup_fn
    from tests.sharding.test_bounds import _config, _full_batch, _plan

    config, plan = _config(cluster), _plan(cluster)
    coll = EmbeddingCollection(config, plan, plan.make_mesh(), rngs=nnx.Rngs(0))

    @jax.jit
    def looked_up(batch):
        return lookup_fn(coll.lowered, coll.mesh, coll.options, coll.buffer_values(), batch)[0]

    for bad in WRAPPING:
        host = _full_batch(config, np.int64)
        host.ids["fa"][3, 1] = bad
        message = rf"^feature 'fa': id {bad} at position \(3, 1\) is outside int32 and JAX's"
        with pytest.raises(ValueError, match=message):
            looked_up(host)
        with pytest.raises(ValueError, match=message):
            nnx.jit(lambda m, b: m.lookup(b).outputs)(coll, host)
    # int64 ids that fit are taken by value, as int32 ids are (the same compiled lookup)
    wide, narrow = (
        looked_up(_full_batch(config, np.int64)),
        looked_up(_full_batch(config, np.int32)),
    )
    for name, out in wide.items():
        np.testing.assert_array_equal(np.asarray(out), np.asarray(narrow[name]))


def test_ids_that_would_wrap_are_refused_by_a_jitted_train_step():
    import functools

    import embark_jax as ej
    from embark_jax.data.batch import Batch
    from embark_jax.ops import optimizers as O
    from embark_jax.training.models import DenseConfig
    from embark_jax.training.state import create
    from tests.sharding.test_bounds import _config, _full_batch, _plan

    config, plan = _config("rb"), _plan("rb")
    dense = DenseConfig(kind="dcnv2", bottom=(4,), top=(4, 1), cross_layers=1, cross_rank=2)
    setup, state = create(config, plan, dense=dense, sparse_optimizer=O.SGD(learning_rate=0.1))
    step = jax.jit(functools.partial(ej.train_step, setup))
    sparse = _full_batch(config, np.int64)
    sparse.ids["fn"][0, 0] = -(2**32) + 3
    sparse.lengths["fn"][2] = 2**32 + 1  # a length too
    batch = Batch(sparse, np.zeros((16, 13), np.float32), np.zeros(16, np.float32))
    with pytest.raises(ValueError, match=r"^feature 'fn': id -4294967293 at position \(0, 0\)"):
        step(state, batch)
    sparse.ids["fn"][0, 0] = 1
    with pytest.raises(ValueError, match=r"^feature 'fn': length 4294967297 at position \(2,\)"):
        step(state, batch)
    sparse.lengths["fn"][2] = 2
    new, metrics = step(state, batch)  # in range: trains
    assert int(new.step) == 1 and [int(x) for x in metrics["invalid"]] == [0, 0]


def test_abstract_batch_has_every_feature_at_max_hotness_and_refuses_a_bad_size():
    sf = SparseFeatures.abstract(CFG, 8)
    assert {k: v.shape for k, v in sf.ids.items()} == {"a": (8, 3), "b": (8, 2)}
    assert {k: v.shape for k, v in sf.lengths.items()} == {"a": (8,), "b": (8,)}
    assert list(sf.weights) == ["b"] and sf.weights["b"].dtype == np.float32
    for bad in (0, -1, 2.5, True, "8", None):
        with pytest.raises(ValueError, match=r"SparseFeatures\.abstract: batch_size") as e:
            SparseFeatures.abstract(CFG, bad)
        assert "\n" not in str(e.value)
