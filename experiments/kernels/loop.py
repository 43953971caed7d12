"""Loop mode of the kernel benchmark: kernel time that a GPU's per-call overhead cannot hide.

A call per op from Python pays dispatch, launch and synchronisation around every kernel; on a
GPU that was ~0.6 ms a call whatever the size. Here each op runs K times inside one jitted
`lax.fori_loop` (`loop_cases.py`: K static, each iteration's input depending on the previous
output, in O(1)), and:

- K is chosen so that one loop call moves about `target_bytes` (at least `k_min`, at most
  `k_max` iterations; at most 32 for `unique`, whose sort is far more work than its bytes);
  each library's loop is compiled, run once (warm-up, and the sample compared across
  libraries), then timed `repeats` times back to back (no sleeps, so the GPU keeps its
  clocks), each call until its whole loop state is ready. Time per op = loop call / K (min
  and median over the calls).
- bytes per op follow FBGEMM's accounting (`points.op_bytes`), GB/s = bytes / time per op.
- the copy reference: a loop of K in-place passes over a float32 buffer moving the op's bytes
  per iteration (read + write, as a device-to-device copy of half of them), timed the same way
  in the same run: the op's `fraction_of_copy` is its GB/s over the copy's. The copy moves at
  least `copy_min_bytes`, so that it measures memory, not the cache.
- on a GPU, one more loop call of the first `profile` cases (the most valuable) is traced
  (`jax.profiler`; a trace costs seconds): the device time of the kernels in that call (the
  union of their intervals on the GPU's streams within the loop's XLA module) per
  iteration, and the kernels that took it, cross-check the wall clock.
- the compiled loop's HLO is scanned for copies of the loop-state arrays (the table, its
  accumulator, ids, gradients, values; `experiments/hlo_scan.py`): a copy per iteration would
  be a harness cost, not the kernel's.

Ours (`embark`) and XLA's own ops (`xla`) run in one process on one device (torch is not a
peer here: its loop would need CUDA graphs). A run's points are the production shapes
(`points.LOOP_QUICK` / `LOOP_FULL`), with batch and rows capped on a CPU (`max_batch`,
`max_vocab`), or the tiny `LOOP_SMOKE`. The work is done point by point, in the order given
(most valuable first), and the JSON is rewritten after every op, so a run stopped by its
time budget (`budget_s`: the first point runs whole, later ops are listed as skipped) or
killed keeps what it measured.

JSON (schema "embark_jax.kernel_loop/1"):

  schema, mode ("loop"), backend ("cpu"/"gpu"), devices, jax, jaxlib, complete, elapsed_s,
  copy_GBps (the best copy rate of the run, read + write), checks_ok,
  settings: {repeats, target_bytes, copy_min_bytes, rotate_below_bytes, k_min, k_max,
             budget_s, max_batch, max_vocab, profile, seed, tasks: [[point name, [ops]]]}
  skipped: [{point, op, reason}]
  points: [{
    point: {batch, hotness, dim, vocab, dist, dtype, name, label, unique_rows, capacity,
            rotated (ids rotated per iteration), requested (the uncapped name, if capped)},
    OP: {                                   # forward, backward_rowwise_adagrad, unique,
      op, bytes, iters,                     # segment_sum
      libs: {LIB: {min_s, median_s, times_s (per op), reps, GBps, GBps_median,
                   fraction_of_copy, loop_s (per call), compile_s, first_s,
                   hlo_copies: {count, copies, copied_buffers, ops},
                   device: {busy_s, span_s, kernels: [[name, s per iteration]]} | null,
                   profile_error}},
      copy: {bytes, iters, min_s, median_s, GBps},
      ratios: {xla: {min, median}},         # XLA time / ours (>1: ours faster)
      errors: {LIB: msg}, check: {LIB: {max_abs_err, ok}},
      ffi_s, ffi_GBps, xla_s, xla_GBps, speedup, fraction_of_copy   # flat, at the min
    }}]
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np

from embark_jax.sharding import hlo_scan
from experiments.kernels import loop_cases as LC
from experiments.kernels import points as P
from experiments.kernels import report

SCHEMA = "embark_jax.kernel_loop/1"
MiB = 1 << 20
# Per backend: bytes per loop call; the copy's least bytes (well above the last-level cache)
# and the distinct-row bytes below which ids rotate (a GPU's L2 holds 50-60 MB); CPU caps on
# the shapes.
BACKEND_DEFAULTS = {
    "gpu": {
        "target_bytes": 16e9,
        "copy_min_bytes": 256 * MiB,
        "rotate_below_bytes": 256 * MiB,
        "max_batch": None,
        "max_vocab": None,
    },
    "cpu": {
        "target_bytes": 256e6,
        "copy_min_bytes": 256 * MiB,
        "rotate_below_bytes": 32 * MiB,
        "max_batch": 1024,
        "max_vocab": 100_000,
    },
}
TOLERANCE = {  # (rtol, atol) of ours against XLA's sample; per dtype of the table
    ("forward", "float32"): (1e-4, 1e-3),
    ("forward", "bfloat16"): (2e-2, 5e-2),
    ("backward_rowwise_adagrad", "float32"): (1e-4, 1e-4),
    ("backward_rowwise_adagrad", "bfloat16"): (2e-2, 3e-2),
    ("unique", "float32"): (0.0, 0.0),
    ("segment_sum", "float32"): (1e-4, 1e-3),
}


@dataclasses.dataclass
class Settings:
    repeats: int = 5
    target_bytes: float | None = None  # None: BACKEND_DEFAULTS
    copy_min_bytes: int | None = None
    rotate_below_bytes: int | None = None
    k_min: int = 2
    k_max: int = 1000
    budget_s: float | None = None  # start no op after this many seconds (but the first point's)
    max_batch: int | None = None
    max_vocab: int | None = None
    profile: int = 0  # trace one more loop call of the first `profile` cases (device times)
    seed: int = P.SEED

    def resolved(self, backend: str) -> Settings:
        """These settings with the backend's defaults for the fields left None."""
        defaults = BACKEND_DEFAULTS["gpu" if backend == "gpu" else "cpu"]
        return dataclasses.replace(
            self, **{k: v for k, v in defaults.items() if getattr(self, k) is None}
        )


