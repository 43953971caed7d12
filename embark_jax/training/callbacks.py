"""Callbacks for `embark_jax.training.loop.fit`: progress output and fault injection."""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

from embark_jax.training.loop import CallbackBase

__all__ = ["ExitAtStep", "Progress"]


class Progress(CallbackBase):
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


class ExitAtStep(CallbackBase):
    """Fault injection for tests: process `process` dies abruptly (exit code 3) before data
    position `step`, as a crashed host would."""

    def __init__(self, process: int, step: int):
        self.process, self.step = process, step

    def on_step_start(self, step):
        if jax.process_index() == self.process and step == self.step:
            sys.stdout.flush()
            os._exit(3)
