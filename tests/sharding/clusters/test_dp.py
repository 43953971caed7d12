"""The DP cluster (`sharding.clusters.dp`): local lookups in this device's replica, and the
flat id slots its backward exchanges, on a local batch of 2 samples (no collective runs)."""

import jax.numpy as jnp
import numpy as np

from embark_jax.data.sparse import SparseFeatures
from tests.sharding.helpers import checked, make_cluster


def dp_cluster():
    return make_cluster("dp", 10, 3, row_shards=1, devices=(tuple(range(8)),))


def test_route_and_owner_pool_the_local_replica_by_hand():
    dp = dp_cluster()
    batch = SparseFeatures.from_dense({"f": np.array([[1, 2, -1], [3, -1, -1]])})
    res, overflow = dp.route(checked(dp, batch))
    np.testing.assert_array_equal(res.rows, [1, 2, -1, 3, -1, -1])
    np.testing.assert_array_equal(res.bag, [0, 0, 0, 1, 1, 1])
    assert res.w is None and overflow.tolist() == [0]  # unweighted; DP never drops
    buffer = jnp.arange(10 * 16, dtype=jnp.float32).reshape(10, 16)  # row i: 16 i, 16 i + 1..
    out = np.asarray(dp.owner(buffer, res)["f"])
    np.testing.assert_array_equal(out[0], np.asarray(buffer[1] + buffer[2]))
    np.testing.assert_array_equal(out[1], np.asarray(buffer[3]))


def test_flat_slots_drop_padding_and_scale_sum_by_one():
    dp = dp_cluster()
    batch = SparseFeatures.from_dense({"f": np.array([[1, 2, -1], [3, -1, -1]])})
    res, _ = dp.route(checked(dp, batch))
    rows, scale = dp._slots(res)
    np.testing.assert_array_equal(rows, [1, 2, -1, 3, -1, -1])
    np.testing.assert_array_equal(scale, [1, 1, 0, 1, 0, 0])
