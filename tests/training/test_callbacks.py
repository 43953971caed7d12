"""Metric logs of `train --log-dir`: JSON lines and TensorBoard event files that TensorBoard's
own reader loads; the progress line; launch's output filter."""

import io
import json

import numpy as np
import pytest

from embark_jax.cli.main import _QuietLines
from embark_jax.training.callbacks import JsonLinesLogger, Progress, TensorBoardLogger
from embark_jax.training.metrics import StreamingAUC
from embark_jax.training.runner import Totals


class FakeRunner:
    """What the loggers read of a `StepRunner`: `totals()`, the running sums of the steps
    `advance` added (each step: a loss of 1 / (i + 1), 32 predictions, overflow i % 2)."""

    def __init__(self):
        self.t = Totals(0, 0, 0.0, StreamingAUC(), {"t": 0}, {"t": 0})
        self.rng = np.random.default_rng(0)

    def advance(self, i: int) -> None:
        labels = self.rng.integers(0, 2, 32).astype(np.float32)
        probs = np.clip(labels * 0.6 + self.rng.random(32) * 0.4, 0, 1)
        self.t.steps += 1
        self.t.applied += 1
        self.t.loss_sum += 1.0 / (i + 1)
        self.t.auc.update(labels, probs)
        self.t.overflow["t"] += i % 2

    def totals(self) -> Totals:
        return self.t.copy()


def _drive(callback, runner, n: int, start: int = 0) -> None:
    for i in range(n):
        runner.advance(i)
        callback.on_step_end(start + i, None, None)


def test_event_file_is_read_back_by_tensorboard(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    runner = FakeRunner()
    logger = TensorBoardLogger(str(tmp_path), runner, batch_size=32, every=2)
    _drive(logger, runner, 4)
    logger.log_scalars(4, {"eval/auc": 0.75})
    logger.close()
    ea = accumulator.EventAccumulator(str(tmp_path))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/loss", "train/overflow", "train/train_auc_window", "eval/auc"} <= tags
    loss = ea.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 4]  # every 2 steps: the mean over the 2 steps
    np.testing.assert_allclose([e.value for e in loss], [3 / 4, 7 / 24], rtol=1e-6)
    assert ea.Scalars("eval/auc")[0].value == pytest.approx(0.75)
    assert [e.step for e in ea.Scalars("train/train_auc_window")] == [2, 4]


def test_json_lines_one_object_every_few_steps(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    runner = FakeRunner()
    logger = JsonLinesLogger(str(path), runner, batch_size=32, every=2)
    _drive(logger, runner, 5, start=10)
    logger.log_scalars(15, {"eval_auc": 0.7})
    logger.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [12, 14, 15]
    assert rows[0]["loss"] == 0.75 and rows[0]["overflow"] == 1.0 and rows[0]["refused"] == 0
    assert "train_auc_window" in rows[1] and "samples_per_s" in rows[1]
    assert "samples_per_s" not in rows[0]  # the first window includes compiling
    assert rows[-1]["eval_auc"] == 0.7


def test_progress_shows_rate_time_left_and_window_auc():
    out = io.StringIO()
    runner = FakeRunner()
    p = Progress(runner, total=4, batch_size=32, every=2, out=out)
    _drive(p, runner, 4)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(not ln.startswith("\r") for ln in lines)
    assert "steps/s" in lines[-1] and "left" in lines[-1] and "AUC(last 2)" in lines[-1]
    assert "loss 0.2917" in lines[-1]  # (1/3 + 1/4) / 2


def test_launch_output_drops_gloo_notices_and_blank_prefixed_lines():
    out = io.StringIO()
    q = _QuietLines(out)
    for line in [
        "[0] [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
        "ranks is : 1\n",
        "[1] [Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of\n",
        "[1] 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
        "[1]  peer ranks. Expected number of connected peer ranks is : 1\n",
        "[1] [Gloo] Rank 1[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of "
        "connected peer ranks is : 1\n",
        "[0] [Gloo] Rank 0 is conn\n",
        "[0] ected to 1 peer ranks.\n",
        "[1] \n",
        "[0] step 1\n",
        "[0] 3 ranks on 1 peer\n",
        "[0]   t1: rb 1x1 [[3]] -- rb: pooling 2 ids\n",
        "[1]    \n",
        "launch: done\n",
    ]:
        q.write(line)
    assert (
        out.getvalue()
        == "[0] step 1\n[0] 3 ranks on 1 peer\n[0]   t1: rb 1x1 [[3]] -- rb: pooling 2 ids\n"
        "launch: done\n"
    )
