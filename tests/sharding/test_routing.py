"""The routing layer (`sharding.routing`): fixed-capacity buckets by hand, and the padded
all-to-all and device index on the 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from embark_jax.sharding.routing import bucket, device_index, exchange


def test_bucket_by_hand():
    """Requests to 3 devices with capacity 2: device 0 gets ids 10, 11 (the third, 12, is
    dropped); device 2 gets 13; the padding request (dst -1) takes no slot."""
    dst = jnp.array([0, 2, 0, -1, 0])
    ids = jnp.array([10, 13, 11, 99, 12])
    send, slot, dropped = bucket(dst, 3, 2, {"id": (ids, -1), "w": (ids * 0.5, 0.0)})
    np.testing.assert_array_equal(send["id"], [[10, 11], [-1, -1], [13, -1]])
    np.testing.assert_array_equal(send["w"], [[5.0, 5.5], [0, 0], [6.5, 0]])
    np.testing.assert_array_equal(slot, [0, 4, 1, -1, -1])
    np.testing.assert_array_equal(dropped, [False, False, False, False, True])
    assert slot.dtype == jnp.int32 and send["w"].dtype == jnp.float32


def test_exchange_transposes_sender_and_peer_on_8_devices():
    mesh = jax.make_mesh((2, 4), ("node", "local"))
    axes = ("node", "local")

    def per_device():
        me = device_index(axes)
        # device me sends 100 * me + peer to each peer
        return exchange(100 * me + jnp.arange(8, dtype=jnp.int32)[:, None], axes)

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(), out_specs=P(axes)))
    got = np.asarray(f()).reshape(8, 8)
    # out[src] on device me is what src sent to me: 100 * src + me
    want = 100 * np.arange(8)[None, :] + np.arange(8)[:, None]
    np.testing.assert_array_equal(got, want)
