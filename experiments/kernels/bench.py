"""Kernel benchmark: our FFI kernels against XLA's lowering and torch (FBGEMM), same data.

Each library runs in its own long-lived worker process (`worker.py`; their thread pools slow
each other in one process), all with the same thread count. Per op, the driver sets the op up
in every worker (compile + warm-up), then runs `repeats` repetitions in rounds: each round
gives every implementation a turn, one process at a time, the starting implementation
rotating round by round, with an idle gap between processes (8 ms: past the ~4.4 ms that
torch's OpenMP workers stay busy after a call, measured here, so no library is timed while
another's threads still hold a core). A turn is `warm_per_turn` untimed calls, then
`reps_per_round` timed ones, so a timed call is a steady-state call, as in a training loop: on
the shared 2-core VM a call right after the machine idled takes several times longer for
every library, which measures the VM's wake-up, not the kernels. Our two-op backward, which
no peer has, is timed in the fused backward's session, interleaved with it and the peers.
What each library computes is in `cases_jax.py` and `cases_torch.py`; bytes follow FBGEMM's
accounting (`points.op_bytes`).
Each library's output (or its table after the same number of SGD steps) is compared with
XLA's on a subset of rows.

JSON (`--out`, default results/kernels.json; rewritten after every point), schema
"embark_jax.kernel_bench/2":

  schema, backend ("cpu"/"gpu"), devices, copy_GBps (copy bandwidth, read + write),
  machine: {cpu_model, cpu_count, cpu_affinity, threads, platform, python, numpy,
            loadavg_start, loadavg_end}
  settings: {repeats, reps_per_round, warm_per_turn, warmup, gap_s, seed, threads, ops, libs}
  libs: {lib: worker info: versions, device, threads_requested, os_threads (by thread name),
         xla_intra_op_threads (JAX libs), num_threads + parallel_backend (torch)}
  unavailable: {lib: why it was not measured (e.g. "ImportError: No module named 'torch'")}
  ops: [op names run]; checks_ok: every library agreed with the reference on every op
  points: [{
    point: {batch, hotness, dim, vocab, dist, name, label, unique_rows, two_op_capacity},
    OP: {                                  # forward, forward_bf16, backward_update,
      op, bytes,                           # backward_two_op, train_step, unique, segment_sum
      libs: {IMPL: {min_s, median_s, times_s: [...], reps, GBps, GBps_median}},
                                           # IMPL: embark, xla, torch, torch_segment_reduce
      ratios: {PEER: {min, median}},       # PEER time / ours (>1: ours faster); backward_two_op
                                           # against backward_update's libs, "fused" = ours
      errors: {IMPL: msg}, check: {IMPL: {max_abs_err, ok}},
      ffi_s, ffi_GBps, xla_s, xla_GBps, torch_s, torch_GBps, speedup (XLA / ours),
      fraction_of_copy                     # flat keys at the min, as older readers expect
    }}]
  floor (--floor only): {OP: {IMPL: {call_us, shape_us, rows_us}}}: at the min, a call of one
    id, of the small shape, and their difference (`report.floor_split`)

Threads: see `worker.py` (XLA's intra-op pool follows the CPU affinity; torch gets
`set_num_threads`). The shared 2-core machines are noisy: compare ratios, read min and median.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from experiments.kernels import points as P
from experiments.kernels import report
from experiments.kernels.points import DEFAULT_POINTS, Point

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "embark_jax.kernel_bench/2"
LIBS = ("embark", "xla", "torch")
TOLERANCE = {  # (rtol, atol) of each library's sample against the reference's
    "forward": (1e-4, 1e-3),
    "forward_bf16": (2e-2, 5e-2),
    "backward_update": (1e-4, 5e-4),  # atol per SGD step (UPDATING)
    "backward_two_op": (1e-4, 5e-4),
    "train_step": (1e-4, 5e-4),
    "unique": (0.0, 0.0),
    "segment_sum": (1e-4, 1e-3),
}


# The updating ops are compared after every library applied the same number of SGD steps; a
# hot row sums ~10^4 float32 gradients per step, in another order in each library, so the
# tables drift apart by about 2e-4 per step (measured: torch vs XLA, 3.4e-3 after 17 steps at
# lr 0.01) while a wrong update is off by ~lr * |sum of gradients| ~ 1 per step.
UPDATING = ("backward_update", "backward_two_op", "train_step")


def sgd_steps(s: Settings) -> int:
    """Calls each implementation of an op gets: warm-up, then per round untimed + timed."""
    rounds = -(-s.repeats // s.reps_per_round)
    return s.warmup + rounds * s.warm_per_turn + s.repeats


class WorkerError(RuntimeError):
    pass


class Worker:
    """A library's worker process, driven one JSON line at a time."""

    def __init__(self, lib: str, threads: int, device: str = "auto"):
        env = dict(os.environ)
        env.setdefault("EMBARK_CPU_TUNING", "on")  # the kernels' opt-in process tuning
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":")
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # GPU: workers share it
        cmd = [sys.executable, "-m", "experiments.kernels.worker", "--lib", lib]
        cmd += ["--threads", str(threads), "--device", device]
        self.lib = lib
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        self.hello = None

    def send(self, **msg) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"{self.lib} worker exited (status {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"{self.lib} worker: {reply['error']}\n{reply.get('traceback')}")
        return reply

    def call(self, **msg) -> dict:
        self.send(**msg)
        return self.recv()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
            except OSError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclasses.dataclass
