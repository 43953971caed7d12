"""`StepRunner`: runs the compiled train step on batches without waiting for the device.

The step (`training.step`) updates the tables in place and decides on the device whether to
commit, so the runner always donates the state, and the state it returns is always the one
to keep: a refused step's state is bit-identical to the state before it.

The host does not wait for the device in the steady state. `step` enqueues step t and only
then reads the flags of step t-1 (one step late, while step t runs); loss, AUC, log loss and
the overflow counts accumulate on the device (`metrics.DeviceMetrics`, running sums that
any process reads on its own, running nothing) and reach the host when asked for
(`totals()`), and once every `READ_EVERY` steps so that their uint32 counts are read before
they could wrap twice. A batch given on the host is validated and placed by `place` (call it
ahead, e.g. in `data.prefetch.Prefetcher`'s thread, to overlap it with the running step); a
batch already on the devices is taken as placed by `place`.

When a step is refused (its loss, dense update or touched rows not finite; or, under
`overflow="error"`, ids lost to a capacity or outside their table), the next call that reads
its flags (`step` of a later batch, or `sync`) raises, naming the step it happened in. From
that step on, the device refuses every step already enqueued (the runner's halt flag), so the
error's `state` is the last committed state. With `skip_nonfinite=True` non-finite steps are
only counted (`Totals.refused`) and training goes on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax.core.options import OverflowPolicy
from embark_jax.data.batch import Batch
from embark_jax.sharding import hlo_bytes
from embark_jax.sharding.capacity import grow_capacities
from embark_jax.sharding.checks import CapacityOverflowError, InvalidIdError
from embark_jax.sharding.dynamic import COUNT_NAMES
from embark_jax.training.metrics import DeviceMetrics, HostSums, StreamingAUC
from embark_jax.training.state import TrainSetup, TrainState, init_staging, with_plan
from embark_jax.training.step import (
    Refusal,
    compile_eval_step,
    dynamic_lost,
    eval_step,
    train_step,
)

__all__ = ["READ_EVERY", "NonFiniteLossError", "StepResult", "StepRunner", "Totals"]

# Steps between two automatic reads of the device metrics (their uint32 counts stay exact
# for batches up to 2**31 / READ_EVERY samples).
READ_EVERY = 1024
_NONFINITE = Refusal.LOSS | Refusal.DENSE | Refusal.SPARSE


class NonFiniteLossError(FloatingPointError):
    """A step's loss, dense update or updated table rows held NaN or inf; the step was not
    applied. `step` is the step it happened in (counting from 1; `position`: its data
    position); `state`, when raised by `StepRunner.step`, the last committed state (use it:
    the state passed in was donated)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What `StepRunner.step` returns besides the state: the step's `number` (the runner's
    count, from 0), its `position` label, and its mean `loss` as a device scalar (reading it,
    `float(result.loss)`, waits for the step)."""

    number: int
    position: int
    loss: jax.Array


@dataclasses.dataclass
class Totals:
    """Sums over the steps a runner ran (host copies of the device metrics): steps run and
    committed, the committed steps' losses, their predictions' AUC / log loss (`auc`), and
    per fixed table the ids lost to a capacity (`overflow`) and outside their table
    (`invalid`), and per dynamic table its counts by name (`dynamic`,
    `sharding.dynamic.COUNT_NAMES`: its lost ids are `dropped` + `overflow`)."""

    steps: int
    applied: int
    loss_sum: float
    auc: StreamingAUC
    overflow: dict[str, int]
    invalid: dict[str, int]
    dynamic: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def refused(self) -> int:
        return self.steps - self.applied

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.applied if self.applied else float("nan")

    def copy(self) -> Totals:
        return dataclasses.replace(
            self,
            auc=self.auc.copy(),
            overflow=dict(self.overflow),
            invalid=dict(self.invalid),
            dynamic={k: dict(v) for k, v in self.dynamic.items()},
        )

    def since(self, earlier: Totals) -> Totals:
        """What was added after `earlier` (a `copy` taken then): a window of steps."""
        return Totals(
            self.steps - earlier.steps,
            self.applied - earlier.applied,
            self.loss_sum - earlier.loss_sum,
            self.auc.since(earlier.auc),
            {k: v - earlier.overflow[k] for k, v in self.overflow.items()},
            {k: v - earlier.invalid[k] for k, v in self.invalid.items()},
            {
                t: {k: v - earlier.dynamic[t][k] for k, v in counts.items()}
                for t, counts in self.dynamic.items()
            },
        )


def _run_step(setup: TrainSetup, halting: int, state, sums, halted, batch):
    """The compiled unit: one train step, its metrics added on device, the halt flag and a
    small flag vector `[status, overflow..., invalid...]` for the host's one-step-late check
    (with dynamic tables: `[status, overflow..., lost..., invalid..., routing overflow...]`)."""
    new, m = train_step(setup, state, batch, allow=~halted)
    sums = sums.add_step(m, batch.labels)
    halted = halted | ((m["status"] & halting) != 0)
    if "dynamic" not in m:
        parts = [m["overflow"], m["invalid"]]
    else:
        routed = m["dynamic"][:, list(COUNT_NAMES).index("overflow")]
        parts = [m["overflow"], dynamic_lost(m["dynamic"]), m["invalid"], routed]
    flags = jnp.concatenate([m["status"][None], *parts])
    return new, sums, halted, flags, m["loss"]


def _eval_sums(setup: TrainSetup, sums: DeviceMetrics, state, batch) -> DeviceMetrics:
    return sums.add_predictions(batch.labels, eval_step(setup, state, batch), jnp.bool_(True))


def _fetch(tree):
    """Host copies of replicated device arrays (each process reads its own copy)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


