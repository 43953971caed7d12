"""`embark_jax.training.distributed`: the local launcher and the launched processes' setup
(two processes training together: tests/cli/test_train.py)."""

import socket
import sys

from embark_jax.training import distributed as D


def test_free_port_can_be_bound():
    port = D.free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_without_a_coordinator_the_process_runs_alone(monkeypatch):
    monkeypatch.delenv(D.ENV_COORDINATOR, raising=False)
    monkeypatch.setattr(D.jax.config, "update", lambda *a: None)  # devices already set up
    assert D.initialize_from_env() is False


def test_die_with_launcher_does_nothing_outside_launch(monkeypatch):
    monkeypatch.delenv(D.ENV_LAUNCHER, raising=False)
    D.die_with_launcher()  # returns: no prctl, no exit


def test_launch_returns_the_first_failure_and_stops_the_others(monkeypatch, capsys):
    """One process fails at once, the other would sleep: it is killed after the grace
    period, and the launcher says so."""
    procs = []

    def start(argv, nproc, devices_per_proc):
        import subprocess

        code = ["import sys; sys.exit(3)", "import time; time.sleep(60)"]
        for c in code:
            procs.append(subprocess.Popen([sys.executable, "-c", c]))
        return procs, []

    monkeypatch.setattr(D, "_start", start)
    assert D.launch(["train"], 2, 1, grace_s=0.2) == 3
    assert all(p.poll() is not None for p in procs)
    out = capsys.readouterr().out
    assert "launch: process 0 exited with code 3" in out
    assert "launch: stopped processes [1] after the grace period" in out