class Settings:
    repeats: int = 7
    reps_per_round: int = 3
    warm_per_turn: int = 2
    warmup: int = 2
    gap_s: float = 0.008
    seed: int = P.SEED
    threads: int = 0  # 0: the CPUs this process may run on
    ops: tuple[str, ...] = P.OPS
    libs: tuple[str, ...] = LIBS
    copy_nbytes: int = 1 << 28
    floor: bool = False  # the points are FLOOR_POINTS: add the per-call floor split


def start_workers(s: Settings) -> tuple[list[Worker], dict, dict]:
    """Starts one worker per library (in parallel); returns the available ones, every
    library's info and the reasons of those left out. torch runs on CUDA when JAX runs on a
    GPU, and is left out there if it has no CUDA."""
    started = [Worker(lib, s.threads, "auto") for lib in s.libs]
    workers, infos, unavailable = [], {}, {}
    for w in started:
        w.hello = w.recv()
        if w.hello["available"]:
            workers.append(w)
            infos[w.lib] = w.hello["info"]
        else:
            unavailable[w.lib] = w.hello["reason"]
            w.close()
    backend = next((i["backend"] for i in infos.values() if "backend" in i), "cpu")
    for w in list(workers):
        if w.lib == "torch" and (backend == "gpu") != (infos["torch"]["device"] == "cuda"):
            unavailable["torch"] = f"torch is on {infos['torch']['device']}, JAX on {backend}"
            workers.remove(w)
            infos.pop("torch")
            w.close()
    return workers, infos, unavailable


def measure_op(
    workers: list[Worker], op: str, s: Settings, extra_ops=()
) -> tuple[dict, dict, dict]:
    """Sets `op` (and `extra_ops`, whose impls are named `IMPL@OP`) up in every worker, runs
    the interleaved rounds, collects the samples.
    Returns `({impl: [seconds]}, {impl: error}, {impl: sample array})`."""
    for w in workers:
        w.send(cmd="setup", op=op, warmup=s.warmup, extra_ops=list(extra_ops))
    impls, errors = [], {}
    for w in workers:
        r = w.recv()
        impls += [(w, impl) for impl in r["impls"]]
        errors |= r["errors"]
    times = {impl: [] for _, impl in impls}
    done, rnd = 0, 0
    while impls and done < s.repeats:
        k = min(s.reps_per_round, s.repeats - done)
        j = rnd % len(impls)
        for w, impl in impls[j:] + impls[:j]:
            time.sleep(s.gap_s)
            times[impl] += w.call(cmd="run", impl=impl, reps=k, warm=s.warm_per_turn)["times"]
        done, rnd = done + k, rnd + 1
    samples = {impl: np.asarray(w.call(cmd="sample", impl=impl)["sample"]) for w, impl in impls}
    for w in workers:
        w.call(cmd="teardown")
    return times, errors, samples


def check_samples(op: str, samples: dict, reference: np.ndarray | None, steps: int = 1) -> dict:
    """Each implementation's sample against the reference (XLA's, else ours); the updating
    ops' atol is per SGD step (`steps` applied)."""
    if reference is None:
        return {}
    rtol, atol = TOLERANCE[op]
    if op in UPDATING:
        atol *= steps
    out = {}
    for impl, x in samples.items():
        same = x.shape == reference.shape
        err = float(np.max(np.abs(x - reference), initial=0.0)) if same else float("inf")
        ok = same and bool(np.allclose(x, reference, rtol=rtol, atol=atol))
        out[impl] = {"max_abs_err": err, "ok": ok}
    return out


def by_op(op: str, *maps: dict) -> dict[str, tuple[dict, ...]]:
    """Splits a session's `{IMPL[@OP]: x}` maps into `{OP: maps with plain IMPL keys}`."""
    out = {}
    for i, m in enumerate(maps):
        for key, value in m.items():
            impl, _, other = key.partition("@")
            out.setdefault(other or op, tuple({} for _ in maps))[i][impl] = value
    return out


