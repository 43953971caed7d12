"""The fit loop.

`fit` runs steps and calls callbacks around them; everything optional (progress output,
checkpoints, fault injection for tests: `embark_jax.training.callbacks`,
`embark_jax.training.checkpoint.CheckpointEvery`) is a callback, so the loop stays a loop.
Callbacks see the state the step returned; they must not keep it past the call (an
in-place runner's next step donates it), except by copying (as the asynchronous checkpoint does). A callback that
saves checkpoints exposes `last_saved` (the newest complete one), which a NaN/inf loss
error names.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from embark_jax.sharding.checks import CapacityOverflowError, InvalidIdError
from embark_jax.training.metrics import StreamingAUC
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
    final_loss: float
    train_auc: float  # cumulative over every training step of this fit
    train_logloss: float
    samples_per_s: float
    losses: list[float]
    overflow: dict[str, int]
    invalid: dict[str, int]


def fit(
    runner: StepRunner,
    state: TrainState,
    dataset: Any,
    steps: int,
    *,
    start: int = 0,
    callbacks: Sequence[Callback] = (),
) -> tuple[TrainState, FitSummary]:
    """Trains `steps` steps on `dataset.batch(start + i)`; returns the final state and a
    summary. A NaN/inf loss or state raises `NonFiniteLossError` naming the step and the
    last checkpoint saved. When a step fails a check (that error, `CapacityOverflowError` or `InvalidIdError`
    under `overflow="error"`), the exception's `state` is the state before that step (usable
    with a transactional runner; None when the runner donated it)."""
    acc, losses = StreamingAUC(), []
    overflow = {t.name: 0 for t in runner.setup.plan.tables}
    invalid = dict(overflow)
    t0 = first = time.perf_counter()
    for i in range(steps):
        position = start + i
        for cb in callbacks:
            cb.on_step_start(position)
        try:
            state, result = runner.step(state, dataset.batch(position))
        except NonFiniteLossError as e:
            saved = [getattr(cb, "last_saved", None) for cb in callbacks]
            last = next((s for s in saved if s), None)
            err = NonFiniteLossError(f"{e}; last good checkpoint: {last or 'none saved'}")
            err.state = state if runner.transactional else None
            raise err from e
        except (CapacityOverflowError, InvalidIdError) as e:
            e.state = state if runner.transactional else None
            raise
        if i == 0:
            first = time.perf_counter()
        losses.append(result.loss)
        acc.update(result.labels, result.probs)
        for k, v in result.overflow.items():
            overflow[k] += v
        for k, v in result.invalid.items():
            invalid[k] += v
        for cb in callbacks:
            cb.on_step_end(position, state, result)
    for cb in callbacks:
        cb.on_end(state)
    end = time.perf_counter()
    window = losses[-10:] or [float("nan")]
    summary = FitSummary(
        steps=steps,
        final_loss=float(np.mean(window)),
        train_auc=acc.auc(),
        train_logloss=acc.logloss(),
        samples_per_s=max(steps - 1, 1) * dataset.batch_size / max(end - (first or t0), 1e-9),
        losses=losses,
        overflow=overflow,
        invalid=invalid,
    )
    return state, summary
