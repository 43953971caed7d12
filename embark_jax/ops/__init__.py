"""Embedding ops: fused kernels through the XLA FFI with pure-JAX references beside them.

`embark_jax.ops.reference` holds the ground-truth semantics; the functions here run the FFI
kernel by default and the reference with `backend="reference"` or inside
`use_backend("reference")`.
"""

from embark_jax.ops import reference
from embark_jax.ops.backend import Backend, current_backend, use_backend
from embark_jax.ops.lookup import lookup_pool, lookup_pool_backward, unique
from embark_jax.ops.segment import segment_sum
from embark_jax.ops.update import (
    StagedUpdate,
    Staging,
    commit_update,
    lookup_pool_backward_update,
    merge_duplicate_rows,
    read_marker,
    sparse_update,
    stage_backward_update,
)

__all__ = [
    "Backend",
    "StagedUpdate",
    "Staging",
    "commit_update",
    "current_backend",
    "lookup_pool",
    "lookup_pool_backward",
    "lookup_pool_backward_update",
    "merge_duplicate_rows",
    "read_marker",
    "reference",
    "segment_sum",
    "sparse_update",
    "stage_backward_update",
    "unique",
    "use_backend",
]
