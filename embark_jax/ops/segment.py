"""`segment_sum`: FFI kernel (default) or reference, differentiable wrt `values`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from embark_jax.ops import _ffi, reference
from embark_jax.ops.backend import Backend, resolve
from embark_jax.ops.ids import as_ids

__all__ = ["segment_sum"]


def segment_sum(
    values: jax.Array,
    segment_ids: jax.Array,
    num_segments: int,
    *,
    backend: Backend | str | None = None,
) -> jax.Array:
    """`out[s] = sum(values[i] for segment_ids[i] == s)` for `values` `[N, ...]`.

    Segment ids may be sorted or not; ids outside [0, num_segments) are dropped.
    float32 and bfloat16 values; int32 and int64 segment ids.
    """
    values = jnp.asarray(values)
    segment_ids = as_ids("segment_sum: segment_ids", segment_ids)
    if segment_ids.shape != values.shape[:1]:
        raise ValueError(
            f"segment_sum: segment_ids shape {segment_ids.shape} must be [N] for values "
            f"of shape {values.shape}"
        )
    if resolve(backend) is Backend.REFERENCE or values.dtype not in _FFI_DTYPES:
        return reference.segment_sum(values, segment_ids, num_segments)
    return _segment_sum_ffi(values, segment_ids, num_segments)


_FFI_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _segment_sum_ffi(values, segment_ids, num_segments):
    return _ffi.segment_sum(values, segment_ids, num_segments)


def _fwd(values, segment_ids, num_segments):
    return _ffi.segment_sum(values, segment_ids, num_segments), segment_ids


def _bwd(num_segments, segment_ids, g):
    valid = (segment_ids >= 0) & (segment_ids < num_segments)
    rows = jnp.take(g, jnp.where(valid, segment_ids, 0), axis=0)
    mask = valid.reshape(valid.shape + (1,) * (g.ndim - 1))
    return jnp.where(mask, rows, 0).astype(g.dtype), None


_segment_sum_ffi.defvjp(_fwd, _bwd)
