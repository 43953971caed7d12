"""Multi-process runs: initialise `jax.distributed` from the launcher's environment, and the
local launcher (`python -m embark_jax launch --nproc 2 --devices-per-proc 4 -- train ...`).

On a real cluster, start one process per host yourself (Slurm, Kubernetes, mpirun) with
EMBARK_COORDINATOR=host0:port, EMBARK_NUM_PROCESSES and EMBARK_PROCESS_ID set (or rely on
`jax.distributed.initialize()`'s own cluster detection); GPUs then use NCCL collectives.
On CPU the collectives are gloo. The launcher here is for development and CI: it starts the
processes on localhost with a free port, prefixes their output, and if one process fails it
stops the others within `--grace` seconds instead of letting them hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import jax

__all__ = ["free_port", "initialize_from_env", "launch"]

ENV_COORDINATOR = "EMBARK_COORDINATOR"
ENV_NUM = "EMBARK_NUM_PROCESSES"
ENV_ID = "EMBARK_PROCESS_ID"
ENV_LOCAL = "EMBARK_LOCAL_DEVICES"
ENV_LAUNCHER = "EMBARK_LAUNCHER_PID"  # set by `launch`: the children die with that process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_from_env(default_cpu_devices: int = 8, timeout_s: int = 60) -> bool:
    """Sets up this process's devices; returns True when it joined a multi-process run.

    Must run before any JAX computation. Without a GPU plugin, the CPU backend is given
    `EMBARK_LOCAL_DEVICES` (or `default_cpu_devices`) fake devices.
    """
    from embark_jax.ops.native import _cuda_plugin_installed

    if not _cuda_plugin_installed() and os.environ.get("JAX_PLATFORMS", "cpu") in ("", "cpu"):
        jax.config.update(
            "jax_num_cpu_devices", int(os.environ.get(ENV_LOCAL, default_cpu_devices))
        )
    if ENV_COORDINATOR not in os.environ:
        return False
    jax.distributed.initialize(
        coordinator_address=os.environ[ENV_COORDINATOR],
        num_processes=int(os.environ[ENV_NUM]),
        process_id=int(os.environ[ENV_ID]),
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=max(10, timeout_s // 2),
    )
    return True


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"{prefix}{line}")
        sys.stdout.flush()


def _start(argv: list[str], nproc: int, devices_per_proc: int):
    """Starts the processes; returns them and the threads pumping their output."""
    port = free_port()
    procs, pumps = [], []
    for i in range(nproc):
        env = dict(os.environ)
        env.update(
            {
                ENV_COORDINATOR: f"127.0.0.1:{port}",
                ENV_NUM: str(nproc),
                ENV_ID: str(i),
                ENV_LOCAL: str(devices_per_proc),
                ENV_LAUNCHER: str(os.getpid()),
                "PYTHONUNBUFFERED": "1",
            }
        )
        p = subprocess.Popen(
            [sys.executable, "-m", "embark_jax", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        t = threading.Thread(target=_pump, args=(p.stdout, f"[{i}] "), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)
    return procs, pumps


def die_with_launcher() -> None:
    """In a process `launch` started: asks Linux to kill it when the launcher dies
    (`prctl(PR_SET_PDEATHSIG, SIGKILL)`), so a launcher killed with SIGKILL leaves no
    process training on its own; exits at once if the launcher is already gone. Nothing
    happens outside `launch` or off Linux."""
    pid = os.environ.get(ENV_LAUNCHER)
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if str(os.getppid()) != pid:  # the launcher died before the request was made
        os._exit(1)


def _interrupt(procs, pumps, grace_s: float) -> int:
    """Ctrl-C in the launcher: the processes get SIGINT (a terminal sends it to them as
    well) and `grace_s` seconds to stop, then are killed; exit code 130."""
    import signal

    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for t in pumps:
        t.join(timeout=5)
    print("launch: interrupted; every process stopped", flush=True)
    return 130


def launch(
    argv: list[str],
    nproc: int,
    devices_per_proc: int,
    *,
    grace_s: float = 20.0,
    timeout_s: float | None = None,
) -> int:
    """Runs `python -m embark_jax <argv>` in `nproc` local processes; returns the first
    non-zero exit code (or 0).

    The bound: when a process fails, the others are killed `grace_s` seconds later unless
    they finish (within one 0.1 s poll), so the launcher returns at most `grace_s` + ~1 s
    after the first failure (the start-up and training time before it aside). What
    happened is printed once every process has stopped and its output is drained:
    `launch: process I exited with code C after T s` and `launch: stopped processes
    [...] after the grace period; all stopped S s after the failure`."""
    procs, pumps = _start(argv, nproc, devices_per_proc)
    start = time.monotonic()
    failed: tuple[int, int, float] | None = None  # (process, code, time)
    killed: list[int] = []
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            now = time.monotonic()
            if bad and failed is None:
                failed = (*bad[0], now)
            if all(c is not None for c in codes):
                break
            if (failed is not None and now - failed[2] > grace_s) or (
                timeout_s is not None and now - start > timeout_s
            ):
                killed = [i for i, p in enumerate(procs) if p.poll() is None]
                for i in killed:
                    procs[i].kill()
                for p in procs:
                    p.wait()
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        return _interrupt(procs, pumps, grace_s)
    end = time.monotonic()
    for t in pumps:
        t.join(timeout=5)
    if failed is not None:
        i, c, at = failed
        print(f"launch: process {i} exited with code {c} after {at - start:.1f} s", flush=True)
    if killed:
        why = "after the grace period" if failed is not None else f"at the {timeout_s} s timeout"
        since = f"{end - failed[2]:.1f} s after the failure" if failed else f"{end - start:.1f} s"
        print(f"launch: stopped processes {killed} {why}; all stopped {since}", flush=True)
    elif failed is not None:
        print(f"launch: all stopped {end - failed[2]:.1f} s after the failure", flush=True)
    return failed[1] if failed is not None else (124 if killed else 0)
