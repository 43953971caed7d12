"""Thin `jax.ffi.ffi_call` wrappers around the native kernels (no autodiff here).

Target names and attribute ids come from the ABI mirror (`abi`). The native extension is
loaded and its targets registered by the first wrapper called (`native.ensure_registered`),
so importing `embark_jax.ops` stays cheap and never touches the native build.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax.ops import abi, native


def result_type(like: jax.Array, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    """Result type for an FFI output computed per device from `like`.

    Inside `shard_map` the result must carry the inputs' `manual_axis_type`; a plain
    `ShapeDtypeStruct` would mark it replicated and give silently wrong gradients
    (docs/design.md §7).
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


def on_gpu() -> bool:
    """Whether FFI calls traced now lower for the CUDA kernels (sizes their workspaces)."""
    return jax.default_backend() == "gpu"


def _workspace(like, nbytes: int):
    """An extra uint8 output the CUDA kernels use as scratch (CUDA-graph compatible: no
    allocation inside the kernel). One byte on the CPU, whose kernels need none."""
    return result_type(like, (max(int(nbytes), 1) if on_gpu() else 1,), jnp.uint8)


def _dedup_workspace(ids, d: int = 0):
    """The CUDA dedup's scratch for `ids`; with the split of hot ids' long runs into pieces
    for gradient rows of width `d` > 0 (sparse_grad, sparse_grad_update; dedup.cuh)."""
    if not on_gpu():
        return _workspace(ids, 1)
    from embark_jax import _ffi_cuda

    return _workspace(
        ids, _ffi_cuda.dedup_workspace_bytes(ids.shape[0], ids.dtype.itemsize, int(d))
    )


def _call(target: abi.Target, result_types, **kwargs):
    """`jax.ffi.ffi_call` of an ABI target; registers the kernels first if no call has yet.

    Registration must precede lowering, and every kernel call is traced through here, so
    this is the one place that needs it (idempotent and cheap after the first call).
    """
    native.ensure_registered()
    return jax.ffi.ffi_call(target.value, result_types, vmap_method="sequential", **kwargs)


def _in_place(target: abi.Target, table, slot_a, slot_b, *extra_results):
    """`_call` of a target that updates `table` and its two slot operands in place: they are
    operands 0-2 and results 0-2 (aliased), followed by `extra_results`."""
    return _call(
        target,
        (
            result_type(table, table.shape, table.dtype),
            result_type(slot_a, slot_a.shape, jnp.float32),
            result_type(slot_b, slot_b.shape, jnp.float32),
            *extra_results,
        ),
        input_output_aliases={0: 0, 1: 1, 2: 2},
    )


