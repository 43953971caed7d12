"""The fit loop.

`fit` runs steps and calls callbacks around them; everything optional (progress output,
checkpoints, fault injection for tests: `embark_jax.training.callbacks`,
`embark_jax.training.checkpoint.CheckpointEvery`) is a callback, so the loop stays a loop.
Batches are built, validated and placed on the devices ahead of time in a background thread
(`data.prefetch.Prefetcher`, `StepRunner.place`), and the loop never waits for a step: the
runner checks each step one step late and keeps the metrics on the device until a callback
asks for them. Callbacks see the state the step returned; they must not keep it past the
call (the next step donates it), except by copying (as the asynchronous checkpoint does). A
callback that saves checkpoints exposes `last_saved` (the newest complete one), which a
NaN/inf error names.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from embark_jax.data.prefetch import Prefetcher
from embark_jax.sharding.checks import CapacityOverflowError, InvalidIdError
from embark_jax.training.runner import NonFiniteLossError, StepResult, StepRunner
from embark_jax.training.state import TrainState

__all__ = ["Callback", "CallbackBase", "FitSummary", "fit"]


class CallbackBase:
    """A callback that does nothing; subclass it and override what you need."""

    def on_step_start(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, state: TrainState, result: StepResult) -> None:
        pass

    def on_end(self, state: TrainState) -> None:
        pass


class Callback(Protocol):
    """Hooks around each step; `step` is the global data position (batch number)."""

    def on_step_start(self, step: int) -> None: ...

    def on_step_end(self, step: int, state: TrainState, result: StepResult) -> None: ...

    def on_end(self, state: TrainState) -> None: ...


@dataclasses.dataclass
class FitSummary:
    steps: int
    final_loss: float  # mean loss of the last 10 steps
    train_auc: float  # cumulative over every committed training step of this fit
    train_logloss: float
    samples_per_s: float
    losses: list[float]  # every step's loss (read once, at the end)
    overflow: dict[str, int]
    invalid: dict[str, int]
    refused: int  # steps not applied (with `StepRunner(skip_nonfinite=True)`)
    dynamic: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


_STEP_ERRORS = (NonFiniteLossError, CapacityOverflowError, InvalidIdError)


def fit(
    runner: StepRunner,
    state: TrainState,
    dataset: Any,
    steps: int,
    *,
    start: int = 0,
    callbacks: Sequence[Callback] = (),
    prefetch: int = 2,
) -> tuple[TrainState, FitSummary]:
    """Trains `steps` steps on `dataset.batch(start + i)`; returns the final state and a
    summary. Batches are prepared `prefetch` steps ahead in a background thread.

    A refused step (NaN/inf loss or update: `NonFiniteLossError`, naming the step and the
    last checkpoint saved; under `overflow="error"`, `CapacityOverflowError` or
    `InvalidIdError`) raises at most one step late; the exception's `state` is the last
    committed state (nothing of the refused step, or of any step after it, was applied)."""
    before = runner.totals()
    batches = Prefetcher(lambda i: runner.place(dataset.batch(i)), depth=prefetch)
    losses: list[jax.Array] = []
    t0 = first = time.perf_counter()
    try:
        for i in range(steps):
            position = start + i
            for cb in callbacks:
                cb.on_step_start(position)
            try:
                state, result = runner.step(state, batches.get(position), position)
                if i == 0:
                    first = time.perf_counter()  # the first call compiles
                losses.append(result.loss)
                for cb in callbacks:  # a checkpoint callback syncs the runner first
                    cb.on_step_end(position, state, result)
            except _STEP_ERRORS as e:
                raise _with_checkpoint(e, state, callbacks) from None
        try:
            runner.sync()
        except _STEP_ERRORS as e:
            raise _with_checkpoint(e, state, callbacks) from None
    finally:
        batches.close()
    for cb in callbacks:
        cb.on_end(state)
    end = time.perf_counter()
    totals = runner.totals().since(before)
    host_losses = [float(x) for x in jax.device_get(losses)]
    window = host_losses[-10:] or [float("nan")]
    summary = FitSummary(
        steps=steps,
        final_loss=float(np.mean(window)),
        train_auc=totals.auc.auc(),
        train_logloss=totals.auc.logloss(),
        samples_per_s=max(steps - 1, 1) * dataset.batch_size / max(end - (first or t0), 1e-9),
        losses=host_losses,
        overflow=totals.overflow,
        invalid=totals.invalid,
        refused=totals.refused,
        dynamic=totals.dynamic,
    )
    return state, summary


def _with_checkpoint(e: Exception, state: TrainState, callbacks) -> Exception:
    """The error with the newest state (when the runner raised it without one) and, for a
    non-finite step, the last checkpoint saved in its message."""
    if getattr(e, "state", None) is None:
        e.state = state
    if not isinstance(e, NonFiniteLossError):
        return e
    saved = [getattr(cb, "last_saved", None) for cb in callbacks]
    last = next((s for s in saved if s), None)
    err = NonFiniteLossError(f"{e}; last good checkpoint: {last or 'none saved'}")
    err.step, err.state = e.step, e.state
    return err
