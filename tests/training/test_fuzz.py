"""Property-based input tests, derandomized (the same cases every run). Prints the cases tried.

- Malformed inputs (`dense_inputs`): every one either works correctly or raises a clear
  ValueError; none crashes the process or corrupts a table.
- Valid inputs only (`valid_inputs`): ids in range, bags no longer than the
  feature's hotness, integer dtypes of every width, finite weights, five features on three
  tables (RB, UB, DP; sum/mean/sqrtn/none), padding anywhere, three constructors. Every case
  must be accepted, and each batch's lookup (the jnp reference and the sharded collection)
  must equal a float64 numpy pooling of the ids as drawn, before any packing.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embark_jax import ops
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.batch import Batch
from embark_jax.data.sparse import SparseFeatures
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.sharding.collection import EmbeddingCollection
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import StepRunner
from embark_jax.training.state import create

CFG = EmbeddingConfig.create(
    [TableConfig(name="t", vocab_size=50, dim=4), TableConfig(name="u", vocab_size=9, dim=4)],
    [
        FeatureConfig(name="f", table="t", max_hotness=4, weighted=True),
        FeatureConfig(name="g", table="u", max_hotness=2),
    ],
)
VOCAB = {"f": 50, "g": 9}
HOT = {"f": 4, "g": 2}

ID_VALUES = st.one_of(st.integers(-3, 60), st.sampled_from([2**31 - 1, 2**31 + 7, -(2**40)]))


@st.composite
def dense_inputs(draw):
    b = draw(st.integers(0, 5))
    ids, weights = {}, {}
    names = draw(st.sampled_from([["f", "g"], ["f", "g"], ["f"], ["f", "g", "zz"]]))
    for name in names:
        width = draw(st.integers(0, 6))
        dtype = draw(st.sampled_from(["int32", "int64", "int64", "float32", "bool", "uint16"]))
        vals = np.array(
            draw(st.lists(ID_VALUES, min_size=b * width, max_size=b * width)), dtype=np.float64
        ).reshape(b, width)
        with np.errstate(invalid="ignore", over="ignore"):
            ids[name] = vals.astype(dtype) if dtype != "uint16" else np.abs(vals).astype(dtype)
        if name == "f" and draw(st.booleans()):
            w = np.array(
                draw(
                    st.lists(
                        st.sampled_from([0.5, 1.0, np.nan, np.inf, -2.0]),
                        min_size=b * width,
                        max_size=b * width,
                    )
                )
            )
            weights[name] = w.reshape(b, width) if draw(st.booleans()) else w.reshape(-1)
    return ids, weights


STATS = {"sparse": [0, 0, 0], "step": [0, 0, 0]}  # tried, accepted, rejected


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(inp=dense_inputs())
def _fuzz_sparse(inp):
    ids, weights = inp
    STATS["sparse"][0] += 1
    try:
        with np.errstate(all="ignore"):
            sf = SparseFeatures.from_dense(ids, weights, config=CFG)
    except ValueError as e:
        assert str(e), "empty error message"
        STATS["sparse"][2] += 1
        return
    STATS["sparse"][1] += 1
    sf.validate(CFG)  # what was accepted is valid and consistent
    for name in ("f", "g"):
        x = np.asarray(sf.ids[name])
        assert x.shape[1] == HOT[name] and x.dtype == np.int32
        assert x.max(initial=-1) < VOCAB[name] and x.min(initial=-1) >= -1
        np.testing.assert_array_equal((x >= 0).sum(axis=1), np.asarray(sf.lengths[name]))


def test_fuzz_sparse_features_construction(capsys):
    _fuzz_sparse()
    tried, ok, rejected = STATS["sparse"]
    with capsys.disabled():
        print(
            f"\nfuzz SparseFeatures.from_dense: {tried} cases, {ok} accepted, {rejected} "
            "rejected with ValueError, 0 failures"
        )
    assert tried >= 100 and ok > 0 and rejected > 0


# --- valid inputs only: every case accepted and looked up like numpy says -------------------

VALID_CFG = EmbeddingConfig.create(
    [
        TableConfig(name="t", vocab_size=50, dim=4),
        TableConfig(name="u", vocab_size=9, dim=4),
        TableConfig(name="v", vocab_size=20, dim=4),
    ],
    [
        FeatureConfig(name="f", table="t", max_hotness=4, weighted=True),
        FeatureConfig(name="h", table="t", max_hotness=3, combiner="sqrtn", weighted=True),
        FeatureConfig(name="g", table="u", max_hotness=2, combiner="mean"),
        FeatureConfig(name="s", table="u", max_hotness=3, combiner="none"),
        FeatureConfig(name="k", table="v", max_hotness=2, combiner="mean", weighted=True),
    ],
)
VALID_B = 8  # the collection's batch: drawn batches of 1..8 samples are padded to it
VALID_PLAN = Plan(
    topology=Topology(num_nodes=1, devices_per_node=8),
    batch_size=VALID_B,
    tables=(
        TablePlan(name="t", cluster="rb", row_shards=2, column_shards=2, devices=((0, 1), (4, 5))),
        TablePlan(name="u", cluster="ub", row_shards=2, column_shards=1, devices=((2, 3),)),
        TablePlan(
            name="v", cluster="dp", row_shards=1, column_shards=1, devices=(tuple(range(8)),)
        ),
    ),
)
SIGNED = ["int8", "int16", "int32", "int64"]
UNSIGNED = ["uint8", "uint16", "uint32", "uint64"]
WEIGHTS = st.floats(0.25, 4.0, width=32)
CTORS = ("from_dense", "from_ragged", "from_lengths")


@st.composite
def valid_inputs(draw):
    """`(bags, forms)`: `bags[feature][sample]` is the list of (id, weight) drawn (weight 1.0
    when the feature's weights are left out); `forms[c]` are the arguments that build them with
    `SparseFeatures.<c>(*forms[c], config=VALID_CFG)` for each constructor c: `from_dense`
    with padding anywhere in rows up to hotness + 1 wide (pad -1, or 127 so unsigned dtypes
    can pad), `from_ragged`, `from_lengths`. One feature has an id in sample 0: no batch is
    empty."""
    b = draw(st.integers(1, VALID_B))
    anchor = draw(st.sampled_from([f.name for f in VALID_CFG.features]))
    pad = draw(st.sampled_from([-1, 127]))
    bags = {}
    dense, dense_w, ragged, ragged_w, values, lengths, values_w = ({} for _ in range(7))
    for f in VALID_CFG.features:
        vocab = VALID_CFG.table_of(f.name).vocab_size
        dtype = draw(st.sampled_from(SIGNED + (UNSIGNED if pad >= 0 else [])))
        given_w = f.weighted and draw(st.booleans())
        rows = []
        for i in range(b):
            n = draw(st.integers(1 if (f.name == anchor and i == 0) else 0, f.max_hotness))
            row_ids = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
            row_w = draw(st.lists(WEIGHTS, min_size=n, max_size=n)) if given_w else [1.0] * n
            rows.append(list(zip(row_ids, row_w, strict=True)))
        bags[f.name] = rows
        w_dtype = draw(st.sampled_from(["float32", "float64"]))
        width = draw(st.integers(max(1, max(len(r) for r in rows)), f.max_hotness + 1))
        x = np.full((b, width), pad, dtype)
        w = np.full((b, width), draw(st.sampled_from([0.0, 9.0])), w_dtype)  # pad weights
        for i, row in enumerate(rows):
            slots = sorted(draw(st.permutations(range(width)))[: len(row)])
            x[i, slots] = [r[0] for r in row]
            w[i, slots] = [r[1] for r in row]
        dense[f.name] = x
        ragged[f.name] = [np.array([r[0] for r in row], dtype) for row in rows]
        values[f.name] = np.array([r[0] for row in rows for r in row], dtype)
        lengths[f.name] = np.array([len(r) for r in rows], draw(st.sampled_from(SIGNED)))
        if given_w:
            dense_w[f.name] = w
            ragged_w[f.name] = [[r[1] for r in row] for row in rows]
            values_w[f.name] = np.array([r[1] for row in rows for r in row], w_dtype)
    forms = {
        "from_dense": (dense, dense_w, pad),
        "from_ragged": (ragged, ragged_w),
        "from_lengths": (values, lengths, values_w),
    }
    return bags, forms


def expected_lookup(bags, tables):
    """Float64 numpy lookup of the bags as drawn, written out per combiner."""
    out = {}
    for f in VALID_CFG.features:
        table = np.asarray(tables[f.table], np.float64)
        rows = bags[f.name]
        if f.combiner.value == "none":
            y = np.zeros((len(rows), f.max_hotness, table.shape[1]))
            for i, row in enumerate(rows):
                for j, (x, w) in enumerate(row):
                    y[i, j] = w * table[x]
        else:
            y = np.zeros((len(rows), table.shape[1]))
            for i, row in enumerate(rows):
                if not row:
                    continue
                y[i] = sum(w * table[x] for x, w in row)
                if f.combiner.value == "mean":
                    y[i] /= sum(w for _, w in row)
                elif f.combiner.value == "sqrtn":
                    y[i] /= np.sqrt(sum(w * w for _, w in row))
        out[f.name] = y
    return out


def pad_batch(sf, size):
    """`sf` with empty samples appended up to `size` (the plain constructor: no checks)."""
    extra = size - sf.batch_size

    def grow(a, value):
        a = np.asarray(a)
        return np.concatenate([a, np.full((extra, *a.shape[1:]), value, a.dtype)])

    return SparseFeatures(
        ids={n: grow(v, -1) for n, v in sf.ids.items()},
        lengths={n: grow(v, 0) for n, v in sf.lengths.items()},
        weights={n: grow(v, 0.0) for n, v in sf.weights.items()},
    )


@jax.jit
def reference_forward(tables, batch):
    """`tests/collection_ref.forward` (the `ops.reference.lookup_pool` of each feature from
    the full tables), jitted: compiled once for the padded batch shape."""
    out = {}
    for f in VALID_CFG.features:
        ids, seg, w = batch.flat(f.name)
        y = ops.reference.lookup_pool(tables[f.table], ids, seg, VALID_B, w, f.combiner)
        out[f.name] = y.reshape(VALID_B, f.max_hotness, -1) if not f.combiner.pooled else y
    return out


@pytest.fixture(scope="module")
def valid_collection():
    return EmbeddingCollection(VALID_CFG, VALID_PLAN, VALID_PLAN.make_mesh(), rngs=nnx.Rngs(3))


def test_fuzz_valid_inputs_are_accepted_and_looked_up_exactly(valid_collection, capsys):
    coll = valid_collection
    tables = coll.full_tables()
    stats = {"tried": 0, "accepted": 0, "nonempty": 0, "ctor": {}, "ids": 0}

    @settings(
        max_examples=110, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(inp=valid_inputs())
    def run(inp):
        bags, forms = inp
        ctor = CTORS[stats["tried"] % 3]  # each constructor a third of the cases
        stats["tried"] += 1
        sf = getattr(SparseFeatures, ctor)(*forms[ctor], config=VALID_CFG)  # must not raise
        stats["accepted"] += 1
        stats["ctor"][ctor] = stats["ctor"].get(ctor, 0) + 1
        b = len(bags["f"])
        # the layout: ids packed left in the order drawn, -1 after, weights beside them
        for f in VALID_CFG.features:
            x, n = np.asarray(sf.ids[f.name]), np.asarray(sf.lengths[f.name])
            assert x.shape == (b, f.max_hotness) and x.dtype == np.int32, f.name
            want_n = [len(r) for r in bags[f.name]]
            np.testing.assert_array_equal(n, want_n, err_msg=f.name)
            for i, row in enumerate(bags[f.name]):
                assert x[i].tolist() == [r[0] for r in row] + [-1] * (f.max_hotness - len(row))
                if f.weighted:
                    got_w = np.asarray(sf.weights[f.name])[i]
                    want_w = [r[1] for r in row] + [0.0] * (f.max_hotness - len(row))
                    np.testing.assert_array_equal(got_w, np.float32(want_w), err_msg=f.name)
        nonempty = sum(len(r) for rows in bags.values() for r in rows)
        stats["ids"] += nonempty
        stats["nonempty"] += nonempty > 0
        want = expected_lookup(bags, tables)
        padded = pad_batch(sf, VALID_B)  # one shape: every lookup below compiles once
        ref = reference_forward(tables, padded)
        res = coll.lookup(coll.shard_batch(padded))  # the sharded kernels
        assert all(int(v) == 0 for v in res.overflow.values())
        assert all(int(v) == 0 for v in res.invalid.values())
        for name, w in want.items():
            got = np.asarray(res.outputs[name])
            np.testing.assert_allclose(
                np.asarray(ref[name])[:b], w, rtol=1e-5, atol=1e-6, err_msg=name
            )
            np.testing.assert_allclose(got[:b], w, rtol=1e-5, atol=1e-6, err_msg=name)
            np.testing.assert_array_equal(got[b:], 0.0, err_msg=name)  # the padded samples

    run()
    with capsys.disabled():
        print(
            f"\nfuzz valid SparseFeatures -> lookup: {stats['tried']} cases, "
            f"{stats['accepted']} accepted ({stats['ctor']}), {stats['nonempty']} non-empty, "
            f"{stats['ids']} ids, all equal to numpy"
        )
    assert stats["accepted"] == stats["tried"] and stats["nonempty"] >= 100
    assert all(stats["ctor"][c] >= 30 for c in CTORS)


@pytest.fixture(scope="module")
def trainer():
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8),
        batch_size=16,
        tables=(
            TablePlan(name="t", cluster="rb", row_shards=2, column_shards=1, devices=((0, 1),)),
            TablePlan(name="u", cluster="ub", row_shards=1, column_shards=1, devices=((2,),)),
        ),
    )
    setup, state = create(
        CFG,
        plan,
        dense=DenseConfig(kind="dcnv2", bottom=(4,), top=(4, 1), cross_layers=1, cross_rank=2),
        sparse_optimizer=O.Adagrad(learning_rate=0.1),
        dense_optimizer=optax.sgd(0.1),
    )
    return {"runner": StepRunner(setup), "state": state}


MUTATIONS = [
    "none",
    "id_too_big",
    "id_negative",
    "float_ids",
    "lengths",
    "nan_weight",
    "empty",
    "huge_hotness",
    "nan_dense",
    "bad_label",
    "wrong_batch",
    "missing",
]


def mutate(base: Batch, kind: str, rng) -> Batch:
    ids = {k: np.array(v) for k, v in base.sparse.ids.items()}
    lengths = {k: np.array(v) for k, v in base.sparse.lengths.items()}
    weights = {k: np.array(v) for k, v in base.sparse.weights.items()}
    dense, labels = np.array(base.dense), np.array(base.labels)
    r, c = rng.integers(0, 16), rng.integers(0, 2)
    if kind == "id_too_big":
        ids["f"][r, 0] = 50 + rng.integers(0, 10**6)
    elif kind == "id_negative":
        ids["g"][r, 0] = -rng.integers(2, 100)
    elif kind == "float_ids":
        ids["f"] = ids["f"].astype(np.float32)
    elif kind == "lengths":
        lengths["g"][r] = 2 - lengths["g"][r] + 1
    elif kind == "nan_weight":
        ids["f"][r, 0] = 3
        weights["f"][r, 0] = np.nan
    elif kind == "empty":
        ids = {k: v[:0] for k, v in ids.items()}
        lengths = {k: v[:0] for k, v in lengths.items()}
        weights = {k: v[:0] for k, v in weights.items()}
        dense, labels = dense[:0], labels[:0]
    elif kind == "huge_hotness":
        ids["f"] = np.concatenate([ids["f"], np.ones((16, 1000), ids["f"].dtype)], axis=1)
    elif kind == "nan_dense":
        dense[r, c] = np.nan
    elif kind == "bad_label":
        labels[r] = 2.0
    elif kind == "wrong_batch":
        dense, labels = dense[:12], labels[:12]
    elif kind == "missing":
        del ids["g"], lengths["g"]
    return Batch(SparseFeatures(ids=ids, lengths=lengths, weights=weights), dense, labels)


def _checksum(tr):
    return [float(np.asarray(x).sum()) for x in jax.tree.leaves(tr["state"].tables)]


def test_fuzz_training_step_inputs(trainer, capsys):
    ds = SyntheticDataset(CFG, batch_size=16, seed=0)
    runner = trainer["runner"]
    trainer["state"], _ = runner.step(trainer["state"], ds.batch(0))  # compile once

    # half the cases are well-formed batches that train (one_of picks its branches alike)
    kinds = st.one_of(st.just("none"), st.sampled_from(MUTATIONS[1:]))

    @settings(
        max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(kind=kinds, seed=st.integers(0, 2**16))
    def run(kind, seed):
        STATS["step"][0] += 1
        batch = mutate(ds.batch(1 + seed % 50), kind, np.random.default_rng(seed))
        before = _checksum(trainer)
        try:
            trainer["state"], r = runner.step(trainer["state"], batch)
        except ValueError as e:
            assert kind != "none" and str(e)
            assert _checksum(trainer) == before  # a rejected batch changes nothing
            STATS["step"][2] += 1
            return
        assert kind == "none", f"malformed batch ({kind}) was accepted"
        assert np.isfinite(float(r.loss))
        assert _checksum(trainer) != before  # it trained: the tables moved
        STATS["step"][1] += 1

    run()
    tried, ok, rejected = STATS["step"]
    with capsys.disabled():
        print(
            f"\nfuzz Trainer.step inputs: {tried} cases, {ok} trained, {rejected} rejected "
            "with ValueError, 0 failures, 0 tables corrupted"
        )
    assert ok >= 50 and rejected >= 50 and runner.num_compilations() == 1
