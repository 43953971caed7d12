"""The whole embedding step, embark_jax against FBGEMM's TBE: the driver.

Per workload (`workloads.py`) the driver writes the inputs once (`data.py`: initial tables,
ids, output gradients), then starts one worker process per contender (`worker.py`), one at a
time: it builds its state from the inputs, runs step 1 on batch 0 and writes that step's
outputs and sampled updated rows, which the driver checks against the numpy reference
(`data.reference_*`) and, for the embark contenders, against TBE's; then one untimed round
warms it up. Only then are the contenders timed: `rounds` rounds, each giving every
contender a turn of `steps` steps back to back (the worker waits for the last one), the
starting contender rotating round by round, with a short idle gap before each turn. A
contender's step time is its turn's time over `steps`; samples/s is the batch over it.

Memory decides the schedule (`--schedule auto`, `choose_schedule`): `interleaved` (the above,
every contender alive at once) when the machine has room for all of them by the estimate
of `memory_needed`; else `one-at-a-time`: each contender is built, checked, warmed up and
timed for its `rounds` turns alone, then ended before the next starts (the machine's load
then differs between contenders; the JSON says which schedule ran). Either way a contender
is started only once there is memory for it (`wait_for_memory`), or is skipped and listed
as unavailable: on a shared machine the kernel's OOM killer could take another job.

JSON (`--out`, default results/collection_bench.json; rewritten after every workload),
schema "embark_jax.collection_bench/2" (/1 had no check_s nor settle, and its first_step_s
included the check):

  schema, settings {rounds, steps, batches, seed, ids, index_dtype, contenders, gap_s,
                    memory_wait_s, schedule (asked), learning_rate, eps, tolerance}
  machine {cpu_model, cpu_count, cpu_affinity, platform, python, numpy, loadavg_start,
           loadavg_end, mem_total_gib}
  checks_ok: every contender agreed with the reference on every workload
  workloads: [{
    workload: {name, note, tables: [{name, rows, dim, hotness}], batch, pooling, table_gib,
               ids_per_batch, output_dim}
    schedule: "interleaved" or "one-at-a-time"
    unavailable: {contender: why it was not run (e.g. "ImportError: No module named ...")}
    contenders: {NAME: {                  # embark, embark_rb, embark_collection, tbe
      what, info (versions, threads), build_s, first_step_s (step 1 alone: trace, compile
      and run), check_s (step 1 and writing what the check reads), settle (the wait after
      the warm-up round for the library's background work: {seconds, huge_pages}),
      check: {outputs_max_abs, rows_max_abs, untouched_max_abs, ok, overflow, applied,
              clusters (embark: tables per cluster kind), index_dtype (tbe)},
      step_s: {min, median, rounds: [...]},
      samples_per_s: {best (batch / min step), median (batch / median step)},
      memory: {after_build_rss_gib, peak_rss_gib (the process's whole life: build and check
               included), steps_peak_rss_gib (from the end of the warm-up round to the
               end: the timed steps), rss_gib (at the end)}}}
    ratios: {NAME: {best, median}}        # samples/s of NAME / TBE's (>1: NAME faster)
    agreement: {NAME: {outputs_max_abs, rows_max_abs}}   # NAME's step 1 against TBE's
  }]
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.collection import data as D
from experiments.collection.workloads import CONTENDERS, PEER, Workload

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "embark_jax.collection_bench/2"
GAP_S = 0.01
# Step 1 against the float64 reference: outputs within OUT_RTOL of the largest output (a
# float32 sum of up to 100 rows), updated rows within ROWS_ATOL_LR * learning rate (a wrong
# update is off by about the learning rate; float32 rounding by ~1e-8).
OUT_RTOL = 1e-4
ROWS_ATOL_LR = 1e-3


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 3
    steps: int = 10
    batches: int = 4
    seed: int = 0
    ids: str = "zipf"
    index_dtype: str = "int32"
    contenders: tuple[str, ...] | None = None  # None: each workload's own
    gap_s: float = GAP_S
    memory_wait_s: float = 600.0  # how long a contender waits for memory before it is skipped
    schedule: str = "auto"  # "interleaved", "one-at-a-time" or "auto" (`choose_schedule`)
    tmp_dir: str | None = None  # where the inputs are written (default: the system's)


# embark_jax.core.cpu_env's opt-in process tuning, set for `*_tuned` contenders only
TUNING_SWITCHES = ("EMBARK_CPU_TUNING", "EMBARK_HUGEPAGES", "EMBARK_MALLOC", "EMBARK_CPU_SPIN")


class WorkerError(RuntimeError):
    pass


class Worker:
    """A contender's worker process, driven one JSON line at a time."""

    whole_peak: float = 0.0  # peak RSS before the timed rounds (GiB)
    reset_ok: bool = False  # the peak was reset then: later peaks are the timed steps'

    def __init__(self, contender: str, manifest: str, index_dtype: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":")
        env["JAX_PLATFORMS"] = "cpu"
        for switch in TUNING_SWITCHES:  # the kernels' process tuning: only where named
            env.pop(switch, None)
        if contender.endswith("_tuned"):
            env["EMBARK_CPU_TUNING"] = "on"
        cmd = [sys.executable, "-m", "experiments.collection.worker", "--contender", contender]
        cmd += ["--manifest", manifest, "--index-dtype", index_dtype]
        self.name = contender
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"{self.name} worker exited (status {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"{self.name} worker: {reply['error']}\n{reply.get('traceback')}")
        return reply

    def call(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- checks ----------------------------------------------------------------------------


class Reference:
    """The numpy reference of step 1, computed once per table and kept."""

    def __init__(self, inp: D.Inputs):
        self.inp = inp
        self._out, self._rows = {}, {}

    def output(self, i: int) -> np.ndarray:
        if i not in self._out:
            self._out[i] = D.reference_output(self.inp, i)
        return self._out[i]

    def rows(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if i not in self._rows:
            self._rows[i] = D.reference_rows(self.inp, i)
        return self._rows[i]


def check_against_reference(ref: Reference, out_dir: str) -> dict:
    """Max abs differences of a contender's step 1 (`out_I.npy`, `rows_I.npy` in `out_dir`)
    from the reference: outputs, updated rows, and untouched rows (which must not move)."""
    inp = ref.inp
    out_err = rows_err = untouched_err = 0.0
    out_scale = 1.0
    for i in range(len(inp.workload.tables)):
        r = ref.output(i)
        out_scale = max(out_scale, float(np.abs(r).max(initial=0.0)))
        out_err = max(out_err, _max_abs(np.load(os.path.join(out_dir, f"out_{i}.npy")), r))
        w0, w1 = ref.rows(i)
        got = np.load(os.path.join(out_dir, f"rows_{i}.npy"))
        rows_err = max(rows_err, _max_abs(got, w1))
        same = np.all(w0 == w1, axis=1)
        if same.any():
            untouched_err = max(untouched_err, _max_abs(got[same], w0[same]))
    ok = out_err <= OUT_RTOL * out_scale and rows_err <= ROWS_ATOL_LR * inp.learning_rate
    ok = ok and untouched_err == 0.0
    return {
        "outputs_max_abs": out_err,
        "rows_max_abs": rows_err,
        "untouched_max_abs": untouched_err,
        "ok": bool(ok),
    }


def agreement(inp: D.Inputs, a_dir: str, b_dir: str) -> dict:
    """Max abs differences between two contenders' step 1 (outputs and sampled rows)."""
    out_err = rows_err = 0.0
    for i in range(len(inp.workload.tables)):
        for name in (f"out_{i}.npy", f"rows_{i}.npy"):
            a = np.load(os.path.join(a_dir, name))
            b = np.load(os.path.join(b_dir, name))
            if name.startswith("out"):
                out_err = max(out_err, _max_abs(a, b))
            else:
                rows_err = max(rows_err, _max_abs(a, b))
    return {"outputs_max_abs": out_err, "rows_max_abs": rows_err}


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise ValueError(f"shape {a.shape} != {b.shape}")
    return float(np.max(np.abs(a.astype(np.float64) - b), initial=0.0))


# --- statistics ----------------------------------------------------------------------------


def summarize(step_s: list[float], batch: int) -> dict:
    lo, med = min(step_s), statistics.median(step_s)
    return {
        "step_s": {"min": lo, "median": med, "rounds": list(step_s)},
        "samples_per_s": {"best": batch / lo, "median": batch / med},
    }


def ratios(contenders: dict[str, dict], peer: str = PEER) -> dict[str, dict]:
    """samples/s of each contender over the peer's, at the best round and at the median."""
    p = contenders.get(peer, {}).get("samples_per_s")
    if not p:
        return {}
    out = {}
    for name, rec in contenders.items():
        s = rec.get("samples_per_s")
        if name != peer and s:
            out[name] = {k: s[k] / p[k] for k in ("best", "median")}
    return out


# --- the run ---------------------------------------------------------------------------------


def memory_needed(w: Workload, contender: str) -> int:
    """Bytes a contender's process may take at its peak, estimated from runs here: an
    embark contender 3x the tables + 1 GiB (tables-100's worker, 4.2 GiB of tables, reached
    12.2 GiB in a step), TBE 1.3x the tables + 0.5 GiB (its weights, the copy-in's chunks)."""
    if contender == PEER:
        return int(1.3 * w.table_bytes) + 2**29
    return 3 * w.table_bytes + 2**30


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def wait_for_memory(need: int, wait_s: float, poll_s: float = 10.0) -> str | None:
    """None once `need` bytes are available (MemAvailable), polling up to `wait_s`; else
    why not. On a shared machine a contender that does not fit is skipped rather than
    started: the kernel's OOM killer could take another job's process."""
    deadline = time.monotonic() + wait_s
    while True:
        avail = mem_available()
        if avail is None or avail >= need:
            return None
        if time.monotonic() >= deadline:
            return (
                f"not enough memory: {avail / 2**30:.1f} GiB available, "
                f"{need / 2**30:.1f} GiB needed"
            )
        time.sleep(poll_s)


def machine_info() -> dict:
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
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mem_total_gib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30,
        "loadavg_start": list(os.getloadavg()),
    }


def say(msg: str) -> None:
    print(msg, flush=True)


def bench_workload(w: Workload, s: Settings) -> dict:
    """One workload: inputs, workers, checks, warm-up, then the timed rounds; all contenders
    alive at once and interleaved when the machine has memory for them all, else one after
    the other (`schedule`)."""
    root = tempfile.mkdtemp(prefix="embark_collection_", dir=s.tmp_dir)
    workers: dict[str, Worker] = {}
    names = [c for c in (s.contenders or w.contenders) if c in CONTENDERS]
    schedule = choose_schedule(w, names, s.schedule)
    rec = {
        "workload": {
            **w.to_json(),
            "table_gib": w.table_bytes / 2**30,
            "ids_per_batch": w.ids_per_batch,
            "output_dim": w.output_dim,
        },
        "schedule": schedule,
        "unavailable": {},
        "contenders": {},
    }
    try:
        t0 = time.perf_counter()
        inp = D.Inputs(root, w, s.batches, s.seed, s.ids).write()
        say(f"{w.summary()}: inputs written in {time.perf_counter() - t0:.1f} s; {schedule}")
        ref = Reference(inp)
        for name in names:
            wk = _prepare(name, inp, ref, s, rec)
            if wk is None:
                continue
            workers[name] = wk
            if schedule == "one-at-a-time":
                _finish(rec, {name: wk}, _rounds({name: wk}, s))
                workers.pop(name).close()
        if schedule == "interleaved":
            _finish(rec, workers, _rounds(workers, s))
        del ref
        rec["agreement"] = {}
        peer_dir = os.path.join(root, f"check_{PEER}")
        if PEER in rec["contenders"]:
            for name in rec["contenders"]:
                if name != PEER:
                    out_dir = os.path.join(root, f"check_{name}")
                    rec["agreement"][name] = agreement(inp, out_dir, peer_dir)
        rec["ratios"] = ratios(rec["contenders"])
    finally:
        for wk in workers.values():
            wk.close()
        shutil.rmtree(root, ignore_errors=True)
    return rec


def choose_schedule(w: Workload, names: list[str], asked: str) -> str:
    """`asked`, or under "auto" "interleaved" when every contender's estimated memory
    (`memory_needed`) fits in what is available with 2 GiB to spare, else "one-at-a-time"."""
    if asked != "auto":
        return asked
    avail = mem_available()
    need = sum(memory_needed(w, n) for n in names) + 2 * 2**30
    return "interleaved" if avail is None or need <= avail else "one-at-a-time"


def _prepare(name: str, inp: D.Inputs, ref: Reference, s: Settings, rec: dict) -> Worker | None:
    """Starts a contender's worker (once there is memory for it), builds it, checks its
    step 1 and runs the warm-up round; None (and why in `rec["unavailable"]`) when it
    cannot run."""
    short = wait_for_memory(memory_needed(inp.workload, name), s.memory_wait_s)
    if short:
        rec["unavailable"][name] = short
        say(f"  {name}: not run ({short})")
        return None
    wk = Worker(name, inp.manifest, s.index_dtype)
    hello = wk.recv()
    if not hello["available"]:
        rec["unavailable"][name] = hello["reason"]
        wk.close()
        say(f"  {name}: not run ({hello['reason']})")
        return None
    try:
        built = wk.call(cmd="build")
        out_dir = os.path.join(inp.root, f"check_{name}")
        os.makedirs(out_dir)
        step1 = wk.call(cmd="check", dir=out_dir)
        wk.call(cmd="run", steps=s.steps)  # warm-up round
        settle = wk.call(cmd="settle")  # huge pages in place before the timed rounds
    except BaseException:
        wk.close()
        raise
    check = {**check_against_reference(ref, out_dir), **step1}
    first_step_s = check.pop("first_step_s")
    check_s = check.pop("check_s")
    if name != PEER:
        check["ok"] = check["ok"] and check["overflow"] == 0 and check["applied"]
    rec["contenders"][name] = {
        "what": CONTENDERS[name],
        "info": built["info"],
        "build_s": built["build_s"],
        "first_step_s": first_step_s,
        "check_s": check_s,
        "settle": settle,
        "check": check,
        "memory": {"after_build_rss_gib": built["memory"]["rss_gib"]},
    }
    say(
        f"  {name}: built in {built['build_s']:.1f} s, step 1 {first_step_s:.2f} s (check "
        f"{check_s:.2f} s), settled in {settle['seconds']:.1f} s; "
        f"vs reference: outputs {check['outputs_max_abs']:.2e}, rows "
        f"{check['rows_max_abs']:.2e}, untouched {check['untouched_max_abs']:.1e} "
        f"({'ok' if check['ok'] else 'FAILED'})"
    )
    return wk


def _finish(rec: dict, workers: dict[str, Worker], times: dict[str, list[float]]) -> None:
    """Step times, samples/s and memory of the timed contenders into `rec`."""
    batch = rec["workload"]["batch"]
    for name, wk in workers.items():
        c = rec["contenders"][name]
        c.update(summarize(times[name], batch))
        mem = wk.call(cmd="memory")["memory"]
        c["memory"] |= {
            "peak_rss_gib": max(wk.whole_peak, mem["peak_rss_gib"]),
            "steps_peak_rss_gib": mem["peak_rss_gib"] if wk.reset_ok else None,
            "rss_gib": mem["rss_gib"],
        }


def _rounds(workers: dict[str, Worker], s: Settings) -> dict[str, list[float]]:
    """Resets each worker's peak RSS (after noting its whole-life peak), then the timed
    rounds: per round every contender's turn of `steps` steps, the first one rotating."""
    names = list(workers)
    for wk in workers.values():
        whole = wk.call(cmd="memory")["memory"]["peak_rss_gib"]
        ok = wk.call(cmd="reset_peak")["ok"]
        wk.whole_peak, wk.reset_ok = whole, ok
    times = {n: [] for n in names}
    for r in range(s.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            time.sleep(s.gap_s)
            times[name].append(workers[name].call(cmd="run", steps=s.steps)["seconds"] / s.steps)
        line = ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in names)
        say(f"  round {r + 1}/{s.rounds}: {line}")
    return times


def run(workloads: list[Workload], s: Settings, out: str | None) -> dict:
    result = {
        "schema": SCHEMA,
        "settings": {
            **{k: v for k, v in dataclasses.asdict(s).items() if k != "tmp_dir"},
            "learning_rate": D.LEARNING_RATE,
            "eps": D.EPS,
            "tolerance": {"outputs_rtol": OUT_RTOL, "rows_atol_lr": ROWS_ATOL_LR},
        },
        "machine": machine_info(),
        "workloads": [],
        "checks_ok": True,
    }
    for w in workloads:
        rec = bench_workload(w, s)
        result["workloads"].append(rec)
        result["checks_ok"] &= all(c["check"]["ok"] for c in rec["contenders"].values())
        result["machine"]["loadavg_end"] = list(os.getloadavg())
        say(table([rec]))
        if out:
            _write(result, out)
    return result


def _write(result: dict, out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = f"{out}.tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(tmp, out)


# --- the printed table -----------------------------------------------------------------------


def table(records: list[dict]) -> str:
    """One row per workload and contender: samples/s, the ratio to TBE and peak memory."""
    head = [
        "workload",
        "contender",
        "samples/s (median / best)",
        "vs TBE (median / best)",
        "peak RSS GiB (steps / whole)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in records:
        w = rec["workload"]["name"]
        for name, c in rec["contenders"].items():
            sps = c.get("samples_per_s")
            r = rec.get("ratios", {}).get(name)
            m = c.get("memory", {})
            steps_peak = m.get("steps_peak_rss_gib")
            cells = [
                w,
                name,
                f"{sps['median']:,.0f} / {sps['best']:,.0f}" if sps else "—",
                f"{r['median']:.2f}x / {r['best']:.2f}x" if r else ("1x" if name == PEER else "—"),
                f"{steps_peak:.2f} / {m['peak_rss_gib']:.2f}"
                if steps_peak is not None and m.get("peak_rss_gib")
                else "—",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        for name, why in rec.get("unavailable", {}).items():
            lines.append(f"| {w} | {name} | not run: {why} | | |")
    return "\n".join(lines)