# `unique` sorts its ids: far more work than its bytes say, so fewer iterations.
K_MAX_OP = {"unique": 32}


def iters_for(nbytes: float, s: Settings, op: str | None = None) -> int:
    """K: loop iterations that move about `target_bytes`, within [k_min, k_max]."""
    k_max = min(s.k_max, K_MAX_OP.get(op, s.k_max))
    return int(min(max(round(s.target_bytes / max(nbytes, 1)), s.k_min), k_max))


def union_ns(intervals: Sequence[tuple[int, int]]) -> int:
    """Total length of the union of `(start, end)` intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def device_times(profile, module: str, iters: int, top: int = 6) -> dict | None:
    """From a `jax.profiler.ProfileData` of one loop call: the kernels' busy time on the
    GPU's streams (union of intervals) and the span of the XLA module `module` (a name
    prefix, e.g. `jit_loop_forward_embark`), both per iteration, and the `top` kernels by
    time. None when the trace has no GPU plane (a CPU run)."""
    planes = [pl for pl in profile.planes if pl.name.startswith("/device:GPU")]
    if not planes:
        return None
    busy = span = 0
    by_kernel: dict[str, int] = {}
    for plane in planes:
        lines = {ln.name: list(ln.events) for ln in plane.lines}
        key = module.removeprefix("jit_")
        mods = [e for e in lines.get("XLA Modules", []) if key in e.name]
        windows = [(e.start_ns, e.start_ns + e.duration_ns) for e in mods]
        kernels = [
            e
            for name, events in lines.items()
            if name.startswith("Stream")
            for e in events
            if not windows
            or any(a <= e.start_ns and e.start_ns + e.duration_ns <= b for a, b in windows)
        ]
        busy += union_ns([(e.start_ns, e.start_ns + e.duration_ns) for e in kernels])
        span += sum(b - a for a, b in windows)
        for e in kernels:
            by_kernel[e.name] = by_kernel.get(e.name, 0) + e.duration_ns
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "busy_s": busy / iters / 1e9,
        "span_s": span / iters / 1e9 if span else None,
        "kernels": [[name, ns / iters / 1e9] for name, ns in ranked],
    }


def _profile_call(compiled, state, aux, module: str, iters: int):
    """Runs one traced loop call; returns (new state, device times or None)."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            state = jax.block_until_ready(compiled(state, *aux))
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        times = device_times(ProfileData.from_file(paths[0]), module, iters) if paths else None
    return state, times


