"""Callbacks for `embark_jax.training.loop.fit`: progress output, metric logs (JSON lines and
TensorBoard event files) and fault injection.

Metrics accumulate on the device (`StepRunner.totals`); these callbacks read them only when
they print or log, every `every` steps, so they never make a step wait. `JsonLinesLogger`
writes one JSON object every `every` steps (`step`, and over the steps since the previous
line: `loss`, `samples_per_s`, `overflow`, `train_auc_window`, `refused`);
`TensorBoardLogger` writes the same scalars as a TensorBoard event file through tensorboardX
(install `tensorboard`, e.g. the `[logging]` extra, to look at it). Both take further
scalars (the final evaluation) through `log_scalars`.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax

from embark_jax.training.loop import CallbackBase
from embark_jax.training.runner import StepRunner, Totals

__all__ = ["ExitAtStep", "JsonLinesLogger", "Progress", "TensorBoardLogger"]


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class _Windows:
    """The runner's totals over the steps since the previous read, and their wall time."""

    def __init__(self, runner: StepRunner):
        self.runner = runner
        self.last: Totals | None = None
        self.last_time = time.perf_counter()

    def take(self) -> tuple[Totals, float]:
        now, totals = time.perf_counter(), self.runner.totals()
        window = totals if self.last is None else totals.since(self.last)
        seconds = now - self.last_time
        self.last, self.last_time = totals, now
        return window, seconds


class Progress(CallbackBase):
    """A progress line every `every` steps: the loss and train AUC of the steps since the last
    line, samples/s and steps/s (after the compiling first step) and the time left."""

    def __init__(
        self,
        runner: StepRunner,
        total: int,
        batch_size: int,
        start: int = 0,
        every: int = 10,
        out=None,
    ):
        self.total, self.batch_size, self.start, self.every = total, batch_size, start, every
        self.out = out or sys.stdout
        self.windows = _Windows(runner)
        self.done = 0
        self.first: float | None = None

    def on_step_end(self, step, state, result):
        self.done += 1
        done = self.done
        if done == 1:
            self.first = time.perf_counter()  # the first step includes compilation
        if done % self.every and done != self.total:
            return
        window, _ = self.windows.take()
        elapsed = time.perf_counter() - (self.first if done > 1 else self.windows.last_time)
        rate = (done - 1) / elapsed if done > 1 and elapsed > 0 else 0.0
        speed = (
            f"{rate * self.batch_size:8.0f} samples/s  {rate:6.2f} steps/s  "
            f"{_clock((self.total - done) / rate)} left"
            if rate
            else "(the first step includes compiling)"
        )
        refused = f"  refused {window.refused}" if window.refused else ""
        bar = "#" * int(30 * done / self.total)
        tty = self.out.isatty()
        cr = "\r" if tty else ""  # overwrite the line on a terminal only
        self.out.write(
            f"{cr}[{bar:<30s}] step {self.start + done:6d}/"
            f"{self.start + self.total}  loss {window.mean_loss:.4f}  "
            f"AUC(last {window.steps}) {window.auc.auc():.3f}  {speed}{refused}"
        )
        self.out.write("\n" if not tty or done == self.total else "")
        self.out.flush()


class _StepMetrics(CallbackBase):
    """Scalars for the loggers every `every` steps, over the steps since the last ones."""

    def __init__(self, runner: StepRunner, batch_size: int, every: int):
        self.batch_size, self.every = batch_size, max(1, every)
        self.windows = _Windows(runner)
        self.count = 0

    def scalars(self) -> dict[str, float] | None:
        self.count += 1
        if self.count % self.every:
            return None
        window, seconds = self.windows.take()
        out = {
            "loss": window.mean_loss,
            "overflow": float(sum(window.overflow.values())),
            "train_auc_window": window.auc.auc(),
            "refused": float(window.refused),
        }
        if seconds > 0 and self.count > self.every:  # the first window includes compiling
            out["samples_per_s"] = window.steps * self.batch_size / seconds
        return out


class JsonLinesLogger(_StepMetrics):
    """One JSON object every `every` steps in `path` (created with its folder; appended to)."""

    def __init__(self, path: str, runner: StepRunner, batch_size: int, every: int = 10):
        super().__init__(runner, batch_size, every)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.fh = open(path, "a")  # closed by close()

    def on_step_end(self, step, state, result):
        scalars = self.scalars()
        if scalars is not None:
            self.log_scalars(step + 1, scalars)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.fh.write(json.dumps({"step": int(step), "wall_time": time.time(), **scalars}) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


class TensorBoardLogger(_StepMetrics):
    """TensorBoard scalars (`train/loss`, `train/samples_per_s`, ...) in `log_dir`, written by
    tensorboardX's `SummaryWriter` (an event file TensorBoard reads; no TensorFlow)."""

    def __init__(self, log_dir: str, runner: StepRunner, batch_size: int, every: int = 10):
        from tensorboardX import SummaryWriter

        super().__init__(runner, batch_size, every)
        self.writer = SummaryWriter(log_dir)

    def on_step_end(self, step, state, result):
        scalars = self.scalars()
        if scalars is not None:
            self.log_scalars(step + 1, {f"train/{k}": v for k, v in scalars.items()})

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, float(value), global_step=int(step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ExitAtStep(CallbackBase):
    """Fault injection for tests: process `process` dies abruptly (exit code 3) before data
    position `step`, as a crashed host would."""

    def __init__(self, process: int, step: int):
        self.process, self.step = process, step

    def on_step_start(self, step):
        if jax.process_index() == self.process and step == self.step:
            sys.stdout.flush()
            os._exit(3)
