"""`StepRunner`: runs the compiled train step on host batches.

It validates and places each batch, calls the jitted step, checks that the loss and the
updated state are finite, and applies the overflow policy. It holds the setup and the
compiled step, never the training state: the caller passes a `TrainState` in and gets the
new one back.

Transactional steps (the default): the state passed in is not donated, so when a check
fails (`NonFiniteLossError`, or `CapacityOverflowError` under `overflow="error"`) nothing
is committed and the caller still holds the state from before the step, usable and
unchanged; retrying cannot apply a batch twice. The cost: the step writes its result into
new buffers instead of updating the tables in place, so device memory holds two copies of
the tables and slots during a step and each step copies them once.
`StepRunner(setup, transactional=False)` donates the state (in place, one copy of the
tables); a failed check then raises with the input state gone (restore the last checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from embark_jax.core.options import OverflowPolicy
from embark_jax.data.batch import Batch
from embark_jax.sharding import hlo_bytes
from embark_jax.sharding.capacity import grow_capacities
from embark_jax.sharding.checks import (
    CapacityOverflowError,
    InvalidIdError,
    check_invalid,
    check_overflow,
)
from embark_jax.training.metrics import StreamingAUC
from embark_jax.training.state import TrainSetup, TrainState, with_plan
from embark_jax.training.step import compile_eval_step, compile_train_step

__all__ = ["NonFiniteLossError", "StepResult", "StepRunner"]


class NonFiniteLossError(FloatingPointError):
    """The loss, or the state the step produced, holds NaN or inf; the message names the
    step (and, raised from `fit`, the last good checkpoint). The step was not applied."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step reports, on the host: mean loss, predicted probabilities and labels of
    the global batch, per table the ids dropped by a full capacity (overflow) and the ids
    outside the table dropped as padding (invalid), and the step number reached."""

    loss: float
    probs: np.ndarray
    labels: np.ndarray
    overflow: dict[str, int]
    invalid: dict[str, int]
    step: int


class StepRunner:
    """Host side of training: `state, result = runner.step(state, batch)`.

    Arguments:
      setup: the `TrainSetup`; its `options.overflow` is the overflow policy: `count`
        (report the dropped ids), `error` (raise `CapacityOverflowError`) or `grow`
        (count, double the overflowing tables' capacities and recompile: later steps fit;
        the ids dropped in the overflowing step got no update).
      validate_inputs: check every batch on the host before it reaches a device.
      transactional: do not donate the state, so a failed check leaves the caller's state
        as it was (see the module docstring for the cost); False updates in place.
    """

    def __init__(
        self, setup: TrainSetup, *, validate_inputs: bool = True, transactional: bool = True
    ):
        self.validate_inputs = validate_inputs
        self.transactional = transactional
        self._compile(setup)

    def _compile(self, setup: TrainSetup) -> None:
        self.setup = setup
        self._step = compile_train_step(setup, donate=not self.transactional)
        self._eval = compile_eval_step(setup)

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
        )

    @staticmethod
    def _host(x) -> np.ndarray:
        if jax.process_count() == 1:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    # --- steps -----------------------------------------------------------------------

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, StepResult]:
        """One training step; use the returned state. Transactional runners leave the
        input state valid (and, when a check raises, unchanged); others donate it."""
        if self.validate_inputs:
            self.check_batch(batch)
        new, out = self._step(state, self.put_batch(batch))
        # one host transfer for every replicated scalar the checks need
        host = jax.device_get(
            {
                "loss": out["loss"],
                "finite": out["finite"],
                "step": new.step,
                "overflow": out["overflow"],
                "invalid": out["invalid"],
            }
        )
        loss, step = float(host["loss"]), int(host["step"])
        kept = (
            "the step was not applied; the state passed in is unchanged"
            if self.transactional
            else "the state passed in was donated and is lost; restore a checkpoint"
        )
        if not math.isfinite(loss) or not bool(host["finite"]):
            what = f"loss {loss}" if not math.isfinite(loss) else "state after the update"
            raise NonFiniteLossError(f"non-finite {what} at step {step} ({kept})")
        names = [t.name for t in self.setup.plan.tables]
        overflow = {n: int(v) for n, v in zip(names, host["overflow"], strict=True)}
        invalid = {n: int(v) for n, v in zip(names, host["invalid"], strict=True)}
        policy = self.setup.options.overflow
        if policy is OverflowPolicy.ERROR:
            try:
                check_invalid(invalid)
                check_overflow(overflow)
            except (CapacityOverflowError, InvalidIdError) as e:
                raise type(e)(f"{e} (at step {step}; {kept})") from None
        elif policy is OverflowPolicy.GROW and any(overflow.values()):
            grown = [name for name, n in overflow.items() if n > 0]
            plan = grow_capacities(
                self.setup.plan, grown, self.setup.options, lowered=self.setup.lowered
            )
            self._compile(with_plan(self.setup, plan))
        probs = self._host(out["probs"])
        return new, StepResult(loss, probs, np.asarray(batch.labels), overflow, invalid, step)

    def evaluate(self, state: TrainState, batches: Iterable[Batch]) -> dict[str, float]:
        """AUC and log loss of the model over `batches` (no update)."""
        acc = StreamingAUC()
        for b in batches:
            acc.update(b.labels, self._host(self._eval(state, self.put_batch(b))))
        return {"auc": acc.auc(), "logloss": acc.logloss()}

    # --- introspection ---------------------------------------------------------------

    def compiled_step(self, state: TrainState, batch: Batch):
        return self._step.lower(state, self.put_batch(batch)).compile()

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
        return self._step._cache_size()