def segment_sum(values: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    values2 = values.reshape(values.shape[0], math.prod(values.shape[1:]))  # N = 0 too
    # The CUDA kernel adds bfloat16 values into a float32 [S, D] workspace (segment_sum.cu).
    ws = 4 * num_segments * values2.shape[1] if values.dtype == jnp.bfloat16 else 1
    out, _ = _call(
        abi.Target.SEGMENT_SUM,
        (
            result_type(values2, (num_segments, values2.shape[1]), values.dtype),
            _workspace(values2, ws),
        ),
    )(values2, segment_ids)
    return out.reshape((num_segments, *values.shape[1:]))


def lookup_pool(
    table,
    ids,
    segment_ids,
    weights,
    num_out: int,
    combiner: str,
    out_dtype,
    sorted_segments: bool,
    split: tuple[int, ...] | None = None,
):
    """`[num_out, D]`, or with `split` (row counts summing to `num_out`) a tuple of
    `[split[k], D]` pieces, rows one after the other: the CPU kernel writes each piece where it
    is (no sliced copy of one output); on a GPU the one output is sliced."""
    d = table.shape[1]
    combiner_id = abi.CombinerId[combiner.upper()]
    ws = 1
    if on_gpu():  # the CUDA kernel's scratch (lookup_pool.cu)
        from embark_jax import _ffi_cuda

        ws = _ffi_cuda.lookup_pool_workspace_bytes(num_out, d, int(combiner_id))
    sizes = (num_out,) if split is None or on_gpu() else tuple(split)
    _, *pieces = _call(
        abi.Target.LOOKUP_POOL,
        (_workspace(ids, ws), *(result_type(ids, (k, d), out_dtype) for k in sizes)),
    )(
        table,
        ids,
        segment_ids,
        weights,
        combiner=np.int64(combiner_id),
        indices_are_sorted=np.int64(sorted_segments),
    )
    if split is None:
        return pieces[0]
    if len(pieces) == 1 and len(split) > 1:
        return tuple(jnp.split(pieces[0], np.cumsum(split)[:-1].tolist()))
    return tuple(pieces)


def unique(ids, capacity: int):
    return _call(
        abi.Target.UNIQUE,
        (
            result_type(ids, (capacity,), ids.dtype),
            result_type(ids, ids.shape, jnp.int32),
            result_type(ids, (capacity,), jnp.int32),
            result_type(ids, (), jnp.int32),
            _dedup_workspace(ids),
        ),
    )(ids)[:4]


def sparse_grad(grads, ids, segment_ids, scale, capacity: int, per_id: bool):
    return _call(
        abi.Target.SPARSE_GRAD,
        (
            result_type(ids, (capacity,), ids.dtype),
            result_type(ids, (capacity, grads.shape[1]), jnp.float32),
            result_type(ids, (), jnp.int32),
            _dedup_workspace(ids, grads.shape[1]),
        ),
    )(grads, ids, segment_ids, scale, per_id=np.int64(per_id))[:3]


def sparse_update(table, slot_a, slot_b, rows, grads, hparams, kernel_id: int):
    return _in_place(abi.Target.SPARSE_UPDATE, table, slot_a, slot_b)(
        table, slot_a, slot_b, rows, grads, hparams, optimizer=np.int64(kernel_id)
    )


def sparse_grad_update(
    table, slot_a, slot_b, grads, ids, segment_ids, scale, hparams, kernel_id: int, per_id: bool
):
    operands = (table, slot_a, slot_b, grads, ids, segment_ids, scale, hparams)
    return _in_place(
        abi.Target.SPARSE_GRAD_UPDATE,
        table,
        slot_a,
        slot_b,
        result_type(ids, (), jnp.int32),
        _dedup_workspace(ids, table.shape[1]),
    )(*operands, optimizer=np.int64(kernel_id), per_id=np.int64(per_id))[:4]


def sparse_grad_stage(
    table,
    slot_a,
    slot_b,
    grads: tuple,
    ids,
    segment_ids,
    scale,
    hparams,
    kernel_id: int,
    per_id: bool,
    slot_widths: tuple[int, int],
    staging: tuple | None = None,
):
    """Returns `(rows, previous values, previous slot a, b, num_unique, finite, table,
    slot a, slot b)`: the last three updated in place (aliased). `table` `[..., V, D]` may
    carry leading dimensions (a `shard_map` block), its slots the same ones. `hparams` may
    carry extra elements after the ABI's (never read: values the update waits for).

    `grads`: the output gradient as one or more `[S_k, D]` pieces, rows one after the
    other. The CPU kernel reads them where they are; on a GPU they are concatenated first
    (the CUDA kernel takes one piece). `staging`: `(values, slot_a, slot_b)` shaped like the
    staged results, which then alias them (the kernel never reads them): donated, the staging
    memory is the caller's from the last step instead of fresh pages; None, or arrays of other
    shapes (made for another batch): fresh results."""
    if on_gpu() and len(grads) > 1:
        grads = (jnp.concatenate(grads),)
    n, d = ids.shape[0], table.shape[-1]
    c = min(n, math.prod(table.shape[:-1]))  # staged slots: at most this many distinct rows
    staged = [result_type(ids, (c, w) if w else (1,), jnp.float32) for w in slot_widths]
    results = (
        result_type(ids, (c,), ids.dtype),
        result_type(ids, (c, d), table.dtype),
        *staged,
        result_type(ids, (), jnp.int32),
        result_type(ids, (), jnp.int32),
        _dedup_workspace(ids, d),
        result_type(table, table.shape, table.dtype),
        result_type(slot_a, slot_a.shape, jnp.float32),
        result_type(slot_b, slot_b.shape, jnp.float32),
    )
    aliases = {0: 7, 1: 8, 2: 9}
    fits = staging is not None and all(
        x.shape == r.shape and x.dtype == r.dtype
        for x, r in zip(staging, results[1:4], strict=True)
    )
    if fits:
        aliases.update({7: 1, 8: 2, 9: 3})
    else:
        staging = (jnp.zeros((0,), jnp.float32),) * 3
    operands = (table, slot_a, slot_b, ids, segment_ids, scale, hparams, *staging, *grads)
    out = _call(abi.Target.SPARSE_GRAD_STAGE, results, input_output_aliases=aliases)(
        *operands, optimizer=np.int64(kernel_id), per_id=np.int64(per_id)
    )
    return (*out[:6], *out[7:])


def commit_rows(table, slot_a, slot_b, rows, values, staged_a, staged_b, commit, kernel_id: int):
    operands = (table, slot_a, slot_b, rows, values, staged_a, staged_b, commit)
    return _in_place(abi.Target.COMMIT_ROWS, table, slot_a, slot_b)(
        *operands, optimizer=np.int64(kernel_id)
    )
