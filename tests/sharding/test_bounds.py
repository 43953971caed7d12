"""The on-device bounds check (docs/design.md §6): a batch built without a
config may hold ids outside their table. In every cluster they must be dropped like
padding, counted per table, raise under the error policy, and never read or update the
rows of a table stacked beside theirs in the same buffer."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.ops import optimizers as O
from embark_jax.sharding.collection import EmbeddingCollection, InvalidIdError, lookup_fn
from tests import collection_ref

G, B = 8, 16
VOCAB_A, VOCAB_N = 10, 40


def _config(cluster):
    features = [
        FeatureConfig(name="fa", table="a", max_hotness=3, combiner="sum"),
        FeatureConfig(name="fa_mean", table="a", max_hotness=4, combiner="mean"),
        FeatureConfig(name="fn", table="n", max_hotness=2, combiner="sum"),
    ]
    if cluster != "rb":  # `none` features may not use RB tables
        features.append(FeatureConfig(name="fa_seq", table="a", max_hotness=2, combiner="none"))
    tables = [
        TableConfig(name="a", vocab_size=VOCAB_A, dim=8),
        TableConfig(name="n", vocab_size=VOCAB_N, dim=8),  # stacked right after "a"
    ]
    return EmbeddingConfig.create(tables, features)


def _plan(cluster):
    if cluster == "dp":
        every = (tuple(range(G)),)
        shards = {"row_shards": 1, "column_shards": 1, "devices": every}
        both = [TablePlan(name=t, cluster="dp", **shards) for t in ("a", "n")]
    else:  # both tables row-split over the same two devices: "n" follows "a" in the buffer
        both = [
            TablePlan(name=t, cluster=cluster, row_shards=2, column_shards=1, devices=((0, 1),))
            for t in ("a", "n")
        ]
    return Plan(topology=Topology(num_nodes=1, devices_per_node=G), batch_size=B, tables=both)


def _batches(config, seed):
    """(raw batch with ids out of range, the same batch with them replaced by padding,
    invalid count per table)."""
    rng = np.random.default_rng(seed)
    raw, clean = {}, {}
    for f in config.features:
        if f.table == "n":  # the neighbour is not looked up: its rows must not move
            x = np.full((B, f.max_hotness), -1, np.int32)
        else:
            x = rng.integers(0, VOCAB_A, size=(B, f.max_hotness)).astype(np.int32)
            x[rng.random(x.shape) < 0.3] = VOCAB_A + rng.integers(0, 25)  # rows of "n"
            x[rng.random(x.shape) < 0.1] = -5
            x[rng.random(x.shape) < 0.1] = -1
            x[0::3, 0] = VOCAB_A  # the first id past the table: row 0 of the neighbour
            x[1::3, 0] = VOCAB_A - 1  # the table's last row: valid
            x[2::3, 0] = -2  # the first negative id below padding
        raw[f.name] = x
        clean[f.name] = np.where((x < -1) | (x >= VOCAB_A), -1, x)
    invalid = {"a": int(sum(((raw[n] < -1) | (raw[n] >= VOCAB_A)).sum() for n in raw)), "n": 0}

    def features(ids):
        lengths = {n: (v >= 0).sum(axis=1).astype(np.int32) for n, v in ids.items()}
        return SparseFeatures(ids, lengths)  # the plain constructor: no host checks

    return features(raw), features(clean), invalid


@pytest.mark.parametrize("cluster", ["dp", "rb", "ub"])
def test_ids_out_of_range_are_dropped_counted_and_never_touch_a_neighbour(cluster):
    config, plan = _config(cluster), _plan(cluster)
    coll = EmbeddingCollection(
        config, plan, plan.make_mesh(), rngs=nnx.Rngs(0), optimizer=O.SGD(learning_rate=0.5)
    )
    assert len(coll.lowered.groups) == 1  # "a" and "n" share one stacked buffer
    raw, clean, invalid = _batches(config, 0)
    assert invalid["a"] > 0
    before = coll.full_tables()
    res = coll.lookup(coll.shard_batch(raw))
    assert {k: int(v) for k, v in res.invalid.items()} == invalid
    assert all(int(v) == 0 for v in res.overflow.values())
    want = collection_ref.forward(config, before, clean)
    for name, w in want.items():
        np.testing.assert_allclose(
            np.asarray(res.outputs[name]), w, rtol=1e-5, atol=1e-5, err_msg=name
        )
    rng = np.random.default_rng(1)
    grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in res.outputs.items()}
    coll.apply_gradients(res, grads, raw)
    after = coll.full_tables()
    np.testing.assert_array_equal(after["n"], before["n"])  # bit-identical neighbour
    want_t, _ = collection_ref.update(config, before, clean, grads, O.SGD(learning_rate=0.5))
    np.testing.assert_allclose(after["a"], want_t["a"], rtol=1e-5, atol=1e-5)
    assert not np.array_equal(after["a"], before["a"])


@pytest.mark.parametrize("cluster", ["dp", "rb", "ub"])
def test_error_policy_raises_on_ids_out_of_range(cluster):
    config, plan = _config(cluster), _plan(cluster)
    coll = EmbeddingCollection(
        config, plan, plan.make_mesh(), rngs=nnx.Rngs(0), options=RuntimeOptions(overflow="error")
    )
    raw, clean, _ = _batches(config, 2)
    with pytest.raises(InvalidIdError, match=r"\{'a': \d+\}"):
        coll.lookup(coll.shard_batch(raw))
    res = coll.lookup(coll.shard_batch(clean))  # the same batch without them passes
    assert all(int(v) == 0 for v in res.invalid.values())


def test_lookup_fn_returns_the_invalid_counts_on_request():
    config, plan = _config("ub"), _plan("ub")
    coll = EmbeddingCollection(config, plan, plan.make_mesh(), rngs=nnx.Rngs(0))
    raw, _, invalid = _batches(config, 3)
    batch = coll.shard_batch(raw)
    args = (coll.lowered, coll.mesh, coll.options, coll.buffer_values(), batch)
    outputs, _, overflow = lookup_fn(*args)  # the three-part form
    out = jax.jit(lambda b: lookup_fn(*args[:3], b, batch, with_invalid=True))(args[3])
    assert out.invalid.shape == (2,) and out.invalid.dtype == jnp.int32
    assert [int(x) for x in out.invalid] == [invalid["a"], invalid["n"]]  # plan order
    np.testing.assert_array_equal(np.asarray(out.overflow), np.asarray(overflow))
    for name in outputs:
        np.testing.assert_array_equal(np.asarray(out.outputs[name]), np.asarray(outputs[name]))


def _full_batch(config, dtype, seed=4):
    """Every slot a valid id (unsigned types cannot hold the -1 padding), ids and lengths of
    `dtype`, through the plain constructor (no host checks)."""
    rng = np.random.default_rng(seed)
    vocab = {"a": VOCAB_A, "n": VOCAB_N}
    ids = {
        f.name: rng.integers(0, vocab[f.table], (B, f.max_hotness)).astype(dtype)
        for f in config.features
    }
    lengths = {n: np.full(B, v.shape[1], dtype) for n, v in ids.items()}
    return SparseFeatures(ids, lengths)


# host (numpy) ids of every integer type: narrow ones are widened on the device, wide and
# unsigned ones converted by value on the host (`bounds.host_batch`)
@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.uint8, np.uint16, np.uint32, np.uint64, np.int64]
)
def test_a_hand_built_batch_of_other_integer_ids_runs_as_its_int32_twin(dtype):
    config, plan = _config("ub"), _plan("ub")
    colls = [
        EmbeddingCollection(
            config, plan, plan.make_mesh(), rngs=nnx.Rngs(0), optimizer=O.SGD(learning_rate=0.5)
        )
        for _ in range(2)
    ]
    other, wide = _full_batch(config, dtype), _full_batch(config, np.int32)
    results = [c.lookup(c.shard_batch(b)) for c, b in zip(colls, (other, wide), strict=True)]
    for name, out in results[1].outputs.items():
        np.testing.assert_array_equal(np.asarray(results[0].outputs[name]), np.asarray(out))
    assert all(int(v) == 0 for r in results for v in r.invalid.values())
    grads = {k: jnp.ones_like(v) for k, v in results[1].outputs.items()}
    for c, r, b in zip(colls, results, (other, wide), strict=True):
        c.apply_gradients(r, grads, b)
    for name, t in colls[1].full_tables().items():
        np.testing.assert_array_equal(colls[0].full_tables()[name], t)


def test_ids_that_would_wrap_are_refused_by_feature_before_any_device_sees_them():
    """A host int64 id of 2**32 + 5 with 64-bit types off would wrap to row 5 in JAX, which
    the device check takes for a valid id (row 5 read and updated, nothing counted): the
    host refuses it, naming the feature."""
    config, plan = _config("ub"), _plan("ub")
    coll = EmbeddingCollection(
        config, plan, plan.make_mesh(), rngs=nnx.Rngs(0), optimizer=O.SGD(learning_rate=0.5)
    )
    host = _full_batch(config, np.int64)
    host.ids["fa"][3, 1] = 2**32 + 5
    for call in (coll.shard_batch, coll.lookup):
        with pytest.raises(ValueError, match=r"^feature 'fa': ids: id 4294967301 is outside int32"):
            call(host)
    res = coll.lookup(coll.shard_batch(_full_batch(config, np.int64)))
    grads = {k: jnp.ones_like(v) for k, v in res.outputs.items()}
    with pytest.raises(ValueError, match=r"^feature 'fa': ids: id 4294967301"):
        coll.apply_gradients(res, grads, host)
    on_device = _full_batch(config, np.uint32)
    on_device.ids["fa"] = jnp.asarray(on_device.ids["fa"])  # a uint32 device array
    with pytest.raises(ValueError, match=r"^feature 'fa': ids: uint32 ids would wrap"):
        coll.lookup(on_device)


def test_a_hand_built_batch_out_of_layout_gets_one_line_naming_the_feature():
    config, plan = _config("ub"), _plan("ub")
    coll = EmbeddingCollection(config, plan, plan.make_mesh(), rngs=nnx.Rngs(0))

    def broken(**change):
        good = _full_batch(config, np.int32)
        ids, lengths = dict(good.ids), dict(good.lengths)
        for key, value in change.items():
            kind, name = key.split("__")
            {"ids": ids, "lengths": lengths}[kind][name] = value
        return SparseFeatures(ids, {k: v for k, v in lengths.items() if v is not None})

    cases = {
        r"feature 'fa': ids must be \[B, H\], got shape \(16,\)": broken(
            ids__fa=np.zeros(B, np.int32)
        ),
        r"feature 'fa': lengths missing": broken(lengths__fa=None),
        r"feature 'fa': lengths shape \(17,\) != \(16,\)": broken(
            lengths__fa=np.zeros(B + 1, np.int32)
        ),
        r"feature 'fa': lengths must be integers, got dtype bool": broken(
            lengths__fa=np.ones(B, bool)
        ),
        r"batch size 12 is not divisible by the 8 devices": SparseFeatures(
            {n: np.asarray(v)[:12] for n, v in _full_batch(config, np.int32).ids.items()},
            {n: np.asarray(v)[:12] for n, v in _full_batch(config, np.int32).lengths.items()},
        ),
    }
    for message, batch in cases.items():
        for call in (coll.shard_batch, coll.lookup):
            with pytest.raises(ValueError, match=message):
                call(batch)
    weighted = _full_batch(config, np.int32)
    weighted.weights["fa"] = np.ones((B, 2), np.float32)
    with pytest.raises(
        ValueError, match=r"feature 'fa': weights shape \(16, 2\) != the ids' \(16, 3\)"
    ):
        weighted.check_layout()  # no config: "fa" is not weighted in this one


def test_with_64_bit_types_uint32_ids_are_widened_and_nothing_is_cast_unsafely():
    """Under `jax_enable_x64` a lookup raises no warning: the invalid count is not scattered
    from int64 into int32 (a FutureWarning, to become an error)."""
    x64 = jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64()
    with x64, warnings.catch_warnings():
        warnings.simplefilter("error")
        config, plan = _config("ub"), _plan("ub")
        coll = EmbeddingCollection(config, plan, plan.make_mesh(), rngs=nnx.Rngs(0))
        on_device = _full_batch(config, np.uint32)
        on_device = SparseFeatures(
            {k: jnp.asarray(v) for k, v in on_device.ids.items()}, on_device.lengths
        )
        outs = [
            coll.lookup(b).outputs
            for b in (_full_batch(config, np.int32), _full_batch(config, np.uint32), on_device)
        ]
    assert on_device.ids["fa"].dtype == jnp.uint32
    for name, want in outs[0].items():
        for other in outs[1:]:
            np.testing.assert_array_equal(np.asarray(other[name]), np.asarray(want))


def test_host_lists_are_arrays_and_bad_ones_get_one_line_naming_the_feature():
    config, plan = _config("ub"), _plan("ub")
    coll = EmbeddingCollection(config, plan, plan.make_mesh(), rngs=nnx.Rngs(0))
    good = _full_batch(config, np.int32)
    as_lists = SparseFeatures(
        {n: np.asarray(v).tolist() for n, v in good.ids.items()},
        {n: np.asarray(v).tolist() for n, v in good.lengths.items()},
    )
    want, got = coll.lookup(good).outputs, coll.lookup(coll.shard_batch(as_lists)).outputs
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))

    def with_fa(ids_fa, **weights):
        return SparseFeatures({**good.ids, "fa": ids_fa}, good.lengths, weights)

    ragged = [[1, 2, 3]] * (B - 1) + [[1, 2]]
    cases = {
        r"^feature 'fa': ids: not a rectangular array of ids": with_fa(ragged),
        r"^feature 'fa': ids: a value is not an integer in int64's range": with_fa(
            [[2**70, 1, 2]] * B
        ),
        r"^feature 'fa': ids must be integers, got float": with_fa(np.ones((B, 3))),
        r"^feature 'fa': weights given but the feature is not configured weighted=True": with_fa(
            good.ids["fa"], fa=np.ones((B, 3), np.float32)
        ),
    }
    for message, batch in cases.items():
        for call in (coll.shard_batch, coll.lookup):
            with pytest.raises(ValueError, match=message):
                call(batch)


def test_nested_lists_of_tracers_ragged_fields_and_odd_weights():
    config, plan = _config("ub"), _plan("ub")
    coll = EmbeddingCollection(config, plan, plan.make_mesh(), rngs=nnx.Rngs(0))
    good = _full_batch(config, np.int32)
    want = coll.lookup(good).outputs

    @nnx.jit
    def rows_as_lists(c, ids, lengths):  # lists of per-slot tracers, as a user may build them
        listed = {
            n: [[v[b, h] for h in range(v.shape[1])] for b in range(B)] for n, v in ids.items()
        }
        return c.lookup(
            SparseFeatures(listed, {n: [x[b] for b in range(B)] for n, x in lengths.items()})
        ).outputs

    got = rows_as_lists(coll, dict(good.ids), dict(good.lengths))
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))

    def batch(**fa):
        ids, lengths = dict(good.ids), dict(good.lengths)
        ids.update({"fa": fa["ids"]} if "ids" in fa else {})
        lengths.update({"fa": fa["lengths"]} if "lengths" in fa else {})
        return SparseFeatures(ids, lengths, {"fa": fa["weights"]} if "weights" in fa else {})

    cases = {
        r"^feature 'fa': lengths: not a rectangular array": batch(
            lengths=[[1]] * (B - 1) + [[1, 2]]
        ),
        r"^feature 'fa': weights: not a rectangular array": batch(
            weights=[[1.0]] * (B - 1) + [[1.0, 2.0]]
        ),
        r"^feature 'fa': ids: a value is not an integer in int64's range": batch(
            ids=[[1, 2, 2**63]] * B
        ),
    }
    for message, b in cases.items():
        with pytest.raises(ValueError, match=message):
            coll.shard_batch(b)
    for dtype in (np.complex64, np.bool_, np.str_):
        odd = SparseFeatures(good.ids, good.lengths, {"fa": np.ones((B, 3), dtype)})
        with pytest.raises(ValueError, match=r"^feature 'fa': weights must be numeric, got dtype"):
            odd.check_layout()
