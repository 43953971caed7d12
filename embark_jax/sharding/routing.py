"""The routing layer shared by the RB and UB clusters: fixed-capacity buckets per destination
device and the padded all-to-all exchange (`ragged_all_to_all` does not run on CPU). The
capacities themselves are sized in `embark_jax.sharding.capacity`.

Everything here runs per device inside `shard_map` over all mesh axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

__all__ = ["bucket", "device_index", "exchange"]


def device_index(axis_names: Sequence[str]) -> jax.Array:
    """This device's global index g (node-major on a 2-D mesh)."""
    return jax.lax.axis_index(tuple(axis_names))


def exchange(x: jax.Array, axis_names: Sequence[str] | str) -> jax.Array:
    """Padded all-to-all on axis 0: `out[src] = x_src[me]` (x is `[num_peers, ...]`)."""
    return jax.lax.all_to_all(x, axis_names, 0, 0, tiled=True)


def bucket(
    dst: jax.Array,
    num_devices: int,
    capacity: int,
    payloads: Mapping[str, tuple[jax.Array, int | float]],
) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """Places requests into per-destination send buffers of fixed capacity.

    Arguments:
      dst: `[N]` destination device of each request; < 0 means no request.
      payloads: name -> (`[N]` values, fill value for empty slots).

    Returns `(send, slot, dropped)`: `send[name]` is `[num_devices, capacity]`; `slot[i]` is
    `dst * capacity + position` of request i in the flattened buffer, or -1; `dropped[i]`
    marks valid requests that did not fit (their count is the overflow to report).
    """
    n = dst.shape[0]
    valid = dst >= 0
    key = jnp.where(valid, dst, num_devices)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    first = jnp.searchsorted(sorted_key, jnp.arange(num_devices + 1), side="left")
    pos_sorted = jnp.arange(n) - first[sorted_key]
    pos = jnp.zeros((n,), jnp.int32).at[order].set(pos_sorted.astype(jnp.int32))
    keep = valid & (pos < capacity)
    slot = jnp.where(keep, dst * capacity + pos, -1)
    target = jnp.where(keep, slot, num_devices * capacity)  # out of range: dropped by .set
    send = {}
    for name, (values, fill) in payloads.items():
        buf = jnp.full((num_devices * capacity,), fill, values.dtype)
        buf = buf.at[target].set(values, mode="drop")
        send[name] = buf.reshape(num_devices, capacity)
    return send, slot.astype(jnp.int32), valid & ~keep
