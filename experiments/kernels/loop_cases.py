"""Loop mode: what ours (`embark`) and XLA's own ops (`xla`) compute, K times in one jit.

Each case is a `lax.fori_loop` of K iterations (K static, so XLA knows the trip count and a
GPU runs the loop without a host round trip per iteration) inside one `jax.jit` whose loop
state is donated. Iteration i+1's input depends on iteration i's output, so XLA can neither
hoist the op out of the loop nor merge iterations, and the dependency costs O(1), not O(table):

- `dep`: one element of the previous output compared with a sentinel passed at run time
  (never equal, but XLA cannot know), as 0 or 1;
- the ids (or the segment ids, and the output gradients) are loop state, and one element of
  each gets `+ dep` in place (`dynamic_update_slice`). `segment_sum` bumps its segment ids,
  not its values: XLA fused a bumped `[N, D]` into its scatter as well, copying it 4 times
  an iteration on the CPU (`loop.py` scans every loop for such copies);
- or, on a point whose distinct rows would fit in the GPU's L2 cache (the one-hot shapes),
  the ids are rotated instead: iteration i reads `(ids + i * (V // K) + dep) mod V`, so no
  iteration finds the previous one's rows in the cache (a training step touches other tables
  between two lookups of one). That costs one pass over the ids per iteration (8 bytes an id,
  1.5% of a float32 row of 128), which XLA fuses into its gather and our kernel gets as an
  operand;
- the updating op carries the table and its slot, updated in place by both (our fused kernel
  aliases them; XLA scatters into them).

Ops (ours vs XLA's own):
- forward: `ops.lookup_pool(indices_are_sorted=True)` vs `jnp.take` + `jax.ops.segment_sum`
  (a bfloat16 table is summed in float32 and rounded once by both);
- backward_rowwise_adagrad: `ops.lookup_pool_backward_update(optimizer=RowWiseAdagrad)` vs
  XLA's sparse backward: the output gradients gathered per id, `jnp.unique(size=C)`, a
  `segment_sum` into the C unique rows, and the optimizer's reference update (gathers and
  scatters of the touched rows and accumulators); bfloat16 tables round stochastically in both,
  with the same seed (the iteration);
- unique: `ops.unique(ids, C)` vs `jnp.unique(ids, size=C, return_inverse, return_counts)`;
- segment_sum: `ops.segment_sum` vs `jax.ops.segment_sum(indices_are_sorted=True)`.
C is the distinct ids rounded up to 256, as a planned capacity is. Every output of an
iteration is loop state, so nothing is dead code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from embark_jax import ops
from embark_jax.ops import optimizers as O
from experiments.kernels import points as P
from experiments.kernels.cases_jax import ffi_forward, xla_forward

LIBS = ("embark", "xla")
SENTINEL_INT = -7  # no id, count or number of unique ids is negative
SENTINEL_FLOAT = -1.0e30  # no pooled sum of rows in [-0.5, 0.5) gets near it


class PointData:
    """A point's inputs on the device: ids and segment ids (drawn on the host, as the
    per-call benchmark's), and the table, output gradients and values made on the device by
    a hash of each element's index (a 20 GB table in milliseconds, no temporaries; every
    library gets the same values)."""

    def __init__(self, p: P.Point, seed: int = P.SEED):
        self.point = p
        host = P.make_ids(p, seed).reshape(-1)
        seen = np.zeros(p.vocab, bool)
        seen[host] = True
        uniq = np.flatnonzero(seen)  # sorted distinct ids, without a sort
        self.unique_rows = len(uniq)
        self.capacity = P.two_op_capacity(self.unique_rows)
        self.ids = jnp.asarray(host)
        self.seg = jnp.asarray(P.segment_ids(p))
        self.out_rows = P.sample_rows(p.batch)
        self.table_rows = uniq[P.sample_rows(len(uniq))]
        self.id_rows = P.sample_rows(p.num_ids)
        self._seed = seed
        self._table = None

    def _make(self, what: int, shape, dtype):
        return _pattern(tuple(shape), jnp.dtype(dtype), self._seed * 16 + what)

    def table(self) -> jax.Array:
        """The point's table (kept for the non-updating ops)."""
        if self._table is None:
            self._table = self.fresh_table()
        return self._table

    def fresh_table(self) -> jax.Array:
        """A new copy of the table (the updating ops consume theirs)."""
        p = self.point
        return self._make(1, (p.vocab, p.dim), p.dtype)

    def drop_table(self) -> None:
        self._table = None

    def grads(self) -> jax.Array:
        p = self.point
        return self._make(2, (p.batch, p.dim), jnp.float32) * 2.0

    def values(self) -> jax.Array:
        p = self.point
        return self._make(3, (p.num_ids, p.dim), jnp.float32) * 2.0


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _pattern(shape, dtype, salt: int):
    """Values in [-0.5, 0.5): a multiply-xorshift hash of each element's row and column."""
    row = lax.broadcasted_iota(jnp.uint32, shape, 0)
    col = lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1) if len(shape) > 1 else 0
    h = row * jnp.uint32(0x9E3779B1) ^ (col + jnp.uint32(salt)) * jnp.uint32(0x85EBCA77)
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        h = (h ^ (h >> shift)) * jnp.uint32(mul)
    h = h ^ (h >> 16)
    return ((h >> 8).astype(jnp.float32) * (1.0 / (1 << 24)) - 0.5).astype(dtype)