class StepRunner:
    """Host side of training: `state, result = runner.step(state, batch)`.

    Arguments:
      setup: the `TrainSetup`; its `options.overflow` is the overflow policy: `count`
        (report the dropped ids), `error` (refuse the step and raise `CapacityOverflowError`
        or `InvalidIdError`) or `grow` (count, double the overflowing tables' capacities and
        recompile: later steps fit; the ids dropped before got no update).
      validate_inputs: check host batches (`Batch.validate`) before placing them.
      skip_nonfinite: count non-finite steps and go on (each is refused: nothing of it is
        applied) instead of raising `NonFiniteLossError`.
    """

    def __init__(
        self, setup: TrainSetup, *, validate_inputs: bool = True, skip_nonfinite: bool = False
    ):
        self.validate_inputs = validate_inputs
        self.skip_nonfinite = skip_nonfinite
        self._halting = int(Refusal.OVERFLOW | Refusal.INVALID | Refusal.HALTED)
        if not skip_nonfinite:
            self._halting |= int(_NONFINITE)
        self._compiled_before = 0
        self._generation = 0  # plans compiled so far (grown capacities make a new one)
        self._count = 0
        self._pending: list[tuple[int, int, jax.Array, jax.Array]] = []
        self._compile(setup)
        self._sums = self._zeros()
        self._halted = self._not_halted()
        self._host = HostSums(len(setup.plan.tables))
        self._since_read = 0

    def _compile(self, setup: TrainSetup) -> None:
        if getattr(self, "_fn", None) is not None:
            self._compiled_before += self._fn._cache_size()
            self._generation += 1
        self.setup = setup
        run = functools.partial(_run_step, setup, self._halting)
        self._fn = jax.jit(run, donate_argnums=(0, 1, 2))
        self._eval = compile_eval_step(setup)
        self._eval_sums = jax.jit(functools.partial(_eval_sums, setup), donate_argnums=(0,))

    # Made by programs every process runs at the same point (construction, `evaluate`, a
    # refusal every process sees): a `device_put` would be a collective in several processes.
    def _zeros(self) -> DeviceMetrics:
        n, d = len(self.setup.plan.tables), len(self._dynamic_names())
        return jax.jit(
            lambda: DeviceMetrics.zeros(n, num_dynamic=d), out_shardings=self.setup.replicated
        )()

    def _dynamic_names(self) -> list[str]:
        dyn = self.setup.dynamic
        return [t.name for t in dyn.config.tables] if dyn is not None else []

    def _not_halted(self) -> jax.Array:
        return jax.jit(lambda: jnp.bool_(False), out_shardings=self.setup.replicated)()

    # --- batches ---------------------------------------------------------------------

    def put_batch(self, batch: Batch) -> Batch:
        """Places a global host batch on the mesh; with several processes each one supplies
        only its own rows (its devices' slice of the batch)."""
        sharding = self.setup.table_sharding
        if jax.process_count() == 1:
            return jax.device_put(batch, sharding)
        n, pid = jax.process_count(), jax.process_index()
        rows = batch.batch_size // n
        local = jax.tree.map(lambda x: np.asarray(x)[pid * rows : (pid + 1) * rows], batch)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)

    def check_batch(self, batch: Batch) -> None:
        """Host-side checks of a training batch; `ValueError` naming what is wrong."""
        batch.validate(
            self.setup.config,
            num_devices=self.setup.plan.topology.num_devices,
            num_dense=self.setup.num_dense,
            dynamic=self.setup.dynamic.config if self.setup.dynamic else None,
        )

    def place(self, batch: Batch) -> Batch:
        """A host batch validated (`validate_inputs`) and placed on the mesh; a batch whose
        arrays are already on the devices as it is (the on-device id checks still apply).
        Thread-safe: call it ahead of `step` in a background thread."""
        if all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):
            return batch
        if self.validate_inputs:
            self.check_batch(batch)
        return self.put_batch(batch)

    # --- steps -----------------------------------------------------------------------

    def step(
        self, state: TrainState, batch: Batch, position: int | None = None
    ) -> tuple[TrainState, StepResult]:
        """Enqueues one training step and returns its state (the input state is donated:
        use the returned one) without waiting for it; then checks the step before it. An
        error about an earlier step carries the newest state as `error.state` (the last
        committed state: the device refused everything after the refused step).
        `position`: the step's label in messages (default: its number)."""
        _check_not_donated(state)
        batch = self.place(batch)
        new, self._sums, self._halted, flags, loss = self._fn(
            state, self._sums, self._halted, batch
        )
        number = self._count
        self._count += 1
        position = number if position is None else int(position)
        self._pending.append((position, self._generation, flags, loss))
        self._since_read += 1
        generation = self._generation
        try:
            self._check_pending(keep=1)
            if self._since_read >= READ_EVERY:
                self._read()
        except (NonFiniteLossError, CapacityOverflowError, InvalidIdError) as e:
            e.state = new
            raise
        if self._generation != generation and new.staging:  # sized for the grown plan
            new = new.replace(staging=init_staging(self.setup, new.tables, new.slots))
        return new, StepResult(number, position, loss)

    def sync(self) -> None:
        """Waits for every enqueued step and checks it (raises as `step` does, with no
        `state`: the caller holds the newest one)."""
        self._check_pending(keep=0)

    def _check_pending(self, keep: int) -> None:
        while len(self._pending) > keep:
            position, generation, flags, loss = self._pending.pop(0)
            self._check(position, generation, *_fetch((flags, loss)))

    def _check(self, position: int, generation: int, flags: np.ndarray, loss) -> None:
        names = [t.name for t in self.setup.plan.tables]
        dyn = self._dynamic_names()
        lost_names = names + dyn
        status = Refusal(int(flags[0]))
        overflow = dict(zip(lost_names, flags[1 : 1 + len(lost_names)].tolist(), strict=True))
        end = 1 + len(lost_names) + len(names)
        invalid = dict(zip(names, flags[1 + len(lost_names) : end].tolist(), strict=True))
        routed = [n for n, v in zip(dyn, flags[end:].tolist(), strict=True) if v > 0]
        grow = self.setup.options.overflow is OverflowPolicy.GROW
        # a step run before the last growth already had its overflow answered
        if grow and generation == self._generation:
            self._grow([n for n in names if overflow[n] > 0], routed)
        if not status & self._halting or status == Refusal.HALTED:
            return
        self._pending.clear()  # steps after it were refused by the halt flag
        self._halted = self._not_halted()
        raise _refusal_error(status, position, float(loss), overflow, invalid)

    def _grow(self, grown: list[str], routed: list[str]) -> None:
        """Under `overflow="grow"`: the fixed tables that overflowed get larger routing
        capacities (`grow_capacities`), the dynamic tables whose ids overflowed their
        routing buckets twice the buckets (`DynamicShards.grown`); then one recompile. A
        dynamic table's own capacity (its state's shape) does not grow: its dropped ids,
        a bucket full, stay counted."""
        setup = self.setup
        if grown:
            plan = grow_capacities(setup.plan, grown, setup.options, lowered=setup.lowered)
            setup = with_plan(setup, plan)
        if routed:
            setup = dataclasses.replace(setup, dynamic=setup.dynamic.grown(routed))
        if grown or routed:
            self._compile(setup)

    # --- metrics ---------------------------------------------------------------------

    def _read(self) -> None:
        """Reads the device sums into the host totals (waits for the steps enqueued so far;
        runs nothing on the device)."""
        self._host.read(_fetch(self._sums))
        self._since_read = 0

    def totals(self) -> Totals:
        """The sums over every step run so far (waits for the device: call it when printing
        or logging, not every step). Any process may call it alone."""
        self._read()
        c, names = self._host.counts, [t.name for t in self.setup.plan.tables]
        auc = StreamingAUC()
        auc.add_sums(c["pos"], c["neg"], self._host.floats["logloss"], int(c["samples"]))
        return Totals(
            int(c["steps"]),
            int(c["applied"]),
            self._host.floats["loss"],
            auc,
            {n: int(v) for n, v in zip(names, c["overflow"], strict=True)},
            {n: int(v) for n, v in zip(names, c["invalid"], strict=True)},
            {
                t: dict(zip(COUNT_NAMES, (int(v) for v in row), strict=True))
                for t, row in zip(self._dynamic_names(), c["dynamic"], strict=True)
            },
        )

    def evaluate(self, state: TrainState, batches: Iterable[Batch]) -> dict[str, float]:
        """AUC and log loss of the model over `batches` (no update), summed on the device."""
        sums = self._zeros()
        for b in batches:
            sums = self._eval_sums(sums, state, self.place(b))
        host = HostSums(len(self.setup.plan.tables))
        host.read(_fetch(sums))
        acc = StreamingAUC()
        c = host.counts
        acc.add_sums(c["pos"], c["neg"], host.floats["logloss"], int(c["samples"]))
        return {"auc": acc.auc(), "logloss": acc.logloss()}

    # --- introspection ---------------------------------------------------------------

    def compiled_step(self, state: TrainState, batch: Batch):
        """The compiled step the runner runs (its metrics included); the same executable
        `step` calls, compiled once."""
        placed = self.place(batch)
        return self._fn.lower(state, self._sums, self._halted, placed).compile()

    def comm_bytes_per_step(self, state: TrainState, batch: Batch) -> dict[str, Any]:
        """Bytes of every collective in one compiled step, by kind and mesh axis."""
        mesh = self.setup.mesh
        mesh_shape = tuple(mesh.shape.values())
        compiled = self.compiled_step(state, batch)
        by_axis = hlo_bytes.collective_bytes(compiled, mesh_shape, mesh.axis_names)
        return {
            "by_kind_axis": {f"{k}/{a}": v for (k, a), v in sorted(by_axis.items())},
            "total": int(sum(by_axis.values())),
            "links": hlo_bytes.link_bytes(by_axis, mesh_shape),
        }

    def num_compilations(self) -> int:
        """Train-step executables compiled so far (1 unless capacities grew)."""
        return self._compiled_before + self._fn._cache_size()


