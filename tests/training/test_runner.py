"""Faults: a non-finite loss stops training naming the step and the last checkpoint; a dead
process does not leave the others hanging; the capacity-overflow policies."""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.sharding.collection import CapacityOverflowError
from embark_jax.training import checkpoint as ckpt
from embark_jax.training.checkpoint import CheckpointEvery
from embark_jax.training.loop import fit
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import NonFiniteLossError, StepRunner
from embark_jax.training.state import create
from tests.cli.test_train import SMALL, run

CFG = EmbeddingConfig.create(
    [TableConfig(name="rw", vocab_size=64, dim=4), TableConfig(name="tw", vocab_size=9, dim=4)],
    [
        FeatureConfig(name="f", table="rw", max_hotness=8),
        FeatureConfig(name="g", table="tw", max_hotness=1),
    ],
)
DENSE = DenseConfig(kind="dcnv2", bottom=(4,), top=(4, 1), cross_layers=1, cross_rank=2)


def make(policy="count", factor=None):
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8),
        batch_size=32,
        tables=(
            TablePlan(
                name="rw",
                cluster="rb",
                row_shards=4,
                column_shards=1,
                devices=((0, 2, 4, 6),),
                capacity_factor=factor,
            ),
            TablePlan(name="tw", cluster="rb", row_shards=1, column_shards=1, devices=((1,),)),
        ),
    )
    setup, state = create(
        CFG,
        plan,
        dense=DENSE,
        sparse_optimizer=O.SGD(learning_rate=0.1),
        dense_optimizer=optax.sgd(0.1),
        options=RuntimeOptions(overflow=policy),
    )
    return StepRunner(setup), state


def test_nan_loss_names_the_step_and_last_checkpoint(tmp_path):
    runner, state = make()
    ds = SyntheticDataset(CFG, batch_size=32, seed=0)
    saver = CheckpointEvery(str(tmp_path), runner, every=1, last_step=2)
    state, _ = fit(runner, state, ds, 2, callbacks=[saver])
    # a diverged model (as after a bad update): the next loss is NaN
    nan = jax.tree.map(lambda x: x * np.float32(np.nan), state.dense_params)
    state = state.replace(dense_params=nan)
    with pytest.raises(
        NonFiniteLossError, match=r"non-finite loss nan at step 3 \(.*\); last good checkpoint: .+"
    ) as e:
        fit(runner, state, ds, 1, start=2, callbacks=[saver])
    assert str(tmp_path) in str(e.value)
    assert ckpt.latest_step(str(tmp_path)) == 2


