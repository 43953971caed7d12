"""`embark_jax.training.metrics`: exact and streaming AUC / logloss, and the device sums'
host totals."""

import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.training.metrics import DeviceMetrics, HostSums, StreamingAUC, auc, logloss


def test_exact_auc_averages_ties_and_is_half_for_one_class():
    assert auc([0, 1, 0, 1], [0.1, 0.9, 0.2, 0.8]) == 1.0
    assert auc([0, 1], [0.5, 0.5]) == 0.5  # a tie counts half
    assert auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75
    assert auc([1, 1], [0.2, 0.3]) == 0.5


def test_logloss_clips_probabilities():
    assert logloss([1, 0], [0.5, 0.5]) == pytest.approx(np.log(2))
    assert np.isfinite(logloss([1], [0.0]))  # clipped to eps, not log(0)


def test_streaming_auc_matches_the_exact_one_and_since_subtracts(rng):
    labels = rng.integers(0, 2, size=400)
    probs = np.clip(0.3 * labels + rng.random(400) * 0.7, 0, 1)
    s = StreamingAUC(bins=1 << 12)
    s.update(labels[:200], probs[:200])
    first = s.copy()
    s.update(labels[200:], probs[200:])
    assert s.auc() == pytest.approx(auc(labels, probs), abs=2e-3)
    assert s.logloss() == pytest.approx(logloss(labels, probs), rel=1e-9)
    later = s.since(first)
    assert later.count == 200
    assert later.auc() == pytest.approx(auc(labels[200:], probs[200:]), abs=2e-3)


def test_host_sums_count_across_a_uint32_wrap():
    host = HostSums(num_tables=1, bins=4)
    d = DeviceMetrics.zeros(1, bins=4)._replace(steps=jnp.uint32(2**32 - 2))
    host.read(d)
    host.read(d._replace(steps=jnp.uint32(3)))  # 5 more steps, wrapped
    assert int(host.counts["steps"]) == 2**32 - 2 + 5


def test_device_predictions_fill_the_same_bins_as_the_host():
    labels, probs = np.array([1, 0, 1, 0]), np.array([0.9, 0.1, 0.6, 0.7], np.float32)
    d = DeviceMetrics.zeros(1, bins=8).add_predictions(
        jnp.asarray(labels), jnp.asarray(probs), jnp.bool_(True)
    )
    host = StreamingAUC(bins=8)
    host.update(labels, probs)
    np.testing.assert_array_equal(d.pos, host.pos)
    np.testing.assert_array_equal(d.neg, host.neg)
    assert float(d.logloss[0] - d.logloss[1]) == pytest.approx(host.loss_sum, rel=1e-5)
