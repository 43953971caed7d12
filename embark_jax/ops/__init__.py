"""Embedding ops: fused kernels through the XLA FFI with pure-JAX references beside them.

`embark_jax.ops.reference` holds the ground-truth semantics; the functions here pick the FFI
kernel where one exists (see `use_backend`).
"""

from embark_jax.ops import reference
from embark_jax.ops.backend import Backend, current_backend, use_backend
from embark_jax.ops.reference import lookup_pool, unique
from embark_jax.ops.segment import segment_sum

__all__ = [
    "Backend",
    "current_backend",
    "lookup_pool",
    "reference",
    "segment_sum",
    "unique",
    "use_backend",
]
