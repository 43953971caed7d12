"""The CPU kernels' worker pool keeps its workers off the caller's CPU (xla_ffi/cpu/cpu_pool.cc).

Checked from outside, in a fresh process (its own pool, nothing pinned yet): the workers are
threads named `embark-pool`, and /proc shows the CPUs each may run on. A worker forced onto the
caller's CPU, while it waits for work or while it sleeps, ends up off that CPU after the next
kernel call (there it could not take a chunk until the caller's chunks were done); so does a
worker asleep on another CPU (a sleeper may be woken onto its waker's CPU, where it would
take no chunk of the calls that follow); the kernel's result
still matches the reference, and a worker idle long enough to sleep takes back every CPU.
The child opts into spinning (EMBARK_CPU_SPIN=on): without it a worker sleeps, with its whole
mask back, as soon as a job ends, so there is no waiting worker to move.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least two CPUs",
)

ATTEMPTS = 30
_CHILD = r"""
import json, os, time
import numpy as np
import jax, jax.numpy as jnp
from embark_jax import ops
from embark_jax.ops import reference

def allowed(tid):
    with open(f"/proc/self/task/{tid}/status") as fh:
        line = next(l for l in fh if l.startswith("Cpus_allowed_list:"))
    cpus = set()
    for part in line.split(":")[1].strip().split(","):
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return sorted(cpus)

def workers():
    tids = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as fh:
            if fh.read().strip() == "embark-pool":
                tids.append(int(tid))
    return tids

rng = np.random.default_rng(0)
table = jnp.asarray(rng.standard_normal((500, 16), dtype=np.float32))
ids = jnp.asarray(rng.integers(0, 500, 4096).astype(np.int32))
seg = jnp.asarray(np.repeat(np.arange(1024), 4).astype(np.int32))
f = jax.jit(lambda t, i, s: ops.lookup_pool(t, i, s, 1024, indices_are_sorted=True))
want = np.asarray(reference.lookup_pool(table, ids, seg, 1024))
ATTEMPTS = int(os.environ["ATTEMPTS"])
out = {"every": sorted(os.sched_getaffinity(0)), "cases": {}}
jax.block_until_ready(f(table, ids, seg))  # starts the pool
for _ in range(200):  # each worker names itself as it starts
    if len(workers()) == len(out["every"]) - 1:
        break
    time.sleep(0.01)
out["workers"] = len(workers())
def where(tid):  # (state, the CPU it last ran on), from /proc/self/task/<tid>/stat
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[36])

def slices(tid):  # times the thread has been run on a CPU (/proc/.../schedstat)
    return int(open(f"/proc/self/task/{tid}/schedstat").read().split()[2])

here = out["every"][0]
others = set(out["every"]) - {here}
os.sched_setaffinity(0, {here})  # this thread, the caller, runs on `here` from now on
ok = True
for case, pause, onto in (
    ("waiting", 0.002, {here}),
    ("asleep", 0.1, {here}),
    ("asleep_elsewhere", 0.1, others),
):
    got, masks = None, []
    for attempt in range(ATTEMPTS):
        jax.block_until_ready(f(table, ids, seg))
        for tid in workers():
            os.sched_setaffinity(tid, onto)  # forced onto (or off) the caller's CPU
        runs = {t: slices(t) for t in workers()}
        time.sleep(pause)  # it runs there, then waits (yields) or, past 5 ms, sleeps
        # a waiting worker must have run there (and so published that CPU) since: on a
        # machine busier than its CPUs it may not have run at all
        if case == "waiting" and any(slices(t) <= runs[t] for t in workers()):
            continue
        # The case's precondition, else try again: each worker last ran where it was
        # forced to (on a busy machine it may not have run at all since, and then it has not
        # published that CPU), waiting (awake) or asleep as the case says (asleep, it has its
        # whole mask back, and the scheduler may have moved it before it slept).
        state = [where(t) for t in workers()]
        asleep = case != "waiting"
        if not all((s == "S") == asleep and cpu in onto for s, cpu in state):
            continue
        got = np.asarray(jax.block_until_ready(f(table, ids, seg)))
        masks = [allowed(tid) for tid in workers()]
        # A worker that fell asleep (kYield after the call, before this thread read its
        # mask on a busy machine) has its whole mask back, as it should: then try again.
        # So does one on its way to sleep, still running when its state is read: a whole
        # mask is the sleep's, never a worker left on the caller's CPU (that is [here]).
        whole = any(m == out["every"] for m in masks)
        if not whole and all(where(t)[0] != "S" for t in workers()):
            break
    ok = ok and got is not None and bool(np.allclose(got, want, rtol=1e-5, atol=1e-5))
    out["cases"][case] = masks
    out["attempts_" + case] = attempt + 1
time.sleep(0.1)  # idle: every worker sleeps, its whole mask back
out["after_sleep"] = [allowed(tid) for tid in workers()]
out["matches_reference"] = ok
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "EMBARK_CPU_THREADS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["EMBARK_CPU_SPIN"] = "on"
    env["ATTEMPTS"] = str(ATTEMPTS)
    run = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_workers_are_named_threads(child):
    assert child["workers"] == len(child["every"]) - 1


@pytest.mark.parametrize("case", ["waiting", "asleep", "asleep_elsewhere"])
def test_a_worker_on_the_callers_cpu_is_moved_off_it(child, case):
    here = child["every"][0]
    assert child["attempts_" + case] < ATTEMPTS, "no clean sample in any attempt"
    masks = child["cases"][case]
    assert masks, "no worker threads found"
    for mask in masks:
        assert here not in mask, (case, mask)
        assert mask == [c for c in child["every"] if c != here], (case, mask)
    assert child["matches_reference"]


def test_an_idle_worker_takes_back_every_cpu(child):
    assert child["after_sleep"] == [child["every"]] * child["workers"]


def _spin_in_child(**env_vars):
    import os
    import subprocess
    import sys

    code = "from embark_jax.ops import native; print(native.build_info()['cpu_spin'])"
    env = {k: v for k, v in os.environ.items() if k not in ("EMBARK_CPU_SPIN", "EMBARK_CPU_TUNING")}
    env.update(env_vars)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_workers_stay_awake_only_when_asked():
    """Process tuning is opt-in: the workers sleep after a job unless EMBARK_CPU_SPIN (or
    EMBARK_CPU_TUNING) asks them to stay awake; a bad value is one line naming it."""
    assert _spin_in_child().stdout.split() == ["off"]
    assert _spin_in_child(EMBARK_CPU_SPIN="on").stdout.split() == ["auto"]
    assert _spin_in_child(EMBARK_CPU_TUNING="1").stdout.split() == ["auto"]
    assert _spin_in_child(EMBARK_CPU_TUNING="on", EMBARK_CPU_SPIN="off").stdout.split() == ["off"]
    bad = _spin_in_child(EMBARK_CPU_SPIN="busy")
    assert bad.returncode != 0
    assert "EMBARK_CPU_SPIN='busy': expected auto, on, 1, off or 0" in bad.stderr
