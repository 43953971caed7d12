"""Property-based bad-input tests: every malformed input either works correctly or raises a
clear ValueError; none crashes the process or corrupts a table. Prints the cases tried."""

import jax
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.batch import Batch
from embark_jax.data.sparse import SparseFeatures
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
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

    @settings(
        max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(kind=st.sampled_from(MUTATIONS), seed=st.integers(0, 2**16))
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
        assert np.isfinite(r.loss)
        STATS["step"][1] += 1

    run()
    tried, ok, rejected = STATS["step"]
    with capsys.disabled():
        print(
            f"\nfuzz Trainer.step inputs: {tried} cases, {ok} trained, {rejected} rejected "
            "with ValueError, 0 failures, 0 tables corrupted"
        )
    assert rejected > 0 and runner.num_compilations() == 1