def bench_point(workers: list[Worker], p: Point, s: Settings, copy_GBps=None) -> dict:
    """Every op of `s.ops` at one point: the JSON record of the point."""
    for w in workers:
        w.send(cmd="point", point=p.to_json(), seed=s.seed)
    metas = [w.recv() for w in workers]  # every worker answers; the data is the same
    u = metas[0]["unique_rows"]
    pt = {"point": p.to_json() | {"name": p.name, "label": p.label, "unique_rows": u}}
    pt["point"]["two_op_capacity"] = metas[0]["capacity"]
    measured, refs = {}, {}
    for op in s.ops:
        if op in measured or P.PEER_OP.get(op) in s.ops:
            continue
        extra = [o for o in s.ops if P.PEER_OP.get(o) == op]
        measured |= by_op(op, *measure_op(workers, op, s, extra))
        for o in [op, *extra]:
            times, errors, samples = measured.get(o, ({}, {}, {}))
            pt[o] = op_result(o, p, u, times, errors, samples, pt, refs, copy_GBps, sgd_steps(s))
            print(progress_line(o, pt[o]), flush=True)
    return pt


def op_result(op, p, u, times, errors, samples, pt, refs, copy_GBps, steps=1) -> dict:
    """The record of one op at point `p` (`pt`: the point's records so far, `refs`: each
    op's reference sample so far)."""
    nbytes = P.op_bytes(op, p, u)
    libs = {impl: report.summarize(t, nbytes) for impl, t in times.items() if t}
    peer = P.PEER_OP.get(op)
    peer_libs = pt[peer]["libs"] if peer in pt else None
    rec = report.op_record(op, nbytes, libs, peer_libs, copy_GBps)
    refs[op] = next((samples[k] for k in ("xla", "embark") if k in samples), None)
    rec["errors"] = errors
    rec["check"] = check_samples(op, samples, refs.get(peer, refs[op]), steps)
    return rec


def progress_line(op: str, rec: dict) -> str:
    parts = [
        f"{impl} {r['min_s'] * 1e3:.3f}/{r['median_s'] * 1e3:.3f} ms {r['GBps']:.2f} GB/s"
        for impl, r in rec["libs"].items()
    ]
    bad = [k for k, c in rec["check"].items() if not c["ok"]]
    tail = f"  MISMATCH: {', '.join(bad)}" if bad else ""
    tail += "".join(f"  [{k}: {v}]" for k, v in rec["errors"].items())
    return f"   {op:16s} " + " | ".join(parts) + tail


def machine_info(s: Settings) -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "threads": s.threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "loadavg_start": list(os.getloadavg()),
    }


def run(points=DEFAULT_POINTS, repeats: int = 7, out: str | None = None, **kw) -> dict:
    """Runs the benchmark; writes `out` after every point; returns the JSON record."""
    s = Settings(repeats=repeats, **kw)
    s.threads = s.threads or len(os.sched_getaffinity(0))
    workers, infos, unavailable = start_workers(s)
    if "embark" not in infos:
        for w in workers:
            w.close()
        raise RuntimeError(f"our kernels could not be loaded: {unavailable.get('embark')}")
    try:
        result = _run(workers, infos, unavailable, points, s, out)
    finally:
        for w in workers:
            w.close()
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    if s.floor:
        result["floor"] = report.floor_split(result)
    print("\n" + report.tables(result) + "\n", flush=True)
    _write(result, out)
    return result


def _run(workers, infos, unavailable, points, s: Settings, out) -> dict:
    ours = next(w for w in workers if w.lib == "embark")
    backend = infos["embark"]["backend"]
    nbytes = s.copy_nbytes if backend == "cpu" else max(s.copy_nbytes, 1 << 30)
    copy_GBps = ours.call(cmd="copy", nbytes=nbytes)["GBps"]
    settings = dataclasses.asdict(s) | {"ops": list(s.ops), "libs": list(s.libs)}
    result = {
        "schema": SCHEMA,
        "backend": backend,
        "devices": infos["embark"]["device"],
        "copy_GBps": copy_GBps,
        "machine": machine_info(s),
        "settings": settings,
        "libs": infos,
        "unavailable": unavailable,
        "ops": list(s.ops),
        "checks_ok": True,
        "points": [],
    }
    print(f"backend {backend}, {s.threads} threads: copy {copy_GBps:.1f} GB/s (read+write)")
    for lib, why in unavailable.items():
        print(f"{lib}: not measured ({why})")
    for p in points:
        print(f"-- {p.name}", flush=True)
        pt = bench_point(workers, p, s, copy_GBps)
        result["points"].append(pt)
        ok = all(c["ok"] for op in s.ops for c in pt[op]["check"].values())
        result["checks_ok"] = result["checks_ok"] and ok
        _write(result, out)  # a run stopped by its time budget keeps what it measured
    for w in workers:  # thread counts after the work (pools are created lazily)
        result["libs"][w.lib] = w.call(cmd="info")["info"]
    return result


def _write(result: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
