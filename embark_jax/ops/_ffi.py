"""Thin `jax.ffi.ffi_call` wrappers around the native kernels (no autodiff here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embark_jax import _native  # noqa: F401  (registers the targets)


def result_type(like: jax.Array, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    """Result type for an FFI output computed per device from `like`.

    Inside `shard_map` the result must carry the inputs' `manual_axis_type`; a plain
    `ShapeDtypeStruct` would mark it replicated and give silently wrong gradients
    (DESIGN.md §7).
    """
    aval = jax.typeof(like)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return aval.update(
        shape=tuple(shape),
        dtype=jnp.dtype(dtype),
        sharding=_sharding_for(aval, len(shape)),
        weak_type=False,
    )


def _sharding_for(aval, rank: int):
    sharding = aval.sharding
    try:
        return sharding.update(spec=jax.sharding.PartitionSpec(*([None] * rank)))
    except Exception:  # pragma: no cover - older jax without abstract shardings
        return sharding


def segment_sum(values: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    values2 = values.reshape(values.shape[0], -1)
    out = jax.ffi.ffi_call(
        "embark_segment_sum",
        result_type(values2, (num_segments, values2.shape[1]), values.dtype),
        vmap_method="sequential",
    )(values2, segment_ids)
    return out.reshape((num_segments, *values.shape[1:]))
