"""Id arrays as the ops take them: one rule, for ids and segment ids, in every op.

The kernels take 1-D int32 or int64 ids. Narrower integer types (int8, int16, uint8,
uint16) are widened to int32, which holds every value they can hold. An unsigned 32- or
64-bit array is widened only where that is exact: uint32 to int64 with JAX's 64-bit types on
(`jax_enable_x64`); a host (numpy) array or a Python list is converted by value when its
values fit the ids JAX can hold (int32 with 64-bit types off, int64 with them on). Anything
else is refused with the field and the type or value: wrapping would turn a large id into a
negative one (padding) or into another row. Bool and float arrays are refused, as are
arrays that are not 1-D or not of the expected length (`as_ids`). The collection's batches
take the same rules for their `[B, H]` ids (`host_id_array` and `widen_ids`, in
`sharding.bounds`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def host_ids(name: str, ids: np.ndarray) -> np.ndarray:
    """A host integer array (any shape) as int32 or int64 by value, a narrow one as it is
    (widened on the device); a one-line `ValueError` where a value does not fit."""
    target = np.dtype(np.int64 if jax.config.jax_enable_x64 else np.int32)
    size, signed = ids.dtype.itemsize, ids.dtype.kind == "i"
    if size < 4 or (signed and size <= target.itemsize):
        return ids  # every value fits (a narrow type is widened on the device)
    if not signed and size < target.itemsize:
        return ids.astype(target)  # uint32 with 64-bit types on
    if ids.size:
        lo, hi, info = ids.min(), ids.max(), np.iinfo(target)
        if lo < info.min or hi > info.max:
            bad = int(hi) if hi > info.max else int(lo)
            if target == np.int32:
                raise ValueError(
                    f"{name}: id {bad} is outside int32 and JAX's 64-bit types are off "
                    "(jax_enable_x64), so it would wrap to another id; enable them or pass "
                    "int32 ids"
                )
            raise ValueError(f"{name}: id {bad} is outside int64")
    return ids.astype(target)


def holds_jax_arrays(x) -> bool:
    """Whether a (nested) list or tuple holds a JAX array anywhere (a tracer under `jit`):
    numpy cannot convert it, `jnp.asarray` can."""
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x))


def _as_array(ids):
    """A Python list or tuple (or scalar) as an array: an empty one as int32 ids; one that
    holds JAX arrays (tracers under `jit`), at any depth, as a JAX array; else a numpy array,
    with Python ints beyond int64 kept as objects (numpy would make them floats) to be
    refused by name."""
    if isinstance(ids, (list, tuple)):
        if len(ids) == 0:
            return np.zeros((0,), np.int32)
        if holds_jax_arrays(ids):
            return jnp.asarray(ids)
    try:
        out = np.asarray(ids)
    except OverflowError:
        return np.asarray(ids, dtype=object)
    if out.dtype.kind == "f" and isinstance(ids, (list, tuple)):
        obj = np.asarray(ids, dtype=object)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in obj.ravel()):
            return obj  # e.g. [1, 2**63] or [[1, 2**63]]: not a float array
    return out


def host_id_array(name: str, ids):
    """Ids of any shape given on the host (a numpy array, or a list: as `as_ids` reads one)
    as a numpy int array by value (`host_ids`); a JAX array or tracer as it is (the device
    rule, `widen_ids`, follows); a one-line `ValueError` that starts with `name` for a
    ragged list, a value beyond int64 or a type that is not an integer."""
    if isinstance(ids, jax.Array):
        return ids
    try:
        ids = ids if isinstance(ids, np.ndarray) else _as_array(ids)
    except ValueError as e:  # numpy: a ragged list
        raise ValueError(f"{name}: not a rectangular array of ids ({e})") from None
    if isinstance(ids, jax.Array):  # a list holding tracers
        return ids
    if ids.dtype == np.dtype(object):
        raise ValueError(f"{name}: a value is not an integer in int64's range")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got {ids.dtype}")
    return host_ids(name, ids)


def as_ids(name: str, ids, n: int | None = None) -> jax.Array:
    """`ids` as a 1-D JAX array of int32 or int64 (of length `n` when given), or a one-line
    `ValueError` that starts with `name` (e.g. "lookup_pool: segment_ids")."""
    ids = host_id_array(name, ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):  # a JAX array's (a host one's is checked)
        raise ValueError(f"{name} must be integers, got {ids.dtype}")
    if ids.ndim != 1 or (n is not None and ids.shape[0] != n):
        raise ValueError(f"{name}: expected a 1-D array of {n or 'N'} ids, got shape {ids.shape}")
    return widen_ids(name, jnp.asarray(ids))


def widen_ids(name: str, ids: jax.Array) -> jax.Array:
    """A JAX integer array of ids (any shape, traced or not) as int32 or int64 by the rule
    above, or a one-line `ValueError` that starts with `name` where it would wrap."""
    dt = ids.dtype
    if dt in (jnp.int32, jnp.int64):
        return ids
    if not jnp.issubdtype(dt, jnp.integer):
        raise ValueError(f"{name} must be integers, got {dt}")
    if dt.itemsize < 4:  # int8, int16, uint8, uint16: every value fits int32
        return ids.astype(jnp.int32)
    if dt == jnp.uint32 and jax.config.jax_enable_x64:
        return ids.astype(jnp.int64)
    raise ValueError(
        f"{name}: {dt} ids would wrap; pass int32 or int64 ids"
        + (" (or enable jax_enable_x64 to widen uint32 to int64)" if dt == jnp.uint32 else "")
    )