def time_case(case: LC.LoopCase, repeats: int, profile: bool = False) -> dict:
    """Compiles, warms up, samples and times one loop case; times are per iteration."""
    state = case.init()
    t0 = time.perf_counter()
    compiled = case.fn.lower(state, *case.aux).compile()
    compile_s = time.perf_counter() - t0
    copies = None
    if case.buffers:
        found = [f for f in hlo_scan.scan(compiled.as_text(), case.buffers) if f["copy"]]
        copies = hlo_scan.summary(found, limit=8)
    t0 = time.perf_counter()
    state = jax.block_until_ready(compiled(state, *case.aux))
    first_s = time.perf_counter() - t0
    sample = case.sample(state)
    loops = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(compiled(state, *case.aux))
        loops.append(time.perf_counter() - t0)
    out = {
        "iters": case.iters,
        "loop_s": loops,
        "compile_s": compile_s,
        "first_s": first_s,
        "hlo_copies": copies,
        "sample": sample,
    }
    if profile:
        try:
            module = f"jit_{case.fn.__name__}"
            state, out["device"] = _profile_call(compiled, state, case.aux, module, case.iters)
        except Exception as e:  # no profiler on this machine: the wall clock stands alone
            out["device"], out["profile_error"] = None, f"{type(e).__name__}: {e}"
    del state
    return out


