"""Thin `jax.ffi.ffi_call` wrappers around the native kernels (no autodiff here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


COMBINER_IDS = {"sum": 0, "mean": 1, "sqrtn": 2, "none": 3}


def lookup_pool(table, ids, segment_ids, weights, num_out: int, combiner: str, out_dtype):
    return jax.ffi.ffi_call(
        "embark_lookup_pool",
        result_type(ids, (num_out, table.shape[1]), out_dtype),
        vmap_method="sequential",
    )(table, ids, segment_ids, weights, combiner=np.int64(COMBINER_IDS[combiner]))


def unique(ids, capacity: int):
    return jax.ffi.ffi_call(
        "embark_unique",
        (
            result_type(ids, (capacity,), ids.dtype),
            result_type(ids, ids.shape, jnp.int32),
            result_type(ids, (capacity,), jnp.int32),
            result_type(ids, (), jnp.int32),
        ),
        vmap_method="sequential",
    )(ids)


def sparse_grad(grads, ids, segment_ids, scale, capacity: int, per_id: bool):
    return jax.ffi.ffi_call(
        "embark_sparse_grad",
        (
            result_type(ids, (capacity,), ids.dtype),
            result_type(ids, (capacity, grads.shape[1]), jnp.float32),
            result_type(ids, (), jnp.int32),
        ),
        vmap_method="sequential",
    )(grads, ids, segment_ids, scale, per_id=np.int64(per_id))


def sparse_update(table, slot_a, slot_b, rows, grads, hparams, kernel_id: int):
    return jax.ffi.ffi_call(
        "embark_sparse_update",
        (
            result_type(table, table.shape, table.dtype),
            result_type(slot_a, slot_a.shape, jnp.float32),
            result_type(slot_b, slot_b.shape, jnp.float32),
        ),
        input_output_aliases={0: 0, 1: 1, 2: 2},
        vmap_method="sequential",
    )(table, slot_a, slot_b, rows, grads, hparams, optimizer=np.int64(kernel_id))


def sparse_grad_update(
    table, slot_a, slot_b, grads, ids, segment_ids, scale, hparams, kernel_id: int, per_id: bool
):
    return jax.ffi.ffi_call(
        "embark_sparse_grad_update",
        (
            result_type(table, table.shape, table.dtype),
            result_type(slot_a, slot_a.shape, jnp.float32),
            result_type(slot_b, slot_b.shape, jnp.float32),
            result_type(ids, (), jnp.int32),
        ),
        input_output_aliases={0: 0, 1: 1, 2: 2},
        vmap_method="sequential",
    )(
        table,
        slot_a,
        slot_b,
        grads,
        ids,
        segment_ids,
        scale,
        hparams,
        optimizer=np.int64(kernel_id),
        per_id=np.int64(per_id),
    )
