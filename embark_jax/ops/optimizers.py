"""Sparse (row-wise, lazy) optimizers for embedding tables.

Each optimizer is a frozen spec with an `init(table) -> state` (a `NamedTuple` of slot
arrays) and a reference `update(table, state, rows, grads) -> (table, state)` that touches
only the given rows. `slot_shapes(vocab, dim)` declares the slots, so memory estimates ask
the optimizer instead of branching on its type; `slot_footprint` is the same as two numbers.
The fused kernel behind `embark_jax.ops.sparse_update` implements the same math; `kernel_id`
and `hparams` speak its ABI (`embark_jax.ops.abi`).

Rounding of bfloat16 tables: the math is float32; an updated element of a bfloat16 table is
stored to nearest even, or, given a `seed` (a uint32 scalar, a new one every step, e.g.
`rounding_seed(key, step)`), stochastically (`reference.stochastic_round_bf16`), which keeps
updates smaller than half a bfloat16 step on average instead of losing them. float32 tables
are stored exactly either way.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from embark_jax.ops import abi, reference

__all__ = [
    "SGD",
    "Adagrad",
    "AdagradState",
    "Adam",
    "AdamState",
    "RowWiseAdagrad",
    "RowWiseAdagradState",
    "SGDState",
    "SparseOptimizer",
    "pack_hparams",
    "rounding_seed",
    "with_rounding_seed",
]


class SGDState(NamedTuple):
    pass


class AdagradState(NamedTuple):
    accumulator: jax.Array  # [V, D]


class RowWiseAdagradState(NamedTuple):
    accumulator: jax.Array  # [V]: one accumulator per row


class AdamState(NamedTuple):
    m: jax.Array  # [V, D]
    v: jax.Array  # [V, D]
    count: jax.Array  # [] int32, number of updates applied


def _gather(x: jax.Array, rows: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.take(x, jnp.where(valid, rows, 0), axis=0)


def _scatter(x: jax.Array, rows: jax.Array, valid: jax.Array, values: jax.Array) -> jax.Array:
    return x.at[jnp.where(valid, rows, x.shape[0])].set(values.astype(x.dtype), mode="drop")


def _stored(table: jax.Array, rows: jax.Array, values: jax.Array, seed) -> jax.Array:
    """Updated rows in the table's dtype, rounded as the kernels round them."""
    if seed is not None and table.dtype == jnp.bfloat16:
        return reference.stochastic_round_bf16(values, seed, rows)
    return values.astype(table.dtype)


def with_rounding_seed(hparams: jax.Array, seed: jax.Array | int) -> jax.Array:
    """`hparams` asking the kernels for stochastic rounding of bfloat16 tables with the
    uint32 `seed` (split into two exact float32 halves, `abi.Hparam.SEED_LO` / `SEED_HI`)."""
    seed = jnp.asarray(seed).astype(jnp.uint32)
    lo = (seed & jnp.uint32(0xFFFF)).astype(jnp.float32)
    hi = (seed >> 16).astype(jnp.float32)
    hp = hparams.at[abi.Hparam.ROUNDING].set(1.0)
    return hp.at[abi.Hparam.SEED_LO].set(lo).at[abi.Hparam.SEED_HI].set(hi)


def rounding_seed(key: jax.Array, step: jax.Array | int) -> jax.Array:
    """`[]` uint32: the stochastic-rounding seed of update `step` under `key` (any uint32
    words, e.g. raw PRNG key data; a typed PRNG key is read through its key data). A hash,
    so every step gets fresh rounding bits, reproducibly: the same key and step give the
    same seed on every device and after a checkpoint restore."""
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    h = reference.mix32(jnp.asarray(step).astype(jnp.uint32) ^ jnp.uint32(0x85EBCA6B))
    for word in jnp.ravel(key).astype(jnp.uint32):
        h = reference.mix32(h ^ word)
    return h


