"""`embark_jax.data.batch`: a training batch and its host-side checks."""

import numpy as np
import pytest

from embark_jax.core.dynamic import DynamicConfig, DynamicFeatureConfig, DynamicTableConfig
from embark_jax.data.batch import Batch, DataError, check_finite_dense
from embark_jax.data.synthetic import SyntheticDataset
from tests.data.test_synthetic import CFG


def test_batch_validate_names_a_bad_label_or_dense_value_and_its_sample():
    from embark_jax.data.batch import Batch, DataError

    ds = SyntheticDataset(CFG, batch_size=8, seed=0)
    good = ds.batch(0)
    labels, dense = np.array(good.labels), np.array(good.dense)
    labels[5] = 2
    dense[3, 1] = np.nan
    cases = [
        (
            Batch(good.sparse, good.dense, labels),
            r"^labels must be 0 or 1: label 2\.0 at sample 5$",
        ),
        (
            Batch(good.sparse, dense, good.labels),
            r"^sample 3: dense feature 1 is nan, not a finite float32 number$",
        ),
    ]
    for batch, message in cases:
        with pytest.raises(DataError, match=message):
            batch.validate(CFG, num_devices=8, num_dense=dense.shape[1])


def _good():
    return SyntheticDataset(CFG, batch_size=8, seed=0).batch(0)


@pytest.mark.parametrize(
    "batch, num_devices, message",
    [
        (_good(), 3, "batch size 8 is not a multiple of the 3 devices"),
        (
            Batch(_good().sparse, _good().dense, np.reshape(_good().labels, (8, 1))),
            8,
            r"labels must be \[B\] zeros and ones, got float32 \(8, 1\)",
        ),
        (Batch(_good().sparse, _good().dense[:0], _good().labels[:0]), 1, "empty batch"),
    ],
)
def test_validate_refuses_misshapen_batches(batch, num_devices, message):
    num_dense = np.shape(_good().dense)[1]
    with pytest.raises(DataError, match=message):
        batch.validate(CFG, num_devices=num_devices, num_dense=num_dense)
    with pytest.raises(DataError, match=rf"dense features must be \[8, {num_dense + 1}\]"):
        _good().validate(CFG, num_devices=8, num_dense=num_dense + 1)


def test_validate_checks_the_dynamic_features_the_model_takes():
    good = _good()
    dyn = DynamicConfig(
        (DynamicTableConfig(name="d", dim=4, capacity=32),),
        (DynamicFeatureConfig(name="fd", table="d", max_hotness=2),),
    )
    num_dense = np.shape(good.dense)[1]
    with pytest.raises(DataError, match=r"the batch has \[\], the model takes \['fd'\]"):
        good.validate(CFG, num_devices=8, num_dense=num_dense, dynamic=dyn)
    wrong = Batch(good.sparse, good.dense, good.labels, {"fd": np.zeros((8, 2, 2), np.int64)})
    with pytest.raises(DataError, match=r"ids must be uint32 \[8, 2, 2\] id words"):
        wrong.validate(CFG, num_devices=8, num_dense=num_dense, dynamic=dyn)
    ok = Batch(good.sparse, good.dense, good.labels, {"fd": np.zeros((8, 2, 2), np.uint32)})
    ok.validate(CFG, num_devices=8, num_dense=num_dense, dynamic=dyn)


def test_check_finite_dense_names_the_first_bad_value_as_shown():
    dense = np.array([[0.0, 1.0], [np.inf, np.nan]], np.float32)
    check_finite_dense(dense[:1], lambda i: f"row {i}")
    with pytest.raises(DataError, match=r"^row 1: dense feature 0 is 1e\+40, not a finite"):
        check_finite_dense(dense, lambda i: f"row {i}", shown=np.array([[0, 1], [1e40, 0]]))
