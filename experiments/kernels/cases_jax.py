"""The JAX cases: ours (`embark`, the FFI kernels) and XLA's own lowering (`xla`).

Every function is `jax.jit`-compiled, takes the ids and segment ids as arguments (not as
baked-in constants), and the updating ones donate the table, as training does.

- forward: `ops.lookup_pool(..., indices_are_sorted=True)` (the path production takes) vs
  `jnp.take` + `jax.ops.segment_sum(..., indices_are_sorted=True)`; bf16: the same on a bf16
  table with a bf16 output (XLA sums in fp32 and rounds once, as ours does).
- backward_update: `ops.lookup_pool_backward_update` (fused backward + SGD) vs `jax.vjp` of the
  XLA forward + dense SGD `table - lr * grad`.
- backward_two_op (ours only): `lookup_pool_backward` (capacity: the distinct rows rounded up
  to 256, as a planner sizes it) + `sparse_update(assume_unique=True)`.
- train_step: forward, then the backward of its output gradient, then SGD, in one jit; the
  output gradient depends on the forward's output (as through a dense model), so the forward
  runs first and reads the table before the in-place update.
- unique: `ops.unique(ids, capacity)` vs `jnp.unique(ids, size=capacity, fill_value=-1,
  return_inverse=True, return_counts=True)`.
- segment_sum: `ops.segment_sum` vs `jax.ops.segment_sum(..., indices_are_sorted=True)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.ops import optimizers as O
from experiments.kernels import points as P
from experiments.kernels.cases import Box, Case, Data


def ffi_forward(table, ids, seg, num_segments):
    """Our forward as production calls it: bags in order, so the sorted path."""
    return ops.lookup_pool(table, ids, seg, num_segments, indices_are_sorted=True)


def xla_forward(table, ids, seg, num_segments):
    """XLA's lowering; sums a bf16 table's rows in fp32 and rounds once (as ours does)."""
    rows = jnp.take(table, ids, axis=0).astype(jnp.float32)
    out = jax.ops.segment_sum(rows, seg, num_segments=num_segments, indices_are_sorted=True)
    return out.astype(table.dtype)


def _after(out, g):
    """`g`, made to depend on `out` (never NaN): the update waits for the forward."""
    return jnp.where(jnp.isnan(out), 0.0, g)


def ffi_fused(t, g, ids, seg, lr=P.LEARNING_RATE):
    opt = O.SGD(learning_rate=lr)
    t, _, _ = ops.lookup_pool_backward_update(t, opt.init(t), g, ids, seg, optimizer=opt)
    return t


def ffi_two_op(t, g, ids, seg, capacity, lr=P.LEARNING_RATE):
    opt = O.SGD(learning_rate=lr)
    rows, rg, _ = ops.lookup_pool_backward(g, ids, seg, capacity=capacity, combiner="sum")
    t, _ = ops.sparse_update(t, opt.init(t), rows, rg, opt, assume_unique=True)
    return t


def xla_dense_sgd(t, g, ids, seg, lr=P.LEARNING_RATE):
    _, vjp = jax.vjp(lambda tt: xla_forward(tt, ids, seg, g.shape[0]), t)
    return t - lr * vjp(g)[0]


def ffi_train_step(t, g, ids, seg):
    return ffi_fused(t, _after(ffi_forward(t, ids, seg, g.shape[0]), g), ids, seg)


def xla_train_step(t, g, ids, seg):
    return xla_dense_sgd(t, _after(xla_forward(t, ids, seg, g.shape[0]), g), ids, seg)


def _ready(x):
    """Waits for `x`. A single array waits through its own method: `jax.block_until_ready`
    first walks its argument as a pytree, which costs ~0.7 us a call here, a harness cost
    the torch side does not pay (its CPU ops return finished tensors)."""
    if isinstance(x, jax.Array):
        return x.block_until_ready()
    return jax.block_until_ready(x)


class JaxCases:
    """Builds the cases of one JAX library (`embark` or `xla`) on a point's data."""

    def __init__(self, lib: str, data: Data):
        self.lib, self.d = lib, data
        self.ids = jnp.asarray(data.ids)
        self.seg = jnp.asarray(data.seg)
        self.table = jnp.asarray(data.table)
        self.grads = jnp.asarray(data.grads)

    def cases(self, op: str) -> dict[str, Case]:
        build = getattr(self, f"_{op}", None)
        if build is None or (self.lib == "xla" and op == "backward_two_op"):
            return {}
        return {self.lib: build()}

    def _pooled(self, table) -> Case:
        b = self.d.point.batch
        fn = ffi_forward if self.lib == "embark" else xla_forward
        f = jax.jit(functools.partial(fn, num_segments=b))
        box = Box()

        def run():
            box.value = _ready(f(table, self.ids, self.seg))

        rows = self.d.out_rows
        return Case(run, lambda: np.asarray(box.value[rows]).astype(np.float64))

    def _forward(self) -> Case:
        return self._pooled(self.table)

    def _forward_bf16(self) -> Case:
        return self._pooled(self.table.astype(jnp.bfloat16))

    def _updating(self, step) -> Case:
        f = jax.jit(step, donate_argnums=(0,))
        box = Box(jnp.array(self.table, copy=True))

        def run():
            box.value = _ready(f(box.value, self.grads, self.ids, self.seg))

        rows = self.d.table_rows
        return Case(run, lambda: np.asarray(box.value[rows]).astype(np.float64))

    def _backward_update(self) -> Case:
        return self._updating(ffi_fused if self.lib == "embark" else xla_dense_sgd)

    def _backward_two_op(self) -> Case:
        return self._updating(functools.partial(ffi_two_op, capacity=self.d.capacity))

    def _train_step(self) -> Case:
        return self._updating(ffi_train_step if self.lib == "embark" else xla_train_step)

    def _unique(self) -> Case:
        cap = self.d.capacity
        if self.lib == "embark":
            f = jax.jit(lambda i: ops.unique(i, cap)[:3])
        else:
            f = jax.jit(
                lambda i: jnp.unique(
                    i, return_inverse=True, return_counts=True, size=cap, fill_value=-1
                )
            )
        box = Box()

        def run():
            box.value = _ready(f(self.ids))

        def sample():
            uniq, inverse, counts = (np.asarray(x) for x in box.value)
            return self.d.unique_sample(uniq, inverse.reshape(-1), counts)

        return Case(run, sample)

    def _segment_sum(self) -> Case:
        b = self.d.point.batch
        values = jnp.asarray(self.d.values)
        if self.lib == "embark":
            f = jax.jit(lambda v, s: ops.segment_sum(v, s, b))
        else:
            f = jax.jit(lambda v, s: jax.ops.segment_sum(v, s, b, indices_are_sorted=True))
        box = Box()

        def run():
            box.value = _ready(f(values, self.seg))

        rows = self.d.out_rows
        return Case(run, lambda: np.asarray(box.value[rows]).astype(np.float64))


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Copy bandwidth (read + write bytes per second), the ceiling for these kernels: a numpy
    copy into a preallocated buffer on the CPU (one thread), a device copy on a GPU."""
    import time

    if jax.default_backend() == "cpu":
        src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        fn = lambda: np.copyto(dst, src)  # noqa: E731
    else:
        x = jnp.ones((nbytes // 4,), jnp.float32)
        f = jax.jit(lambda a: a + 1.0)
        fn = lambda: _ready(f(x))  # noqa: E731
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best