@dataclasses.dataclass
class LoopCase:
    """One library's op as a loop: `fn(state, *aux)` runs K iterations and returns the new
    state (donated: call it again on its result). `init()` makes the first state, `sample`
    reads the rows compared across libraries, `buffers` names the large loop-state arrays
    (the HLO must not copy them)."""

    op: str
    lib: str
    iters: int
    fn: Callable
    init: Callable[[], tuple]
    aux: tuple
    sample: Callable[[tuple], np.ndarray]
    buffers: dict


def _dep(x: jax.Array, sentinel: jax.Array) -> jax.Array:
    """0 (or 1 if the first element of `x` equals `sentinel`, which never happens), int32."""
    first = lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(())
    return (first.astype(sentinel.dtype) == sentinel).astype(jnp.int32)


def _bump(x: jax.Array, dep: jax.Array) -> jax.Array:
    """`x` with `dep` added to its first element, in place (O(1))."""
    corner = lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)
    return lax.dynamic_update_slice(x, corner + dep.astype(x.dtype), (0,) * x.ndim)


def _rotated(ids0: jax.Array, i: jax.Array, dep: jax.Array, vocab: int, iters: int):
    """Iteration i's ids: `(ids0 + i * (V // K) + dep) mod V` (each iteration other rows)."""
    shifted = ids0 + i.astype(jnp.int32) * max(vocab // iters, 1) + dep
    return jnp.where(shifted >= vocab, shifted - vocab, shifted)


def rotated_ids(ids0: np.ndarray, i: int, vocab: int, iters: int) -> np.ndarray:
    """`_rotated` on the host, for the checks (dep = 0)."""
    return (ids0.astype(np.int64) + i * max(vocab // iters, 1)) % vocab


def _named(fn, name: str):
    """`fn` jitted under `name` (the XLA module is `jit_<name>`: the profile finds it)."""
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn, donate_argnums=(0,))


def _shape(x) -> tuple[str, tuple[int, ...]]:
    return (str(x.dtype), tuple(x.shape))


def forward(lib: str, d: PointData, iters: int, rotate: bool) -> LoopCase:
    p = d.point
    pool = ffi_forward if lib == "embark" else xla_forward
    table = d.table()
    sent = jnp.float32(SENTINEL_FLOAT)

    def loop(state, table, ids0, seg, sent):
        def body(i, s):
            ids, out = s
            dep = _dep(out, sent)
            if rotate:
                x = _rotated(ids0, i, dep, p.vocab, iters)
            else:
                ids = x = _bump(ids, dep)
            return ids, pool(table, x, seg, p.batch)

        return lax.fori_loop(0, iters, body, state)

    def init():
        return (jnp.array(d.ids, copy=True), jnp.zeros((p.batch, p.dim), table.dtype))

    def sample(state):
        return np.asarray(state[1][d.out_rows]).astype(np.float64)

    bufs = {} if rotate else {"ids": _shape(d.ids)}
    fn = _named(loop, f"loop_forward_{lib}")
    return LoopCase("forward", lib, iters, fn, init, (table, d.ids, d.seg, sent), sample, bufs)


def _xla_rowwise(table, acc, g, ids, seg, capacity, opt, seed):
    """XLA's sparse backward + optimizer: per-id gradients, dedup, sum per unique row, then
    the optimizer's reference update of those rows only."""
    per_id = jnp.take(g, seg, axis=0)
    uniq, inverse = jnp.unique(ids, size=capacity, fill_value=-1, return_inverse=True)
    rows_grad = jax.ops.segment_sum(per_id, inverse.reshape(-1), num_segments=capacity)
    table, state = opt.update(table, O.RowWiseAdagradState(acc), uniq, rows_grad, seed=seed)
    return table, state.accumulator


def backward_rowwise_adagrad(lib: str, d: PointData, iters: int, rotate: bool) -> LoopCase:
    p = d.point
    opt = O.RowWiseAdagrad(learning_rate=P.LEARNING_RATE)
    bf16 = p.dtype == "bfloat16"
    cap = d.capacity
    sent = jnp.float32(SENTINEL_FLOAT)

    def update(table, acc, g, ids, seg, seed):
        if lib == "embark":
            state = O.RowWiseAdagradState(acc)
            table, state, _ = ops.lookup_pool_backward_update(
                table, state, g, ids, seg, optimizer=opt, seed=seed
            )
            return table, state.accumulator
        return _xla_rowwise(table, acc, g, ids, seg, cap, opt, seed)

    def loop(state, ids0, seg, sent):
        def body(i, s):
            table, acc, g, ids = s
            dep = _dep(table, sent)
            g = _bump(g, dep)
            if rotate:
                x = _rotated(ids0, i, dep, p.vocab, iters)
            else:
                ids = x = _bump(ids, dep)
            seed = i.astype(jnp.uint32) if bf16 else None
            table, acc = update(table, acc, g, x, seg, seed)
            return table, acc, g, ids

        return lax.fori_loop(0, iters, body, state)

    def init():
        table = d.fresh_table()
        acc = jnp.zeros((p.vocab,), jnp.float32)
        return table, acc, d.grads(), jnp.array(d.ids, copy=True)

    rows = d.table_rows
    if rotate:  # the rows the last iteration updated
        rows = np.unique(rotated_ids(rows, iters - 1, p.vocab, iters))

    def sample(state):
        table, acc = np.asarray(state[0][rows]), np.asarray(state[1][rows])
        return np.concatenate([table.astype(np.float64).ravel(), acc.astype(np.float64)])

    bufs = {
        "table": (p.dtype, (p.vocab, p.dim)),
        "accumulator": ("float32", (p.vocab,)),
        "grads": ("float32", (p.batch, p.dim)),
    }
    if not rotate:
        bufs["ids"] = _shape(d.ids)
    fn = _named(loop, f"loop_backward_rowwise_adagrad_{lib}")
    return LoopCase(
        "backward_rowwise_adagrad", lib, iters, fn, init, (d.ids, d.seg, sent), sample, bufs
    )


def unique(lib: str, d: PointData, iters: int, rotate: bool) -> LoopCase:
    cap = d.capacity
    sent = jnp.int32(SENTINEL_INT)

    def dedup(ids):
        if lib == "embark":
            uniq, inverse, counts, _ = ops.unique(ids, cap)
        else:
            uniq, inverse, counts = jnp.unique(
                ids, size=cap, fill_value=-1, return_inverse=True, return_counts=True
            )
        return tuple(x.reshape(-1).astype(jnp.int32) for x in (uniq, inverse, counts))

    def loop(state, sent):
        def body(i, s):
            ids, _, _, counts = s
            ids = _bump(ids, _dep(counts, sent))
            return (ids, *dedup(ids))

        return lax.fori_loop(0, iters, body, state)

    n = d.point.num_ids

    def init():
        zeros = jnp.zeros((cap,), jnp.int32)
        return jnp.array(d.ids, copy=True), zeros, jnp.zeros((n,), jnp.int32), zeros + 1

    def sample(state):
        k = min(64, d.unique_rows)
        uniq, inverse, counts = (np.asarray(x) for x in state[1:])
        parts = [uniq[:k], counts[:k], inverse[d.id_rows]]
        return np.concatenate([x.astype(np.int64).ravel() for x in parts])

    fn = _named(loop, f"loop_unique_{lib}")
    return LoopCase("unique", lib, iters, fn, init, (sent,), sample, {"ids": _shape(d.ids)})


def segment_sum(lib: str, d: PointData, iters: int, rotate: bool) -> LoopCase:
    p = d.point
    sent = jnp.float32(SENTINEL_FLOAT)

    def reduce(values, seg):
        if lib == "embark":
            return ops.segment_sum(values, seg, p.batch)
        return jax.ops.segment_sum(values, seg, p.batch, indices_are_sorted=True)

    # the segment ids in each library's own shape: [N] for our kernel, [N, 1] for XLA's
    # scatter (bumping one shape and reshaping it for the op made XLA duplicate the update,
    # copying the ids 4 times an iteration on the CPU)
    seg_shape = (p.num_ids,) if lib == "embark" else (p.num_ids, 1)

    def loop(state, values, sent):
        def body(i, s):
            seg, out = s
            seg = _bump(seg, _dep(out, sent))
            return seg, reduce(values, seg.reshape(-1))

        return lax.fori_loop(0, iters, body, state)

    def init():
        seg = jnp.array(d.seg, copy=True).reshape(seg_shape)
        return seg, jnp.zeros((p.batch, p.dim), jnp.float32)

    def sample(state):
        return np.asarray(state[1][d.out_rows]).astype(np.float64)

    values = d.values()
    bufs = {"values": _shape(values), "segment_ids": ("int32", seg_shape)}
    fn = _named(loop, f"loop_segment_sum_{lib}")
    return LoopCase("segment_sum", lib, iters, fn, init, (values, sent), sample, bufs)


BUILDERS = {
    "forward": forward,
    "backward_rowwise_adagrad": backward_rowwise_adagrad,
    "unique": unique,
    "segment_sum": segment_sum,
}


def copy_case(nbytes: int, iters: int) -> LoopCase:
    """The copy reference: K in-place passes `x = x * c` over `nbytes / 2` bytes of float32
    (c = 1.0 passed at run time), each reading and writing every element: `nbytes` moved per
    iteration, the traffic of a device-to-device copy of `nbytes / 2`."""
    n = max(nbytes // 8, 1)
    c = jnp.float32(1.0)

    def loop(x, c):
        return lax.fori_loop(0, iters, lambda i, v: v * c, x)

    def init():
        return jnp.ones((n,), jnp.float32)

    fn = _named(loop, "loop_copy")
    return LoopCase("copy", "copy", iters, fn, init, (c,), lambda s: np.zeros(0), {})