def pack_hparams(**values) -> jax.Array:
    """The kernels' float32 hyper-parameter vector, laid out by `abi.Hparam`; entries not
    given are 0. Keyword names are the lower-case `abi.Hparam` names (`lr`, `eps`, ...)."""
    entries = [jnp.float32(0.0)] * abi.HPARAM_COUNT
    for name, value in values.items():
        entries[abi.Hparam[name.upper()]] = jnp.asarray(value, jnp.float32)
    return jnp.stack(entries)


def _check_hparam(opt: str, field: str, value: Any, bounds: tuple[float, float]) -> None:
    """A one-line `ValueError` naming the optimizer, field and value unless `value` is a
    finite real number in `[low, high)` (a NaN, inf, negative number or string is rejected)."""
    low, high = bounds
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(float(value)) and low <= float(value) < high
    if not ok:
        finite = math.isinf(high)
        want = f"a finite number >= {low:g}" if finite else f"a number in [{low:g}, {high:g})"
        raise ValueError(f"{opt}: {field} must be {want}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseOptimizer(abc.ABC):
    """Base of the sparse optimizers. Rows < 0 or >= V are padding and left untouched; the
    reference `update` expects unique rows (`ops.sparse_update` merges duplicates)."""

    learning_rate: float
    kernel_id: ClassVar[abi.OptimizerId]

    # field -> [low, high): the valid range of each hyper-parameter (checked at construction)
    _RANGES: ClassVar[dict[str, tuple[float, float]]] = {
        "learning_rate": (0.0, math.inf),
        "eps": (0.0, math.inf),
        "initial_accumulator": (0.0, math.inf),
        "b1": (0.0, 1.0),
        "b2": (0.0, 1.0),
    }

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name in self._RANGES:
                value = getattr(self, f.name)
                _check_hparam(type(self).__name__, f.name, value, self._RANGES[f.name])

    @abc.abstractmethod
    def slot_shapes(self, vocab: int, dim: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of each float32 optimizer slot of a [vocab, dim] table."""

    @abc.abstractmethod
    def init(self, table: jax.Array) -> Any: ...

    @abc.abstractmethod
    def _rows_update(self, w, slots, g, state) -> tuple[jax.Array, tuple[jax.Array, ...]]: ...

    def slot_bytes(self, vocab: int, dim: int) -> int:
        return sum(4 * math.prod(s) for s in self.slot_shapes(vocab, dim).values())

    @property
    def slot_footprint(self) -> tuple[int, int]:
        """(float32 slots per table element, float32 slots per row): the optimizer state of a
        [V, D] table is `V * (D * a + b)` floats. The kernel ABI's numbers for `kernel_id`;
        they agree with `slot_shapes` (tests/test_abi.py)."""
        return abi.SLOT_FOOTPRINT[self.kernel_id]

    def hparams(self, state: Any) -> jax.Array:
        """The fused kernel's hyper-parameter vector (layout `abi.Hparam`)."""
        return pack_hparams(lr=self.learning_rate)

    def kernel_slots(self, table: jax.Array, state: Any) -> tuple[jax.Array, jax.Array]:
        """The (at most two) slot arrays the kernel updates; unused ones are [1] dummies."""
        arrays = [x for x in state if x.ndim > 0]
        dummy = jnp.zeros((1,), jnp.float32)
        return (*arrays, dummy, dummy)[:2]

    def from_kernel_slots(self, state: Any, a: jax.Array, b: jax.Array) -> Any:
        """The state after the fused kernel returned slots `a` and `b`."""
        n = sum(1 for x in state if x.ndim > 0)
        return self._with_slots(state, (a, b)[:n])

    def update(self, table, state, rows, grads, *, seed=None):
        """Reference update of the unique `rows` with `grads` [C, D] (float32). With a `seed`
        (uint32), a bfloat16 table's updated elements round stochastically, bit for bit as
        the kernels round them; without, to nearest even."""
        valid = (rows >= 0) & (rows < table.shape[0])
        w = _gather(table, rows, valid).astype(jnp.float32)
        slots = tuple(_gather(s, rows, valid) for s in state if s.ndim > 0)
        new_w, new_slots = self._rows_update(w, slots, grads.astype(jnp.float32), state)
        table = _scatter(table, rows, valid, _stored(table, rows, new_w, seed))
        full = [s for s in state if s.ndim > 0]
        full = [_scatter(f, rows, valid, n) for f, n in zip(full, new_slots, strict=True)]
        return table, self._with_slots(state, full)

    def _with_slots(self, state, slots):
        """The state after one update whose new slot arrays are `slots`."""
        return type(state)(*slots)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(SparseOptimizer):
    kernel_id: ClassVar[abi.OptimizerId] = abi.OptimizerId.SGD

    def slot_shapes(self, vocab, dim):
        return {}

    def init(self, table):
        return SGDState()

    def _rows_update(self, w, slots, g, state):
        return w - self.learning_rate * g, ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(SparseOptimizer):
    initial_accumulator: float = 0.0
    eps: float = 1e-8
    kernel_id: ClassVar[abi.OptimizerId] = abi.OptimizerId.ADAGRAD

    def slot_shapes(self, vocab, dim):
        return {"accumulator": (vocab, dim)}

    def init(self, table):
        return AdagradState(jnp.full(table.shape, self.initial_accumulator, jnp.float32))

    def hparams(self, state):
        return pack_hparams(lr=self.learning_rate, eps=self.eps)

    def _rows_update(self, w, slots, g, state):
        acc = slots[0] + g * g
        return w - self.learning_rate * g / (jnp.sqrt(acc) + self.eps), (acc,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowWiseAdagrad(SparseOptimizer):
    initial_accumulator: float = 0.0
    eps: float = 1e-8
    kernel_id: ClassVar[abi.OptimizerId] = abi.OptimizerId.ROW_WISE_ADAGRAD

    def slot_shapes(self, vocab, dim):
        return {"accumulator": (vocab,)}

    def init(self, table):
        return RowWiseAdagradState(jnp.full(table.shape[:1], self.initial_accumulator, jnp.float32))

    def hparams(self, state):
        return pack_hparams(lr=self.learning_rate, eps=self.eps)

    def _rows_update(self, w, slots, g, state):
        acc = slots[0] + jnp.mean(g * g, axis=1)
        step = self.learning_rate / (jnp.sqrt(acc) + self.eps)
        return w - step[:, None] * g, (acc,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adam(SparseOptimizer):
    """Lazy Adam: moments and weights of untouched rows do not change; the bias correction
    uses the number of updates applied to the table (`count`)."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    kernel_id: ClassVar[abi.OptimizerId] = abi.OptimizerId.ADAM

    def slot_shapes(self, vocab, dim):
        return {"m": (vocab, dim), "v": (vocab, dim)}

    def init(self, table):
        z = jnp.zeros(table.shape, jnp.float32)
        return AdamState(z, z, jnp.zeros((), jnp.int32))

    def _corrections(self, state):
        t = (state.count + 1).astype(jnp.float32)
        return 1.0 - self.b1**t, 1.0 - self.b2**t

    def hparams(self, state):
        c1, c2 = self._corrections(state)
        lr_t = self.learning_rate * jnp.sqrt(c2) / c1
        eps_t = self.eps * jnp.sqrt(c2)
        return pack_hparams(lr=lr_t, eps=eps_t, b1=self.b1, b2=self.b2)

    def _rows_update(self, w, slots, g, state):
        # lr (m / c1) / (sqrt(v / c2) + eps), in float32 with the corrections folded into lr
        # and eps as in the kernels' hparams, so both compute the same float32 values
        hp = self.hparams(state)
        lr_t, eps_t, b1, b2 = (
            hp[h] for h in (abi.Hparam.LR, abi.Hparam.EPS, abi.Hparam.B1, abi.Hparam.B2)
        )
        m = b1 * slots[0] + (1.0 - b1) * g
        v = b2 * slots[1] + (1.0 - b2) * g * g
        return w - lr_t * m / (jnp.sqrt(v) + eps_t), (m, v)

    def _with_slots(self, state, slots):
        return AdamState(slots[0], slots[1], state.count + 1)