class Run:
    """One loop-mode run: the JSON record and how it is filled."""

    def __init__(self, s: Settings, out: str | None, say=print):
        self.backend = jax.default_backend()
        self.s = s.resolved(self.backend)
        self.out, self.say = out, say
        self.t0 = time.perf_counter()
        self.copies: dict[int, dict] = {}
        self.traced = 0
        import jaxlib

        self.result = {
            "schema": SCHEMA,
            "mode": "loop",
            "backend": self.backend,
            "devices": str(jax.devices()[0]),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "settings": dataclasses.asdict(self.s),
            "copy_GBps": None,
            "checks_ok": True,
            "complete": False,
            "skipped": [],
            "points": [],
        }

    def over_budget(self) -> bool:
        b = self.s.budget_s
        return b is not None and time.perf_counter() - self.t0 > b

    def write(self) -> None:
        self.result["elapsed_s"] = time.perf_counter() - self.t0
        if self.out:
            with open(self.out, "w") as fh:
                json.dump(self.result, fh, indent=1)

    def copy_at(self, nbytes: int) -> dict:
        """The copy reference moving `nbytes` per iteration (at least `copy_min_bytes`),
        measured once per byte count in this run."""
        n = max(int(nbytes), self.s.copy_min_bytes)
        if n not in self.copies:
            k = iters_for(n, self.s)
            r = time_case(LC.copy_case(n, k), self.s.repeats)
            t = [x / k for x in r["loop_s"]]
            rec = {"bytes": n, "iters": k, "min_s": min(t), "median_s": statistics.median(t)}
            rec["GBps"] = n / rec["min_s"] / 1e9
            self.copies[n] = rec
            best = self.result["copy_GBps"] or 0.0
            self.result["copy_GBps"] = max(best, rec["GBps"])
        return self.copies[n]

    def point_record(self, p: P.Point, requested: P.Point, data, rotate: bool) -> dict:
        """The point's record, shared by tasks on the same point (ops are added to it)."""
        for pt in self.result["points"]:
            if pt["point"]["name"] == p.name:
                return pt
        info = p.to_json() | {"name": p.name, "label": p.label}
        info |= {"unique_rows": data.unique_rows, "capacity": data.capacity, "rotated": rotate}
        if requested != p:
            info["requested"] = requested.name
        pt = {"point": info}
        self.result["points"].append(pt)
        return pt

    def measure_op(self, op: str, data, rotate: bool) -> dict:
        p = data.point
        nbytes = P.op_bytes(op, p, data.unique_rows)
        k = iters_for(nbytes, self.s, op)
        libs, samples, errors = {}, {}, {}
        for lib in LC.LIBS:
            try:
                case = LC.BUILDERS[op](lib, data, k, rotate)
                trace = self.traced < self.s.profile
                self.traced += trace
                r = time_case(case, self.s.repeats, trace)
            except Exception as e:  # recorded; the other library and ops still run
                errors[lib] = f"{type(e).__name__}: {e}"
                continue
            samples[lib] = r.pop("sample")
            libs[lib] = report.summarize([t / k for t in r["loop_s"]], nbytes) | r
        copy = self.copy_at(nbytes)
        for r in libs.values():
            r["fraction_of_copy"] = r["GBps"] / copy["GBps"]
        rec = report.op_record(op, nbytes, libs, None, copy["GBps"])
        rec |= {"iters": k, "copy": copy, "errors": errors}
        rec["check"] = check(op, p.dtype, samples)
        return rec

    def run(self, tasks: Sequence[tuple[P.Point, Sequence[str]]]) -> dict:
        s = self.s
        self.result["settings"]["tasks"] = [[p.name, list(o)] for p, o in tasks]
        for requested, op_names in tasks:
            p = requested.capped(s.max_batch, s.max_vocab)
            first = not self.result["points"]  # the first point runs whole, whatever the budget
            if not first and self.over_budget():
                self.skip(p, op_names, "time budget spent")
                continue
            data = LC.PointData(p, s.seed)
            rotate = data.unique_rows * p.dim * p.elem_bytes <= s.rotate_below_bytes
            pt = self.point_record(p, requested, data, rotate)
            self.say(f"-- {p.name} (K per op: bytes / {s.target_bytes:.3g}; rotated: {rotate})")
            for i, op in enumerate(op_names):
                if not first and self.over_budget():
                    self.skip(p, op_names[i:], "time budget spent")
                    break
                if op == "backward_rowwise_adagrad":
                    data.drop_table()  # it updates fresh copies in place
                pt[op] = rec = self.measure_op(op, data, rotate)
                self.result["checks_ok"] &= all(c["ok"] for c in rec["check"].values())
                self.say(progress_line(op, rec))
                self.write()
            del data
        self.result["complete"] = not self.result["skipped"]
        self.write()
        return self.result

    def skip(self, p: P.Point, op_names, reason: str) -> None:
        for op in op_names:
            self.result["skipped"].append({"point": p.name, "op": op, "reason": reason})
        self.say(f"-- {p.name}: skipped {', '.join(op_names)} ({reason})")
        self.write()


def check(op: str, dtype: str, samples: dict) -> dict:
    """Ours against XLA's sample (XLA's own ops are the reference)."""
    ref = samples.get("xla")
    if ref is None:
        return {}
    rtol, atol = TOLERANCE.get((op, dtype), TOLERANCE[(op, "float32")])
    out = {}
    for lib, x in samples.items():
        same = x.shape == ref.shape
        err = float(np.max(np.abs(x - ref), initial=0.0)) if same else float("inf")
        out[lib] = {"max_abs_err": err, "ok": same and bool(np.allclose(x, ref, rtol, atol))}
    return out


