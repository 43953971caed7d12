"""What every cluster shares (`sharding.clusters.base`): a routed table's placement, the
destination and buffer row of each id, output shapes, and the pooled combiners' divisor."""

import jax.numpy as jnp
import numpy as np

from embark_jax.core.specs import Combiner
from embark_jax.sharding.clusters.base import ClusterBase, FeatureInput
from tests.sharding.helpers import make_cluster


def test_placement_and_shard_requests_by_hand():
    """100 rows over 4 row shards on devices 0-3: id i lives in shard i % 4, row i // 4."""
    rb = make_cluster("rb", 100, 3, row_shards=4)
    dev, off = rb.placement("t")
    np.testing.assert_array_equal(dev, [[0, 1, 2, 3]])
    np.testing.assert_array_equal(off, [[0, 0, 0, 0]])
    req = rb.shard_requests("t", jnp.array([0, 25, 99, -1]))
    np.testing.assert_array_equal(req.j, [0, 1, 3, 0])
    (dst,), (row,) = req.dst, req.row
    np.testing.assert_array_equal(dst, [0, 1, 3, -1])  # padding goes nowhere
    np.testing.assert_array_equal(row[:3], [0, 6, 24])
    assert rb.table_index("t") == 0 and rb.output_shape(rb.features[0]) == (2, 16)


def test_denominator_is_the_weight_sum_for_mean_and_one_for_sum():
    fi = FeatureInput(
        ids=jnp.array([1, 2, -1, 5]),
        seg=jnp.array([0, 0, 1, 1]),
        weights=jnp.array([1.0, 2.0, 0.0, 4.0]),  # padding weighs 0
    )
    np.testing.assert_array_equal(ClusterBase.denominator(fi, 2, Combiner.MEAN), [3.0, 4.0])
    np.testing.assert_array_equal(ClusterBase.denominator(fi, 2, Combiner.SUM), [1.0, 1.0])
    # an empty bag (divisor 0) pools to zeros, never NaN
    got = ClusterBase.apply_denominator(jnp.array([[2.0, 4.0], [6.0, 8.0]]), jnp.array([2.0, 0.0]))
    np.testing.assert_array_equal(got, [[1.0, 2.0], [0.0, 0.0]])
