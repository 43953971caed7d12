"""A hypothesis state machine over training and checkpoints: steps, bad
batches (rejected on the host, or a NaN update on the device), saves, saves
killed at each point (an exception injected while writing a table, or at each rename of the
commit), resumes and restores into a mismatched model. After every rule the live state is
usable and equals the last state really reached; the latest restorable checkpoint always
equals a state that was reached and saved (the last committed save, or — for a save killed
at its last renames — the one being saved)."""

import dataclasses
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from embark_jax.ops import optimizers as O
from embark_jax.training import checkpoint as ckpt
from embark_jax.training.runner import NonFiniteLossError, StepRunner
from embark_jax.training.state import full_tables
from tests.training.test_reliability import tiny

OPT = O.Adagrad(learning_rate=0.1)
_MODELS: dict = {}


def models():
    """(runner, initial state, dataset) and a mismatched runner, built once per session."""
    if not _MODELS:
        _MODELS["main"] = tiny(OPT)
        _MODELS["other"] = tiny(O.SGD(learning_rate=0.1))
        setup = _MODELS["main"][0].setup
        _MODELS["nan"] = StepRunner(dataclasses.replace(setup, tx=optax.sgd(float("nan"))))
    return _MODELS["main"], _MODELS["other"][0], _MODELS["nan"]


def snapshot(runner, state):
    """Everything a state holds, on the host (tables, slots, dense leaves, step)."""
    lw = runner.setup.lowered
    tables = {
        t.name: ckpt.table_arrays(lw, t.name, state.tables, state.slots) for t in lw.plan.tables
    }
    dense = [np.asarray(x) for x in jax.tree.leaves((state.dense_params, state.dense_opt))]
    return int(state.step), full_tables(runner.setup, state), tables, dense


def same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    flat_a = jax.tree.leaves((a[1], a[2], a[3]))
    flat_b = jax.tree.leaves((b[1], b[2], b[3]))
    return len(flat_a) == len(flat_b) and all(
        np.array_equal(x, y) for x, y in zip(flat_a, flat_b, strict=True)
    )


class Killed(BaseException):
    """The injected crash (a BaseException, like a signal, so no `except Exception` eats it)."""


KILL_POINTS = ["table-write", "move-old-aside", "move-new-in", "delete-old", "prune"]


@settings(
    max_examples=6,
    stateful_step_count=6,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
class TrainingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        (self.runner, state, self.ds), self.other, self.nan_runner = models()
        self.dir = tempfile.mkdtemp(prefix="embark-sm-")
        self.live = jax.tree.map(jnp.copy, state)  # steps donate it; every example starts anew
        self.reached = snapshot(self.runner, state)  # what the live state must equal
        self.committed = None  # snapshot of the latest restorable checkpoint
        self.position = 0

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- training ---------------------------------------------------------------------

    @rule(n=st.integers(1, 2))
    def steps(self, n):
        for _ in range(n):
            self.live, r = self.runner.step(self.live, self.ds.batch(self.position))
            self.position += 1
            assert np.isfinite(float(r.loss))
        self.reached = snapshot(self.runner, self.live)

    @rule(kind=st.sampled_from(["non-finite-loss", "host-invalid"]))
    def bad_batch(self, kind):
        b = self.ds.batch(self.position)
        if kind == "host-invalid":
            with pytest.raises(ValueError):
                self.runner.step(self.live, dataclasses.replace(b, labels=b.labels + 2))
        else:  # the same state under a NaN dense learning rate: a NaN update on the device
            self.live, _ = self.nan_runner.step(self.live, b)  # refused on the device
            with pytest.raises(NonFiniteLossError, match="the step was not applied"):
                self.nan_runner.sync()

    # --- checkpoints ------------------------------------------------------------------

    @rule(point=st.sampled_from([None, *KILL_POINTS]))
    def save(self, point):
        """A save, or one killed at `point` (an exception injected there)."""
        mp = pytest.MonkeyPatch()
        real_replace, real_rmtree, real_arrays = os.replace, shutil.rmtree, ckpt.table_arrays

        def replace(src, dst):
            hit = {
                "move-old-aside": ".old-" in str(dst),
                "move-new-in": ".tmp-" in str(src),
                "prune": ".del-" in str(dst),
            }
            if hit.get(point):
                raise Killed(point)
            return real_replace(src, dst)

        def rmtree(path, *a, **kw):
            if point == "delete-old" and ".old-" in str(path):
                raise Killed(point)
            return real_rmtree(path, *a, **kw)

        def arrays(lowered, name, *a, **kw):
            if point == "table-write" and name == "b":
                raise Killed(point)
            return real_arrays(lowered, name, *a, **kw)

        mp.setattr(os, "replace", replace)
        mp.setattr(shutil, "rmtree", rmtree)
        mp.setattr(ckpt, "table_arrays", arrays)
        try:
            ckpt.save(self.dir, self.runner.setup, self.live, max_to_keep=2)
            committed_anyway = True  # the point was not on this save's path
        except Killed:
            committed_anyway = point in ("delete-old", "prune")  # after the new one is in
        finally:
            mp.undo()
        if committed_anyway:
            self.committed = self.reached
        self.check_latest()

    @precondition(lambda self: self.committed is not None)
    @rule(mismatch=st.booleans())
    def resume(self, mismatch):
        if mismatch:  # into a model with another optimizer: refused, the live state stays
            with pytest.raises(ValueError, match="checkpoint optimizer Adagrad, configured SGD"):
                ckpt.restore(self.dir, self.other.setup)
            return
        self.live, meta = ckpt.restore(self.dir, self.runner.setup)
        assert same(snapshot(self.runner, self.live), self.committed)
        self.reached = self.committed
        self.position = meta["data_position"]

    # --- invariants -------------------------------------------------------------------

    def check_latest(self):
        """The latest restorable checkpoint equals the last committed save."""
        if self.committed is None:
            assert ckpt.latest_step(self.dir) is None
            return
        restored, _ = ckpt.restore(self.dir, self.runner.setup)
        assert same(snapshot(self.runner, restored), self.committed)

    @invariant()
    def live_state_is_usable_and_unchanged(self):
        leaves = jax.tree.leaves(self.live)
        assert not any(x.is_deleted() for x in leaves)
        assert same(snapshot(self.runner, self.live), self.reached)


TestTrainingMachine = TrainingMachine.TestCase
