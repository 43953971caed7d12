"""Sparse (row-wise, lazy) optimizers for embedding tables, shaped like optax transforms.

Each optimizer is a frozen spec with a pure `init(table) -> state` (a `NamedTuple` of slot
arrays) and a pure row update: `hparams(state, step)` gives the step's hyper-parameters as
(traced) float32 scalars, `rows_update(w, slots, g, hp)` the new values of the gathered rows.
`update(table, state, rows, grads, step=...)` composes them into the reference update that
touches only the given rows. `slot_shapes(vocab, dim)` declares the slots, so memory estimates
ask the optimizer instead of branching on its type; `slot_footprint` is the same as two numbers.

The learning rate is a number or any optax schedule (a function of the step, e.g.
`optax.warmup_cosine_decay_schedule(...)`): it is evaluated inside the compiled step from the
step counter, a traced value, so a schedule changes the rate every step without recompiling.

The fused kernels behind `embark_jax.ops` implement the same math; `embark_jax.ops.update`
packs the state's slots and the hyper-parameters into the kernels' ABI (`embark_jax.ops.abi`).

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
from collections.abc import Callable
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
    "Schedule",
    "SparseOptimizer",
    "rounding_seed",
    "stored_values",
]

# An optax schedule: step (an int32 scalar, possibly traced) -> value.
Schedule = Callable[[jax.Array], jax.Array]


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


def stored_values(values: jax.Array, dtype, rows: jax.Array, seed) -> jax.Array:
    """Updated rows `values` `[C, D]` (float32) of table rows `rows` in the table's `dtype`,
    rounded as the kernels round them (stochastically for bfloat16 given a `seed`)."""
    if seed is not None and jnp.dtype(dtype) == jnp.bfloat16:
        return reference.stochastic_round_bf16(values, seed, rows)
    return values.astype(dtype)


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
    reference `update` expects unique rows (`ops.sparse_update` merges duplicates).

    `learning_rate`: a number >= 0 or an optax schedule (step -> rate), evaluated at the step
    counter the caller passes (`TrainState.step` in training: updates committed so far)."""

    learning_rate: float | Schedule
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
            if f.name not in self._RANGES:
                continue
            value = getattr(self, f.name)
            if f.name == "learning_rate" and callable(value):
                continue  # a schedule: its values are checked on device, every step
            _check_hparam(type(self).__name__, f.name, value, self._RANGES[f.name])

    @abc.abstractmethod
    def slot_shapes(self, vocab: int, dim: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of each float32 optimizer slot of a [vocab, dim] table."""

    @abc.abstractmethod
    def init(self, table: jax.Array) -> Any: ...

    @abc.abstractmethod
    def rows_update(
        self, w: jax.Array, slots: tuple[jax.Array, ...], g: jax.Array, hp: dict[str, jax.Array]
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The new values of gathered rows: weights `w` `[C, D]` float32, the state's slot
        arrays gathered at the same rows, gradients `g` `[C, D]`, hyper-parameters `hp`
        (`hparams`). Pure elementwise math; the kernels compute the same in float32."""

    @property
    def slot_names(self) -> tuple[str, ...]:
        """The state's fields that are slot arrays (one row per table row), in kernel order."""
        return tuple(self.slot_shapes(1, 1))

    def slot_arrays(self, state: Any) -> tuple[jax.Array, ...]:
        return tuple(getattr(state, name) for name in self.slot_names)

    def slot_bytes(self, vocab: int, dim: int) -> int:
        return sum(4 * math.prod(s) for s in self.slot_shapes(vocab, dim).values())

    @property
    def slot_footprint(self) -> tuple[int, int]:
        """(float32 slots per table element, float32 slots per row): the optimizer state of a
        [V, D] table is `V * (D * a + b)` floats. The kernel ABI's numbers for `kernel_id`;
        they agree with `slot_shapes` (tests/ops/test_abi.py)."""
        return abi.SLOT_FOOTPRINT[self.kernel_id]

    @property
    def scheduled(self) -> bool:
        """Whether the learning rate is a schedule (a function of the step)."""
        return callable(self.learning_rate)

    def learning_rate_at(self, step: jax.Array | int | None) -> jax.Array:
        """`[]` float32: the learning rate at `step` (a schedule needs one)."""
        if not self.scheduled:
            return jnp.float32(self.learning_rate)
        if step is None:
            raise ValueError(
                f"{type(self).__name__}: the learning rate is a schedule; pass the step "
                "(the number of updates applied so far)"
            )
        return jnp.asarray(self.learning_rate(jnp.asarray(step)), jnp.float32)

    def hparams(self, state: Any, step: jax.Array | int | None = None) -> dict[str, jax.Array]:
        """The step's hyper-parameters as float32 scalars, named as `abi.Hparam` (lower case):
        `lr` (the schedule at `step`) and what the optimizer adds."""
        return {"lr": self.learning_rate_at(step)}

    def advance(self, state: Any, slots: tuple[jax.Array, ...], applied: jax.Array | int = 1):
        """The state whose slot arrays are `slots` after an update; `applied` (0 or 1, may be
        traced) says whether the update was committed (Adam counts committed updates)."""
        return type(state)(*slots)

    def update(self, table, state, rows, grads, *, step=None, seed=None):
        """Reference update of the unique `rows` with `grads` [C, D] (float32) at `step`. With a
        `seed` (uint32), a bfloat16 table's updated elements round stochastically, bit for bit
        as the kernels round them; without, to nearest even."""
        valid = (rows >= 0) & (rows < table.shape[0])
        w = _gather(table, rows, valid).astype(jnp.float32)
        slots = tuple(_gather(s, rows, valid) for s in self.slot_arrays(state))
        new_w, new_slots = self.rows_update(
            w, slots, grads.astype(jnp.float32), self.hparams(state, step)
        )
        table = _scatter(table, rows, valid, stored_values(new_w, table.dtype, rows, seed))
        full = self.slot_arrays(state)
        full = [_scatter(f, rows, valid, n) for f, n in zip(full, new_slots, strict=True)]
        return table, self.advance(state, tuple(full))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(SparseOptimizer):
    kernel_id: ClassVar[abi.OptimizerId] = abi.OptimizerId.SGD

    def slot_shapes(self, vocab, dim):
        return {}

    def init(self, table):
        return SGDState()

    def rows_update(self, w, slots, g, hp):
        return w - hp["lr"] * g, ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Accumulating(SparseOptimizer):
    """Adagrad's family: one float32 `accumulator` slot of squared gradients, starting at
    `initial_accumulator`; the step divides by its square root plus `eps`."""

    initial_accumulator: float = 0.0
    eps: float = 1e-8
    state_type: ClassVar[type]

    def init(self, table):
        shape = self.slot_shapes(*table.shape)["accumulator"]
        return self.state_type(jnp.full(shape, self.initial_accumulator, jnp.float32))

    def hparams(self, state, step=None):
        return {"lr": self.learning_rate_at(step), "eps": jnp.float32(self.eps)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(_Accumulating):
    kernel_id: ClassVar[abi.OptimizerId] = abi.OptimizerId.ADAGRAD
    state_type: ClassVar[type] = AdagradState

    def slot_shapes(self, vocab, dim):
        return {"accumulator": (vocab, dim)}

    def rows_update(self, w, slots, g, hp):
        acc = slots[0] + g * g
        return w - hp["lr"] * g / (jnp.sqrt(acc) + hp["eps"]), (acc,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowWiseAdagrad(_Accumulating):
    """Adagrad with one accumulator per row: the mean of the row's squared gradients."""

    kernel_id: ClassVar[abi.OptimizerId] = abi.OptimizerId.ROW_WISE_ADAGRAD
    state_type: ClassVar[type] = RowWiseAdagradState

    def slot_shapes(self, vocab, dim):
        return {"accumulator": (vocab,)}

    def rows_update(self, w, slots, g, hp):
        acc = slots[0] + jnp.mean(g * g, axis=1)
        size = hp["lr"] / (jnp.sqrt(acc) + hp["eps"])
        return w - size[:, None] * g, (acc,)


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

    def hparams(self, state, step=None):
        # lr (m / c1) / (sqrt(v / c2) + eps) with the bias corrections c1, c2 of the update
        # count folded into lr and eps, in float32, as the kernels take them
        t = (state.count + 1).astype(jnp.float32)
        c1, c2 = 1.0 - self.b1**t, 1.0 - self.b2**t
        return {
            "lr": self.learning_rate_at(step) * jnp.sqrt(c2) / c1,
            "eps": self.eps * jnp.sqrt(c2),
            "b1": jnp.float32(self.b1),
            "b2": jnp.float32(self.b2),
        }

    def rows_update(self, w, slots, g, hp):
        b1, b2 = hp["b1"], hp["b2"]
        m = b1 * slots[0] + (1.0 - b1) * g
        v = b2 * slots[1] + (1.0 - b2) * g * g
        return w - hp["lr"] * m / (jnp.sqrt(v) + hp["eps"]), (m, v)

    def advance(self, state, slots, applied=1):
        return AdamState(slots[0], slots[1], state.count + jnp.asarray(applied, jnp.int32))
