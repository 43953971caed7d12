"""Id arrays as the ops take them: one rule for host int64 ids when JAX's 64-bit types are off."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_INT32 = np.iinfo(np.int32)


def as_ids(name: str, ids) -> jax.Array:
    """`ids` as a JAX array. With 64-bit types off (`jax_enable_x64`), JAX converts a host
    int64 array to int32 by wrapping (2**33 -> 0: a real row); such an array holding a value
    outside int32 is refused instead. Arrays already on a device, or traced under `jit`,
    were converted by JAX before any op sees them."""
    if (
        isinstance(ids, np.ndarray)
        and ids.dtype.kind in "iu"
        and ids.dtype.itemsize > 4
        and ids.size
        and not jax.config.jax_enable_x64
    ):
        lo, hi = ids.min(), ids.max()
        if lo < _INT32.min or hi > _INT32.max:
            bad = int(hi) if hi > _INT32.max else int(lo)
            raise ValueError(
                f"{name}: id {bad} is outside int32 and JAX's 64-bit types are off "
                "(jax_enable_x64), so it would wrap to another id; enable them or pass int32 ids"
            )
    return jnp.asarray(ids)