def _check_not_donated(state: TrainState) -> None:
    """A state an earlier step consumed (donated) cannot run again: say so, instead of
    handing XLA deleted buffers."""
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise ValueError(
            "StepRunner.step: this state was donated to an earlier step (its buffers were "
            "updated in place); pass the state that step returned"
        )


def _refusal_error(status: Refusal, position: int, loss: float, overflow, invalid) -> Exception:
    """The error of a refused step; it names the step counting from 1 (the step at data
    position p is step p + 1, as checkpoints count)."""
    kept = "the step was not applied; the state is the last committed one"
    step = position + 1
    if status & _NONFINITE:  # the first cause (a NaN loss makes the updates NaN too)
        what = (
            f"loss {loss}"
            if status & Refusal.LOSS
            else "dense update"
            if status & Refusal.DENSE
            else "embedding update"
        )
        err: Exception = NonFiniteLossError(f"non-finite {what} at step {step} ({kept})")
    elif status & Refusal.INVALID:
        bad = {k: v for k, v in invalid.items() if v}
        err = InvalidIdError(
            f"ids outside their table's vocabulary at step {step} (count per table: {bad}; {kept})"
        )
    else:
        bad = {k: v for k, v in overflow.items() if v}
        err = CapacityOverflowError(
            f"ids overflowed routing/dedup capacities at step {step} (ids dropped per "
            f"table: {bad}; {kept}); raise the tables' capacity_factor / unique_capacity "
            "(see embark_jax.sharding.capacity); a dynamic table's drops need a larger "
            "capacity or bucket_size"
        )
    err.step, err.position, err.state = step, position, None
    return err
