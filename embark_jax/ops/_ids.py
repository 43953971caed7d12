"""Id arrays as the ops take them: one rule for every integer type an id array may have.

The kernels take int32 or int64 ids. Narrower integer types (int8, int16, uint8, uint16)
are widened to int32, which holds every value they can hold. An unsigned 32- or 64-bit
array is widened only where that is exact: uint32 to int64 with JAX's 64-bit types on
(`jax_enable_x64`); a host (numpy) array whose values fit the signed type of its width is
converted by value. Anything else is refused with the field and the type: wrapping would
turn a large id into a negative one (padding) or into another row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_INT32 = np.iinfo(np.int32)


def _host_ids(name: str, ids: np.ndarray) -> np.ndarray:
    """A host integer array, converted by value where its type would wrap in JAX."""
    if ids.dtype.itemsize < 4 or not ids.size:
        return ids
    lo, hi = ids.min(), ids.max()
    if not jax.config.jax_enable_x64 and (lo < _INT32.min or hi > _INT32.max):
        bad = int(hi) if hi > _INT32.max else int(lo)
        raise ValueError(
            f"{name}: id {bad} is outside int32 and JAX's 64-bit types are off "
            "(jax_enable_x64), so it would wrap to another id; enable them or pass int32 ids"
        )
    if ids.dtype.kind == "u":
        signed = np.dtype(f"int{8 * ids.dtype.itemsize}")
        if hi > np.iinfo(signed).max:
            raise ValueError(f"{name}: id {int(hi)} is outside {signed.name}")
        return ids.astype(signed)
    return ids


def as_ids(name: str, ids) -> jax.Array:
    """`ids` as a JAX array of int32 or int64 (non-integer types are passed through for the
    op to refuse by name). With 64-bit types off, JAX converts a host int64 array to int32 by
    wrapping (2**33 -> 0: a real row); such an array holding a value outside int32 is refused
    instead. Arrays already on a device, or traced under `jit`, were converted by JAX before
    any op sees them."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        ids = _host_ids(name, ids)
    ids = jnp.asarray(ids)
    dt = ids.dtype
    if not jnp.issubdtype(dt, jnp.integer) or dt in (jnp.int32, jnp.int64):
        return ids
    if dt.itemsize < 4:  # int8, int16, uint8, uint16: every value fits int32
        return ids.astype(jnp.int32)
    if dt == jnp.uint32 and jax.config.jax_enable_x64:
        return ids.astype(jnp.int64)
    raise ValueError(
        f"{name}: {dt} ids would wrap; pass int32 or int64 ids"
        + (" (or enable jax_enable_x64 to widen uint32 to int64)" if dt == jnp.uint32 else "")
    )