def progress_line(op: str, rec: dict) -> str:
    parts = []
    for lib, r in rec["libs"].items():
        dev = r.get("device") or {}
        extra = f", device {dev['busy_s'] * 1e3:.3f} ms" if dev.get("busy_s") else ""
        parts.append(
            f"{lib} {r['min_s'] * 1e3:.3f}/{r['median_s'] * 1e3:.3f} ms {r['GBps']:.1f} GB/s "
            f"{100 * r['fraction_of_copy']:.0f}% of copy{extra}"
        )
    vs = rec["ratios"].get("xla")
    tail = f"  ours vs xla {vs['min']:.2f}x" if vs else ""
    bad = [k for k, c in rec["check"].items() if not c["ok"]]
    tail += f"  MISMATCH: {', '.join(bad)}" if bad else ""
    tail += "".join(f"  [{k}: {v}]" for k, v in rec["errors"].items())
    return f"   {op:25s} K={rec['iters']:<4d} " + " | ".join(parts) + tail


def headline(result: dict) -> list[dict]:
    """The target bar per measured (point, op): ours' fraction of the copy, the bar where
    one applies (forward 65% and fused backward + row-wise Adagrad 30% on the float32
    hotness-20 and -80 points), and ours vs XLA (>= 1.0 on every shape)."""
    rows = []
    for pt in result.get("points", []):
        info = pt["point"]
        for op in P.LOOP_OPS:
            rec = pt.get(op)
            if not rec or "embark" not in rec.get("libs", {}):
                continue
            frac = rec["libs"]["embark"]["fraction_of_copy"]
            bar = None
            if info.get("dtype", "float32") == "float32" and info["hotness"] in (20, 80):
                bar = {"forward": 0.65, "backward_rowwise_adagrad": 0.30}.get(op)
            vs = rec["ratios"].get("xla", {}).get("min")
            rows.append(
                {
                    "point": info["name"],
                    "label": info["label"],
                    "op": op,
                    "fraction_of_copy": frac,
                    "bar": bar,
                    "meets_bar": None if bar is None else frac >= bar,
                    "vs_xla": vs,
                    "meets_xla": None if vs is None else vs >= 1.0,
                }
            )
    return rows


def headline_table(result: dict) -> str:
    head = "| point | op | ours % of copy | bar | ours vs XLA |"
    lines = [head, "|---|---|---|---|---|"]
    for r in headline(result):
        bar = (
            "—"
            if r["bar"] is None
            else f"{100 * r['bar']:.0f}% " + ("met" if r["meets_bar"] else "missed")
        )
        vs = "—" if r["vs_xla"] is None else f"{r['vs_xla']:.2f}x"
        lines.append(
            f"| {r['label']} | {r['op']} | {100 * r['fraction_of_copy']:.1f}% | {bar} | {vs} |"
        )
    return "\n".join(lines)


def run(tasks, settings: Settings, out: str | None = None, say=print) -> dict:
    """Runs `tasks` (`[(Point, ops)]`) in loop mode; writes `out` after every op."""
    r = Run(settings, out, say)
    s = r.s
    say(
        f"loop mode on {r.result['devices']}: {s.repeats} timed calls per case, K = bytes per "
        f"call {s.target_bytes:.3g} / op bytes in [{s.k_min}, {s.k_max}]"
        + (f", shapes capped at batch {s.max_batch}, {s.max_vocab} rows" if s.max_batch else "")
    )
    result = r.run(tasks)
    if result["copy_GBps"]:
        say(f"copy reference: best {result['copy_GBps']:.1f} GB/s (read + write)")
    say("\n" + headline_table(result) + "\n")
    return result