def test_overflow_policies():
    ds = SyntheticDataset(CFG, batch_size=32, seed=1, alpha=0.0)  # uniform ids: no luck
    counted, state = make("count", factor=0.2)
    state, summary = fit(counted, state, ds, 1)
    assert summary.overflow["rw"] > 0 and summary.overflow["tw"] == 0
    erring, state = make("error", factor=0.2)
    erring.step(state, ds.batch(0))
    with pytest.raises(CapacityOverflowError, match="'rw'"):
        erring.sync()
    grow, state = make("grow", factor=0.2)
    overflow, last = [], grow.totals()
    for i in range(10):  # the runner grows one step late: it reads flags while the next runs
        state, _ = grow.step(state, ds.batch(i))
        now = grow.totals()
        overflow.append(now.since(last).overflow["rw"])
        last = now
    assert overflow[0] > 0 and overflow[-1] == 0
    # step 1 was enqueued before step 0's overflow was read: it ran on the old capacities (its
    # overflow does not grow them again); from step 2 on "rw" has double the slots it had
    assert overflow[1] > overflow[0] // 2, overflow
    assert overflow[2] <= overflow[0] // 2, overflow
    assert grow.setup.plan.table("rw").capacity_factor > 0.2  # grew, and the step recompiled


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as fh:
            out += [int(x) for x in fh.read().split()]
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_processes_die_with_a_launcher_killed_with_sigkill():
    """Workers stop when their launcher is killed -9, rather than training on alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    argv = ["launch", "--nproc", "2", "--devices-per-proc", "1", "--", "train", *SMALL]
    argv += ["--steps", "100000", "--batch-size", "16"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "embark_jax", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    children: list[int] = []
    try:
        seen, deadline = "", time.monotonic() + 300
        while "loss" not in seen.rpartition("[0] training")[2]:  # a step of both processes
            assert launcher.poll() is None and time.monotonic() < deadline, seen
            if select.select([launcher.stdout], [], [], 1.0)[0]:
                seen += launcher.stdout.readline()
        children = _children(launcher.pid)
        assert len(children) == 2 and all(_alive(c) for c in children), seen
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(c) for c in children), "a process outlived its launcher"
    finally:  # whatever happened, no process of this test is left running
        if launcher.poll() is None:
            children += _children(launcher.pid)
            launcher.kill()
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)


@pytest.mark.slow
def test_killed_process_ends_the_run_in_bounded_time():
    """Process 1 dies before step 2; process 0 then waits in a collective. The launcher
    kills it once the grace period is over, returns within grace + ~1 s of the failure
    (plus the start-up before it), and reports only after every process has stopped."""
    grace = 10
    t0 = time.monotonic()
    r = run(
        [
            "launch",
            "--nproc",
            "2",
            "--devices-per-proc",
            "2",
            "--grace",
            str(grace),
            "--",
            "train",
            "--steps",
            "6",
            *SMALL,
            "--debug-exit-at",
            "1:2",
        ],
        timeout=240,
    )
    elapsed = time.monotonic() - t0
    out = r.stdout
    assert r.returncode == 3, out
    failed = re.search(r"launch: process 1 exited with code 3 after ([\d.]+) s", out)
    stopped = re.search(r"launch: stopped processes \[0\] .*all stopped ([\d.]+) s after", out)
    assert failed and stopped, out
    assert grace <= float(stopped.group(1)) <= grace + 2, out  # the survivor was stopped
    startup = float(failed.group(1))
    assert elapsed <= startup + grace + 15, (elapsed, startup)  # + interpreter start/exit
    # the report comes after every process's output (each stopped, its output drained)
    lines = out.splitlines()
    first_report = next(i for i, ln in enumerate(lines) if ln.startswith("launch:"))
    assert all(not ln.startswith("[") for ln in lines[first_report:]), out


@pytest.mark.slow
def test_cli_checkpoint_and_resume_on_other_device_count(tmp_path):
    d = tmp_path / "ck"
    out1, out2, full = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    common = [*SMALL, "--optimizer", "adagrad", "--checkpoint-dir", str(d)]
    r = run(["train", "--steps", "3", *common, "--save-every", "3", "--out", str(out1)])
    assert r.returncode == 0, r.stdout + r.stderr
    # resume on 4 devices with the TRW baseline: restores, continues at batch 3
    r = run(
        [
            "train",
            "--steps",
            "2",
            *common,
            "--resume",
            "--devices",
            "4",
            "--baseline",
            "trw",
            "--out",
            str(out2),
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "saved with 8 devices" in r.stdout
    r = run(["train", "--steps", "5", *SMALL, "--optimizer", "adagrad", "--out", str(full)])
    assert r.returncode == 0
    resumed, straight = json.loads(out2.read_text()), json.loads(full.read_text())
    np.testing.assert_allclose(resumed["losses"], straight["losses"][3:], rtol=1e-4)


@pytest.mark.slow
def test_checkpoint_from_one_process_restores_on_two(tmp_path):
    d = tmp_path / "ck"
    r = run(["train", "--steps", "2", *SMALL, "--checkpoint-dir", str(d)])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(
        [
            "launch",
            "--nproc",
            "2",
            "--devices-per-proc",
            "2",
            "--",
            "train",
            "--steps",
            "1",
            *SMALL,
            "--checkpoint-dir",
            str(d),
            "--resume",
            "--out",
            str(tmp_path / "m.json"),
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "saved with 8 devices" in r.stdout
    assert ckpt.latest_step(str(d)) == 3  # and the 2-process run saved its own checkpoint
    assert json.loads((tmp_path / "m.json").read_text())["processes"] == 2


def test_comm_bytes_per_step_reuses_the_compiled_step():
    """The collective bytes are read from the executable the steps ran: asking compiles
    nothing (a second compile of a large step costs as long as the first)."""
    from jax._src import monitoring
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    runner, state = make()
    batch = SyntheticDataset(CFG, batch_size=32, seed=0).batch(0)
    state, _ = runner.step(state, batch)
    runner.sync()
    compiles = []

    def listen(event, duration, **_):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        comm = runner.comm_bytes_per_step(state, batch)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert comm["total"] > 0 and compiles == []
