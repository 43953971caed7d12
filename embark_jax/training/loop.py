"""The fit loop and its callbacks.

`fit` runs steps and calls callbacks around them; everything optional (progress output,
checkpoints, fault injection for tests) is a callback, so the loop stays a loop. Callbacks
see the state the step returned; they must not keep it past the call (the next step donates
it), except by copying (as the asynchronous checkpoint does).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from embark_jax.training import checkpoint
from embark_jax.training.metrics import StreamingAUC
from embark_jax.training.runner import NonFiniteLossError, StepResult, StepRunner
from embark_jax.training.state import TrainState

__all__ = ["Callback", "CheckpointEvery", "ExitAtStep", "FitSummary", "Progress", "fit"]


class Callback(Protocol):
    """Hooks around each step; `step` is the global data position (batch number)."""

    def on_step_start(self, step: int) -> None: ...

    def on_step_end(self, step: int, state: TrainState, result: StepResult) -> None: ...

    def on_end(self, state: TrainState) -> None: ...


class _Base:
    def on_step_start(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, state: TrainState, result: StepResult) -> None:
        pass

    def on_end(self, state: TrainState) -> None:
        pass


class Progress(_Base):
    """A progress line every `every` steps: loss, samples/s (after the compiling step)."""

    def __init__(self, total: int, batch_size: int, start: int = 0, every: int = 10, out=None):
        self.total, self.batch_size, self.start, self.every = total, batch_size, start, every
        self.out = out or sys.stdout
        self.losses: list[float] = []
        self.t0 = time.perf_counter()
        self.first: float | None = None

    def on_step_end(self, step, state, result):
        self.losses.append(result.loss)
        done = len(self.losses)
        if done == 1:
            self.first = time.perf_counter()  # the first step includes compilation
        if done % self.every and done != self.total:
            return
        elapsed = time.perf_counter() - (self.first if done > 1 else self.t0)
        sps = (done - 1) * self.batch_size / elapsed if done > 1 else 0.0
        bar = "#" * int(30 * done / self.total)
        self.out.write(
            f"\r[{bar:<30s}] step {self.start + done:6d}/{self.start + self.total}  loss "
            f"{np.mean(self.losses[-self.every :]):.4f}  {sps:9.0f} samples/s"
        )
        self.out.write("\n" if not self.out.isatty() or done == self.total else "")
        self.out.flush()


class CheckpointEvery(_Base):
    """Saves a checkpoint every `every` steps and after the last one (asynchronously with
    `async_save`: one save in flight at a time). `last` is the newest complete save."""

    def __init__(
        self,
        directory: str,
        runner: StepRunner,
        every: int,
        last_step: int,
        *,
        async_save: bool = False,
    ):
        self.directory, self.runner, self.every = directory, runner, every
        self.last_step, self.async_save = last_step, async_save
        self.last: str | None = None
        self._pending: checkpoint.PendingSave | None = None

    def on_step_end(self, step, state, result):
        position = step + 1
        if position % self.every and position != self.last_step:
            return
        self._settle()
        setup = self.runner.setup
        if self.async_save:
            self._pending = checkpoint.save_async(
                self.directory, setup, state, data_position=position
            )
        else:
            self.last = checkpoint.save(self.directory, setup, state, data_position=position)

    def _settle(self) -> None:
        if self._pending is not None:
            self.last = self._pending.wait()
            self._pending = None

    def on_end(self, state):
        self._settle()


class ExitAtStep(_Base):
    """Fault injection for tests: process `process` dies abruptly (exit code 3) before data
    position `step`, as a crashed host would."""

    def __init__(self, process: int, step: int):
        self.process, self.step = process, step

    def on_step_start(self, step):
        if jax.process_index() == self.process and step == self.step:
            sys.stdout.flush()
            os._exit(3)


@dataclasses.dataclass
class FitSummary:
    steps: int
    final_loss: float
    train_auc: float  # cumulative over every training step of this fit
    train_logloss: float
    samples_per_s: float
    losses: list[float]
    overflow: dict[str, int]


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
    summary. A NaN/inf loss raises `NonFiniteLossError` naming the last checkpoint saved."""
    acc, losses = StreamingAUC(), []
    overflow = {t.name: 0 for t in runner.setup.plan.tables}
    t0 = first = time.perf_counter()
    for i in range(steps):
        position = start + i
        for cb in callbacks:
            cb.on_step_start(position)
        try:
            state, result = runner.step(state, dataset.batch(position))
        except NonFiniteLossError as e:
            saved = [cb.last for cb in callbacks if isinstance(cb, CheckpointEvery)]
            last = next((s for s in saved if s), None)
            raise NonFiniteLossError(f"{e}; last good checkpoint: {last or 'none saved'}") from e
        if i == 0:
            first = time.perf_counter()
        losses.append(result.loss)
        acc.update(result.labels, result.probs)
        for k, v in result.overflow.items():
            overflow[k] += v
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
    )
    return state, summary
